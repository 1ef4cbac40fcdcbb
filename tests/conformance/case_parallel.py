"""Two gloo ranks on the CPU: tensor parallel 2 and pipeline parallel 2, through vLLM's model loader.

Two processes (``torch.multiprocessing``, started once for both cases) join
one gloo group, build the tiny Llama from its zipserv checkpoint with this vLLM's
``get_model`` at TP=2 or PP=2, and check every compressed layer they hold
against the source checkpoint: at TP=2 each rank's part is the rank's slice
(rows of column-parallel layers, columns of row-parallel ones); at PP=2 each
rank builds only its half of the layers (vLLM's PPMissingLayer for the rest),
and the plugin only those. Between the two the ranks tear down vLLM's groups and
the gloo group, and join a new one on another port.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from zipserv_vllm.serve import free_port


def _rank(rank: int, ports: dict, zs: str, bf16: str, out: dict) -> None:
    """One rank: the model at TP=2, then (the groups torn down, a new store) at PP=2."""
    os.environ.setdefault("ZIPSERV_MODE", "exact")
    try:
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model

        from conftest import building_config, source_weight

        from zipserv_vllm.vllm_plugin import register
        from zipserv_vllm.vllm_plugin.methods import _full_weight

        register()
        try:
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

            _set_torch_accelerator_to_noop()
        except ImportError:
            torch.accelerator.empty_cache = lambda *a, **k: None
        src = load_file(os.path.join(bf16, "model.safetensors"))
    except Exception:
        for parallel in ports:
            out[(rank, parallel)] = "ERROR " + traceback.format_exc()
        return
    for parallel, port in ports.items():
        try:
            os.environ["VLLM_DIST_IDENT"] = f"zipserv-conformance-{port}"  # what vLLM's CPU worker sets
            size = {"tensor_parallel_size": 2} if parallel == "tp" else {"pipeline_parallel_size": 2}
            with building_config():
                vc = EngineArgs(model=zs, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                                kv_cache_memory_bytes=32 << 20, distributed_executor_backend="mp",
                                **size).create_engine_config()
            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                             local_rank=rank, backend="gloo")
                initialize_model_parallel(2 if parallel == "tp" else 1, 2 if parallel == "pp" else 1)
                model = get_model(vllm_config=vc)
            seen = []
            for name, mod in model.named_modules():
                st = mod.__dict__.get("_zs_state")
                if st is None or not st.parts or st.tied_to is not None:
                    continue
                want = source_weight(src, name, rank if parallel == "tp" else None)
                got = _full_weight(st)[: want.shape[0]]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, name)
                seen.append(name)
            out[(rank, parallel)] = sorted(seen)
            del model
            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:
            out[(rank, parallel)] = "ERROR " + traceback.format_exc()
            for later in ports:  # the groups were not torn down: the later cases cannot run here
                out.setdefault((rank, later), f"ERROR not run: the {parallel} case failed first")
            return


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("conf_parallel")
    bf16 = build_tiny_model(root / "bf16", "llama", intermediate_size=768)  # 384 rows per TP rank: whole tiles
    return str(bf16), str(compress_checkpoint(bf16, root / "zs", progress=False).dst)


@pytest.fixture(scope="module")
def two_ranks(tiny):
    """Both cases in one pair of rank processes (TP=2, then PP=2): each spawned rank imports vLLM once."""
    bf16, zs = tiny
    ports = {"tp": free_port(), "pp": free_port()}
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, ports, zs, bf16, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        return dict(out)


@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_two_ranks(two_ranks, parallel):
    res = {r: two_ranks.get((r, parallel)) for r in range(2)}
    for r in range(2):
        assert isinstance(res[r], list), res[r]
    if parallel == "tp":  # every layer on both ranks, each with its own part
        assert res[0] == res[1] and len(res[0]) == 10
    else:  # the layers split between the stages: embedding + layer 0 on rank 0, layer 1 + lm_head on rank 1
        assert not set(res[0]) & set(res[1]) and len(res[0]) + len(res[1]) == 10
        assert "model.embed_tokens" in res[0] and "lm_head" in res[1]
