"""How many machine instructions each weight costs in the fused kernels' hot loop, and what that allows.

No GPU needed: the CUDA sources are compiled (nvcc -cubin) for each listed
arch, disassembled (``cuobjdump -sass``, which runs ``nvdisasm``; PyPI's
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` where the toolkit has none), and for every fused and grouped instance the
hottest tensor-core loop is found: the shortest loop (a backward branch)
that holds ``HMMA`` instructions (the byte-split-layout kernel of
``zipgemm_packed.cuh`` too: ``packed_kernel``, and ``packed_kernel_xfast``, its
instance for 16-byte-aligned X and K a multiple of 64). One trip of it is one 64-wide K tile of a
warp's 16 weight rows, 1,024 weights (``HMMA count x 256 / NT8``: each A
fragment of 256 weights feeds NT8 n8 groups). Inner loops (the X staging
loop) are counted once.

* instructions per weight = loop instructions / weights per trip;
* issue-bound weights per SM-cycle = 4 / that (an SM issues at most one warp
  instruction per cycle on each of its 4 schedulers), the best the decode can
  do before any stall;
* the ratio to BF16 predicted for each GPU in :data:`GPUS`: BF16 streams
  ``bandwidth / 2 / (SMs x clock)`` weights per SM-cycle; the compressed kernel
  is bound by the larger of its bytes (``bits / 8`` per weight) and its issue
  rate times an efficiency. Two columns: efficiency 1 (the ceiling) and the
  efficiency measured on the one GPU that ran it (an H200: the fused N = 8
  instance's weights per SM-cycle in ``benchmarks/results/h200-*/bench_full.json``
  over its issue bound).

Writes JSON (default ``configs/sass_budget.json``, which the dispatcher's cost
model reads for its decode rate) and prints a table; ``--check FILE`` compares
with a committed JSON and fails when an instance's count grew by more than 2 %.

    python benchmarks/sass_budget.py [--archs 80,89,90,100,120] [--sources zipgemm_n8.cu,...] [--out F] [--check F]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISSUE_PER_SM_CYCLE = 4  # warp instructions: one per scheduler, four schedulers per SM (sm_80 .. sm_120)
GROWTH_TOLERANCE = 0.02


@dataclass(frozen=True)
class GpuSpec:
    name: str
    arch: str  # the SASS it runs
    sms: int
    clock_ghz: float  # boost clock
    bandwidth_gb_s: float
    source: str


# Published figures (vendor datasheets and architecture whitepapers); boost clocks.
GPUS = (
    GpuSpec("A100 SXM 80GB", "80", 108, 1.41, 2039, "NVIDIA A100 datasheet"),
    GpuSpec("L40S", "89", 142, 2.52, 864, "NVIDIA L40S datasheet"),
    GpuSpec("RTX 4090", "89", 128, 2.52, 1008, "NVIDIA Ada whitepaper"),
    GpuSpec("H100 SXM", "90", 132, 1.98, 3350, "NVIDIA H100 datasheet"),
    GpuSpec("H200", "90", 132, 1.98, 4800, "NVIDIA H200 datasheet; 132 SMs and 1.98 GHz read on the one used here"),
    GpuSpec("B200", "100", 148, 1.965, 8000, "NVIDIA DGX B200 / Blackwell datasheet"),
)

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"Function\s*:\s*(\S+)")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_KERNEL = re.compile(r"(fused_kernel|grouped_kernel|packed_kernel)ILi(\d+)E(?:Lb([01])E)?")


@dataclass
class Loop:
    kernel: str  # with "_xfast" for the byte-split kernel's instance for aligned X and K % 64 == 0
    nt8: int
    start: int
    end: int
    instructions: int
    hmma: int
    inner_loops: int

    @property
    def weights(self) -> int:
        return self.hmma * 256 // self.nt8

    @property
    def per_weight(self) -> float:
        return self.instructions / self.weights


def parse_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled function name: [(address, instruction without predicate)]} of a cuobjdump -sass listing."""
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _LINE.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), _PRED.sub("", m.group(2))))
    return funcs


def hot_loop(name: str, code: list[tuple[int, str]]) -> Loop | None:
    """The shortest loop of a fused / grouped / byte-split instance that holds HMMA instructions (None: no
    such loop). The byte-split kernel has two: its main loop and the rare one over tiles with exceptions."""
    km = _KERNEL.search(name)
    if km is None:
        return None
    loops = []
    for addr, ins in code:
        op = ins.split()[0]
        if op.startswith("BRA") and not op.startswith("BRA.DIV"):
            target = re.search(r"0x([0-9a-f]+)", ins)
            if target and int(target.group(1), 16) <= addr:
                loops.append((int(target.group(1), 16), addr))
    best = None
    for a, b in loops:
        body = [ins for addr, ins in code if a <= addr <= b]
        hmma = sum(ins.startswith("HMMA") for ins in body)
        if hmma and (best is None or b - a < best.end - best.start):
            inner = sum(1 for c, d in loops if a <= c and d <= b and (c, d) != (a, b))
            kernel = km.group(1) + ("_xfast" if km.group(3) == "1" else "")
            best = Loop(kernel, int(km.group(2)), a, b, len(body), hmma, inner)
    return best


def find_tool(name: str) -> str | None:
    """A CUDA binary utility: PATH, the toolkit of nvcc, then PyPI's nvidia-cuda-* packages."""
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    cands = [Path(nvcc).resolve().parent / name] if nvcc else []
    for base in sys.path:
        cands += [Path(p) for p in glob.glob(os.path.join(base, "nvidia", "*", "bin", name))]
        cands.append(Path(base) / "nvidia" / "cuda_nvdisasm" / "bin" / name)
    return next((str(c) for c in cands if c.is_file() and os.access(c, os.X_OK)), None)


def _nvcc_build():
    spec = importlib.util.spec_from_file_location("zipserv_nvcc_build", ROOT / "csrc" / "cuda" / "nvcc_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_cubin(nvcc: str, src: Path, arch: str, out: Path) -> Path:
    nb = _nvcc_build()
    cmd = [nvcc, "-std=c++17", "-O3", "-cubin", f"-arch=sm_{arch}", f"-I{nb.INCLUDE_DIR}", f"-I{nb.SOURCES_DIR}",
           str(src), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src.name} for sm_{arch}:\n{r.stderr[-3000:]}")
    return out


def measure(archs: list[str], sources: list[str], jobs: int = 0) -> tuple[list[dict], dict]:
    nvcc = _nvcc_build().find_nvcc()
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if nvcc is None or cuobjdump is None or nvdisasm is None:
        raise FileNotFoundError(f"needs nvcc ({nvcc or 'not found'}), cuobjdump ({cuobjdump or 'not found'}) and "
                                f"nvdisasm ({nvdisasm or 'not found'}; pip install nvidia-cuda-cuobjdump "
                                "nvidia-cuda-nvdisasm)")
    # cuobjdump -sass runs nvdisasm, found on PATH or in the folder NVDISASM_PATH names
    env = dict(os.environ, NVDISASM_PATH=str(Path(nvdisasm).parent),
               PATH=str(Path(nvdisasm).parent) + os.pathsep + os.environ.get("PATH", ""))
    work = [(a, ROOT / "csrc" / "cuda" / s) for a in archs for s in sources]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        def one(item):
            arch, src = item
            cubin = compile_cubin(nvcc, src, arch, Path(tmp) / f"{src.stem}_sm{arch}.cubin")
            r = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"cuobjdump -sass failed on {cubin.name}: {r.stderr.strip()[-1000:]}")
            text = r.stdout
            return arch, src.name, parse_sass(text)

        for arch, src, funcs in pool.map(one, work):
            for name, code in funcs.items():
                loop = hot_loop(name, code)
                if loop is None:
                    continue
                rows.append({"arch": arch, "source": src, "kernel": loop.kernel, "nt8": loop.nt8,
                             "tile_n": 8 * loop.nt8, "loop_instructions": loop.instructions, "hmma": loop.hmma,
                             "weights_per_trip": loop.weights, "inner_loops": loop.inner_loops,
                             "instructions_per_weight": round(loop.per_weight, 4),
                             "issue_bound_weights_per_sm_cycle": round(ISSUE_PER_SM_CYCLE / loop.per_weight, 3)})
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    tools = {"nvcc": ver, "cuobjdump": cuobjdump}
    return sorted(rows, key=lambda r: (int(r["arch"]), r["kernel"], r["nt8"])), tools


def h200_efficiency(rows: list[dict]) -> dict | None:
    """The share of the issue bound each fused sm_90 instance reached on the H200 run: its measured
    weights per SM-cycle on the largest layer (split-K off, the GPU full) at N = tile_n, over the
    instance's issue bound from these counts. ``efficiency`` is the tile_n 8 one (decode batches)."""
    runs = sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "h200-*" / "bench_full.json")))
    bounds = {r["tile_n"]: r["issue_bound_weights_per_sm_cycle"] for r in rows
              if r["arch"] == "90" and r["kernel"] == "fused_kernel"}
    if not runs or 8 not in bounds:
        return None
    d = json.loads(Path(runs[-1]).read_text())
    gpu = next(g for g in GPUS if g.name == "H200")
    largest = max(d["rows"], key=lambda r: r["M"] * r["K"])
    by_tile = {}
    for r in d["rows"]:
        if (r["M"], r["K"]) == (largest["M"], largest["K"]) and r["N"] in bounds and "fused" in r["seconds"]:
            wpc = r["M"] * r["K"] / (r["seconds"]["fused"] * d["sm_count"] * gpu.clock_ghz * 1e9)
            by_tile[str(r["N"])] = {"measured_weights_per_sm_cycle": round(wpc, 3),
                                    "efficiency": round(wpc / bounds[r["N"]], 3)}
    if "8" not in by_tile:
        return None
    return {"source": os.path.relpath(runs[-1], ROOT), "layer": f"{largest['M']}x{largest['K']}",
            "measured_weights_per_sm_cycle": by_tile["8"]["measured_weights_per_sm_cycle"],
            "issue_bound": bounds[8], "efficiency": by_tile["8"]["efficiency"], "by_tile_n": by_tile}


PACKED_BITS = 12.05  # the byte-split layout (docs/FORMAT.md appendix A), Gaussian weights


def predictions(rows: list[dict], bits: float, cal: dict | None) -> list[dict]:
    """Predicted ratio to BF16 of the N <= 16 instances on each GPU of :data:`GPUS`: the TCA-TBE fused
    kernel at ``bits`` per weight, the byte-split kernel (aligned X) at PACKED_BITS. The efficiency
    column uses the share of the issue bound the fused kernel reached on the H200 at that tile_n, for
    both (the byte-split kernel has not run on a GPU)."""
    out = []
    for g in GPUS:
        bf16 = g.bandwidth_gb_s * 1e9 / 2 / (g.sms * g.clock_ghz * 1e9)
        for r in rows:
            if r["arch"] != g.arch or r["kernel"] not in ("fused_kernel", "packed_kernel_xfast") or r["tile_n"] > 16:
                continue
            b = bits if r["kernel"] == "fused_kernel" else PACKED_BITS
            rate = r["issue_bound_weights_per_sm_cycle"]
            eff = ((cal or {}).get("by_tile_n") or {}).get(str(r["tile_n"]), {}).get("efficiency")
            # to tie BF16 the decode must keep up with BF16's stream (bf16 weights per SM-cycle); to beat it
            # by 1.15x, 1.15 times that (possible only while 16 / bits >= 1.15)
            row = {"gpu": g.name, "kernel": r["kernel"], "tile_n": r["tile_n"], "bits_per_weight": b,
                   "bf16_weights_per_sm_cycle": round(bf16, 2), "needed_for_1.15x": round(1.15 * bf16, 2),
                   "ratio_at_issue_bound": round(min(16 / b, rate / bf16), 3)}
            if eff is not None:
                row["ratio_at_measured_efficiency"] = round(min(16 / b, rate * eff / bf16), 3)
            out.append(row)
    return out


def check(rows: list[dict], committed: dict) -> list[str]:
    """Instances whose loop grew by more than GROWTH_TOLERANCE against the committed counts."""
    old = {(r["arch"], r["kernel"], r["nt8"]): r["loop_instructions"] for r in committed["instances"]}
    grown = []
    for r in rows:
        before = old.get((r["arch"], r["kernel"], r["nt8"]))
        if before is not None and r["loop_instructions"] > before * (1 + GROWTH_TOLERANCE):
            grown.append(f"sm_{r['arch']} {r['kernel']}<{r['nt8']}>: {before} -> {r['loop_instructions']} "
                         f"instructions per {r['weights_per_trip']} weights")
    return grown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default="80,89,90,100,120")
    ap.add_argument("--sources", default="zipgemm_n8.cu,zipgemm_n16.cu,zipgemm_n32.cu,zipgemm_n64.cu,zipgemm_n128.cu,"
                                          "zipgemm_packed.cu")
    ap.add_argument("--bits", type=float, default=11.23, help="bits per weight for the predictions (bench_codec: 11.231)")
    ap.add_argument("--out", default=str(ROOT / "configs" / "sass_budget.json"))
    ap.add_argument("--check", default=None, help="fail if an instance grew against this JSON")
    args = ap.parse_args(argv)
    try:
        rows, tools = measure([a.strip() for a in args.archs.split(",") if a.strip()],
                              [s.strip() for s in args.sources.split(",") if s.strip()])
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"sass_budget: {exc}", file=sys.stderr)
        return 2
    cal = h200_efficiency(rows)
    result = {"benchmark": "sass_budget", "tools": tools, "issue_per_sm_cycle": ISSUE_PER_SM_CYCLE,
              "bits_per_weight": args.bits, "instances": rows, "h200_calibration": cal,
              "gpus": [asdict(g) for g in GPUS],
              "predictions": predictions(rows, args.bits, cal)}
    print(f"{'arch':>5} {'kernel':15} {'tile_n':>6} {'instr/trip':>10} {'HMMA':>5} {'weights':>7} {'instr/weight':>12} "
          f"{'weights/SM-cycle':>16}")
    for r in rows:
        print(f"{'sm_' + r['arch']:>5} {r['kernel']:15} {r['tile_n']:6d} {r['loop_instructions']:10d} {r['hmma']:5d} "
              f"{r['weights_per_trip']:7d} {r['instructions_per_weight']:12.3f} {r['issue_bound_weights_per_sm_cycle']:16.2f}")
    if cal:
        print(f"H200 calibration ({cal['layer']}, N = tile_n): " + ", ".join(
            f"tile_n {t}: {v['measured_weights_per_sm_cycle']} weights/SM-cycle = {v['efficiency']:.2f} of the bound"
            for t, v in cal["by_tile_n"].items()))
    print(f"\n{'gpu':14} {'kernel':20} {'tile_n':>6} {'BF16 w/SM-cyc':>13} {'need 1.15x':>10} {'ratio (ceiling)':>15} "
          f"{'ratio (H200 eff)':>16}")
    for p in result["predictions"]:
        print(f"{p['gpu']:14} {p['kernel']:20} {p['tile_n']:6d} {p['bf16_weights_per_sm_cycle']:13.2f} "
              f"{p['needed_for_1.15x']:10.2f} "
              f"{p['ratio_at_issue_bound']:15.2f}x {p.get('ratio_at_measured_efficiency', float('nan')):15.2f}x")
    rc = 0
    if args.check:
        grown = check(rows, json.loads(Path(args.check).read_text()))
        for g in grown:
            print(f"sass_budget: GREW {g}", file=sys.stderr)
        rc = 1 if grown else 0
    if args.out and args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
