"""The byte-split layout on a GPU: dispatch, tuning keys, the engine's layout setting (CPU-side logic).

The kernels themselves are checked on the SIMT harness (tests/simt/test_packed.py,
test_selfcheck.py) and on a GPU (tests/gpu); this file covers what decides
whether and how they serve: the layout a GPU engine holds (ZIPSERV_GPU_LAYOUT,
prefer), the dispatcher's plans for a weight in that layout (measured, then
the cost model), and the tuner's keys and cache for them.
"""

import weakref

import pytest
import torch

from zipserv_vllm import settings
from zipserv_vllm.kernels import autotune, dispatch
from zipserv_vllm.kernels.dispatch import Plan

H200 = dispatch.gpu_model("NVIDIA H200", (9, 0), 132)


@pytest.fixture(autouse=True)
def _no_measured():
    dispatch.set_measured({})
    yield
    dispatch.set_measured({})


def test_packed_plans_and_their_validation():
    assert [dispatch.packed_tile_n(n) for n in (1, 8, 9, 16, 17, 4096)] == [8, 8, 16, 16, 16, 16]
    cands = dispatch.candidates(4, 4096, 4096, layout="bytesplit")
    assert {p.path for p in cands} == {"packed", "packed_decoupled"}
    assert all(p.tile_n == 8 for p in cands if p.path == "packed") and len(cands) > 2  # several splits
    assert all(p.tile_n == 16 for p in dispatch.candidates(12, 4096, 4096, layout="bytesplit") if p.path == "packed")
    assert {p.path for p in dispatch.candidates(4, 4096, 4096)} == {"fused", "decoupled"}
    with pytest.raises(ValueError, match="tile_n must be one of"):
        Plan("packed", 32)
    with pytest.raises(ValueError, match="path must be one of"):
        Plan("bytesplit")
    with pytest.raises(ValueError, match="layout must be one of"):
        dispatch.candidates(4, 64, 64, layout="v2")


def test_packed_decode_rate_comes_from_the_machine_code():
    rows = {(r["kernel"], r["tile_n"]): r for r in dispatch.sass_budget()["instances"] if r["arch"] == "90"}
    eff = dispatch.sass_budget()["h200_calibration"]["by_tile_n"]["8"]["efficiency"]
    for kernel in ("packed_kernel", "packed_kernel_xfast"):
        for tn in (8, 16):
            want = rows[(kernel, tn)]["issue_bound_weights_per_sm_cycle"] * eff
            assert dispatch.decode_rate("90", tn, kernel) == pytest.approx(want)
    # the byte-split decode is several times the v1 one's rate (0.28 vs 1.41 instructions per weight)
    assert dispatch.decode_rate("90", 8, "packed_kernel_xfast") > 4 * dispatch.decode_rate("90", 8)


def test_cost_model_of_the_packed_plans():
    m, k = 4096, 4096
    # decode sizes: the byte-split kernel is predicted faster than v1's on the H200 (issue-bound there)
    for n in (1, 8, 16):
        v1 = min(dispatch.estimate(p, n, m, k, H200) for p in dispatch.candidates(n, m, k))
        bs = min(dispatch.estimate(p, n, m, k, H200) for p in dispatch.candidates(n, m, k, layout="bytesplit"))
        assert bs < 0.7 * v1
    # its bytes are 12.05 bits per weight: a memory-bound call moves more than v1's 11.3
    slow = dataclasses_replace(H200, hbm_gb_s=200.0)
    t_v1 = dispatch.estimate(Plan("fused", 8, 1), 1, m, k, slow)
    t_bs = dispatch.estimate(Plan("packed", 8, 1), 1, m, k, slow)
    assert t_bs / t_v1 == pytest.approx(12.05 / 11.3, rel=0.02)
    # a pass per 16 columns: at prefill sizes the decoupled path wins
    assert dispatch.choose(4096, m, k, 132, gpu=H200, layout="bytesplit") == Plan("packed_decoupled")
    assert dispatch.choose(1, m, k, 132, gpu=H200, layout="bytesplit").path == "packed"


def dataclasses_replace(gpu, **kw):
    import dataclasses

    return dataclasses.replace(gpu, **kw)


def test_measured_plans_apply_to_their_own_layout_only():
    m, k = 4096, 4096
    dispatch.set_measured({(m, k): [(16, Plan("packed", 16, 3)), (1 << 30, Plan("packed_decoupled"))]})
    assert dispatch.choose(4, m, k, 132, gpu=H200, layout="bytesplit") == Plan("packed", 8, 3)  # tile_n for N
    assert dispatch.choose(64, m, k, 132, gpu=H200, layout="bytesplit") == Plan("packed_decoupled")
    assert dispatch.choose(4, m, k, 132, gpu=H200).path in ("fused", "decoupled")  # a v1 weight: the model
    dispatch.set_measured({(m, k): [(1 << 30, Plan("decoupled"))]})
    assert dispatch.choose(4, m, k, 132, gpu=H200) == Plan("decoupled")
    assert dispatch.choose(4, m, k, 132, gpu=H200, layout="bytesplit").path == "packed"  # ignored: v1's rule
    # the shipped tables hold v1 rules: never applied to the byte-split layout
    table = {"shapes": [{"m": m, "k": k, "rules": [{"n_max": 1 << 30, "path": "decoupled"}]}]}
    assert dispatch.choose(4, m, k, 132, table, H200) == Plan("decoupled")
    assert dispatch.choose(4, m, k, 132, table, H200, layout="bytesplit").path == "packed"


def test_tuner_keys_rules_and_cache_per_layout(tmp_path, monkeypatch):
    for n, plan in ((4, Plan("packed", 8, 2)), (12, Plan("packed", 16, 1)), (64, Plan("packed_decoupled")),
                    (4, Plan("fused", 8, 3)), (300, Plan("decoupled"))):
        assert autotune.plan_from_key(autotune.plan_key(plan), n) == plan
    times = {("packed/split1", 1): 3.0, ("packed/split4", 1): 2.0, ("packed_decoupled", 1): 9.0,
             ("packed/split1", 64): 9.0, ("packed/split4", 64): 8.0, ("packed_decoupled", 64): 4.0}

    def fn(plan, n, m, k):
        return 5.0 if plan == "bf16" else times.get((autotune.plan_key(plan), n), 50.0)

    got = autotune.tune([(4096, 4096)], 64, fn, candidates=lambda n, m, k: dispatch.candidates(
        n, m, k, layout="bytesplit"), ns=[1, 64])
    assert got.rules() == {(4096, 4096): [(1, Plan("packed", 8, 4)), (1 << 30, Plan("packed_decoupled"))]}
    assert got.ratio(4096, 4096, 1) == pytest.approx(0.4)
    # a budget cut after the decode buckets: the byte-split kernel's rule is not stretched to prefill sizes
    cut = autotune.tune([(4096, 4096)], 64, fn, candidates=lambda n, m, k: dispatch.candidates(
        n, m, k, layout="bytesplit"), ns=[1])
    assert cut.rules() == {(4096, 4096): [(1, Plan("packed", 8, 4))]}
    dispatch.set_measured(cut.rules())
    assert dispatch.choose(1, 4096, 4096, 132, gpu=H200, layout="bytesplit") == Plan("packed", 8, 4)
    assert dispatch.choose(4096, 4096, 4096, 132, gpu=H200, layout="bytesplit") == Plan("packed_decoupled")
    monkeypatch.setenv("ZIPSERV_CACHE", str(tmp_path))
    v1 = autotune.cache_file("NVIDIA H200", "580.1", "1.0")
    bs = autotune.cache_file("NVIDIA H200", "580.1", "1.0", "bytesplit")
    assert v1 != bs and v1 == autotune.cache_file("NVIDIA H200", "580.1", "1.0", "v1")


def test_gpu_layout_setting(monkeypatch):
    monkeypatch.delenv("ZIPSERV_GPU_LAYOUT", raising=False)
    assert settings.gpu_layout("memory") == "v1" and settings.gpu_layout("speed") == "bytesplit"
    monkeypatch.setenv("ZIPSERV_GPU_LAYOUT", "BYTESPLIT")
    assert settings.gpu_layout("memory") == "bytesplit"
    monkeypatch.setenv("ZIPSERV_GPU_LAYOUT", "v1")
    assert settings.gpu_layout("speed") == "v1"
    monkeypatch.setenv("ZIPSERV_GPU_LAYOUT", "nibbles")
    with pytest.raises(settings.SettingError, match="ZIPSERV_GPU_LAYOUT is 'nibbles'; expected one of v1, bytesplit"):
        settings.check_all()


def test_which_devices_hold_the_byte_split_layout(monkeypatch):
    from zipserv_vllm.kernels import cuda
    from zipserv_vllm.vllm_plugin import layouts

    gpu = torch.device("cuda", 0)
    assert not layouts.uses_packed(gpu, "fast")  # a GPU engine's default: v1
    assert not layouts.uses_packed(gpu, "exact", "bytesplit")  # exact mode never repacks
    monkeypatch.setattr(cuda, "REGISTERED", True)
    assert layouts.uses_packed(gpu, "fast", "bytesplit")
    monkeypatch.setattr(cuda, "REGISTERED", False)  # no CUDA kernels built: the layers stay v1
    assert not layouts.uses_packed(gpu, "fast", "bytesplit")


@pytest.mark.skipif(not __import__("zipserv_vllm.kernels.cuda", fromlist=["REGISTERED"]).REGISTERED,
                    reason="zipserv_vllm._cuda is not built here (no nvcc at install)")
def test_cuda_kernels_are_registered_on_the_packed_ops():
    from zipserv_vllm.kernels import cuda, ops

    for op in ("zipserv::packed_gemm", "zipserv::packed_decompress"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
    assert hasattr(cuda._cuda, "decompress_packed")
    ops.register_lean_kernel("packed_gemm", "CUDA", cuda.packed_gemm_cuda)  # a second time: no error


def test_a_gpu_repack_leaves_the_embedding_in_v1():
    from zipserv_vllm.vllm_plugin import layouts, loading

    def state(kind):
        return loading.LayerState(prefix=kind, kind=kind, rows=64, cols=64, device=torch.device("cpu"),
                                  expected_shards=[], orig_loader=None, layer_ref=None)

    assert layouts.stays_v1(state("embedding"), "cuda:0")
    assert not layouts.stays_v1(state("linear"), "cuda:0")
    assert not layouts.stays_v1(state("embedding"), "cpu")  # the CPU packs it (packed_embedding)
    # an untied lm_head (the embedding method's other layer) only multiplies: repacked like a linear layer
    from zipserv_vllm.vllm_plugin import compat

    head_cls = compat.find("ParallelLMHead")
    head = head_cls.__new__(head_cls)  # (an instance without vLLM's distributed set-up: only its class matters)
    st = state("embedding")
    st.layer_ref = weakref.ref(head)
    assert not layouts.stays_v1(st, "cuda:0")
