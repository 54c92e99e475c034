"""The request shapes of the servers' `/tokenize` endpoints, named once.

`format.token_counts` builds the requests; `apis.servers` says which server speaks
which.  Apart from both so that knowing a server's shape loads no HTTP client.
"""

from __future__ import annotations

CONTENT = "content"
"""llama-server's: `{"content", "add_special", "parse_special", "with_pieces"}`."""
PROMPT = "prompt"
"""vLLM's and SGLang's: `{"prompt", "add_special_tokens"}`, and no model (each server
then counts with the one it serves, where a name it does not serve would be a 404)."""

__all__ = ["CONTENT", "PROMPT"]
