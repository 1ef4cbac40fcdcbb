"""Measure the resident weight bytes of a loaded vLLM model (what the arena saves).

:func:`weight_memory` walks a model *as vLLM loaded it* and counts the bytes of
every distinct tensor storage it holds (parameters and buffers, each storage
once, so tied or shared tensors are not counted twice) plus every zipserv
arena page.

vLLM's CPU backend may move a BF16 layer's weight out of its parameter into a
prepacked GEMM kernel (``dispatch_cpu_unquantized_gemm(remove_weight=True)``:
the SGL or zentorch kernels hold a packed tensor, oneDNN a handle to its own
reordered copy). The tensors such a kernel's closure holds are counted like
parameters; a oneDNN handle does not expose its buffer, so it is counted as
``K * N * itemsize`` bytes and reported separately as ``prepacked_bytes``.
Apart from that, nothing is computed from shapes except
``compressed_bf16_bytes``, the size the compressed layers would have in BF16,
for the ratio. Use it through ``LLM.apply_model(weight_memory)``.
"""

from __future__ import annotations

import torch


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int] | None:
    if t.is_meta or t.numel() == 0:
        return None
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr()), s.nbytes()


def _prepacked(mod: torch.nn.Module, storages: dict[tuple, int]) -> int:
    """Weights a CPU GEMM kernel took out of ``mod.weight``: tensors in its closure go
    into ``storages``; returns the bytes of oneDNN handles (K * N * itemsize)."""
    fn = mod.__dict__.get("cpu_linear")
    w = mod.__dict__.get("_parameters", {}).get("weight")
    if fn is None or w is None or w.numel():
        return 0
    handles = 0
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            obj = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(obj, torch.Tensor):
            kb = _storage_key_and_bytes(obj)
            if kb is not None:
                storages[kb[0]] = kb[1]
        elif hasattr(obj, "handler_tensor") and getattr(obj, "k", -1) > 0 and getattr(obj, "n", -1) > 0:
            handles += obj.k * obj.n * w.element_size()
    return handles


def weight_memory(model: torch.nn.Module) -> dict:
    """Bytes of the model's parameters/buffers, prepacked CPU GEMM weights and zipserv arenas."""
    storages: dict[tuple, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        kb = _storage_key_and_bytes(t)
        if kb is not None:
            storages[kb[0]] = kb[1]
    prepacked = sum(_prepacked(mod, storages) for mod in model.modules())
    from ..format.cpu_layout import PackedTensor

    arenas, compressed, bf16, paths, equiv, parts, layouts, by_layer = {}, 0, 0, {}, 0, {}, {}, {}
    referenced = 0
    checked: dict[str, int] = {}

    def states(mod):
        st = mod.__dict__.get("_zs_state")
        return ([st] if st is not None else []) + list(mod.__dict__.get("_zs_moe_states") or [])  # vllm_plugin/moe.py

    for st in (st for mod in model.modules() for st in states(mod)):
        if st.bf16:
            bf16 += 1
        if st.arena is not None and st.tied_to is None:
            arenas[id(st.arena)] = st.arena
            compressed += 1
            equiv += 2 * st.rows * st.cols
            referenced += sum(st.arena.footprint(t) for t in st.tables)
            parts[st.prefix] = len(st.part_shapes)
            lay = "bytesplit" if st.parts and all(isinstance(p, PackedTensor) for p in st.parts) else "v1"
            layouts[lay] = layouts.get(lay, 0) + 1
        if st.path:
            paths[st.path] = paths.get(st.path, 0) + 1
            by_layer[st.prefix] = st.path
        if st.path in ("tiles", "re-encoded") and st.tied_to is None:  # read from a zipserv checkpoint
            key = st.checked or "not checked"
            checked[key] = checked.get(key, 0) + 1
    param_bytes = sum(storages.values())
    arena_bytes = sum(a.allocated_bytes for a in arenas.values())
    return {
        "param_and_buffer_bytes": param_bytes,  # incl. tensors held by prepacked CPU GEMM kernels
        "prepacked_bytes": prepacked,  # oneDNN-held weights, K * N * itemsize each
        "arena_bytes": arena_bytes,
        "arena_pages": sum(a.num_pages for a in arenas.values()),
        # allocated arena bytes that no loaded layer's arrays use: 0 after a clean load (weight updates
        # leave old arrays in pages other layers still share, until those pages are free)
        "arena_unreferenced_bytes": arena_bytes - referenced,
        "total_bytes": param_bytes + prepacked + arena_bytes,
        "layers_compressed": compressed,
        "layers_bf16": bf16,
        "load_paths": paths,
        "layer_paths": by_layer,  # how each layer was loaded: tiles / re-encoded / packed / bf16
        "compressed_bf16_bytes": equiv,
        "parts": parts,  # compressed matrices per layer: 1 = one GEMM per call in fast mode
        "layouts": layouts,  # layers per in-memory layout: v1 (TCA-TBE) or bytesplit (CPU fast mode)
        # matrices read from a zipserv checkpoint, by how their data was checked at load:
        # tiles / full / no checksums / no CRC stored / not checked (the summary line says the same)
        "checked": checked,
        # CPU fast mode: the kernel measured fastest per shape and N bucket at engine start
        # (kernels/cpu_dispatch.py): {"MxK": [[bucket, kernel], ...]}
        "cpu_kernels": _cpu_kernels(),
        # the native codec's threads in this worker (decode, tile checks, pack at load): its default
        # count, the OS threads one parallel call really ran on (torch's OpenMP team), torch's count
        # and this thread's affinity mask
        "codec_threads": _codec_threads(),
    }


def _codec_threads() -> dict[str, int]:
    import os

    import torch

    from .. import codec

    n = codec.default_threads()
    used = codec._C.threads_used(n) if codec.native_available() else 0
    return {"default": n, "used": used, "torch": torch.get_num_threads(), "affinity": len(os.sched_getaffinity(0))}


def _cpu_kernels() -> dict[str, list]:
    from ..kernels import cpu_dispatch

    return {f"{m}x{k}": [list(r) for r in rows] for (m, k), rows in cpu_dispatch.measured().items()}
