"""zipserv under vLLM's default compilation (torch.compile with Inductor) equals the BF16 model.

``vllm serve`` without ``--enforce-eager`` compiles the model's forward with
dynamo (``fullgraph=True``: a graph break is an error, so a passing run proves
zipserv's layers were traced) and Inductor, which fuses the ops around each
GEMM and keeps some intermediates in fp32 depending on what it can fuse. Exact
mode must still give the BF16 model's greedy tokens and logprobs bit for bit,
both compiled the default way: for a dense model (Qwen2-style: tied
embeddings, q/k/v biases, a 700-wide MLP) and a mixture of experts
(Qwen3-MoE-style), pre-compressed and packed at load; fast mode stays within
its bound.

The compile cache: vLLM keeps compiled graphs on disk under a key of its
config and the traced source files. Process A (cold cache) runs the six engines
above, three of each model in one process, and a Mixtral-style model's BF16,
exact and fast engines, both packed at load (one process for every compiled
engine: Inductor's in-process caches make each engine after the first cheaper); process B then finds the cache warm:
the same configurations must find their own entries and give the same bits, and
both models in fast mode (only ``ZIPSERV_MODE`` differs) must get entries of
their own. What is tested is the key: on vLLM 0.32 with torch 2.13, loading a
saved graph fails for every model, BF16 included ("'function' object has no
attribute 'finalize_loading'"), and vLLM compiles again, so no saved graph is
replayed here (test_config.py checks the by-name MoE lookup that a replayed
graph relies on).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zs_e2e import FAST_LOGPROB_TOL, MOE_FAST_MAX_TOL, MOE_FAST_MEAN_TOL, e2e_environ, max_score_diff, mean_score_diff

HERE = Path(__file__).parent
THREADS = min(2, os.cpu_count() or 1)


def _worker(runs: list, cache: Path, out: Path, aot_root: Path) -> dict:
    spec = out.with_suffix(".spec.json")
    spec.write_text(json.dumps({"runs": runs, "aot_root": str(aot_root)}))
    # two OpenMP threads (scripts/test.sh gives each pytest worker one): the codec inside a compiled
    # engine must run on all of torch's threads
    env = dict(e2e_environ(), VLLM_CACHE_ROOT=str(cache), OMP_NUM_THREADS=str(THREADS),
               PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    proc = subprocess.run([sys.executable, str(HERE / "compile_worker.py"), str(spec), str(out)], env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"compile worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(qwen2_dirs, tmp_path_factory):
    """Process A (cold compile cache) and process B (the same cache, warm)."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    root = tmp_path_factory.mktemp("compile")
    dense, dense_zs = (str(p) for p in qwen2_dirs)
    moe = build_zoo_model(root / "moe-bf16", "qwen3-moe")
    moe_zs = str(compress_checkpoint(moe, root / "moe-zs", progress=False).dst)
    moe = str(moe)
    mixtral = str(build_zoo_model(root / "mixtral-bf16", "mixtral"))
    cache = root / "vllm-cache"
    aot_root = cache / "torch_compile_cache" / "torch_aot_compile"
    # vLLM's inspections of the model classes (not what is tested here: the compile cache is) from
    # the user's cache root, as a real second start finds them; without them process A inspects
    # each architecture in a subprocess first (~9 s each here)
    from vllm import envs

    seen = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    if seen.is_dir():
        shutil.copytree(seen, cache / "modelinfos")
    a = _worker([
        {"name": "dense_base", "model": dense, "mode": "exact", "score": "self"},
        {"name": "dense_exact", "model": dense_zs, "mode": "exact"},
        {"name": "dense_pack", "model": dense, "mode": "exact", "quantization": True},
        {"name": "moe_base", "model": moe, "mode": "exact", "score": "self"},
        {"name": "moe_exact", "model": moe_zs, "mode": "exact"},
        {"name": "moe_pack", "model": moe, "mode": "exact", "quantization": True},
        {"name": "mixtral_base", "model": mixtral, "mode": "exact", "score": "self"},
        # (each fast engine before any other zipserv engine of its model in the process: see
        # test_fast_mode_compiled_moe_layers_run_in_cpp)
        {"name": "mixtral_fast", "model": mixtral, "mode": "fast", "quantization": True, "score": "mixtral_base"},
        {"name": "mixtral_pack", "model": mixtral, "mode": "exact", "quantization": True},
    ], cache, root / "a.json", aot_root)
    b = _worker([
        {"name": "moe_fast", "model": moe_zs, "mode": "fast", "score": a["moe_base"]["score_seqs"]},
        {"name": "moe_exact", "model": moe_zs, "mode": "exact"},
        {"name": "dense_exact", "model": dense_zs, "mode": "exact"},
        {"name": "dense_fast", "model": dense_zs, "mode": "fast", "score": a["dense_base"]["score_seqs"]},
    ], cache, root / "b.json", aot_root)
    return a, b


def _same(run, base):
    assert run["tokens"] == base["tokens"]
    assert run["logprobs"] == base["logprobs"]  # exact float equality


def test_compiled_by_inductor(compiled):
    a, b = compiled
    for run in (*a.values(), *b.values()):
        assert run["compilation"]["backend"] == "inductor", run["compilation"]
        assert run["compilation"]["mode"] != "NONE", run["compilation"]
        # the codec (decode, tile checks, pack at load) runs on all of torch's OpenMP threads in the
        # engine, not on the one core an affinity mask or a pinned worker thread would suggest
        th = run["memory"]["codec_threads"]
        assert th["default"] == th["torch"] == th["used"] == THREADS, th


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_exact_mode_compiled_identical_to_bf16_compiled(compiled, model):
    a, b = compiled
    base = a[f"{model}_base"]
    for run in (a[f"{model}_exact"], a[f"{model}_pack"], b[f"{model}_exact"]):
        _same(run, base)
    layers = a[f"{model}_exact"]["memory"]["layers_compressed"]
    assert layers > 0 and a[f"{model}_pack"]["memory"]["layers_compressed"] == layers


def test_compile_cache_keyed_by_configuration(compiled):
    """Each configuration of process A compiled into its own cache entry; in process B the same
    configurations found theirs (no new entry), and fast mode (another ZIPSERV_MODE, nothing else)
    got a new one rather than the exact-mode entry."""
    a, b = compiled
    assert all(len(r["new_aot_dirs"]) == 1 for r in a.values()), {k: r["new_aot_dirs"] for k, r in a.items()}
    assert len({r["new_aot_dirs"][0] for r in a.values()}) == len(a)
    assert b["moe_exact"]["new_aot_dirs"] == [] and b["dense_exact"]["new_aot_dirs"] == []
    assert len(b["moe_fast"]["new_aot_dirs"]) == 1 and len(b["dense_fast"]["new_aot_dirs"]) == 1


def test_mixtral_packed_at_load_compiled(compiled):
    """The Mixtral-style model (the zoo's: 4 experts, 2 layers) packed at load under Inductor: the MoE
    layers were traced (fullgraph), exact mode equals compiled BF16 bit for bit, fast mode stays within
    the MoE bounds, and every expert's w13 and w2 is held compressed."""
    a, _ = compiled
    base, exact, fast = a["mixtral_base"], a["mixtral_pack"], a["mixtral_fast"]
    for run in (exact, fast):
        experts = [k for k in run["memory"]["parts"] if ".block_sparse_moe.experts." in k]
        assert len(experts) == 2 * 4 * 2, experts  # w13 and w2 of 4 experts in 2 layers
    _same(exact, base)
    assert mean_score_diff(fast, base) <= MOE_FAST_MEAN_TOL, mean_score_diff(fast, base)
    assert max_score_diff(fast, base) <= MOE_FAST_MAX_TOL, max_score_diff(fast, base)


def test_fast_mode_compiled_within_bound(compiled):
    a, b = compiled
    assert 0 < max_score_diff(b["dense_fast"], a["dense_base"]) <= FAST_LOGPROB_TOL
    assert mean_score_diff(b["moe_fast"], a["moe_base"]) <= MOE_FAST_MEAN_TOL
    assert max_score_diff(b["moe_fast"], a["moe_base"]) <= MOE_FAST_MAX_TOL


def test_fast_mode_compiled_moe_layers_run_in_cpp(compiled):
    """Compiled fast mode on an AVX512-BF16 CPU: after the first call of each MoE layer (served by
    the op's Python implementation), zipserv::moe_experts' C++ CPU kernel serves every compressed MoE
    layer of the model by name, as vLLM's own MoE kernel is called from the compiled graph. (Only
    while the name is unambiguous: a compiled engine's model outlives its shutdown in this process,
    so a later engine's layers of the same names stay in the Python implementation, which finds
    each in its own forward pass; hence each fast engine here runs before the other zipserv
    engines of its model.)"""
    from zipserv_vllm.kernels import cpu

    if not (cpu.available() and cpu.bf16_supported()):
        pytest.skip("the one-call MoE kernel (and so its C++ op path) needs AVX512-BF16; this CPU has none")
    a, b = compiled
    for run in (b["moe_fast"], a["mixtral_fast"]):
        rep = run["cpp_op"]
        assert rep["status"] == "C++ CPU kernel installed", rep
        assert rep["moe_layers"] and rep["moe_served"] == rep["moe_layers"], rep
    # exact mode runs vLLM's kernel, never this one (process A's exact engine is the first zipserv
    # engine of its model there, so its names were unambiguous: a wrong registration would show)
    assert a["moe_exact"]["cpp_op"]["moe_served"] == [] and a["moe_exact"]["cpp_op"]["moe_layers"]
