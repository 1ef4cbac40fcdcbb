// Portable scalar fused decode-GEMM: the readable statement of the summation
// contract of zipserv/cpu_gemm.h, and the fallback on any CPU. Each 64 x 64
// tile is decoded (FORMAT.md section 5) into a small natural-order buffer and
// consumed at once.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "zipserv/cpu_gemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // SSE: part of every x86-64 CPU
#endif

namespace zipserv {
namespace cpu {
namespace {

// Decodes tile g into out[64][64] (row-major, tile coordinates). Returns false
// when its segments are malformed.
bool decode_tile(const Matrix& w, int64_t g, uint16_t* out) {
  const uint64_t* planes = w.bitmaps + g * kPlanes * kFragsPerTile;
  int64_t h = 0;
  for (int f = 0; f < kFragsPerTile; ++f) {
    h += __builtin_popcountll(planes[f] | planes[kFragsPerTile + f] | planes[2 * kFragsPerTile + f]);
  }
  if (!tile_ok(w, g, h)) return false;
  const uint8_t* sm = w.sm + w.offsets[2 * g];
  const uint16_t* fb = w.fb + w.offsets[2 * g + 1];
  const int base = w.base[g];
  for (int f = 0; f < kFragsPerTile; ++f) {
    const int r0 = frag_row0(f), c0 = frag_col0(f);
    for (int p = 0; p < kFragElems; ++p) {
      int code = 0;
      for (int b = 0; b < kPlanes; ++b) code |= static_cast<int>((planes[b * kFragsPerTile + f] >> p) & 1u) << b;
      out[(r0 + p / kFrag) * kTile + c0 + p % kFrag] = code ? assemble(*sm++, base, code) : *fb++;
    }
  }
  return true;
}

// The word at position p of FT f in a byte-split tile record t with table lut (cpu_layout.h),
// before the tile's exceptions.
inline uint16_t packed_word(const uint8_t* t, const uint8_t* lut, int f, int p) {
  const int code = (t[pk_code_byte(f, p)] >> (4 * pk_code_nibble(p))) & 15;
  return static_cast<uint16_t>(lut[code] << 8 | t[pk_lo_byte(f, p)]);
}

// Walks tile g's exception entries in order, patch(f, p, high byte) for each. Returns false at the
// first entry out of the tile or not ascending (the entries before it have been applied).
template <class Patch>
bool walk_exceptions(const Packed& w, int64_t g, Patch patch) {
  int64_t prev = -1;
  for (int64_t e = w.exc_start[g]; e < w.exc_start[g + 1]; ++e) {
    const int64_t d = w.exc[e] >> kPkExcShift;
    if (d <= prev || d >= kTileElems) return false;  // out of the tile, or not ascending
    prev = d;
    patch(static_cast<int>(d / kFragElems), static_cast<int>(d % kFragElems), static_cast<uint8_t>(w.exc[e] & 0xFFu));
  }
  return true;
}

// A word with its high byte replaced by an exception's.
inline uint16_t with_high(uint16_t v, uint8_t hi) { return static_cast<uint16_t>(hi << 8 | (v & 0xFFu)); }

// Decodes tile g of the byte-split layout (cpu_layout.h) into out[64][64].
// Returns false when its exception range or entries are malformed.
bool decode_tile(const Packed& w, int64_t g, uint16_t* out) {
  if (!packed_tile_ok(w, g)) return false;
  const uint8_t* t = w.tiles + g * kPkTileBytes;
  const uint8_t* lut = w.luts + g * kPkLutEntries;
  for (int f = 0; f < kFragsPerTile; ++f) {
    const int r0 = frag_row0(f), c0 = frag_col0(f);
    for (int p = 0; p < kFragElems; ++p) out[(r0 + p / kFrag) * kTile + c0 + p % kFrag] = packed_word(t, lut, f, p);
  }
  return walk_exceptions(w, g, [&](int f, int p, uint8_t hi) {
    uint16_t& v = out[(frag_row0(f) + p / kFrag) * kTile + frag_col0(f) + p % kFrag];
    v = with_high(v, hi);
  });
}

struct Scratch {
  std::vector<float> acc;  // [64 rows][n][4 lanes]
  uint16_t tile[kTileElems];
};

thread_local Scratch scratch;

// IEEE semantics (no FTZ/DAZ) whatever the caller set, as in the SIMD kernels:
// libm's fma may run on the hardware FMA unit, which obeys MXCSR.
struct CsrGuard {
#if defined(__x86_64__) || defined(__i386__)
  unsigned saved;
  CsrGuard() : saved(_mm_getcsr()) { _mm_setcsr(0x1F80); }
  ~CsrGuard() { _mm_setcsr(saved); }
#endif
};

template <class W>
void gemm_rows_t(const GemmJobT<W>& job, int64_t tm0, int64_t tm1) {
  CsrGuard csr;
  const W& w = job.w;
  const int64_t n = job.n;
  Scratch& s = scratch;
  try {
    s.acc.resize(static_cast<size_t>(kTile * n * 4));
  } catch (const std::bad_alloc&) {  // (no exception may leave the parallel region)
    job.oom->store(true);
    return;
  }
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    for (int64_t tk = 0; tk < w.kt; ++tk) {
      const int64_t g = tm * w.kt + tk;
      if (!decode_tile(w, g, s.tile)) {
        report_bad(job.bad_tile, g);
        return;
      }
      for (int r = 0; r < kTile; ++r) {
        for (int64_t t = 0; t < n; ++t) {
          float* a = &s.acc[(r * n + t) * 4];
          const float* x = job.x + t * job.kp + tk * kTile;
          for (int c = 0; c < kTile; ++c) {
            const int l = lane_of(c);
            a[l] = std::fma(bf16_to_float(s.tile[r * kTile + c]), x[c], a[l]);
          }
        }
      }
    }
    for (int r = 0; r < kTile; ++r) {
      const int64_t m = tm * kTile + r;
      if (m >= w.m) break;
      for (int64_t t = 0; t < n; ++t) job.y[t * w.m + m] = finish_output(&s.acc[(r * n + t) * 4], job.bias, m);
    }
  }
}

template <class W>
void decode_rows_t(const DecodeJobT<W>& job, int64_t tm0, int64_t tm1) {
  const W& w = job.w;
  Scratch& s = scratch;
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    for (int64_t tk = 0; tk < w.kt; ++tk) {
      const int64_t g = tm * w.kt + tk;
      if (!decode_tile(w, g, s.tile)) {
        report_bad(job.bad_tile, g);
        return;
      }
      for (int r = 0; r < kTile && tm * kTile + r < w.m; ++r) {
        const int64_t cols = std::min<int64_t>(kTile, w.k - tk * kTile);
        std::memcpy(job.out + (tm * kTile + r) * w.k + tk * kTile, s.tile + r * kTile, cols * 2);
      }
    }
  }
}

}  // namespace

int64_t decode_packed_row(const Packed& w, int64_t row, uint16_t* out) {
  const int64_t tm = row / kTile;
  const int rr = static_cast<int>(row % kTile);
  // the FTs holding tile row rr: f = 16 (rr / 16) + 2 j + (rr / 8) % 2 (columns 8 j .. 8 j + 7), its
  // positions p = 8 (rr % 8) + c
  const int f0 = (rr >> 4) * 16 + ((rr >> 3) & 1), p0 = (rr & 7) * kFrag;
  uint16_t seg[kTile];
  for (int64_t tk = 0; tk < w.kt; ++tk) {
    const int64_t g = tm * w.kt + tk;
    if (!packed_tile_ok(w, g)) return g;
    const uint8_t* t = w.tiles + g * kPkTileBytes;
    const uint8_t* lut = w.luts + g * kPkLutEntries;
    for (int j = 0; j < kTile / kFrag; ++j) {
      const int f = f0 + 2 * j;
      for (int c = 0; c < kFrag; ++c) seg[frag_col0(f) + c] = packed_word(t, lut, f, p0 + c);
    }
    // every entry of the tile checked, as decode_tile does; those of row rr applied
    const bool ok = walk_exceptions(w, g, [&](int f, int p, uint8_t hi) {
      if (frag_row0(f) + p / kFrag == rr) seg[frag_col0(f) + p % kFrag] = with_high(seg[frag_col0(f) + p % kFrag], hi);
    });
    if (!ok) return g;
    std::memcpy(out + tk * kTile, seg, static_cast<size_t>(std::min<int64_t>(kTile, w.k - tk * kTile)) * 2);
  }
  return -1;
}

Kernel scalar_kernel() {
  return {"scalar", gemm_rows_t<Matrix>, decode_rows_t<Matrix>, gemm_rows_t<Packed>, decode_rows_t<Packed>};
}

}  // namespace cpu
}  // namespace zipserv
