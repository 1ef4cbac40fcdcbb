"""Decode throughput of a Llama-3-8B-shaped model: every linear through zipserv_vllm.linear vs BF16.

Plain PyTorch, no vLLM. Weights are N(0, 0.02^2) in bf16 (norm weights 1);
the model is built once and served two ways in the same process:

* ``bf16``    : F.linear on the BF16 weights;
* ``zipserv`` : zipserv_vllm.linear on the compressed weights (mode "fast":
                the dispatcher picks fused ZipGEMM or decompress + cuBLAS).

QKV and gate/up are merged (as vLLM does); the embedding stays BF16 (the
tile format cannot fetch single rows), lm_head is compressed. The KV cache is
pre-filled with random values for --context positions and greedy decoding
runs --steps tokens per batch size; on CUDA each decode step is captured in a
CUDA graph (shape-static attention over the whole cache with a mask), so
launch overhead does not hide the GEMMs. Reports decode tokens/s at batch 1, 8
and 32 for both, their ratio, and the weight memory of both. JSON:
benchmarks/results/bench_decode_e2e.json.

``--device cpu --tiny`` runs a 2-layer, 256-wide model on the CPU (a smoke test
of the script and of the CPU path; its numbers say nothing about the GPU).
Without CUDA and without ``--device cpu`` it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Config:
    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


TINY = Config(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1000)


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Linears:
    """The model's linear weights, served as BF16 or as CompressedTensors."""

    def __init__(self, weights: dict[str, torch.Tensor], compressed: bool):
        import zipserv_vllm

        self.compressed = compressed
        if compressed:
            enc = zipserv_vllm.compress_tensor
            if next(iter(weights.values())).is_cuda:
                from zipserv_vllm.kernels import cuda as cuda_ops

                enc = cuda_ops.compress_tensor_cuda
            self.w = {k: enc(v) for k, v in weights.items()}
        else:
            self.w = weights

    def __call__(self, name, x):
        if self.compressed:
            import zipserv_vllm

            return zipserv_vllm.linear(x, self.w[name])
        return F.linear(x, self.w[name])

    def nbytes(self) -> int:
        if self.compressed:
            return sum(ct.nbytes for ct in self.w.values())
        return sum(t.numel() * t.element_size() for t in self.w.values())


def make_weights(cfg: Config, device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)

    def gauss(m, k):
        return (torch.randn(m, k, generator=g, device=device) * 0.02).to(torch.bfloat16)

    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    w = {}
    for i in range(cfg.layers):
        w[f"{i}.qkv"] = gauss(q + 2 * kv, cfg.hidden)
        w[f"{i}.o"] = gauss(cfg.hidden, q)
        w[f"{i}.gate_up"] = gauss(2 * cfg.intermediate, cfg.hidden)
        w[f"{i}.down"] = gauss(cfg.hidden, cfg.intermediate)
    w["lm_head"] = gauss(cfg.vocab, cfg.hidden)
    embed = gauss(cfg.vocab, cfg.hidden)
    return w, embed


class Decoder:
    """Greedy decode with a static KV cache; step() uses only device tensors (graph-capturable)."""

    def __init__(self, cfg: Config, lin: Linears, embed, batch: int, max_len: int, device):
        self.cfg, self.lin, self.embed = cfg, lin, embed
        self.norm_w = torch.ones(cfg.hidden, dtype=torch.bfloat16, device=device)
        self.cache = torch.randn(cfg.layers, 2, batch, cfg.kv_heads, max_len, cfg.head_dim, device=device).to(torch.bfloat16)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
        ang = torch.arange(max_len, device=device).float()[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()
        self.ar = torch.arange(max_len, device=device)
        self.batch, self.max_len = batch, max_len

    def rope(self, x):  # x [B, h, 1, d]
        c, s = self.cos[self.pos][:, None, :], self.sin[self.pos][:, None, :]  # [1, 1, d/2]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
        return out.to(x.dtype)

    def step(self):
        cfg, b = self.cfg, self.batch
        h = self.embed[self.tokens]  # [B, H]
        mask = torch.where(self.ar <= self.pos, 0.0, float("-inf")).to(torch.bfloat16)[None, None, None, :]
        q_n, kv_n = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for i in range(cfg.layers):
            x = rms_norm(h, self.norm_w, cfg.eps)
            qkv = self.lin(f"{i}.qkv", x)
            q = qkv[:, :q_n].view(b, cfg.heads, 1, cfg.head_dim)
            k = qkv[:, q_n:q_n + kv_n].view(b, cfg.kv_heads, 1, cfg.head_dim)
            v = qkv[:, q_n + kv_n:].view(b, cfg.kv_heads, 1, cfg.head_dim)
            q, k = self.rope(q), self.rope(k)
            self.cache[i, 0].index_copy_(2, self.pos, k)
            self.cache[i, 1].index_copy_(2, self.pos, v)
            a = F.scaled_dot_product_attention(q, self.cache[i, 0], self.cache[i, 1], attn_mask=mask, enable_gqa=True)
            h = h + self.lin(f"{i}.o", a.reshape(b, q_n))
            x = rms_norm(h, self.norm_w, cfg.eps)
            gu = self.lin(f"{i}.gate_up", x)
            h = h + self.lin(f"{i}.down", F.silu(gu[:, :cfg.intermediate]) * gu[:, cfg.intermediate:])
        logits = self.lin("lm_head", rms_norm(h, self.norm_w, cfg.eps))
        self.tokens.copy_(logits.argmax(-1))
        self.pos.add_(1)


def run_decode(cfg, lin, embed, batch, context, steps, device, graph: bool) -> float:
    dec = Decoder(cfg, lin, embed, batch, context + steps + 8, device)
    dec.pos.fill_(context)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                dec.step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dec.step()
        fn = g.replay
    else:
        fn = dec.step
        fn()
    dec.pos.fill_(context)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return batch * steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256 (CPU smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (e.g. 8 to save time)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-graph", action="store_true", help="eager decode steps (no CUDA graph)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_decode_e2e.json"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_decode_e2e: no CUDA device; use --device cpu --tiny for a CPU smoke run", file=sys.stderr)
            return 2
        from zipserv_vllm.kernels import cuda as cuda_ops

        if not cuda_ops.available():
            print(f"bench_decode_e2e: {cuda_ops.unavailable_reason()}", file=sys.stderr)
            return 2
    cfg = TINY if args.tiny else Config()
    if args.layers:
        cfg.layers = args.layers
    batches = [int(b) for b in args.batches.split(",")]
    graph = device.type == "cuda" and not args.no_graph

    t0 = time.time()
    weights, embed = make_weights(cfg, device)
    bf16 = Linears(weights, compressed=False)
    zs = Linears(weights, compressed=True)
    if device.type == "cuda":
        from zipserv_vllm.kernels import cuda as cuda_ops

        cuda_ops.prepare(device)
    build_s = time.time() - t0

    results = []
    for b in batches:
        tps = {name: run_decode(cfg, lin, embed, b, args.context, args.steps, device, graph)
               for name, lin in (("bf16", bf16), ("zipserv", zs))}
        results.append({"batch": b, "tokens_per_s": tps, "speedup": tps["zipserv"] / tps["bf16"]})
        print(f"batch {b:3d}: bf16 {tps['bf16']:10.1f} tok/s  zipserv {tps['zipserv']:10.1f} tok/s  "
              f"ratio {tps['zipserv'] / tps['bf16']:.3f}", flush=True)
    emb_bytes = embed.numel() * 2
    mem = {"linear_bf16_bytes": bf16.nbytes(), "linear_zipserv_bytes": zs.nbytes(), "embedding_bf16_bytes": emb_bytes,
           "total_bf16_bytes": bf16.nbytes() + emb_bytes, "total_zipserv_bytes": zs.nbytes() + emb_bytes}
    mem["linear_ratio"] = mem["linear_zipserv_bytes"] / mem["linear_bf16_bytes"]
    print(f"weights: linears {mem['linear_bf16_bytes'] / 1e9:.3f} GB bf16 -> {mem['linear_zipserv_bytes'] / 1e9:.3f} GB "
          f"zipserv ({mem['linear_ratio']:.3f}); with the bf16 embedding {mem['total_bf16_bytes'] / 1e9:.3f} -> "
          f"{mem['total_zipserv_bytes'] / 1e9:.3f} GB")
    out = {
        "benchmark": "bench_decode_e2e", "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "config": asdict(cfg), "tiny": args.tiny, "context": args.context, "steps": args.steps,
        "cuda_graph": graph, "build_seconds": round(build_s, 1), "results": results, "memory": mem,
        "note": "random N(0, 0.02^2) weights; tokens/s = batch * steps / wall time of the decode steps",
    }
    p = Path(args.out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1))
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
