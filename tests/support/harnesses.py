"""Real harnesses (Claude Code, Codex) for the tests that run them: where the
binary is, and the bare environment each runs in."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HARNESS_BIN_ENV = "LLMP_HARNESS_BIN"


def harness_bin(name: str, package: str, home: Path) -> Path:
    """`name` from $LLMP_HARNESS_BIN or PATH, checked to run (HOME `home`); else skip, saying why."""
    where = os.environ.get(HARNESS_BIN_ENV, "").strip()
    found: str | None = None
    if where:
        candidate = Path(where).expanduser() / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found = str(candidate)
    found = found or shutil.which(name)
    if found is None:
        pytest.skip(
            f"no {name}: {HARNESS_BIN_ENV}={where or '(unset)'} has none and none is on PATH; "
            f"install it with `npm install --prefix ~/.cache/llmp-harness/npm {package}` and "
            f"set {HARNESS_BIN_ENV}=~/.cache/llmp-harness/npm/node_modules/.bin (.ci/run does)"
        )
    try:
        done = subprocess.run(
            [found, "--version"],
            env=base_env(Path(found).parent, home),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{found} --version did not run: {exc}")
    if done.returncode != 0:
        text = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
        pytest.skip(f"{found} --version exited {done.returncode}: {text[-500:]}")
    print(f"{name}: {found} ({done.stdout.decode('utf-8', 'replace').strip()})")
    return Path(found)


def base_env(bin_dir: Path, home: Path) -> dict[str, str]:
    """An `env -i`-like environment: the harness's bin dir, node, system dirs, an isolated HOME."""
    path = [str(bin_dir)]
    node = shutil.which("node")
    if node:
        path.append(str(Path(node).parent))  # codex's launcher is a node script
    path += ["/usr/local/bin", "/usr/bin", "/bin"]
    env = {
        "PATH": ":".join(dict.fromkeys(path)),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env
