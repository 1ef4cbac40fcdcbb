"""Test support for the SIMT harness: the in-process build, other builds, the child process."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "child.py"
MISSING = "zipserv_vllm._simt is not built (pip install -e . builds it with g++; no CUDA needed)"

_spec = importlib.util.spec_from_file_location("zipserv_simt_build", ROOT / "csrc" / "simt" / "simt_build.py")
simt_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(simt_build)
EXIT_STATUS = simt_build.EXIT_STATUS


def module():
    """The plain build installed with the package, or None."""
    try:
        from zipserv_vllm import _simt
    except ImportError:
        return None
    return _simt


def _cache() -> Path:
    from zipserv_vllm.cache import cache_dir

    return cache_dir() / "simt"


def build(variant: str, root: Path | None = None, name: str = "clean") -> Path:
    """Build of ``variant`` from ``root`` (a copy of csrc/; default the tree's own), objects cached."""
    out = _cache() / "modules" / f"{name}-{variant}" / simt_build.module_filename()
    return simt_build.build(out, root=root or ROOT / "csrc", variant=variant, cache_dir=_cache() / "objs")


def run_child(module_path: Path, variant: str, request: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as d:
        req = Path(d) / "request.json"
        req.write_text(json.dumps(request))
        env = simt_build.sanitizer_env(variant)
        env.pop("PYTHONPATH", None)
        return subprocess.run([sys.executable, str(CHILD), str(module_path), str(req)], capture_output=True,
                              text=True, env=env, timeout=timeout)


def copy_csrc(dst: Path) -> Path:
    """A copy of csrc/ to plant a fault in."""
    shutil.copytree(ROOT / "csrc", dst, ignore=shutil.ignore_patterns("__pycache__", "*.o"))
    return dst


def plant(root: Path, path: str, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in root/path (the test fails if the source moved on)."""
    f = root / path
    text = f.read_text()
    n = text.count(old)
    if n != 1:
        raise AssertionError(f"{path}: the planted fault's anchor occurs {n} times (the kernel changed?): {old!r}")
    f.write_text(text.replace(old, new))

