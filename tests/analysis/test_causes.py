"""Every loss cause is complete in the one table that describes it (analysis/causes.py)."""

from __future__ import annotations

import re

from llmp.analysis import causes, loss, provider
from llmp.analysis.classify import SIDE_CALL
from llmp.analysis.html.common import CAUSES as HTML_COLOURS
from llmp.analysis.html.page import _cause_css
from llmp.analysis.render import sentence
from llmp.apis import servers

HEX = re.compile(r"#[0-9A-Fa-f]{6}")


def _luminance(hex_colour: str) -> float:
    def channel(c: int) -> float:
        s = c / 255
        return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4

    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def test_every_cause_has_every_field() -> None:
    names = [c.name for c in causes.CAUSES]
    assert len(names) == len(set(names))
    for c in causes.CAUSES:
        assert c.group in causes.GROUPS, c
        assert c.words and c.fix.endswith("."), c
        assert HEX.fullmatch(c.colour), c
        if c.group == causes.CLIENT:
            assert c.did, c  # the prefix_break sentence says what the harness did
        if c.group == causes.SERVER:
            assert set(re.findall(r"{(\w+)}", c.story)) == {"model", "times", "lost"}, c


def test_chip_text_is_readable_on_every_colour() -> None:
    """WCAG contrast of at least 4.5 between the chip's text and its colour."""
    for c in causes.CAUSES:
        bg = _luminance(c.colour)
        text = 1.0 if c.light_text else _luminance("#1A1A1A")
        hi, lo = max(bg, text), min(bg, text)
        assert (hi + 0.05) / (lo + 0.05) >= 4.5, c


def test_every_cause_the_engine_charges_is_in_the_table() -> None:
    charged = {
        loss.SYSTEM_CHANGED,
        loss.TOOLS_CHANGED,
        loss.HISTORY_REWRITTEN,
        SIDE_CALL,
        loss.OTHER_CONVERSATION,
        loss.OTHER_MODEL,
        loss.SERVER_EMPTY,
        loss.SERVER_HEAD_ONLY,
        loss.SERVER_ROLLBACK,
        causes.SERVER_NO_ROLLBACK,
        loss.SERVER_CAPACITY,
        loss.SERVER_TEMPLATE,
        # On a cloud provider (provider.py, R35).
        provider.SETTINGS_CHANGED,
        provider.MODEL_CHANGED,
        provider.CACHE_KEY_CHANGED,
        provider.BREAKPOINT_TOO_FAR,
        provider.CACHE_EXPIRED,
        provider.PROVIDER_EVICTED,
    }
    assert charged == set(causes.BY_NAME)
    assert causes.SIDE_CALL == SIDE_CALL


def test_the_page_and_the_report_read_the_table() -> None:
    assert HTML_COLOURS == {c.name: c.colour for c in causes.CAUSES}
    css = _cause_css()
    for c in causes.CAUSES:
        assert f".b-{c.name} {{ background: {c.colour}; }}" in css
        assert (f".chip.b-{c.name}" in css) == c.light_text
    for c in causes.CAUSES:
        if c.group == causes.SERVER:
            f = {
                "kind": "server_cache_loss",
                "model": "m",
                "rows": [1],
                "evidence": {"kind": c.name},
            }
            said, fix = sentence(f)
            assert said.startswith("m ") and fix == c.fix
        if c.group == causes.CLIENT:
            f = {
                "kind": "prefix_break",
                "client": "x",
                "rows": [1],
                "evidence": {"break_cause": c.name},
            }
            said, fix = sentence(f)
            assert c.did in said and fix == c.fix


def test_an_unknown_cause_reads_as_its_name() -> None:
    assert causes.words("from_a_newer_recording") == "from_a_newer_recording"


# llama-server's and Ollama's own settings: never a fix on another server.
LLAMA_FLAGS = re.compile(
    r"llama-server|-np\b|--swa-full|--ctx-checkpoints|--checkpoint-min-step|--cache-ram|"
    r"--reasoning-preserve|\s-c\b|keep_alive|OLLAMA_"
)


def test_a_shared_cache_gets_its_own_servers_fix() -> None:
    """Every server cause has a fix for each shared-cache server, none names llama-server's
    flags, and the capacity fix fits the build: the CPU build's knobs there, the GPU's
    elsewhere (docs/analysis.md's server table)."""
    shared = (servers.VLLM, servers.VLLM_CPU, servers.SGLANG, servers.VLLM_OR_SGLANG)
    for c in causes.CAUSES:
        if c.group != causes.SERVER:
            continue
        for server in shared:
            fix = c.fix_for(server.name)
            assert fix != c.fix and fix.endswith("."), (c.name, server.name)
            assert not LLAMA_FLAGS.search(fix), (c.name, server.name, fix)
            f = {
                "kind": "server_cache_loss",
                "model": "m",
                "rows": [1],
                "evidence": {"kind": c.name, "server": server.name},
            }
            assert sentence(f)[1] == fix
        # llama-server and servers llmp cannot tell keep the general fix.
        assert c.fix_for(servers.LLAMA_SERVER.name) == c.fix_for(None) == c.fix
    capacity = causes.BY_NAME[causes.SERVER_CAPACITY]
    cpu, gpu = capacity.fix_for(servers.VLLM_CPU.name), capacity.fix_for(servers.VLLM.name)
    assert "VLLM_CPU_KVCACHE_SPACE" in cpu and "--kv-cache-memory-bytes" in cpu
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu and "--gpu-memory-utilization" in gpu
    assert "--mem-fraction-static" in capacity.fix_for(servers.SGLANG.name)


def test_context_advice_names_the_servers_own_setting() -> None:
    """After a refusal for the context, or in context_overflow's fix: vLLM's and
    SGLang's own setting, llama-server's -c only where the server may be llama-server."""
    from llmp.analysis import advice
    from llmp.analysis.findings.context_overflow import ContextOverflow

    for server, knob in (
        (servers.VLLM, "--max-model-len"),
        (servers.VLLM_CPU, "--max-model-len"),
        (servers.SGLANG, "--context-length"),
        (servers.VLLM_OR_SGLANG, "--max-model-len"),
    ):
        tip = advice.cut_after_context_error(True, None, server.name)["text"]
        assert knob in tip and not LLAMA_FLAGS.search(tip), tip
        f = {
            "kind": "context_overflow",
            "model": "m",
            "rows": [],
            "evidence": {"refused": 1, "truncated": 1, "server": server.name},
        }
        fix = ContextOverflow.sentence(f)[1]
        assert knob in fix and not LLAMA_FLAGS.search(fix), fix
    for server_name in (servers.LLAMA_SERVER.name, None):
        assert "llama-server -c" in advice.cut_after_context_error(True, None, server_name)["text"]
