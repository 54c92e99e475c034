"""Recordings of prompts longer than the server's context, built on `scenarios`.

* `ollama_truncating`: Ollama with a small `num_ctx` fits a longer prompt
  silently, with status 200, and reports what it kept as
  `prompt_eval_count`.  Like its `chatPrompt`, it drops the oldest messages
  after the system prompt (keeping the system prompt, the tools and the
  last message); what still does not fit its runner cuts, keeping the first
  `num_keep` tokens and the end (`how="runner"` does only that).
* `llama_refusing`: llama-server answers a prompt longer than `n_ctx` with
  HTTP 400 `exceed_context_size_error` (its real body, with `n_prompt_tokens`
  and `n_ctx`); the harness retries once, then drops its old history and
  goes on.  A full recording keeps the error body; a digest recording only
  the status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support import scenarios as sc

OLLAMA_UA = "continue/1.2"


MESSAGE_STARTS = ("<|user|>", "<|assistant|>", "<|tool|>")


@dataclass
class TruncatingOllama(sc.OllamaServer):
    """Ollama with a prompt longer than num_ctx: it drops the start, silently."""

    num_ctx: int = 2048
    num_keep: int = 4
    how: str = "messages"  # or "runner": only the token cut

    def fit(self, prompt: list[str]) -> list[str]:
        if self.how == "messages":
            body, gen = prompt[:-1], prompt[-1:]  # the generation prompt stays last
            starts = [i for i, t in enumerate(body) if t in MESSAGE_STARTS]
            if starts:
                head = body[: starts[0]]  # system prompt and tools
                segs = [body[a:b] for a, b in zip(starts, [*starts[1:], len(body)], strict=True)]
                while len(segs) > 1 and len(head) + sum(map(len, segs)) + 1 > self.num_ctx:
                    segs.pop(0)
                prompt = head + [t for seg in segs for t in seg] + gen
        if len(prompt) > self.num_ctx:
            keep = self.num_ctx - self.num_keep
            prompt = prompt[: self.num_keep] + prompt[len(prompt) - keep :]
        return prompt

    def serve(self, prompt: list[str], reply_chars: int, model: str | None = None) -> sc.Outcome:
        if len(prompt) > self.num_ctx:
            prompt = self.fit(prompt)
        return super().serve(prompt, reply_chars, model)


def ollama_truncating(
    num_ctx: int = 2048,
    in_request: bool = True,
    meaning: str = "cached",
    turns: int = 10,
    how: str = "messages",
) -> sc.Traffic:
    """An agent whose conversation outgrows Ollama's context after a few turns."""
    tr = sc.Traffic()
    srv = TruncatingOllama(meaning=meaning, num_ctx=num_ctx, how=how)
    params: dict[str, Any] = {"options": {"num_ctx": num_ctx}} if in_request else {}
    a = sc.Agent(tr, srv, model="qwen3:8b", ua=OLLAMA_UA, params=params)
    sc.work(a, turns, size=2400)
    return tr


def context_error(n_prompt: int, n_ctx: int) -> dict[str, Any]:
    """llama-server's 400 body for a prompt longer than the slot's context."""
    return {
        "error": {
            "code": 400,
            "message": f"request ({n_prompt} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n_prompt,
            "n_ctx": n_ctx,
        }
    }


def refuse(tr: sc.Traffic, agent: sc.Agent, n_ctx: int) -> dict[str, Any]:
    """Record the agent's next request refused for its context (a non-streamed 400)."""
    body = agent.body()
    n_prompt = len(sc.render(body["messages"], body.get("tools")))
    assert n_prompt > n_ctx, (n_prompt, n_ctx)
    t = tr.t
    tr.t += 40
    return tr._record(
        method="POST",
        path="/v1/chat/completions",
        ua=agent.ua,
        body=body,
        status=400,
        resp_body=context_error(n_prompt, n_ctx),
        stream=None,
        t_start=t,
        t_first=t + 6,
        t_end=t + 7,
    )


def llama_refusing(retries: int = 1) -> tuple[sc.Traffic, int, list[int]]:
    """The traffic, the server's n_ctx, and the ids of the refused requests."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua="aider/0.86.1", model="qwen")
    sc.work(a, 4, size=2000)
    largest = max(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in tr.records if r["response"]
    )
    n_ctx = largest + 200
    # The user pastes a long log: the next prompt no longer fits.
    a.messages.append({"role": "user", "content": sc.text("a long log", 6000)})
    refused = [refuse(tr, a, n_ctx)["id"] for _ in range(1 + retries)]
    # The harness gives up on the history and starts over with the last question.
    a.messages = [a.messages[0], {"role": "user", "content": sc.text("the question again", 300)}]
    a.send({"role": "assistant", "content": sc.text("an answer", 300)})
    sc.work(a, 2, seed="after")
    return tr, n_ctx, refused
