"""A response's counters as the report's Counts: the API's own, then the proxy's clock.

Each API module reads its server's counters (`ChatApi.counts`); what is
left unmeasured and can be timed by the proxy is filled in here, with
source `proxy` (docs/analysis.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmp.apis import ChatApi
from llmp.apis.base import CountHints, Counts
from llmp.apis.openai_chat import openai_counts
from llmp.format.fastread import LlamaTop
from llmp.format.measure import MV, PROXY

if TYPE_CHECKING:
    from llmp.analysis.exchange import Exchange


@dataclass(slots=True)
class Timing:
    """The proxy's own clock for one exchange."""

    t_start: int
    t_first_byte: int | None
    t_end: int
    streamed: bool
    t_first_event: int | None = None


def _proxy_times(counts: Counts, timing: Timing | None) -> None:
    """Without server timings, a streamed response's first event marks the end
    of prefill, as well as the proxy can tell (R28).  Its first byte would not:
    a keep-alive comment can come long before.  Recordings made before R28
    have only the first byte."""
    if timing is None or not timing.streamed:
        return
    first = timing.t_first_event if timing.t_first_event is not None else timing.t_first_byte
    if first is None:
        return
    if counts.prefill_ms is None:
        counts.prefill_ms = (float(max(0, first - timing.t_start)), PROXY)
    if counts.decode_ms is None:
        counts.decode_ms = (float(max(0, timing.t_end - first)), PROXY)


def counts_for(
    api: ChatApi, top: dict[str, Any] | None, timing: Timing | None, hints: CountHints
) -> Counts:
    """The Counts of one response."""
    c = Counts() if top is None else api.counts(top, hints)
    _proxy_times(c, timing)
    return c


def exchange_counts(
    ex: Exchange, estimated_prompt: MV, evaluated_share: float, known_old: bool
) -> Counts:
    """`counts_for` of an Exchange, the proxy's clock read from it directly (the
    engine's way: no `Timing` per row, and `CountHints` made only for an API that
    reads them)."""
    top = ex.top
    if top is None:
        c = Counts()
    elif type(top) is LlamaTop:
        c = openai_counts(top)  # the fast path's llama-server usage
    else:
        assert isinstance(top, dict)
        c = ex.api.counts(top, CountHints(estimated_prompt, evaluated_share, known_old))
    if ex.streamed and (c.prefill_ms is None or c.decode_ms is None):
        _proxy_times(c, Timing(ex.t_start, ex.t_first_byte, ex.t_end, True, ex.t_first_event))
    return c
