"""Which CUDA path serves one ``zipserv::gemm`` call: fused ZipGEMM or decoupled.

The choice is made per call from the token count N and the layer shape
(M, K), never from the phase: chunked prefill mixes decode and prefill
tokens in one batch. A *table* (JSON in ``configs/dispatch/``) holds the
per-GPU thresholds; ``benchmarks/tune_dispatch.py`` measures and writes one
on a real GPU. Tables are looked up by GPU name (``nvidia-h200.json``), then
compute capability (``sm90.json``), then ``default.json``, then the built-in
defaults below, so an unknown GPU always gets a plan.

Table format::

    {
      "gpu": "...", "source": "how the numbers were obtained",
      "fused_max_n": 128,          # N above this -> decoupled (decompress + cuBLAS)
      "blocks_per_sm": 4,          # split-K aims at sm_count * blocks_per_sm blocks
      "max_split": 16, "min_k_tiles_per_split": 2,
      "shapes": [                  # optional measured rules for exact (M, K)
        {"m": 4096, "k": 4096, "rules": [{"n_max": 16, "path": "fused", "split": 4}, ...]}
      ]
    }

A shape rule list is searched in order for the first ``n_max >= N``; a
``split`` of 0 means "use the heuristic". No torch import: the logic is
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

BUILTIN = {
    "gpu": "unknown",
    "source": "built-in default (paper: fused for decode-sized N <= 128, untuned)",
    "fused_max_n": 128,
    "blocks_per_sm": 4,
    "max_split": 16,
    "min_k_tiles_per_split": 2,
    "shapes": [],
}

TABLE_DIR_ENV = "ZIPSERV_DISPATCH_DIR"


@dataclass(frozen=True)
class Plan:
    """``path`` "fused" (tile_n columns per block, K split in ``split`` parts) or "decoupled"."""

    path: str
    tile_n: int = 0
    split: int = 1

    def __post_init__(self):
        if self.path not in ("fused", "decoupled"):
            raise ValueError(f"path must be 'fused' or 'decoupled', got {self.path!r}")
        if self.path == "fused" and self.tile_n not in TILE_NS:
            raise ValueError(f"tile_n must be one of {TILE_NS}, got {self.tile_n}")
        if self.split < 1:
            raise ValueError(f"split must be >= 1, got {self.split}")


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


def heuristic_split(m: int, k: int, n: int, tile_n: int, sm_count: int, table: dict) -> int:
    """Smallest split that fills sm_count * blocks_per_sm blocks, bounded by the table."""
    kt = -(-k // TILE)
    blocks = -(-n // tile_n) * -(-m // TILE)
    target = sm_count * int(table.get("blocks_per_sm", 2))
    if blocks >= target:
        return 1
    split = -(-target // blocks)
    cap = max(1, min(int(table.get("max_split", 16)), kt // max(1, int(table.get("min_k_tiles_per_split", 2)))))
    return splitk_parts(kt, max(1, min(split, cap)))


def choose(n: int, m: int, k: int, sm_count: int, table: dict | None = None) -> Plan:
    """The plan for Y[n, m] = X[n, k] . W[m, k]^T on a GPU with ``sm_count`` SMs."""
    if min(n, m, k) < 1:
        raise ValueError(f"N, M, K must be >= 1, got N={n}, M={m}, K={k}")
    if sm_count < 1:
        raise ValueError(f"sm_count must be >= 1, got {sm_count}")
    table = BUILTIN if table is None else table
    kt = -(-k // TILE)
    for shape in table.get("shapes", ()):
        if int(shape["m"]) == m and int(shape["k"]) == k:
            for rule in shape["rules"]:
                if n <= int(rule["n_max"]):
                    if rule["path"] == "decoupled":
                        return Plan("decoupled")
                    tn = tile_n_for(n)
                    split = int(rule.get("split", 0))
                    if split > 0:
                        split = splitk_parts(kt, min(split, kt, int(table.get("max_split", 16))))
                    else:
                        split = heuristic_split(m, k, n, tn, sm_count, table)
                    return Plan("fused", tn, split)
            break
    if n > int(table.get("fused_max_n", 128)):
        return Plan("decoupled")
    tn = tile_n_for(n)
    return Plan("fused", tn, heuristic_split(m, k, n, tn, sm_count, table))


def max_fused_n(table: dict) -> int:
    """Largest N any rule of the table sends to the fused kernel (sizes the split-K workspace)."""
    n = int(table.get("fused_max_n", 128))
    for shape in table.get("shapes", ()):
        for rule in shape["rules"]:
            if rule["path"] == "fused":
                n = max(n, int(rule["n_max"]))
    return n


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
    for key in ("fused_max_n", "blocks_per_sm", "max_split", "min_k_tiles_per_split"):
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
    names = [table_key(gpu_name), f"sm{capability[0]}{capability[1]}", "default"]
    for d in table_dirs():
        for stem in names:
            p = d / f"{stem}.json"
            if p.is_file():
                with open(p) as fh:
                    t = dict(BUILTIN, **json.load(fh))
                t["_file"] = str(p)
                return validate_table(t, str(p))
    return dict(BUILTIN)
