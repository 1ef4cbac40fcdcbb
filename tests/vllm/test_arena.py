"""Unit tests of the paged arena and the tile plans (no vLLM needed)."""

import pytest
import torch

from zipserv_vllm import compress_tensor, decompress_tensor
from zipserv_vllm.format import CompressedTensor
from zipserv_vllm.vllm_plugin.arena import PagedArena
from zipserv_vllm.vllm_plugin.tiles import TilePlan, compressed_from_table, store_compressed


def _w(m, k, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * std).to(torch.bfloat16)


def _bits(t):
    return t.contiguous().view(torch.int16)


def test_put_views_alignment_and_accounting():
    arena = PagedArena(page_bytes=4096, align=256)
    a = torch.arange(10, dtype=torch.int64)
    b = torch.arange(7, dtype=torch.uint8)
    c = torch.arange(300, dtype=torch.int16)
    ea, eb, ec = arena.put(a), arena.put(b), arena.put(c)
    assert [e.slot.offset for e in (ea, eb, ec)] == [0, 256, 512]
    assert torch.equal(arena.view(ea), a) and torch.equal(arena.view(eb), b) and torch.equal(arena.view(ec), c)
    assert arena.num_pages == 1 and arena.allocated_bytes == 4096
    assert arena.used_bytes == 256 + 256 + 768
    for e in (ea, eb, ec):
        assert arena.view(e).data_ptr() % 256 == arena.view(ea).data_ptr() % 256


def test_new_page_when_full_and_large_arrays_get_own_page():
    arena = PagedArena(page_bytes=1024, align=256)
    e1 = arena.put(torch.zeros(900, dtype=torch.uint8))  # 1024 with alignment
    e2 = arena.put(torch.ones(10, dtype=torch.uint8))    # does not fit: page 1
    big = torch.arange(5000, dtype=torch.int16)
    e3 = arena.put(big)                                   # 10000 bytes > page: own page
    assert (e1.slot.page, e2.slot.page, e3.slot.page) == (0, 1, 2)
    assert torch.equal(arena.view(e3), big)
    assert arena.allocated_bytes == 1024 + 1024 + 10240


def test_trim_shrinks_partly_used_pages_and_keeps_data():
    arena = PagedArena(page_bytes=1 << 20)
    data = [torch.randint(-100, 100, (n,), dtype=torch.int64) for n in (3, 50, 1000)]
    entries = [arena.put(t) for t in data]
    assert arena.allocated_bytes == 1 << 20
    assert arena.trim() is True
    assert arena.allocated_bytes == arena.used_bytes == 256 + 512 + 8192
    for e, t in zip(entries, data):
        assert torch.equal(arena.view(e), t)
    assert arena.trim() is False
    e4 = arena.put(torch.ones(4, dtype=torch.uint8))  # a sealed page takes no more slots
    assert e4.slot.page == 1


def test_reserve_commit_is_exact():
    arena = PagedArena(page_bytes=2048)
    slots = [arena.reserve(n) for n in (100, 700, 1500, 5000, 10)]
    with pytest.raises(RuntimeError, match="commit"):
        arena.raw(slots[0])
    arena.commit()
    assert [s.page for s in slots] == [0, 0, 1, 2, 3]
    assert arena.allocated_bytes == (256 + 768) + 1536 + 5120 + 256
    arena.raw(slots[3]).fill_(7)
    assert int(arena.raw(slots[3]).sum()) == 7 * 5000


def test_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        PagedArena(align=100)
    with pytest.raises(ValueError, match="positive"):
        PagedArena(page_bytes=0)


@pytest.mark.parametrize("shape", [(256, 192), (200, 130), (64, 64), (130, 700)])
def test_store_and_view_round_trip(shape):
    w = _w(*shape)
    ct = compress_tensor(w)
    arena = PagedArena(page_bytes=1 << 16)
    table = store_compressed(arena, ct)
    back = compressed_from_table(arena, table, ct.shape)
    assert back.same_encoding(ct)
    assert torch.equal(_bits(decompress_tensor(back)), _bits(w))


def _execute(plan, page_bytes=1 << 16):
    arena = PagedArena(page_bytes=page_bytes)
    table = plan.reserve(arena)
    arena.commit()
    plan.copy_into(arena, table)
    ct = compressed_from_table(arena, table, plan.shape)
    ct.validate()
    return ct, arena


@pytest.mark.parametrize("dim,start,length", [(0, 0, 128), (0, 64, 136), (1, 0, 64), (1, 128, 72), (1, 64, 64), (None, 0, None)])
def test_plan_select_equals_narrow(dim, start, length):
    w = _w(200, 200, seed=3)
    ct = compress_tensor(w)
    plan = TilePlan.select(ct, dim, start, length)
    got, arena = _execute(plan)
    want = ct.compact() if dim is None else ct.narrow(dim, start, length)
    assert got.same_encoding(want)
    ref = w if dim is None else w.narrow(dim, start, length)
    assert torch.equal(_bits(decompress_tensor(got)), _bits(ref))
    assert arena.used_bytes >= plan.nbytes


def test_plan_cat_equals_cat_and_reads_only_own_ranges():
    q, k, v = _w(256, 128, 1), _w(128, 128, 2), _w(128, 128, 3)
    cts = [compress_tensor(t) for t in (q, k, v)]
    # rank 1 of TP=2: second half of each
    plans = [TilePlan.select(c, 0, c.shape[0] // 2, c.shape[0] // 2) for c in cts]
    plan = TilePlan.cat(plans)
    got, _ = _execute(plan)
    want = CompressedTensor.cat([c.narrow(0, c.shape[0] // 2, c.shape[0] // 2) for c in cts])
    assert got.same_encoding(want)
    # A row block of a canonical matrix is one contiguous range per stream.
    assert all(len(p.pieces["sm"]) == 1 and len(p.pieces["bitmaps"]) == 1 for p in plans)
    assert plan.sizes["sm"] == sum(c.narrow(0, c.shape[0] // 2, c.shape[0] // 2).sm.numel() for c in cts)


def test_plan_refuses_unaligned():
    ct = compress_tensor(_w(200, 200))
    with pytest.raises(ValueError, match="tile boundaries"):
        TilePlan.select(ct, 0, 32, 64)
    with pytest.raises(ValueError, match="rows"):
        TilePlan.cat([TilePlan.select(ct, 0, 128, 72), TilePlan.select(ct, 0, 0, 64)])


def test_repack_releases_each_v1_page_once_its_layers_are_repacked(monkeypatch):
    """CPU fast mode's repack (layouts.repack): every layer ends up in the byte-split
    layout, bit for bit, and each v1 page is freed as soon as no layer left needs it."""
    from zipserv_vllm.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    from zipserv_vllm.format.cpu_layout import PackedTensor
    from zipserv_vllm.vllm_plugin import layouts, loading

    old, new = PagedArena(page_bytes=1 << 16, align=256), PagedArena(page_bytes=1 << 16, align=256)
    weights, states = [], []
    for i in range(6):
        w = _w(128 + 64 * (i % 2), 200, seed=i)
        w[0, 0] = 0.0  # an exception
        ct = compress_tensor(w)
        st = loading.LayerState(prefix=f"l{i}", kind="linear", rows=w.shape[0], cols=200,
                                device=torch.device("cpu"), expected_shards=[None])
        st.arena, st.tables, st.part_shapes = old, [store_compressed(old, ct)], [tuple(w.shape)]
        st.bind()
        weights.append(w)
        states.append(st)
    pages_before = old.num_pages
    assert pages_before >= 3
    released = []
    real_release = old.release
    monkeypatch.setattr(old, "release", lambda i: (released.append((i, sum(s.arena is new for s in states))),
                                                    real_release(i)))
    assert layouts.repack(states, old, new) == 6
    assert old.num_pages == 0 and len(released) == pages_before
    assert released[0][1] < 6  # the first page went before the last layer was repacked
    for w, st in zip(weights, states):
        assert st.arena is new and all(isinstance(p, PackedTensor) for p in st.parts)
        assert torch.equal(_bits(cpu_kernels.packed_decode(st.parts[0])), _bits(w))
    assert layouts.repack(states, new, PagedArena()) == 0  # already packed: nothing to do


def test_repack_moves_layers_already_packed_beside_v1_ones():
    """A pre-compressed checkpoint's v1 layers and MoE experts packed at load share one arena: the
    repack retires that arena whole, moving the packed layers unchanged (no page left untracked)."""
    from zipserv_vllm.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    from zipserv_vllm.format.cpu_layout import PackedTensor
    from zipserv_vllm.vllm_plugin import layouts, loading

    old, new = PagedArena(page_bytes=1 << 16, align=256), PagedArena(page_bytes=1 << 16, align=256)
    weights, states = [], []
    for i in range(4):
        w = _w(128, 200, seed=10 + i)
        st = loading.LayerState(prefix=f"l{i}", kind="linear", rows=128, cols=200, device=torch.device("cpu"),
                                expected_shards=[None])
        if i % 2:  # packed at load
            layouts.pack_layer(st, w, old, packed=True)
        else:
            st.arena, st.tables, st.part_shapes = old, [store_compressed(old, compress_tensor(w))], [(128, 200)]
            st.bind()
        weights.append(w)
        states.append(st)
    assert layouts.repack(states, old, new) == 2  # the two v1 layers were repacked
    assert old.num_pages == 0
    for w, st in zip(weights, states):
        assert st.arena is new and isinstance(st.parts[0], PackedTensor)
        assert torch.equal(_bits(cpu_kernels.packed_decode(st.parts[0])), _bits(w))


def test_parts_epoch_moves_whenever_parts_are_assigned():
    """loading.parts_epoch (what a MoE layer's cached expert address tables are checked against):
    every assignment of a layer's parts moves it (construction, bind, re-encode, repack all assign)."""
    from zipserv_vllm.vllm_plugin import loading

    e0 = loading.parts_epoch()
    st = loading.LayerState(prefix="l", kind="linear", rows=64, cols=64, device=torch.device("cpu"),
                            expected_shards=[None])
    e1 = loading.parts_epoch()
    assert e1 != e0
    arena = PagedArena(page_bytes=1 << 16, align=256)
    st.arena, st.tables, st.part_shapes = arena, [store_compressed(arena, compress_tensor(_w(64, 64)))], [(64, 64)]
    assert loading.parts_epoch() == e1  # other fields: no change
    st.bind()
    e2 = loading.parts_epoch()
    assert e2 != e1 and len(st.parts) == 1
    st.parts = []
    assert loading.parts_epoch() != e2


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _huge_kib(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``addr``."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() != "madvise",
                    reason="the advice only matters where the kernel's THP setting is 'madvise' (this host's); "
                           "'always' backs every page anyway and 'never' (or not Linux) none")
@pytest.mark.parametrize("fill", ["put", "commit", "trim"])
def test_cpu_pages_are_backed_by_huge_pages(fill):
    """CPU pages are fresh mappings advised to use transparent huge pages before they are written:
    the weight stream then costs no TLB miss per 4 KiB (fails with torch.empty pages)."""
    arena = PagedArena("cpu", page_bytes=16 << 20)
    data = torch.ones(12 << 20, dtype=torch.uint8)
    if fill == "commit":
        slot = arena.reserve(data.numel())
        arena.commit()
        arena.raw(slot).copy_(data)
    else:
        arena.put(data)
        if fill == "trim":
            assert arena.trim()
    page = arena._pages[0].tensor
    aligned = -(-page.data_ptr() // (2 << 20)) * (2 << 20)
    assert _huge_kib(aligned) >= 2048, (fill, _thp_mode())


def test_repack_copies_the_layers_that_stay_v1(monkeypatch):
    """On a GPU the input embedding stays v1 (layouts.stays_v1): the repack copies its v1 arrays into
    the new arena as they are, bit for bit, and repacks the rest (checked here on the CPU with the
    GPU's rule in place)."""
    from zipserv_vllm.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    from zipserv_vllm.codec import decompress_tensor
    from zipserv_vllm.format import CompressedTensor
    from zipserv_vllm.format.cpu_layout import PackedTensor
    from zipserv_vllm.vllm_plugin import layouts, loading

    monkeypatch.setattr(layouts, "stays_v1", lambda st, device: st.kind == "embedding")
    old, new = PagedArena(page_bytes=1 << 16, align=256), PagedArena(page_bytes=1 << 16, align=256)
    weights, states = [], []
    for i, kind in enumerate(("embedding", "linear", "linear")):
        w = _w(192, 200, seed=20 + i)
        st = loading.LayerState(prefix=f"l{i}", kind=kind, rows=192, cols=200, device=torch.device("cpu"),
                                expected_shards=[None])
        st.arena, st.tables, st.part_shapes = old, [store_compressed(old, compress_tensor(w))], [(192, 200)]
        st.bind()
        weights.append(w)
        states.append(st)
    assert layouts.repack(states, old, new) == 2  # the two linear layers
    assert old.num_pages == 0
    emb, *lin = states
    assert emb.arena is new and isinstance(emb.parts[0], CompressedTensor)
    assert torch.equal(_bits(decompress_tensor(emb.parts[0])), _bits(weights[0]))
    for w, st in zip(weights[1:], lin):
        assert st.arena is new and isinstance(st.parts[0], PackedTensor)
        assert torch.equal(_bits(cpu_kernels.packed_decode(st.parts[0])), _bits(w))
    # only v1 embeddings left: nothing to repack
    assert layouts.repack([emb], new, PagedArena()) == 0
