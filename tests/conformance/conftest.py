"""The conformance suite: the plugin against one vLLM release's own classes, on the CPU.

Run in a subprocess per vLLM release by tests/test_conformance.py (the files
are ``case_*.py``, which the main test run does not collect): vLLM 0.32 from the
venv, and vLLM 0.33's Python package (``.vllm033/``, made by scripts/setup.sh)
put in front of it with ``PYTHONPATH`` and ``VLLM_TARGET_DEVICE=cpu``. Its
compiled kernels are absent (the GPU wheel's), which layers, loaders and model
construction do not need; nothing here runs an engine.

One session-wide vLLM context: a ``VllmConfig`` on the CPU device, a one-rank
gloo process group and model parallel size 1.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch


def pytest_report_header(config):
    import vllm

    return f"conformance: vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}, torch {torch.__version__}"


@pytest.fixture(scope="session")
def vllm_cpu():
    os.environ.setdefault("ZIPSERV_MODE", "exact")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
