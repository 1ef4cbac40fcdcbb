"""End-to-end demo: ``python -m zipserv_vllm.demo``.

1. builds the embedded tiny Llama (random weights, offline, a few seconds);
2. compresses it into a zipserv checkpoint (``zipserv compress``'s code);
3. starts vLLM's OpenAI-compatible server on it (``python -m zipserv_vllm.serve``,
   the plugin is detected from config.json);
4. asks one chat question and prints the answer (gibberish: the weights are random)
   and the weight memory the plugin saved, as it logged it;
5. stops the server.

Options: ``--workdir DIR`` (default: a temporary directory), ``--mode fast|exact``,
``--timeout SECONDS`` for the server start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path


def _chat(port: int, question: str) -> str:
    body = json.dumps({"model": "zipserv-demo", "messages": [{"role": "user", "content": question}],
                       "max_tokens": 24, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipserv_vllm.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--mode", choices=("fast", "exact"), default=None, help="ZIPSERV_MODE for the server")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server")
    args = ap.parse_args(argv)

    from .checkpoint import compress_checkpoint
    from .serve import free_port, start_server, stop_server, wait_ready
    from .testing.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="zipserv-demo-") as tmp:
        work = Path(args.workdir or tmp)
        print(f"[1/4] building the tiny Llama in {work / 'tiny-bf16'}", flush=True)
        bf16 = build_tiny_model(work / "tiny-bf16", "llama")
        print("[2/4] compressing it (lossless, every weight checked bit for bit)", flush=True)
        rep = compress_checkpoint(bf16, work / "tiny-zipserv", progress=False, overwrite=True)
        del rep
        port = free_port()
        log_path = work / "server.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if args.mode:
            env["ZIPSERV_MODE"] = args.mode
        print(f"[3/4] starting the vLLM OpenAI server on 127.0.0.1:{port} (log: {log_path})", flush=True)
        with open(log_path, "w") as log:
            proc = start_server(work / "tiny-zipserv", port, ["--served-model-name", "zipserv-demo",
                                                              "--enforce-eager", "--max-model-len", "256",
                                                              "--kv-cache-memory-bytes", str(64 << 20)], log, env)
            try:
                wait_ready(proc, port, args.timeout)
                question = "What does a lossless weight format keep?"
                print(f"[4/4] asking: {question}", flush=True)
                answer = _chat(port, question)
                print(f"answer (random tiny model, so gibberish): {answer!r}")
            except Exception as exc:
                print(f"error: {exc}; server log: {log_path}", file=sys.stderr)
                stop_server(proc)
                if not args.workdir:
                    print(log_path.read_text()[-3000:], file=sys.stderr)
                return 1
            finally:
                stop_server(proc)
        m = re.search(r"zipserv: (\d+) layers compressed .*?; arena (\d+) page\(s\), ([\d.]+) MiB allocated for "
                      r"([\d.]+) MiB of BF16 weights \(([\d.]+)x, ([\d.]+) MiB saved\), mode (\w+)", log_path.read_text())
        if m:
            layers, pages, comp, bf, ratio, saved, mode = m.groups()
            print(f"weights: {layers} layers held in {comp} MiB ({pages} arena page(s)) instead of {bf} MiB BF16: "
                  f"{ratio}x smaller, {saved} MiB saved (mode {mode})")
        else:
            print("weights: the server log has no zipserv memory line (was the plugin loaded?)", file=sys.stderr)
            return 1
        print("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
