"""Selection logic of zipserv_vllm.kernels.dispatch (fused vs decoupled, tile_n, split-K) on CPU."""

import dataclasses
import json
from pathlib import Path

import pytest

from zipserv_vllm.kernels import dispatch
from zipserv_vllm.kernels.dispatch import Plan


def test_tile_n_buckets_follow_the_paper_ranges():
    assert [dispatch.tile_n_for(n) for n in (1, 7, 8)] == [8, 8, 8]  # N <= 8
    assert [dispatch.tile_n_for(n) for n in (9, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert dispatch.tile_n_for(129) == dispatch.tile_n_for(8192) == 128  # > 128: grid over column tiles
    with pytest.raises(ValueError, match="N must be >= 1"):
        dispatch.tile_n_for(0)


H200 = dispatch.gpu_model("NVIDIA H200", (9, 0), 132)
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


H200_RUN = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-2026-12-04"
                       / "bench_full.json").read_text())


def test_cost_model_against_the_h200_measurements():
    """The model's times against the one GPU run (bench_zipgemm.py on an H200, Llama-3-8B shapes,
    N = 1 .. 8192): every fused, decoupled and BF16 estimate within 0.65x .. 1.35x of the measured
    median, and where the two compressed paths differ by more than 35 % the model picks the faster
    one. (The decode rate comes from the machine code and this run's largest layer; the other
    shapes, the decoupled path and BF16 are predictions.)"""
    for r in H200_RUN["rows"]:
        n, m, k, t = r["N"], r["M"], r["K"], r["seconds"]
        est = {"decoupled": dispatch.estimate(Plan("decoupled"), n, m, k, H200),
               "cublas": dispatch.estimate_bf16(n, m, k, H200)}
        if "fused" in t:
            est["fused"] = dispatch.estimate(Plan("fused", dispatch.tile_n_for(n), r["fused_config"]["split"]),
                                             n, m, k, H200)
        for key, e in est.items():
            assert 0.65 < e / t[key] < 1.35, (r["layer"], n, key, e, t[key])
        if "fused" in t and max(t["fused"], t["decoupled"]) > 1.35 * min(t["fused"], t["decoupled"]):
            measured = min(("fused", "decoupled"), key=t.get)
            assert min(("fused", "decoupled"), key=est.get) == measured, (r["layer"], n)


def test_decode_rate_comes_from_the_machine_code():
    budget = dispatch.sass_budget()
    row = next(r for r in budget["instances"] if r["arch"] == "90" and r["kernel"] == "fused_kernel"
               and r["tile_n"] == 8)
    eff = budget["h200_calibration"]["by_tile_n"]["8"]["efficiency"]
    assert dispatch.decode_rate("90", 8) == pytest.approx(4 / row["instructions_per_weight"] * eff, rel=1e-3)
    assert dispatch.decode_rate("90", 128) < dispatch.decode_rate("90", 8)  # the wide instance is slower per weight
    assert dispatch.decode_rate("75", 8) == dispatch.decode_rate("90", 8)  # no count for sm_75: sm_90's


def test_gpu_names_match_their_family():
    assert dispatch.gpu_model("NVIDIA H200").hbm_gb_s == 4800
    assert dispatch.gpu_model("NVIDIA H200 NVL", (9, 0)).name == "H200"
    assert dispatch.gpu_model("NVIDIA GH200 480GB", (9, 0)).name == "GH200"  # not the H200 it contains
    assert dispatch.gpu_model("NVIDIA H100 PCIe", (9, 0)).hbm_gb_s == 2000
    assert dispatch.gpu_model("NVIDIA H100 80GB HBM3", (9, 0)).name == "H100 SXM"
    assert dispatch.gpu_model("NVIDIA A100-SXM4-40GB", (8, 0)).hbm_gb_s == 1555
    assert dispatch.gpu_model("NVIDIA GeForce RTX 4090", (8, 9)).arch == "89"
    assert dispatch.gpu_model("Some Future GPU", (10, 0)).name == "B200"  # by capability
    assert dispatch.gpu_model("NVIDIA H200", (9, 0), sms=66).bf16_tflops == pytest.approx(989 / 2)


def test_cost_model_counts_the_partials_traffic():
    """The review's example: 6144x4096 at N = 128. The split's fp32 partials (written and read back)
    are part of the estimate, so more split is chosen only while it pays."""
    m, k, n = 6144, 4096, 128
    # a GPU whose decode is far from its limit (on the H200 itself the decode is the bound, and at
    # N = 128 the model sends this shape to the decoupled path, as measured)
    fast = dataclasses.replace(H200, clock_ghz=1e6)
    plans = [p for p in dispatch.candidates(n, m, k) if p.path == "fused"]
    est = {p.split: dispatch.estimate(p, n, m, k, fast) for p in plans}
    chosen = dispatch.choose(n, m, k, 132, gpu=fast)
    assert chosen.path == "fused" and est[chosen.split] == min(est.values())
    assert dispatch.choose(n, m, k, 132, gpu=H200) == Plan("decoupled")
    # with the GPU already full (the lm_head), more split only adds partials: it costs more, and is not chosen
    m = 128256
    # (a GPU whose decode is far from its limit: on the H200 itself the decode bounds every split alike)
    no_l2 = dispatch.Gpu("no-l2", H200.hbm_gb_s, H200.bf16_tflops, 132, 0.001, clock_ghz=1e6)
    e1, e2, e4 = (dispatch.estimate(dispatch.Plan("fused", 128, s), n, m, k, no_l2) for s in (1, 2, 4))
    assert e1 < e2 < e4
    assert dispatch.choose(n, m, k, 132, gpu=no_l2).split == 1


# A GPU whose compute and decode are far from any limit: every estimate is its bytes over the
# bandwidth, which this test counts itself from the shapes (not from the module's formulas).
UNBOUND = dispatch.Gpu("memory only", 1000.0, 1e9, 1, 1e6, 1e6)  # one SM: every grid fills it


@pytest.mark.parametrize("m,k,n", [(4096, 4096, 1), (6144, 4096, 8), (128256, 4096, 3), (4096, 14336, 16)])
def test_cost_model_against_independently_counted_bytes(m, k, n):
    gbs = UNBOUND.hbm_gb_s * 1e9
    weight_c = m * k * 11.3 / 8  # TCA-TBE at the paper's 11.3 bits per weight
    weight_bf16 = m * k * 2
    acts = n * k * 2 + n * m * 2  # X read, Y written, BF16
    fused = dispatch.estimate(Plan("fused", dispatch.tile_n_for(n), 1), n, m, k, UNBOUND)
    assert fused == pytest.approx((weight_c + acts) / (gbs * 0.75) + 2e-6, rel=1e-9)
    bf16 = dispatch.estimate_bf16(n, m, k, UNBOUND)
    assert bf16 == pytest.approx((weight_bf16 + acts) / (gbs * 0.85) + 2e-6, rel=1e-9)
    # decoupled: decode reads the compressed weight and writes BF16, then the GEMM reads it again
    dec = dispatch.estimate(Plan("decoupled"), n, m, k, UNBOUND)
    assert dec == pytest.approx((weight_c + weight_bf16) / (gbs * 0.8) + (weight_bf16 + acts) / (gbs * 0.85)
                                + 4e-6, rel=1e-9)
    # where bandwidth rules (launches aside), the compressed kernel's advantage is its bytes
    assert (bf16 - 2e-6) / (fused - 2e-6) == pytest.approx((weight_bf16 + acts) / 0.85 / ((weight_c + acts) / 0.75))


def test_shipped_tables_are_measured_or_say_they_are_not(tmp_path):
    """A table either says it is not measured, or names the committed measurement it was built from
    and its rules are what tune_dispatch.py --from-bench derives from that file."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("tune_dispatch", root / "benchmarks" / "tune_dispatch.py")
        tune = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tune)
    finally:
        sys.path.remove(str(root / "benchmarks"))
    measured = 0
    for p in dispatch.table_dirs()[-1].glob("*.json"):
        table = json.loads(p.read_text())
        if table["source"].startswith("not measured"):
            continue
        src = table["source"].split("--from-bench ")[1].split(" ")[0]
        assert tune.from_bench(root / src, tmp_path / p.name) == 0
        assert json.loads((tmp_path / p.name).read_text())["shapes"] == table["shapes"], p
        measured += 1
    assert measured >= 1  # the H200's


def test_split_k_fills_the_gpu_only_when_m_cannot():
    # 4096 rows = 64 tile rows: far from filling 132 SMs x 4 blocks, so split
    assert dispatch.choose(1, 4096, 4096, 132, gpu=H200).split > 1
    # the lm_head's 2004 tile rows fill the GPU alone
    assert dispatch.choose(1, 128256, 4096, 132, gpu=H200).split == 1
    # max_split caps it, and a small K cannot be split below min_k_tiles_per_split tiles per part
    assert dispatch.choose(1, 64, 4096, 132, gpu=H200).split <= 16
    assert dispatch.choose(1, 64, 128, 132, gpu=H200).split == 1
    # the split is always the kernel's non-empty part count
    for k in (64, 320, 4160, 14336):
        for sms in (1, 46, 132, 170):
            p = dispatch.choose(4, 512, k, sms)
            kt = -(-k // 64)
            assert p.split == dispatch.splitk_parts(kt, p.split) and p.split <= kt


def test_measured_plans_come_first_then_tables_then_the_model():
    table = dict(dispatch.BUILTIN, shapes=[
        {"m": 1024, "k": 4096, "rules": [{"n_max": 4, "path": "fused", "split": 8},
                                         {"n_max": 64, "path": "fused", "split": 0},
                                         {"n_max": 100000, "path": "decoupled"}]}])
    assert dispatch.choose(3, 1024, 4096, 132, table) == Plan("fused", 8, 8)
    p = dispatch.choose(40, 1024, 4096, 132, table)
    assert p.path == "fused" and p.tile_n == 64  # split 0 = the cost model's
    assert dispatch.choose(65, 1024, 4096, 132, table) == Plan("decoupled")
    # an explicit split is capped by max_split and by Kt
    table["shapes"][0]["rules"][0]["split"] = 1000
    assert dispatch.choose(3, 1024, 4096, 132, table).split == 16
    # measured plans override both
    try:
        dispatch.set_measured({(1024, 4096): [(4, Plan("decoupled")), (10**9, Plan("fused", 8, 2))]})
        assert dispatch.choose(3, 1024, 4096, 132, table) == Plan("decoupled")
        assert dispatch.choose(40, 1024, 4096, 132, table) == Plan("fused", 64, 2)  # tile_n follows N
        assert dispatch.choose(40, 2048, 4096, 132, table) == dispatch.cost_model_plan(40, 2048, 4096,
                                                                                         dispatch.gpu_model(sms=132))
    finally:
        dispatch.set_measured({})


def test_table_lookup_by_name_then_capability_then_default(tmp_path, monkeypatch):
    (tmp_path / "nvidia-test-gpu.json").write_text(json.dumps({"max_split": 7}))
    (tmp_path / "sm75.json").write_text(json.dumps({"max_split": 5}))
    monkeypatch.setenv(dispatch.TABLE_DIR_ENV, str(tmp_path))
    dispatch.load_table.cache_clear()
    try:
        assert dispatch.table_key("NVIDIA Test-GPU") == "nvidia-test-gpu"
        assert dispatch.load_table("NVIDIA Test-GPU", (9, 0))["max_split"] == 7
        assert dispatch.load_table("Other", (7, 5))["max_split"] == 5
        assert dispatch.load_table("NVIDIA H200", (9, 0))["_file"].endswith("nvidia-h200.json")  # measured
        assert dispatch.load_table("NVIDIA H200 NVL", (9, 0))["_file"].endswith("nvidia-h200.json")  # its family
        assert dispatch.load_table("NVIDIA H100 PCIe", (9, 0))["_file"].endswith("sm90.json")  # not measured
        unknown = dispatch.load_table("Other", (12, 0))
        assert unknown["_file"].endswith("default.json") and unknown["max_split"] == 16
        (tmp_path / "sm70.json").write_text(json.dumps({"shapes": [{"m": 1}]}))
        with pytest.raises(ValueError, match="need m, k and rules"):
            dispatch.load_table("Other", (7, 0))
    finally:
        dispatch.load_table.cache_clear()


def test_shipped_tables_are_valid():
    for p in dispatch.table_dirs()[-1].glob("*.json"):
        t = dispatch.validate_table(dict(dispatch.BUILTIN, **json.loads(p.read_text())), str(p))
        assert "source" in t and t["max_split"] >= 1 and "fused_max_n" not in t


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="N=0"):
        dispatch.choose(0, 64, 64, 1)
    with pytest.raises(ValueError, match="sm_count"):
        dispatch.choose(1, 64, 64, 0)
    with pytest.raises(ValueError, match="tile_n"):
        Plan("fused", 12, 1)
    with pytest.raises(ValueError, match="path"):
        Plan("other")
