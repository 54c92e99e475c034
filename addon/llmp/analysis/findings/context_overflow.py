"""`context_overflow`: prompts the server cut or refused for its context (analysis/overflow.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmp.analysis.advice import shared_context_setting
from llmp.analysis.findings.base import FindingKind, Label, Tools
from llmp.analysis.overflow import CONTEXT_OVERFLOW, Overflow
from llmp.analysis.words import n_of, short_model, value_of

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.analysis.overflow import Refusal
    from llmp.analysis.rows import Row


class ContextOverflow(FindingKind):
    """One finding per served model; `Overflow` decides which prompts were cut."""

    name = CONTEXT_OVERFLOW

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.overflow = Overflow(cfg)

    def row(self, row: Row, ex: Exchange | None) -> bool:
        # `ex` is the row's request (for Ollama's `num_ctx`); without it the
        # context size is simply not known.
        return self.overflow.row(row, ex.num_ctx if ex is not None else None)

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        self.overflow.refused(session, record_id, refusal)

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        return self.overflow.build()

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        """Prompts the server cut silently, or refused."""
        ev = f.get("evidence", {})
        model = short_model(f.get("model"))
        n_ctx = ev.get("n_ctx")
        # Ollama's requests say num_ctx; llama-server's errors say n_ctx.
        name = "num_ctx" if ev.get("n_ctx_source") == "request" else "n_ctx"
        ctx = f" ({name} {n_ctx:,})" if isinstance(n_ctx, int) else ""
        sent = value_of(ev.get("sent"))
        largest = f"{sent:,.0f} tokens" if sent is not None else "a size not recorded"
        what: list[str] = []
        fixes: list[str] = []
        server = ev.get("server")
        # vLLM and SGLang set their context their own way: never llama-server's -c.
        shared = shared_context_setting(server if isinstance(server, str) else None)
        cut = int(ev.get("truncated") or 0)
        if cut:
            what.append(_cut_text(ev, model, cut, ctx, largest))
            fixes.append(
                f"Raise the context above the largest prompt ({shared}), or make the harness "
                "compact its history before the prompt reaches the limit."
                if shared is not None
                else "Raise the context above the largest prompt (Ollama: options.num_ctx in "
                "the request, or OLLAMA_CONTEXT_LENGTH; llama-server: -c), or make the harness "
                "compact its history before the prompt reaches the limit."
            )
        refused = int(ev.get("refused") or 0)
        if refused:
            if ev.get("refused_from") == "status":
                what.append(
                    f"{model} refused {n_of(refused, 'request')} with HTTP 400 when the prompt "
                    f"grew past any it had accepted (up to {largest}); a digest recording keeps "
                    "no error body, but on "
                    f"{'this server' if shared is not None else 'llama-server'} this is a "
                    "prompt longer than the context"
                )
                fixes.append("Record with --full to see the server's own error.")
            else:
                what.append(
                    f"{model} refused {n_of(refused, 'request')} longer than its context{ctx}, "
                    f"up to {largest}; those turns failed"
                )
            fixes.insert(
                0,
                f"Start the server with a larger context ({shared}), or have the harness "
                "compact or trim its history before the prompt reaches the limit."
                if shared is not None
                else "Start the server with a larger context (llama-server -c; with -np N each "
                "slot gets a share of it), or have the harness compact or trim its history "
                "before the prompt reaches the limit.",
            )
        return "; ".join(what) + ".", " ".join(dict.fromkeys(fixes))

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        ev = f.get("evidence") or {}
        parts = []
        if ev.get("truncated"):
            parts.append(f"{ev['truncated']:,} cut silently")
        if ev.get("refused"):
            parts.append(f"{ev['refused']:,} refused")
        size = f"{n_of(int(ev.get('turns') or 0), 'turn')} over the context ({', '.join(parts)})"
        n_ctx = ev.get("n_ctx")
        if isinstance(n_ctx, int):
            name = "num_ctx" if ev.get("n_ctx_source") == "request" else "n_ctx"
            size += f", {name} {n_ctx:,}"
        return size


def _cut_text(ev: dict[str, Any], model: str, cut: int, ctx: str, largest: str) -> str:
    """The silent truncation, as the readable report says it."""
    dropped = value_of(ev.get("dropped"))
    gone = f", about {dropped:,.0f} tokens in all" if dropped else ""
    reported = ev.get("reported")
    counted = f"{reported:,}" if isinstance(reported, int) else "fewer"
    return (
        f"{model} silently dropped the start of {n_of(cut, 'prompt')} that "
        f"{'was' if cut == 1 else 'were'} longer than its context{ctx}: it counted "
        f"{counted} tokens of the largest, which was about {largest}"
        f"{gone}. The model answered without the oldest messages, or without the "
        "system prompt and tools, and no error said so"
    )


__all__ = ["CONTEXT_OVERFLOW", "ContextOverflow"]
