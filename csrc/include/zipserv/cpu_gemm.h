// Fused decode-GEMM on the CPU: Y[N, M] = X[N, K] . W[M, K]^T (+ bias) read
// straight from TCA-TBE v1 (docs/FORMAT.md), never materialising W.
//
// This header is shared by the per-ISA kernel files of csrc/cpu_gemm/. It has
// no framework types (arrays arrive as raw pointers from pybind11).
//
// The summation order is part of the contract, so that every ISA (scalar,
// AVX2, AVX-512) gives bit-identical results:
//   * X is widened to fp32 and zero-padded to Kp = 64 * Kt columns; W's
//     padding columns are finite (FORMAT.md section 1), so they add +0.
//   * Output (n, m) keeps 4 fp32 lanes; lane l accumulates the columns k with
//     k % 4 == l (k = l, l+4, l+8, ... < Kp), in increasing k,
//     acc = fma(w[m][k], x[n][k], acc), starting from +0. (This is the order
//     in which the SIMD kernels widen a register of 16 BF16 words, 8 columns
//     of two rows, to fp32: columns 0-3, then 4-7.)
//   * y = (lane0 + lane1) + (lane2 + lane3), then y = y + float(bias[m]),
//     then round-to-nearest-even to bf16 like torch (any NaN -> 0x7FC0).
//   * The kernels run with the default MXCSR (no FTZ/DAZ), set on entry.
#pragma once

#include <atomic>
#include <cstdint>

#include "zipserv/cpu_layout.h"
#include "zipserv/format.h"

namespace zipserv {
namespace cpu {

// One compressed matrix: the arrays of FORMAT.md section 6.
struct Matrix {
  const uint64_t* bitmaps;  // [Mt][Kt][3][64]
  const uint8_t* base;      // [Mt][Kt]
  const int64_t* offsets;   // [Mt][Kt][2]
  const uint8_t* sm;
  int64_t sm_len;
  const uint16_t* fb;
  int64_t fb_len;
  int64_t m, k, mt, kt;
};

// One matrix in the CPU byte-split layout (cpu_layout.h, FORMAT.md appendix A).
struct Packed {
  const uint8_t* tiles;      // [Mt][Kt][kPkTileBytes]
  const uint8_t* luts;       // [Mt][Kt][16]
  const int64_t* exc_start;  // [Mt * Kt + 1], exceptions of tile g: exc[exc_start[g] .. exc_start[g + 1])
  const uint32_t* exc;
  int64_t exc_len;
  int64_t m, k, mt, kt;
};

// One fast-mode GEMM y[n, m] = x[n, k] . W^T + bias on a byte-split weight, by
// address: the entry the torch op extension (zipserv_vllm._cpu_op,
// csrc/cpu_op/packed_gemm_op.cpp) reaches through the capsule _cpu_gemm.packed_call.
// The caller has checked every size and dtype (the Python path's checks); the
// entry never throws and never touches Python.
struct PackedCall {
  const uint8_t* tiles;
  const uint8_t* luts;
  const int64_t* exc_start;
  const uint32_t* exc;
  int64_t exc_len, m, k;
  const uint16_t* x;     // [n][k] bf16 bits, contiguous
  int64_t n;
  const uint16_t* bias;  // [m] or nullptr
  uint16_t* y;           // [n][m]
  int threads;
  bool panel;            // the AVX512-BF16 kernel, else the fp32 fused kernel at the best ISA
};
// kPackedCallDone when y is complete; anything else (a malformed tile's index, or
// kPackedCallFailed: out of memory, no AVX512-BF16) means y is not to be used and
// the caller runs the checked path, which raises the error.
constexpr int64_t kPackedCallDone = -1, kPackedCallFailed = -2;
using PackedCallFn = int64_t (*)(const PackedCall&);
// The capsule's name carries the struct's version: a stale build of either
// extension is refused by name (change the number with the struct).
constexpr const char* kPackedCallCapsule = "zipserv_vllm._cpu_gemm.packed_call/1";

// One MoE layer's routed experts for t tokens (what MoeLayer::run does, module.cpp), by
// address: the torch op extension's entry for zipserv::moe_experts, through the capsule
// _cpu_gemm.moe_call. The layer comes from MoeLayer.handle() (a capsule named
// kMoeLayerCapsule whose pointer is the MoeLayer; the caller keeps the Python object,
// and with it the experts' tensors, alive while it calls). The caller has checked every
// size and dtype (kernels/cpu.py moe_run's checks); the entry never throws and never
// touches Python.
struct MoeCall {
  const void* layer;      // the MoeLayer
  const uint16_t* x;      // [t][hidden] bf16 bits, contiguous
  int64_t t;
  const void* ids;        // [t][k] int32 (id_bytes 4) or int64 (8), contiguous
  int id_bytes;
  const float* weights;   // [t][k] fp32, contiguous
  int64_t k;
  uint16_t* out;          // [t][hidden] bf16 bits
  bool on_input;          // the weights scale x (apply_router_weight_on_input)
  int threads;
};
// kMoeCallDone when out is complete; kMoeCallFailed (an expert id out of range, a
// malformed tile, out of memory) means out is not to be used and the caller runs the
// checked path, which raises the error.
constexpr int64_t kMoeCallDone = 0, kMoeCallFailed = 1;
using MoeCallFn = int64_t (*)(const MoeCall&);
constexpr const char* kMoeCallCapsule = "zipserv_vllm._cpu_gemm.moe_call/1";
constexpr const char* kMoeLayerCapsule = "zipserv_vllm._cpu_gemm.MoeLayer/1";

// Rows of a byte-split embedding table (kernels/cpu.py packed_embedding), by address: the
// torch op extension's entry for zipserv::packed_embedding, through the capsule
// _cpu_gemm.embedding_call. y[i] = row ids[i] of W (ids clamped to [0, rows); rows m ..
// rows - 1 are zeros), bit for bit. The caller has checked the arrays' dtypes and
// shapes; the entry never throws and never touches Python.
struct EmbeddingCall {
  const uint8_t* tiles;
  const uint8_t* luts;
  const int64_t* exc_start;
  const uint32_t* exc;
  int64_t exc_len, m, k, rows;
  const int64_t* ids;  // [n], contiguous
  int64_t n;
  uint16_t* y;         // [n][k]
  int threads;
};
// kEmbeddingCallFailed (a malformed tile): y is not to be used; the caller
// runs the checked path, which raises the error.
constexpr int64_t kEmbeddingCallDone = 0, kEmbeddingCallFailed = 1;
using EmbeddingCallFn = int64_t (*)(const EmbeddingCall&);
constexpr const char* kEmbeddingCallCapsule = "zipserv_vllm._cpu_gemm.embedding_call/1";

// Lane of column k (the kernels' fp32 copy of x keeps natural column order).
inline int lane_of(int64_t k) { return static_cast<int>(k & 3); }

// One call of the fused GEMM (W: Matrix for v1, Packed for the byte-split layout).
template <class W>
struct GemmJobT {
  W w;
  const float* x;        // [n][kp] fp32, zero-padded
  int64_t n, kp;
  const uint16_t* bias;  // [m] bf16 bits or nullptr
  uint16_t* y;           // [n][m] bf16 bits
  std::atomic<int64_t>* bad_tile;  // first malformed tile index seen, else -1
  std::atomic<bool>* oom;  // set when a thread's scratch could not be allocated (this call's own flag)
};
using GemmJob = GemmJobT<Matrix>;
using PackedGemmJob = GemmJobT<Packed>;

// One call of the decode-only entry (tests the fused decode bit for bit).
template <class W>
struct DecodeJobT {
  W w;
  uint16_t* out;  // [m][k] bf16 bits
  std::atomic<int64_t>* bad_tile;
  std::atomic<bool>* oom;  // set when a thread's scratch could not be allocated (this call's own flag)
};
using DecodeJob = DecodeJobT<Matrix>;
using PackedDecodeJob = DecodeJobT<Packed>;

// A kernel processes tile rows [tm0, tm1). Scratch memory is thread-local.
using GemmRowsFn = void (*)(const GemmJob&, int64_t tm0, int64_t tm1);
using DecodeRowsFn = void (*)(const DecodeJob&, int64_t tm0, int64_t tm1);
using PackedGemmRowsFn = void (*)(const PackedGemmJob&, int64_t tm0, int64_t tm1);
using PackedDecodeRowsFn = void (*)(const PackedDecodeJob&, int64_t tm0, int64_t tm1);

// One call of the AVX512-BF16 kernel (kernel_avx512bf16.cpp): BF16 activations.
struct Bf16GemmJob {
  Packed w;
  const uint16_t* x;     // [n][kp] bf16 bits, zero-padded
  int64_t n, kp;
  const uint16_t* bias;  // [m] bf16 bits or nullptr
  uint16_t* y;           // [n][m] bf16 bits
  std::atomic<int64_t>* bad_tile;
  std::atomic<bool>* oom;  // set when a thread's scratch could not be allocated (y is then incomplete); never null
};
// Tile rows [tm0, tm1) of a job; `after` is the first record of what this thread computes next
// (another run's first tile, of this job or of another with the same K), prefetched while the last
// rows are multiplied, or nullptr (then the records past tm1 are, within the matrix).
using Bf16GemmRowsFn = void (*)(const Bf16GemmJob&, int64_t tm0, int64_t tm1, const uint8_t* after);
Bf16GemmRowsFn avx512bf16_gemm_rows();
bool avx512bf16_supported();

PackedDecodeRowsFn avx512bf16_decode_rows();  // the panel kernel's decode step alone (tests)
// act[r][i] = bf16(silu(h[r][i]) * h[r][inter + i]) for rows r0 .. r1 - 1 (fp32, vector exp; inter % 16 == 0)
void avx512bf16_silu_mul(const uint16_t* h, int64_t r0, int64_t r1, int64_t inter, uint16_t* act);

struct Kernel {
  const char* name;
  GemmRowsFn gemm_rows;
  DecodeRowsFn decode_rows;
  PackedGemmRowsFn packed_gemm_rows;
  PackedDecodeRowsFn packed_decode_rows;
};

Kernel scalar_kernel();

// Row `row` (< w.m) of a byte-split matrix into out[0 .. w.k), bit for bit (kernel_scalar.cpp): only
// the 8 FTs of each tile that hold the row are read, and every exception entry of each tile is
// checked as the decoders check them. Returns -1, or the first malformed tile. Portable code: a
// lookup reads a row per token, 1/8 of each tile (the embedding lookup's unit).
int64_t decode_packed_row(const Packed& w, int64_t row, uint16_t* out);

Kernel avx2_kernel();
Kernel avx512_kernel();
bool avx2_supported();
bool avx512_supported();

// Shared helpers -----------------------------------------------------------

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// torch's c10::BFloat16 rounding: RNE, every NaN becomes 0x7FC0.
inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t finish_output(const float lanes[4], const uint16_t* bias, int64_t m) {
  float y = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (bias) y = y + bf16_to_float(bias[m]);
  return float_to_bf16(y);
}

// Checks tile g's segments (FORMAT.md section 5) given its high count h.
inline bool tile_ok(const Matrix& w, int64_t g, int64_t h) {
  const int64_t off_sm = w.offsets[2 * g], off_fb = w.offsets[2 * g + 1];
  return off_sm % kSmAlign == 0 && off_fb % kFbAlign == 0 && off_sm >= 0 && off_fb >= 0 &&
         off_sm <= w.sm_len - sm_segment_len(h) && off_fb <= w.fb_len - fb_segment_len(h);
}

// Checks tile g's exception range (the entries themselves are checked as the
// kernels consume them: every one must belong to the tile, in order).
inline bool packed_tile_ok(const Packed& w, int64_t g) {
  const int64_t a = w.exc_start[g], b = w.exc_start[g + 1];
  return a >= 0 && a <= b && b <= w.exc_len;
}

inline void report_bad(std::atomic<int64_t>* bad, int64_t g) {
  int64_t cur = bad->load();
  while ((cur < 0 || g < cur) && !bad->compare_exchange_weak(cur, g)) {
  }
}

// Runs fn(tm0, tm1) over [0, items) on `threads` OpenMP threads (torch's own
// team; the caller is one of them; parallel.cpp). Items are handed out
// dynamically; every item is computed entirely by one thread, so results do
// not depend on `threads`.
void parallel_for(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx);
// The same for any callable body(tm0, tm1).
template <class Body>
void parallel_for(int64_t items, int threads, Body& body) {
  parallel_for(items, threads, [](void* c, int64_t a, int64_t b) { (*static_cast<Body*>(c))(a, b); }, &body);
}

// Runs fn(ctx, item, next) for every item of [0, items) on `threads` OpenMP threads: the first
// items dealt out (thread t: items 2t and 2t + 1, or item t with fewer than two items per
// thread), and each thread claims its next item before it runs the current one, so that
// next (-1: none) is the item the same thread runs afterwards and the current one can prefetch its
// data. Unlike parallel_for's (a, b), the callback's arguments are an item and its successor.
void parallel_claims(int64_t items, int threads, void (*fn)(void*, int64_t, int64_t), void* ctx);

// The same for any callable body(item, next).
template <class Body>
void parallel_claims(int64_t items, int threads, Body& body) {
  parallel_claims(items, threads, [](void* c, int64_t i, int64_t next) { (*static_cast<Body*>(c))(i, next); }, &body);
}

// Registers the fork handler parallel_for and parallel_claims rely on (called at module import).
void install_fork_guard();

}  // namespace cpu
}  // namespace zipserv
