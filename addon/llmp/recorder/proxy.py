"""`llmp proxy`: mitmproxy with the recorder, in one command.

Most users will never learn mitmproxy's options, so this runs mitmproxy's own
`DumpMaster` in this process with the very `Recorder` addon that
`mitmdump -s addon/llmp_addon.py` loads, and maps a few flags onto the shared
option names in `llmp.recorder.options.OPTIONS`. Both front ends therefore record the
same bytes the same way; only the defaults differ (loopback, a quiet console).

mitmproxy is imported only when the proxy starts, so other subcommands (and
`llmp --help`) don't pay for it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from llmp.live.contract import WARN_MS, WARN_TOKENS
from llmp.recorder import options as llmp_options

DEFAULT_LISTEN = "127.0.0.1:8081"
DEFAULT_CONFDIR = "~/.mitmproxy"  # mitmproxy's own default, so one CA serves both tools
CA_CERT = "mitmproxy-ca-cert.pem"
PROG = "llmp proxy"

#: The flag that sets each recorder option, to name it in error messages.
FLAG_FOR_OPTION: dict[str, str] = {
    "llmp_file": "--out",
    "llmp_body": "--full",
    "llmp_rotate": "--rotate",
    "llmp_limit": "--limit",
    "llmp_connect_timeout": "--connect-timeout",
    "llmp_tokenize": "--no-tokenize",
    "llmp_diagnose": "--diagnose",
    "llmp_refuse_websockets": "--refuse-websockets",
    "llmp_live": "--no-live",
    "llmp_live_warn_ms": "--warn-ms",
    "llmp_live_warn_tokens": "--warn-tokens",
    "llmp_events": "--events",
    "llmp_events_csv": "--events-csv",
    "llmp_live_log": "--live-log",
}

_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


class UsageError(Exception):
    """A bad flag value or an unusable setup; the message is the one-line reason."""


# -- parsing flags -----------------------------------------------------------


def parse_upstream(text: str) -> str:
    """`http://host:port` for the model server; a bare `host:port` means http.

    mitmproxy's reverse mode takes no path, and `/v1` is the usual slip, so it
    is refused with a hint rather than silently dropped.
    """
    raw = text.strip()
    if not raw:
        raise UsageError("--upstream is empty; give the model server, e.g. http://127.0.0.1:8080")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"--upstream {text!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"--upstream must be an http:// or https:// URL, not {text!r}")
    host = parts.hostname
    if not host:
        raise UsageError(f"--upstream {text!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        root = f"{parts.scheme}://{parts.netloc}"
        raise UsageError(
            f"--upstream takes the server's address without a path: use {root}, not {text!r}"
        )
    if parts.username or parts.password:
        raise UsageError("--upstream must not contain a user name or password")
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}" + (f":{port}" if port is not None else "")


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or just `PORT` (which stays on loopback); port 0 picks one."""
    raw = text.strip()
    host = "127.0.0.1"
    port_text = raw
    if not raw or (":" not in raw and not raw.isdigit()):
        raise UsageError(f"--listen {text!r} is not HOST:PORT (e.g. 127.0.0.1:8081)")
    if raw.startswith("["):
        inner, sep, rest = raw[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise UsageError(f"--listen {text!r} is not HOST:PORT (e.g. 127.0.0.1:8081)")
        host, port_text = inner, rest[1:]
    elif ":" in raw:
        host, _, port_text = raw.rpartition(":")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise UsageError(
            f"--listen {text!r}: the host must be an IP address (e.g. 127.0.0.1:8081)"
        ) from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"--listen {text!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): `32M`, `1048576`."""
    raw = text.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = raw, ""
    if raw and raw[-1] in _SIZE_UNITS:
        number, unit = raw[:-1], raw[-1]
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"--limit must be a number of bytes such as 32M, not {text!r}") from None
    if not math.isfinite(value) or int(value * _SIZE_UNITS[unit]) <= 0:
        raise UsageError(f"--limit must be a positive number of bytes, not {text!r}")
    return int(value * _SIZE_UNITS[unit])


def parse_seconds(text: str) -> float:
    """A number of seconds; range checks are the options table's job."""
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--connect-timeout must be a number of seconds, not {text!r}") from None


def parse_count(text: str, flag: str) -> int:
    """A whole number for a threshold flag; range checks are the options table's job."""
    try:
        return int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise UsageError(f"{flag} must be a whole number, not {text!r}") from None


def _flagify(message: str) -> str:
    """Name our flags instead of the mitmproxy option names in a shared error message."""
    # Longest first: llmp_live is the start of llmp_live_warn_ms.
    for name in sorted(FLAG_FOR_OPTION, key=len, reverse=True):
        message = message.replace(name, FLAG_FOR_OPTION[name])
    return message


def _url_host(host: str) -> str:
    """The host a client on this machine uses to reach a listener bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# -- configuration -----------------------------------------------------------


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `llmp proxy` was asked to do, checked."""

    upstream: str | None  # None in forward mode
    host: str
    port: int
    settings: llmp_options.Settings
    confdir: str
    verbose: bool = False
    allow_hosts: tuple[str, ...] = ()
    """Forward mode: mitmproxy's `allow_hosts` (patterns of `host:port`); only these
    hosts' TLS is read, every other connection is tunnelled as it is (`llmp run`)."""

    @property
    def forward(self) -> bool:
        return self.upstream is None

    @property
    def mode(self) -> str:
        return "regular" if self.upstream is None else f"reverse:{self.upstream}"

    @property
    def ca_cert(self) -> str:
        return os.path.join(self.confdir, CA_CERT)

    def recorder_options(self) -> dict[str, Any]:
        """The shared recorder options (`llmp.recorder.options.OPTIONS`) for these flags.

        Each value takes the type the table declares, as `--set` would give it:
        mitmproxy type-checks options, and has no float type of its own.
        """
        values = llmp_options.as_values(self.settings)
        return {spec.name: _as_type(spec.type, values[spec.name]) for spec in llmp_options.OPTIONS}


def _as_type(kind: type, value: Any) -> Any:
    """`value` as the option type `kind`; a float becomes its exact text."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return value
    if kind is str and isinstance(value, float):
        return repr(value)
    return kind(value)


def build_config(args: argparse.Namespace) -> ProxyConfig:
    """Check every flag, in plain Python, before mitmproxy is even imported."""
    if args.forward and args.upstream:
        raise UsageError("--forward and --upstream don't go together: pick one")
    if not args.forward and not args.upstream:
        raise UsageError("--upstream is required, e.g. --upstream http://127.0.0.1:8080")
    upstream = None if args.forward else parse_upstream(args.upstream)
    host, port = parse_listen(args.listen)
    out = args.out or llmp_options.default_file()
    values: dict[str, Any] = {
        "llmp_file": os.path.abspath(os.path.expanduser(out)),
        "llmp_body": "full" if args.full else "digest",
    }
    rotate = getattr(args, "rotate", None)  # `llmp proxy` only: `llmp run` reports one file
    if rotate:
        values["llmp_rotate"] = rotate
    if args.limit is not None:
        values["llmp_limit"] = parse_size(args.limit)
    if args.connect_timeout is not None:
        values["llmp_connect_timeout"] = parse_seconds(args.connect_timeout)
    values["llmp_live"] = not args.no_live
    values["llmp_tokenize"] = not args.no_tokenize
    values["llmp_diagnose"] = bool(getattr(args, "diagnose", False))
    values["llmp_refuse_websockets"] = bool(getattr(args, "refuse_websockets", False))
    if args.warn_ms is not None:
        values["llmp_live_warn_ms"] = parse_count(args.warn_ms, "--warn-ms")
    if args.warn_tokens is not None:
        values["llmp_live_warn_tokens"] = parse_count(args.warn_tokens, "--warn-tokens")
    for key, path in (
        ("llmp_events", args.events),
        ("llmp_events_csv", args.events_csv),
        ("llmp_live_log", args.live_log),
    ):
        if path:
            values[key] = os.path.abspath(os.path.expanduser(path))
    try:
        settings = llmp_options.validate(values)
    except llmp_options.OptionError as exc:
        raise UsageError(_flagify(str(exc))) from None
    if upstream is not None and port != 0:
        up = urlsplit(upstream)
        if up.port == port and up.hostname and (_is_loopback(up.hostname) or up.hostname == host):
            raise UsageError(f"--upstream {upstream} is this proxy's own address; it would loop")
    confdir = os.path.abspath(os.path.expanduser(args.confdir))
    return ProxyConfig(upstream, host, port, settings, confdir, bool(args.verbose))


def check_confdir(confdir: str) -> None:
    """Make sure mitmproxy can keep its CA in `confdir`.

    mitmproxy creates the CA there on first start, and a failure would only
    show up as a logged traceback.
    """
    try:
        os.makedirs(confdir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot use --confdir {confdir}: {exc.strerror or exc}") from None
    ca = os.path.join(confdir, CA_CERT)
    if not os.path.exists(ca) and not os.access(confdir, os.W_OK):
        raise UsageError(f"cannot use --confdir {confdir}: not writable, and it has no CA yet")
    if os.path.exists(ca) and not os.access(ca, os.R_OK):
        raise UsageError(f"cannot use --confdir {confdir}: {ca} is not readable")


def check_bindable(host: str, port: int) -> None:
    """Fail early, in one line, if the listen address is taken or not ours.

    mitmproxy would report it too, but as a logged error among others.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            shown = f"[{host}]" if ":" in host else host
            raise UsageError(f"cannot listen on {shown}:{port}: {exc.strerror or exc}") from None


# -- what the user sees ------------------------------------------------------


def banner_lines(cfg: ProxyConfig, port: int) -> list[str]:
    """The few lines printed once the proxy listens: where to point the client."""
    base = f"http://{_url_host(cfg.host)}:{port}"
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    s = cfg.settings
    lines: list[str] = []
    if cfg.upstream is not None:
        lines += [
            f"llmp proxy: {shown}:{port} -> {cfg.upstream}. Point your client here:",
            f"  OPENAI_BASE_URL={base}/v1",
            f"  ANTHROPIC_BASE_URL={base}",
            f"  OLLAMA_HOST={base}",
        ]
    else:
        lines += [
            f"llmp proxy: forward proxy on {shown}:{port}. Point your client here:",
            f"  HTTPS_PROXY={base}",
            f"  HTTP_PROXY={base}",
            f"HTTPS clients must trust mitmproxy's CA certificate {cfg.ca_cert}, e.g.:",
            f"  SSL_CERT_FILE={cfg.ca_cert}  (Python httpx/openai, curl, OpenSSL)",
            f"  REQUESTS_CA_BUNDLE={cfg.ca_cert}  (Python requests)",
            f"  NODE_EXTRA_CA_CERTS={cfg.ca_cert}  (Node.js)",
        ]
    if s.body == "full":
        what = "full bodies: prompts and replies are kept"
    else:
        what = "digest: hashes and counts, no message text; --full keeps bodies"
    lines.append(f"Recording to {s.file} ({what}).")
    if s.live:
        where = f"in {s.live_log}" if s.live_log else "below"
        lines.append(f"Live view: a line per chat request {where}; summary at {base}/_llmp/summary")
    if not _is_loopback(cfg.host):
        who = "as an open proxy" if cfg.forward else f"to reach {cfg.upstream}"
        lines.append(
            f"WARNING: listening on {shown}, not loopback: anyone who can reach this machine "
            f"can use it {who}, and their traffic is recorded. "
            "Use --listen 127.0.0.1:PORT to keep it local."
        )
    lines.append("Stop with Ctrl-C.")
    return lines


class Banner:
    """Prints the banner once the listener is up (so port 0 shows the real port)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.done_called = False

    def running(self) -> None:
        port = listening_port(self.cfg.port)
        print("\n".join(banner_lines(self.cfg, port)), flush=True)

    def done(self) -> None:
        self.done_called = True


# -- running -----------------------------------------------------------------


def _setup_logging(verbose: bool) -> None:
    """As mitmdump does; without --verbose, hide mitmproxy's per-connection lines."""
    logging.getLogger().setLevel(logging.DEBUG)
    for name in ("tornado", "asyncio", "hpack", "quic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet = logging.INFO if verbose else logging.WARNING
    for name in ("mitmproxy.proxy.server", "mitmproxy.proxy.mode_servers"):
        logging.getLogger(name).setLevel(quiet)


def make_master(cfg: ProxyConfig, *, termlog: bool = True, addons: tuple[Any, ...] = ()) -> Any:
    """mitmproxy's DumpMaster with the recorder and `addons`, configured for `cfg`.

    Returns `(master, recorder)`; raises `UsageError` with the recorder's one-line
    reason when it cannot start (a file in use, unwritable).  Must run in the loop.
    """
    from mitmproxy import exceptions, hooks
    from mitmproxy import options as mitm_options
    from mitmproxy.tools.dump import DumpMaster

    from llmp.recorder.addon import Recorder

    opts = mitm_options.Options()
    master = DumpMaster(opts, with_termlog=termlog, with_dumper=termlog)
    recorder = Recorder(raise_on_startup_error=True)
    try:
        opts.update(
            mode=[cfg.mode],
            listen_host=cfg.host,
            listen_port=cfg.port,
            confdir=cfg.confdir,
            # The recorder needs lazy connects (R13); setting it here saves it
            # from changing options inside its own configure.
            connection_strategy="lazy",
        )
        if cfg.allow_hosts:
            opts.update(allow_hosts=list(cfg.allow_hosts))
        if termlog:  # the dumper's option: it prints the flows to the terminal
            opts.update(flow_detail=1 if cfg.verbose else 0)
        # Not known until the recorder's `load` adds them: deferred, then
        # applied by mitmproxy as the addon registers.
        opts.update_defer(**cfg.recorder_options())
        master.addons.add(recorder, *addons)
        # Addons added after the options were set get their first configure
        # directly, as mitmproxy's script loader does; an OptionsError here
        # (a file in use, unwritable) is our one-line reason.
        master.addons.invoke_addon_sync(recorder, hooks.ConfigureHook(set(opts.keys())))
    except exceptions.OptionsError as exc:
        if recorder.writer is not None:
            recorder.writer.close()
        raise UsageError(_flagify(str(exc))) from None
    return master, recorder


def listening_port(default: int) -> int:
    """The port mitmproxy listens on (port 0 picks one): ask its proxyserver addon."""
    from mitmproxy import ctx

    ps = ctx.master.addons.get("proxyserver")
    addrs = ps.listen_addrs() if ps is not None else []
    return int(addrs[0][1]) if addrs else default


async def serve(cfg: ProxyConfig) -> int:
    """Run mitmproxy with the recorder until SIGINT or SIGTERM; return the exit code."""
    _setup_logging(cfg.verbose)
    banner = Banner(cfg)
    master, recorder = make_master(cfg, addons=(banner,))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        await master.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if not banner.done_called and recorder.writer is not None:
            recorder.writer.close()  # startup failed before `done`: release the file
    writer = recorder.writer
    return 1 if writer is not None and writer.failed else 0


def _run(args: argparse.Namespace) -> int:
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)  # a file or pipe sees each line as it happens
    try:
        cfg = build_config(args)
        check_bindable(cfg.host, cfg.port)
        check_confdir(cfg.confdir)
        return asyncio.run(serve(cfg))
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


def add_recorder_flags(parser: argparse.ArgumentParser) -> None:
    """The recorder's flags, shared by `llmp proxy` and `llmp run` (one table: `options`)."""
    parser.add_argument(
        "--out", metavar="FILE", help="the recording, appended to (default llmp-<date>.jsonl)"
    )
    parser.add_argument(
        "--full", action="store_true", help="keep request and response bodies (default: digests)"
    )
    parser.add_argument(
        "--limit",
        metavar="BYTES",
        help=f"bytes kept per body, e.g. 32M (default {llmp_options.LIMIT // llmp_options.MIB}M)",
    )
    parser.add_argument(
        "--connect-timeout",
        metavar="SECONDS",
        help="upstream connect timeout before recording `timeout` "
        f"(default {llmp_options.CONNECT_TIMEOUT})",
    )
    parser.add_argument(
        "--no-tokenize",
        action="store_true",
        help="do not ask the upstream's /tokenize for each new message's token count",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="ask Anthropic or OpenAI (GPT-5.6 and later) for their own cache diagnosis of "
        "each turn: adds a field naming the conversation's previous response (R37)",
    )
    parser.add_argument(
        "--refuse-websockets",
        action="store_true",
        help="answer a WebSocket upgrade to a chat API with 426, so the client (Codex) "
        "falls back to HTTP, which is recorded",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="no live view: no per-request lines, warnings or /_llmp/summary",
    )
    parser.add_argument(
        "--warn-ms",
        metavar="MS",
        help="warn when a turn re-processed more than this many ms it could have reused "
        f"(default {WARN_MS})",
    )
    parser.add_argument(
        "--warn-tokens",
        metavar="N",
        help=f"warn when a turn re-processed more than this many tokens (default {WARN_TOKENS})",
    )
    parser.add_argument(
        "--live-log",
        metavar="FILE",
        help="write the live view's per-request lines to FILE instead of the terminal",
    )
    parser.add_argument(
        "--events",
        metavar="FILE",
        help="append the live event stream (LLMP_TURN / LLMP_SUMMARY lines) to FILE",
    )
    parser.add_argument(
        "--events-csv",
        metavar="FILE",
        help="append one CSV row per analysed chat request to FILE (header row first)",
    )
    parser.add_argument(
        "--confdir",
        metavar="DIR",
        default=DEFAULT_CONFDIR,
        help=f"mitmproxy's directory for its CA certificate (default {DEFAULT_CONFDIR})",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="also show mitmproxy's per-request log"
    )


def register(sub: Any) -> None:
    """Add the `proxy` subcommand."""
    parser = sub.add_parser(
        "proxy",
        help="record traffic in front of a model server",
        description=(
            "Run a recording proxy in front of a model server (llama-server, Ollama, vLLM, "
            "any OpenAI-compatible server). Point the client at the printed address."
        ),
    )
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="the model server, e.g. http://127.0.0.1:8080 (required unless --forward)",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=DEFAULT_LISTEN,
        help=f"where clients connect (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    parser.add_argument(
        "--forward",
        action="store_true",
        help="forward proxy for HTTPS clients (HTTPS_PROXY) instead of --upstream",
    )
    parser.add_argument(
        "--rotate",
        choices=[r for r in llmp_options.ROTATIONS if r],
        help="'daily': start a new recording file each local day, its date in the name",
    )
    add_recorder_flags(parser)
    parser.set_defaults(handler=_run)
