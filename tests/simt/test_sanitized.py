"""The kernels' sources under AddressSanitizer and ThreadSanitizer, in the SIMT harness.

One case of everything (tests/simt/corpus.py, coverage_cases: every fused
instance, split-K, ragged shapes, all 65,536 patterns through every kernel,
non-canonical layouts, the encoder; under TSan with fewer embedding ids and
one-hot columns, ``race_only``), in a child process with the sanitizer runtime
preloaded:

* ASan: every global and shared access of every thread is checked against its
  allocation (each __shared__ object and the dynamic area are separate heap
  blocks of their exact size; the streams are numpy arrays of their exact
  length, so an over-read of a segment's last chunk would be caught), and an
  in-flight cp.async destination is poisoned until the issuing thread's wait;
* TSan: shared- and global-memory accesses of a block's threads not ordered by
  a barrier or __syncwarp are reported races.

Both must run clean and give the reference results. Then a weight whose
offsets point past its stream: what kernels/cuda.py's validate_weight stops
before any launch, the harness under ASan catches at the cp.async. Budget:
~40 s per sanitizer build (cold; cached in ZIPSERV_CACHE) + ~20 s (ASan) and ~2 min (TSan, two
schedules, corpus.coverage_cases(race_only=True)) of runs.
"""

import numpy as np
import pytest

from . import cases, harness
from .corpus import coverage_cases, gemm_case

pytestmark = pytest.mark.skipif(harness.module() is None, reason=harness.MISSING)


@pytest.mark.parametrize("variant,schedules", [("asan", ["forward"]), ("tsan", ["forward", "reverse"])])
def test_kernels_run_clean_under_sanitizer(variant, schedules, tmp_path):
    path = tmp_path / "cases.npz"
    cases.save(path, coverage_cases(race_only=variant == "tsan"))
    r = harness.run_child(harness.build(variant), variant, {"cases": str(path), "schedules": schedules})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    assert "0 failed" in r.stdout


def test_offsets_past_the_stream_are_caught_under_asan(tmp_path):
    c = gemm_case(64, 128, 4, 8, 1)
    off = c["offsets"].copy()
    off[0, 1, 0] = c["sm"].size  # tile (0, 1)'s sm segment starts at the end of the stream
    c.update(offsets=off, name="bad offsets")
    path = tmp_path / "bad.npz"
    cases.save(path, [c])
    r = harness.run_child(harness.build("asan"), "asan", {"cases": str(path)})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "cp.async (device_common.cuh:" in r.stdout and "outside any allocation" in r.stdout, r.stdout
    assert np.array_equal(c["offsets"], off)
