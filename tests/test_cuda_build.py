"""nvcc compiles every CUDA kernel for every listed architecture with warnings as errors.

Each csrc/cuda/*.cu is compiled once, with all ``-gencode`` flags
(``csrc/cuda/nvcc_build.py``, the same flags setup.py uses, plus
``-Werror all-warnings -Xcompiler -Werror``), into a temp dir; the sources
compile in parallel. Skipped where nvcc is absent. Nothing runs: this machine
has no GPU. Budget: ~30-60 s of nvcc on 2 cores (the time is printed).
"""

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("zipserv_nvcc_build", ROOT / "csrc" / "cuda" / "nvcc_build.py")
nvb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nvb)

NVCC = nvb.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME): CUDA kernels not compiled")


def test_every_kernel_compiles_for_every_arch_with_werror(tmp_path, monkeypatch, record_property):
    monkeypatch.delenv("ZIPSERV_CUDA_ARCHS", raising=False)
    archs = nvb.cuda_archs(NVCC)
    missing = [a for a in nvb.DEFAULT_ARCHS if a not in archs]
    assert not missing, f"this nvcc cannot target {missing}"
    srcs = nvb.cu_sources()
    assert {s.name for s in srcs} >= {"zipgemm.cu", "decompress.cu", "encode.cu"} | {f"zipgemm_n{t}.cu" for t in (8, 16, 32, 64, 128)}
    t0 = time.perf_counter()
    objs = nvb.compile_all(NVCC, srcs, tmp_path, archs, werror=True)
    dt = time.perf_counter() - t0
    record_property("nvcc_seconds", round(dt, 1))
    print(f"\nnvcc: {len(srcs)} sources x {len(archs)} archs (sm_{', sm_'.join(archs)}) in {dt:.1f} s")
    for o in objs:
        assert o.stat().st_size > 0
        # SASS for every arch is embedded (the fatbin names each target)
        data = o.read_bytes()
        for a in archs:
            assert f"sm_{a}".encode() in data, f"{o.name} has no sm_{a} code"
        if o.name.startswith("zipgemm_n"):  # each instance file holds the dense and the grouped (MoE) kernel
            assert b"fused_kernel" in data and b"grouped_kernel" in data, o.name


def test_werror_is_effective(tmp_path):
    """The flags really turn a warning into an error (so the test above can fail)."""
    src = tmp_path / "warn.cu"
    src.write_text("__global__ void k(int* p) { int unused; p[0] = 1; }\n")
    cmd = nvb.nvcc_command(NVCC, src, tmp_path / "warn.o", ["80"], werror=True, threads=1)
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0, "an unused variable compiled under -Werror"


def test_arch_override(monkeypatch):
    monkeypatch.setenv("ZIPSERV_CUDA_ARCHS", "90")
    assert nvb.cuda_archs(NVCC) == ["90"]
    flags = nvb.gencode_flags(["90"])
    assert flags == ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
    monkeypatch.setenv("ZIPSERV_CUDA_ARCHS", "75")
    with pytest.raises(ValueError, match="8.0"):
        nvb.cuda_archs(NVCC)


def test_extension_links_cudart_only():
    cu = pytest.importorskip("zipserv_vllm._cuda", reason="zipserv_vllm._cuda not built (pip install -e . with nvcc)")
    simt = pytest.importorskip("zipserv_vllm._simt", reason="zipserv_vllm._simt not built (pip install -e .)")
    assert tuple(cu.tile_ns()) == (8, 16, 32, 64, 128)
    for t in cu.tile_ns():  # nvcc's and g++'s (SIMT build) compile of the shared-memory map agree
        assert cu.fused_smem_bytes(t) == simt.fused_smem_bytes(t)
    r = subprocess.run(["ldd", cu.__file__], capture_output=True, text=True)
    if r.returncode == 0:
        libs = r.stdout
        assert "libtorch" not in libs and "libc10" not in libs, "the CUDA extension must not link the torch C++ ABI"
        assert "libcudart.so" not in libs, "cudart is linked statically"
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") == "" and not Path("/dev/nvidia0").exists():
        with pytest.raises(RuntimeError, match="zipserv CUDA prepare"):
            cu.prepare()  # no GPU here: a clear error, not a crash


def test_lane_decode_is_branch_free(tmp_path):
    """decode_lane_pair compiles to straight-line PTX: selects, no data-dependent branch."""
    src = tmp_path / "lane.cu"
    src.write_text(
        '#include "zipserv/decode_lane.h"\n'
        "__global__ void k(const uint64_t* p, const uint8_t* sm, const uint16_t* fb, const int* hb, uint32_t* out) {\n"
        "  const int t = threadIdx.x;\n"
        "  out[t] = zipserv::decode_lane_pair(p[3 * t], p[3 * t + 1], p[3 * t + 2], hb[t] & 255, sm, fb, hb[t], hb[t + 1], t & 31);\n"
        "}\n")
    ptx = tmp_path / "lane.ptx"
    r = subprocess.run([NVCC, "-std=c++17", "-O3", f"-I{nvb.INCLUDE_DIR}", "-arch=sm_80", "-ptx", str(src), "-o", str(ptx)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    body = ptx.read_text()
    assert "popc.b64" in body and "selp" in body
    assert " bra" not in body and "\tbra" not in body, "decode_lane_pair has a branch"


def test_toolkit_mismatch_is_one_clear_line(monkeypatch):
    """A CUDA 13 nvcc beside a torch built for CUDA 12 is not used silently: its extension would need a
    newer driver (R580) than torch's (R525). The build prints one line and skips the extension."""
    import sys

    sys.path.insert(0, str(ROOT / "csrc" / "cuda"))
    import nvcc_build

    monkeypatch.setattr(nvcc_build, "nvcc_version", lambda nvcc: (13, 0))
    monkeypatch.setattr(nvcc_build, "torch_cuda_version", lambda: (12, 8))
    line = nvcc_build.toolkit_mismatch("nvcc")
    assert line.startswith("zipserv-vllm: nvcc is CUDA 13.0 but torch was built for CUDA 12.8")
    assert ">= 580.65.06" in line and "ZIPSERV_ALLOW_CUDA_MISMATCH=1" in line
    monkeypatch.setattr(nvcc_build, "torch_cuda_version", lambda: (13, 0))
    assert nvcc_build.toolkit_mismatch("nvcc") is None
    monkeypatch.setattr(nvcc_build, "torch_cuda_version", lambda: None)  # a CPU torch: build for the tests
    assert nvcc_build.toolkit_mismatch("nvcc") is None
