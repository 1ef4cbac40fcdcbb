#!/usr/bin/env python3
"""Which modules does each vLLM architecture build WITHOUT the quantization method?

A compressed checkpoint may only compress a weight whose vLLM module receives
the quantization config (zipserv then loads the ``zs_*`` arrays); any other
module has only a ``weight`` parameter and loading fails. Whether it does is
decided by each model file (``VocabParallelEmbedding(vocab, hidden)`` without
``quant_config=`` in Mixtral, with it in Llama), so this script reads the
installed vLLM's model sources (``ast``, nothing is imported or run) and writes,
per architecture, the attribute names (``embed_tokens``, ``gate``, ``score``...)
of layers constructed with no quantization config or a conditional one
(``plain``; ``mixed`` when other classes build the same name with one, e.g.
BERT's pooler ``dense`` next to its quantized encoder ``dense`` layers):

* the linear and embedding classes zipserv serves (``VocabParallelEmbedding``,
  ``ParallelLMHead``, ``*ParallelLinear``, ``ReplicatedLinear``, ``GateLinear``...)
  called without ``quant_config``, with ``quant_config=None`` or with an
  expression that may be None (``quant_config if ... else None``);
* plain ``nn.Linear`` / ``nn.Embedding``.

Imports between model files are followed (Mistral reuses Llama's classes), and
the sets are unions over everything a file can use, so the table errs towards
"keep BF16", which is always safe.

    python scripts/scan_vllm_layers.py            # rewrite zipserv_vllm/checkpoint/vllm_layers.json
    python scripts/scan_vllm_layers.py --check    # exit 1 if the table is not the installed vLLM's

tests/test_vllm_layer_table.py runs ``--check`` where vLLM is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "zipserv_vllm" / "checkpoint" / "vllm_layers.json"
QUANTIZABLE = {"VocabParallelEmbedding", "ParallelLMHead", "ColumnParallelLinear", "RowParallelLinear",
               "QKVParallelLinear", "MergedColumnParallelLinear", "ReplicatedLinear", "GateLinear",
               "QKVCrossParallelLinear", "MergedReplicatedLinear"}
PLAIN = {"Linear", "Embedding"}  # torch.nn


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _quantized(node: ast.Call) -> bool:
    """True when the call certainly passes a (non-None) quantization config."""
    for kw in node.keywords:
        if kw.arg == "quant_config":
            v = kw.value
            if isinstance(v, ast.Constant) and v.value is None:
                return False
            return not isinstance(v, (ast.IfExp, ast.BoolOp))  # conditional: may be None
        if kw.arg is None:  # **kwargs: unknown
            return False
    return False


def _targets(node: ast.Assign | ast.AnnAssign) -> list[str]:
    tg = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.attr for t in tg if isinstance(t, ast.Attribute)]


# Shared infrastructure, not model definitions (their layers are adapters' heads and helpers).
NOT_MODELS = {"adapters", "interfaces", "interfaces_base", "utils", "registry", "vision", "module_mapping", "config"}


def scan_file(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(attribute names built without quantization, built with it, sibling model modules imported)."""
    tree = ast.parse(path.read_text())
    plain: set[str] = set()
    quant: set[str] = set()
    imports: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            mod = node.module.split(".")[0]
            if mod not in NOT_MODELS:
                imports.add(mod)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            call, names = node.value, _targets(node)
            name = _callee(call)
            if (name in QUANTIZABLE and not _quantized(call)) or name in PLAIN:
                plain.update(names)
            elif name in QUANTIZABLE:
                quant.update(names)
    return plain, quant, imports


def registry(models: Path) -> dict[str, str]:
    """architecture -> model module, from registry.py's dict literals."""
    tree = ast.parse((models / "registry.py").read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and v.elts and \
                        isinstance(v.elts[0], ast.Constant) and isinstance(v.elts[0].value, str):
                    out.setdefault(k.value, v.elts[0].value)
    return out


def build(vllm_dir: Path) -> dict:
    models = vllm_dir / "model_executor" / "models"
    files = {p.stem: p for p in models.glob("*.py")}
    scanned = {stem: scan_file(p) for stem, p in files.items()}

    def closure(stem: str) -> tuple[set[str], set[str]]:
        seen, todo, plain, quant = set(), [stem], set(), set()
        while todo:
            s = todo.pop()
            if s in seen or s not in scanned:
                continue
            seen.add(s)
            p, q, imps = scanned[s]
            plain |= p
            quant |= q
            todo.extend(imps)
        return plain, quant

    archs = {}
    for arch, mod in sorted(registry(models).items()):
        if mod in files:
            plain, quant = closure(mod)
            # "plain": always built without the quantization method; "mixed": both ways (by class)
            archs[arch] = {"plain": sorted(plain - quant), "mixed": sorted(plain & quant)}
    from vllm.version import __version__  # noqa: PLC0415  (only the version string)

    return {"vllm_version": __version__, "architectures": archs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed table instead of writing it")
    a = ap.parse_args(argv)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        print("vLLM is not installed", file=sys.stderr)
        return 2
    table = build(Path(list(spec.submodule_search_locations)[0]))
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if a.check:
        old = json.loads(OUT.read_text())
        if old["architectures"] != table["architectures"]:
            diff = sorted(k for k in set(old["architectures"]) | set(table["architectures"])
                          if old["architectures"].get(k) != table["architectures"].get(k))
            print(f"{OUT.name} is not the installed vLLM {table['vllm_version']}'s ({len(diff)} architectures "
                  f"differ, e.g. {', '.join(diff[:5])}): run scripts/scan_vllm_layers.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(table['architectures'])} architectures, vLLM {table['vllm_version']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
