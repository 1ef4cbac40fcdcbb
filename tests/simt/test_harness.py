"""The SIMT harness itself (csrc/simt/): each check it promises fires, and its built-ins mean what CUDA says.

Self-test kernels (csrc/simt/selftest.cpp) misuse the model on purpose: a
barrier only some threads reach, threads at different barriers, a warp whose
lanes call different intrinsics or exit early, a cp.async read before its
wait, misaligned or global-destination copies, a shared-memory race, too much
dynamic shared memory. mma.sync and the warp shuffles are checked against
oracles written here from the PTX ISA and the CUDA programming guide. The
sanitizer builds (ASan, TSan) are checked in a child process: an in-flight
cp.async read, a shared-array overflow and a race are reported, the ordered
version of the race is not. Budget: ~5 s plus the two sanitizer builds (~40 s
cold, cached in ZIPSERV_CACHE).
"""

import json

import numpy as np
import pytest

from . import harness

simt = harness.module()

pytestmark = pytest.mark.skipif(simt is None, reason=harness.MISSING)


@pytest.fixture(autouse=True)
def _default_schedule():
    simt.configure("forward", 1)
    yield
    simt.configure("forward", 1)


def _run(name, inputs=(), threads=32, **kw):
    return simt.selftest(name, list(inputs), threads, **kw)


@pytest.mark.parametrize("name,threads,words", [
    ("barrier_divergent", 64, ["__syncthreads at selftest.cpp:", "can never complete", "threads 0-31 wait",
                               "threads 32-63 exited"]),
    ("barrier_sites", 64, ["different __syncthreads", "threads 0-31 wait at __syncthreads (selftest.cpp:",
                           "threads 32-63 wait at __syncthreads (selftest.cpp:"]),
    ("collective_divergent", 32, ["warp 0 diverged", "__reduce_add_sync", "__shfl_sync"]),
    ("collective_exited", 32, ["__reduce_add_sync", "for lane 31, which exited"]),
    ("cp_async_misaligned", 32, ["not 16-byte aligned"]),
    ("cp_async_to_global", 32, ["not inside the block's shared memory"]),
])
def test_misuse_is_reported_not_hung(name, threads, words):
    err, msg, _ = _run(name, [1, 2, 3, 4], threads)
    assert err == 719, (err, msg)  # cudaErrorLaunchFailure
    assert f"{name} (launched at selftest.cpp:" in msg and "block (0,0,0)" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_cp_async_destination_is_garbage_until_the_wait():
    src = [0x11111111, 0x22222222, 0x33333333, 0x44444444]
    for seed in (1, 2, 3):
        simt.configure("forward", seed)
        err, _, out = _run("read_before_wait", src)
        assert err == 0
        assert out[0] != src[0], "a read before cp.async.wait_all saw the data"
        assert out[1] == src[0], "after the wait the data is there"


def test_a_race_shows_under_some_schedule_and_the_barrier_fixes_it():
    seen = set()
    for schedule in ("forward", "reverse", "random"):
        simt.configure(schedule, 5)
        seen.add(_run("shared_race", [7], 64)[2][0])
        assert _run("shared_ordered", [7], 64)[2][0] == 7
    assert 7 in seen and len(seen) > 1, "the reader saw the same value whichever thread ran first"


def test_dynamic_shared_memory_needs_the_attribute():
    simt.reset_device()
    err, msg, _ = _run("dynamic_touch", threads=32, dynamic_smem=64 * 1024)
    assert err == 1 and "over the kernel's limit of 49152" in msg and "cudaFuncSetAttribute" in msg
    assert _run("dynamic_touch_raised", threads=32, dynamic_smem=64 * 1024)[0] == 0
    simt.configure("forward", 1, device_max_dynamic_shared=99 * 1024)  # an sm_86-class device
    try:
        assert _run("dynamic_touch_raised", threads=32, dynamic_smem=100 * 1024)[0] == 1  # over the device limit
    finally:
        simt.configure("forward", 1, device_max_dynamic_shared=227 * 1024)


# ------------------------------------------------------------ mma.sync oracle
def _bf16(v):
    return (np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint32)


def test_mma_follows_the_ptx_fragment_tables():
    """D = A B + C for m16n8k16 (bf16 in, f32 accumulate) with the lanes' registers laid out as the
    PTX ISA's figures for mma.m16n8k16 show (this test's own transcription)."""
    rng = np.random.default_rng(0)
    A = rng.integers(-8, 8, (16, 16)).astype(np.float32) / 4  # exact in bf16 and in the sums
    B = rng.integers(-8, 8, (16, 8)).astype(np.float32) / 4
    C = rng.integers(-8, 8, (16, 8)).astype(np.float32)
    regs = np.zeros((32, 10), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a_pos = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]  # a0a1, a2a3, a4a5, a6a7
        for r, (row, col) in enumerate(a_pos):
            regs[lane, r] = _bf16(A[row, col]) | (_bf16(A[row, col + 1]) << 16)
        for r in range(2):  # b0b1: k = 2t, 2t+1; b2b3: k = 2t+8, 2t+9; column g
            k = 2 * t + 8 * r
            regs[lane, 4 + r] = _bf16(B[k, g]) | (_bf16(B[k + 1, g]) << 16)
        c_pos = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
        regs[lane, 6:10] = np.array([C[p] for p in c_pos], np.float32).view(np.uint32)
    err, msg, out = _run("mma_probe", regs.reshape(-1).tolist(), 32)
    assert err == 0, msg
    D = A @ B + C
    got = np.array(out[:128], np.uint32).view(np.float32).reshape(32, 4)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        want = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
        np.testing.assert_array_equal(got[lane], want, err_msg=f"lane {lane}")


# ------------------------------------------------------------ shuffles
SHFL = {"idx": 0, "up": 1, "down": 2, "xor": 3, "reduce_add": 4, "ballot": 5, "any": 6, "all": 7}


def _shfl_oracle(op, v, arg, width):
    out = []
    for lane in range(32):
        seg = lane - lane % width
        if op == "idx":
            src = seg + arg % width
        elif op == "up":
            src = lane - arg if lane - seg >= arg else lane
        elif op == "down":
            src = lane + arg if lane - seg + arg < width else lane
        elif op == "xor":
            src = lane ^ arg if (lane ^ arg) - (lane ^ arg) % width == seg else lane
        else:
            src = None
        if src is not None:
            out.append(v[src])
        elif op == "reduce_add":
            out.append(sum(v) & 0xFFFFFFFF)
        elif op == "ballot":
            out.append(sum(1 << i for i in range(32) if v[i] & 1))
        elif op == "any":
            out.append(int(any(x & 1 for x in v)))
        else:
            out.append(int(all(x & 1 for x in v)))
    return out


@pytest.mark.parametrize("op,arg,width", [("idx", 5, 32), ("idx", 3, 8), ("up", 1, 32), ("up", 4, 16),
                                          ("down", 2, 32), ("down", 3, 8), ("xor", 1, 32), ("xor", 6, 4),
                                          ("reduce_add", 0, 32), ("ballot", 0, 32), ("any", 0, 32), ("all", 0, 32)])
def test_warp_shuffles_match_cuda(op, arg, width):
    v = [(i * 2654435761 + 12345) & 0xFFFFFFFF for i in range(32)]
    if op == "all":
        v = [x | 1 for x in v]
    err, msg, out = _run("shuffle_probe", v, 32, arg=arg, width=width, op=SHFL[op])
    assert err == 0, msg
    assert out[:32] == _shfl_oracle(op, v, arg, width)


def test_counters_show_what_ran():
    simt.reset_stats()
    _run("shared_ordered", [7], 64)
    s = simt.stats()
    assert s["launches"] == 1 and s["blocks"] == 1 and s["threads"] == 64 and s["barriers"] == 1


# ------------------------------------------------------------ sanitizer builds
@pytest.mark.parametrize("variant,name,threads,want", [
    ("asan", "read_before_wait", 32, "use-after-poison"),
    ("asan", "shared_overflow", 9, "heap-buffer-overflow"),
    ("tsan", "shared_race", 64, "data race"),
    ("tsan", "shared_ordered", 64, None),
])
def test_sanitizer_builds_report_what_they_should(variant, name, threads, want):
    r = harness.run_child(harness.build(variant), variant, {"selftest": [name, threads]})
    if want is None:
        assert r.returncode == 0, r.stderr[-3000:]
    else:
        assert r.returncode == harness.EXIT_STATUS[variant], (r.returncode, r.stderr[-3000:])
        assert want in r.stderr and "selftest.cpp" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("variant", ["asan", "tsan"])
def test_sanitizer_children_run_one_blas_thread_whatever_the_caller_says(variant, monkeypatch):
    # numpy's OpenBLAS (and any OpenMP runtime) is not instrumented: a pool of its threads makes
    # TSan report races that are not in the kernels. The harness pins them to one thread itself.
    names = sorted(harness.simt_build.SANITIZER_CHILD_THREADS)
    assert {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"} <= set(names)
    for name in names:
        monkeypatch.setenv(name, "8")
    r = harness.run_child(harness.build(variant), variant, {"environ": names})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {name: "1" for name in names}
    assert harness.simt_build.sanitizer_env("plain", {"OPENBLAS_NUM_THREADS": "8"})["OPENBLAS_NUM_THREADS"] == "8"
