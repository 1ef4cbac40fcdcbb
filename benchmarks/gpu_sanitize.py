"""Small shapes through every CUDA kernel, for compute-sanitizer (memcheck, racecheck, synccheck).

Run by benchmarks/gpu_run.sh as ``compute-sanitizer --tool TOOL python benchmarks/gpu_sanitize.py``:
decompress, every fused instance (tile_n 8..128) with split-K off and on, the
decoupled path, the embedding gather, the grouped (MoE) kernel, the
byte-split-layout kernel (both instances) and the GPU encoder, on 130 x 452 and 320 x 1000 weights (ragged M and K), the
all-65,536-patterns matrix, and a non-canonical layout (segments in reverse
tile order with garbage between them).

Results are checked exactly, so one wrong weight anywhere fails:

* decode and gather: bit for bit against the source weight;
* every GEMM path: one-hot inputs (rows of the identity, N in {1, 21, 130, K}
  for the fused instances; every expert's full identity for the grouped
  kernel), whose outputs are the weight's own values: fp32 sums of one product
  and zeros are exact, so the output must equal the weight's column exactly;
* accumulation over K: random inputs against a float64 reference, within the
  bound of fp32 accumulation plus the output's bf16 rounding.

Exits 1 on a wrong result; the sanitizer reports memory, race and barrier errors itself.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import zipserv_vllm
from zipserv_vllm.format import CompressedTensor, reference
from zipserv_vllm.kernels import cuda as cuda_ops
from zipserv_vllm.kernels.embedding import compressed_embedding
from zipserv_vllm.kernels.selfcheck import exact_one_hot, one_hot, within_f64

DEV = "cuda"


def noncanonical(ct: CompressedTensor) -> CompressedTensor:
    e = reference.Encoded(*ct.shape, ct.bitmaps.cpu().numpy().view(np.uint64), ct.base.cpu().numpy(),
                          ct.offsets.cpu().numpy(), ct.sm.cpu().numpy(), ct.fb.cpu().numpy().view(np.uint16))
    h = reference.tile_high_counts(e.bitmaps).reshape(-1)
    sm_len, fb_len = -(-h // 16) * 16, -(-(4096 - h) // 8) * 8
    sm, fb, off = [], [], np.zeros((h.size, 2), dtype=np.int64)
    ps = pf = 0
    for t in reversed(range(h.size)):
        sm.append(np.full(32, 0xAB, np.uint8)); ps += 32
        fb.append(np.full(16, 0xCDEF, np.uint16)); pf += 16
        a, b = e.offsets.reshape(-1, 2)[t]
        off[t] = (ps, pf)
        sm.append(e.sm[a:a + sm_len[t]]); ps += sm_len[t]
        fb.append(e.fb[b:b + fb_len[t]]); pf += fb_len[t]
    return CompressedTensor(ct.shape, ct.bitmaps, ct.base, torch.from_numpy(off.reshape(ct.offsets.shape)).to(DEV),
                            torch.from_numpy(np.concatenate(sm)).to(DEV),
                            torch.from_numpy(np.concatenate(fb).view(np.int16)).to(DEV))


def main() -> int:
    bad = 0

    def check(ok: bool, what: str) -> None:
        nonlocal bad
        if not ok:
            bad += 1
            print(f"gpu_sanitize: WRONG {what}", flush=True)

    weights = {(130, 452): (torch.randn(130, 452) * 0.02).to(torch.bfloat16),
               (320, 1000): (torch.randn(320, 1000) * 0.02).to(torch.bfloat16),
               (256, 256): torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)}
    for (m, k), w in weights.items():
        w = w.to(DEV)
        ct = cuda_ops.compress_tensor_cuda(w)
        ref_ct = zipserv_vllm.compress_tensor(w.cpu())
        check(ct.same_encoding(ref_ct), f"GPU encoder != CPU encoder on {m}x{k}")
        for label, c in (("canonical", ct), ("non-canonical", noncanonical(ct))):
            where = f"{m}x{k} {label}"
            wd = cuda_ops.decompress_cuda(c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k)
            check(torch.equal(wd.view(torch.int16), w.view(torch.int16)), f"decompress {where}")
            ids = torch.tensor([0, m - 1, m, m + 5, -3, 10**6], device=DEV)
            rows = m + 64
            got = compressed_embedding(ids, c, rows)
            padded = torch.cat([w, torch.zeros(rows - m, k, dtype=w.dtype, device=DEV)])
            check(torch.equal(got.view(torch.int16), padded[ids.clamp(0, rows - 1)].view(torch.int16)),
                  f"embedding {where}")
            if m == 256:  # the patterns matrix holds NaN/inf: decode and gather only
                continue
            for n in (1, 21, 130, k):
                x, cols = one_hot(n, k, offset=n, device=DEV)
                for tn in (8, 16, 32, 64, 128):
                    for split in (1, 3):
                        y = cuda_ops.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None, tn, split)
                        check(exact_one_hot(y, w, cols), f"fused tile_n={tn} split={split} N={n} one-hot {where}")
                y = cuda_ops.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None)
                check(exact_one_hot(y, w, cols), f"decoupled N={n} one-hot {where}")
                check(exact_one_hot(zipserv_vllm.linear(x, c), w, cols), f"linear N={n} one-hot {where}")
            for n in (1, 21, 130):
                x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
                for tn in (8, 16, 32, 64, 128):
                    for split in (1, 3):
                        y = cuda_ops.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None, tn, split)
                        check(within_f64(y, x, w), f"fused tile_n={tn} split={split} N={n} accumulation {where}")
                y = cuda_ops.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None)
                check(within_f64(y, x, w), f"decoupled N={n} accumulation {where}")
    # the byte-split-layout kernel (docs/FORMAT.md appendix A): the patterns matrix one-hot (inf / NaN rows give
    # NaN wherever their row has one, so only rows without them are compared), Gaussian weights exactly and
    # against float64, aligned X (16-byte chunks) and X one element off (the general instance)
    from zipserv_vllm.format.cpu_layout import reference_pack

    for (m, k), w in weights.items():
        pt = reference_pack(w).to(DEV)
        w = w.to(DEV)
        finite = torch.isfinite(w.float()).all(dim=1)
        for off in (0, 1):
            x, cols = one_hot(k, k, device=DEV)
            if off:
                buf = torch.zeros(x.numel() + 8, dtype=torch.bfloat16, device=DEV)
                x = buf[1:1 + x.numel()].view(k, k).copy_(x)
            for tn in cuda_ops.PACKED_TILE_NS:
                for split in (1, 3):
                    y = cuda_ops.packed_gemm(x, pt, None, tn, split)
                    check(exact_one_hot(y[:, finite], w[finite], cols), f"packed tile_n={tn} split={split} one-hot "
                          f"{m}x{k} x offset {off}")
                    if m != 256:
                        xr = torch.randn(21, k, device=DEV).to(torch.bfloat16)
                        check(within_f64(cuda_ops.packed_gemm(xr, pt, None, tn, split), xr, w),
                              f"packed tile_n={tn} split={split} accumulation {m}x{k}")
    # the grouped (mixture-of-experts) kernel: 4 experts, one of them non-canonical, an empty expert, ragged rows;
    # experts 0 and 3 get every row of the identity, expert 2 a few
    m, k = 130, 452
    ws = [(torch.randn(m, k) * 0.02).to(torch.bfloat16).to(DEV) for _ in range(4)]
    cts = [cuda_ops.compress_tensor_cuda(w) for w in ws]
    cts[2] = noncanonical(cts[2])
    counts = [k, 0, 21, k]
    parts = [one_hot(c, k, offset=5 * e, device=DEV) for e, c in enumerate(counts)]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    x = torch.cat([p[0] for p in parts])
    xr = torch.randn(starts[-1], k, device=DEV).to(torch.bfloat16)
    er = torch.tensor(starts, dtype=torch.int32, device=DEV)
    for tn in (8, 16, 32, 64, 128):
        y = cuda_ops.grouped_gemm(x, cts, er, path="fused", tile_n=tn)
        yr = cuda_ops.grouped_gemm(xr, cts, er, path="fused", tile_n=tn)
        for e, c in enumerate(counts):
            if c:
                a, b = starts[e], starts[e + 1]
                check(exact_one_hot(y[a:b], ws[e], parts[e][1]), f"grouped tile_n={tn} expert {e} one-hot")
                check(within_f64(yr[a:b], xr[a:b], ws[e]), f"grouped tile_n={tn} expert {e} accumulation")
    torch.cuda.synchronize()
    print(f"gpu_sanitize: {bad} wrong results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
