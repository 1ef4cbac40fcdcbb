"""How the CUDA sources are compiled: shared by setup.py and tests/test_cuda_build.py.

Pure standard library (setup.py imports it before anything is installed).

* ``find_nvcc()``: ``$CUDA_HOME/bin/nvcc`` or ``nvcc`` on PATH, else None.
* ``cuda_archs()``: ``ZIPSERV_CUDA_ARCHS`` ("90" or "80,86;90") or the
  default 80, 86, 89, 90, 100, 120, limited to what this nvcc supports.
* ``nvcc_command(src, obj, archs, werror)``: one nvcc call producing one
  object with every ``-gencode`` (SASS for each arch + PTX of the newest),
  ``--threads`` so the archs compile in parallel.
* ``compile_all(srcs, out_dir, ...)``: all sources, in parallel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEFAULT_ARCHS = ("80", "86", "89", "90", "100", "120")
SOURCES_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = SOURCES_DIR.parent / "include"


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuda_top(nvcc: str) -> Path:
    """The toolkit root nvcc itself uses (works through wrapper scripts)."""
    out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    m = re.search(r"^#\$ TOP=(.*)$", out, re.M)
    if m:
        return Path(m.group(1).strip()).resolve()
    return Path(nvcc).resolve().parent.parent


def cuda_lib_dir(nvcc: str) -> Path:
    top = cuda_top(nvcc)
    for cand in (top / "lib64", top / "targets" / "x86_64-linux" / "lib", top / "targets" / "sbsa-linux" / "lib", top / "lib"):
        if (cand / "libcudart_static.a").exists() or (cand / "libcudart.so").exists():
            return cand
    raise RuntimeError(f"no libcudart under {top}: set CUDA_HOME")


def supported_archs(nvcc: str) -> set[str]:
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set(DEFAULT_ARCHS)
    return {m.group(1) for m in re.finditer(r"compute_(\d+)", out)}


# The oldest driver a CUDA runtime of each major needs (NVIDIA's release notes; the extension
# links the toolkit's cudart_static, so the toolkit decides).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA version torch was built for; None for a CPU torch or without torch."""
    try:
        import torch
    except ImportError:
        return None
    v = getattr(torch.version, "cuda", None)
    if not v:
        return None
    major, minor = (int(x) for x in v.split(".")[:2])
    return major, minor


def toolkit_mismatch(nvcc: str) -> str | None:
    """One line when nvcc's CUDA major differs from torch's (the extension would then need a
    newer driver than torch does, or fail to share its runtime's expectations); None otherwise."""
    have, want = nvcc_version(nvcc), torch_cuda_version()
    if have is None or want is None or have[0] == want[0]:
        return None
    return (f"zipserv-vllm: nvcc is CUDA {have[0]}.{have[1]} but torch was built for CUDA {want[0]}.{want[1]}; "
            f"the CUDA extension built with it needs an NVIDIA driver >= {MIN_DRIVER.get(have[0], '?')} "
            f"(torch's CUDA {want[0]} needs >= {MIN_DRIVER.get(want[0], '?')}). Not building it: point CUDA_HOME at "
            f"a CUDA {want[0]} toolkit, or set ZIPSERV_ALLOW_CUDA_MISMATCH=1 to build anyway")


def cuda_archs(nvcc: str) -> list[str]:
    env = os.environ.get("ZIPSERV_CUDA_ARCHS", "").replace(";", ",").replace(" ", ",")
    wanted = [a.strip().replace("sm_", "").replace(".", "") for a in env.split(",") if a.strip()] or list(DEFAULT_ARCHS)
    bad = [a for a in wanted if not a.isdigit() or int(a) < 80]
    if bad:
        raise ValueError(f"ZIPSERV_CUDA_ARCHS has {bad}: the kernels need compute capability 8.0+ (e.g. '80,90')")
    have = supported_archs(nvcc)
    archs = [a for a in wanted if a in have]
    if not archs:
        raise RuntimeError(f"this nvcc supports none of the archs {wanted} (it has {sorted(have)})")
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = max(archs, key=int)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def nvcc_command(nvcc: str, src: str | Path, obj: str | Path, archs: list[str], werror: bool = False,
                 threads: int | None = None) -> list[str]:
    cmd = [nvcc, "-std=c++17", "-O3", "-c", str(src), "-o", str(obj), f"-I{INCLUDE_DIR}", f"-I{SOURCES_DIR}",
           "-Xcompiler", "-fPIC,-Wall,-Wextra", "--threads", str(threads or max(1, os.cpu_count() or 1))]
    if werror:
        cmd += ["-Werror", "all-warnings", "-Xcompiler", "-Werror"]
    return cmd + gencode_flags(archs)


def cu_sources() -> list[Path]:
    return sorted(SOURCES_DIR.glob("*.cu"))


def compile_all(nvcc: str, srcs: list[Path], out_dir: str | Path, archs: list[str], werror: bool = False) -> list[Path]:
    """Compile every source to out_dir/<name>.o in parallel; raise with nvcc's output on failure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cores = max(1, os.cpu_count() or 1)
    per = max(1, cores // max(1, len(srcs)))

    def one(src: Path) -> Path:
        obj = out_dir / (src.name + ".o")
        r = subprocess.run(nvcc_command(nvcc, src, obj, archs, werror, threads=per), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src.name}:\n{r.stdout}{r.stderr}")
        return obj

    with ThreadPoolExecutor(max_workers=min(len(srcs), cores) or 1) as pool:
        return list(pool.map(one, srcs))
