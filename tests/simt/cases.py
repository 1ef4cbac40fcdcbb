"""Kernel cases for the SIMT harness: what to launch and what must come out. numpy only.

A case is a dict: ``kind`` (decompress, zipgemm, onehot, grouped, grouped_onehot,
packed, packed_onehot, embedding, encode),
its arrays and scalars, and the expected result (from the reference codec,
computed by the parent test). ``run(mod, case)`` launches it through
``kernels.py`` and returns None or what went wrong. ``save``/``load`` carry a
list of cases to the sanitizer child process as one .npz file.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

try:
    from . import kernels
except ImportError:  # loaded by file path in the child process
    import kernels  # type: ignore[no-redef]

ENC = ("bitmaps", "base", "offsets", "sm", "fb")


def weight(e, **extra) -> dict:
    return {"m": int(e.m), "k": int(e.k), **{n: np.ascontiguousarray(getattr(e, n)) for n in ENC}, **extra}


def _enc(case) -> SimpleNamespace:
    return SimpleNamespace(**{n: case[n] for n in ("m", "k", *ENC)})


def run(mod, case: dict) -> str | None:
    kind = case["kind"]
    name = case.get("name", kind)
    try:
        if kind == "decompress":
            got = kernels.decompress(mod, _enc(case))
            bad = int((got != case["want"]).sum())
            return f"{name}: {bad} elements differ from the reference decode" if bad else None
        if kind == "zipgemm":
            bias = case.get("bias")
            y = kernels.zipgemm(mod, _enc(case), case["x"], bias, int(case["tile_n"]), int(case["split"]))
            err = kernels.gemm_error(y, case["w"], case["x"], bias)
            return f"{name}: error {err:.3g} x the tolerance (inf = unwritten or NaN)" if not err <= 1 else None
        if kind == "onehot":
            cols = case["cols"]
            x = kernels.one_hot_x(cols.size, int(case["k"]), cols)
            y = kernels.zipgemm(mod, _enc(case), x, None, int(case["tile_n"]), int(case["split"]))
            msg = kernels.check_one_hot(y, case["w"], cols)
            return f"{name}: {msg}" if msg else None
        if kind in ("packed", "packed_onehot", "packed_decompress"):
            pk = SimpleNamespace(m=int(case["m"]), k=int(case["k"]), **{n: case[n] for n in kernels.PACKED})
            if kind == "packed_decompress":  # bit for bit: the weight the layout was packed from
                got = kernels.decompress_packed(mod, pk)
                bad = int((got != np.asarray(case["w"], np.uint16)).sum())
                return f"{name}: {bad} elements differ from the packed weight" if bad else None
            if kind == "packed_onehot":
                x = kernels.one_hot_x(case["cols"].size, pk.k, case["cols"])
            else:
                x = case["x"]
            if int(case.get("x_offset", 0)):  # an X 2 bytes past a 16-byte boundary: the general instance
                buf = np.zeros(x.size + 8, np.uint16)
                x = buf[1:1 + x.size].reshape(x.shape)
                x[...] = case["x"] if kind == "packed" else kernels.one_hot_x(case["cols"].size, pk.k, case["cols"])
            y = kernels.zipgemm_packed(mod, pk, x, case.get("bias"), int(case["tile_n"]), int(case["split"]))
            if kind == "packed_onehot":
                msg = kernels.check_one_hot(y, case["w"], case["cols"])
                return f"{name}: {msg}" if msg else None
            err = kernels.gemm_error(y, case["w"], x, case.get("bias"))
            return f"{name}: error {err:.3g} x the tolerance (inf = unwritten or NaN)" if not err <= 1 else None
        if kind in ("grouped", "grouped_onehot"):
            experts = [SimpleNamespace(m=int(case["m"]), k=int(case["k"]), **{n: case[f"{n}{i}"] for n in ENC})
                       for i in range(int(case["experts"]))]
            counts = case["counts"]
            x = case["x"] if kind == "grouped" else kernels.one_hot_x(int(counts.sum()), int(case["k"]), case["cols"])
            y = kernels.zipgemm_grouped(mod, experts, x, counts, int(case["tile_n"]))
            start = 0
            for i, c in enumerate(counts.tolist()):
                ye, w = y[start:start + c], case["w"][i]
                if kind == "grouped":
                    err = kernels.gemm_error(ye, w, x[start:start + c], None) if c else 0.0
                    msg = None if err <= 1 else f"error {err:.3g} x the tolerance (inf = unwritten or NaN)"
                else:
                    msg = kernels.check_one_hot(ye, w, case["cols"][start:start + c])
                if msg:
                    return f"{name}: expert {i} ({c} rows): {msg}"
                start += c
            return None
        if kind == "embedding":
            got = kernels.embedding(mod, _enc(case), case["ids"], int(case["rows"]))
            bad = int((got != case["want"]).sum())
            return f"{name}: {bad} elements differ from the padded table's rows" if bad else None
        if kind == "encode":
            got = kernels.encode(mod, case["w"])
            for n in ENC:
                if not np.array_equal(getattr(got, n), case["want_" + n]):
                    return f"{name}: {n} differs from the reference encoder"
            return None
    except RuntimeError as exc:
        return f"{name}: {exc}"
    raise ValueError(f"unknown case kind {kind!r}")


def save(path, cases: list[dict]) -> None:
    arrays, meta = {}, []
    for i, c in enumerate(cases):
        scal = {}
        for key, v in c.items():
            if isinstance(v, np.ndarray):
                arrays[f"{i}.{key}"] = v
            else:
                scal[key] = v
        meta.append(scal)
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def load(path) -> list[dict]:
    z = np.load(path)
    meta = json.loads(bytes(z["__meta__"]).decode())
    cases = [dict(m) for m in meta]
    for key in z.files:
        if key != "__meta__":
            i, name = key.split(".", 1)
            cases[int(i)][name] = np.ascontiguousarray(z[key])
    return cases
