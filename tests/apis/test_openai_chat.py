"""`/v1/chat/completions` (`apis/openai_chat.py`): its digests (R4, R5) and counters.

The hashes are written out by hand from the rules, not computed by the code
under test.  The SSE merge (R9) has its own file, `test_merge.py`, beside the
NDJSON merge and the stream capture that share its builders.
"""

from __future__ import annotations

from typing import Any

from llmp.apis import api_by_name, api_name
from llmp.apis.base import SERVER, CountHints
from llmp.apis.openai_chat import OpenAIChat, message_digest, message_text
from llmp.format import canonical
from llmp.format.canonical import EMPTY_HASH, hash_bytes, hash_text


def request_digest(body: Any, api: str) -> Any:
    chat = api_by_name(api)
    assert chat is not None
    return chat.request_digest(body) if isinstance(body, dict) else None


response_digest = OpenAIChat().response_digest


def test_chat_api_paths() -> None:
    assert api_name("POST", "/v1/chat/completions") == "openai_chat"
    assert api_name("POST", "/chat/completions?x=1") == "openai_chat"
    assert api_name("POST", "/proxy/openai/v1/chat/completions") == "openai_chat"
    assert api_name("POST", "/api/chat") == "ollama_chat"
    assert api_name("GET", "/v1/chat/completions") == "other"
    assert api_name("POST", "/v1/completions") == "other"
    assert api_name("POST", "/api/chat/x") == "other"


def test_message_hash_covers_exactly_the_five_fields() -> None:
    msg = {"role": "user", "content": "hi", "extra": 1}
    d = message_digest(msg)
    assert d["hash"] == hash_bytes(b'["user","hi",null,null,null]')
    # an empty tool_calls array counts as missing
    assert message_digest({"role": "user", "content": "hi", "tool_calls": []})["hash"] == d["hash"]
    # Ollama's tool_name is the name
    tool = message_digest({"role": "tool", "content": "42", "tool_name": "calc"})
    assert tool["name"] == "calc"
    assert tool["hash"] == hash_bytes(b'["tool","42",null,"calc",null]')


def test_message_text_parts_and_tool_calls() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msg = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "ab"},
            {"type": "image_url", "image_url": {}},
            {"type": "text", "text": "c"},
        ],
        "tool_calls": calls,
    }
    text = message_text(msg)
    assert text == "abc" + canonical.dumps(calls).decode()
    d = message_digest(msg)
    assert d["chars"] == len(text)
    assert d["tool_calls"] == [{"id": "c1", "name": "f"}]


def test_head_tail_and_empty() -> None:
    long = "é" * 300 + "x" * 10
    d = message_digest({"role": "user", "content": long})
    assert d["chars"] == 310
    assert d["head"] == hash_text(long[:256])
    assert d["tail"] == hash_text(long[-256:])
    e = message_digest({"role": "assistant", "content": None})
    assert e["chars"] == 0 and e["head"] == EMPTY_HASH == e["tail"]


def test_request_params() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": -1,
        "max_completion_tokens": 8,
        "response_format": {"type": "text"},
        "grammar": "",
        "json_schema": {"type": "object"},
    }
    d = OpenAIChat().request_digest(body)
    assert d is not None
    assert d["params"] == {
        "max_tokens": 8,
        "response_format": False,
        "grammar": True,
        "stream": False,
    }
    assert d["tools"] == [] and d["tools_hash"] is None
    o = request_digest(
        {"model": "m", "messages": [], "format": "json", "options": {"num_predict": 5}},
        "ollama_chat",
    )
    assert o is not None
    assert o["params"] == {
        "max_tokens": 5,
        "response_format": True,
        "grammar": False,
        "stream": True,
    }
    assert request_digest([1], "openai_chat") is None


def test_tools_digest() -> None:
    tools = [
        {"type": "function", "function": {"name": "read_file", "parameters": {"b": 1.50, "a": 1}}}
    ]
    parsed = canonical.loads(canonical.record_dumps(tools))
    d = OpenAIChat().request_digest({"messages": [], "tools": parsed})
    assert d is not None
    canon = canonical.dumps(parsed[0])
    assert d["tools"] == [
        {"name": "read_file", "hash": hash_bytes(canon), "chars": len(canon.decode())}
    ]
    assert d["tools_hash"] == hash_bytes(b"[" + canon + b"]")


def test_response_digest() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "héllo",
                    "reasoning_content": "abc",
                    "tool_calls": [{"id": None, "function": {"name": "g"}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 10},
        "timings": {"cache_n": 9},
        "model": "x.gguf",
    }
    d = OpenAIChat().response_digest(body)
    assert d == {
        "usage": {"usage": {"prompt_tokens": 10}, "timings": {"cache_n": 9}, "model": "x.gguf"},
        "output": {
            "content_chars": 5,
            "reasoning_chars": 3,
            "tool_calls": [{"id": None, "name": "g"}],
        },
    }
    ollama = OpenAIChat().response_digest(
        {
            "model": "q",
            "message": {"role": "assistant", "content": "", "thinking": "hm"},
            "done": True,
            "prompt_eval_count": 5,
        }
    )
    assert ollama is not None
    assert ollama["output"]["reasoning_chars"] == 2
    assert ollama["usage"] == {"model": "q", "done": True, "prompt_eval_count": 5}


# -- the counters (docs/analysis.md §4) --------------------------------------------

counts = OpenAIChat().counts


def test_counts_llama_server_timings_first() -> None:
    """llama-server: cache_n and prompt_n are the reuse and the work, its times the prefill's."""
    c = counts(
        {
            "usage": {
                "prompt_tokens": 237,
                "completion_tokens": 35,
                "prompt_tokens_details": {"cached_tokens": 200},
            },
            "timings": {"cache_n": 236, "prompt_n": 1, "prompt_ms": 12.5, "predicted_ms": 410},
        },
        CountHints(),
    )
    assert c.prompt_tokens == (237, SERVER)
    assert c.completion_tokens == (35, SERVER)
    assert c.reused_tokens == (236, SERVER)  # timings win over usage's cached_tokens
    assert c.evaluated_tokens == (1, SERVER)
    assert c.prefill_ms == (12.5, SERVER) and c.decode_ms == (410.0, SERVER)
    assert c.load_ms is None


def test_counts_cached_tokens_then_the_difference() -> None:
    """vLLM, SGLang: cached_tokens is the reuse; the work is what is left of the prompt."""
    c = counts(
        {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}},
        CountHints(),
    )
    assert (c.reused_tokens, c.evaluated_tokens) == ((64, SERVER), (36, SERVER))
    flat = counts({"usage": {"prompt_tokens": 100, "cached_tokens": 90}}, CountHints())
    assert (flat.reused_tokens, flat.evaluated_tokens) == ((90, SERVER), (10, SERVER))


def test_counts_vllms_cache_writes() -> None:
    """vLLM 0.32's `created_cache_tokens`: what the request wrote into the cache, as the
    real CPU build sent it (prompt 355: two blocks of 128 written, 99 left out)."""
    details = {"cached_tokens": 0, "created_cache_tokens": 256, "multimodal_tokens": None}
    c = counts({"usage": {"prompt_tokens": 355, "prompt_tokens_details": details}}, CountHints())
    assert c.cache_write_tokens == (256, SERVER)
    assert (c.reused_tokens, c.evaluated_tokens) == ((0, SERVER), (355, SERVER))
    # Not sent (every other server), or not a count: not said.
    plain = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}
    assert counts(plain, CountHints()).cache_write_tokens is None
    bad = {"cached_tokens": 0, "created_cache_tokens": -1}
    assert (
        counts({"usage": {"prompt_tokens_details": bad}}, CountHints()).cache_write_tokens is None
    )


def test_counts_deepseek_hit_and_miss() -> None:
    c = counts(
        {"usage": {"prompt_cache_hit_tokens": 30, "prompt_cache_miss_tokens": 5}}, CountHints()
    )
    assert c.prompt_tokens == (35, SERVER)
    assert (c.reused_tokens, c.evaluated_tokens) == ((30, SERVER), (5, SERVER))


def test_counts_prompt_from_timings_and_completion_from_predicted_n() -> None:
    c = counts({"timings": {"cache_n": 10, "prompt_n": 4, "predicted_n": 7}}, CountHints())
    assert c.prompt_tokens == (14, SERVER)
    assert c.completion_tokens == (7, SERVER)


def test_counts_refuse_what_is_not_a_non_negative_number() -> None:
    """Absent, negative, boolean or text counters are "the server did not say"."""
    c = counts(
        {
            "usage": {"prompt_tokens": -1, "completion_tokens": True},
            "timings": {"cache_n": "5", "prompt_ms": -2.0, "predicted_ms": None},
        },
        CountHints(),
    )
    assert c.reported() == []
    assert counts({"usage": "nope", "timings": []}, CountHints()).reported() == []


def test_cache_usage_reads_each_servers_write_count() -> None:
    """R35's split: OpenAI's `cache_write_tokens`, vLLM's `created_cache_tokens`, else no
    write; the rest of the prompt is uncached."""
    api = OpenAIChat()

    def usage(**details: int) -> dict[str, Any]:
        return {"usage": {"prompt_tokens": 1000, "prompt_tokens_details": details}}

    openai = api.cache_usage(usage(cached_tokens=512, cache_write_tokens=256))
    vllm = api.cache_usage(usage(cached_tokens=512, created_cache_tokens=384))
    llama = api.cache_usage(usage(cached_tokens=900))
    assert openai is not None and (openai.read, openai.write, openai.uncached) == (512, 256, 232)
    assert vllm is not None and (vllm.read, vllm.write, vllm.uncached) == (512, 384, 104)
    assert llama is not None and (llama.read, llama.write, llama.uncached) == (900, 0, 100)
    assert api.cache_usage({"usage": {"prompt_tokens": 10}}) is None  # nothing said of the cache
    assert api.cache_usage(usage(cached_tokens=2**64)) is None  # a damaged counter
