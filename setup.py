"""Build of the zipserv_vllm._C extension (pybind11).

The C++ part builds with g++ alone. The CUDA part (csrc/cuda) is compiled only
when nvcc is found; set ZIPSERV_NO_CUDA=1 to skip it. The extension uses no
torch C++ ABI: arrays and pointers come from Python.
"""

import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

CPP_SOURCES = sorted(
    os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp")
)

ext = Pybind11Extension(
    "zipserv_vllm._C",
    CPP_SOURCES,
    include_dirs=["csrc/include"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
