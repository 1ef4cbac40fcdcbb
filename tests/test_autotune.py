"""The measuring dispatcher (zipserv_vllm/kernels/autotune.py) with injected timings, on the CPU."""

from __future__ import annotations

import json

from zipserv_vllm.kernels import autotune, dispatch
from zipserv_vllm.kernels.dispatch import Plan


def _fake(table):
    """time_fn from {(m, k): {"bf16": s, plan_key: s}} (same for every N), else 1.0."""
    calls = []

    def fn(plan, n, m, k):
        key = plan if isinstance(plan, str) else autotune.plan_key(plan)
        calls.append((key, n, m, k))
        return table.get((m, k), {}).get(key, 1.0)

    return fn, calls


def test_buckets():
    assert autotune.buckets(1) == [1]
    assert autotune.buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert autotune.buckets(8192)[-1] == 8192


def test_fastest_measured_plan_becomes_the_rule():
    fn, calls = _fake({(4096, 4096): {"bf16": 2.0, "fused/split4": 0.5, "decoupled": 3.0},
                       (1024, 4096): {"bf16": 1.0, "decoupled": 0.2}})
    t = autotune.tune([(4096, 4096), (1024, 4096)], 16, fn)
    assert t.complete and {c[0] for c in calls} >= {"bf16", "decoupled", "fused/split1", "fused/split4"}
    rules = t.rules()
    assert rules[(4096, 4096)][0] == (1, Plan("fused", 8, 4))
    assert rules[(1024, 4096)][-1] == (1 << 30, Plan("decoupled"))
    assert t.ratio(4096, 4096, 8) == 0.25
    try:
        dispatch.set_measured(rules)
        assert dispatch.choose(8, 4096, 4096, 132) == Plan("fused", 8, 4)
        assert dispatch.choose(3000, 1024, 4096, 132) == Plan("decoupled")
    finally:
        dispatch.set_measured({})


def test_budget_stops_and_leaves_the_rest_to_the_model():
    ticks = iter(range(1000))
    fn, calls = _fake({})
    t = autotune.tune([(64, 64), (128, 64)], 1 << 20, fn, budget_s=3.5, clock=lambda: next(ticks))
    assert not t.complete and len({c[1] for c in calls}) <= 2  # stopped after a few (shape, N) pairs


def test_speed_policy_finds_layers_slower_than_bf16():
    fn, _ = _fake({(256, 688): {"bf16": 1.0, "fused/split1": 1.3, "decoupled": 1.5, "fused/split2": 1.2,
                                "fused/split3": 1.4, "fused/split4": 1.25, "fused/split5": 1.5}})
    t = autotune.tune([(256, 688), (256, 256)], 512, fn)
    assert autotune.slower_than_bf16(t, 256, 688, 256) == (1.2, 1)
    assert autotune.slower_than_bf16(t, 256, 256, 256) is None  # all 1.0: as fast, not slower
    assert autotune.slower_than_bf16(t, 256, 688, 0) is None  # no measured N in range


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("ZIPSERV_CACHE", str(tmp_path))
    fn, _ = _fake({(64, 64): {"bf16": 1.0, "decoupled": 0.1}})
    t = autotune.tune([(64, 64)], 4, fn)
    p = autotune.cache_file("NVIDIA H200", "13.0", "0.2.0")
    assert p.parent == tmp_path / "dispatch" and "nvidia-h200" in p.name
    autotune.save_cached(p, t)
    back = autotune.load_cached(p)
    assert back.times == t.times and back.rules() == t.rules()
    p.write_text("{not json")
    assert autotune.load_cached(p) is None


def test_injected_timings_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"256x688": {"*": {"bf16": 1.0, "*": 2.0}}, "*": {"*": {"bf16": 1.0, "*": 0.5}}}))
    fn = autotune.injected_time_fn(f)
    assert fn(Plan("decoupled"), 4, 256, 688) == 2.0 and fn("bf16", 4, 256, 688) == 1.0
    assert fn(Plan("fused", 8, 2), 1, 512, 256) == 0.5


def test_cache_written_by_two_engines_at_once(tmp_path):
    """Two engines starting together on one machine both save their measurements: each write is
    whole and its own (a shared temporary name let one rename the other's file away mid-write)."""
    import threading

    fn, _ = _fake({(64, 64): {"bf16": 1.0, "decoupled": 0.1}})
    t = autotune.tune([(64, 64)], 4, fn)
    p = tmp_path / "dispatch" / "x.json"
    errors = []

    def save():
        try:
            for _ in range(300):
                autotune.save_cached(p, t)
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            errors.append(repr(exc))

    threads = [threading.Thread(target=save) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert autotune.load_cached(p).rules() == t.rules()
    assert [x.name for x in p.parent.iterdir()] == ["x.json"]  # no temporary file left behind
