"""Markers for the whole suite (one place): ``slow`` on what starts a vLLM engine, a server or a
child process with a sanitizer, so that ``pytest -m "not slow"`` is the inner loop of development.
CI runs everything (scripts/test.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Files whose tests are slow as a whole; in tests/vllm every file but the two that start no engine.
SLOW_FILES = {"test_docs.py", "test_sanitized.py", "test_faults.py", "test_cuda_build.py", "test_conformance.py"}
FAST_VLLM_FILES = {"test_arena.py", "test_traceable.py", "test_config.py"}
# The longest files first (measured with --durations on the fresh-clone run), the rest in their
# usual order: scripts/test.sh runs the files on two workers (pytest-xdist, --dist loadfile
# --no-loadscopereorder), and starting the long ones early lets both workers finish together.
LONG_FIRST = ["vllm/test_moe.py", "simt/test_sanitized.py", "vllm/test_compile.py", "test_docs.py",
              "test_conformance.py", "vllm/test_tensor_parallel.py", "vllm/test_server.py", "vllm/test_errors.py",
              "vllm/test_features.py", "vllm/test_demo.py", "vllm/test_offline.py", "vllm/test_layouts_e2e.py",
              "vllm/test_bad_checkpoints.py", "simt/test_faults.py", "test_cuda_build.py"]


@pytest.fixture(autouse=True)
def _fresh_cpu_op_choices():
    """The C++ CPU kernel of zipserv::packed_gemm remembers the dispatcher's choice per shape; tests
    that monkeypatch ``cpu_dispatch.choose`` would leave it stale for the next test."""
    import sys

    def sync():
        cpu = sys.modules.get("zipserv_vllm.kernels.cpu")
        if cpu is not None:
            cpu._op_sync()

    sync()
    yield
    sync()


def _rank(item) -> int:
    rel = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
    return LONG_FIRST.index(rel) if rel in LONG_FIRST else len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    items[:] = sorted(items, key=_rank)  # stable: each file's own order is kept
    slow = pytest.mark.slow
    for item in items:
        p = Path(str(item.fspath)).resolve()
        in_vllm = p.parent == HERE / "vllm"
        sanitizer_child = p.parent == HERE / "simt" and "sanitizer" in item.name  # builds ASan/TSan (~40 s cold)
        if p.name in SLOW_FILES or (in_vllm and p.name not in FAST_VLLM_FILES) or sanitizer_child \
                or p.parent == HERE / "conformance":
            item.add_marker(slow)
