"""The C++ header (format.h) and the Python mirror (spec.py) define the same format."""

import pytest

from zipserv_vllm.format import spec

_C = pytest.importorskip("zipserv_vllm._C", reason="native extension not built (pip install -e .)")


def test_constants_agree():
    assert _C.format_constants() == spec.constants()


def test_frag_geometry_covers_tile_once():
    seen = set()
    for f in range(spec.FRAGS_PER_TILE):
        for r in range(spec.FRAG):
            for c in range(spec.FRAG):
                seen.add((spec.frag_row0(f) + r, spec.frag_col0(f) + c))
    assert seen == {(r, c) for r in range(spec.TILE) for c in range(spec.TILE)}
    # TT column-major: FT 1 is below FT 0, FT 2 right of it.
    assert (spec.frag_row0(1), spec.frag_col0(1)) == (8, 0)
    assert (spec.frag_row0(2), spec.frag_col0(2)) == (0, 8)
    assert (spec.frag_row0(4), spec.frag_col0(4)) == (0, 16)
    assert (spec.frag_row0(16), spec.frag_col0(16)) == (16, 0)
