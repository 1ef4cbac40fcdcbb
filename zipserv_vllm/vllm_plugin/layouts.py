"""Which in-memory layout each device holds, and moving layers into it.

* TCA-TBE v1 (``CompressedTensor``): the checkpoint's format, what exact mode
  and a GPU engine under ``prefer: memory`` hold;
* the byte-split layout (``PackedTensor``, docs/FORMAT.md appendix A): about
  12.05 bits per weight, a decode of a few integer operations per pair. Held
  on the CPU in fast mode (with the ``_cpu_gemm`` extension, unless
  ``ZIPSERV_CPU_LAYOUT=v1``), and on a GPU in fast mode when the engine holds
  it (``ZIPSERV_GPU_LAYOUT=bytesplit`` or ``prefer: speed``, its kernels
  having passed their first-contact check; the input embedding stays v1 there).

A layer gets there by :func:`pack_layer` (pack at load, straight from BF16) or
by :func:`repack` once loading is over (v1 tiles of a pre-compressed
checkpoint), one layer at a time, each v1 page released as soon as no layer
still needs it.
"""

from __future__ import annotations

import torch

from .. import settings
from ..codec import compress_tensor
from ..format import CompressedTensor
from ..format.cpu_layout import PackedTensor
from ..kernels import ops
from .arena import PagedArena
from .loading import LayerState
from .tiles import store_compressed

def cpu_layout() -> str:
    """``ZIPSERV_CPU_LAYOUT``: the in-memory layout of CPU fast mode (default ``bytesplit``)."""
    return settings.cpu_layout()


def uses_packed(device: torch.device, mode: str, gpu_layout: str = "v1") -> bool:
    """Whether layers on ``device`` are held in the byte-split layout: on the CPU in fast mode
    (unless ``ZIPSERV_CPU_LAYOUT=v1``); on a GPU in fast mode when the engine's ``gpu_layout`` is
    ``bytesplit`` and the CUDA kernels (and the native packer) are built (see :func:`repack`)."""
    device = torch.device(device)
    if mode != "fast":
        return False
    from ..kernels import cpu as cpu_kernels

    if device.type == "cuda":  # (the repack packs on the CPU: the native packer is needed too)
        from ..kernels import cuda

        return gpu_layout == "bytesplit" and cuda.REGISTERED and cpu_kernels.available()
    return device.type == "cpu" and cpu_layout() == "bytesplit" and cpu_kernels.available()


def pack_layer(state: LayerState, w: torch.Tensor, arena: PagedArena, packed: bool = False) -> None:
    """Compress the rank's BF16 weight ``w`` into ``arena`` (pack at load); with
    ``packed``, into the CPU byte-split layout instead of v1."""
    bf16_bytes = w.numel() * w.element_size()
    if packed:
        from ..kernels import cpu as cpu_kernels

        pt = cpu_kernels.pack(w.detach().to("cpu"))
        if pt.nbytes >= bf16_bytes:
            raise ValueError(f"its compressed form would not be smaller ({pt.bits_per_weight:.1f} bits per weight)")
        state.tables = [arena.store(pt.arrays())]
        state.part_shapes = [tuple(pt.shape)]
    else:
        ct = compress_tensor(w.detach().to("cpu"))
        if ct.nbytes >= bf16_bytes:
            raise ValueError(f"its compressed form would not be smaller ({ct.bits_per_weight:.1f} bits per weight)")
        if ct.device != arena.device:
            ct = ct.to(arena.device)
        state.tables = [store_compressed(arena, ct)]
        state.part_shapes = [tuple(ct.shape)]
    state.arena = arena
    state.bind()
    state.path = "packed"
    state.done = True


def stays_v1(state: LayerState, device) -> bool:
    """Whether :func:`repack` leaves ``state`` in v1 on ``device``: an input embedding table on a GPU
    (its gather kernel reads v1; on the CPU the packed embedding kernel reads the byte-split layout).
    An untied lm_head (``ParallelLMHead``, which only ever multiplies) is repacked like a linear
    layer; a tied one shares the embedding's parts."""
    if torch.device(device).type != "cuda" or state.kind != "embedding":
        return False
    from . import compat

    head = compat.find("ParallelLMHead", required=False)
    layer = state.layer
    return not (head is not None and layer is not None and isinstance(layer, head))


def repack(states: list[LayerState], old: PagedArena, new: PagedArena) -> int:
    """Repack every v1 part of ``states`` held in ``old`` into ``new`` in the
    byte-split layout, one layer at a time; each page of ``old`` is released as
    soon as no layer left to repack uses it, so the peak stays near the final
    size plus a page. Returns the number of layers repacked. On a GPU the
    embedding tables stay v1 (the gather kernel reads TCA-TBE v1), copied as
    they are; the parts are packed on the CPU (kernels.cpu.pack)."""
    from ..kernels import cpu as cpu_kernels

    def keeps_v1(st: LayerState) -> bool:
        return stays_v1(st, old.device)

    def pages(st: LayerState) -> set[int]:
        return {e.slot.page for t in st.tables for e in t.entries.values()}

    held = [st for st in states if st.arena is old and st.tables]
    count = sum(1 for st in held if not keeps_v1(st) and not all("tiles" in t.entries for t in st.tables))
    if not count:
        return 0
    # Layers already in the byte-split layout (packed at load, e.g. MoE experts beside v1 layers of a
    # pre-compressed checkpoint) move along, copied as they are: ``old`` is retired as a whole.
    users: dict[int, int] = {}  # layers (repacked or not) with arrays in each page
    for st in held:
        for page in pages(st):
            users[page] = users.get(page, 0) + 1
    todo = sorted(held, key=lambda st: min(e.slot.page for t in st.tables for e in t.entries.values()))
    for st in todo:
        used = pages(st)
        tables = []
        for part in st.parts:
            if isinstance(part, CompressedTensor) and keeps_v1(st):
                tables.append(store_compressed(new, part))
                continue
            if isinstance(part, PackedTensor):
                pt = part
            elif part.device.type == "cuda":  # decoded on the GPU (its decompress kernel), packed on the CPU
                pt = cpu_kernels.pack(ops.decode(part).cpu())
            else:
                pt = cpu_kernels.pack(part)
            tables.append(new.store(pt.arrays()))
            del pt
        st.parts = []
        st.tables, st.arena = tables, new
        st.bind()
        for page in used:
            users[page] -= 1
            if users[page] == 0:
                old.release(page)
    return count
