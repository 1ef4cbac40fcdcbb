"""Measure the resident weight bytes of a loaded vLLM model (what the arena saves).

:func:`weight_memory` walks a model *as vLLM loaded it* and counts the bytes of
every distinct tensor storage it holds (parameters and buffers, each storage
once, so tied or shared tensors are not counted twice) plus every zipserv
arena page. Nothing is computed from shapes except ``compressed_bf16_bytes``,
the size the compressed layers would have in BF16, for the ratio.
Use it through ``LLM.apply_model(weight_memory)``.
"""

from __future__ import annotations

import torch


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int] | None:
    if t.is_meta or t.numel() == 0:
        return None
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr()), s.nbytes()


def weight_memory(model: torch.nn.Module) -> dict:
    """Bytes of the model's parameters/buffers and of its zipserv arenas."""
    storages: dict[tuple, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        kb = _storage_key_and_bytes(t)
        if kb is not None:
            storages[kb[0]] = kb[1]
    from ..format.cpu_layout import PackedTensor

    arenas, compressed, bf16, paths, equiv, parts, layouts = {}, 0, 0, {}, 0, {}, {}
    for mod in model.modules():
        st = mod.__dict__.get("_zs_state")
        if st is None:
            continue
        if st.bf16:
            bf16 += 1
        if st.arena is not None and st.tied_to is None:
            arenas[id(st.arena)] = st.arena
            compressed += 1
            equiv += 2 * st.rows * st.cols
            parts[st.prefix] = len(st.part_shapes)
            lay = "bytesplit" if st.parts and all(isinstance(p, PackedTensor) for p in st.parts) else "v1"
            layouts[lay] = layouts.get(lay, 0) + 1
        if st.path:
            paths[st.path] = paths.get(st.path, 0) + 1
    param_bytes = sum(storages.values())
    arena_bytes = sum(a.allocated_bytes for a in arenas.values())
    return {
        "param_and_buffer_bytes": param_bytes,
        "arena_bytes": arena_bytes,
        "arena_pages": sum(a.num_pages for a in arenas.values()),
        "total_bytes": param_bytes + arena_bytes,
        "layers_compressed": compressed,
        "layers_bf16": bf16,
        "load_paths": paths,
        "compressed_bf16_bytes": equiv,
        "parts": parts,  # compressed matrices per layer: 1 = one GEMM per call in fast mode
        "layouts": layouts,  # layers per in-memory layout: v1 (TCA-TBE) or bytesplit (CPU fast mode)
    }
