"""The C++ headers (format.h, cpu_layout.h) and the Python mirrors (spec.py,
cpu_layout.py) define the same format and the same CPU byte-split layout."""

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


def test_cpu_layout_constants_agree():
    from zipserv_vllm.format import cpu_layout as L

    cg = pytest.importorskip("zipserv_vllm._cpu_gemm", reason="CPU kernel extension not built (pip install -e .)")
    got = cg.layout_constants()
    got["code_positions"] = [tuple(p) for p in got["code_positions"]]
    assert got == L.constants()
    # every (FT, position) has its own nibble, and the low bytes and code bytes tile the record once
    nibbles = {(L.code_byte(f, p), L.code_nibble(p)) for f in range(64) for p in range(64)}
    los = {L.lo_byte(f, p) for f in range(64) for p in range(64)}
    assert len(nibbles) == 4096 and len(los) == 4096 and not los & {b for b, _ in nibbles}
    assert los | {b for b, _ in nibbles} == set(range(L.TILE_BYTES))


def test_format_is_the_ground_floor():
    """zipserv_vllm/format imports nothing else of the package (no codec, kernels, checkpoint, plugin)."""
    import ast
    from pathlib import Path

    import zipserv_vllm.format as fmt

    for path in Path(fmt.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert node.level <= 1 and not target.startswith("zipserv_vllm"), f"{path.name} imports {target}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("zipserv_vllm") for a in node.names), path.name
