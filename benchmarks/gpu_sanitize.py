"""Small shapes through every CUDA kernel, for compute-sanitizer (memcheck, racecheck, synccheck).

Run by benchmarks/gpu_run.sh as ``compute-sanitizer --tool TOOL python benchmarks/gpu_sanitize.py``:
decompress, every fused instance (tile_n 8..128) with split-K off and on, the
decoupled path, the embedding gather and the GPU encoder, on 130 x 452 and
320 x 1000 weights (ragged M and K), N in {1, 21, 130}, the all-65,536-patterns
matrix, and a non-canonical layout (segments in reverse tile order with
garbage between them). Exits 1 on a wrong result; the sanitizer reports
memory, race and barrier errors itself.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm.format import CompressedTensor, reference
from zipserv_vllm.kernels import cuda as cuda_ops
from zipserv_vllm.kernels.embedding import compressed_embedding

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
    weights = {(130, 452): (torch.randn(130, 452) * 0.02).to(torch.bfloat16),
               (320, 1000): (torch.randn(320, 1000) * 0.02).to(torch.bfloat16),
               (256, 256): torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)}
    for (m, k), w in weights.items():
        w = w.to(DEV)
        ct = cuda_ops.compress_tensor_cuda(w)
        for c in (ct, noncanonical(ct)):
            wd = cuda_ops.decompress_cuda(c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k)
            bad += not torch.equal(wd.view(torch.int16), w.view(torch.int16))
            ids = torch.tensor([0, m - 1, m, m + 5, -3, 10**6], device=DEV)
            rows = m + 64
            got = compressed_embedding(ids, c, rows)
            padded = torch.cat([w, torch.zeros(rows - m, k, dtype=w.dtype, device=DEV)])
            bad += not torch.equal(got.view(torch.int16), padded[ids.clamp(0, rows - 1)].view(torch.int16))
            if m == 256:  # the patterns matrix holds NaN/inf: decode only
                continue
            for n in (1, 21, 130):
                x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
                ref = F.linear(x.float(), w.float())
                for tn in (8, 16, 32, 64, 128):
                    for split in (1, 3):
                        y = cuda_ops.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None, tn, split)
                        bad += not torch.allclose(y.float(), ref, atol=5e-2, rtol=2e-2)
                y = cuda_ops.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None)
                bad += not torch.allclose(y.float(), ref, atol=5e-2, rtol=2e-2)
                bad += not torch.allclose(zipserv_vllm.linear(x, c).float(), ref, atol=5e-2, rtol=2e-2)
    # the grouped (mixture-of-experts) kernel: 4 experts, one of them non-canonical, empty experts, ragged rows
    m, k = 130, 452
    ws = [(torch.randn(m, k) * 0.02).to(torch.bfloat16).to(DEV) for _ in range(4)]
    cts = [cuda_ops.compress_tensor_cuda(w) for w in ws]
    cts[2] = noncanonical(cts[2])
    counts = [3, 0, 21, 1]
    starts = [0, 3, 3, 24, 25]
    x = torch.randn(starts[-1], k, device=DEV).to(torch.bfloat16)
    er = torch.tensor(starts, dtype=torch.int32, device=DEV)
    for tn in (8, 16, 32, 64, 128):
        y = cuda_ops.grouped_gemm(x, cts, er, path="fused", tile_n=tn)
        for e, c in enumerate(counts):
            if c:
                a, b = starts[e], starts[e + 1]
                bad += not torch.allclose(y[a:b].float(), F.linear(x[a:b].float(), ws[e].float()), atol=5e-2, rtol=2e-2)
    torch.cuda.synchronize()
    print(f"gpu_sanitize: {bad} wrong results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
