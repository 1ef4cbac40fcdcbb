"""The harness catches the mistakes it exists for: faults planted in a copy of the kernels' own sources.

Each test copies csrc/, changes one line of a kernel or of its index math (the
anchor must occur exactly once, so a kernel that moved on fails the test
instead of silently testing nothing), builds that copy with g++ and runs small
cases in a child process. The unmodified sources pass the same cases
(test_kernels.py, test_sanitized.py), so a failure here is the planted fault
being seen. Builds are cached by source hash; only the changed translation
unit recompiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import cases, harness
from .corpus import ALL, decompress_case, expert_weights, gemm_case, grouped_case, onehot_case

pytestmark = pytest.mark.skipif(harness.module() is None, reason=harness.MISSING)

KERNEL = "cuda/zipgemm_kernel.cuh"
LAYOUT = "cuda/zipgemm_layout.cuh"


def _gemm_cases():
    return [gemm_case(130, 452, 21, 32, 1), gemm_case(128, 256, 16, 16, 3), onehot_case(8, 4, 64)]


def _decompress_cases():
    rng = np.random.default_rng(5)
    return [decompress_case(ALL.reshape(256, 256), "all patterns"),
            decompress_case(rng.integers(0x3000, 0x4000, (130, 200), dtype=np.uint16), "narrow")]


def _faulty(tmp_path, name, path, old, new, variant="plain"):
    root = harness.copy_csrc(tmp_path / f"csrc-{variant}")
    harness.plant(root, path, old, new)
    return harness.build(variant, root=root, name=f"fault-{name}")


def _run(tmp_path, module, variant, todo, schedules=("forward",)):
    p = tmp_path / f"cases-{variant}.npz"
    cases.save(p, todo)
    return harness.run_child(module, variant, {"cases": str(p), "schedules": list(schedules)})


def _assert_wrong(r, n_cases):
    """The child ran to its end and reported wrong results (exit 1), not a crash."""
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert " failed; harness counters" in r.stdout, r.stdout
    assert " 0 failed" not in r.stdout and f"{n_cases} cases" in r.stdout, r.stdout


# The fused kernel's main loop opens with the wait for the previous iteration's
# cp.async group, then the barrier that makes every warp's copies visible.
LOOP_TOP = "    for (int i = 0; i < nt; ++i) {\n      cp_async_wait_all();\n      __syncthreads();\n"


def test_missing_cp_async_wait(tmp_path):
    mod = _faulty(tmp_path, "no-wait", KERNEL, LOOP_TOP, "    for (int i = 0; i < nt; ++i) {\n      __syncthreads();\n")
    todo = _gemm_cases()
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))  # staged data read before it landed
    asan = _faulty(tmp_path, "no-wait", KERNEL, LOOP_TOP, "    for (int i = 0; i < nt; ++i) {\n      __syncthreads();\n",
                   variant="asan")
    r = _run(tmp_path, asan, "asan", todo[:1])
    # ASan sees the read of a cp.async destination that is still in flight (poisoned until the wait)
    assert r.returncode == harness.EXIT_STATUS["asan"], (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "use-after-poison" in r.stderr and "zipgemm_kernel.cuh" in r.stderr, r.stderr[-3000:]


def test_missing_barrier(tmp_path):
    mod = _faulty(tmp_path, "no-barrier", KERNEL, LOOP_TOP,
                  "    for (int i = 0; i < nt; ++i) {\n      cp_async_wait_all();\n")
    todo = _gemm_cases()
    # warps read the X tile other warps' copies fill: under some schedule before they land
    _assert_wrong(_run(tmp_path, mod, "plain", todo, schedules=("forward", "reverse")), len(todo))


def test_wrong_swizzle(tmp_path):
    old = "  return x_smem_index(t * 8 + b_frag_n(lane), kg * 16 + b_frag_k(lane, r, 0));\n"
    new = "  return (t * 8 + b_frag_n(lane)) * kTile + kg * 16 + b_frag_k(lane, r, 0);  // planted: no swizzle\n"
    mod = _faulty(tmp_path, "swizzle", LAYOUT, old, new)
    todo = _gemm_cases()
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))


def test_fallback_index_off_by_one(tmp_path):
    old = "{ return s.fb_local + i * kFragElems - hrun; }"
    mod = _faulty(tmp_path, "fb-off-by-one", LAYOUT, old, "{ return s.fb_local + i * kFragElems - hrun + 1; }")
    todo = _decompress_cases()[:1] + [onehot_case(32, 1, 64)]  # all patterns: plenty of fallback values
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))


def test_pipeline_with_two_plane_buffers(tmp_path):
    # planes two tiles ahead then land in the buffer the current tile is being decoded from
    mod = _faulty(tmp_path, "two-plane-buffers", LAYOUT, "constexpr int kBmpBuffers = 3;",
                  "constexpr int kBmpBuffers = 2;")
    todo = [gemm_case(128, 512, 16, 16, 1), onehot_case(8, 1, 64)]  # 8 and 4 K tiles: the pipeline wraps
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))


def test_grouped_kernel_on_the_next_experts_rows(tmp_path):
    # the grouped kernel's X and Y views start one expert too far (a routing/offset slip)
    old = "    const int r0 = g.expert_rows[e], r1 = g.expert_rows[e + 1];\n"
    new = "    const int r0 = g.expert_rows[e] + 1, r1 = g.expert_rows[e + 1];  // planted: off by one row\n"
    mod = _faulty(tmp_path, "grouped-rows", KERNEL, old, new)
    todo = [grouped_case(expert_weights(3, 130, 200), [4, 9, 6], 8)]
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))


# The decompress kernels: each lane decodes its fragment pairs into the shared tile, then the
# warp's lanes store rows that other lanes wrote (store_tile_rows): the __syncwarp between.
WARP_SYNC = "  }\n  __syncwarp();\n  store_tile_rows(tile, a.out"
NO_WARP_SYNC = "  }\n  store_tile_rows(tile, a.out"


def _packed_decompress_cases():
    from .corpus import packed_case

    return [packed_case(ALL.reshape(256, 256), "packed_decompress", "all patterns", 0, 1),
            packed_case(np.random.default_rng(5).integers(0x3000, 0x4000, (130, 200), dtype=np.uint16),
                        "packed_decompress", "narrow", 0, 1)]


@pytest.mark.parametrize("source", ["decompress.cu", "decompress_packed.cu"])
def test_missing_syncwarp_is_a_race(tmp_path, source):
    path = f"cuda/{source}"
    todo = _decompress_cases() if source == "decompress.cu" else _packed_decompress_cases()
    mod = _faulty(tmp_path, f"no-syncwarp-{source}", path, WARP_SYNC, NO_WARP_SYNC)
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))
    tsan = _faulty(tmp_path, f"no-syncwarp-{source}", path, WARP_SYNC, NO_WARP_SYNC, variant="tsan")
    r = _run(tmp_path, tsan, "tsan", todo[1:])
    assert r.returncode == harness.EXIT_STATUS["tsan"], (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "data race" in r.stderr and source in r.stderr, r.stderr[-3000:]


def test_anchor_that_moved_fails_loudly(tmp_path):
    root = harness.copy_csrc(tmp_path / "csrc")
    with pytest.raises(AssertionError, match="occurs 0 times"):
        harness.plant(root, KERNEL, "no such line in the kernel", "")


PACKED = "cuda/zipgemm_packed.cuh"


def _packed_cases():
    from .corpus import bf16_bits, packed_case, weight
    from .test_packed import with_exceptions

    rng = np.random.default_rng(11)
    w = weight(rng, 128, 256)
    return [packed_case(with_exceptions(128, 256, seed=4), "packed_onehot", "exceptions", 8, 1, cols=np.arange(256)),
            packed_case(ALL.reshape(256, 256), "packed_onehot", "all patterns", 16, 2, cols=np.arange(0, 256, 3)),
            packed_case(w, "packed", "gaussian", 16, 1, x=bf16_bits(rng.standard_normal((11, 256))))]


@pytest.mark.parametrize("what,old,new", [
    # the table look-up reads entry (code % 4) for code 1 instead of (code % 8)
    ("selector", "const uint32_t s7 = a & 0x0707u;", "const uint32_t s7 = a & 0x0307u;"),
    # codes >= 8 take entries 0..7 (the upper half of the table never used)
    ("upper half", "const uint32_t m = prmt(a << 4, 0u, 0x0908u);", "const uint32_t m = 0u;"),
    # the second element of a lane's pair never gets its exception
    ("exception pair", "if (d == d0 + 1) v =", "if (d == d0 + 2) v ="),
    # tiles with a few exceptions decoded in the main loop, unpatched (and again in the exception loop)
    ("exception tile", "if (es[i + 1] > es[i]) {", "if (es[i + 1] > es[i] + 8) {"),
])
def test_packed_faults(tmp_path, what, old, new):
    mod = _faulty(tmp_path, f"packed-{what.replace(' ', '-')}", PACKED, old, new)
    todo = _packed_cases()
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))


def test_packed_decompress_fault(tmp_path):
    """The decompress kernel's own store: a lane's pair written one FT row too low."""
    from .corpus import packed_case
    from .test_packed import with_exceptions

    mod = _faulty(tmp_path, "packed-decompress-row", "cuda/decompress_packed.cu",
                  "out_tile_index(frag_row0(f) + lane / 4,", "out_tile_index(frag_row0(f) + (lane / 4 + 1) % 8,")
    todo = [packed_case(with_exceptions(130, 200, seed=6), "packed_decompress", "exceptions", 0, 1),
            packed_case(ALL.reshape(256, 256), "packed_decompress", "all patterns", 0, 1)]
    _assert_wrong(_run(tmp_path, mod, "plain", todo), len(todo))
