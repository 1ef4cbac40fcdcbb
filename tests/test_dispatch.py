"""Selection logic of zipserv_vllm.kernels.dispatch (fused vs decoupled, tile_n, split-K) on CPU."""

import json

import pytest

from zipserv_vllm.kernels import dispatch
from zipserv_vllm.kernels.dispatch import Plan


def test_tile_n_buckets_follow_the_paper_ranges():
    assert [dispatch.tile_n_for(n) for n in (1, 7, 8)] == [8, 8, 8]  # N <= 8
    assert [dispatch.tile_n_for(n) for n in (9, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert dispatch.tile_n_for(129) == dispatch.tile_n_for(8192) == 128  # > 128: grid over column tiles
    with pytest.raises(ValueError, match="N must be >= 1"):
        dispatch.tile_n_for(0)


def test_large_n_goes_decoupled_small_n_fused():
    for n in (1, 2, 3, 8, 16, 17, 32, 64, 128):
        p = dispatch.choose(n, 4096, 4096, 132)
        assert p.path == "fused" and p.tile_n == dispatch.tile_n_for(n)
    for n in (129, 256, 1024, 8192):
        assert dispatch.choose(n, 4096, 4096, 132) == Plan("decoupled")


def test_split_k_fills_the_gpu_only_when_m_cannot():
    t2 = dict(dispatch.BUILTIN, blocks_per_sm=2)
    # 4096 rows = 64 tile rows < 2 * 132 blocks: split until 264 blocks
    p = dispatch.choose(1, 4096, 4096, 132, t2)
    assert p.split == 5 and 64 * p.split >= 264
    # 28672 rows = 448 blocks already fill 132 SMs twice: no split ...
    assert dispatch.choose(8, 28672, 4096, 132, t2).split == 1
    # ... but not four times (the built-in default): split 2
    assert dispatch.BUILTIN["blocks_per_sm"] == 4
    assert dispatch.choose(8, 28672, 4096, 132).split == 2
    # max_split caps it
    assert dispatch.choose(1, 64, 4096, 132).split == 16
    # a small K cannot be split below min_k_tiles_per_split tiles per part
    assert dispatch.choose(1, 64, 128, 132).split == 1
    assert dispatch.choose(1, 64, 256, 132).split == 2
    # the split is always the kernel's non-empty part count
    for k in (64, 320, 4160, 14336):
        for sms in (1, 46, 132, 170):
            p = dispatch.choose(4, 512, k, sms)
            kt = -(-k // 64)
            assert p.split == dispatch.splitk_parts(kt, p.split) and p.split <= kt


def test_shape_rules_override_thresholds():
    table = dict(dispatch.BUILTIN, fused_max_n=16, shapes=[
        {"m": 1024, "k": 4096, "rules": [{"n_max": 4, "path": "fused", "split": 8},
                                         {"n_max": 64, "path": "fused", "split": 0},
                                         {"n_max": 100000, "path": "decoupled"}]}])
    assert dispatch.choose(3, 1024, 4096, 132, table) == Plan("fused", 8, 8)
    p = dispatch.choose(40, 1024, 4096, 132, table)
    assert p.path == "fused" and p.tile_n == 64  # split 0 = heuristic
    assert dispatch.choose(65, 1024, 4096, 132, table) == Plan("decoupled")
    # other shapes use the table thresholds
    assert dispatch.choose(17, 2048, 4096, 132, table) == Plan("decoupled")
    assert dispatch.max_fused_n(table) == 64
    # an explicit split is capped by max_split and by Kt
    table["shapes"][0]["rules"][0]["split"] = 1000
    assert dispatch.choose(3, 1024, 4096, 132, table).split == 16


def test_table_lookup_by_name_then_capability_then_default(tmp_path, monkeypatch):
    (tmp_path / "nvidia-test-gpu.json").write_text(json.dumps({"fused_max_n": 7}))
    (tmp_path / "sm75.json").write_text(json.dumps({"fused_max_n": 5}))
    monkeypatch.setenv(dispatch.TABLE_DIR_ENV, str(tmp_path))
    dispatch.load_table.cache_clear()
    try:
        assert dispatch.table_key("NVIDIA Test-GPU") == "nvidia-test-gpu"
        assert dispatch.load_table("NVIDIA Test-GPU", (9, 0))["fused_max_n"] == 7
        assert dispatch.load_table("Other", (7, 5))["fused_max_n"] == 5
        assert dispatch.load_table("NVIDIA H200", (9, 0))["_file"].endswith("sm90.json")  # shipped table
        unknown = dispatch.load_table("Other", (12, 0))
        assert unknown["_file"].endswith("default.json") and unknown["fused_max_n"] == 128
        (tmp_path / "sm70.json").write_text(json.dumps({"shapes": [{"m": 1}]}))
        with pytest.raises(ValueError, match="need m, k and rules"):
            dispatch.load_table("Other", (7, 0))
    finally:
        dispatch.load_table.cache_clear()


def test_shipped_tables_are_valid():
    for p in dispatch.table_dirs()[-1].glob("*.json"):
        t = dispatch.validate_table(dict(dispatch.BUILTIN, **json.loads(p.read_text())), str(p))
        assert "source" in t and t["fused_max_n"] >= 1


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="N=0"):
        dispatch.choose(0, 64, 64, 1)
    with pytest.raises(ValueError, match="sm_count"):
        dispatch.choose(1, 64, 64, 0)
    with pytest.raises(ValueError, match="tile_n"):
        Plan("fused", 12, 1)
    with pytest.raises(ValueError, match="path"):
        Plan("other")
