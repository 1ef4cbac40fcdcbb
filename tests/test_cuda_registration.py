"""The CUDA kernels are registered on the ops only when zipserv_vllm._cuda is built.

Without the extension, registering them made every CUDA tensor raise instead of
taking the ops' composite implementation. Checked in fresh interpreters, with
the extension importable and with it made unimportable.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

PROBE = (
    "import sys\n"
    "{hide}"
    "import torch, zipserv_vllm.kernels as k\n"
    "has = lambda op: torch._C._dispatch_has_kernel_for_dispatch_key(op, 'CUDA')\n"
    "print(k.cuda.REGISTERED, has('zipserv::gemm'), has('zipserv::decompress'), has('zipserv::embedding'))\n"
)


def _probe(hide: bool) -> str:
    code = PROBE.format(hide="sys.modules['zipserv_vllm._cuda'] = None\n" if hide else "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_not_registered_without_the_extension():
    assert _probe(hide=True) == "False False False False"


@pytest.mark.skipif(importlib.util.find_spec("zipserv_vllm._cuda") is None,
                    reason="zipserv_vllm._cuda is not built here (no nvcc)")
def test_registered_with_the_extension():
    assert _probe(hide=False) == "True True True True"


def test_composite_decompress_returns_on_the_arrays_device():
    import torch

    import zipserv_vllm
    from zipserv_vllm.kernels import ops

    w = (torch.randn(70, 130) * 0.02).to(torch.bfloat16)
    ct = zipserv_vllm.compress_tensor(w)
    out = ops.decompress(ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, 70, 130)
    assert out.device == ct.sm.device and torch.equal(out.view(torch.int16), w.view(torch.int16))


def test_offsets_validated_once_and_again_after_a_change(monkeypatch):
    """The host-side validation cache of kernels/cuda.py, which needs no GPU: the second look-up of a
    validated weight must find it (the first GPU run found the WeakKeyDictionary it used raising
    'Boolean value of Tensor with more than one value is ambiguous' there), and an in-place change
    of the offsets must send it through validation again."""
    import torch

    import zipserv_vllm
    from zipserv_vllm.kernels import cuda

    ct = zipserv_vllm.compress_tensor((torch.randn(130, 200) * 0.02).to(torch.bfloat16))
    arrays = (ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, *ct.shape)
    seen = []
    real = cuda.validate_weight
    monkeypatch.setattr(cuda, "validate_weight", lambda *a: (seen.append(1), real(*a)))
    monkeypatch.setattr(cuda, "_capturing", lambda: False)
    for _ in range(3):
        cuda._check_offsets_once(*arrays)
    assert len(seen) == 1
    ct.offsets[0, 0, 0] = ct.offsets[0, 0, 0]  # a write bumps the tensor's version
    cuda._check_offsets_once(*arrays)
    assert len(seen) == 2
    ct.offsets[-1, -1, 0] = 1 << 40  # a segment outside the stream: refused before any kernel reads it
    with pytest.raises(ValueError):
        cuda._check_offsets_once(*arrays)


def test_dispatch_cache_is_keyed_by_the_driver():
    from zipserv_vllm.kernels import autotune, cuda

    prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Jul 10 2025\nGCC version: gcc 12\n"
    open_ = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder)\n"
    assert cuda.driver_from_proc(prop) == "580.159.04"
    assert cuda.driver_from_proc(open_) == "580.65.06"
    assert cuda.driver_from_proc("garbage") is None
    assert isinstance(cuda.driver_version(), str)  # no driver here: torch's answer, never an exception
    a = autotune.cache_file("NVIDIA H200", "580.159.04", "0.1.0")
    assert a != autotune.cache_file("NVIDIA H200", "580.65.06", "0.1.0") and "580-159-04" in a.name
