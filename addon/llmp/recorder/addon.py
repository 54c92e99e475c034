"""The mitmproxy addon: a thin shell of hooks around the pure recorder.

Every hook does O(1) work on the proxy's event loop: it notes times, keeps
references to bytes, and hands finished exchanges to the writer thread.
Nothing here may delay, change or drop a byte of the client's traffic (R7).

The live view (`llmp.live.view`) runs next to the record building, in the builder
child (`llmp.recorder.builder`); the addon only says which live view the options ask
for, and answers the reserved `/_llmp/` paths itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from typing import TYPE_CHECKING, Any

import orjson
from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy import server_hooks

from llmp.format.nouns import n_of
from llmp.live import contract as llmp_live
from llmp.recorder import options as llmp_options
from llmp.recorder.capture import Capture, now_ms, stream_tap
from llmp.recorder.errors import classify_error
from llmp.recorder.rotate import DailyFile
from llmp.recorder.writer import LiveSpec, RecordingError, RecordingFile, RecordWriter

if TYPE_CHECKING:
    from llmp.recorder.diagnose import Diagnosis

log = logging.getLogger("llmp")

READY = "llmp: recording to"
_STATE = "llmp"  # key in flow.metadata
_RESERVED = "llmp_reserved"  # flow.metadata key of a request for a /_llmp/ path
_REFUSED = "llmp_refused"  # flow.metadata key of a WebSocket upgrade answered 426
_DIAGNOSED = "llmp_diagnosed"  # flow.metadata key: the diagnosis remembers this request
_JSON = {"content-type": "application/json", "cache-control": "no-store"}
_RESERVED_PREFIX = llmp_live.RESERVED_PREFIX.encode()  # matched against the raw path


class Recorder:
    """Records every HTTP exchange as one llmp v1 record."""

    def __init__(self, *, raise_on_startup_error: bool = False) -> None:
        # Under mitmdump a bad option is logged as one line at error level, which
        # makes mitmdump exit 1 without a traceback; `llmp proxy` wants the
        # OptionsError itself. After startup, mitmproxy needs the OptionsError
        # to roll the change back.
        self.raise_on_startup_error = raise_on_startup_error
        self._running = False
        self.settings: llmp_options.Settings | None = None
        self.writer: RecordWriter | None = None
        self._live_key: tuple[object, ...] | None = None  # the live view's settings, or None
        self._last_id = 0
        self._conn_ids = itertools.count(1)
        self._conns: dict[str, int] = {}
        self._inflight: dict[int, Capture] = {}
        self._finished = False
        # Connect-timeout timers, and the client connections whose connect they gave up on.
        self._connect_timers: dict[str, asyncio.TimerHandle] = {}
        self._timed_out: set[str] = set()
        # The opt-in diagnosis (`llmp_diagnose`): its state and its one worker thread.
        self._diagnosis: Diagnosis | None = None
        self._diagnose_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- lifecycle ---------------------------------------------------------

    def load(self, loader: Any) -> None:
        for spec in llmp_options.OPTIONS:
            loader.add_option(spec.name, spec.type, spec.default, spec.help)

    def configure(self, updated: set[str]) -> None:
        if (
            self.settings is None
            or "termlog_verbosity" in updated  # the child's lines follow the terminal's level
            or any(name.startswith("llmp_") for name in updated)
        ):
            try:
                self._apply_settings()
            except exceptions.OptionsError as exc:
                if self._running or self.raise_on_startup_error:
                    raise
                log.error("llmp: %s", exc)
                return
        if ctx.options.connection_strategy != "lazy":
            # R13: in eager reverse mode a refused upstream makes no HTTP flow at
            # all; lazy connects per request, so every failure has a flow.
            ctx.options.update(connection_strategy="lazy")

    def _apply_settings(self) -> None:
        try:
            settings = llmp_options.validate(
                {spec.name: getattr(ctx.options, spec.name) for spec in llmp_options.OPTIONS}
            )
        except llmp_options.OptionError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        new_writer = self.settings is None or (settings.file, settings.rotate) != (
            self.settings.file,
            self.settings.rotate,
        )
        if new_writer:
            try:
                file = (
                    DailyFile(settings.file)
                    if settings.rotate == "daily"
                    else RecordingFile(settings.file)
                )
            except RecordingError as exc:
                raise exceptions.OptionsError(str(exc)) from None
            if self.writer is not None:
                self.writer.close()  # with its live view: its LLMP_SUMMARY ends its part
            self.writer = RecordWriter(file, settings.body)
            self._live_key = None
        elif self.writer is not None:
            self.writer.mode = settings.body
        assert self.writer is not None
        key = _live_key(settings)
        if key != self._live_key:
            try:
                self.writer.set_live(self._live_spec(settings))
            except llmp_live.LiveError as exc:
                self._live_key = None
                if new_writer and not self._running:
                    self.writer.file.discard()  # a start that failed leaves no empty file
                    self.writer.close()
                    self.writer = None
                raise exceptions.OptionsError(str(exc)) from None
            self._live_key = key
        self.settings = settings
        self._set_diagnosis(settings.diagnose)

    def _set_diagnosis(self, on: bool) -> None:
        """Start or stop the opt-in diagnosis; its module (and the APIs it parses with)
        is imported only when it is on."""
        if on and self._diagnosis is None:
            from llmp.recorder.diagnose import Diagnosis

            self._diagnosis = Diagnosis()
            self._diagnose_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="llmp-diagnose"
            )
        elif not on and self._diagnosis is not None:
            self._diagnosis = None
            if self._diagnose_pool is not None:
                self._diagnose_pool.shutdown(wait=False)
                self._diagnose_pool = None

    def _live_spec(self, s: llmp_options.Settings) -> LiveSpec | None:
        """The live view these settings ask for, from the next id on.

        Turned on while running: exchanges already in flight end after it
        started, and are left out (`reorder.late`).
        """
        if not s.live:
            return None
        cfg = llmp_live.LiveConfig(
            warn_ms=s.live_warn_ms,
            warn_tokens=s.live_warn_tokens,
            events=s.events,
            events_csv=s.events_csv,
            log_file=s.live_log,
            log_level=_terminal_level(),
        )
        return LiveSpec(cfg, first_id=self._last_id + 1)

    def running(self) -> None:
        self._running = True
        _quiet_legacy_log_events()
        s = self.settings
        if s is not None:
            log.info(
                "%s %s (%s mode, limit %d bytes, connect timeout %g s)",
                READY,
                self.writer.file.path if self.writer is not None else s.file,
                s.body,
                s.limit,
                s.connect_timeout,
            )
            if s.diagnose:
                log.info(
                    "llmp: diagnosis on (llmp_diagnose): requests to Anthropic and to OpenAI's "
                    "Responses API ask the provider why a turn missed its cache (request.added)"
                )
            if s.refuse_websockets:
                log.info("llmp: WebSocket upgrades to a chat API are answered 426, for HTTP")
            if s.live:
                log.info(
                    "llmp: live view on: a line per chat request, a warning above %s "
                    "or %s lost; summary at GET %s, Prometheus metrics at GET %s",
                    n_of(s.live_warn_tokens, "token"),
                    f"{s.live_warn_ms:,} ms",
                    llmp_live.SUMMARY_PATH,
                    llmp_live.METRICS_PATH,
                )

    def done(self) -> None:
        """Shutdown: in-flight exchanges are written as they stand (R13), then the file closes."""
        self._finished = True
        for timer in self._connect_timers.values():
            timer.cancel()
        self._set_diagnosis(False)
        if self.writer is None:
            return
        for cap in sorted(self._inflight.values(), key=lambda c: c.id):
            cap.cut_at_shutdown = True
            cap.set_error("upstream_reset")
            self._finish(cap)
        self._inflight.clear()
        self.writer.close()  # the live view's last lines come after the last record
        log.info("llmp: wrote %d records to %s", self.writer.written, self.writer.file.path)

    # -- connections -------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        self._conns[client.id] = next(self._conn_ids)

    def client_disconnected(self, client: connection.Client) -> None:
        self._conns.pop(client.id, None)

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """Start the connect timer: mitmproxy has none of its own (R13)."""
        if self.settings is None or data.server.error:
            return
        task = asyncio.current_task()
        if task is None:
            return
        loop = asyncio.get_running_loop()
        self._connect_timers[data.server.id] = loop.call_later(
            self.settings.connect_timeout, self._connect_timed_out, data, task
        )

    def _connect_timed_out(
        self, data: server_hooks.ServerConnectionHookData, task: asyncio.Task[Any]
    ) -> None:
        # The flow holds its own copy of the server connection, so the give-up
        # is remembered per client connection: HTTP/1 has one connect at a time.
        self._connect_timers.pop(data.server.id, None)
        self._timed_out.add(data.client.id)
        task.cancel()

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        timer = self._connect_timers.pop(data.server.id, None)
        if timer is not None:
            timer.cancel()

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.server_connected(data)

    # -- flows -------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self._finished:
            _refuse(flow)
            return
        req = flow.request
        data = req.data
        if data.path.startswith(_RESERVED_PREFIX):
            # Ours: answered in `request`, so it takes no id and makes no record.
            flow.metadata[_RESERVED] = True
            return
        if self.writer is None:
            return
        if self.settings is not None and self.settings.refuse_websockets and _chat_websocket(req):
            # Answered in `request`: a chat over a WebSocket would be no record at all.
            flow.metadata[_REFUSED] = True
            return
        self._last_id += 1
        # References only (the fields are an immutable tuple): the builder decodes
        # and filters them (`Capture.settle`), off the client's path.
        cap = Capture(
            id=self._last_id,
            conn=self._conns.get(flow.client_conn.id, 0),
            t_start_ms=int(data.timestamp_start * 1000),
            raw_method=data.method,
            raw_path=data.path,
            request_fields=data.headers.fields,
            upstream=data.host,  # reverse: the target's host; forward: the requested one
        )
        if self.settings is not None and self.settings.tokenize and data.method == b"POST":
            cap.tokenize = f"{req.scheme}://{req.host}:{req.port}"
        flow.metadata[_STATE] = cap
        self._inflight[cap.id] = cap

    async def request(self, flow: http.HTTPFlow) -> None:
        if self._finished:
            # mitmproxy still runs hooks while it tears connections down after
            # `done`; a request forwarded now would reach the server with no
            # record (its record, if any, was written in flight at `done`).
            _refuse(flow)
            return
        if flow.metadata.get(_RESERVED):
            flow.response = await self._reserved(flow.request.method, flow.request.path)
            return
        if flow.metadata.get(_REFUSED):
            flow.response = http.Response.make(
                426, b"llmp: send this over HTTP\n", {"content-type": "text/plain"}
            )
            return
        cap = flow.metadata.get(_STATE)
        if cap is None or self.settings is None:
            return
        body = flow.request.raw_content or b""
        cap.request_complete = True
        cap.request_body_bytes = len(body)
        if len(body) > self.settings.limit:
            cap.set_error("body_too_large")  # forwarded unchanged, stored as nothing (R12)
            cap.request_body = None
        else:
            cap.request_body = body  # the client's bytes: the record is of what it sent
            if self._diagnosis is not None and body:
                await self._diagnose(flow, cap, body)

    async def _diagnose(self, flow: http.HTTPFlow, cap: Capture, body: bytes) -> None:
        """R37: ask a provider for its own cache diagnosis, off the event loop.

        The request waits for this (it is what is sent), and only this: the parse
        and the rewrite run on the diagnosis's one worker thread.
        """
        from llmp.apis import api_name
        from llmp.apis.providers import provider_of_host
        from llmp.recorder import diagnose

        diagnosis, pool = self._diagnosis, self._diagnose_pool
        req = flow.request
        provider = provider_of_host(req.host)
        api = api_name(req.method, req.path)
        if (
            diagnosis is None
            or pool is None
            or provider is None
            or not diagnose.wants(provider, api)
        ):
            return
        encoding = req.headers.get("content-encoding")
        beta = req.headers.get_all(diagnose.BETA_HEADER)
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                pool, _diagnosed_body, diagnosis, cap.id, provider, api, body, encoding, beta
            )
        except Exception:  # never lose the request over it: it goes as the client sent it
            log.exception("llmp: the diagnosis of request %d failed; sent unchanged", cap.id)
            diagnosis.forget(cap.id)
            return
        if done is None:
            return
        raw, beta_values, added = done
        flow.metadata[_DIAGNOSED] = True
        if raw is not None:
            req.raw_content = raw
            if "transfer-encoding" not in req.headers:
                req.headers["content-length"] = str(len(raw))
        if beta_values is not None:
            req.headers.set_all(diagnose.BETA_HEADER, beta_values)
        cap.added = list(added) or None

    async def _reserved(self, method: str, path: str) -> http.Response:
        """The answer to a request for a /_llmp/ path; never forwarded upstream."""
        path = path.split("?", 1)[0]
        if path not in (llmp_live.SUMMARY_PATH, llmp_live.METRICS_PATH):
            return _json_response(
                404,
                {
                    "v": 1,
                    "error": f"no such llmp path; try GET {llmp_live.SUMMARY_PATH} "
                    f"or GET {llmp_live.METRICS_PATH}",
                },
            )
        if method != "GET":
            resp = _json_response(405, {"v": 1, "error": "use GET"})
            resp.headers["allow"] = "GET"
            return resp
        writer = self.writer
        if writer is None or self._live_key is None:
            return _json_response(404, {"v": 1, "error": "the live view is off (llmp_live)"})
        # Both come from the builder child (or the writer's thread): asked off the loop.
        if path == llmp_live.METRICS_PATH:
            answer = await asyncio.to_thread(writer.live_metrics)
            if answer is None:
                return _json_response(503, {"v": 1, "error": "the live view did not answer"})
            text, content_type = answer
            return http.Response.make(
                200, text, {"content-type": content_type, "cache-control": "no-store"}
            )
        summary = await asyncio.to_thread(writer.live_summary)
        if summary is None:
            return _json_response(503, {"v": 1, "error": "the live view did not answer"})
        return http.Response.make(200, summary, _JSON)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        cap = flow.metadata.get(_STATE)
        resp = flow.response
        if cap is None or resp is None or self.settings is None:
            return
        cap.status = resp.status_code
        cap.response_fields = resp.headers.fields  # filtered by the builder, like the request's
        # Stream every body through: never buffered, never held back (R7).
        resp.stream = stream_tap(cap, self.settings.limit)

    def response(self, flow: http.HTTPFlow) -> None:
        cap = flow.metadata.get(_STATE)
        if cap is None:
            return
        resp = flow.response
        if resp is not None and resp.stream is False and resp.raw_content:
            # A body mitmproxy buffered anyway (another addon turned streaming off).
            cap.add_piece(resp.raw_content, self.settings.limit if self.settings else 1 << 25)
        if flow.metadata.get(_DIAGNOSED) and self._diagnosis is not None:
            if resp is not None and 200 <= resp.status_code < 300:
                # Its id is read at the next provider request, on the worker thread.
                self._diagnosis.responded(cap.id, cap.pieces, resp.headers.get("content-encoding"))
            else:
                self._diagnosis.forget(cap.id)
        self._end(cap)

    def error(self, flow: http.HTTPFlow) -> None:
        cap = flow.metadata.get(_STATE)
        if cap is None:
            return
        msg = flow.error.msg if flow.error else ""
        if flow.metadata.get(_DIAGNOSED) and self._diagnosis is not None:
            self._diagnosis.forget(cap.id)
        if not cap.request_complete:
            # mitmproxy words a client that hangs up mid-body exactly like a
            # server that dies mid-body; only the client was sending then.
            cap.set_error("client_disconnected")
        timed_out = flow.client_conn.id in self._timed_out and cap.status is None
        self._timed_out.discard(flow.client_conn.id)
        cap.set_error(
            classify_error(msg, response_started=cap.status is not None, timed_out=timed_out)
        )
        self._end(cap)

    def _end(self, cap: Capture) -> None:
        if self._inflight.pop(cap.id, None) is None:
            return  # already written (at shutdown)
        if self._finished:
            return
        self._finish(cap)

    def _finish(self, cap: Capture) -> None:
        if cap.t_end_ms is None:
            cap.t_end_ms = now_ms()
        if self.writer is not None:
            self.writer.submit(cap)


def _chat_websocket(req: http.Request) -> bool:
    """A WebSocket upgrade to a chat API's path (Codex's Responses over a WebSocket)."""
    if req.headers.get("upgrade", "").lower() != "websocket":
        return False
    from llmp.apis import api_for

    return api_for("POST", req.path) is not None


def _diagnosed_body(
    diagnosis: Diagnosis,
    seq: int,
    provider: str,
    api: str,
    body: bytes,
    encoding: str | None,
    beta: list[str],
) -> tuple[bytes | None, list[str] | None, tuple[str, ...]] | None:
    """On the diagnosis's worker thread: the body to send (encoded as the client's was),
    the `anthropic-beta` values, and what was added; None: send it unchanged."""
    from mitmproxy.net import encoding as codec

    try:
        data = codec.decode(body, encoding) if encoding else body
    except ValueError:  # an encoding mitmproxy cannot undo: sent as it came
        return None
    if not isinstance(data, bytes):
        return None
    rewrite = diagnosis.request(seq, provider, api, data, beta)
    if rewrite is None:
        return None
    raw = rewrite.body
    if raw is not None and encoding:
        raw = codec.encode(raw, encoding)
    return raw, rewrite.beta, rewrite.added


def _refuse(flow: http.HTTPFlow) -> None:
    """Kill a flow that reached a hook after shutdown began: it is never forwarded."""
    if flow.killable:
        flow.kill()


def _live_key(s: llmp_options.Settings) -> tuple[object, ...] | None:
    """What a change of which restarts the live view."""
    if not s.live:
        return None
    return (
        s.live_warn_ms,
        s.live_warn_tokens,
        s.events,
        s.events_csv,
        s.live_log,
        _terminal_level(),
    )


def _terminal_level() -> int:
    """The level below which mitmproxy's terminal log drops lines (`termlog_verbosity`)."""
    name = getattr(ctx.options, "termlog_verbosity", "info")
    level = logging.getLevelName(str(name).upper())
    return level if isinstance(level, int) else logging.INFO


def _json_response(status: int, obj: dict[str, Any]) -> http.Response:
    return http.Response.make(status, orjson.dumps(obj), _JSON)


def _not_a_live_line(record: logging.LogRecord) -> bool:
    return not getattr(record, llmp_live.LINE_ATTR, False)


def _quiet_legacy_log_events() -> None:
    """Keep the live view's per-request lines off mitmproxy's deprecated `add_log` hook.

    mitmproxy hands every log record to the event loop once more, to call the
    `add_log` hook of every addon (deprecated since mitmproxy 9; no built-in
    addon uses it). For a line per request that is a cost on the client's
    path, for nothing: the terminal and standard logging handlers still get
    the line.
    """
    handler = getattr(ctx.master, "_legacy_log_events", None)
    if isinstance(handler, logging.Handler) and _not_a_live_line not in handler.filters:
        handler.addFilter(_not_a_live_line)
