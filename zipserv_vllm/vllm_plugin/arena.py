"""A paged arena: the device memory that holds every compressed layer's arrays.

Instead of one allocation per stream (five per layer, hundreds per model), the
compressed arrays of all layers live in a few large, fixed-size **pages**
(64 MiB by default) allocated per device. Each layer keeps a small
**page table** (:class:`PageTable`): for each of its arrays the page, byte
offset, length, dtype and shape. The arrays the kernels see are views into
the pages.

Why: few large allocations instead of many small ones (allocator overhead,
fragmentation, and one large copy per page when loading), and the bytes in
use are known exactly (:attr:`PagedArena.allocated_bytes`), so memory reports
and vLLM's memory profiling see the compressed size.

Two ways to fill it:

* **planned** (all sizes known first, e.g. a pre-compressed checkpoint):
  :meth:`reserve` every array, then :meth:`commit` allocates each page with
  exactly the bytes reserved in it; then copy into :meth:`view`.
* **incremental** (sizes known one layer at a time, e.g. compressing while
  loading): :meth:`put` copies a tensor in, opening full-size pages as needed;
  :meth:`trim` finally shrinks partly used pages (one copy each), after which
  page tables must be resolved again (:meth:`views`).

Every array starts at a multiple of ``align`` bytes (256 by default) inside
its page, so int64 (and wider vector) views are legal. On Linux CPUs a page is
a fresh anonymous mapping advised to be backed by transparent huge pages
(``madvise`` ``MADV_HUGEPAGE`` before it is written; where the kernel's THP
setting is ``never`` nothing changes): the kernels stream
every weight once per call, and with 4 KiB pages each one costs a TLB miss
(docs/CPU.md). This module imports no vLLM.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass, field

import torch

DEFAULT_PAGE_BYTES = 64 << 20
DEFAULT_ALIGN = 256


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


_HUGE_PAGE = 2 << 20


def _page_memory(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of uninitialised page memory on ``device``. On Linux CPUs a fresh anonymous
    mapping advised to use transparent huge pages before anything touches it (torch's allocator
    may hand out recycled heap memory already backed by 4 KiB pages, where the advice comes too
    late); the tensor keeps the mapping alive. Elsewhere, and for pages under 2 MiB, torch's."""
    if device.type == "cpu" and nbytes >= _HUGE_PAGE and sys.platform.startswith("linux"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError, ValueError):  # (advisory: a kernel without THP keeps small pages)
            pass
        return torch.frombuffer(buf, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes at byte ``offset`` of page ``page``."""

    page: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Entry:
    """One array of a page table: where it is and how to view it."""

    slot: Slot
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class PageTable:
    """A layer's arrays by name (e.g. ``bitmaps``, ``sm``), each an :class:`Entry`."""

    entries: dict[str, Entry] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.slot.nbytes for e in self.entries.values())


@dataclass
class _Page:
    capacity: int
    used: int = 0
    tensor: torch.Tensor | None = None
    sealed: bool = False  # committed/trimmed pages take no further slots
    released: bool = False


class PagedArena:
    """Fixed-size pages of ``uint8`` device memory holding aligned arrays."""

    def __init__(self, device: torch.device | str = "cpu", page_bytes: int = DEFAULT_PAGE_BYTES,
                 align: int = DEFAULT_ALIGN):
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.device = torch.device(device)
        self.page_bytes = _round_up(page_bytes, align)
        self.align = align
        self._pages: list[_Page] = []

    # ------------------------------------------------------------- allocation
    def reserve(self, nbytes: int) -> Slot:
        """Reserve ``nbytes`` (no memory is touched yet). An array larger than a
        page gets a page of its own size."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        size = _round_up(max(nbytes, 1), self.align)
        page = self._pages[-1] if self._pages else None
        if page is None or page.sealed or page.used + size > page.capacity:
            page = _Page(capacity=max(self.page_bytes, size))
            self._pages.append(page)
        slot = Slot(len(self._pages) - 1, page.used, nbytes)
        page.used += size
        return slot

    def commit(self) -> None:
        """Allocate every reserved page that has no memory yet, with exactly its
        reserved bytes, and seal it."""
        for page in self._pages:
            if page.tensor is None and not page.released:
                page.capacity = page.used
                page.tensor = _page_memory(page.used, self.device)
                page.sealed = True

    def put(self, t: torch.Tensor) -> Entry:
        """Copy ``t`` into the arena (incremental fill) and return its entry."""
        src = t.detach().contiguous()
        nbytes = src.numel() * src.element_size()
        slot = self.reserve(nbytes)
        page = self._pages[slot.page]
        if page.tensor is None:
            page.tensor = _page_memory(page.capacity, self.device)
        entry = Entry(slot, src.dtype, tuple(src.shape))
        if nbytes:
            self.raw(slot).copy_(src.reshape(-1).view(torch.uint8), non_blocking=False)
        return entry

    def store(self, arrays: dict[str, torch.Tensor]) -> PageTable:
        """:meth:`put` every array; the returned table maps names to entries."""
        return PageTable({name: self.put(t) for name, t in arrays.items()})

    def trim(self) -> bool:
        """Shrink every partly used, allocated page to its used bytes (one copy
        each) and seal it. Returns True if any page moved: views taken before
        are then stale and must be re-resolved with :meth:`views`."""
        moved = False
        for page in self._pages:
            if page.tensor is not None and page.used < page.capacity:
                new = _page_memory(page.used, self.device)
                new.copy_(page.tensor[: page.used])
                page.tensor, page.capacity, moved = new, page.used, True
            page.sealed = page.sealed or page.tensor is not None
        return moved

    def release(self, index: int) -> None:
        """Free page ``index`` (its arrays are no longer needed; views taken
        before keep the memory alive until they are dropped)."""
        page = self._pages[index]
        page.tensor, page.sealed, page.released = None, True, True

    # ------------------------------------------------------------------ views
    def raw(self, slot: Slot) -> torch.Tensor:
        """The ``uint8`` bytes of ``slot`` (a view into its page)."""
        page = self._pages[slot.page]
        if page.released:
            raise RuntimeError(f"page {slot.page} was released")
        if page.tensor is None:
            raise RuntimeError(f"page {slot.page} has no memory yet: call commit() first")
        return page.tensor[slot.offset : slot.offset + slot.nbytes]

    def view(self, entry: Entry) -> torch.Tensor:
        """The array of ``entry`` as a typed view into its page."""
        raw = self.raw(entry.slot)
        if entry.slot.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        return raw.view(entry.dtype).view(entry.shape)

    def views(self, table: PageTable) -> dict[str, torch.Tensor]:
        return {name: self.view(e) for name, e in table.entries.items()}

    # ------------------------------------------------------------- accounting
    @property
    def num_pages(self) -> int:
        return sum(1 for p in self._pages if p.tensor is not None)

    def footprint(self, table: PageTable) -> int:
        """Bytes ``table``'s arrays take in their pages, alignment padding included (as reserved)."""
        return sum(_round_up(max(e.slot.nbytes, 1), self.align) for e in table.entries.values())

    @property
    def allocated_bytes(self) -> int:
        """Bytes of device memory the pages hold (what the arena costs)."""
        return sum(p.tensor.numel() for p in self._pages if p.tensor is not None)

    @property
    def used_bytes(self) -> int:
        """Bytes handed out to arrays, alignment padding included."""
        return sum(p.used for p in self._pages if p.tensor is not None)

    def stats(self) -> dict[str, int]:
        return {"pages": self.num_pages, "allocated_bytes": self.allocated_bytes,
                "used_bytes": self.used_bytes, "page_bytes": self.page_bytes}

    def __repr__(self) -> str:
        return (f"PagedArena(device={self.device}, pages={self.num_pages}, "
                f"allocated={self.allocated_bytes}, used={self.used_bytes})")
