"""Offline batch generation from a zipserv-compressed checkpoint with vLLM's ``LLM``.

    python examples/offline_batch.py ./my-model-zipserv          # a compressed directory
    python examples/offline_batch.py ./my-model-bf16 --pack      # BF16 dir, compressed while loading
    python examples/offline_batch.py                             # builds + compresses the tiny test model

A compressed directory (``zipserv compress SRC DST``) declares
``quant_method: zipserv`` in its config.json, so vLLM picks the plugin with no
flag. ``ZIPSERV_MODE=exact`` makes outputs bit-identical to the BF16 model.
On CPU, set a KV-cache size (here ``kv_cache_memory_bytes``) or vLLM refuses
to start.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="checkpoint directory (default: build the tiny test model)")
    ap.add_argument("--pack", action="store_true", help="BF16 checkpoint: compress it while loading")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fastest start on CPU

    tmp = None
    model = args.model
    if model is None:
        from zipserv_vllm.checkpoint import compress_checkpoint
        from zipserv_vllm.testing.tiny_model import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="zipserv-example-")
        bf16 = build_tiny_model(Path(tmp.name) / "bf16")
        if args.pack:
            model = str(bf16)
        else:
            model = str(compress_checkpoint(bf16, Path(tmp.name) / "zs", progress=False).dst)

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, quantization="zipserv" if args.pack else None, dtype="bfloat16",
              max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Lossless compression means", "Hello, my name is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for o in outs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
