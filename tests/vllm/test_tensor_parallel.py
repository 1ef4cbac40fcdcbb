"""Tensor parallel size 2 on CPU: pre-compressed and pack-at-load equal BF16 TP=2 bit for bit.

One subprocess runs the three TP=2 engines in turn (base, pre-compressed,
pack at load). In the pre-compressed run each rank reads only its own tiles
where the split falls on 64-element tile boundaries (q/k/v, o, embedding,
lm_head of the tiny Llama), and falls back to decode, split, re-encode for the
MLP, whose 688 = 2 x 344 rows/columns do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from zs_e2e import e2e_environ

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tp_runs(llama_dirs, tmp_path_factory):
    bf16, zs = llama_dirs
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    env = dict(e2e_environ(), VLLM_CPU_OMP_THREADS_BIND="0|1", PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(HERE / "tp_worker.py"), str(out), f"base={bf16}", f"pre={zs}", f"pack={bf16},zipserv",
           f"pre_tp1={zs},tp1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"TP=2 worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), proc.stderr + proc.stdout


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_tp2_identical_to_bf16_tp2(tp_runs, way):
    runs, _ = tp_runs
    assert len(runs["base"]["tokens"]) >= 8
    assert runs[way]["tokens"] == runs["base"]["tokens"]
    assert runs[way]["logprobs"] == runs["base"]["logprobs"]


def test_tp2_ranks_load_their_own_tiles(tp_runs):
    runs, log = tp_runs
    mems = runs["pre"]["memory"]
    assert len(mems) == 2  # one report per rank
    for mem in mems:
        assert mem["load_paths"] == {"tiles": 6, "re-encoded": 4}
        assert mem["layers_compressed"] == 10
    # one summary line per rank counts them (the reason is a debug line: VLLM_LOGGING_LEVEL=DEBUG)
    assert log.count("4 re-encoded at load, 6 loaded tile by tile") == 2
    # Each rank holds about half of what one engine at TP=1 holds (not the whole model, which a
    # comparison of the two ranks with each other could not tell apart).
    (tp1,) = runs["pre_tp1"]["memory"]
    for m in mems:
        assert 0.4 * tp1["arena_bytes"] < m["arena_bytes"] < 0.6 * tp1["arena_bytes"], (m["arena_bytes"], tp1["arena_bytes"])
        assert 0.4 * tp1["compressed_bf16_bytes"] < m["compressed_bf16_bytes"] < 0.6 * tp1["compressed_bf16_bytes"]
    assert all(m["load_paths"] == {"packed": 10} for m in runs["pack"]["memory"])
