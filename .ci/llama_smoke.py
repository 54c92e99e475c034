"""Exit 0 when the real llama-server ($LLMP_LLAMA_SERVER) starts and answers one chat.

A llama.cpp built natively can use instructions the CPU lists but the VM refuses
(AMX: SIGILL on the first matrix product), so `.ci/run` asks once before the tests
rely on it, and builds a portable server when this fails.
"""

import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.real import LlamaServer, LlamaServerError  # noqa: E402

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

try:
    with LlamaServer(timeout=120) as server:
        request = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=json.dumps(BODY).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
        if server.proc is not None and server.proc.poll() is not None:
            raise LlamaServerError(f"llama-server exited with {server.proc.returncode}")
except (LlamaServerError, OSError) as exc:
    print(f"ci: llama-server smoke test failed: {str(exc)[:1500]}", file=sys.stderr)
    sys.exit(1)
print("ci: llama-server answered a chat", file=sys.stderr)
