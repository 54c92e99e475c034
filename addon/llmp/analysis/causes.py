"""Every loss cause, one entry each: its name, group, words, fix and colour.

A lost token is charged to one cause (`Loss.cause`, `time.by_cause`).  The
readable report, the HTML page, the live view and the findings all describe a
cause from this table, so a new cause is one `Cause(...)` below: a cause
missing a field fails `tests/analysis/test_causes.py`, not silently on a page
that prints its raw name in grey.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmp.apis import providers
from llmp.apis.servers import SGLANG, VLLM, VLLM_CPU, VLLM_OR_SGLANG

CLIENT = "client"
"""The harness changed its prompt (its own finding: `prefix_break`)."""
EXTERNAL = "external"
"""Something else that ran on the server took the cache (an eviction finding)."""
SERVER = "server"
"""The server lost or could not use its cache by itself (`server_cache_loss`)."""
PROVIDER = "provider"
"""A cloud provider's cache rules dropped it (R35): each such cause is a finding kind of its
own name.  `breakpoint_too_far` is charged to the client (`lost_client`: the client placed
its breakpoints), `cache_expired` and `provider_evicted` to the provider (`lost_external`)."""
GROUPS = (CLIENT, EXTERNAL, SERVER, PROVIDER)


@dataclass(frozen=True, slots=True)
class Cause:
    """One loss cause, as every part of the report describes it."""

    name: str
    group: str
    words: str
    """What happened, for the loss-by-cause table and the live view's warning."""
    fix: str
    """What would stop it, as the finding's fix says it (the general fix; a
    recognised harness's own advice may replace it)."""
    colour: str
    """Its colour on the HTML page (#RRGGBB, Okabe-Ito and Tol palettes)."""
    light_text: bool = False
    """Chip text is white on this colour (a WCAG contrast of at least 4.5)."""
    did: str = ""
    """Client causes: what the harness did, for the `prefix_break` sentence."""
    story: str = ""
    """Server causes: the `server_cache_loss` sentence, with {model}, {times}, {lost}."""
    by_server: tuple[tuple[str, str], ...] = ()
    """The fix where a server program has its own (`apis.servers.Server.name`, fix):
    a finding on vLLM never names llama-server's flags."""

    def fix_for(self, server: str | None) -> str:
        """The fix for the server that answered (its name), else the general one."""
        for name, fix in self.by_server:
            if name == server:
                return fix
        return self.fix


SYSTEM_CHANGED = "system_changed"
TOOLS_CHANGED = "tools_changed"
HISTORY_REWRITTEN = "history_rewritten"
SIDE_CALL = "side_call"
OTHER_CONVERSATION = "other_conversation"
OTHER_MODEL = "other_model"
SERVER_EMPTY = "server_empty"
SERVER_HEAD_ONLY = "server_head_only"
SERVER_ROLLBACK = "server_rollback"
SERVER_NO_ROLLBACK = "server_no_rollback"
SERVER_CAPACITY = "server_capacity"
SERVER_TEMPLATE = "server_template"
SETTINGS_CHANGED = "settings_changed"
MODEL_CHANGED = "model_changed"
CACHE_KEY_CHANGED = "cache_key_changed"
BREAKPOINT_TOO_FAR = "breakpoint_too_far"
CACHE_EXPIRED = "cache_expired"
PROVIDER_EVICTED = "provider_evicted"

SWA_FIX = (
    "The model's cache cannot go back to an earlier position (a sliding-window or "
    "hybrid/recurrent model): llama-server re-reads from 0 or from its last context "
    "checkpoint before the change. For a sliding-window model (Gemma 3 and 4, gpt-oss, "
    "Command-A) start llama-server with --swa-full (more KV memory); for a hybrid model "
    "(Qwen 3.5 and 3.6, Qwen3-Next, Granite 4 H, LFM2) keep more checkpoints closer "
    "together (--ctx-checkpoints, --checkpoint-min-step); and keep the prompt stable "
    "before the change, so that there is nothing to go back to."
)

_SHARED = "The server keeps every request's prompt in one cache until its KV memory runs short"
_VLLM_MEMORY = (
    "give vLLM's cache more memory (a higher --gpu-memory-utilization, or "
    "--kv-cache-memory-bytes; --kv-cache-dtype fp8 halves each token's size), a shorter "
    "--max-model-len, or run fewer conversations at once (--max-num-seqs)"
)
_VLLM_CPU_MEMORY = (
    "give vLLM's cache more host memory: VLLM_CPU_KVCACHE_SPACE=N (N whole GiB) or "
    "--kv-cache-memory-bytes (the variable wins when both are set; on the CPU build "
    "--gpu-memory-utilization is a share of host RAM, ignored once either is set), a "
    "shorter --max-model-len, or run fewer conversations at once (--max-num-seqs)"
)
_SGLANG_MEMORY = (
    "give SGLang's cache more memory (a higher --mem-fraction-static, or --max-total-tokens), "
    "a shorter --context-length, or run fewer conversations at once (--max-running-requests)"
)
_EITHER_MEMORY = (
    "give the cache more memory (vLLM --gpu-memory-utilization or --kv-cache-dtype fp8, "
    "SGLang --mem-fraction-static), a shorter --max-model-len / --context-length, or run "
    "fewer conversations at once"
)
_MEMORY = (
    (VLLM.name, _VLLM_MEMORY),
    (VLLM_CPU.name, _VLLM_CPU_MEMORY),
    (SGLANG.name, _SGLANG_MEMORY),
    (VLLM_OR_SGLANG.name, _EITHER_MEMORY),
)
"""What gives a shared cache more room, per server program: where every shared-cache
fix ends, since there a loss nothing else explains is the cache's memory."""


def _shared(fix: str) -> tuple[tuple[str, str], ...]:
    """`fix` for each shared-cache server, its memory advice appended."""
    return tuple((name, f"{fix}; {memory}.") for name, memory in _MEMORY)


def _shared_reset() -> tuple[tuple[str, str], ...]:
    """`server_empty` on a shared cache: no slot to land on, no model unloaded when idle."""
    vllm = (
        "--no-enable-prefix-caching turns it off; /reset_prefix_cache, a development "
        "endpoint, empties it"
    )
    reset = {
        VLLM.name: vllm,
        VLLM_CPU.name: vllm,
        SGLANG.name: "--disable-radix-cache turns it off; /flush_cache empties it",
        VLLM_OR_SGLANG.name: "vLLM --no-enable-prefix-caching or SGLang --disable-radix-cache "
        "turn it off; vLLM's /reset_prefix_cache or SGLang's /flush_cache empty it",
    }
    return tuple(
        (
            name,
            "Look for server restarts, the prefix cache turned off or emptied "
            f"({reset[name]}), or a conversation's requests spread over several replicas, "
            "each with its own cache (route each conversation to one replica).",
        )
        for name, _ in _MEMORY
    )


def _template() -> tuple[tuple[str, str], ...]:
    """`server_template` on vLLM and SGLang: the template's kwargs, their way."""
    head = (
        "The model's chat template renders the replies since the previous user message "
        "otherwise once a new one arrives (Qwen 3.x and Gemma 4 drop their reasoning), so "
        "every user turn re-reads them. Where the template supports it, keep the reasoning "
        'in the history: send chat_template_kwargs {"preserve_thinking": true} with each '
        "request"
    )
    vllm = f"{head} (or start vLLM with --default-chat-template-kwargs); otherwise it is "
    vllm += "the template's design."
    other = f"{head}; otherwise it is the template's design."
    return (
        (VLLM.name, vllm),
        (VLLM_CPU.name, vllm),
        (SGLANG.name, other),
        (VLLM_OR_SGLANG.name, other),
    )


_OPENAI_OVERFLOW = providers.openai_overflow_per_minute()
_LOOKBACK = providers.anthropic_lookback_blocks()

CAUSES: tuple[Cause, ...] = (
    Cause(
        SYSTEM_CHANGED,
        CLIENT,
        "system prompt changed",
        "Keep the system prompt byte-identical between turns: move dates, times, directory "
        "listings and other changing text into the newest message.",
        "#D55E00",
        did="changed its system prompt",
    ),
    Cause(
        TOOLS_CHANGED,
        CLIENT,
        "tool definitions changed",
        "Send the same tools, in the same order and with the same descriptions, on every turn.",
        "#E69F00",
        did="changed its tool definitions",
    ),
    Cause(
        HISTORY_REWRITTEN,
        CLIENT,
        "earlier messages rewritten",
        "Only append to the history: do not edit, reorder or drop earlier messages; if the "
        "context must shrink, compact rarely and in big steps.",
        "#CC79A7",
        did="rewrote earlier messages",
    ),
    Cause(
        SETTINGS_CHANGED,
        CLIENT,
        "cache settings changed",
        "Keep the settings that are part of the cached prefix the same for the whole "
        "conversation: on Anthropic tool_choice, the thinking settings, images and the "
        "anthropic-beta values; on OpenAI reasoning.effort, text.verbosity, text.format, "
        "parallel_tool_calls and service_tier.",
        "#DDCC77",
        did="changed settings that are part of the cached prefix",
    ),
    Cause(
        MODEL_CHANGED,
        CLIENT,
        "the conversation went on with another model",
        "A provider caches per model: a conversation that moves to another model reads its "
        "whole prompt again. Switch models between conversations, not inside one.",
        "#CC6677",
        did="went on with another model",
    ),
    Cause(
        CACHE_KEY_CHANGED,
        CLIENT,
        "prompt_cache_key changed",
        "Keep one prompt_cache_key per conversation (not per request, and not one for a "
        "whole account): OpenAI routes by the prompt's start and the key, so a new key is a "
        "cold machine.",
        "#EE7733",
        did="changed its prompt_cache_key",
    ),
    Cause(
        BREAKPOINT_TOO_FAR,
        PROVIDER,
        "the last cache entry was beyond the breakpoint's lookback",
        "Put a cache_control breakpoint on the last block of every request (or a breakpoint "
        f"within {_LOOKBACK} blocks of the previous one): the API looks back at most "
        f"{_LOOKBACK} blocks from each breakpoint for an entry to read.",
        "#88CCEE",
    ),
    Cause(
        CACHE_EXPIRED,
        PROVIDER,
        "the cache entry expired",
        "The entry outlived its time-to-live between two turns (Anthropic: 5 minutes, or an "
        'hour with "ttl": "1h"; OpenAI: the retention the response reports): ask for a '
        "longer time-to-live where the gaps are longer.",
        "#44AA99",
    ),
    Cause(
        PROVIDER_EVICTED,
        PROVIDER,
        "the provider dropped the cache entry",
        "The prefix was the same, within its time-to-live and the lookback, and still not "
        "read: the provider evicted it or routed the request elsewhere. Nothing on the "
        "client's side changes that, but on OpenAI more than about "
        f"{_OPENAI_OVERFLOW} requests a minute on one prefix and prompt_cache_key overflow "
        "to other machines: keep one prompt_cache_key per conversation, not one for a whole "
        "account.",
        "#117733",
        light_text=True,
    ),
    Cause(
        SIDE_CALL,
        EXTERNAL,
        "side-calls evicted the cache",
        "Give side-calls their own slot (llama-server -np 2 with a larger -c) or their own "
        "model on another server.",
        "#0072B2",
        light_text=True,
    ),
    Cause(
        OTHER_CONVERSATION,
        EXTERNAL,
        "other conversations evicted the cache",
        "Give each agent its own slot (llama-server -np N with -c large enough for N "
        "contexts), or run them one at a time.",
        "#56B4E9",
    ),
    Cause(
        OTHER_MODEL,
        EXTERNAL,
        "another model ran in between",
        "Keep both models loaded (OLLAMA_MAX_LOADED_MODELS, llama-swap groups), or serve "
        "each model from its own server.",
        "#009E73",
    ),
    Cause(
        SERVER_EMPTY,
        SERVER,
        "server lost its whole cache",
        "Look for server restarts, the model being unloaded when idle (Ollama's keep_alive, "
        "5 min by default), or requests landing on another slot (llama-server -np > 1).",
        "#882255",
        light_text=True,
        story="{model} lost its whole cache {times} with nothing else running in between: {lost}.",
        by_server=_shared_reset(),
    ),
    Cause(
        SERVER_HEAD_ONLY,
        SERVER,
        "server kept only the head",
        "The server restored only a shared head (a system prompt from another slot or a "
        "prompt cache): give each agent its own slot and enough --cache-ram.",
        "#F0E442",
        story="{model} kept only the start of the prompt {times}: {lost}.",
        by_server=_shared(
            "The shared cache kept only the start of the prompt: its later blocks were "
            "evicted while memory was short (the least recently used go first, a prompt's "
            "last blocks before its first)"
        ),
    ),
    Cause(
        SERVER_ROLLBACK,
        SERVER,
        "server re-processed the tail",
        "On SWA or hybrid models llama-server restores from checkpoints (try --swa-full or "
        "more --ctx-checkpoints); a chat template that re-renders earlier turns, for example "
        "by dropping reasoning, does the same.",
        "#332288",
        light_text=True,
        story="{model} re-processed the end of the cached prompt {times}: {lost}.",
        by_server=_shared(
            "The shared cache lost the end of the cached prompt: its last blocks were "
            "evicted while memory was short, or the chat template rendered earlier turns "
            "otherwise"
        ),
    ),
    Cause(
        SERVER_NO_ROLLBACK,
        SERVER,
        "the model's cache could not roll back",
        SWA_FIX,
        "#999933",
        story="{model} could not return its cache to where the prompt changed {times}, and "
        "re-read what came before the change too: {lost}.",
        by_server=_shared(
            "The server re-read from before where the prompt changed: keep the prompt stable "
            "before the change, so that there is nothing to go back to"
        ),
    ),
    Cause(
        SERVER_TEMPLATE,
        SERVER,
        "the chat template re-rendered earlier replies",
        "The model's chat template renders the replies since the previous user message "
        "otherwise once a new one arrives (Qwen 3.x and Gemma 4 drop their reasoning; "
        "llama.cpp #21912), so every user turn re-reads them. Where the template supports "
        "it (llama-server's /props: chat_template_caps.supports_preserve_reasoning), keep "
        "the reasoning in the history: llama-server --reasoning-preserve (the default of "
        "recent builds; --no-reasoning-preserve turns it off) or, on older builds, "
        "--chat-template-kwargs '{\"preserve_thinking\": true}'; otherwise it is the "
        "template's design.",
        "#661100",
        light_text=True,
        story="{model} re-read the replies since the previous user message {times}, because "
        "its chat template rendered them otherwise: {lost}.",
        by_server=_template(),
    ),
    Cause(
        SERVER_CAPACITY,
        SERVER,
        "the shared cache ran short of memory",
        f"{_SHARED}, so what ran in between did not evict by itself: {_EITHER_MEMORY}.",
        "#AA4499",
        light_text=True,
        story="{model} lost the conversation from its shared prefix cache {times} while other "
        "requests filled its memory: {lost}.",
        by_server=_shared(f"{_SHARED}, so what ran in between did not evict by itself"),
    ),
)

BY_NAME: dict[str, Cause] = {c.name: c for c in CAUSES}
CLIENT_CAUSES = tuple(c.name for c in CAUSES if c.group == CLIENT)
EXTERNAL_CAUSES = tuple(c.name for c in CAUSES if c.group == EXTERNAL)
SERVER_CAUSES = tuple(c.name for c in CAUSES if c.group == SERVER)
PROVIDER_CAUSES = tuple(c.name for c in CAUSES if c.group == PROVIDER)
WORDS: dict[str, str] = {c.name: c.words for c in CAUSES}
COLOURS: dict[str, str] = {c.name: c.colour for c in CAUSES}


def words(cause: str) -> str:
    """A cause as a person reads it; an unknown one (a newer recording) by its name."""
    known = BY_NAME.get(cause)
    return known.words if known is not None else cause
