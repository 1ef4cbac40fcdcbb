"""Which CUDA path serves one ``zipserv::gemm`` call: fused ZipGEMM (tile_n, split-K) or decoupled.

The choice is made per call from the token count N and the layer shape
(M, K), never from the phase: chunked prefill mixes decode and prefill
tokens in one batch. In order of precedence:

1. **measured**: timings of this GPU (``kernels/autotune.py``, run at engine
   start and cached on disk), installed with :func:`set_measured`;
2. **tabled**: measured rules for exact shapes in a per-GPU table (JSON in
   ``configs/dispatch/``, written by ``benchmarks/tune_dispatch.py``);
3. **the cost model** (:func:`estimate`), wherever nothing was measured.

The cost model, and what it rests on (its figures are datasheet values, except
the decode rate, which comes from the machine code and one GPU run; the
autotuner exists to replace it):

* time of a kernel = max(memory time, compute time) + 2 us of launch overhead;
* memory time = bytes moved / (HBM bandwidth x efficiency x fill), where
  fill = min(1, blocks / (SMs x blocks_per_sm)) models the bytes in flight a
  memory-bound kernel needs (a grid smaller than the GPU's slots gets that
  share of the bandwidth), and efficiency is 0.75 for the fused kernel, 0.8 for
  decompress, 0.85 for cuBLAS;
* bytes: the compressed weight (``bits_per_weight`` / 8 per weight, 11.3 by
  default) once per column pass (ceil(N / 128) passes above 128 tokens), X and
  Y once; split-K adds its fp32 partials, written and read back (L2-resident
  when they fit in the L2, counted at 3x the HBM bandwidth, else HBM); the
  decoupled path moves the compressed weight, writes the BF16 copy and cuBLAS
  reads it back;
* compute: 2 N M K flops at 50 % of the BF16 tensor peak for the fused kernel
  (decode competes for issue slots), 70 % for cuBLAS;
* the decode itself, per column pass, at :func:`decode_rate` weights per
  SM-cycle: 4 warp instructions per SM-cycle over the instance's hot-loop
  instructions per weight counted in its SASS (``configs/sass_budget.json``,
  ``benchmarks/sass_budget.py``: 1.41 for the tile_n 8 instance on sm_90),
  times the share of it the instance reached on the H200 (0.73 at tile_n 8,
  0.46 at 128); the decompress kernel at
  the tile_n 8 rate. On the H200 this makes the decode, not the memory, the
  bound of every compressed path, as measured.

Table format (every key optional)::

    {
      "gpu": "...", "source": "how the numbers were obtained",
      "blocks_per_sm": 4,          # resident blocks per SM the grid aims at
      "max_split": 16, "min_k_tiles_per_split": 2,
      "shapes": [                  # measured rules for exact (M, K)
        {"m": 4096, "k": 4096, "rules": [{"n_max": 16, "path": "fused", "split": 4}, ...]}
      ]
    }

A shape rule list is searched in order for the first ``n_max >= N``; a
``split`` of 0 means "the cost model's split". No torch import: the logic is
testable on any machine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TILE = 64
TILE_NS = (8, 16, 32, 64, 128)  # columns per block of the fused kernel instances
PACKED_TILE_NS = (8, 16)  # the byte-split-layout kernel's instances (decode batch sizes)
LAUNCH_S = 2e-6
BITS_PER_WEIGHT = 11.3
PACKED_BITS_PER_WEIGHT = 12.05  # the byte-split layout on trained weights (docs/FORMAT.md appendix A)
# In-memory layouts of a GPU weight: TCA-TBE v1 (paths "fused", "decoupled") or the byte-split
# layout (paths "packed": its fused kernel, "packed_decoupled": its decompress kernel + cuBLAS).
LAYOUTS = ("v1", "bytesplit")
PATHS = {"v1": ("fused", "decoupled"), "bytesplit": ("packed", "packed_decoupled")}
DECOUPLED_PATHS = ("decoupled", "packed_decoupled")  # decompress + cuBLAS: no tile_n, no split

BUILTIN = {
    "gpu": "unknown",
    "source": "built-in kernel parameters (the cost model decides paths)",
    "blocks_per_sm": 4,
    "max_split": 16,
    "min_k_tiles_per_split": 2,
    "shapes": [],
}

TABLE_DIR_ENV = "ZIPSERV_DISPATCH_DIR"


@dataclass(frozen=True)
class Plan:
    """``path`` "fused" (tile_n columns per block, K split in ``split`` parts) or "decoupled" for a
    TCA-TBE v1 weight; "packed" (the byte-split kernel, tile_n 8 or 16) or "packed_decoupled" for a
    weight in the byte-split layout."""

    path: str
    tile_n: int = 0
    split: int = 1

    def __post_init__(self):
        paths = PATHS["v1"] + PATHS["bytesplit"]
        if self.path not in paths:
            raise ValueError(f"path must be one of {paths}, got {self.path!r}")
        if self.path == "fused" and self.tile_n not in TILE_NS:
            raise ValueError(f"tile_n must be one of {TILE_NS}, got {self.tile_n}")
        if self.path == "packed" and self.tile_n not in PACKED_TILE_NS:
            raise ValueError(f"tile_n must be one of {PACKED_TILE_NS}, got {self.tile_n}")
        if self.split < 1:
            raise ValueError(f"split must be >= 1, got {self.split}")


@dataclass(frozen=True)
class Gpu:
    """What the cost model knows of a GPU (published figures, not measurements)."""

    name: str
    hbm_gb_s: float
    bf16_tflops: float  # dense tensor-core peak
    sms: int
    l2_mb: float
    clock_ghz: float = 1.7
    arch: str = "90"  # the SASS it runs (sm_<arch>): selects the decode rate


# By name (a pattern of the lower-cased device name, first match wins): the datasheet figures of
# each part, so "NVIDIA H200 NVL" and "NVIDIA H100 PCIe" do not take the family's SXM numbers.
FAMILIES = (
    (r"gh200", Gpu("GH200", 4000, 989, 132, 60, 1.98, "90")),  # HBM3 part; before "h200", which it contains
    (r"h200", Gpu("H200", 4800, 989, 132, 60, 1.98, "90")),
    (r"h100.*pcie|h800.*pcie", Gpu("H100 PCIe", 2000, 756, 114, 50, 1.755, "90")),
    (r"h100|h800", Gpu("H100 SXM", 3350, 989, 132, 50, 1.98, "90")),
    (r"a100.*40gb", Gpu("A100 40GB", 1555, 312, 108, 40, 1.41, "80")),
    (r"a100", Gpu("A100 80GB", 2039, 312, 108, 40, 1.41, "80")),
    (r"l40s", Gpu("L40S", 864, 362, 142, 48, 2.52, "89")),
    (r"4090", Gpu("RTX 4090", 1008, 165, 128, 72, 2.52, "89")),
    (r"b200", Gpu("B200", 8000, 2250, 148, 126, 1.965, "100")),
)
# By compute capability, where the name is not known (the family's common part).
GPUS = {
    (8, 0): Gpu("A100", 2039, 312, 108, 40, 1.41, "80"),
    (8, 6): Gpu("A10 / RTX 3090", 600, 125, 72, 6, 1.7, "86"),
    (8, 9): Gpu("L40S / RTX 4090", 864, 362, 142, 96, 2.5, "89"),
    (9, 0): Gpu("H100 SXM / H200", 3350, 989, 132, 50, 1.98, "90"),
    (10, 0): Gpu("B200", 8000, 2250, 148, 126, 1.9, "100"),
    (12, 0): Gpu("RTX 5090", 1792, 209, 170, 96, 2.4, "120"),
}
GENERIC = Gpu("unknown", 1500, 300, 100, 40, 1.5, "90")


def gpu_family(name: str) -> Gpu | None:
    """The datasheet entry of a device name, matched by family pattern (None: unknown)."""
    low = name.lower()
    return next((g for pat, g in FAMILIES if re.search(pat, low)), None)


def gpu_model(name: str = "", capability: tuple[int, int] | None = None, sms: int | None = None) -> Gpu:
    g = gpu_family(name) or (GPUS.get(tuple(capability)) if capability else None) or GENERIC
    if sms and sms != g.sms:
        g = Gpu(g.name, g.hbm_gb_s, g.bf16_tflops * sms / g.sms, sms, g.l2_mb, g.clock_ghz, g.arch)
    return g


# ------------------------------------------------------------ decode rate
# Where configs/sass_budget.json is absent (an install without the source tree): the rate the fused
# N = 8 instance reached on the one GPU it ran on (an H200, 2026-12-04: 2.08 weights per SM-cycle).
FALLBACK_DECODE_RATE = 2.0


@lru_cache(maxsize=None)
def sass_budget() -> dict:
    """configs/sass_budget.json (benchmarks/sass_budget.py: each fused instance's hot-loop
    instructions per weight from its machine code, and the issue efficiency measured on a GPU);
    {} where it is not found."""
    for d in table_dirs():
        p = d.parent / "sass_budget.json"
        if p.is_file():
            with open(p) as fh:
                return json.load(fh)
    return {}


def decode_rate(arch: str, tile_n: int, kernel: str = "fused_kernel") -> float:
    """Weights per SM-cycle the fused instance ``tile_n`` decodes on ``sm_<arch>``: the issue bound
    of its hot loop (4 warp instructions per SM-cycle over its instructions per weight, counted in
    the machine code) times the share of that bound the instance reached on the H200 (per tile_n:
    0.73 for tile_n 8, lower for the wide instances); sm_90's count for an arch without one. The
    decompress kernel (the decoupled path) runs the same per-lane decode: it is charged the tile_n 8
    rate (measured on the H200: 2.1 weights per SM-cycle, the fused 1.7-2.1).

    ``kernel`` "packed_kernel" / "packed_kernel_xfast": the byte-split kernel's general and
    aligned-X instances. They have not run on a GPU: they are charged the v1 tile_n 8 instance's
    measured share of its bound (an assumption until a GPU measures them), and the byte-split
    decompress kernel (same per-lane decode, no tensor ops) the general instance's tile_n 8 rate."""
    budget = sass_budget()
    rows = [r for r in budget.get("instances", ()) if r["kernel"] == kernel and r["tile_n"] == tile_n]
    row = next((r for r in rows if r["arch"] == arch), None) or next((r for r in rows if r["arch"] == "90"), None)
    if row is None:
        return FALLBACK_DECODE_RATE
    cal = budget.get("h200_calibration") or {}
    measured_n = tile_n if kernel == "fused_kernel" else TILE_NS[0]
    eff = float((cal.get("by_tile_n") or {}).get(str(measured_n), {}).get("efficiency", cal.get("efficiency", 1.0)))
    return float(row["issue_bound_weights_per_sm_cycle"]) * eff


def packed_tile_n(n: int) -> int:
    """The byte-split kernel's instance for N tokens: 8 up to 8, else 16 (a grid over 16-column
    blocks above 16, each block decoding the whole weight: the cost model charges every pass)."""
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    return PACKED_TILE_NS[0] if n <= PACKED_TILE_NS[0] else PACKED_TILE_NS[-1]


def tile_n_of(path: str, n: int) -> int:
    """The instance of ``path``'s fused kernel for N tokens (0 for a decoupled path)."""
    if path == "fused":
        return tile_n_for(n)
    return packed_tile_n(n) if path == "packed" else 0


def tile_n_for(n: int) -> int:
    """Columns per block: N <= 8 -> 8 (paper's N8 mode); 9..128 -> the smallest
    instance covering N; > 128 -> 128 with a grid over column tiles."""
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    for t in TILE_NS:
        if n <= t:
            return t
    return TILE_NS[-1]


def splitk_parts(kt: int, split: int) -> int:
    """Non-empty parts when kt K-tiles are cut into ceil(kt / split)-tile parts (kernel's rule)."""
    per = -(-kt // split)
    return -(-kt // per)


def max_split(k: int, table: dict) -> int:
    kt = -(-k // TILE)
    return max(1, min(int(table.get("max_split", 16)), kt // max(1, int(table.get("min_k_tiles_per_split", 2)))))


# -------------------------------------------------------------- cost model
def _mem_s(nbytes: float, gpu: Gpu, eff: float, fill: float = 1.0) -> float:
    return nbytes / (gpu.hbm_gb_s * 1e9 * eff * max(fill, 1e-3))


def estimate(plan: Plan, n: int, m: int, k: int, gpu: Gpu, table: dict | None = None,
             bits_per_weight: float | None = None) -> float:
    """Estimated seconds of one call by ``plan`` (see the module docstring for the assumptions)."""
    table = BUILTIN if table is None else table
    packed = plan.path in PATHS["bytesplit"]
    if bits_per_weight is None:
        bits_per_weight = PACKED_BITS_PER_WEIGHT if packed else BITS_PER_WEIGHT
    flops = 2.0 * n * m * k
    xy = 2.0 * n * (k + m)
    wc = bits_per_weight / 8 * m * k
    if plan.path in DECOUPLED_PATHS:
        dec_blocks = -(-m // TILE) * -(-k // TILE)
        # (a grid larger than the GPU does not read faster than its memory: fill is at most 1)
        dec_fill = min(1.0, dec_blocks / (gpu.sms * 4))
        rate = decode_rate(gpu.arch, 8, "packed_kernel" if packed else "fused_kernel")
        t_dec = max(_mem_s(wc + 2.0 * m * k, gpu, 0.8, dec_fill),
                    m * k / (gpu.sms * rate * gpu.clock_ghz * 1e9 * dec_fill)) + LAUNCH_S
        t_mm = max(_mem_s(2.0 * m * k + xy, gpu, 0.85), flops / (gpu.bf16_tflops * 1e12 * 0.7)) + LAUNCH_S
        return t_dec + t_mm
    if packed:  # one pass per 16-column block: every block decodes the whole weight
        passes = -(-n // plan.tile_n)
        kernel = "packed_kernel_xfast" if k % TILE == 0 else "packed_kernel"
    else:
        passes = -(-n // TILE_NS[-1]) if n > TILE_NS[-1] else 1
        kernel = "fused_kernel"
    blocks = -(-n // plan.tile_n) * -(-m // TILE) * plan.split
    fill = min(1.0, blocks / (gpu.sms * int(table.get("blocks_per_sm", 4))))
    t = _mem_s(passes * wc + xy, gpu, 0.75, fill)
    if plan.split > 1:
        partial = 2.0 * plan.split * n * m * 4
        fast = partial / 2 <= gpu.l2_mb * 1e6
        t += _mem_s(partial, gpu, 0.75 * (3.0 if fast else 1.0)) + LAUNCH_S  # + the reduction kernel
    rate = decode_rate(gpu.arch, plan.tile_n, kernel)
    t_decode = passes * m * k / (gpu.sms * rate * gpu.clock_ghz * 1e9 * min(1.0, blocks / gpu.sms))
    t_mma = flops / (gpu.bf16_tflops * 1e12 * 0.5)
    return max(t, t_decode, t_mma) + LAUNCH_S


def estimate_bf16(n: int, m: int, k: int, gpu: Gpu) -> float:
    """Estimated seconds of the same GEMM on a BF16 weight (what plain vLLM runs)."""
    return max(_mem_s(2.0 * m * k + 2.0 * n * (k + m), gpu, 0.85),
               2.0 * n * m * k / (gpu.bf16_tflops * 1e12 * 0.7)) + LAUNCH_S


def candidates(n: int, m: int, k: int, table: dict | None = None, layout: str = "v1") -> list[Plan]:
    """The plans worth timing or estimating for one call on a weight held in ``layout``: the fused
    kernel (v1) or the byte-split kernel (bytesplit) with each sensible split, and the decoupled
    path of that layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    table = BUILTIN if table is None else table
    kt = -(-k // TILE)
    cap = max_split(k, table)
    splits = sorted({splitk_parts(kt, s) for s in (1, 2, 3, 4, 6, 8, 12, 16) if s <= cap})
    if layout == "bytesplit":
        tn = packed_tile_n(n)
        return [Plan("packed", tn, s) for s in splits] + [Plan("packed_decoupled")]
    tn = tile_n_for(n)
    return [Plan("fused", tn, s) for s in splits] + [Plan("decoupled")]


def cost_model_plan(n: int, m: int, k: int, gpu: Gpu, table: dict | None = None, layout: str = "v1") -> Plan:
    """The plan the cost model estimates fastest."""
    return min(candidates(n, m, k, table, layout), key=lambda p: (estimate(p, n, m, k, gpu, table), p.split))


# ---------------------------------------------------------------- measured
_MEASURED: dict[tuple[int, int], list[tuple[int, Plan]]] = {}  # (m, k) -> [(n_max, plan)] ascending


def set_measured(rules: dict[tuple[int, int], list[tuple[int, Plan]]]) -> None:
    """Install measured plans ((M, K) -> [(n_max, plan)], n_max ascending); replaces earlier ones."""
    _MEASURED.clear()
    _MEASURED.update({k: sorted(v, key=lambda r: r[0]) for k, v in rules.items()})


def measured_plan(n: int, m: int, k: int) -> Plan | None:
    for n_max, plan in _MEASURED.get((m, k), ()):
        if n <= n_max:
            return plan
    return None


def choose(n: int, m: int, k: int, sm_count: int, table: dict | None = None, gpu: Gpu | None = None,
           layout: str = "v1") -> Plan:
    """The plan for Y[n, m] = X[n, k] . W[m, k]^T on a GPU with ``sm_count`` SMs, W held in ``layout``
    (measured rules of the other layout's paths are ignored; the tables hold v1 rules only)."""
    if min(n, m, k) < 1:
        raise ValueError(f"N, M, K must be >= 1, got N={n}, M={m}, K={k}")
    if sm_count < 1:
        raise ValueError(f"sm_count must be >= 1, got {sm_count}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    table = BUILTIN if table is None else table
    gpu = gpu_model(sms=sm_count) if gpu is None else gpu
    plan = measured_plan(n, m, k)
    if plan is not None and plan.path in PATHS[layout]:
        return Plan(plan.path, tile_n_of(plan.path, n), plan.split)
    if layout == "bytesplit":
        return cost_model_plan(n, m, k, gpu, table, layout)
    kt = -(-k // TILE)
    for shape in table.get("shapes", ()):
        if int(shape["m"]) == m and int(shape["k"]) == k:
            for rule in shape["rules"]:
                if n <= int(rule["n_max"]):
                    if rule["path"] == "decoupled":
                        return Plan("decoupled")
                    split = int(rule.get("split", 0))
                    if split > 0:
                        return Plan("fused", tile_n_for(n), splitk_parts(kt, min(split, kt, max_split(k, table))))
                    fused = [p for p in candidates(n, m, k, table) if p.path == "fused"]
                    return min(fused, key=lambda p: (estimate(p, n, m, k, gpu, table), p.split))
            break
    return cost_model_plan(n, m, k, gpu, table)


# ------------------------------------------------------------------ tables
def table_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(TABLE_DIR_ENV):
        dirs.append(Path(os.environ[TABLE_DIR_ENV]))
    dirs.append(Path(__file__).resolve().parents[2] / "configs" / "dispatch")
    return dirs


def table_key(gpu_name: str) -> str:
    """File stem of a GPU name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def validate_table(table: dict, where: str = "table") -> dict:
    for key in ("blocks_per_sm", "max_split", "min_k_tiles_per_split"):
        if key in table and (not isinstance(table[key], int) or table[key] < 0):
            raise ValueError(f"{where}: {key} must be a non-negative integer, got {table[key]!r}")
    for shape in table.get("shapes", ()):
        if not {"m", "k", "rules"} <= set(shape):
            raise ValueError(f"{where}: shape entries need m, k and rules, got {sorted(shape)}")
        for rule in shape["rules"]:
            if rule.get("path") not in ("fused", "decoupled") or "n_max" not in rule:
                raise ValueError(f"{where}: bad rule {rule!r} for shape {shape['m']}x{shape['k']}")
    return table


@lru_cache(maxsize=None)
def load_table(gpu_name: str, capability: tuple[int, int]) -> dict:
    """The table for a GPU: by name, then sm<major><minor>, then default, then BUILTIN."""
    fam = gpu_family(gpu_name)
    names = [table_key(gpu_name)] + ([table_key("nvidia " + fam.name)] if fam else []) + \
        [f"sm{capability[0]}{capability[1]}", "default"]
    for d in table_dirs():
        for stem in names:
            p = d / f"{stem}.json"
            if p.is_file():
                with open(p) as fh:
                    t = dict(BUILTIN, **json.load(fh))
                t["_file"] = str(p)
                return validate_table(t, str(p))
    return dict(BUILTIN)
