"""benchmarks/sass_budget.py: the machine-code budget of the fused kernels' hot loop.

The parser is checked on a hand-written listing; the real count compiles the
N <= 16 instances (TCA-TBE and byte-split) for sm_90 (nvcc, PyPI's cuobjdump; no GPU) and compares
with configs/sass_budget.json, which the dispatcher's cost model reads: a
change of more than 2 % in either direction fails until the file is
regenerated (``python benchmarks/sass_budget.py``), so the count cannot grow
unnoticed and the model never runs on stale numbers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "benchmarks" / "sass_budget.py")
sb = importlib.util.module_from_spec(_spec)
sys.modules["sass_budget"] = sb  # its dataclasses look their module up
_spec.loader.exec_module(sb)
COMMITTED = json.loads((ROOT / "configs" / "sass_budget.json").read_text())

LISTING = """
\t\tFunction : _ZN7zipserv4cuda5fused12fused_kernelILi2EEEvNS0_8GemmArgsE
        /*0000*/                   LDC R1, c[0x0][0x28] ;      /* 0x00000a00ff017b82 */
        /*0010*/                   MOV R2, RZ ;                /* 0x0 */
        /*0020*/                   LDS R3, [R2] ;              /* 0x0 */
        /*0030*/               @P0 BRA 0x20 ;                  /* 0x0 */
        /*0040*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0050*/               @P1 HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0060*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0070*/              @!P2 BRA 0x10 ;
        /*0080*/                   BRA 0x90 ;
        /*0090*/                   EXIT ;
\t\tFunction : _ZN7zipserv4cuda5fused14grouped_kernelILi1EEEvNS0_15GroupedGemmArgsE
        /*0000*/                   EXIT ;
"""


def test_hot_loop_is_the_innermost_loop_with_tensor_ops():
    funcs = sb.parse_sass(LISTING)
    assert len(funcs) == 2
    name = next(n for n in funcs if "fused" in n)
    loop = sb.hot_loop(name, funcs[name])
    # 0x10 .. 0x70: 7 instructions, the inner loop (0x20 .. 0x30, no HMMA) counted once; the forward BRA is no loop
    assert (loop.start, loop.end, loop.instructions, loop.hmma, loop.inner_loops) == (0x10, 0x70, 7, 2, 1)
    assert loop.nt8 == 2 and loop.weights == 2 * 256 // 2 and loop.per_weight == 7 / 256
    grouped = next(n for n in funcs if "grouped" in n)
    assert sb.hot_loop(grouped, funcs[grouped]) is None  # no loop, no HMMA
    assert sb.hot_loop("_Z3foov", funcs[name]) is None  # not a fused / grouped instance


def test_the_byte_split_kernel_meets_the_budget():
    """Issue 21's goal for the N <= 16 decode on sm_90: at most 0.35 warp instructions per weight."""
    rows = {(r["kernel"], r["tile_n"]): r for r in COMMITTED["instances"] if r["arch"] == "90"}
    for tn in (8, 16):
        assert rows[("packed_kernel_xfast", tn)]["instructions_per_weight"] <= 0.35
        assert rows[("fused_kernel", tn)]["instructions_per_weight"] > 1.0  # TCA-TBE v1's: why the second layout


def test_committed_budget_is_complete_and_consistent():
    rows = COMMITTED["instances"]
    assert {(r["arch"], r["kernel"], r["tile_n"]) for r in rows} >= {
        ("90", k, t) for k in ("fused_kernel", "grouped_kernel") for t in (8, 16, 32, 64, 128)} | {
        ("90", k, t) for k in ("packed_kernel", "packed_kernel_xfast") for t in (8, 16)}
    for r in rows:
        assert r["weights_per_trip"] == 1024  # one warp's 16 rows x one 64-wide K tile
        assert abs(r["instructions_per_weight"] - r["loop_instructions"] / 1024) < 1e-3
        assert abs(r["issue_bound_weights_per_sm_cycle"] - 4 / r["instructions_per_weight"]) < 0.01
    cal = COMMITTED["h200_calibration"]
    assert 0 < cal["efficiency"] <= 1


def test_the_count_has_not_moved():
    nvcc = sb._nvcc_build().find_nvcc()
    if nvcc is None or sb.find_tool("cuobjdump") is None or sb.find_tool("nvdisasm") is None:
        pytest.skip("needs nvcc, cuobjdump and nvdisasm (scripts/setup.sh installs PyPI's nvidia-cuda-cuobjdump and "
                    "nvidia-cuda-nvdisasm; nvcc is the CUDA toolkit's) to compile and disassemble the kernels")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if version != COMMITTED["tools"]["nvcc"]:
        pytest.skip(f"this nvcc ({version}) is not the one the committed counts come from "
                    f"({COMMITTED['tools']['nvcc']}): other compilers emit other code")
    rows, _ = sb.measure(["90"], ["zipgemm_n8.cu", "zipgemm_n16.cu", "zipgemm_packed.cu"])
    old = {(r["arch"], r["kernel"], r["nt8"]): r["loop_instructions"] for r in COMMITTED["instances"]}
    assert len(rows) == 8
    moved = [f"sm_90 {r['kernel']}<{r['nt8']}>: {old[(r['arch'], r['kernel'], r['nt8'])]} -> {r['loop_instructions']}"
             for r in rows if abs(r["loop_instructions"] / old[(r["arch"], r["kernel"], r["nt8"])] - 1)
             > sb.GROWTH_TOLERANCE]
    assert not moved, ("hot-loop instruction counts changed; if intended, run python benchmarks/sass_budget.py "
                       f"to update configs/sass_budget.json: {moved}")
    assert not sb.check(rows, COMMITTED)
