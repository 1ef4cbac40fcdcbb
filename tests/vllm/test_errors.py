"""A refused checkpoint reaches the user as one readable line, whatever vLLM wraps around it.

Real processes as users start them (vLLM's multiprocess engine, no in-process
shortcut): the launcher ``python -m zipserv_vllm.serve`` ends with the line and
status 1; a script calling ``LLM(...)`` dies with the line printed at the top of
the final error report, before vLLM's traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file, save_file

TIMEOUT = 240
LAYER = "model.layers.1.self_attn.o_proj"


def _damaged(src, dst):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    sm = t[f"{LAYER}.zs_sm"].clone()
    sm[100] ^= 1
    t[f"{LAYER}.zs_sm"] = sm
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # what users run: the engine in its own process
    env.pop("ZIPSERV_ERROR_FILE", None)
    return env


def test_launcher_ends_with_the_line(llama_dirs, tmp_path):
    d = _damaged(llama_dirs[1], tmp_path / "zs")
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.serve", str(d), "--port", "1", "--enforce-eager",
                        "--max-model-len", "128"], capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 1
    assert lines[-1].startswith(f"zipserv: error: checkpoint tensor {LAYER}.zs_* is damaged: tile (0, 0) does not "
                                "match its checksum"), lines[-3:]


def test_truncated_shard_through_the_launcher(llama_dirs, tmp_path):
    d = tmp_path / "zs"
    shutil.copytree(llama_dirs[1], d)
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.serve", str(d), "--port", "1", "--enforce-eager"],
                       capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 1 and lines[-1].startswith("zipserv: error: checkpoint shard model.safetensors is "
                                                      "truncated: tensor "), lines[-3:]


def test_llm_script_prints_the_line_first(llama_dirs, tmp_path):
    d = _damaged(llama_dirs[1], tmp_path / "zs")
    script = tmp_path / "run.py"
    script.write_text("from vllm import LLM\n\nif __name__ == '__main__':\n"
                      f"    LLM(model={str(d)!r}, enforce_eager=True, max_model_len=128)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    err = r.stderr.splitlines()
    assert r.returncode == 1
    i = next(i for i, x in enumerate(err) if x.startswith("zipserv: error: "))
    assert f"checkpoint tensor {LAYER}.zs_* is damaged" in err[i]
    assert err[i + 1] == "(vLLM's report of it follows)" and err[i + 2].startswith("Traceback")
    assert not any(x.startswith("Traceback") for x in err[i + 3:])  # nothing after it but vLLM's one report


def test_bad_setting_through_the_launcher(llama_dirs):
    """A ZIPSERV_* value that does not exist stops vLLM in the process the user started: one line, status 1."""
    env = dict(_env(), ZIPSERV_THREADS="abc")
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.serve", str(llama_dirs[1]), "--port", "1",
                        "--enforce-eager", "--max-model-len", "128"], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env)
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 1
    assert lines[-1] == "zipserv: error: ZIPSERV_THREADS must be an integer >= 1, got 'abc'", lines[-3:]
