"""The error file of vllm_plugin/errors.py: a fresh private file per run, the newest message shown,
a successful load's own messages dropped. No vLLM needed (errors.py imports none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from zipserv_vllm.vllm_plugin import errors

_PROBE = """
import json, os, stat, sys
from zipserv_vllm.vllm_plugin import errors
errors.install()
path = os.environ[errors.ENV]
errors.report(ValueError("zipserv: the first problem"))
errors.report(ValueError("zipserv: the second problem"))
print(json.dumps({"path": path, "mode": stat.S_IMODE(os.stat(path).st_mode), "islink": os.path.islink(path),
                  "last": errors.last_error()}))
"""


def _probe(env):
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_each_run_gets_a_fresh_private_file_and_the_newest_message(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop(errors.ENV, None)
    # What the old fixed name invited: a stale file (or a symlink) at zipserv-errors-<pid>.txt.
    for pid in range(os.getpid(), os.getpid() + 200):
        (tmp_path / f"zipserv-errors-{pid}.txt").write_text("zipserv: a stale error of another run\n")
    a, b = _probe(env), _probe(env)
    assert a["path"] != b["path"] and os.path.dirname(a["path"]) == str(tmp_path)
    assert a["mode"] == 0o600 and not a["islink"]
    assert a["last"] == b["last"] == "zipserv: the second problem"
    assert not os.path.exists(a["path"]) and not os.path.exists(b["path"])  # removed when the run ends


def test_a_successful_load_clears_only_its_own_lines(monkeypatch, tmp_path):
    path = tmp_path / "errors.txt"
    path.write_text("")
    monkeypatch.setenv(errors.ENV, str(path))
    errors.report(ValueError("zipserv: mine, before the load went well"))
    # another process of the same run (a second tensor-parallel rank) reports after it
    with open(path, "a") as f:
        f.write(f"{os.getpid() + 1}\tzipserv: rank 1's tile (0, 0) does not match its checksum\n")
    assert errors.last_error() == "zipserv: rank 1's tile (0, 0) does not match its checksum"
    errors.report(ValueError("zipserv: mine, newest"))
    assert errors.last_error() == "zipserv: mine, newest"
    errors.clear_mine()
    assert errors.last_error() == "zipserv: rank 1's tile (0, 0) does not match its checksum"
    assert path.read_text().count("\n") == 1
    errors.clear_mine()  # nothing of mine left: unchanged
    assert errors.last_error() == "zipserv: rank 1's tile (0, 0) does not match its checksum"


def test_no_file_means_no_message(monkeypatch):
    monkeypatch.delenv(errors.ENV, raising=False)
    assert errors.last_error() is None
    errors.clear_mine()
