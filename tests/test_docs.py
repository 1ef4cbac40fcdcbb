"""Every snippet in the README and docs/ runs as written and prints what the docs say it prints.

Each fenced block carries a marker comment on the line before it:

* ``<!-- doc-test: run -->``: run it. Python blocks run as a script. Bash
  blocks run line by line (``\\`` continues a line) from a scratch copy of the
  repository root (links to ``.venv``, ``examples/``, ...), in order, one
  scratch directory per document, so later blocks use what earlier ones made.
  In a transcript block, lines starting with ``$ `` are commands and the lines
  after them their expected output: each expected line must appear, in order, in
  what the command printed, with numbers, hex digests and runs of spaces free to
  differ (timings and paths vary); ``...`` stands for lines left out. A command
  exits 0 unless its expected output shows ``zipserv: error:`` (then 2) or
  ends with ``# exits N``.
* ``<!-- doc-test: skip REASON -->``: not run; the reason is required (a GPU
  command, a server that runs until stopped, pseudo-code...).

A block without a marker fails the test, so no snippet goes unchecked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*doc-test:\s*(run|skip)\b\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
TIMEOUT = 900


def blocks(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(prev)
        out.append({"line": start + 1, "lang": lang, "text": "\n".join(lines[start + 1 : j]),
                    "action": mark.group(1) if mark else None, "reason": mark.group(2) if mark else ""})
        i = j + 1
    return out


def test_every_snippet_is_marked():
    bad = []
    for path in DOCS:
        for b in blocks(path):
            where = f"{path.relative_to(ROOT)}:{b['line']}"
            if b["action"] is None:
                bad.append(f"{where}: no <!-- doc-test: run|skip REASON --> marker")
            elif b["action"] == "skip" and len(b["reason"]) < 8:
                bad.append(f"{where}: skipped without a reason")
    assert not bad, "\n".join(bad)


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of a bash block."""
    lines = text.splitlines()
    transcript = any(x.startswith("$ ") for x in lines)
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for x in lines:
        if transcript:
            if x.startswith("$ "):
                out.append((x[2:], []))
            elif out:
                out[-1][1].append(x)
            continue
        if pending:
            x = pending + " " + x.strip()
            pending = ""
        if x.rstrip().endswith("\\"):
            pending = x.rstrip()[:-1]
            continue
        if x.strip() and not x.lstrip().startswith("#"):
            out.append((x, []))
    return out


_NUM = re.compile(r"\b[0-9a-f]{8}\b|\d+(\.\d+)?")


def _norm(line: str) -> str:
    return " ".join(_NUM.sub("#", line).split())


def _matches(expected: list[str], got: str) -> str | None:
    """None when every expected line appears in order in ``got``; else the first missing one."""
    actual = [_norm(x) for x in got.splitlines()]
    pos = 0
    for e in expected:
        if e.strip() in ("", "...") or e.lstrip().startswith("(") and e.rstrip().endswith(")"):
            continue
        want = _norm(e)
        while pos < len(actual) and actual[pos] != want:
            pos += 1
        if pos == len(actual):
            return e
        pos += 1
    return None


def _scratch(tmp_path: Path) -> Path:
    d = tmp_path / "repo"
    d.mkdir()
    for name in (".venv", "examples", "benchmarks", "scripts", "zipserv_vllm", "configs", "docs", "tests"):
        if (ROOT / name).exists():
            (d / name).symlink_to(ROOT / name)
    return d


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs them
    return env


def _run_block(b: dict, cwd: Path, where: str, n: int) -> None:
    env = _env()
    if b["lang"] == "python":
        script = cwd / f"snippet_{n}.py"
        script.write_text(b["text"] + "\n")
        r = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.returncode == 0, f"{where}: the Python snippet failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return
    for cmd, expected in _commands(b["text"]):
        if cmd.strip().startswith("source ") and "activate" in cmd:
            continue  # the environment already has the venv's bin first on PATH
        m = re.search(r"#\s*exits\s+(\d+)\s*$", cmd)
        want = int(m.group(1)) if m else (2 if any("zipserv: error:" in e for e in expected) else 0)
        r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        got = r.stdout + r.stderr
        assert r.returncode == want, f"{where}: `{cmd}` exited {r.returncode}, expected {want}:\n{got[-3000:]}"
        missing = _matches(expected, got)
        assert missing is None, f"{where}: `{cmd}` did not print\n  {missing}\nit printed:\n{got[-3000:]}"


@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in DOCS])
def test_snippets_run(doc, tmp_path):
    path = ROOT / doc
    todo = [b for b in blocks(path) if b["action"] == "run"]
    if not todo:
        pytest.skip(f"{doc} has no runnable snippets (each is marked skip with its reason)")
    pytest.importorskip("transformers")
    cwd = _scratch(tmp_path)
    for n, b in enumerate(todo):
        _run_block(b, cwd, f"{doc}:{b['line']}", n)
