"""Token counts from the server's own tokenizer: `llmp analyze --tokenize URL` (R18).

A full recording holds every message text, so the server that served it can
say exactly how many tokens each one is.  This module fills each full
record's `tokens` with those counts, keyed by message hash and tool hash, and
rewrites the recording in place.

Choices, and why:

- **What is counted.** A message is counted from its text (content plus the
  canonical JSON of its tool calls, R5), a tool from its canonical JSON.  Each
  is sent alone, so the chat template's own tokens (role headers, separators)
  are never part of a count.
- **`add_special: false`** keeps BOS/EOS out (R18).  **`parse_special: true`**
  matches how llama-server tokenises the rendered prompt: special-token text
  inside a message (a pasted `<|im_end|>`) is one token there, so it is one
  token here.  Counting texts one by one can still differ from the in-prompt
  count by a token at a boundary, where a tokenizer could merge across it.
- **Each server's own request.** llama-server's `/tokenize` takes `{"content"}`
  (`CONTENT`); vLLM's and SGLang's take `{"prompt"}` with `add_special_tokens:
  false` (`PROMPT`; their Hugging Face tokenizers parse special-token text as
  llama-server does with `parse_special`), and no model, so each counts with the
  one it serves.  Both answer `{"tokens": [...]}`.  A `Tokenizer` told no shape
  tries llama-server's first and, when the server refuses that request (HTTP
  400 or 422: vLLM and SGLang want a prompt), vLLM's, once.
- **Once per distinct text.** Hashes are collected over the whole file first;
  each distinct non-empty text is sent once, even when several hashes share
  it.  Empty text counts 0 without a request.
- **Re-counting.** A record that already has `tokens` is counted again and
  its `tokens` overwritten: the server named by the URL is the authority.
- **Every other byte is kept.** Only the value of the top-level `tokens` key
  of an enriched line changes: it is spliced into the original line text, so
  key order, number text and escaping stay as they were.  Digest records,
  bad lines, blank lines and a last line without a newline are copied as is.
  Only if a line cannot be spliced safely (a repeated `tokens` key) is that
  one record re-serialised, still keeping its number text (R2).
- **Nothing is written until everything is counted.** The new file is an
  anonymous `O_TMPFILE` where the platform has it (a killed process leaves
  nothing behind), otherwise a hidden temporary beside the original, removed
  on any exception.  It gets the original's mode, is fsynced, then renamed
  over the original, and the directory is fsynced.  A kill at any moment
  leaves either the old file or the complete new one.  SIGTERM is turned
  into `SystemExit` while enriching so the clean-up runs.
- **No concurrent recorder.** The recorder holds an exclusive `flock` on its
  file; enriching takes the same lock and refuses a file in use, since lines
  appended during the run would be lost by the rename.
- **Failures are fast and clear.** A server without `/tokenize` (Ollama), a
  refused connection, a digest-only recording, a missing file: one line of
  `TokenizeError`, and the file is untouched.  Resets, timeouts and 5xx are
  retried with exponential backoff.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import re
import secrets
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import orjson

from llmp.format import canonical
from llmp.format.nouns import n_of
from llmp.format.tokenize_shapes import CONTENT, PROMPT

__all__ = [
    "CONTENT",
    "PROMPT",
    "EnrichResult",
    "Targets",
    "TokenizeError",
    "Tokenizer",
    "enrich_file",
    "normalize_url",
    "tokenize_payload",
]


class TokenizeError(Exception):
    """Enriching failed; the message is one line for the user, the file is untouched."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing
        """The server has no tokenize endpoint at all (asking again is pointless)."""


@dataclass(frozen=True)
class EnrichResult:
    """What an enrichment did, for the command's summary line."""

    path: Path
    url: str
    records: int
    """Lines that are version-1 records."""
    records_enriched: int
    """Full chat records whose `tokens` were (re)written."""
    skipped_digest_records: int
    """Records in digest mode: no text, nothing to count."""
    skipped_other_records: int
    """Other records without a chat body (non-chat paths, `body_text`, too large)."""
    bad_lines: int
    """Non-blank lines that are not version-1 records; copied unchanged."""
    distinct_messages: int
    distinct_tools: int
    distinct_texts: int
    """Distinct non-empty texts sent to the server (each exactly once)."""
    requests: int
    """HTTP requests made, retries included."""
    retries: int

    def summary(self) -> str:
        """One line for the user."""
        return (
            f"tokenized {n_of(self.distinct_texts, 'distinct text')} "
            f"({n_of(self.distinct_messages, 'message')}, {n_of(self.distinct_tools, 'tool')}) "
            f"with {n_of(self.requests, 'request')}; "
            f"enriched {n_of(self.records_enriched, 'record')} in {self.path}"
            + (
                f"; skipped {n_of(self.skipped_digest_records, 'digest record')}"
                if self.skipped_digest_records
                else ""
            )
        )


# --------------------------------------------------------------------------- targets


Targets = Callable[[dict[str, Any]], "tuple[dict[str, str], dict[str, str]] | None"]
"""What a record asks to count (`{hash: text}` for its messages and its tools),
or None when it has no full chat body; `llmp.apis.record_targets`."""


def _is_v1(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    v = record.get("v")
    return isinstance(v, int) and not isinstance(v, bool) and v == 1


def _is_digest(record: dict[str, Any]) -> bool:
    request = record.get("request")
    return isinstance(request, dict) and request.get("digest") is not None


# --------------------------------------------------------------------------- splicing

_WS_RE = re.compile(rb"[ \t\r\n]*")
_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRUCT_RE = re.compile(rb'["{}\[\]]')
_SCALAR_RE = re.compile(rb"[-+.0-9A-Za-z]+")


class _ScanError(ValueError):
    """The line is not laid out the way the scanner expects; re-serialise instead."""


def _ws(line: bytes, pos: int) -> int:
    match = _WS_RE.match(line, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _skip_value(line: bytes, pos: int) -> int:
    """The end of the JSON value starting at `pos`, without parsing it."""
    head = line[pos : pos + 1]
    if head == b'"':
        match = _STRING_RE.match(line, pos)
        if match is None:
            raise _ScanError("unterminated string")
        return match.end()
    if head in (b"{", b"["):
        depth = 0
        cursor = pos
        while True:
            found = _STRUCT_RE.search(line, cursor)
            if found is None:
                raise _ScanError("unterminated container")
            char = found.group()
            if char == b'"':
                string = _STRING_RE.match(line, found.start())
                if string is None:
                    raise _ScanError("unterminated string")
                cursor = string.end()
                continue
            cursor = found.end()
            if char in (b"{", b"["):
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return cursor
    scalar = _SCALAR_RE.match(line, pos)
    if scalar is None:
        raise _ScanError(f"unexpected byte at {pos}")
    return scalar.end()


def _splice_tokens(line: bytes, value: bytes) -> bytes:
    """The line with its top-level `tokens` value replaced by `value`, all else kept.

    Walks the top-level members only, skipping values by their brackets and
    strings, so a `"tokens"` inside a message or a string is never touched.
    A record without `tokens` gets it appended as the last key.
    """
    pos = _ws(line, 0)
    if line[pos : pos + 1] != b"{":
        raise _ScanError("not an object")
    pos = _ws(line, pos + 1)
    spans: list[tuple[int, int]] = []
    if line[pos : pos + 1] == b"}":
        close = pos
        empty = True
    else:
        empty = False
        while True:
            key = _STRING_RE.match(line, pos)
            if key is None:
                raise _ScanError("expected a key")
            raw_key = key.group()
            try:
                name = orjson.loads(raw_key) if b"\\" in raw_key else raw_key[1:-1].decode()
            except (orjson.JSONDecodeError, UnicodeDecodeError):
                raise _ScanError("undecodable key") from None
            pos = _ws(line, key.end())
            if line[pos : pos + 1] != b":":
                raise _ScanError("expected ':'")
            start = _ws(line, pos + 1)
            end = _skip_value(line, start)
            if name == "tokens":
                spans.append((start, end))
            pos = _ws(line, end)
            sep = line[pos : pos + 1]
            if sep == b",":
                pos = _ws(line, pos + 1)
                continue
            if sep == b"}":
                close = pos
                break
            raise _ScanError("expected ',' or '}'")
    if _ws(line, close + 1) != len(line):
        raise _ScanError("trailing bytes after the record")
    if len(spans) > 1:
        raise _ScanError("repeated 'tokens' key")
    if spans:
        start, end = spans[0]
        return line[:start] + value + line[end:]
    member = b'"tokens":' + value
    return line[:close] + (member if empty else b"," + member) + line[close:]


def _rewrite_line(line: bytes, value: bytes, tokens: dict[str, Any]) -> bytes:
    """Splice `tokens` in; if the layout defeats the scanner, re-serialise this one record."""
    try:
        return _splice_tokens(line, value)
    except _ScanError:
        body = line.rstrip(b"\r\n")
        ending = line[len(body) :]
        record = canonical.loads(body)
        record["tokens"] = tokens
        return canonical.record_dumps(record) + ending


# --------------------------------------------------------------------------- server


def normalize_url(url: str) -> str:
    """The server's base URL: scheme added if missing, trailing `/`, `/v1`, `/tokenize` cut."""
    text = url.strip()
    if not text:
        raise TokenizeError(
            "no tokenize URL given; pass the llama-server base URL, e.g. http://127.0.0.1:8080"
        )
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TokenizeError(f"not an http(s) URL: {url!r}; expected e.g. http://127.0.0.1:8080")
    path = parts.path.rstrip("/")
    for suffix in ("/tokenize", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)].rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def tokenize_payload(text: str, shape: str = CONTENT) -> bytes:
    """The `/tokenize` request body for one text in a server's own shape (see the module
    docstring for the flags)."""
    if shape == PROMPT:
        return orjson.dumps({"prompt": text, "add_special_tokens": False})
    return orjson.dumps(
        {"content": text, "add_special": False, "parse_special": True, "with_pieces": False}
    )


class _Stopped(Exception):
    """Another worker failed or the run was interrupted; stop quietly."""


class _Refused(TokenizeError):
    """The server refused llama-server's request shape (it may want vLLM's)."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class Tokenizer:
    """One server, one connection pool, shared by the worker threads."""

    def __init__(
        self,
        base: str,
        *,
        timeout: float,
        retries: int,
        backoff: float,
        pool: int,
        shape: str | None = None,
    ) -> None:
        self.base = base
        self.endpoint = f"{base}/tokenize"
        self.shape = shape
        """The request's shape (`CONTENT`, `PROMPT`); None: llama-server's, then vLLM's
        when the server refuses it (found on the first text, which is sent alone)."""
        self.retries = max(0, retries)
        self.backoff = backoff
        self.stop = threading.Event()
        self.requests = 0
        self.retried = 0
        self._lock = threading.Lock()
        self.client = httpx.Client(
            timeout=timeout,
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            headers={"content-type": "application/json", "accept": "application/json"},
        )

    def close(self) -> None:
        self.stop.set()
        self.client.close()

    def _post(self, payload: bytes) -> httpx.Response:
        with self._lock:
            self.requests += 1
        return self.client.post(self.endpoint, content=payload)

    def count(self, text: str) -> int:
        """Tokens in `text`, retrying transient failures; `TokenizeError` on the others."""
        if self.shape is not None:
            return self._count(text, self.shape)
        try:
            n = self._count(text, CONTENT)
        except _Refused:
            n = self._count(text, PROMPT)
            self.shape = PROMPT
            return n
        self.shape = CONTENT
        return n

    def _count(self, text: str, shape: str) -> int:
        payload = tokenize_payload(text, shape)
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                if self.stop.wait(self.backoff * (2 ** (attempt - 1))):
                    raise _Stopped
            if self.stop.is_set():
                raise _Stopped
            try:
                response = self._post(payload)
            except httpx.ConnectError as exc:
                raise TokenizeError(
                    f"cannot connect to {self.base} ({_reason(exc)}): "
                    "is llama-server running there?"
                ) from None
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last = f"{type(exc).__name__}: {_reason(exc)}"
                continue
            status = response.status_code
            if status in (404, 405, 501):
                raise TokenizeError(
                    f"{self.base} has no tokenize endpoint (POST /tokenize gave HTTP {status}); "
                    "Ollama has none: point --tokenize at a llama-server",
                    missing=True,
                )
            if status >= 500 or status in (408, 429):
                last = f"HTTP {status}"
                continue
            if status != 200:
                snippet = response.text.strip().replace("\n", " ")[:200]
                message = f"{self.endpoint} answered HTTP {status}: {snippet}"
                if self.shape is None and shape == CONTENT and status in (400, 422):
                    raise _Refused(message)  # maybe vLLM's or SGLang's: try their shape
                raise TokenizeError(message)
            try:
                data = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                data = None
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list):
                raise TokenizeError(
                    f"{self.endpoint} did not answer like a /tokenize of llama-server, vLLM "
                    "or SGLang (no 'tokens' list in the reply)"
                )
            return len(tokens)
        raise TokenizeError(
            f"{self.endpoint} kept failing after {self.retries + 1} attempts (last: {last})"
        )


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr; yields the function that advances it."""
    if not enabled or total == 0:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("counting tokens"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    with bar:
        task = bar.add_task("tokenize", total=total)
        yield lambda: bar.advance(task)


def _count_all(
    tok: Tokenizer, texts: list[str], concurrency: int, advance: Callable[[], None]
) -> dict[str, int]:
    """Count every text, at most `concurrency` requests in flight.

    The first text is sent alone, so a wrong URL fails once and clearly
    instead of `concurrency` times.  Workers are daemon threads: an
    interrupted run does not wait for their requests to end.
    """
    counts: dict[str, int] = {}
    if not texts:
        return counts
    counts[texts[0]] = tok.count(texts[0])
    advance()
    rest = texts[1:]
    if not rest:
        return counts
    work: queue.SimpleQueue[str] = queue.SimpleQueue()
    for text in rest:
        work.put(text)
    done: queue.SimpleQueue[tuple[str, int | BaseException]] = queue.SimpleQueue()

    def worker() -> None:
        while not tok.stop.is_set():
            try:
                text = work.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((text, tok.count(text)))
            except BaseException as exc:  # handed to the main thread, which re-raises
                done.put((text, exc))
                return

    for index in range(min(concurrency, len(rest))):
        threading.Thread(target=worker, name=f"llmp-tokenize-{index}", daemon=True).start()
    try:
        for _ in range(len(rest)):
            text, result = done.get()
            if isinstance(result, BaseException):
                raise result
            counts[text] = result
            advance()
    finally:
        tok.stop.set()
    return counts


# --------------------------------------------------------------------------- files


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While enriching, SIGTERM raises SystemExit so the clean-up runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_USE_O_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


class _TempFile:
    """The new recording, invisible until `publish` renames it over the original."""

    def __init__(self, target: Path, st: os.stat_result) -> None:
        self.target = target
        self.directory = target.parent
        self.name: Path | None = None
        self.fd = -1
        mode = stat.S_IMODE(st.st_mode)
        if _USE_O_TMPFILE:
            try:
                self.fd = os.open(self.directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise
        while self.fd < 0:
            name = self._fresh_name()
            try:
                self.fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            self.name = name
        try:
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(self.fd, st.st_uid, st.st_gid)
                except OSError:
                    pass  # not ours to give away; keep our ownership
            os.fchmod(self.fd, mode)
        except BaseException:
            self.discard()
            raise

    def _fresh_name(self) -> Path:
        return self.directory / f".{self.target.name}.{secrets.token_hex(4)}.tokenize.tmp"

    def writer(self) -> IO[bytes]:
        return open(self.fd, "wb", buffering=1 << 20, closefd=False)

    def publish(self) -> None:
        """fsync, give it a name if it has none, rename it over the target, fsync the dir."""
        os.fsync(self.fd)
        if self.name is None:
            # A directory fd makes os.link use linkat(AT_SYMLINK_FOLLOW), which
            # links the anonymous file itself; plain link() would fail (EXDEV).
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                while True:
                    name = self._fresh_name()
                    try:
                        os.link(f"/proc/self/fd/{self.fd}", name.name, dst_dir_fd=dir_fd)
                    except FileExistsError:
                        continue
                    self.name = name
                    break
            finally:
                os.close(dir_fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.name, self.target)
        self.name = None
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass  # the rename is done; only its durability on power loss is in doubt
        finally:
            os.close(dir_fd)

    def discard(self) -> None:
        """Remove every trace of the new file; safe to call twice."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.name is not None:
            try:
                os.unlink(self.name)
            except FileNotFoundError:
                pass
            self.name = None


def _open_recording(path: Path) -> IO[bytes]:
    try:
        src = open(path, "rb")
    except FileNotFoundError:
        raise TokenizeError(f"no such recording: {path}") from None
    except IsADirectoryError:
        raise TokenizeError(f"{path} is a directory, not a recording") from None
    except OSError as exc:
        raise TokenizeError(f"cannot open recording {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise TokenizeError(
                f"{path} is not a regular file; only a recording file can be enriched"
            )
        fcntl.flock(src.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        src.close()
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise TokenizeError(
                f"recording {path} is in use by a running recorder (or another --tokenize); "
                "stop the proxy first"
            ) from None
        raise TokenizeError(f"cannot lock recording {path}: {exc.strerror}") from None
    except BaseException:
        src.close()
        raise
    return src


@dataclass
class _Scan:
    """Pass one: what each line needs, and every text to count."""

    plans: dict[int, tuple[list[str], list[str]]]
    messages: dict[str, str]
    tools: dict[str, str]
    lines: int = 0
    records: int = 0
    digest_records: int = 0
    other_records: int = 0
    bad_lines: int = 0


def _scan(src: IO[bytes], targets: Targets) -> _Scan:
    result = _Scan(plans={}, messages={}, tools={})
    for index, line in enumerate(src):
        result.lines = index + 1
        if not line.strip():
            continue
        try:
            record = canonical.loads(line)
        except canonical.NotJSON:
            result.bad_lines += 1
            continue
        if not _is_v1(record):
            result.bad_lines += 1
            continue
        result.records += 1
        found = targets(record)
        if found is None:
            if _is_digest(record):
                result.digest_records += 1
            else:
                result.other_records += 1
            continue
        messages, tools = found
        for key, text in messages.items():
            result.messages.setdefault(key, text)
        for key, text in tools.items():
            result.tools.setdefault(key, text)
        result.plans[index] = (list(messages), list(tools))
    return result


def _write_new(src: IO[bytes], out: IO[bytes], scan: _Scan, counts: dict[str, int]) -> None:
    """Pass two: copy every line, splicing `tokens` into the planned ones."""

    def count_of(text: str) -> int:
        return counts[text] if text else 0

    src.seek(0)
    seen = 0
    for index, line in enumerate(src):
        seen = index + 1
        plan = scan.plans.get(index)
        if plan is None:
            out.write(line)
            continue
        message_keys, tool_keys = plan
        tokens = {
            "messages": {key: count_of(scan.messages[key]) for key in message_keys},
            "tools": {key: count_of(scan.tools[key]) for key in tool_keys},
        }
        out.write(_rewrite_line(line, canonical.record_dumps(tokens), tokens))
    if seen != scan.lines:
        raise TokenizeError(
            "the recording changed while it was being enriched; nothing was written"
        )


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (
        b.st_dev,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
    )


def enrich_file(
    path: Path,
    url: str,
    *,
    targets: Targets,
    concurrency: int = 4,
    progress: bool | None = None,
    timeout: float = 30.0,
    retries: int = 3,
    backoff: float = 0.5,
) -> EnrichResult:
    """Fill `tokens` of every full record in `path` from `url`'s `/tokenize`, in place.

    `progress=None` shows a bar when stderr is a terminal.  `retries` extra
    attempts follow a transient failure, `backoff`, then twice that, and so
    on, seconds apart.  Raises `TokenizeError` (file untouched) on failure;
    an interrupt (KeyboardInterrupt, SIGTERM) also leaves it untouched.
    """
    if concurrency < 1:
        raise TokenizeError(f"concurrency must be at least 1, not {concurrency}")
    base = normalize_url(url)
    target = Path(os.path.realpath(path))
    with _sigterm_as_exit():
        src = _open_recording(target)
        with src:
            initial = os.fstat(src.fileno())
            scan = _scan(src, targets)
            if not scan.plans:
                raise TokenizeError(
                    f"nothing to count in {path}: no full chat records "
                    f"({scan.digest_records} digest, {scan.other_records} other, "
                    f"{scan.bad_lines} bad lines); "
                    "only full recordings (llmp_body=full) can be enriched"
                )
            texts = list(
                dict.fromkeys(t for t in (*scan.messages.values(), *scan.tools.values()) if t)
            )
            tok = Tokenizer(
                base, timeout=timeout, retries=retries, backoff=backoff, pool=concurrency
            )
            try:
                bar = _progress_bar(len(texts), _show_progress(progress))
                with bar as advance:
                    counts = _count_all(tok, texts, concurrency, advance)
            finally:
                tok.close()
            temp = _TempFile(target, initial)
            try:
                with temp.writer() as out:
                    _write_new(src, out, scan, counts)
                try:
                    now = os.stat(target)
                except FileNotFoundError:
                    now = None
                if now is None or not _same_file(initial, now):
                    raise TokenizeError(
                        f"{path} changed while it was being enriched; nothing was written"
                    )
                temp.publish()
            finally:
                temp.discard()
    return EnrichResult(
        path=Path(path),
        url=base,
        records=scan.records,
        records_enriched=len(scan.plans),
        skipped_digest_records=scan.digest_records,
        skipped_other_records=scan.other_records,
        bad_lines=scan.bad_lines,
        distinct_messages=len(scan.messages),
        distinct_tools=len(scan.tools),
        distinct_texts=len(texts),
        requests=tok.requests,
        retries=tok.retried,
    )
