// The embedding gather of zipserv::embedding on a GPU: rows of a compressed
// table decoded straight from the stored tiles, one block per (id, K tile),
// one thread per column of the tile. No host synchronisation, no allocation
// but the output, so it runs inside CUDA-graph capture.
//
// The block body is written as three phases separated by barriers, as
// __host__ __device__ functions: the kernel (csrc/cuda/embedding.cu) runs them
// with __syncthreads() between; the SIMT harness (csrc/simt/) runs that kernel
// on the CPU, so the code the GPU executes is the code the CPU tests execute.
//
//   load   thread t fetches the three bit-plane words of FT t and counts its
//          high-frequency elements
//   scan   thread 0 turns the 64 counts into exclusive prefix sums
//   decode thread t decodes element (r, t) of the tile, r = id % 64
//          (docs/FORMAT.md sections 2 and 5), or writes 0 for a padding row
//
// Ids are clamped to [0, rows); rows M .. rows - 1 are vLLM's vocabulary
// padding and read zeros. Segment offsets must have been validated against
// the streams (kernels/cuda.py does it once per tensor, before any capture).
#pragma once

#include <cstdint>

#include "zipserv/decode_lane.h"
#include "zipserv/format.h"

namespace zipserv {
namespace gather {

constexpr int kThreads = kTile;  // one thread per tile column

struct GatherArgs {
  const void* ids;          // int32 or int64 [n]
  int ids_int64;            // 1: int64 ids
  int64_t n;
  const uint64_t* bitmaps;  // [Mt, Kt, 3, 64]
  const uint8_t* base;      // [Mt, Kt]
  const int64_t* offsets;   // [Mt, Kt, 2]
  const uint8_t* sm;
  const uint16_t* fb;
  uint16_t* out;            // bf16 [n, K]
  int M, K;
  int64_t rows;             // the table's rows including vLLM's padding (>= M)
};

struct Shared {
  uint64_t planes[kPlanes * kFragsPerTile];
  int before[kFragsPerTile];  // high-frequency elements of the tile before FT f
};

// The clamped row of id i.
ZS_HD int64_t gather_row(const GatherArgs& a, int64_t i) {
  int64_t id = a.ids_int64 ? static_cast<const int64_t*>(a.ids)[i] : static_cast<const int32_t*>(a.ids)[i];
  if (id < 0) id = 0;
  if (id >= a.rows) id = a.rows - 1;
  return id;
}

// Tile index g of (row, tk), or -1 for a padding row.
ZS_HD int64_t gather_tile(const GatherArgs& a, int64_t row, int tk) {
  if (row >= a.M) return -1;
  const int64_t kt = tile_count(a.K);
  return (row / kTile) * kt + tk;
}

ZS_HD void gather_load(const GatherArgs& a, int64_t g, int t, Shared& s) {
  if (g < 0) return;
  const uint64_t* p = a.bitmaps + g * (kPlanes * kFragsPerTile);
  const uint64_t p0 = p[t], p1 = p[kFragsPerTile + t], p2 = p[2 * kFragsPerTile + t];
  s.planes[t] = p0;
  s.planes[kFragsPerTile + t] = p1;
  s.planes[2 * kFragsPerTile + t] = p2;
  s.before[t] = popc64(indicator(p0, p1, p2));
}

ZS_HD void gather_scan(int64_t g, Shared& s) {
  if (g < 0) return;
  int run = 0;
  for (int f = 0; f < kFragsPerTile; ++f) {
    const int c = s.before[f];
    s.before[f] = run;
    run += c;
  }
}

// FT f and position p of element (r, c) of a tile (docs/FORMAT.md section 2).
ZS_HD void element_ft(int r, int c, int* f, int* p) {
  const int j = (r % 16) / 8 + 2 * ((c % 16) / 8);
  *f = (r / 16) * 16 + (c / 16) * 4 + j;
  *p = (r % 8) * 8 + (c % 8);
}

ZS_HD void gather_decode(const GatherArgs& a, int64_t i, int64_t row, int64_t g, int tk, int t, const Shared& s) {
  const int col = tk * kTile + t;
  if (col >= a.K) return;
  uint16_t v = 0;
  if (g >= 0) {
    int f, p;
    element_ft(static_cast<int>(row % kTile), t, &f, &p);
    const uint64_t p0 = s.planes[f], p1 = s.planes[kFragsPerTile + f], p2 = s.planes[2 * kFragsPerTile + f];
    const uint64_t ind = indicator(p0, p1, p2);
    const int hb = popc64(ind & ((uint64_t{1} << p) - 1u));
    const int hi = s.before[f] + hb;
    if ((ind >> p) & 1u) {
      v = assemble(a.sm[a.offsets[2 * g] + hi], a.base[g], static_cast<int>(code_at(p0, p1, p2, p)));
    } else {
      v = a.fb[a.offsets[2 * g + 1] + f * kFragElems + p - hi];
    }
  }
  a.out[i * a.K + col] = v;
}

}  // namespace gather
}  // namespace zipserv
