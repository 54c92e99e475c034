"""`llmp run -- COMMAND`: record one harness session and explain it, in one command.

The recorder starts on a free loopback port (as `llmp proxy` does, with the
same options table), the command runs as a child with its base-URL
variables pointed at it, and when the child exits the recording is flushed
and the readable report printed to stderr.  The child keeps the terminal:
its stdin, stdout and stderr are ours, and it is in our process group, so a
Ctrl-C reaches it first, as in a shell; `llmp run` waits for it and then
reports.  The live view's lines and mitmproxy's own log go to a log file
beside the recording, never over the harness's screen (errors still reach
stderr).  See docs/proxy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmp.recorder import harness
from llmp.recorder import options as llmp_options
from llmp.recorder.proxy import (
    ProxyConfig,
    UsageError,
    add_recorder_flags,
    build_config,
    check_bindable,
    check_confdir,
    listening_port,
    make_master,
)

PROG = "llmp run"
DEFAULT_LISTEN = "127.0.0.1:0"

log = logging.getLogger("llmp")


def child_env(env: dict[str, str], upstream: str, proxy: str) -> dict[str, str]:
    """The child's environment: every base-URL variable pointed at the proxy.

    Any variable that already named the upstream (with or without a path after
    it, such as `/v1`, or OpenRouter's `/api/v1`) names the proxy instead, with
    the same path; `OPENAI_BASE_URL` (with `/v1`), `ANTHROPIC_BASE_URL` and
    `OLLAMA_HOST` are set where they did not.
    """
    out = dict(env)
    up = upstream.rstrip("/")
    named = set()
    for key, value in env.items():
        if value.rstrip("/") == up or value.startswith(up + "/"):
            out[key] = proxy + value[len(up) :]
            named.add(key)
    defaults = {"OPENAI_BASE_URL": f"{proxy}/v1", "ANTHROPIC_BASE_URL": proxy, "OLLAMA_HOST": proxy}
    out.update({k: v for k, v in defaults.items() if k not in named})
    out["LLMP_PROXY_URL"] = proxy
    return out


def live_log_for(recording: str) -> str:
    """`run.jsonl` → `run.live.log`: the live view's lines, beside the recording."""
    base = recording[: -len(".jsonl")] if recording.endswith(".jsonl") else recording
    return base + ".live.log"


def exit_code(returncode: int) -> int:
    """The child's exit code, as a shell gives it: 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def _setup_logging(log_file: str, verbose: bool) -> logging.Handler:
    """mitmproxy's log and ours to the log file; errors to stderr as well."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    for name in ("tornado", "asyncio", "hpack", "quic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet = logging.INFO if verbose else logging.WARNING
    for name in ("mitmproxy.proxy.server", "mitmproxy.proxy.mode_servers"):
        logging.getLogger(name).setLevel(quiet)
    fmt = logging.Formatter("[%(asctime)s.%(msecs)03d] %(message)s", "%H:%M:%S")
    os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # as the sink does
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(fmt)
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setLevel(logging.ERROR)
    to_stderr.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    root.addHandler(to_file)
    root.addHandler(to_stderr)
    return to_file


class _Ready:
    """An addon that learns the port once mitmproxy listens."""

    def __init__(self, default: int) -> None:
        self.default = default
        self.port: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def running(self) -> None:
        if not self.port.done():
            self.port.set_result(listening_port(self.default))


def _ca_bundle(plan: harness.Plan, ca_cert: str, where: str) -> str:
    """The CA file the harness is pointed at: mitmproxy's, with the ones it already
    trusted through the same variable (a company's CA) written beside it."""
    if not os.path.isfile(ca_cert):
        raise UsageError(f"mitmproxy's CA certificate {ca_cert} is missing")
    if not plan.ca_include:
        return ca_cert
    bundle = os.path.join(where, "ca-bundle.pem")
    with open(bundle, "wb") as out:
        for path in (*plan.ca_include, ca_cert):
            try:
                with open(path, "rb") as src:
                    out.write(src.read().rstrip(b"\n") + b"\n")
            except OSError as exc:
                raise UsageError(f"cannot read the CA file {path}: {exc.strerror or exc}") from None
    return bundle


async def _session(
    cfg: ProxyConfig, command: Sequence[str], plan: harness.Plan | None = None
) -> tuple[int, bool]:
    """Run the recorder and the child; the child's exit code, and whether it started."""
    ready = _Ready(cfg.port)
    master, recorder = make_master(cfg, termlog=False, addons=(ready,))
    loop = asyncio.get_running_loop()
    proxy_task = asyncio.ensure_future(master.run())
    started = False
    code = 0
    scratch = tempfile.TemporaryDirectory(prefix="llmp-run-")
    try:
        waiter = asyncio.ensure_future(asyncio.shield(ready.port))
        done, _ = await asyncio.wait({waiter, proxy_task}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            raise UsageError("the recording proxy stopped before it listened (see the log)")
        port = ready.port.result()
        proxy = f"http://127.0.0.1:{port}"
        argv = list(command)
        if plan is None:
            assert cfg.upstream is not None
            target = cfg.upstream
            env = child_env(dict(os.environ), cfg.upstream, proxy)
        else:
            target = plan.upstream
            bundle = None if plan.reverse else _ca_bundle(plan, cfg.ca_cert, scratch.name)
            env = harness.child_env(plan, os.environ, proxy, bundle)
            argv = harness.command_for(plan, command, proxy)
        print(
            f"{PROG}: {command[0]} through {proxy} -> {target}, recording to {cfg.settings.file}",
            file=sys.stderr,
            flush=True,
        )
        if plan is not None:
            print(f"{PROG}: {plan.describe()}", file=sys.stderr, flush=True)
        try:
            child = await asyncio.create_subprocess_exec(*argv, env=env)
        except OSError as exc:
            raise UsageError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
        started = True

        def forward(sig: int) -> None:
            # Ctrl-C reached the child from the terminal already (one process
            # group): wait for it. A signal sent to us alone goes on to it.
            if sig != signal.SIGINT and child.returncode is None:
                child.send_signal(sig)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, forward, sig)
        try:
            code = exit_code(await child.wait())
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
    finally:
        scratch.cleanup()
        master.shutdown()
        try:
            await proxy_task
        except Exception as exc:  # the proxy's own failure: the report still follows
            log.error("the recording proxy failed: %s", exc)
        writer = recorder.writer
        if writer is not None and writer.file.fd >= 0:
            writer.close()
        if not started and writer is not None:
            _discard_if_empty(cfg.settings.file, writer.file.created)
    return code, started


def _discard_if_empty(path: str, created: bool) -> None:
    """No empty recording is left behind by a session that never started."""
    try:
        if created and os.path.getsize(path) == 0:
            os.unlink(path)
    except OSError:
        pass


def _report(recording: str, since: int, html: Path | None) -> None:
    """The report of this session only: the bytes this run appended to the recording
    (it may hold earlier sessions), on stderr, and the page when asked."""
    import tempfile

    from llmp.analysis.command import explain

    with (
        open(recording, "rb") as src,
        tempfile.NamedTemporaryFile(prefix="llmp-run-", suffix=".jsonl") as part,
    ):
        src.seek(since)
        shutil.copyfileobj(src, part, 1 << 20)
        part.flush()
        explain([part.name], out=sys.stderr, html=html)


def _run(args: argparse.Namespace) -> int:
    command: list[str] = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(f"{PROG}: give the command to run after --, e.g. llmp run -- aider", file=sys.stderr)
        return 2
    if shutil.which(command[0]) is None:
        print(f"{PROG}: cannot start {command[0]}: command not found", file=sys.stderr)
        return 127
    html = Path(args.html) if args.html else None
    if html is not None and not html.resolve().parent.is_dir():
        print(f"{PROG}: --html {html}: no such directory", file=sys.stderr)
        return 2
    plan: harness.Plan | None = None
    if not args.upstream:
        try:
            plan = _plan(args, command)
        except UsageError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
    args.out = args.out or llmp_options.default_file()
    if args.live_log is None and not args.no_live:
        args.live_log = live_log_for(os.path.abspath(os.path.expanduser(args.out)))
    try:
        cfg = build_config(args)
        if plan is not None and not plan.reverse:
            hosts = tuple(harness.allow_pattern(h) for h in plan.allow_hosts)
            cfg = dataclasses.replace(cfg, allow_hosts=hosts)
        check_bindable(cfg.host, cfg.port)
        check_confdir(cfg.confdir)
        log_file = cfg.settings.live_log or live_log_for(cfg.settings.file)
        try:
            since = os.path.getsize(cfg.settings.file)  # the report is of what follows
        except OSError:
            since = 0
        handler = _setup_logging(log_file, cfg.verbose)
        try:
            code, started = asyncio.run(_session(cfg, command, plan))
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 127 if str(exc).startswith("cannot start") else 2
    if started:
        if cfg.settings.live:
            print(f"{PROG}: the live view's lines are in {log_file}", file=sys.stderr)
        try:
            _report(cfg.settings.file, since, html)
        except Exception:  # the analysis failed: the harness's exit code still stands
            import traceback

            traceback.print_exc(file=sys.stderr)
            print(
                f"{PROG}: the report failed; the recording is {cfg.settings.file}", file=sys.stderr
            )
    return code


def _read_text(path: str) -> str | None:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _plan(args: argparse.Namespace, command: Sequence[str]) -> harness.Plan:
    """Without --upstream: the harness's own provider (`harness.plan_for`), and the
    recorder's flags it needs; a `UsageError` when there is none."""
    try:
        plan = harness.plan_for(command, os.environ, _read_text)
    except harness.PlanError as exc:
        raise UsageError(str(exc)) from None
    if plan is None:
        raise UsageError(
            "--upstream is required, e.g. --upstream http://127.0.0.1:8080 "
            "(without it, llmp run records claude and codex against their own provider)"
        )
    if not plan.reverse:
        held = [name for name in harness.PROXY_VARS if os.environ.get(name)]
        if held:
            raise UsageError(
                f"{held[0]} is already set; llmp run would put its recorder in that proxy's "
                "place: unset it, or record with llmp proxy (docs/proxy.md)"
            )
    args.upstream = plan.root if plan.reverse else None
    args.forward = not plan.reverse
    args.refuse_websockets = args.refuse_websockets or plan.refuse_websockets
    if not (plan.reverse and plan.root.startswith("http://")):
        # A provider or a gateway has no /tokenize: message text goes nowhere else (R35).
        args.no_tokenize = True
    return plan


def register(sub: Any) -> None:
    """Add the `run` subcommand."""
    parser = sub.add_parser(
        "run",
        help="record one harness session and explain it: llmp run [--upstream URL] -- COMMAND",
        description=(
            "Start the recorder on a free loopback port, run COMMAND with its base-URL "
            "variables (OPENAI_BASE_URL, ANTHROPIC_BASE_URL, OLLAMA_HOST, and any variable "
            "set to the upstream) pointed at it, and when COMMAND exits, print the report of "
            "that session on stderr and exit with COMMAND's exit code. Without --upstream, "
            "claude and codex are recorded against their own provider (Anthropic's or "
            "OpenAI's API, a ChatGPT login, a configured base URL), their credentials "
            "untouched."
        ),
    )
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="the model server, e.g. http://127.0.0.1:8080 (claude and codex: by default "
        "their own provider)",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=DEFAULT_LISTEN,
        help=f"where the proxy listens (default {DEFAULT_LISTEN}: a free loopback port; "
        "give a fixed one for harnesses configured by file, such as Codex)",
    )
    parser.add_argument(
        "--html", metavar="FILE", help="also write the report as a self-contained page"
    )
    add_recorder_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS…]")
    parser.set_defaults(handler=_run, forward=False)
