"""Start vLLM's OpenAI-compatible server on a zipserv checkpoint and query it with the openai client.

    python examples/serve_and_query.py ./my-model-zipserv
    python examples/serve_and_query.py ./my-model-bf16 --pack     # adds --quantization zipserv
    python examples/serve_and_query.py                            # tiny test model, compressed here

The server is the one ``vllm serve`` runs, started as
``python -m zipserv_vllm.serve MODEL [vllm serve options]`` (the CPU wheel's
``vllm`` console script is broken). It listens on 127.0.0.1 on a free port and
is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--pack", action="store_true", help="BF16 checkpoint: --quantization zipserv")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()

    from openai import OpenAI

    from zipserv_vllm.serve import free_port, start_server, stop_server, wait_ready

    tmp = tempfile.TemporaryDirectory(prefix="zipserv-example-")
    model = args.model
    if model is None:
        from zipserv_vllm.checkpoint import compress_checkpoint
        from zipserv_vllm.testing.tiny_model import build_tiny_model

        bf16 = build_tiny_model(Path(tmp.name) / "bf16")
        model = str(bf16) if args.pack else str(compress_checkpoint(bf16, Path(tmp.name) / "zs", progress=False).dst)
    port = free_port()
    extra = ["--served-model-name", "zs", "--enforce-eager", "--max-model-len", "256",
             "--kv-cache-memory-bytes", str(64 << 20)] + (["--quantization", "zipserv"] if args.pack else [])
    log_path = Path(tmp.name) / "server.log"
    with open(log_path, "w") as log:
        proc = start_server(model, port, extra, log, dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        try:
            wait_ready(proc, port, args.timeout)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", timeout=120)
            print("models:", [m.id for m in client.models.list().data])
            c = client.completions.create(model="zs", prompt="The capital of France is", max_tokens=16, temperature=0)
            print("completion:", repr(c.choices[0].text))
            stream = client.completions.create(model="zs", prompt="def fibonacci(n):", max_tokens=16,
                                               temperature=0, stream=True)
            print("streamed:", repr("".join(ch.choices[0].text for ch in stream if ch.choices)))
            chat = client.chat.completions.create(model="zs", messages=[{"role": "user", "content": "Hi!"}],
                                                  max_tokens=16, temperature=0)
            print("chat:", repr(chat.choices[0].message.content))
        finally:
            stop_server(proc)
    for line in log_path.read_text().splitlines():
        if "zipserv:" in line and "layers compressed" in line:
            print(line.split("zipserv:", 1)[1].strip())
    tmp.cleanup()


if __name__ == "__main__":
    main()
