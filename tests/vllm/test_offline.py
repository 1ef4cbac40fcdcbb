"""Offline ``LLM.generate`` through the zipserv plugin equals the BF16 model bit for bit.

One engine per (architecture, way in), all in this process: the BF16 reference,
the pre-compressed checkpoint (detected from config.json, no flag) and pack at
load (``quantization="zipserv"`` on the BF16 checkpoint). Greedy tokens and
their logprobs must be identical (exact mode, eager).
"""

from __future__ import annotations

import os

import pytest

from zs_e2e import FAST_LOGPROB_TOL, PROMPTS, e2e_env, max_score_diff as _max_score_diff, run_engine


@pytest.fixture(scope="module")
def llama_runs(llama_dirs):
    bf16, zs = llama_dirs
    with e2e_env():
        return {"base": run_engine(bf16, score="self"), "pre": run_engine(zs),
                "pack": run_engine(bf16, quantization="zipserv")}


@pytest.fixture(scope="module")
def qwen2_runs(qwen2_dirs):
    bf16, zs = qwen2_dirs
    with e2e_env():
        return {"base": run_engine(bf16, chat=False), "pre": run_engine(zs, chat=False, quantization="zipserv"),
                "pack": run_engine(bf16, chat=False, quantization="zipserv")}


def _fast_run(model, base, layout=None, **kw):
    import os

    with e2e_env():
        os.environ["ZIPSERV_MODE"] = "fast"
        if layout:
            os.environ["ZIPSERV_CPU_LAYOUT"] = layout
        try:
            return run_engine(model, chat=False, score=base["score_seqs"], **kw)
        finally:
            os.environ.pop("ZIPSERV_CPU_LAYOUT", None)


@pytest.fixture(scope="module")
def llama_fast(llama_dirs, llama_runs):
    return _fast_run(llama_dirs[0], llama_runs["base"], quantization="zipserv")


@pytest.fixture(scope="module")
def llama_fast_pre(llama_dirs, llama_runs):
    """Pre-compressed checkpoint in fast mode: v1 tiles loaded, then repacked."""
    return _fast_run(llama_dirs[1], llama_runs["base"])


@pytest.fixture(scope="module")
def llama_fast_v1(llama_dirs, llama_runs):
    """Fast mode keeping TCA-TBE v1 in memory (ZIPSERV_CPU_LAYOUT=v1): the v1 fused kernel."""
    return _fast_run(llama_dirs[1], llama_runs["base"], layout="v1")


@pytest.fixture(scope="module")
def llama_fast_corrupt(llama_dirs, llama_runs, tmp_path_factory):
    """Negative control: the pre-compressed checkpoint with ONE 64x64 tile altered
    (layer 0 o_proj, tile (0, 0): base_exp + 1, i.e. its in-window weights doubled;
    the format stays valid; loaded with ZIPSERV_VERIFY=none, since the tile
    checksum refuses it otherwise: tests/vllm/test_bad_checkpoints.py)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("corrupt") / "zs"
    shutil.copytree(llama_dirs[1], d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.zs_base"
    base = tensors[name].clone()
    base[0, 0] += 1
    tensors[name] = base
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    import os

    os.environ["ZIPSERV_VERIFY"] = "none"
    try:
        return _fast_run(d, llama_runs["base"])
    finally:
        os.environ.pop("ZIPSERV_VERIFY")


def _same(a, b):
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # exact float equality: bit-identical logits
    assert a["text"] == b["text"]


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_llama_identical_to_bf16(llama_runs, way):
    base, run = llama_runs["base"], llama_runs[way]
    assert len(base["tokens"]) == len(PROMPTS) >= 8
    assert all(len(t) > 0 for t in base["tokens"])
    _same(base, run)
    assert run["chat"] == base["chat"]


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_llama_really_compressed(llama_runs, way):
    mem, base_mem = llama_runs[way]["memory"], llama_runs["base"]["memory"]
    # 2 decoder layers x (qkv, o, gate_up, down) + embedding + lm_head
    assert mem["layers_compressed"] == 10 and mem["layers_bf16"] == 0
    assert base_mem["arena_bytes"] == 0 and base_mem["layers_compressed"] == 0
    assert mem["load_paths"] == ({"tiles": 10} if way == "pre" else {"packed": 10})
    # Merged layers are one compressed matrix (one GEMM) when the tiles allow it:
    # q/k/v (256/128/128 rows) join; gate/up (688 rows each, not a multiple of 64) stay two parts.
    parts = mem["parts"]
    for i in range(2):
        assert parts[f"model.layers.{i}.self_attn.qkv_proj"] == 1
        assert parts[f"model.layers.{i}.mlp.gate_up_proj"] == (2 if way == "pre" else 1)
        assert parts[f"model.layers.{i}.mlp.down_proj"] == 1
    assert 0 < mem["arena_bytes"] < mem["compressed_bf16_bytes"]
    assert mem["total_bytes"] < base_mem["total_bytes"]
    # What is left as parameters is the norms only (plus 0-size placeholders).
    assert base_mem["total_bytes"] - mem["param_and_buffer_bytes"] >= mem["compressed_bf16_bytes"]


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_qwen2_biases_tied_embeddings_non_tile_shapes(qwen2_runs, way):
    _same(qwen2_runs["base"], qwen2_runs[way])
    mem = qwen2_runs[way]["memory"]
    # tied lm_head shares the embedding's arena data: 2 x 4 linear + 1 embedding
    assert mem["layers_compressed"] == 9 and mem["layers_bf16"] == 0


@pytest.mark.parametrize("way", ["pack", "pre", "v1"])
def test_fast_mode_teacher_forced_logprobs_close_to_bf16(way, request, llama_runs):
    """Fast mode (fused CPU kernel) scores the BF16 model's own greedy continuations
    within FAST_LOGPROB_TOL nats at every position: packed at load straight into
    the byte-split layout, pre-compressed v1 repacked into it, and v1 kept."""
    base = llama_runs["base"]
    llama_fast = request.getfixturevalue({"pack": "llama_fast", "pre": "llama_fast_pre", "v1": "llama_fast_v1"}[way])
    mem = llama_fast["memory"]
    assert mem["load_paths"] == ({"packed": 10} if way == "pack" else {"tiles": 10})
    assert mem["layouts"] == ({"v1": 10} if way == "v1" else {"bytesplit": 10})
    if way != "v1":  # byte-split: ~12.05 bits per weight (docs/FORMAT.md appendix A) plus arena rounding
        assert mem["arena_bytes"] < 0.8 * mem["compressed_bf16_bytes"]
    # the codec runs on torch's OpenMP threads inside the worker, all of them (csrc/codec.cpp); with
    # two or more (test_compile.py's engines, where scripts/test.sh's OMP_NUM_THREADS=1 does not reach)
    th = mem["codec_threads"]
    want = int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))
    assert th["default"] == th["torch"] == th["used"] >= want, th
    # the measuring dispatcher ran at engine start for every byte-split shape (kernels/cpu_dispatch.py)
    kernels = mem["cpu_kernels"]
    if way != "v1":
        from zipserv_vllm.kernels import cpu as cpu_kernels, cpu_dispatch

        assert kernels and all([b for b, _ in rows] == list(cpu_dispatch.BUCKETS[:len(rows)]) for rows in kernels.values())
        allowed = {"fused", "panel"} if cpu_kernels.bf16_supported() else {"fused"}
        assert {kern for rows in kernels.values() for _, kern in rows} <= allowed
    diff = _max_score_diff(llama_fast, base)
    print(f"fast vs bf16: max |d logprob| = {diff:.5f}; kernels {kernels}")
    assert 0 < diff <= FAST_LOGPROB_TOL  # > 0: another GEMM than the BF16 one really ran
    # The greedy decode (decode-sized GEMMs) agrees step by step until a token flips.
    for tf, tb, lf, lb in zip(llama_fast["tokens"], base["tokens"], llama_fast["logprobs"], base["logprobs"]):
        assert len(tf) == len(tb)
        for a, b, x, y in zip(tf, tb, lf, lb):
            if a != b:
                break
            assert abs(x - y) <= FAST_LOGPROB_TOL


def test_fast_mode_bound_catches_one_corrupted_tile(llama_fast_corrupt, llama_runs):
    assert llama_fast_corrupt["memory"]["layouts"] == {"bytesplit": 10}  # the repacked layout carries the damage
    diff = _max_score_diff(llama_fast_corrupt, llama_runs["base"])
    print(f"corrupted tile vs bf16: max |d logprob| = {diff:.5f}")
    assert diff > 5 * FAST_LOGPROB_TOL


@pytest.fixture(scope="module")
def mixed_run(llama_dirs, tmp_path_factory):
    """A pre-compressed checkpoint that stores one layer (layer 0's o_proj) uncompressed."""
    import shutil

    from safetensors.torch import load_file, save_file

    bf16, zs = llama_dirs
    d = tmp_path_factory.mktemp("mixed") / "zs"
    shutil.copytree(zs, d)
    name = "model.layers.0.self_attn.o_proj"
    tensors = {k: v for k, v in load_file(d / "model.safetensors").items() if not k.startswith(name + ".")}
    tensors[name + ".weight"] = load_file(bf16 / "model.safetensors")[name + ".weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with e2e_env():
        return run_engine(d, chat=False)


def test_layer_stored_uncompressed_stays_bf16(mixed_run, llama_runs):
    _same(llama_runs["base"], mixed_run)
    mem = mixed_run["memory"]
    assert mem["load_paths"] == {"tiles": 9, "bf16": 1}
    assert mem["layers_bf16"] == 1 and mem["layers_compressed"] == 9


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cast_checkpoint_equals_vllm_serving_the_source_as_bfloat16(vllm_env, tmp_path, dtype):
    """zipserv compress --dtype bfloat16 of an FP32 / FP16 model, served with vLLM's default dtype
    (config.json says bfloat16), is bit-identical to vLLM serving the source with dtype=bfloat16."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.tiny_model import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "llama", dtype=dtype, seed=3)
    zs = compress_checkpoint(src, tmp_path / "zs", progress=False, dtype="bfloat16").dst
    base = run_engine(src, chat=False)  # ENGINE_KW: dtype="bfloat16", vLLM casts while loading
    got = run_engine(zs, chat=False, dtype="auto")
    assert got["memory"]["layers_compressed"] == 10
    assert got["tokens"] == base["tokens"] and got["logprobs"] == base["logprobs"]
