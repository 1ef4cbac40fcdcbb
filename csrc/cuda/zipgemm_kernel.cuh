// Fused ZipGEMM: Y[N, M] = X[N, K] . W[M, K]^T (+ bias) with W in TCA-TBE v1
// (docs/FORMAT.md), decoded lane by lane straight into mma.m16n8k16 A
// fragments. Design, lane maps and the shared-memory map: docs/ZIPGEMM.md.
//
// Block = 4 warps over one 64-row tile row of W (warp w = medium tile w) and
// TN = 8 * NT8 columns of X; grid = (ceil(N / TN), Mt, split parts). The
// grouped kernel (mixtures of experts) runs the same block body over
// (ceil(rows / TN), Mt, experts), each block on its expert's weight and rows.
// Pipeline per K tile i (one barrier per tile):
//   wait(all) + barrier -> counts of tile i+1 from its bit-planes (already in
//   shared memory) -> cp.async values + X of tile i+1, bit-planes of tile
//   i+2 -> decode + MMA of tile i.
// Bit-planes run one tile ahead of values because the values' addresses are
// derived from them (popcounts), so three bit-plane buffers are kept.
//
// Each instance (NT8 = 1, 2, 4, 8, 16) is compiled in its own
// zipgemm_n<8*NT8>.cu so the instances build in parallel.
#pragma once

#include "device_common.cuh"
#include "launch.h"

namespace zipserv {
namespace cuda {
namespace fused {

using namespace zipserv::gemm;
using namespace zipserv::dev;

template <int NT8>
struct Fused {
  static constexpr int TN = 8 * NT8;

  // X rows col0 .. col0 + TN - 1, K columns 64 kt .. 64 kt + 63, into the
  // swizzled tile; rows >= N and columns >= K are zero.
  static __device__ __forceinline__ void issue_x(uint16_t* sx, const GemmArgs& a, int col0, int kt) {
    for (int c = threadIdx.x; c < TN * 8; c += kThreads) {
      const XChunk xc = x_chunk(c, col0, kt, a.N, a.K, a.x_vec != 0);
      const int n = xc.n, k0 = xc.k0;
      uint16_t* dst = sx + xc.dst;
      if (xc.vec) {
        const uint16_t* src = xc.n_ok ? a.x + static_cast<int64_t>(n) * a.K + k0 : a.x;
        cp_async16(dst, src, xc.n_ok ? 16 : 0);
      } else {
        uint16_t v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          v[e] = (xc.n_ok && k0 + e < a.K) ? a.x[static_cast<int64_t>(n) * a.K + k0 + e] : uint16_t{0};
        uint4 pk;
        pk.x = v[0] | (uint32_t{v[1]} << 16);
        pk.y = v[2] | (uint32_t{v[3]} << 16);
        pk.z = v[4] | (uint32_t{v[5]} << 16);
        pk.w = v[6] | (uint32_t{v[7]} << 16);
        *reinterpret_cast<uint4*>(dst) = pk;
      }
    }
  }

  // Decode + MMA of one K tile from shared memory.
  static __device__ __forceinline__ void compute(float (&acc)[NT8][4], const uint64_t* bmp, const uint8_t* ssm,
                                                 const uint16_t* sfb, const uint16_t* sx, const WarpSegment& seg,
                                                 int base_exp, int warp, int lane, int ncols) {
    int hrun = 0;  // high-frequency elements of the warp's earlier FTs
#pragma unroll
    for (int kg = 0; kg < 4; ++kg) {
      uint32_t af[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int f = a_frag_ft(warp, kg, j);
        const uint64_t p0 = bmp[f], p1 = bmp[kFragsPerTile + f], p2 = bmp[2 * kFragsPerTile + f];
        af[j] = decode_lane_pair(p0, p1, p2, base_exp, ssm, sfb, ft_sm_before(seg, hrun),
                                 ft_fb_before(seg, kg * 4 + j, hrun), lane);
        hrun += popc64(indicator(p0, p1, p2));
      }
      mma_slice(acc, af, sx, kg, lane, ncols);
    }
  }

  // The MMAs of K slice kg: A fragment af (decoded by the caller) times each n8 group of the staged
  // X tile. Shared with the byte-split kernel (zipgemm_packed.cuh).
  static __device__ __forceinline__ void mma_slice(float (&acc)[NT8][4], const uint32_t (&af)[4],
                                                   const uint16_t* sx, int kg, int lane, int ncols) {
#pragma unroll
    for (int t = 0; t < NT8; ++t) {
      if (t * 8 < ncols) {  // uniform: skip n8 groups wholly beyond N
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(sx + b_frag_smem(t, kg, lane, 0));
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(sx + b_frag_smem(t, kg, lane, 1));
        mma_bf16_16816(acc[t], af, b0, b1);
      }
    }
  }
};

// Epilogue of a block (the fused and the byte-split kernels): bias + bf16 rounding (split == 1) or
// the fp32 partials of K part `part`.
template <int NT8>
__device__ __forceinline__ void store_acc(const GemmArgs& a, const float (&acc)[NT8][4], int tm, int col0, int part,
                                          int warp, int lane) {
#pragma unroll
  for (int t = 0; t < NT8; ++t) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = c_out_m(tm, warp, lane, r);
      const int n = c_out_n(col0, t, lane, r);
      if (m < a.M && n < a.N) {
        if (a.split == 1) {
          a.y[y_index(n, m, a.M)] = f32_to_bf16_bits(epilogue_sum(&acc[t][r], 0, 1, a.bias, m));
        } else {
          a.ws[ws_index(part, n, m, a.N, a.M)] = acc[t][r];
        }
      }
    }
  }
}

// One block's work: tile row tm of W, X rows col0 .. col0 + TN - 1, K part `part`.
template <int NT8>
__device__ __forceinline__ void fused_block(const GemmArgs& a, unsigned char* smem, int col0, int tm, int part) {
    using F = Fused<NT8>;
    constexpr int TN = F::TN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kt_total = (a.K + kTile - 1) / kTile;
    int kb, ke;
    splitk_range(kt_total, a.split, part, &kb, &ke);
    const int nt = ke > kb ? ke - kb : 0;
    const int64_t grow = static_cast<int64_t>(tm) * kt_total;
    const int ncols = a.N - col0;

    auto bmp = [&](int buf) { return reinterpret_cast<uint64_t*>(smem + smem_bmp(buf)); };
    auto stage = [&](int s) { return smem + smem_stage(TN, s); };
    auto st_sm = [&](int s) { return stage(s) + stage_sm(warp); };
    auto st_fb = [&](int s) { return reinterpret_cast<uint16_t*>(stage(s) + stage_fb(warp)); };
    auto st_x = [&](int s) { return reinterpret_cast<uint16_t*>(stage(s) + stage_x(TN)); };

    float acc[NT8][4];
#pragma unroll
    for (int t = 0; t < NT8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

    WarpSegment seg{};  // of the tile whose values are in flight / staged
    int base_cur = 0;
    int64_t nx_sm = 0, nx_fb = 0;  // segment starts of the tile whose bit-planes are in flight
    int nx_base = 0;
    int hb, hc;

    if (nt > 0) {
      issue_bitmaps(bmp(pipe_issue_bmp(-2)), a.bitmaps, grow + kb);
      cp_async_commit();
      const int64_t o_sm = a.offsets[2 * (grow + kb)], o_fb = a.offsets[2 * (grow + kb) + 1];
      base_cur = a.base[grow + kb];
      cp_async_wait_all();
      __syncthreads();
      warp_counts(bmp(pipe_counts_bmp(-1)), warp, lane, &hb, &hc);
      seg = warp_segment(o_sm, o_fb, warp, hb, hc);
      issue_values(st_sm(pipe_issue_stage(-1)), st_fb(pipe_issue_stage(-1)), seg, a.sm, a.fb, lane);
      F::issue_x(st_x(pipe_issue_stage(-1)), a, col0, kb);
      if (nt > 1) {
        issue_bitmaps(bmp(pipe_issue_bmp(-1)), a.bitmaps, grow + kb + 1);
        nx_sm = a.offsets[2 * (grow + kb + 1)];
        nx_fb = a.offsets[2 * (grow + kb + 1) + 1];
        nx_base = a.base[grow + kb + 1];
      }
      cp_async_commit();
    }

    for (int i = 0; i < nt; ++i) {
      cp_async_wait_all();
      __syncthreads();
      const WarpSegment cur = seg;
      const int cur_base = base_cur;
      if (i + 1 < nt) {
        warp_counts(bmp(pipe_counts_bmp(i)), warp, lane, &hb, &hc);
        seg = warp_segment(nx_sm, nx_fb, warp, hb, hc);
        base_cur = nx_base;
        issue_values(st_sm(pipe_issue_stage(i)), st_fb(pipe_issue_stage(i)), seg, a.sm, a.fb, lane);
        F::issue_x(st_x(pipe_issue_stage(i)), a, col0, kb + i + 1);
      }
      if (i + 2 < nt) {
        const int64_t g = grow + kb + i + 2;
        issue_bitmaps(bmp(pipe_issue_bmp(i)), a.bitmaps, g);
        nx_sm = a.offsets[2 * g];
        nx_fb = a.offsets[2 * g + 1];
        nx_base = a.base[g];
      }
      cp_async_commit();
      const int cs = pipe_compute_stage(i);
      F::compute(acc, bmp(pipe_compute_bmp(i)), st_sm(cs), st_fb(cs), st_x(cs), cur, cur_base, warp, lane, ncols);
    }

    store_acc<NT8>(a, acc, tm, col0, part, warp, lane);
}

template <int NT8>
__global__ void __launch_bounds__(kThreads) fused_kernel(GemmArgs a) {
    ZS_DYNAMIC_SHARED(smem);
    fused_block<NT8>(a, smem, blockIdx.x * (8 * NT8), blockIdx.y, blockIdx.z);
}

// Grouped (mixture of experts): grid (ceil(rows / TN), Mt, E); block z works on expert z's
// weight and on its rows expert_rows[z] .. expert_rows[z + 1] of X and Y. Blocks past their
// expert's rows leave at once (before any barrier, the whole block alike), so the grid depends
// only on the total row count (CUDA-graph safe) however the tokens are routed.
template <int NT8>
__global__ void __launch_bounds__(kThreads) grouped_kernel(GroupedGemmArgs g) {
    ZS_DYNAMIC_SHARED(smem);
    const int e = blockIdx.z;
    const int r0 = g.expert_rows[e], r1 = g.expert_rows[e + 1];
    const int col0 = blockIdx.x * (8 * NT8);
    if (col0 >= r1 - r0) return;
    const uint64_t* w = g.weights + static_cast<int64_t>(e) * kGroupedPtrs;
    const GemmArgs a{reinterpret_cast<const uint64_t*>(w[0]), reinterpret_cast<const uint8_t*>(w[1]),
                     reinterpret_cast<const int64_t*>(w[2]), reinterpret_cast<const uint8_t*>(w[3]),
                     reinterpret_cast<const uint16_t*>(w[4]), g.x + static_cast<int64_t>(r0) * g.K, nullptr,
                     g.y + static_cast<int64_t>(r0) * g.M, nullptr, g.M, g.K, r1 - r0, 1, g.x_vec};
    fused_block<NT8>(a, smem, col0, blockIdx.y, 0);
}

template <int NT8>
inline int launch(const GemmArgs& a, cudaStream_t st) {
  constexpr int TN = 8 * NT8;
  const dim3 grid((a.N + TN - 1) / TN, (a.M + kTile - 1) / kTile, a.split);
  ZS_LAUNCH(fused_kernel<NT8>, grid, kThreads, fused_smem_bytes(TN), st)(a);
  return static_cast<int>(cudaGetLastError());
}

template <int NT8>
inline int launch_grouped(const GroupedGemmArgs& g, cudaStream_t st) {
  constexpr int TN = 8 * NT8;
  const dim3 grid((g.rows + TN - 1) / TN, (g.M + kTile - 1) / kTile, g.E);
  ZS_LAUNCH(grouped_kernel<NT8>, grid, kThreads, fused_smem_bytes(TN), st)(g);
  return static_cast<int>(cudaGetLastError());
}

template <int NT8>
inline int set_attr() {
  int err = static_cast<int>(cudaFuncSetAttribute(fused_kernel<NT8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  fused_smem_bytes(8 * NT8)));
  if (!err)
    err = static_cast<int>(cudaFuncSetAttribute(grouped_kernel<NT8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                fused_smem_bytes(8 * NT8)));
  return err;
}


// One instance per translation unit (zipgemm_n*.cu).
#define ZIPSERV_FUSED_INSTANCE(NT8)                                                                    \
  int launch_nt8_##NT8(const GemmArgs& a, cudaStream_t st) { return launch<NT8>(a, st); }           \
  int launch_grouped_nt8_##NT8(const GroupedGemmArgs& g, cudaStream_t st) {                         \
    return launch_grouped<NT8>(g, st);                                                              \
  }                                                                                                 \
  int set_attr_nt8_##NT8() { return set_attr<NT8>(); }

}  // namespace fused
}  // namespace cuda
}  // namespace zipserv
