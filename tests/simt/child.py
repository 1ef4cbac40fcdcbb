"""Child process of the harness tests: loads one build of zipserv_vllm._simt by path and runs a request.

    python child.py MODULE.so REQUEST.json

The request is {"selftest": [name, threads]}, {"cases": "cases.npz",
"schedules": ["forward", ...]} or {"environ": [name, ...]} (prints those
variables of the child's environment as JSON). It prints one line per failing case and exits
1 if any failed; a sanitizer report ends the process with the sanitizer's own
exit status first (csrc/simt/simt_build.py, sanitizer_env). Imports numpy and
this directory's kernels.py / cases.py by path only: no torch, no package, so
a sanitizer runtime preloaded into the interpreter sees only the kernels.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("_simt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    mod = load_module(sys.argv[1])
    req = json.loads(Path(sys.argv[2]).read_text())
    if "environ" in req:
        print(json.dumps({name: os.environ.get(name) for name in req["environ"]}))
        return 0
    if "selftest" in req:
        name, threads = req["selftest"]
        err, msg, _ = mod.selftest(name, [1, 2, 3, 4], threads)
        print(f"selftest {name}: error {err} {msg}")
        return 1 if err else 0
    mod.prepare()
    failed = 0
    todo = cases.load(req["cases"])
    for schedule in req.get("schedules", ["forward"]):
        mod.configure(schedule, 3)
        for c in todo:
            msg = cases.run(mod, c)
            if msg:
                failed += 1
                print(f"[{schedule}] {msg}", flush=True)
    print(f"{len(todo)} cases x {len(req.get('schedules', ['forward']))} schedules, {failed} failed; "
          f"harness counters: {mod.stats()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
