"""GPU tests: collected everywhere, skipped with the reason where no CUDA device / extension exists."""

import pytest


def _reason() -> str:
    import torch

    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: the CUDA kernels cannot run here (the same sources run on the CPU: tests/simt/)"
    from zipserv_vllm.kernels import cuda as cuda_ops

    return cuda_ops.unavailable_reason()


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            if reason is None:
                reason = _reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
            item.add_marker(pytest.mark.gpu)
