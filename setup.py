"""Build of zipserv-vllm's native extensions (pybind11; only ``_cpu_op`` uses torch's C++ ABI).

* ``zipserv_vllm._C``: format constants and the multi-threaded CPU codec
  (csrc/*.cpp, on torch's OpenMP threads). Builds with g++ alone.
* ``zipserv_vllm._cpu_gemm``: fused decode-GEMM CPU kernels (csrc/cpu_gemm/).
* ``zipserv_vllm._cpu_op``: the C++ CPU kernel of the ``zipserv::packed_gemm``
  op (csrc/cpu_op/), built against the installed torch when it is importable.
* ``zipserv_vllm._cuda``: CUDA kernels (csrc/cuda/), compiled only when nvcc
  is found and ZIPSERV_NO_CUDA is not set.
* ``zipserv_vllm._simt``: the same CUDA kernel sources compiled by g++ and run
  on the CPU by the SIMT harness (csrc/simt/, built by csrc/simt/simt_build.py),
  for the tests. Needs no CUDA.

Arrays and pointers come from Python, so one build serves several torch
versions (``_cpu_op`` excepted: it loads only under the torch it was built with). ``ZIPSERV_BUILD_ONLY=_C,_cpu_gemm`` restricts which extensions are
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
    # zlib: CRC-32 of stored arrays and tiles (csrc/codec.cpp); zlib.h comes with the Python headers' toolchain.
    # OpenMP: the codec runs on torch's own libgomp threads (csrc/codec.cpp, parallel_chunks).
    Pybind11Extension("zipserv_vllm._C", sorted(glob.glob("csrc/*.cpp")),
                      depends=sorted(glob.glob("csrc/include/zipserv/*.h")), libraries=["z"],
                      **{**COMMON, "extra_compile_args": COMMON["extra_compile_args"] + ["-fopenmp"],
                         "extra_link_args": COMMON["extra_link_args"] + ["-fopenmp"]}),
]
if glob.glob("csrc/cpu_gemm/*.cpp"):
    extensions.append(
        # OpenMP: the kernels run on torch's own libgomp threads (csrc/cpu_gemm/parallel.cpp).
        Pybind11Extension(
            "zipserv_vllm._cpu_gemm", sorted(glob.glob("csrc/cpu_gemm/*.cpp")),
            depends=sorted(glob.glob("csrc/cpu_gemm/*.inc") + glob.glob("csrc/include/zipserv/*.h")),
            **{**COMMON, "extra_compile_args": COMMON["extra_compile_args"] + ["-fopenmp"],
               "extra_link_args": COMMON["extra_link_args"] + ["-fopenmp"]},
        )
    )

# ``zipserv_vllm._cpu_op``: zipserv::packed_gemm's CPU kernel in C++ (csrc/cpu_op/), so compiled graphs
# call the GEMM without Python. The one extension built against torch's C++ ABI: only when torch is
# importable at build time (pip's build isolation hides it: the op then stays Python, slower per call),
# and loaded only by the torch version it was built with (kernels/cpu.py).
def _torch_op_extension():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("zipserv-vllm: torch is not importable while building; skipping zipserv_vllm._cpu_op "
              "(build with --no-build-isolation for the C++ op)")
        return None
    return Pybind11Extension(
        "zipserv_vllm._cpu_op", ["csrc/cpu_op/packed_gemm_op.cpp"],
        # (torch's version.py: a torch upgrade rebuilds it, as the other torch would refuse it)
        depends=["csrc/include/zipserv/cpu_gemm.h", "csrc/include/zipserv/cpu_layout.h",
                 os.path.join(os.path.dirname(torch.__file__), "version.py")],
        include_dirs=["csrc/include"] + cpp_extension.include_paths(),
        library_dirs=cpp_extension.library_paths(),
        runtime_library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[("TORCH_EXTENSION_NAME", "_cpu_op"), ("TORCH_API_INCLUDE_EXTENSION_H", None),
                       ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
                       ("ZIPSERV_TORCH_VERSION", '"' + torch.__version__ + '"')],
        # C++20: torch 2.13's headers use it (bit-field initializers warn under C++17)
        cxx_std=20, extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    )


if glob.glob("csrc/cpu_op/*.cpp"):
    _op_ext = _torch_op_extension()
    if _op_ext is not None:
        extensions.append(_op_ext)


def _load(name, path):
    """A build helper under csrc/ (pure standard library, shared with the tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_nvcc_build():
    """csrc/cuda/nvcc_build.py (flags shared with tests/test_cuda_build.py)."""
    return _load("zipserv_nvcc_build", os.path.join("csrc", "cuda", "nvcc_build.py"))


# ``zipserv_vllm._simt``: built by csrc/simt/simt_build.py (BuildExt below), not by setuptools.
_simt_build = None
if glob.glob("csrc/simt/*.cpp"):
    _simt_build = _load("zipserv_simt_build", os.path.join("csrc", "simt", "simt_build.py"))
    extensions.append(Pybind11Extension("zipserv_vllm._simt", ["csrc/simt/module.cpp"]))


# ``zipserv_vllm._cuda``: only when nvcc is found and ZIPSERV_NO_CUDA is unset.
_nvb = None
if glob.glob("csrc/cuda/*.cu") and not os.environ.get("ZIPSERV_NO_CUDA"):
    _nvb = _load_nvcc_build()
    _nvcc = _nvb.find_nvcc()
    _mismatch = _nvb.toolkit_mismatch(_nvcc) if _nvcc is not None else None
    if _nvcc is None:
        print("zipserv-vllm: nvcc not found, skipping the CUDA extension (set CUDA_HOME to build it)")
        _nvb = None
    elif _mismatch and not os.environ.get("ZIPSERV_ALLOW_CUDA_MISMATCH"):
        print(_mismatch)
        _nvb = None
    else:
        extensions.append(
            Pybind11Extension(
                "zipserv_vllm._cuda", ["csrc/cuda/bindings.cpp"],
                include_dirs=["csrc/include", "csrc/cuda"], cxx_std=17,
                extra_compile_args=["-O2", "-Wall", "-Wextra"],
                library_dirs=[str(_nvb.cuda_lib_dir(_nvcc))],
                # static cudart: the .so does not depend on the toolkit's or torch's libcudart version
                libraries=["cudart_static", "dl", "rt", "pthread"],
            )
        )

only = {x.strip() for x in os.environ.get("ZIPSERV_BUILD_ONLY", "").split(",") if x.strip()}
if only:
    extensions = [e for e in extensions if e.name.rsplit(".", 1)[1] in only]


class BuildExt(build_ext):
    """build_ext that first compiles csrc/cuda/*.cu with nvcc (in parallel) for ``_cuda``."""

    def build_extension(self, ext):
        if ext.name == "zipserv_vllm._simt":
            # Objects cached in the source tree by content (build/simt_objs), like the CUDA ones.
            here = os.path.dirname(os.path.abspath(__file__))
            _simt_build.build(self.get_ext_fullpath(ext.name), variant="plain",
                              cache_dir=os.path.join(here, "build", "simt_objs"), log=print)
            return
        if ext.name == "zipserv_vllm._cuda" and _nvb is not None:
            nvcc = _nvb.find_nvcc()
            archs = _nvb.cuda_archs(nvcc)
            # In the source tree, not build_temp (a fresh temporary directory for every pip build):
            # a rebuild only recompiles the .cu files when a CUDA source or header changed.
            out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "cuda_objs", "_".join(archs))
            srcs = _nvb.cu_sources()
            objs = [os.path.join(out, s.name + ".o") for s in srcs]
            deps = [str(p) for p in srcs] + glob.glob("csrc/cuda/*.cuh") + glob.glob("csrc/cuda/*.h") + \
                glob.glob("csrc/include/zipserv/*.h")
            newest = max(os.path.getmtime(d) for d in deps)
            if self.force or not all(os.path.exists(o) and os.path.getmtime(o) >= newest for o in objs):
                print(f"zipserv-vllm: nvcc {', '.join('sm_' + a for a in archs)} -> {out}")
                objs = [str(o) for o in _nvb.compile_all(nvcc, srcs, out, archs)]
            ext.extra_objects = objs
            ext.depends = list(ext.depends) + deps
        super().build_extension(ext)


setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
