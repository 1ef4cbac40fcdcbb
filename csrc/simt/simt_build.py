"""How ``zipserv_vllm._simt`` is built: shared by setup.py and the harness tests.

Pure standard library (setup.py imports it before anything is installed);
pybind11 is imported only when a build runs.

The module is the CUDA kernels' own sources (``csrc/cuda/*.cu``, compiled by
g++ as C++ with ``ZIPSERV_SIMT``), the same bindings as ``_cuda``
(``csrc/cuda/bindings.cpp``), the harness runtime and its self-tests
(``csrc/simt/``). Three variants:

* ``plain``: optimised, run in-process by the test suite;
* ``asan``: AddressSanitizer on every translation unit (each global and shared
  access checked against its allocation; in-flight cp.async destinations
  poisoned); loaded by a child process with ``LD_PRELOAD`` (``sanitizer_env``);
* ``tsan``: ThreadSanitizer on the kernels and bindings (the runtime tells it
  about barriers and fibers, csrc/simt/runtime.cpp).

``build(output, root=...)`` compiles from any copy of ``csrc/`` (the tests
plant faults in a copy), one object per source in parallel, cached by the hash
of the command and of every file the source includes (``g++ -MM``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent
VARIANTS = ("plain", "asan", "tsan")
_OPT = {"plain": ["-O2"], "asan": ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
        "tsan": ["-O1", "-g", "-fsanitize=thread"]}
_LINK = {"plain": [], "asan": ["-fsanitize=address"], "tsan": ["-fsanitize=thread"]}


def compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or "g++"


def sources(root: Path = CSRC) -> list[Path]:
    """Every translation unit of the module."""
    root = Path(root)
    return (sorted((root / "cuda").glob("*.cu")) + [root / "cuda" / "bindings.cpp"]
            + sorted((root / "simt").glob("*.cpp")))


def _python_includes() -> list[str]:
    import pybind11

    return [pybind11.get_include(), sysconfig.get_paths()["include"]]


def flags(src: Path, root: Path, variant: str) -> list[str]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    root = Path(root)
    opt = list(_OPT[variant])
    if variant == "tsan" and src.name == "runtime.cpp":
        opt = ["-O1", "-g", "-DSIMT_TSAN=1"]  # the runtime's bookkeeping is not instrumented (runtime.cpp)
    inc = [f"-I{root / 'include'}", f"-I{root / 'cuda'}", f"-I{root}"]
    if src.name in ("bindings.cpp", "module.cpp"):
        inc += [f"-isystem{p}" for p in _python_includes()]
    lang = ["-x", "c++"] if src.suffix == ".cu" else []
    return ["-std=c++17", "-fPIC", "-DZIPSERV_SIMT", "-Wall", "-Wextra", "-Wno-unknown-pragmas",
            "-fvisibility=hidden", *opt, *inc, *lang]


def _deps(cxx: str, src: Path, fl: list[str]) -> list[Path]:
    out = subprocess.run([cxx, *fl, "-MM", str(src)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"g++ -MM failed on {src}:\n{out.stderr}")
    text = out.stdout.replace("\\\n", " ")
    return [Path(p) for p in text.split(":", 1)[1].split()]


def _key(cxx: str, src: Path, fl: list[str], root: Path) -> str:
    h = hashlib.sha256()
    h.update(" ".join([cxx, *fl]).replace(str(root), "<root>").encode())
    for dep in sorted(set(_deps(cxx, src, fl))):
        h.update(str(dep.name).encode())
        h.update(dep.read_bytes())
    return h.hexdigest()[:24]


def build(output: str | Path, root: str | Path = CSRC, variant: str = "plain", cache_dir: str | Path | None = None,
          jobs: int | None = None, log=None) -> Path:
    """Compile and link the module from ``root`` (a csrc/ tree) into ``output``."""
    root, output = Path(root).resolve(), Path(output)
    cache = Path(cache_dir) if cache_dir else output.parent / "simt_objs"
    objdir = cache / variant
    objdir.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    srcs = sources(root)

    def one(src: Path) -> Path:
        fl = flags(src, root, variant)
        obj = objdir / f"{src.stem}-{_key(cxx, src, fl, root)}.o"
        if not obj.exists():
            if log:
                log(f"g++ [{variant}] {src.name}")
            tmp = obj.with_suffix(f".{os.getpid()}.tmp")
            r = subprocess.run([cxx, *fl, "-c", str(src), "-o", str(tmp)], capture_output=True, text=True)
            if r.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"g++ failed on {src.name} ({variant}):\n{r.stdout}{r.stderr}")
            tmp.replace(obj)
        return obj

    with ThreadPoolExecutor(max_workers=jobs or max(1, os.cpu_count() or 1)) as pool:
        objs = list(pool.map(one, srcs))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + f".{os.getpid()}.tmp")
    r = subprocess.run([cxx, "-shared", *map(str, objs), "-o", str(tmp), *_LINK[variant], "-pthread"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"linking {output.name} ({variant}) failed:\n{r.stdout}{r.stderr}")
    tmp.replace(output)
    return output


def module_filename() -> str:
    return "_simt" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


SANITIZER_CHILD_THREADS = {name: "1" for name in (
    "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")}


def sanitizer_env(variant: str, env: dict | None = None) -> dict:
    """Environment of a Python child process that loads a sanitizer build: the
    sanitizer runtime preloaded (the interpreter is not instrumented), halting
    with a distinct exit status on the first report."""
    env = dict(os.environ if env is None else env)
    if variant == "plain":
        return env
    # One thread for every library the child loads that keeps a pool of its own (numpy's
    # OpenBLAS, an OpenMP runtime): those libraries are not instrumented, so TSan cannot see
    # their synchronisation and reports races that are not in the kernels. Set here, over
    # whatever the caller's environment says, so the result does not depend on the machine.
    env.update(SANITIZER_CHILD_THREADS)
    def lib(name):
        return subprocess.run([compiler(), f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()

    # libstdc++ is preloaded with the runtime: the interpreter does not link it, and ASan's
    # __cxa_throw interceptor must find the real one at start-up, or the first C++ exception
    # (a fault the harness reports, a pybind11 error) aborts the process.
    env["LD_PRELOAD"] = f"{lib(f'lib{variant}.so')} {lib('libstdc++.so')}"
    if variant == "asan":
        env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:exitcode=86:abort_on_error=0"
    else:
        env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=87:report_signal_unsafe=0"
    return env


EXIT_STATUS = {"asan": 86, "tsan": 87}


if __name__ == "__main__":  # python csrc/simt/simt_build.py OUT.so [variant]
    out = build(sys.argv[1], variant=sys.argv[2] if len(sys.argv) > 2 else "plain", log=print)
    print(out)
