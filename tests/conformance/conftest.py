"""The conformance suite: the plugin against one vLLM release's own classes, on the CPU.

Run in a subprocess per vLLM release by tests/test_conformance.py (the files
are ``case_*.py``, which the main test run does not collect): vLLM 0.32 from the
venv, and vLLM 0.33's Python package (``.vllm033/``, made by scripts/setup.sh)
put in front of it with ``PYTHONPATH`` and ``VLLM_TARGET_DEVICE=cpu``. Its
compiled kernels are absent (the GPU wheel's), which layers, loaders and model
construction do not need; nothing here runs an engine.

One session-wide vLLM context: a ``VllmConfig`` on the CPU device, a one-rank
gloo process group and model parallel size 1.

vLLM 0.34's CPU platform refuses an x86 host without triton-cpu while it
checks a new config (``CpuPlatform.check_and_update_config``: "vLLM on x86 CPUs
requires Triton (triton-cpu)"; 0.33 only warned), and triton-cpu is not on
PyPI. Nothing in this suite runs a Triton kernel (no engine, no forward pass
through vLLM's Triton ops), so :func:`building_config` tells that one check
that Triton is there, only while a config is built, and puts the flag back.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch


def pytest_report_header(config):
    import vllm

    return f"conformance: vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}, torch {torch.__version__}"


@contextlib.contextmanager
def building_config():
    """Build a vLLM config here (see the module docstring): ``vllm.triton_utils.HAS_TRITON`` reads True
    for the duration of the block on a vLLM whose CPU platform demands Triton, and as it was after."""
    import vllm.triton_utils as triton_utils

    old = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = old


@pytest.fixture(scope="session")
def vllm_cpu():
    os.environ.setdefault("ZIPSERV_MODE", "exact")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from zipserv_vllm.serve import free_port
    from zipserv_vllm.vllm_plugin import register

    register()
    # What vLLM's CPU model runner does before it loads a model: torch.accelerator calls (empty_cache,
    # synchronize) become no-ops on a host without an accelerator.
    try:
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
    except ImportError:  # pragma: no cover - moved in some release: the same, by hand
        def _set_torch_accelerator_to_noop():
            torch.accelerator.empty_cache = lambda *a, **k: None
            torch.accelerator.synchronize = lambda *a, **k: None
    _set_torch_accelerator_to_noop()
    port = free_port()
    with building_config():
        vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield vc


def source_weight(src: dict, name: str, rank: int | None = None):
    """The weight vLLM's module ``name`` holds, from the checkpoint tensors ``src``: q/k/v and
    gate/up joined as vLLM joins them; with ``rank`` (TP=2), that rank's part of each (rows of
    column-parallel layers, columns of o/down_proj, rows of the vocabulary)."""
    def part(w, dim=0):
        return w if rank is None else w.chunk(2, dim=dim)[rank]

    for fused, names in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if name.endswith(fused):
            p = name[: -len(fused)]
            return torch.cat([part(src[f"{p}{x}.weight"]) for x in names])
    dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
    return part(src[f"{name}.weight"], dim)
