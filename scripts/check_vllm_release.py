#!/usr/bin/env python3
"""Check zipserv-vllm against a vLLM release in one command: ``check_vllm_release.py VERSION``.

Fetches that release's Python package from PyPI into ``.vllm-release/VERSION/``
(``pip install --no-deps --target``: no dependencies, the venv's torch stays),
then, with it in front of the venv's packages on the CPU platform:

1. the compatibility layer's own check (``zipserv_vllm.vllm_plugin.compat.missing()``):
   every vLLM API the plugin uses, and the signatures it relies on;
2. the conformance suite (tests/conformance/): every layer type, whole models
   through that release's model loader, TP=2 and PP=2, bit for bit.

It prints what broke (one line per missing API, each failing test with the end
of its error) and exits 0 when everything passed, 1 when something broke, 2
when the release could not be fetched. Run it from the repository with the
venv's Python (``.venv/bin/python scripts/check_vllm_release.py 0.35.0``).
A release whose CPU platform needs triton-cpu is handled as for 0.34
(tests/conformance/conftest.py). Nothing here runs a model: releases without a
CPU wheel still check.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_conformance import release_env, run_suite  # noqa: E402


def fetch(version: str) -> Path:
    """The folder holding vLLM ``version``'s Python package: one scripts/setup.sh made (``.vllm034/``
    for 0.34.0), an earlier fetch, or a new one."""
    for folder in (ROOT / f".vllm0{version.split('.')[1]}", ROOT / ".vllm-release" / version):
        if (folder / f"vllm-{version}.dist-info").is_dir() and (folder / "vllm").is_dir():
            return folder
    print(f"fetching vLLM {version}'s Python package into {folder.relative_to(ROOT)} (no dependencies)", flush=True)
    shutil.rmtree(folder, ignore_errors=True)  # a fetch cut short leaves a partial package pip would keep
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(folder), f"vllm=={version}"], capture_output=True, text=True)
    if r.returncode != 0 or not (folder / f"vllm-{version}.dist-info").is_dir():
        lines = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        why = (errors or lines or [f"pip exit status {r.returncode}"])[-1]
        shutil.rmtree(folder, ignore_errors=True)
        raise SystemExit(f"check_vllm_release: could not fetch vllm=={version}: {why}")
    return folder


def compat_problems(env: dict) -> list[str]:
    code = ("from zipserv_vllm.vllm_plugin import compat\n"
            "for line in compat.missing(): print('MISSING', line)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return [f"importing the plugin under this vLLM failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"]
    return [line[len("MISSING "):] for line in r.stdout.splitlines() if line.startswith("MISSING ")]


def failures(output: str) -> list[str]:
    """``FAILED test - reason`` / ``ERROR ...`` lines of pytest's short summary."""
    return [line for line in output.splitlines() if re.match(r"^(FAILED|ERROR) ", line)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="a vLLM release on PyPI, e.g. 0.35.0")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?([.-]?(rc|post|dev)\d+)?", args.version):
        print(f"check_vllm_release: {args.version!r} is not a release number (e.g. 0.35.0)", file=sys.stderr)
        return 2
    try:
        folder = fetch(args.version)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    env = release_env(folder)
    try:
        problems = compat_problems(env)
        for line in problems:
            print(f"compat: {line}")
        r = run_suite(env)
    except subprocess.TimeoutExpired as exc:
        print(f"check_vllm_release: {' '.join(map(str, exc.cmd[-2:]))} did not finish within {exc.timeout:.0f} s",
              file=sys.stderr)
        return 1
    out = r.stdout + r.stderr
    header = next((line for line in out.splitlines() if line.startswith("conformance: vLLM")), "")
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line
                    or " error" in line), "(no pytest summary)")
    print(header or f"conformance: vLLM {args.version} (the suite printed no header)")
    for line in failures(out):
        print(line)
    print(f"conformance suite: {summary.strip('= ')}")
    if r.returncode != 0 and not failures(out):
        print(out[-3000:])
    ok = (r.returncode == 0 and not problems and f"conformance: vLLM {args.version}" in out
          and " passed" in summary)  # a suite that only skipped proves nothing
    print(f"vLLM {args.version}: {'everything zipserv-vllm checks passed' if ok else 'something broke (above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
