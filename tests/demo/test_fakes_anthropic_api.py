"""The fake of Anthropic's own Messages API (``Upstream("anthropic-api")``), driven by the real
``anthropic`` SDK: every prompt-cache rule it keeps, with the counters computed here by hand
(a text block's tokens are its characters over four, any other block's its compact JSON's)."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from llmp.apis.providers import anthropic_minimum_tokens, facts
from llmp.demo.fakes import (
    REASONING_TEXT,
    REPLY_TEXT,
    TOOL_ARGS,
    AnthropicAPI,
    Decision,
    PromptCache,
)
from llmp.demo.fakes.anthropic_api import ORGANIZATION_ID
from llmp.demo.fakes.anthropic_cache import (
    Fingerprint,
    RequestError,
    diagnose,
    fingerprint,
    parse_prompt,
    usage,
)
from tests.support.upstreams import Upstream

SONNET = "claude-sonnet-4-5"  # minimum 1024
OPUS = "claude-opus-4-6"  # minimum 4096
CC: Any = {"type": "ephemeral"}
CC_1H: Any = {"type": "ephemeral", "ttl": "1h"}
BETA = facts()["anthropic"]["diagnosis_beta"]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def up(clock: Clock) -> Iterator[Upstream]:
    with Upstream("anthropic-api", clock=clock) as u:
        yield u


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as st:
        yield st


def client(stack: contextlib.ExitStack, url: str, api_key: str = "x") -> anthropic.Anthropic:
    c = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=10)
    return stack.enter_context(c)


def text(n: int, tag: str = "") -> str:
    """A text of exactly ``n`` tokens (4 n characters), told apart by ``tag``."""
    head = f"{tag}|"
    return (head + "abcd" * n)[: 4 * n]


def block(n: int, tag: str = "", cc: Any = None) -> dict[str, Any]:
    b: dict[str, Any] = {"type": "text", "text": text(n, tag)}
    if cc is not None:
        b["cache_control"] = cc
    return b


def json_tokens(obj: Any) -> int:
    return math.ceil(len(json.dumps(obj, ensure_ascii=False, separators=(",", ":"))) / 4)


def make_tool(name: str, chars: int, cc: Any = None) -> dict[str, Any]:
    t: dict[str, Any] = {
        "name": name,
        "description": "d" * chars,
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    if cc is not None:
        t["cache_control"] = cc
    return t


def tool_tokens(t: dict[str, Any]) -> int:
    return json_tokens({k: v for k, v in t.items() if k != "cache_control"})


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def req(*messages: dict[str, Any], model: str = SONNET, **extra: Any) -> dict[str, Any]:
    msgs = list(messages) or [{"role": "user", "content": "hi"}]
    return {"model": model, "max_tokens": 256, "messages": msgs, **extra}


Counts = tuple[int, int, int, int]
"""(cache read, 5-minute writes, 1-hour writes, uncached input)"""


def turn(
    c: anthropic.Anthropic, body: dict[str, Any], stream: bool = False, fake: str = ""
) -> Counts:
    """One request through the SDK; its input counters (message_start's when streamed),
    checked to add up to the prompt's size as ``count_tokens`` gives it."""
    extra: dict[str, Any] = {"extra_headers": {"x-fake": fake}} if fake else {}
    if stream:
        events = list(c.messages.create(**body, stream=True, **extra))
        start = events[0]
        assert start.type == "message_start"
        u = start.message.usage
    else:
        u = c.messages.create(**body, **extra).usage
    assert u.cache_creation is not None
    assert u.cache_read_input_tokens is not None and u.cache_creation_input_tokens is not None
    got = (
        u.cache_read_input_tokens,
        u.cache_creation.ephemeral_5m_input_tokens,
        u.cache_creation.ephemeral_1h_input_tokens,
        u.input_tokens,
    )
    assert u.cache_creation_input_tokens == got[1] + got[2]
    count_body = {k: v for k, v in body.items() if k != "max_tokens"}
    total = c.messages.count_tokens(**count_body).input_tokens
    assert sum(got) == total, (got, total)
    return got


def last_decision(up: Upstream) -> Decision:
    """The fake's own cache decision for the last /v1/messages request."""
    ex = next(e for e in reversed(up.log) if e.path.split("?")[0] == "/v1/messages")
    d = ex.cache
    assert isinstance(d, Decision)
    return d


def raw_post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    with httpx.Client(timeout=10) as h:
        return h.post(url + "/v1/messages?beta=true", json=body, headers=headers)


SYSTEM_N = 1100


def system(tag: str = "s", cc: Any = CC, n: int = SYSTEM_N) -> list[dict[str, Any]]:
    return [block(n, tag, cc)]


# ------------------------------------------------------------ writes and reads


@pytest.mark.parametrize("stream", [False, True])
def test_first_write_then_full_read(
    up: Upstream, stack: contextlib.ExitStack, stream: bool
) -> None:
    c = client(stack, up.url)
    body = req(system=system())
    assert turn(c, body, stream) == (0, SYSTEM_N, 0, 1)  # "hi" is one token, after C
    d = last_decision(up)
    assert d.hit is None and d.written == (0,) and d.minimum == 1024 and d.committed
    assert d.alive == 1
    assert turn(c, body, stream) == (SYSTEM_N, 0, 0, 1)
    d = last_decision(up)
    assert d.hit == 0 and d.written == () and d.refreshed == (0,)
    [entry] = up.anthropic_api.entries()
    assert entry.position == 0 and entry.tokens == SYSTEM_N and entry.ttl == "5m"


def test_the_billing_line_is_no_part_of_the_cache_key(
    up: Upstream, stack: contextlib.ExitStack
) -> None:
    """Claude Code's first system block changes between requests and the API still reads
    the prefix behind it (R35); any other first block that changes misses."""
    c = client(stack, up.url)

    def body(first: str) -> dict[str, Any]:
        return req(system=[{"type": "text", "text": first}, block(SYSTEM_N, "s", CC)])

    line = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=cli;"
    n = math.ceil(len(line.format("7c2")) / 4)
    assert turn(c, body(line.format("7c2"))) == (0, n + SYSTEM_N, 0, 1)
    assert turn(c, body(line.format("d41"))) == (n + SYSTEM_N, 0, 0, 1)
    other = "a session id that changes: 7c2;"
    turn(c, body(other))
    assert turn(c, body(other.replace("7c2", "d41")))[0] == 0


def test_the_diagnosis_ignores_the_billing_line_whatever_its_length(
    up: Upstream, stack: contextlib.ExitStack
) -> None:
    """Claude Code's line grows between requests (`cc_prompt_id=…`, then `cc_prev_req=…`):
    the API read everything, so it names no change."""
    c = client(stack, up.url)
    head = "x-anthropic-billing-header: cc_version=2.1.332.b2c; cc_entrypoint=sdk-cli; "

    def body(first: str) -> dict[str, Any]:
        return req(system=[{"type": "text", "text": head + first}, block(SYSTEM_N, "s", CC)])

    first = _diag(c, body("cc_prompt_id=55db;"), None)
    _diag(c, body("cc_prev_req=req_011C7DIENxCZnT2yIg0123456789abcdef;"), first)
    assert _sent(up) is None


def test_moving_breakpoint_reads_through_the_lookback(
    up: Upstream, stack: contextlib.ExitStack
) -> None:
    """Claude Code's turns: the breakpoint moves to the last block; the latest user message is
    sent as blocks with ``cache_control``, and as a plain string on the next turn."""
    c = client(stack, up.url)
    u1 = text(10, "u1")
    turn1 = req(user({"type": "text", "text": u1, "cache_control": CC}), system=system())
    assert turn(c, turn1) == (0, SYSTEM_N + 10, 0, 0)
    assert last_decision(up).written == (0, 1)
    turn2 = req(
        {"role": "user", "content": u1},
        {"role": "assistant", "content": text(5, "a1")},
        user(block(10, "u2", CC)),
        system=system(),
    )
    assert turn(c, turn2) == (SYSTEM_N + 10, 15, 0, 0)
    d = last_decision(up)
    assert d.hit == 1 and d.written == (3,)


def _chain(n_blocks: int) -> list[dict[str, Any]]:
    """One user message of ``n_blocks`` one-token blocks, the last with a breakpoint."""
    blocks = [block(1, f"{i}") for i in range(n_blocks)]
    blocks[-1]["cache_control"] = CC
    return [user(*blocks)]


@pytest.mark.parametrize(("later", "reads"), [(19, True), (20, False)])
def test_lookback_reaches_19_blocks_back_not_20(
    up: Upstream, stack: contextlib.ExitStack, later: int, reads: bool
) -> None:
    c = client(stack, up.url)
    # no breakpoint on the system: only the messages' entry can be read
    first = req(*_chain(1), system=system(cc=None))
    assert turn(c, first) == (0, SYSTEM_N + 1, 0, 0)
    second = req(*_chain(1 + later), system=system(cc=None))
    total = SYSTEM_N + 1 + later
    if reads:
        assert turn(c, second) == (SYSTEM_N + 1, later, 0, 0)
        assert last_decision(up).hit == 1
    else:
        assert turn(c, second) == (0, total, 0, 0)
        assert last_decision(up).hit is None
    assert facts()["anthropic"]["lookback_blocks"] == 20


def test_the_hit_is_the_furthest_over_all_breakpoints(
    up: Upstream, stack: contextlib.ExitStack
) -> None:
    c = client(stack, up.url)
    assert turn(c, req(*_chain(1), system=system()))[1] == SYSTEM_N + 1
    # the last breakpoint is 25 blocks on (too far), but one on the 2nd block of the
    # message finds the first turn's entry behind it
    blocks = [block(1, f"{i}") for i in range(26)]
    blocks[1]["cache_control"] = CC
    blocks[-1]["cache_control"] = CC
    assert turn(c, req(user(*blocks), system=system())) == (SYSTEM_N + 1, 25, 0, 0)
    assert last_decision(up).hit == 1


@pytest.mark.parametrize("stream", [False, True])
def test_mixed_ttls_a_b_c(up: Upstream, stack: contextlib.ExitStack, stream: bool) -> None:
    c = client(stack, up.url)
    tool = make_tool("get_weather", 4200, CC_1H)
    t = tool_tokens(tool)
    assert t >= 1024  # its own breakpoint counts
    messages = [user(block(30, "u0", CC), block(7, "tail"))]
    first = req(*messages, tools=[tool], system=system("s1", CC_1H))
    # nothing read: 1-hour writes through the system (B), 5-minute through u0 (C)
    assert turn(c, first, stream) == (0, 30, t + SYSTEM_N, 7)
    # the system changes: the tools entry is read (A), the new system written for an hour
    # (B - A), the message for five minutes (C - B), the tail after C uncached
    second = req(*messages, tools=[tool], system=system("s2", CC_1H))
    assert turn(c, second, stream) == (t, 30, SYSTEM_N, 7)
    d = last_decision(up)
    assert d.hit == 0 and d.written == (1, 2)
    ttls = {(e.position, e.ttl) for e in up.anthropic_api.entries()}
    assert ttls == {(0, "1h"), (1, "1h"), (2, "5m")}


def test_automatic_caching_marks_the_last_block(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    body = req(user(block(1200, "u0")), system="plain system", cache_control=CC)
    sys_tokens = math.ceil(len("plain system") / 4)
    assert turn(c, body) == (0, sys_tokens + 1200, 0, 0)
    assert [b.position for b in last_decision(up).breakpoints] == [1]
    body2 = req(
        {"role": "user", "content": text(1200, "u0")},
        {"role": "assistant", "content": "ok"},
        user(block(3, "u1")),
        system="plain system",
        cache_control=CC,
    )
    assert turn(c, body2) == (sys_tokens + 1200, 1 + 3, 0, 0)


def test_below_the_minimum_nothing_is_cached(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    assert anthropic_minimum_tokens(OPUS) == 4096
    body = req(system=system(n=2000), model=OPUS)
    for _ in range(2):
        assert turn(c, body) == (0, 0, 0, 2001)
        d = last_decision(up)
        assert d.minimum == 4096 and [b.counted for b in d.breakpoints] == [False]
    assert up.anthropic_api.entries() == []
    # the same prompt on a model with a lower minimum is cached
    assert turn(c, req(system=system(n=2000)))[1] == 2000
    # a short first breakpoint neither reads nor writes; a long enough second one does
    mixed = req(user(block(600, "u", CC)), system=system(n=600))
    assert turn(c, mixed) == (0, 1200, 0, 0)
    assert [b.counted for b in last_decision(up).breakpoints] == [False, True]


# ------------------------------------------------------------------- tiers


def _tiered(**extra: Any) -> dict[str, Any]:
    tool = make_tool("get_weather", 4200, CC)
    return req(
        user(block(40, "u0", CC)),
        tools=[tool],
        system=system(),
        **extra,
    )


def test_a_tool_change_misses_every_tier(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    first = _tiered()
    t = tool_tokens(first["tools"][0])
    assert turn(c, first) == (0, t + SYSTEM_N + 40, 0, 0)
    assert turn(c, first) == (t + SYSTEM_N + 40, 0, 0, 0)
    changed = _tiered()
    changed["tools"][0]["description"] = "e" * 4200
    assert turn(c, changed) == (0, t + SYSTEM_N + 40, 0, 0)


@pytest.mark.parametrize(
    "setting",
    [
        {"tool_choice": {"type": "any"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    ],
)
def test_messages_tier_settings_miss_messages_only(
    up: Upstream, stack: contextlib.ExitStack, setting: dict[str, Any]
) -> None:
    c = client(stack, up.url)
    first = _tiered()
    t = tool_tokens(first["tools"][0])
    turn(c, first)
    assert turn(c, _tiered(**setting)) == (t + SYSTEM_N, 40, 0, 0)
    assert last_decision(up).hit == 1  # the system block


def test_speed_misses_system_and_messages(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    first = _tiered()
    t = tool_tokens(first["tools"][0])
    turn(c, first)
    assert turn(c, _tiered(speed="fast")) == (t, SYSTEM_N + 40, 0, 0)
    assert last_decision(up).hit == 0  # the tool


def test_an_added_image_misses_the_messages_tier(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    first = _tiered()
    t = tool_tokens(first["tools"][0])
    turn(c, first)
    history = [user(block(40, "u0")), {"role": "assistant", "content": "ok"}]
    # appending text reads through the first turn's message entry
    more = req(*history, user(block(5, "u1", CC)), tools=first["tools"], system=system())
    assert turn(c, more)[0] == t + SYSTEM_N + 40
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
    }
    with_image = req(
        *history, user(image, block(5, "u1", CC)), tools=first["tools"], system=system()
    )
    read, w5m, _, _ = turn(c, with_image)
    assert read == t + SYSTEM_N and w5m == 40 + 1 + json_tokens(image) + 5


def test_dropped_thinking_blocks_miss_from_there(up: Upstream, stack: contextlib.ExitStack) -> None:
    """New user content drops the earlier thinking blocks from the prompt."""
    c = client(stack, up.url)
    thinking = {"type": "thinking", "thinking": "plan the call", "signature": "c2ln"}
    call = {"type": "tool_use", "id": "toolu_01x", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01x", "content": "sunny"}
    loop: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": [thinking, call]},
        user({**result, "cache_control": CC}),
    ]
    tools = [make_tool("get_weather", 40)]
    head = tool_tokens(tools[0]) + SYSTEM_N
    turn(c, req(*loop, tools=tools, system=system()))
    # positions: tool, system, user, thinking, tool_use, result
    assert last_decision(up).written == (1, 5)
    # still in the tool loop (only tool results since the user spoke): the thinking stays,
    # and the entry at the result is read
    call2 = {**call, "id": "toolu_01y"}
    result2 = {**result, "tool_use_id": "toolu_01y"}
    loop2: list[dict[str, Any]] = [
        *loop[:2],
        user(result),
        {"role": "assistant", "content": [thinking, call2]},
    ]
    assert turn(
        c, req(*loop2, user({**result2, "cache_control": CC}), tools=tools, system=system())
    )
    assert last_decision(up).hit == 5
    # a new user text: every thinking block before it leaves the prompt, so the loop's
    # entries miss and only the system's is read
    after: list[dict[str, Any]] = [
        *loop2,
        user(result2),
        {"role": "assistant", "content": "Sunny."},
    ]
    read, *_ = turn(c, req(*after, user(block(3, "new", CC)), tools=tools, system=system()))
    assert read == head
    assert last_decision(up).hit == 1


# ------------------------------------------------------------ time to live


def test_ttl_expiry_and_refresh(up: Upstream, stack: contextlib.ExitStack, clock: Clock) -> None:
    c = client(stack, up.url)
    body = req(system=system())
    assert turn(c, body)[1] == SYSTEM_N
    clock.now += 299
    assert turn(c, body)[0] == SYSTEM_N  # read at 299 s: alive for 300 s more
    clock.now += 299
    assert turn(c, body)[0] == SYSTEM_N
    clock.now += 300  # exactly its time to live since the last read
    assert turn(c, body) == (0, SYSTEM_N, 0, 1)
    one_hour = req(system=system("h", CC_1H))
    assert turn(c, one_hour)[2] == SYSTEM_N
    clock.now += 3599
    assert turn(c, one_hour)[0] == SYSTEM_N
    clock.now += 3600
    assert turn(c, one_hour) == (0, 0, SYSTEM_N, 1)


def test_a_read_keeps_the_prefix_behind_it_warm(
    up: Upstream, stack: contextlib.ExitStack, clock: Clock
) -> None:
    c = client(stack, up.url)
    first = req(user(block(20, "u0", CC)), system=system())
    turn(c, first)
    clock.now += 200
    assert turn(c, first)[0] == SYSTEM_N + 20  # refreshes the system's entry too
    assert last_decision(up).refreshed == (0, 1)
    clock.now += 200  # 400 s after the system's write, 200 s after the read
    changed = req(user(block(20, "other", CC)), system=system())
    assert turn(c, changed)[0] == SYSTEM_N


# ------------------------------------------------------------------- control


def test_evict_by_method_and_by_mode(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    body = req(user(block(20, "u0", CC)), system=system())
    turn(c, body)
    assert up.anthropic_api.evict() == 2
    assert turn(c, body) == (0, SYSTEM_N + 20, 0, 0)
    assert turn(c, body, fake="evict=1") == (SYSTEM_N, 20, 0, 0)
    assert turn(c, body, fake="evict") == (0, SYSTEM_N + 20, 0, 0)
    # cache_miss reads nothing and keeps the entries
    assert turn(c, body, fake="cache_miss") == (0, SYSTEM_N + 20, 0, 0)
    assert turn(c, body) == (SYSTEM_N + 20, 0, 0, 0)
    assert up.anthropic_api.evict(position=7) == 0
    with pytest.raises(anthropic.BadRequestError):
        turn(c, body, fake="evict=last")


def test_scope_is_model_and_api_key(up: Upstream, stack: contextlib.ExitStack) -> None:
    body = req(system=system())
    turn(client(stack, up.url, "key-1"), body)
    assert turn(client(stack, up.url, "key-2"), body)[0] == 0
    assert (
        turn(client(stack, up.url, "key-1"), req(system=system(), model="claude-sonnet-4-6"))[0]
        == 0
    )
    assert turn(client(stack, up.url, "key-1"), body)[0] == SYSTEM_N
    ids = {e.response_header("anthropic-workspace-id") for e in up.log}
    assert len(ids) == 2  # one workspace per key


def test_entries_are_readable_once_the_response_began(up: Upstream) -> None:
    """A stream whose head is out (and that then hangs) has already written its entries."""
    body = req(system=system(), stream=True)
    headers = {"x-api-key": "k", "x-fake": "hang_after_head,hang_s=30"}

    def held() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut when the fake closes
            raw_post(up.url, body, **headers)

    hold = threading.Thread(target=held)
    hold.start()
    try:
        head = threading.Event()
        for _ in range(2000):
            # The head is out, and the fake is holding the rest (its outcome says so once
            # the hang has begun: the head goes out a moment before).
            if up.log and up.log[0].t_head is not None and up.log[0].outcome == "hung":
                head.set()
                break
            head.wait(0.005)
        assert head.is_set()
        second = raw_post(up.url, req(system=system()), **{"x-api-key": "k"})
        assert second.json()["usage"]["cache_read_input_tokens"] == SYSTEM_N
    finally:
        up.close()
        hold.join(10)


def test_unit_writes_wait_for_commit(clock: Clock) -> None:
    cache = PromptCache(clock)
    prompt = parse_prompt(req(system=system()))
    first = cache.plan(prompt, "scope", 1024)
    second = cache.plan(prompt, "scope", 1024)  # arrives before the first's head
    assert first.written == second.written == (0,) and second.hit is None
    cache.commit(first, "msg_1")
    third = cache.plan(prompt, "scope", 1024)
    assert third.hit == 0 and third.read == SYSTEM_N
    assert cache.plan(prompt, "other scope", 1024).hit is None


# ------------------------------------------------------------------ errors


def _error(exc: anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert body["type"] == "error" and body["request_id"].startswith("req_011C")
    assert exc.response.headers["request-id"] == body["request_id"]
    err: dict[str, Any] = body["error"]
    return err


def test_breakpoint_errors(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    five = [block(1, f"{i}", CC) for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(user(*five)))
    assert _error(e.value) == {
        "type": "invalid_request_error",
        "message": "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    }
    # the automatic one counts toward the four
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(user(*five[:4], block(1, "x")), cache_control=CC))
    assert _error(e.value)["message"].endswith("Found 5.")
    # ...but adds nothing on a block that already has the same one
    c.messages.create(**req(user(*five[:4]), cache_control=CC))
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(user(block(1, "a", CC), block(1, "b", CC_1H))))
    assert _error(e.value)["message"] == (
        "messages.0.content.1.cache_control.ttl: a ttl='1h' cache_control block must not come "
        "after a ttl='5m' cache_control block. Note that blocks are processed in the following "
        "order: `tools`, `system`, `messages`."
    )
    # tools come first: a 1-hour system after a 5-minute tool is refused too
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(tools=[make_tool("t", 10, CC)], system=system(cc=CC_1H)))
    assert _error(e.value)["message"].startswith("system.0.cache_control.ttl: a ttl='1h'")
    thinking = {"type": "thinking", "thinking": "t", "signature": "s", "cache_control": CC}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(user(block(1)), {"role": "assistant", "content": [thinking]}))
    assert _error(e.value)["message"] == (
        "messages.1.content.0.thinking.cache_control: Extra inputs are not permitted"
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(user({"type": "text", "text": "", "cache_control": CC})))
    assert _error(e.value)["message"] == (
        "messages.0.content.0.text: cache_control cannot be set for empty text blocks"
    )
    assert all(ex.cache is None for ex in up.log if ex.status == 400)


def test_auth_and_other_errors(up: Upstream, stack: contextlib.ExitStack) -> None:
    r = raw_post(up.url, req())
    assert r.status_code == 401
    assert r.json()["error"] == {
        "type": "authentication_error",
        "message": "x-api-key header is required",
    }
    bearer = stack.enter_context(
        anthropic.Anthropic(base_url=up.url, auth_token="oauth-token", max_retries=0)
    )
    assert bearer.messages.create(**req()).content[0].type == "text"
    assert up.last.request_header("authorization") == "Bearer oauth-token"
    c = client(stack, up.url)
    with pytest.raises(anthropic.NotFoundError) as e404:
        c.get("/v1/nothing", cast_to=httpx.Response)
    assert _error(e404.value)["type"] == "not_found_error"
    with pytest.raises(anthropic.APIStatusError) as e5:
        c.messages.create(**req(), extra_headers={"x-fake": "status=529"})
    assert e5.value.status_code == 529 and _error(e5.value)["type"] == "overloaded_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**req(), extra_headers={"x-fake": "context_error"})
    assert _error(e.value)["message"] == "prompt is too long: 200808 tokens > 200000 maximum"


def test_a_prompt_over_the_context_window_is_refused(clock: Clock) -> None:
    with Upstream("anthropic-api", clock=clock, n_ctx=1000) as small:
        r = raw_post(small.url, req(system=system()), **{"x-api-key": "k"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt is too long: 1101 tokens > 1000 maximum"
    with Upstream("llama") as llama:
        assert llama.n_ctx == 8192  # the local servers keep theirs


# --------------------------------------------------------------- diagnostics


def _diag(
    c: anthropic.Anthropic,
    body: dict[str, Any],
    previous: str | None,
    stream: bool = False,
    **headers: str,
) -> str:
    """A request asking for a diagnosis (with the beta value); its message id."""
    full = {**body, "diagnostics": {"previous_message_id": previous}}
    extra: dict[str, Any] = {"extra_headers": {"anthropic-beta": BETA, **headers}}
    if stream:
        events = list(c.messages.create(**full, stream=True, **extra))
        start = events[0]
        assert start.type == "message_start"
        return start.message.id
    return c.messages.create(**full, **extra).id


def _sent(up: Upstream) -> Any:
    """The diagnostics the fake sent last (``...`` when absent)."""
    ex = up.last
    if ex.sse_events():
        message = json.loads(ex.sse_events()[0][1])["message"]
    else:
        message = json.loads(ex.decoded_body)
    return message.get("diagnostics", ...)


@pytest.mark.parametrize("stream", [False, True])
def test_diagnostics_states(up: Upstream, stack: contextlib.ExitStack, stream: bool) -> None:
    c = client(stack, up.url)
    base = req(user(block(20, "u0", CC)), system=system("s1"))
    c.messages.create(**base)
    assert _sent(up) is ...  # not asked: absent
    first = _diag(c, base, None, stream)
    assert _sent(up) is None  # a first turn
    same = _diag(c, base, first, stream)
    assert _sent(up) is None  # nothing diverged
    grown = req(
        user(block(20, "u0")),
        {"role": "assistant", "content": "ok"},
        user(block(5, "u1", CC)),
        system=system("s1"),
    )
    grown_id = _diag(c, grown, same, stream)
    assert _sent(up) is None  # only appended
    sys_id = _diag(c, req(*grown["messages"], system=system("s2")), grown_id, stream)
    # the previous request cached system + u0 + "ok" + u1; none of it is shared now
    assert _sent(up) == {
        "cache_miss_reason": {
            "type": "system_changed",
            "cache_missed_input_tokens": SYSTEM_N + 20 + 1 + 5,
        }
    }
    rewritten = req(user(block(20, "edited")), *grown["messages"][1:], system=system("s2"))
    msg_id = _diag(c, rewritten, sys_id, stream)
    assert _sent(up) == {
        "cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 20 + 1 + 5}
    }
    model_id = _diag(c, {**rewritten, "model": "claude-sonnet-4-6"}, msg_id, stream)
    assert _sent(up) == {
        "cache_miss_reason": {"type": "model_changed", "cache_missed_input_tokens": SYSTEM_N + 26}
    }
    _diag(
        c,
        {**rewritten, "model": "claude-sonnet-4-6", "tool_choice": {"type": "auto"}},
        model_id,
        stream,
    )
    assert _sent(up) == {"cache_miss_reason": {"type": "unavailable"}}
    _diag(c, rewritten, "msg_01unknown", stream)
    assert _sent(up) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    _diag(c, rewritten, msg_id, stream, **{"x-fake": "diagnosis_pending"})
    assert _sent(up) == {"cache_miss_reason": None}


def test_diagnostics_need_a_fingerprint_and_carry_no_text(
    up: Upstream, stack: contextlib.ExitStack
) -> None:
    c = client(stack, up.url)
    body = req(user(block(20, "secret words", CC)), system=system("hidden prompt"))
    plain = c.messages.create(**body)  # did not ask: nothing kept for it
    _diag(c, body, plain.id)
    assert _sent(up) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert set(up.anthropic_api.fingerprints) == {json.loads(up.last.decoded_body)["id"]}
    # without the beta header too
    r = raw_post(
        up.url, {**body, "diagnostics": {"previous_message_id": None}}, **{"x-api-key": "x"}
    )
    assert "diagnostics" in r.json() and r.json()["diagnostics"] is None
    fp = repr(up.anthropic_api.fingerprints)
    assert "secret" not in fp and "hidden" not in fp
    # another key's message is not found
    other = client(stack, up.url, "other-key")
    _diag(other, body, json.loads(up.last.decoded_body)["id"])
    assert _sent(up) == {"cache_miss_reason": {"type": "previous_message_not_found"}}


def test_diagnostics_sdk_types(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    body = req(system=system("a"))
    first = c.messages.create(**body, diagnostics={"previous_message_id": None})
    second = c.messages.create(
        **req(system=system("b")), diagnostics={"previous_message_id": first.id}
    )
    assert first.diagnostics is None
    assert second.diagnostics is not None
    reason = second.diagnostics.cache_miss_reason
    assert reason is not None and reason.type == "system_changed"
    assert reason.cache_missed_input_tokens == SYSTEM_N


def _fp(**tiers: Any) -> Fingerprint:
    base: dict[str, Any] = {
        "scope": "k",
        "model": SONNET,
        "speed": "standard",
        "tools": (("t", 10),),
        "system": (("s", 100),),
        "messages": (("m0", 5), ("m1", 5)),
        "others": "o",
        "cached": 120,
    }
    return Fingerprint(**(base | tiers))


def _kind(d: dict[str, Any] | None) -> str | None:
    reason = None if d is None else d["cache_miss_reason"]
    return None if reason is None else str(reason["type"])


def test_unit_diagnose() -> None:
    prev = _fp()
    assert diagnose(prev, _fp(messages=(("m0", 5), ("m1", 5), ("m2", 9)))) is None
    assert _kind(diagnose(None, prev)) == "previous_message_not_found"
    assert _kind(diagnose(prev, _fp(scope="other"))) == "previous_message_not_found"
    assert diagnose(prev, _fp(speed="fast")) == {
        "cache_miss_reason": {"type": "model_changed", "cache_missed_input_tokens": 120}
    }
    assert diagnose(prev, _fp(tools=(("t", 10), ("t2", 3)))) == {
        "cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 110}
    }
    assert diagnose(prev, _fp(system=(("s2", 100),))) == {
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 110}
    }
    assert diagnose(prev, _fp(messages=(("m0", 5), ("x", 5)))) == {
        "cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 5}
    }
    assert diagnose(prev, _fp(messages=(("m0", 5),))) == {
        "cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 5}
    }
    # the earliest divergence is named, whatever follows it
    both = _fp(system=(("s2", 100),), messages=(("x", 5),), others="p")
    assert _kind(diagnose(prev, both)) == "system_changed"
    # the divergence at block 3 (tool 0, system 1, m0 2, m1 3): too deep from depth 3 on
    deep = _fp(messages=(("m0", 5), ("x", 5)))
    assert _kind(diagnose(prev, deep, depth=4)) == "messages_changed"
    assert diagnose(prev, deep, depth=3) == {"cache_miss_reason": {"type": "unavailable"}}
    assert diagnose(prev, _fp(others="p")) == {"cache_miss_reason": {"type": "unavailable"}}


def test_diagnosis_depth_on_the_server(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    api = up.anthropic_api
    assert isinstance(api, AnthropicAPI)
    api.diagnosis_depth = 1
    body = req(user(block(20, "u0", CC)), system=system())
    first = _diag(c, body, None)
    _diag(c, req(user(block(20, "u1", CC)), system=system()), first)
    assert _sent(up) == {"cache_miss_reason": {"type": "unavailable"}}


# ------------------------------------------------------------------ the wire


def test_non_streamed_message_and_headers(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    msg = c.messages.create(**req(system=system(), model="claude-opus-4-8"))
    assert msg.model == "claude-opus-4-8" and msg.id.startswith("msg_01") and len(msg.id) == 28
    assert msg.stop_reason == "end_turn" and msg.usage.service_tier == "standard"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].type == "text" and msg.content[0].text == REPLY_TEXT["anthropic-api"]
    ex = up.last
    obj = json.loads(ex.body)
    assert "diagnostics" not in obj
    assert list(obj["usage"]) == [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cache_creation",
        "output_tokens",
        "service_tier",
    ]
    assert ex.response_header("content-type") == "application/json"
    assert ex.response_header("anthropic-organization-id") == ORGANIZATION_ID
    assert ex.response_header("anthropic-workspace-id")
    assert (ex.response_header("request-id") or "").startswith("req_011C")
    names = {k for k, _ in ex.response_headers if k.startswith("anthropic-ratelimit-")}
    assert "anthropic-ratelimit-requests-limit" in names and len(names) == 9
    assert ex.cache is not None and ex.cache.committed


def test_stream_events_thinking_and_usage(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    body = req(system=system(), thinking={"type": "enabled", "budget_tokens": 2048})
    with c.messages.stream(**body) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking" and final.content[0].thinking == REASONING_TEXT
    assert final.content[0].signature
    events = [(n, json.loads(d)) for n, d in up.last.sse_events()]
    assert [n for n, _ in events][:2] == ["message_start", "ping"]
    assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == [0, 1]
    delta = events[-2][1]["usage"]
    start = events[0][1]["message"]["usage"]
    assert "cache_creation" not in delta and "cache_creation" in start
    for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"):
        assert delta[k] == start[k]
    assert delta["output_tokens"] == final.usage.output_tokens > start["output_tokens"]
    assert up.last.response_header("content-type") == "text/event-stream; charset=utf-8"
    # the same request, not streamed, thinks the same
    msg = c.messages.create(**body)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    # without thinking enabled, no thinking block
    assert [b.type for b in c.messages.create(**req()).content] == ["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use(up: Upstream, stack: contextlib.ExitStack, stream: bool) -> None:
    c = client(stack, up.url)
    body = req(
        {"role": "user", "content": "What's the weather in Tokyo?"},
        tools=[make_tool("get_weather", 20)],
    )
    if stream:
        with c.messages.stream(**body) as s:
            msg = s.get_final_message()
    else:
        msg = c.messages.create(**body)
    assert msg.stop_reason == "tool_use"
    [call] = msg.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == TOOL_ARGS
    assert call.id.startswith("toolu_01")


def test_midstream_error_and_no_ping(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    with pytest.raises(anthropic.APIStatusError):
        list(c.messages.create(**req(), stream=True, extra_headers={"x-fake": "midstream_error"}))
    name, data = up.last.sse_events()[-1]
    assert name == "error" and json.loads(data)["error"]["type"] == "overloaded_error"
    list(c.messages.create(**req(), stream=True, extra_headers={"x-fake": "no_ping"}))
    assert "ping" not in [n for n, _ in up.last.sse_events()]


def test_count_tokens_leaves_the_cache_alone(up: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, up.url)
    tool = make_tool("get_weather", 100, CC)
    body: dict[str, Any] = {"model": SONNET, "messages": [{"role": "user", "content": "hi"}]}
    n = c.messages.count_tokens(**body | {"system": system(), "tools": [tool]}).input_tokens
    assert n == tool_tokens(tool) + SYSTEM_N + 1
    assert up.anthropic_api.entries() == [] and up.last.path == "/v1/messages/count_tokens"


# ---------------------------------------------------------------- pure parts


def test_unit_parse_prompt() -> None:
    as_blocks = parse_prompt(req(user(block(3, "u", CC)), system="sys"))
    as_string = parse_prompt(req({"role": "user", "content": text(3, "u")}, system=[block(1, "")]))
    assert [b.tokens for b in as_blocks.blocks] == [1, 3]
    # a string content is one text block; cache_control is not part of the prompt
    assert as_blocks.blocks[1].digest == as_string.blocks[1].digest
    assert as_blocks.breakpoints == [1] and as_string.breakpoints == []
    assert as_blocks.blocks[1].where == "messages.0.content.0"
    # one message of two blocks is not two messages of one
    one = parse_prompt(req(user(block(1, "a"), block(1, "b"))))
    two = parse_prompt(req(user(block(1, "a")), user(block(1, "b"))))
    assert one.blocks[-1].chain != two.blocks[-1].chain
    # key order counts (a byte change is a change)
    t1 = {"name": "t", "description": "d"}
    t2 = {"description": "d", "name": "t"}
    assert (
        parse_prompt(req(tools=[t1])).blocks[0].digest
        != parse_prompt(req(tools=[t2])).blocks[0].digest
    )
    with pytest.raises(RequestError, match=r"cache_control\.ttl: Input should be '5m' or '1h'"):
        parse_prompt(req(user(block(1, "a", {"type": "ephemeral", "ttl": "2h"}))))


def test_unit_usage_adds_up(clock: Clock) -> None:
    cache = PromptCache(clock)
    prompt = parse_prompt(
        req(
            user(block(1500, "a", CC_1H), block(500, "b", CC), block(9, "c")),
            tools=[make_tool("t", 8)],
        )
    )
    d = cache.plan(prompt, "s", 1024)
    u = usage(d, 7)
    assert u["cache_read_input_tokens"] == 0
    assert u["cache_creation"] == {
        "ephemeral_5m_input_tokens": 500,
        "ephemeral_1h_input_tokens": prompt.blocks[1].end,
    }
    assert u["input_tokens"] == 9 and u["output_tokens"] == 7
    total = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
    assert total == prompt.total == d.prompt_tokens
    fp = fingerprint(prompt, "s", d.cached)
    assert fp.cached == prompt.blocks[2].end
