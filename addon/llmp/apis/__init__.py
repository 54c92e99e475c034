"""The chat APIs llmp knows, one module each, and the registry that picks one.

`api_for(method, path)` is the request's API (R6, R21), or None when it is
not a chat request (`OTHER`).  Adding an API is one module with a
`ChatApi` subclass, its tests, and one line in `APIS`.
"""

from __future__ import annotations

from typing import Any

from llmp.apis.anthropic_messages import AnthropicMessages
from llmp.apis.base import ChatApi, CountHints, Counts, Merger
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat
from llmp.apis.openai_responses import OpenAIResponses
from llmp.format.schema import NDJSON, SSE, RequestDigest, ResponseDigest

__all__ = [
    "APIS",
    "OTHER",
    "ChatApi",
    "CountHints",
    "Counts",
    "Merger",
    "api_by_name",
    "api_for",
    "api_name",
    "merger_for",
    "record_targets",
    "request_digest_of",
    "response_digest_of",
    "strip_query",
]

APIS: tuple[ChatApi, ...] = (
    OpenAIChat(),
    OllamaChat(),
    AnthropicMessages(),
    OpenAIResponses(),
)
"""Every chat API, in the order they are tried."""

OTHER = "other"
"""The `api` of a request that is no chat request."""

_BY_NAME = {api.name: api for api in APIS}
_DEFAULT_MERGER: dict[str, ChatApi] = {SSE: APIS[0], NDJSON: APIS[1]}


def strip_query(path: str) -> str:
    """The path without its query string or fragment."""
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    return path


def api_for(method: str, path: str) -> ChatApi | None:
    """The chat API of a request, or None when it is not a chat request."""
    if method.upper() != "POST":
        return None
    bare = strip_query(path)
    for api in APIS:
        if api.matches(method, bare):
            return api
    return None


def api_name(method: str, path: str) -> str:
    """`api_for`'s name, or `"other"`."""
    api = api_for(method, path)
    return OTHER if api is None else api.name


def api_by_name(name: str) -> ChatApi | None:
    return _BY_NAME.get(name)


def merger_for(api: ChatApi | None, kind: str) -> Merger:
    """The merger of a stream: the API's own, or the usual one for that framing."""
    if api is None or api.stream != kind:
        api = _DEFAULT_MERGER[kind]
    return api.merger()


def request_digest_of(request: dict[str, Any], api: ChatApi) -> RequestDigest | None:
    """A record's request digest: as recorded, or computed from its full body (R2).

    The one place a digest is taken of a full body, so that a full and a
    digest recording of the same traffic give the same facts.  May raise
    ValueError, TypeError or RecursionError on a hostile body.
    """
    digest = request.get("digest")
    if digest is None:
        body = request.get("body")
        if isinstance(body, dict):
            return api.request_digest(body)
        return None
    return digest if isinstance(digest, dict) else None  # type: ignore[return-value]


def response_digest_of(response: dict[str, Any], api: ChatApi) -> ResponseDigest | None:
    """A record's response digest: as recorded, or computed from its full body."""
    digest = response.get("digest")
    if digest is None:
        body = response.get("body")
        if isinstance(body, dict):
            return api.response_digest(body)
        return None
    return digest if isinstance(digest, dict) else None  # type: ignore[return-value]


def record_targets(record: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]] | None:
    """What `--tokenize` counts in a record (R18): `{hash: text}` of its messages
    and of its tools, or None when it has no full chat body."""
    request = record.get("request")
    if not isinstance(request, dict):
        return None
    method, path, body = request.get("method"), request.get("path"), request.get("body")
    if not isinstance(method, str) or not isinstance(path, str) or not isinstance(body, dict):
        return None
    api = api_for(method, path)
    return None if api is None else api.count_targets(body)
