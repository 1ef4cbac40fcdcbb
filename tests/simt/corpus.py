"""Kernel cases built from the reference codec (the parent side: imports the package)."""

import numpy as np

from zipserv_vllm.format import reference

from . import cases

ALL = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # RNE, finite inputs


def weight(rng, m, k):
    w = rng.standard_normal((m, k)) * 0.02
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 50))] = 0.0  # zeros (fallback)
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 200))] *= 300.0  # outliers (fallback)
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 500))] = 1e-39  # subnormals (fallback)
    return bf16_bits(w)


def gemm_case(m, k, n, tile_n, split, bias=True, seed=0, name="zipgemm"):
    rng = np.random.default_rng([m, k, n, seed])
    w = weight(rng, m, k)
    e = reference.encode(w)
    x = bf16_bits(rng.standard_normal((n, k)))
    b = bf16_bits(rng.standard_normal(m) * 0.1) if bias else None
    c = cases.weight(e, kind="zipgemm", name=f"{name} {m}x{k} N={n} tile_n={tile_n} split={split}", w=w, x=x,
                     tile_n=tile_n, split=split)
    if b is not None:
        c["bias"] = b
    return c


def grouped_case(ws, counts, tile_n, onehot=False, name="grouped", encoded=None):
    """One grouped launch over the experts ``ws`` (bf16 bits [E, M, K]), counts[e] rows each; X random
    (checked against float64 per expert) or one-hot (checked exactly)."""
    ws = np.ascontiguousarray(ws)
    counts = np.asarray(counts, dtype=np.int64)
    n_exp, m, k = ws.shape
    c = {"kind": "grouped_onehot" if onehot else "grouped", "m": m, "k": k, "experts": n_exp, "counts": counts,
         "w": ws, "tile_n": tile_n,
         "name": f"{name} {n_exp} experts {m}x{k} rows {counts.tolist()} tile_n={tile_n}"}
    for i in range(n_exp):
        e = encoded[i] if encoded is not None else reference.encode(ws[i])
        c.update({f"{n}{i}": np.ascontiguousarray(getattr(e, n)) for n in cases.ENC})
    rng = np.random.default_rng([m, k, n_exp, int(counts.sum())])
    if onehot:
        c["cols"] = rng.integers(0, k, int(counts.sum()))
    else:
        c["x"] = bf16_bits(rng.standard_normal((int(counts.sum()), k)))
    return c


def expert_weights(n_exp, m, k, seed=0):
    rng = np.random.default_rng([n_exp, m, k, seed])
    return np.stack([weight(rng, m, k) for _ in range(n_exp)])


def decompress_case(w, name="decompress", e=None):
    e = e or reference.encode(w)
    assert np.array_equal(reference.decode(e), w)  # the oracle itself round-trips
    return cases.weight(e, kind="decompress", name=name, want=w)


def encode_case(w, name="encode"):
    e = reference.encode(w)
    return {"kind": "encode", "name": name, "w": np.ascontiguousarray(w),
            **{"want_" + n: np.ascontiguousarray(getattr(e, n)) for n in cases.ENC}}


def onehot_case(tile_n, split, n, name="all patterns"):
    """All 65,536 patterns as W, one-hot X (cases.run checks it exactly)."""
    w = ALL.reshape(256, 256)
    cols = (np.arange(n) * 97) % 256
    return cases.weight(reference.encode(w), kind="onehot", name=f"{name} tile_n={tile_n} split={split}", w=w,
                        cols=cols, tile_n=tile_n, split=split)


def embedding_case(w, ids, rows, e=None, name="embedding"):
    padded = np.concatenate([w, np.zeros((rows - w.shape[0], w.shape[1]), np.uint16)])
    want = padded[np.clip(ids.astype(np.int64), 0, rows - 1)]
    return cases.weight(e or reference.encode(w), kind="embedding", name=name, ids=ids, rows=rows, want=want)


def noncanonical_case(c, name="non-canonical layout"):
    """Case c with its weight's segments reordered and garbage between them."""
    from .kernels import noncanonical

    e = noncanonical(cases._enc(c))
    return {**c, "sm": e.sm, "fb": e.fb, "offsets": e.offsets, "name": f"{c.get('name', c['kind'])}, {name}"}


def coverage_cases(race_only: bool = False) -> list:
    """One of everything, small enough for the sanitizer builds: every fused instance with split-K
    off and on, ragged shapes, K % 8 != 0, all 65,536 patterns through every kernel, non-canonical
    layouts, the encoder, the byte-split-layout kernel.

    ``race_only`` (ThreadSanitizer, whose cost grows with every access it orders): the same cases
    with the three that only widen the data cut down (measured under TSan: 40 s, 21 s and 21 s of a
    150 s schedule): the one-hot GEMM at tile_n 8 / split 4 gets 16 columns (two column blocks,
    every split) instead of 64, and the two embedding lookups 24 ids (first, last, out of range,
    repeated) instead of 256 and 134. Which bit patterns flow through a kernel does not change
    which threads touch which addresses in what order; the plain and ASan runs keep the full ones."""
    rng = np.random.default_rng(21)
    w = weight(rng, 130, 200)
    if race_only:
        all_ids = np.array([255, 0, 1, 128, 127, 254, 7, 7, 64, 200, 3, 250, 31, 32, 33, 100, 101, 160, 192, 193,
                            224, 8, 9, 63], dtype=np.int64)
        w_ids = np.array([0, 129, 130, 160, -1, 999, 1, 64, 65, 64, 2, 128, 127, 3, 4, 5, 100, 101, 102, 33, 31, 32,
                          63, 66], dtype=np.int32)
        onehot_n = 16
    else:
        all_ids = np.arange(256, dtype=np.int64)[::-1].copy()
        w_ids = np.concatenate([np.arange(130), [130, 160, -1, 999]]).astype(np.int32)
        onehot_n = 64
    out = [gemm_case(130, 452, 21, t, s) for t in (8, 16, 32, 64, 128) for s in (1, 3)]
    out += [gemm_case(70, 100, 9, 16, 2), gemm_case(1, 1, 1, 8, 1, bias=False),
            noncanonical_case(gemm_case(130, 200, 17, 32, 2)),
            onehot_case(128, 1, 256), onehot_case(8, 4, onehot_n),
            decompress_case(ALL.reshape(256, 256), "all patterns"), decompress_case(w),
            noncanonical_case(decompress_case(w)),
            embedding_case(ALL.reshape(256, 256), all_ids, 256),
            noncanonical_case(embedding_case(w, w_ids, 167)),
            encode_case(np.random.default_rng(3).permutation(ALL).reshape(256, 256), "encoder, all patterns"),
            encode_case(weight(rng, 129, 257), "encoder, ragged"),
            grouped_case(expert_weights(4, 130, 200), [3, 0, 9, 17], 8),
            grouped_case(expert_weights(3, 70, 100), [5, 1, 0], 16),
            grouped_case(np.stack([np.roll(ALL, 4099 * i).reshape(256, 256) for i in range(3)]), [9, 0, 20], 32,
                         onehot=True, name="grouped, all patterns")]
    # the byte-split-layout kernel: both instances (K % 64 == 0 with aligned X; ragged K), split-K, exceptions
    out += [packed_case(ALL.reshape(256, 256), "packed_onehot", "byte-split, all patterns", 16, 2,
                        cols=np.arange(0, 256, 8 if race_only else 1)),
            packed_case(w, "packed", "byte-split ragged", 8, 3, x=bf16_bits(rng.standard_normal((11, 200))),
                        bias=bf16_bits(rng.standard_normal(130) * 0.1)),
            # its decompress kernel: all patterns, and a ragged weight (rows and columns past the tiles)
            packed_case(ALL.reshape(256, 256), "packed_decompress", "byte-split decompress, all patterns", 0, 1),
            packed_case(w, "packed_decompress", "byte-split decompress ragged", 0, 1)]
    return out


def packed_case(w, kind, name, tile_n, split, **extra):
    """A case of the byte-split-layout kernel: W (bf16 bits) packed by the layout's executable spec
    (zipserv_vllm.format.cpu_layout.reference_pack, docs/FORMAT.md appendix A)."""
    import torch

    from zipserv_vllm.format.cpu_layout import reference_pack

    pt = reference_pack(torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16))
    arrays = {a: np.ascontiguousarray(getattr(pt, a).numpy()) for a in ("tiles", "luts", "exc_start", "exc")}
    return {"kind": kind, "name": f"{name} tile_n={tile_n} split={split}", "m": int(w.shape[0]), "k": int(w.shape[1]),
            "w": w, "tile_n": tile_n, "split": split, **arrays, **extra}
