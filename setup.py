"""Build of zipserv-vllm's native extensions (pybind11; no torch C++ ABI).

* ``zipserv_vllm._C``: format constants and the multi-threaded CPU codec
  (csrc/*.cpp). Builds with g++ alone.
* ``zipserv_vllm._cpu_gemm``: fused decode-GEMM CPU kernels (csrc/cpu_gemm/).
* ``zipserv_vllm._cuda``: CUDA kernels (csrc/cuda/), compiled only when nvcc
  is found and ZIPSERV_NO_CUDA is not set.

Arrays and pointers come from Python, so one build serves several torch
versions. ``ZIPSERV_BUILD_ONLY=_C,_cpu_gemm`` restricts which extensions are
built (useful while developing one of them).
"""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

COMMON = dict(
    include_dirs=["csrc/include"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

extensions = [
    Pybind11Extension("zipserv_vllm._C", sorted(glob.glob("csrc/*.cpp")), **COMMON),
]
if glob.glob("csrc/cpu_gemm/*.cpp"):
    extensions.append(
        Pybind11Extension("zipserv_vllm._cpu_gemm", sorted(glob.glob("csrc/cpu_gemm/*.cpp")), **COMMON)
    )

only = {x.strip() for x in os.environ.get("ZIPSERV_BUILD_ONLY", "").split(",") if x.strip()}
if only:
    extensions = [e for e in extensions if e.name.rsplit(".", 1)[1] in only]

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
