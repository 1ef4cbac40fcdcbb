// Host-side entry points of the CUDA kernels (implemented in csrc/cuda/*.cu,
// called from csrc/cuda/bindings.cpp). Plain C++: pointers, sizes and the
// stream come from Python, so the extension links cudart only and has no
// torch C++ ABI. Every function returns a cudaError_t as int (0 = success).
#pragma once

#include <cstdint>

#include "gather_layout.cuh"

namespace zipserv {
namespace cuda {

// Y[N, M] = X[N, K] . W[M, K]^T (+ bias), W in TCA-TBE v1.
struct GemmArgs {
  const uint64_t* bitmaps;  // [Mt, Kt, 3, 64]
  const uint8_t* base;      // [Mt, Kt]
  const int64_t* offsets;   // [Mt, Kt, 2]
  const uint8_t* sm;        // sign-mantissa stream (16-byte aligned)
  const uint16_t* fb;       // fallback stream (16-byte aligned)
  const uint16_t* x;        // bf16 [N, K], row-major, contiguous
  const uint16_t* bias;     // bf16 [M] or nullptr
  uint16_t* y;              // bf16 [N, M]
  float* ws;                // fp32 [split, N, M] when split > 1
  int M, K, N;
  int split;                // K parts (already reduced to the non-empty count)
  int x_vec;                // 1 when K % 8 == 0 and x is 16-byte aligned
};

// Grouped fused ZipGEMM over the experts of a mixture-of-experts layer: for every expert e,
// Y[r, M] = X[r, K] . W_e[M, K]^T over its rows r = expert_rows[e] .. expert_rows[e + 1] - 1
// (X rows grouped by expert, as the router's sort gives them). No bias, no split-K.
constexpr int kGroupedPtrs = 5;  // per expert: bitmaps, base, offsets, sm, fb (device addresses)
struct GroupedGemmArgs {
  const uint64_t* weights;      // [E, kGroupedPtrs] addresses of each expert's five arrays
  const int32_t* expert_rows;   // [E + 1] row starts, non-decreasing, expert_rows[E] == rows
  const uint16_t* x;            // bf16 [rows, K], row-major, contiguous
  uint16_t* y;                  // bf16 [rows, M]
  int M, K, E, rows;
  int x_vec;                    // 1 when K % 8 == 0 and x is 16-byte aligned
};

// Y[N, M] = X[N, K] . W[M, K]^T (+ bias), W in the byte-split layout (docs/FORMAT.md appendix A):
// g carries X, bias, Y, the split-K workspace and the sizes (its TCA-TBE pointers are unused).
struct PackedGemmArgs {
  const uint8_t* tiles;       // [Mt, Kt, 6144] tile records (16-byte aligned)
  const uint8_t* luts;        // [Mt, Kt, 16] tables of high bytes (16-byte aligned)
  const int64_t* exc_start;   // [G + 1]
  const int32_t* exc;         // [E] d << 8 | high byte, ascending d per tile
  GemmArgs g;
};

// W (row-major bf16 [M, K]) from the byte-split layout (the arrays of PackedGemmArgs).
struct PackedDecompressArgs {
  const uint8_t* tiles;
  const uint8_t* luts;
  const int64_t* exc_start;
  const int32_t* exc;
  uint16_t* out;            // bf16 [M, K]
  int M, K;
};

struct DecompressArgs {
  const uint64_t* bitmaps;
  const uint8_t* base;
  const int64_t* offsets;
  const uint8_t* sm;
  const uint16_t* fb;
  uint16_t* out;            // bf16 [M, K]
  int M, K;
};

struct EncodeArgs {
  const uint16_t* w;        // bf16 bits [M, K]
  int M, K;
  int tm0, tm_count;        // tile rows [tm0, tm0 + tm_count) in this call
  uint64_t* bitmaps;        // [tm_count * Kt, 3, 64]
  uint8_t* base;            // [tm_count * Kt]
  int64_t* hcount;          // [tm_count * Kt]  H of each tile
  uint8_t* scratch_sm;      // [tm_count * Kt, 4096]
  uint16_t* scratch_fb;     // [tm_count * Kt, 4096]
};

struct ScatterArgs {
  const int64_t* hcount;    // [G]
  const int64_t* offsets;   // [G, 2] segment starts (already computed)
  const uint8_t* scratch_sm;
  const uint16_t* scratch_fb;
  uint8_t* sm;              // zero-initialised streams
  uint16_t* fb;
  int64_t G;
};

int zipgemm(const GemmArgs& a, int tile_n, uintptr_t stream);
int zipgemm_grouped(const GroupedGemmArgs& g, int tile_n, uintptr_t stream);
// tile_n 8 or 16 (the decode sizes); split-K reduced as zipgemm's.
int zipgemm_packed(const PackedGemmArgs& p, int tile_n, uintptr_t stream);
int decompress(const DecompressArgs& a, uintptr_t stream);
int decompress_packed(const PackedDecompressArgs& a, uintptr_t stream);
int encode_tiles(const EncodeArgs& a, uintptr_t stream);
int encode_scatter(const ScatterArgs& a, uintptr_t stream);
// Sets the dynamic shared-memory attribute of every fused instance on the
// current device and loads every kernel the GEMM paths launch (once per
// device, before any launch or graph capture: with lazy module loading a
// first launch inside a capture would load a module during capture).
int prepare_current_device();
int decompress_preload();
// zipserv::embedding: rows of a compressed table (gather_layout.cuh).
int embedding_gather(const zipserv::gather::GatherArgs& a, uintptr_t stream);
int embedding_preload();
const char* error_string(int err);

}  // namespace cuda
}  // namespace zipserv
