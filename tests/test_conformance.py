"""The conformance suite (tests/conformance/) against every vLLM release the plugin is tested with.

Each release runs the suite in its own process: vLLM 0.32 from the venv, and
vLLM 0.33's and 0.34's Python packages from ``.vllm033/`` and ``.vllm034/``
(made by scripts/setup.sh: ``pip install --no-deps --target .vllm034
vllm==0.34.0``), put in front of the venv's packages with ``PYTHONPATH`` and run
on the CPU platform (``VLLM_TARGET_DEVICE=cpu``) with the venv's torch 2.13.
The end-to-end tests (engine, server) run on 0.32 only: vLLM 0.33 and 0.34 have
no CPU wheel, and their GPU wheels' compiled kernels are not there, which
layers, loaders and model construction do not need. vLLM 0.34's CPU platform
demands triton-cpu, which is not on PyPI: tests/conformance/conftest.py says how
the suite builds configs without it. ``scripts/check_vllm_release.py VERSION``
runs the same suite against any release.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_suite(env_extra: dict, python: str = sys.executable) -> subprocess.CompletedProcess:
    """The conformance suite in a fresh process with ``env_extra`` (e.g. another vLLM on PYTHONPATH)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_extra)
    return subprocess.run([python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o",
                           "python_files=case_*.py", str(ROOT / "tests" / "conformance")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def release_env(folder: Path) -> dict:
    """The environment that puts the vLLM Python package in ``folder`` in front of the venv's.

    With a cache root of its own per release: vLLM caches each model class's inspection
    (``modelinfos/<module>-<class>.json``, keyed by the model file's hash, one file per class), so
    two releases sharing ~/.cache/vllm overwrite each other's entries and every engine start after
    the other release ran inspects the class again in a subprocess (~9-12 s per architecture here).
    The root is in the user's cache directory, named by the release's dist-info (``vllm-0.33.0``),
    so a fresh clone finds the inspections of an earlier run (measured: the 0.33 suite 45 s cold,
    20 s warm); a folder without one keeps its cache beside the package."""
    dist = sorted(folder.glob("vllm-*.dist-info"))
    if dist:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        cache = base / "zipserv-vllm-tests" / dist[0].name.removesuffix(".dist-info")
    else:
        cache = folder / ".vllm-cache"
    return {"PYTHONPATH": str(folder), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(cache)}


def _release_folder(release: str) -> Path:
    folder = ROOT / f".vllm0{release.split('.')[1]}"
    if not (folder / "vllm").is_dir():
        pytest.skip(f"{folder} is missing: scripts/setup.sh installs vLLM {release}'s Python package there")
    return folder


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_conformance(release):
    pytest.importorskip("vllm")
    env = release_env(_release_folder(release)) if release != "0.32" else {}
    r = run_suite(env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"conformance: vLLM {release}." in out, out[:2000]
    assert " passed" in out and "failed" not in out.splitlines()[-1]


def _check_release(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_vllm_release.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=2000)


def test_conformance_034_through_check_vllm_release():
    """vLLM 0.34 through the one-command release check (scripts/check_vllm_release.py), which finds the
    package scripts/setup.sh put in .vllm034/ (nothing downloaded): the compatibility layer's check and
    the whole conformance suite pass, and the script says so with exit status 0."""
    pytest.importorskip("vllm")
    _release_folder("0.34")
    r = _check_release("0.34.0")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "conformance: vLLM 0.34.0 from " + str(ROOT / ".vllm034") in out, out[-3000:]
    assert "compat:" not in out and "FAILED" not in out
    assert "vLLM 0.34.0: everything zipserv-vllm checks passed" in out


def test_check_vllm_release_refuses_a_bad_version_in_one_line():
    r = _check_release("latest")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "check_vllm_release: 'latest' is not a release number (e.g. 0.35.0)"


def test_check_vllm_release_says_in_one_line_when_the_release_cannot_be_fetched(monkeypatch):
    """pip offline (PIP_NO_INDEX): exit status 2, one line naming the release and pip's error, nothing
    left behind."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    r = _check_release("0.31.99")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.startswith("check_vllm_release: could not fetch vllm==0.31.99: ") and "\n" not in err, err
    assert "Traceback" not in r.stdout + r.stderr
    assert not (ROOT / ".vllm-release" / "0.31.99").exists()
