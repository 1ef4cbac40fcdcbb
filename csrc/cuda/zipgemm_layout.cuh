// Index math of the ZipGEMM / decompress kernels. Plain C++ marked ZS_HD:
// nvcc compiles it into the kernels, g++ into the same kernels run on the CPU
// by the SIMT harness (csrc/simt/, tests/simt/), so the tests execute exactly
// these mappings.
//
// Thread block: 4 warps (128 threads) over one 64-row tile row of W and
// kTileN(NT8) = 8 * NT8 columns of X. Warp w owns medium tile mm = w
// (W rows 16 w .. 16 w + 15 of the tile) and all kTileN columns.
#pragma once

#include <cstdint>

#include "zipserv/decode_lane.h"
#include "zipserv/format.h"

namespace zipserv {
namespace gemm {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMedRows = 16;                            // rows of a medium tile
constexpr int kFtPerMed = 16;                           // FTs of a medium tile
constexpr int kMedElems = kFtPerMed * kFragElems;       // 1024
constexpr int kChunk = 16;                              // bytes per cp.async

// Per-warp staging of a medium tile's value segments (bytes / elements).
// A warp copies the 16-byte chunks that cover its sub-segment: at most 15
// bytes before it and the rounding after it, plus the one-element over-read
// of decode_lane_pair (kSmSlack / kFbSlack).
constexpr int kSmSlack = 16;
constexpr int kFbSlack = 8;
constexpr int kSmStageMaxChunks = (15 + kMedElems + kChunk - 1) / kChunk;      // 65
constexpr int kFbStageMaxChunks = (7 + kMedElems + 7) / 8;                       // 129
constexpr int kSmStageBytes = kSmStageMaxChunks * kChunk + kSmSlack;            // 1056
constexpr int kFbStageElems = kFbStageMaxChunks * 8 + kFbSlack;                 // 1040
static_assert(kSmStageBytes % 16 == 0 && (kFbStageElems * 2) % 16 == 0, "16-byte aligned staging");

constexpr int kBmpBytes = kPlanes * kFragsPerTile * 8;  // 1536 per tile
constexpr int kBmpBuffers = 3;                          // tiles t, t+1, t+2
constexpr int kStages = 2;                              // values + X double buffer

// Pipeline schedule of the fused kernel, K tile i of a split part (the
// prologue is iteration -1: it issues planes of tiles 0 and 1 and values/X of
// tile 0). A hazard here reads garbage in the SIMT harness (cp.async fills its
// destination with garbage until the wait; tests/simt/test_faults.py plants one).
//   compute(i)     reads planes buffer pipe_compute_bmp(i), stage pipe_compute_stage(i)
//   counts(i+1)    reads planes buffer pipe_counts_bmp(i)
//   issue(i+1)     values + X of tile i+1 into stage pipe_issue_stage(i)
//   issue(i+2)     planes of tile i+2 into buffer pipe_issue_bmp(i)
ZS_HD int pipe_compute_bmp(int i, int nbmp = kBmpBuffers) { return i % nbmp; }
ZS_HD int pipe_compute_stage(int i) { return i & 1; }
ZS_HD int pipe_counts_bmp(int i, int nbmp = kBmpBuffers) { return (i + 1) % nbmp; }
ZS_HD int pipe_issue_stage(int i) { return (i + 1) & 1; }
ZS_HD int pipe_issue_bmp(int i, int nbmp = kBmpBuffers) { return (i + 2) % nbmp; }

// Supported columns per block: 8 * NT8 for NT8 in {1, 2, 4, 8, 16}.
ZS_HD int tile_n_of(int nt8) { return 8 * nt8; }

// Bytes of one stage: four warps' value staging + X tile [tile_n][64] bf16.
ZS_HD int stage_bytes(int tile_n) {
  return kWarps * (kSmStageBytes + kFbStageElems * 2) + tile_n * kTile * 2;
}
// Dynamic shared memory of the fused kernel (fixed per tile_n: the staging
// is sized by the format's bound, so it never depends on the weight).
ZS_HD int fused_smem_bytes(int tile_n) { return kBmpBuffers * kBmpBytes + kStages * stage_bytes(tile_n); }
// Offsets inside the dynamic shared memory.
ZS_HD int smem_bmp(int buf) { return buf * kBmpBytes; }
ZS_HD int smem_stage(int tile_n, int stage) { return kBmpBuffers * kBmpBytes + stage * stage_bytes(tile_n); }
ZS_HD int stage_sm(int warp) { return warp * kSmStageBytes; }
ZS_HD int stage_fb(int warp) { return kWarps * kSmStageBytes + warp * kFbStageElems * 2; }
ZS_HD int stage_x(int /*tile_n*/) { return kWarps * (kSmStageBytes + kFbStageElems * 2); }

// Decompress kernel: one tile per block, one stage, and the decoded tile
// staged row-major with a pitch of 72 elements (144-byte rows: 16-byte aligned
// for the vector stores, and the lanes' 4-byte writes of one FT hit 32 banks).
constexpr int kOutPitch = kTile + 8;
ZS_HD int out_tile_index(int r, int c) { return r * kOutPitch + c; }
// Blocks of a one-tile-per-block launch over an M x K matrix (the decompress kernels), or 0 when M
// or K is not positive or the count does not fit a grid's x dimension (2^31 - 1).
ZS_HD int64_t tile_blocks(int M, int K) {
  if (M < 1 || K < 1) return 0;
  const int64_t g = static_cast<int64_t>((M + kTile - 1) / kTile) * ((K + kTile - 1) / kTile);
  return g > 0x7FFFFFFFLL ? 0 : g;
}
ZS_HD int decompress_smem_bytes() {
  return kBmpBytes + kWarps * (kSmStageBytes + kFbStageElems * 2) + kTile * kOutPitch * 2;
}

// ---------------------------------------------------------------- A side
// FT of the tile that feeds A register j (a0..a3) of warp w in K slice kg.
ZS_HD int a_frag_ft(int warp, int kg, int j) { return warp * kFtPerMed + kg * 4 + j; }

// Lane l's share of the medium-tile counts: it holds the popcounts of FTs
// l and l + 32; summed over the 32 lanes, `before` is the number of
// high-frequency elements in FTs < 16 w and `inside` those in FTs 16 w ..
// 16 w + 15.
ZS_HD void lane_count_share(int warp, int lane, int pc_lo, int pc_hi, int* before, int* inside) {
  const int lo = warp * kFtPerMed, hi = lo + kFtPerMed;
  const int f0 = lane, f1 = lane + 32;
  *before = (f0 < lo ? pc_lo : 0) + (f1 < lo ? pc_hi : 0);
  *inside = ((f0 >= lo && f0 < hi) ? pc_lo : 0) + ((f1 >= lo && f1 < hi) ? pc_hi : 0);
}

// Where warp w's value sub-segments lie and how it copies them.
struct WarpSegment {
  int64_t sm_begin;  // first global sm byte copied (16-aligned)
  int sm_chunks;     // 16-byte chunks copied
  int sm_local;      // staging index of the warp's first sm byte
  int64_t fb_begin;  // first global fb element copied (8-aligned)
  int fb_chunks;     // 16-byte (8-element) chunks copied
  int fb_local;      // staging index of the warp's first fb element
};

// hb: high-frequency elements of the tile before FT 16 w; hc: inside the
// warp's 16 FTs. The copied ranges stay inside the tile's segments
// [off_sm, off_sm + Hp) and [off_fb, off_fb + Fp): no over-read of the streams.
ZS_HD WarpSegment warp_segment(int64_t off_sm, int64_t off_fb, int warp, int hb, int hc) {
  WarpSegment s;
  const int64_t sm0 = off_sm + hb, sm1 = sm0 + hc;
  s.sm_begin = sm0 / kChunk * kChunk;
  s.sm_chunks = static_cast<int>((round_up(sm1, kChunk) - s.sm_begin) / kChunk);
  s.sm_local = static_cast<int>(sm0 - s.sm_begin);
  const int fb_before = warp * kMedElems - hb, fb_count = kMedElems - hc;
  const int64_t fb0 = off_fb + fb_before, fb1 = fb0 + fb_count;
  s.fb_begin = fb0 / 8 * 8;
  s.fb_chunks = static_cast<int>((round_up(fb1, 8) - s.fb_begin) / 8);
  s.fb_local = static_cast<int>(fb0 - s.fb_begin);
  return s;
}

// decode_lane_pair's h_before / f_before for the warp's i-th FT (0..15, in
// the kernel's order f = 16 w + i), hrun = high-frequency elements of FTs
// 16 w .. 16 w + i - 1.
ZS_HD int ft_sm_before(const WarpSegment& s, int hrun) { return s.sm_local + hrun; }
ZS_HD int ft_fb_before(const WarpSegment& s, int i, int hrun) { return s.fb_local + i * kFragElems - hrun; }

// ---------------------------------------------------------------- B side
// X tile in shared memory: row n (0..tile_n-1) holds k = 0..63 of token n;
// 16-byte chunk c of row n is stored at chunk c ^ (n % 8), so the 32-bit
// fragment loads of 8 rows hit 32 distinct banks. Index in bf16 elements.
ZS_HD int x_smem_index(int n, int k) { return n * kTile + (((k >> 3) ^ (n & 7)) << 3) + (k & 7); }

// X staging, chunk c (0 .. 8 tile_n - 1) of K tile kt for a block starting at
// column col0: it holds X[n][k0 .. k0 + 7] (zero where n >= N or k >= K) at
// shared index dst .. dst + 7. `vec`: the 16-byte cp.async path is allowed
// (whole chunk inside K and X 16-byte aligned with K % 8 == 0).
struct XChunk {
  int n, k0, dst;
  bool n_ok, vec;
};
ZS_HD XChunk x_chunk(int c, int col0, int kt, int N, int K, bool x_vec) {
  XChunk x;
  const int r = c >> 3, ch = c & 7;
  x.n = col0 + r;
  x.k0 = kt * kTile + ch * 8;
  x.dst = x_smem_index(r, ch * 8);
  x.n_ok = x.n < N;
  x.vec = x_vec && x.k0 + 8 <= K;
  return x;
}

// B fragment (k16 x n8, "col"): lane l, register r (b0, b1), half e holds
// k = 2 (l % 4) + e + 8 r of column n = l / 4.
ZS_HD int b_frag_k(int lane, int r, int e) { return 2 * (lane % 4) + e + 8 * r; }
ZS_HD int b_frag_n(int lane) { return lane / 4; }
// Shared-memory index of the 32-bit pair of B register r, n8 group t, K slice kg.
ZS_HD int b_frag_smem(int t, int kg, int lane, int r) {
  return x_smem_index(t * 8 + b_frag_n(lane), kg * 16 + b_frag_k(lane, r, 0));
}

// C fragment (m16 x n8, fp32): lane l, register r (c0..c3) holds row
// l / 4 + 8 (r / 2) (a W row in the medium tile) and column 2 (l % 4) + r % 2.
ZS_HD int c_frag_m(int lane, int r) { return lane / 4 + 8 * (r / 2); }
ZS_HD int c_frag_n(int lane, int r) { return 2 * (lane % 4) + (r % 2); }
// Output row (W row) and column (token) of C register r of n8 group t.
ZS_HD int c_out_m(int tm, int warp, int lane, int r) { return tm * kTile + warp * kMedRows + c_frag_m(lane, r); }
ZS_HD int c_out_n(int col0, int t, int lane, int r) { return col0 + t * 8 + c_frag_n(lane, r); }

// ---------------------------------------------------------------- split-K
// K tiles per split part and the number of non-empty parts.
ZS_HD int splitk_per(int kt, int split) { return (kt + split - 1) / split; }
ZS_HD int splitk_parts(int kt, int split) {
  const int per = splitk_per(kt, split);
  return (kt + per - 1) / per;
}
ZS_HD void splitk_range(int kt, int split, int part, int* begin, int* end) {
  const int per = splitk_per(kt, split);
  *begin = part * per;
  *end = (*begin + per < kt) ? *begin + per : kt;
}

// ---------------------------------------------------------------- epilogue
// Output element (n, m) of Y[N, M] (row-major, like F.linear).
ZS_HD int64_t y_index(int n, int m, int M) { return static_cast<int64_t>(n) * M + m; }
// Split-K workspace element of part p: ws[p][n][m].
ZS_HD int64_t ws_index(int part, int n, int m, int N, int M) {
  return (static_cast<int64_t>(part) * N + n) * M + m;
}

// fp32 -> bf16 bits, round to nearest even; NaN -> canonical 0x7FC0 (sign kept).
ZS_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(f);
#else
  __builtin_memcpy(&u, &f, 4);
#endif
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
ZS_HD float bf16_bits_to_f32(uint16_t b);

// Final value of one output element: the parts summed in order, then the bias
// (the fused kernel with one part and the reduction kernel both use this).
ZS_HD float epilogue_sum(const float* parts, int64_t stride, int nparts, const uint16_t* bias, int m) {
  float s = 0.f;
  for (int p = 0; p < nparts; ++p) s += parts[p * stride];
  if (bias) s += bf16_bits_to_f32(bias[m]);
  return s;
}

ZS_HD float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace gemm
}  // namespace zipserv
