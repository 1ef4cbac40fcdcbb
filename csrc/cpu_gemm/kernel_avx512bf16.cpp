// AVX512-BF16 (vdpbf16ps) GEMM from the CPU byte-split layout: the fast
// kernel of CPUs with BF16 dot products (Zen 4 and later, Cooper Lake,
// Sapphire Rapids and later). Compiled for that ISA through a target pragma
// limited to this file; chosen only when the CPU reports every feature
// (avx512bf16_supported()) and the dispatcher picks it (kernels/cpu_dispatch.py).
//
// Buffered path (more than kStreamMaxN tokens). A thread's tile rows (64 weight
// rows = 4 panels of 16 rows, each one medium tile row) are walked as one
// sequence of chunks: 8 tiles (512 columns) below kWideMinN = 48 tokens,
// 32 tiles (2048 columns) from there on.
//   1. decode: every FT of a chunk is rebuilt in 512-bit registers (low bytes
//      loaded, 4-bit codes through the tile's table by one vpshufb, bytes
//      interleaved into words) and stored to one half of a per-thread double
//      buffer (64 rows x the chunk's columns of BF16: 64 or 256 KiB per half),
//      the tile's exceptions patched in once the chunk is whole. Only a work
//      item's first chunk is decoded on its own: chunk q + 1 is decoded while
//      chunk q is multiplied, kDecodeStep groups at a time between the dot
//      products, and chunk q + 2's records are prefetched into L2 meanwhile.
//      Each weight is decoded once per call, whatever the number of tokens.
//   2. multiply: tokens in register blocks of up to 6; for every 8 columns, 4
//      panel vectors (16 rows x 8 columns) and one 128-bit broadcast of each
//      token's 8 activations feed 4 vdpbf16ps per token, into fp32
//      accumulators kept per thread across the chunks of a row
//      ([4 panels][n][64]). Accumulator lane (row, column pair c) sums the
//      products of columns 2c, 2c + 1 of every 8-column group in increasing k.
//      Narrow chunks: panels outside, token blocks inside; wide chunks: token
//      blocks outside (fewer accumulator loads and stores per dot product).
//   3. y = the 4 lanes of a row summed ((l0 + l1) + (l2 + l3)), + bias, RNE to
//      bf16 (any NaN -> 0x7FC0).
// Measured (2-core Zen 4, cache-cold weights; the previous build and this one
// loaded side by side in one process, calls alternating, then the roles of the
// two module copies swapped; docs/CPU.md): 1.0-1.03x from 24 to 512 tokens on
// 11008x4096 and 4096x4096, 0.97-1.02x on 4096x11008.
//
// Numerics (docs/CPU.md, "Numerical bounds"): vdpbf16ps multiplies BF16
// pairs exactly in fp32 and adds them to the accumulator with round to
// nearest even, treating denormal inputs and outputs as zero (whatever MXCSR
// says). This is not the fp32 kernels' summation order, so the results are
// not bit-identical to theirs: it is a fast-mode kernel, and exact mode never
// runs it.
//
// With at most kStreamMaxN = 18 tokens the chunk buffer is skipped
// (stream_gemm_rows below): each FT is decoded into registers and consumed at
// once by a block of up to 6 tokens, the decode repeated per block (at 7 and
// 8 tokens two half-panel passes instead, each FT decoded once: stream_half),
// in chunks of kChunk = 8 tiles.
//
// The chunk buffer is also the seam for other multipliers (an AMX BF16 tile
// kernel would read the same panels).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "zipserv/cpu_gemm.h"

#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,bmi,bmi2,popcnt")

namespace zipserv {
namespace cpu {
namespace {

constexpr int kPanelRows = 16;                    // a medium tile row
constexpr int kMediumWords = 16 * kFragElems;     // 16 FTs of a medium tile
constexpr int kMaxNb = 6;                         // tokens per register block
constexpr int kPfLinesPerGroup = kPkTileBytes / 4 / 8 / 64;  // record lines prefetched per 8-column group: a chunk per 4 panel passes (3)

// Per-thread buffer of T, grown on demand (never freed while the thread lives). get() returns
// nullptr when out of memory: the caller sets its job's oom flag and returns (no exception may
// leave an OpenMP region); each call has a flag of its own, so concurrent calls (the GIL is
// released) never see each other's failure.
template <class T>
struct ThreadBuf {
  T* p = nullptr;
  size_t cap = 0;
  ~ThreadBuf() { std::free(p); }
  T* get(size_t count) {
    if (count > cap) {
      std::free(p);
      p = static_cast<T*>(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64));
      if (p == nullptr) {
        cap = 0;
        return nullptr;
      }
      cap = count;
    }
    return p;
  }
};
thread_local ThreadBuf<uint16_t> panel_buf;  // decoded panels (BF16)
thread_local ThreadBuf<float> acc_buf;       // both paths' accumulators [4 panels][n][4][16]

// Word index, inside its FT's 64 buffer words, of FT position p = 8 r + c:
// vector v = r & 1 (rows 0, 2, 4, 6 / 1, 3, 5, 7), its 128-bit lane r >> 1.
inline int ft_word(int p) { return ((p >> 3) & 1) * 32 + (p >> 4) * 8 + (p & 7); }

// ft_words' constants: the code bytes' nibble shift per 64-bit lane, the nibble mask.
inline __m512i ft_shifts() { return _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4); }
inline __m512i ft_nib() { return _mm512_set1_epi8(0x0F); }

// A tile's 16-entry table (at t) in every 128-bit lane.
inline __m512i lut_at(const uint8_t* t) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}

// One FT record (96 bytes) -> its 64 words in two registers: the low bytes
// loaded, the code bytes [c0 | c1] (16 each) spread to lanes [c0 | c0 | c1 | c1],
// the low / high nibble per lane (positions 0-15, 16-31, 32-47, 48-63) looked
// up in the tile's table, bytes interleaved into words. shifts and nib are
// ft_shifts() and ft_nib(), passed in so that callers keep them in registers.
inline void ft_words(const uint8_t* r, __m512i lut, __m512i shifts, __m512i nib, __m512i& w0, __m512i& w1) {
  const __m512i lo = _mm512_loadu_si512(r);
  const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kPkLoBytes)));
  const __m512i codes = _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(c, c, 0x50), shifts), nib);
  const __m512i hi = _mm512_shuffle_epi8(lut, codes);
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// One FT record -> its 64 words at dst (two 512-bit stores); shifts and nib as for ft_words.
__attribute__((always_inline)) inline void decode_ft(const uint8_t* r, __m512i lut, __m512i shifts, __m512i nib,
                                                    uint16_t* dst) {
  __m512i w0, w1;
  ft_words(r, lut, shifts, nib, w0, w1);
  _mm512_store_si512(dst, w0);
  _mm512_store_si512(dst + 32, w1);
}

// The next chunk's decode, spread over the multiply of the current one (buffered
// path): FTs [next, end) of a chunk of tn tiles whose records start at rec, FT f
// (tile f >> 6, position p = f & 63 in it: medium tile p >> 4, FT p & 15) going to
// dst + ((p >> 4) * tn + (f >> 6)) * kMediumWords + (p & 15) * kFragElems, the
// buffer layout of decode_tiles. Exceptions are patched once the chunk is whole.
struct ChunkDecode {
  const uint8_t* rec = nullptr;   // the chunk's first record (its tiles are consecutive)
  const uint8_t* luts = nullptr;  // the chunk's first tile's table
  uint16_t* dst = nullptr;
  int64_t tn = 0, next = 0, end = 0;
};

__attribute__((always_inline)) inline void decode_chunk_ft(const ChunkDecode& d, int64_t f, __m512i shifts,
                                                          __m512i nib) {
  const int64_t tc = f >> 6, p = f & 63;
  decode_ft(d.rec + f * kPkFtBytes, lut_at(d.luts + tc * kPkLutEntries), shifts, nib,
            d.dst + ((p >> 4) * d.tn + tc) * kMediumWords + (p & 15) * kFragElems);
}

// FTs dec.next .. stop - 1 (decode_chunk_ft), dec.next advanced to stop.
__attribute__((always_inline)) inline void decode_chunk_until(ChunkDecode& dec, int64_t stop) {
  const __m512i shifts = ft_shifts(), nib = ft_nib();
  const ChunkDecode d = dec;
  for (int64_t f = d.next; f < stop; ++f) decode_chunk_ft(d, f, shifts, nib);
  if (stop > dec.next) dec.next = stop;
}

// The buffered path (more than kStreamMaxN tokens) in chunks of tiles whose width and loop order
// depend on the token count, the next chunk decoded kDecodeStep groups at a time between the dot
// products. Below kWideMinN tokens, chunks of kChunk = 8 tiles, panels outside and token blocks
// inside (a 16 KiB panel stays in L1 for all the blocks); from kWideMinN on, chunks of
// kWideChunk = 32 tiles (2048 columns), token blocks outside (a panel_block call runs 256 groups,
// so its 24 accumulators' loads and stores weigh 4x less). Measured side by side (2-core Zen 4,
// 4096x4096 and 11008x4096, against 8-tile chunks decoded in a step of their own, panels outside;
// docs/CPU.md): 8-tile interleaved 1.0-1.04x at 24-32 tokens, 0.98-1.0x at 64-128; 32-tile
// 1.0-1.04x at 64-128, 1.02-1.04x at 512, 0.95-1.0x at 24-32.
constexpr int64_t kWideMinN = 48, kWideChunk = 32;
constexpr int64_t kHalfSkew = 33 * 32;  // words (33 cache lines) between the double buffer's halves
constexpr int64_t kDecodeStep = 8;
static_assert(kFragsPerTile == 64, "decode_chunk_ft: FT f of a chunk is FT f & 63 of its tile f >> 6");
constexpr int64_t kChunk = 8;  // tiles per step of the streaming path and the narrow buffered path: 48 KiB of records

// NB tokens x the panel: acc[t][j] over all 8-column groups, S independent
// accumulator sets (2 when there are few tokens, to hide the dot-product latency),
// starting from out's sums or, for a row's first chunk (zero), from 0.
// With dec, FTs dec.next .. dec.end - 1 of the next chunk are decoded along the
// way, evenly over the groups (their shuffles and stores issue beside the dot
// products instead of in a phase of their own).
template <int NB, int S>
void panel_block(const uint16_t* buf, int64_t groups, const uint16_t* x, int64_t kp, const char* pf, float* out,
                 ChunkDecode* dec, bool zero) {
  __m512 acc[S][NB][4];
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 6
    for (int t = 0; t < NB; ++t)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[s][t][j] = s == 0 && !zero ? _mm512_load_ps(out + (t * 4 + j) * 16) : _mm512_setzero_ps();
  const int64_t f0 = dec ? dec->next : 0, quota = dec ? dec->end - f0 : 0;
  const int64_t whole = groups - groups % S;
  int64_t g = 0;
  while (g < whole) {
    // kDecodeStep groups of dot products, then this stretch's share of the decode
    const int64_t stop = std::min<int64_t>(whole, g + kDecodeStep);
    for (; g < stop; g += S) {
      if (pf) {
#pragma GCC unroll 6
        for (int i = 0; i < S * kPfLinesPerGroup; ++i) _mm_prefetch(pf + (g * kPfLinesPerGroup + i) * 64, _MM_HINT_T1);
      }
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        const uint16_t* w = buf + (g + s) * 128;
        const __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + 32);
        const __m512bh w2 = (__m512bh)_mm512_load_si512(w + 64), w3 = (__m512bh)_mm512_load_si512(w + 96);
#pragma GCC unroll 6
        for (int t = 0; t < NB; ++t) {
          const __m512bh xb = (__m512bh)_mm512_broadcast_i32x4(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + t * kp + (g + s) * 8)));
          acc[s][t][0] = _mm512_dpbf16_ps(acc[s][t][0], w0, xb);
          acc[s][t][1] = _mm512_dpbf16_ps(acc[s][t][1], w1, xb);
          acc[s][t][2] = _mm512_dpbf16_ps(acc[s][t][2], w2, xb);
          acc[s][t][3] = _mm512_dpbf16_ps(acc[s][t][3], w3, xb);
        }
      }
    }
    if (quota) decode_chunk_until(*dec, f0 + quota * g / whole);
  }
  if (dec) decode_chunk_until(*dec, dec->end);  // (whole == 0: fewer groups than S; never, as a tile has 8)
  for (; g < groups; ++g) {  // (S = 2 and an odd number of groups)
    const uint16_t* w = buf + g * 128;
    for (int t = 0; t < NB; ++t) {
      const __m512bh xb =
          (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + t * kp + g * 8)));
      for (int j = 0; j < 4; ++j)
        acc[0][t][j] = _mm512_dpbf16_ps(acc[0][t][j], (__m512bh)_mm512_load_si512(w + 32 * j), xb);
    }
  }
#pragma GCC unroll 6
  for (int t = 0; t < NB; ++t)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512 a = acc[0][t][j];
      if (S == 2) a = _mm512_add_ps(a, acc[S - 1][t][j]);
      _mm512_store_ps(out + (t * 4 + j) * 16, a);
    }
}

void panel_tokens(const uint16_t* buf, int64_t groups, const uint16_t* x, int64_t kp, int64_t nb, const char* pf,
                  float* out, ChunkDecode* dec, bool zero) {
  switch (nb) {
    case 1: panel_block<1, 2>(buf, groups, x, kp, pf, out, dec, zero); break;
    case 2: panel_block<2, 2>(buf, groups, x, kp, pf, out, dec, zero); break;
    case 3: panel_block<3, 2>(buf, groups, x, kp, pf, out, dec, zero); break;
    case 4: panel_block<4, 1>(buf, groups, x, kp, pf, out, dec, zero); break;
    case 5: panel_block<5, 1>(buf, groups, x, kp, pf, out, dec, zero); break;
    default: panel_block<6, 1>(buf, groups, x, kp, pf, out, dec, zero); break;
  }
}

// The first of tiles g0 .. g1 - 1 whose exception range is malformed, or -1.
int64_t first_bad_range(const Packed& w, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    if (!packed_tile_ok(w, g)) return g;
  return -1;
}

// A tile's exception list as it is walked: the next entry, the list's end, the last position seen,
// whether the entries so far ascend.
struct TileExc {
  const uint32_t* e;
  const uint32_t* end;
  int64_t prev = -1;
  bool ordered = true;
  TileExc(const Packed& w, int64_t g) : e(w.exc + w.exc_start[g]), end(w.exc + w.exc_start[g + 1]) {}
  // whether the next entry belongs to medium tile mm (d >> 10 == mm)
  bool in_medium(int mm) const { return e < end && static_cast<int>(*e >> (kPkExcShift + 10)) == mm; }
  // every entry belonged to the tile (d < 4096), in ascending order
  bool ok() const { return ordered && e == end; }
};

// Applies the exceptions of medium tile mm (decoded at dst), advancing x past them.
inline void patch_medium(int mm, uint16_t* dst, TileExc& x) {
  uint8_t* b = reinterpret_cast<uint8_t*>(dst);
  for (; x.in_medium(mm); ++x.e) {
    const int64_t d = *x.e >> kPkExcShift;
    x.ordered &= d > x.prev;
    x.prev = d;
    b[2 * (((d >> 6) & 15) * kFragElems + ft_word(static_cast<int>(d & 63))) + 1] = static_cast<uint8_t>(*x.e);
  }
}

// Decodes medium tile mm of tile g (16 FTs) into dst and applies its exceptions (patch_medium).
inline void decode_medium(const Packed& w, int64_t g, int mm, __m512i lut, uint16_t* dst, TileExc& x) {
  const uint8_t* ft = w.tiles + g * kPkTileBytes + mm * 16 * kPkFtBytes;
#pragma GCC unroll 4
  for (int fi = 0; fi < 16; ++fi) decode_ft(ft + fi * kPkFtBytes, lut, ft_shifts(), ft_nib(), dst + fi * kFragElems);
  patch_medium(mm, dst, x);
}

inline __m512i tile_lut(const Packed& w, int64_t g) { return lut_at(w.luts + g * kPkLutEntries); }

// The exceptions of tiles g0 .. g0 + tn - 1, whose FTs are decoded in buf (decode_tiles' layout),
// applied. Returns the first tile whose list is malformed, or -1.
int64_t patch_tiles(const Packed& w, int64_t g0, int64_t tn, uint16_t* buf) {
  for (int64_t tc = 0; tc < tn; ++tc) {
    TileExc x(w, g0 + tc);
    for (int mm = 0; mm < 4; ++mm) patch_medium(mm, buf + (mm * tn + tc) * kMediumWords, x);
    if (!x.ok()) return g0 + tc;
  }
  return -1;
}

// Step 1 for tiles g0 .. g0 + tn - 1 of one tile row, in one go: checks their ranges, decodes
// them (a sequential walk of their records, medium tile mm of tile g0 + tc into panel mm at
// buf + (mm * tn + tc) * kMediumWords: decode_chunk_ft's layout) and patches their exceptions.
// Returns the first malformed tile, or -1.
int64_t decode_tiles(const Packed& w, int64_t g0, int64_t tn, uint16_t* buf) {
  const int64_t bad_range = first_bad_range(w, g0, g0 + tn);
  if (bad_range >= 0) return bad_range;
  ChunkDecode d;
  d.rec = w.tiles + g0 * kPkTileBytes;
  d.luts = w.luts + g0 * kPkLutEntries;
  d.dst = buf;
  d.tn = tn;
  decode_chunk_until(d, tn * kFragsPerTile);
  return patch_tiles(w, g0, tn, buf);
}

// Step 3 for the n tokens of the panel whose first row is row0: part holds
// [n][4 vectors][16 lanes]; lane l of vector j is row (j >> 1) * 8 + 2 (l >> 2)
// + (j & 1), column pair l & 3. Per row (l0 + l1) + (l2 + l3) of its four
// lanes, + bias, RNE to bf16 (any NaN -> 0x7FC0): finish_output's arithmetic
// in the same order (fp32 addition is commutative, so a + b and b + a agree),
// 16 rows per vector.
// Tokens t0 .. t0 + n - 1 when t0 is given (part then holds theirs only).
void finish_panel(const Bf16GemmJob& job, const float* part, int64_t n, int64_t row0, int64_t t0 = 0) {
  const int64_t m = job.w.m;
  const int64_t live = std::min<int64_t>(kPanelRows, m - row0);
  if (live <= 0) return;
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1u);
  // after the sums, 128-bit lane q holds rows 2q, 2q + 1, 8 + 2q, 9 + 2q: output row o's position
  const __m512i order = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m512 bias = _mm512_setzero_ps();
  if (job.bias)
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, job.bias + row0)), 16));
  const __m512i round_bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7FC0);
  for (int64_t t = 0; t < n; ++t) {
    const float* a = part + t * 64;
    __m512 r[2];
    for (int h = 0; h < 2; ++h) {  // vectors 2h (rows of even index) and 2h + 1 (odd)
      const __m512 v0 = _mm512_load_ps(a + 32 * h), v1 = _mm512_load_ps(a + 32 * h + 16);
      const __m512 lo = _mm512_unpacklo_ps(v0, v1);  // [v0.l0, v1.l0, v0.l1, v1.l1] per 128-bit lane
      const __m512 hi = _mm512_unpackhi_ps(v0, v1);  // [v0.l2, v1.l2, v0.l3, v1.l3]
      const __m512 p = _mm512_add_ps(lo, _mm512_permute_ps(lo, 0x4E));  // [l0 + l1 of v0, of v1, (same)]
      const __m512 q = _mm512_add_ps(hi, _mm512_permute_ps(hi, 0x4E));  // [l2 + l3 of v0, of v1, (same)]
      r[h] = _mm512_add_ps(p, q);
    }
    // [r0 row 2q, r0 row 2q + 1, r1 row 8 + 2q, r1 row 9 + 2q] per 128-bit lane, then rows in order
    __m512 y = _mm512_permutexvar_ps(order, _mm512_shuffle_ps(r[0], r[1], 0x44));
    if (job.bias) y = _mm512_add_ps(y, bias);
    const __m512i u = _mm512_castps_si512(y);
    __m512i b = _mm512_add_epi32(u, _mm512_add_epi32(round_bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    b = _mm512_mask_mov_epi32(_mm512_srli_epi32(b, 16), _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), nan);
    _mm256_mask_storeu_epi16(job.y + (t0 + t) * m + row0, keep, _mm512_cvtepi32_epi16(b));
  }
}

// ---- streaming path (up to kStreamMaxN tokens): no chunk buffer -----------
// Each FT is decoded into registers and consumed at once by the dot products
// of a block of up to kStreamNb tokens (24 accumulators), the decode repeated
// for each block of the chunk, panel by panel: panel mm reads medium
// tile mm of each tile of a chunk of kChunk tiles (the accumulators stay in
// registers across the chunk), and while it does, the records of the next
// chunk (the next row's, past the row's end; after the item's last row the
// first chunk of the thread's next item) are prefetched into L2, a
// quarter per panel pass, so that the four passes over a chunk find it
// there. Medium tiles with exceptions are decoded into a small buffer and
// patched first. Each output is computed by one thread, so the bits do not depend
// on the thread count; they do depend on the batch size (register blocks of 1-3
// tokens on the buffered path use two accumulator sets per lane, the streaming
// path one), as with any fast-mode kernel.
// Up to 18 tokens (3 blocks), decoding each FT once per block costs less than
// the buffer's stores and loads (2-core Zen 4, 11008x4096, 4096x4096,
// 4096x11008, against the buffered path: 1.28-1.30x at 5 tokens, 1.03-1.11x
// at 7-12, 0.99-1.07x at 16, 0.98-1.0x at 20-24; with blocks of 4 it had
// lost from 12 tokens on).
constexpr int kStreamNb = 6;          // tokens per register block
constexpr int64_t kStreamMaxN = 18;   // the streaming path up to this many tokens
// (kChunk: measured when the buffered path decoded each chunk in a step of its own and was used
// from 5 tokens: 4 and 8 tiles alike, 16 slower, 64 1.2-1.6x slower; docs/CPU.md)

template <int NB>
__attribute__((noinline)) void stream_pass(const uint8_t* tiles, const uint8_t* luts, int64_t g0, int64_t tn, int mm,
                                           const uint16_t* x, int64_t kp, uint16_t* const* patched,
                                           const char* pf, float* acc_mem) {
  __m512 acc[NB][4];
#pragma GCC unroll 6
  for (int t = 0; t < NB; ++t)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_load_ps(acc_mem + (t * 4 + j) * 16);
  const __m512i shifts = ft_shifts(), nib = ft_nib();
  for (int64_t tc = 0; tc < tn; ++tc) {
    const int64_t g = g0 + tc;
    const uint8_t* ft = tiles + g * kPkTileBytes + mm * 16 * kPkFtBytes;
    if (pf) {
#pragma GCC unroll 24
      for (int i = 0; i < 16 * kPkFtBytes; i += 64) _mm_prefetch(pf + tc * (16 * kPkFtBytes) + i, _MM_HINT_T1);
    }
    const uint16_t* pb = patched[tc];
    const __m512i lut = lut_at(luts + g * kPkLutEntries);
    const uint16_t* xc = x + tc * kTile;
#pragma GCC unroll 2
    for (int cg = 0; cg < 8; ++cg) {
      __m512bh wv[4];
#pragma GCC unroll 2
      for (int rb = 0; rb < 2; ++rb) {
        const int fi = 2 * cg + rb;
        if (pb) {
          wv[2 * rb] = (__m512bh)_mm512_load_si512(pb + fi * kFragElems);
          wv[2 * rb + 1] = (__m512bh)_mm512_load_si512(pb + fi * kFragElems + 32);
        } else {
          __m512i w0, w1;
          ft_words(ft + fi * kPkFtBytes, lut, shifts, nib, w0, w1);
          wv[2 * rb] = (__m512bh)w0;
          wv[2 * rb + 1] = (__m512bh)w1;
        }
      }
#pragma GCC unroll 6
      for (int t = 0; t < NB; ++t) {
        const __m512bh xb =
            (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xc + t * kp + cg * 8)));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], wv[j], xb);
      }
    }
  }
#pragma GCC unroll 6
  for (int t = 0; t < NB; ++t)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_store_ps(acc_mem + (t * 4 + j) * 16, acc[t][j]);
}

using StreamPassFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, int, const uint16_t*, int64_t,
                              uint16_t* const*, const char*, float*);
constexpr StreamPassFn kStreamPass[kStreamNb + 1] = {nullptr,        stream_pass<1>, stream_pass<2>, stream_pass<3>,
                                                     stream_pass<4>, stream_pass<5>, stream_pass<6>};

// Half-panel passes (7 and 8 tokens): pass rb of panel mm multiplies rows
// 8 rb .. 8 rb + 7 of the panel (FTs 2 cg + rb of each medium tile: vectors
// 2 rb, 2 rb + 1 of the accumulator layout) by all the tokens, 2 accumulators
// per token, so that each FT is decoded once instead of once per block of
// kStreamNb tokens (twice). Each accumulator lane sees the same dot products
// in the same order as in stream_pass: the same bits. Measured against two
// stream_pass blocks (2-core Zen 4, weights cache-cold): 1.05-1.3x faster at
// 7 and 8 tokens on 8192x1024, 1024x4096, 4096x4096 and 11008x4096; at 9 and 10
// tokens mixed (0.9-1.2x), so larger batches keep stream_pass (with 9 or more
// tokens the x loads, doubled here, weigh more and a block of 12 spills).
constexpr int64_t kHalfMinN = kStreamNb + 1, kHalfMaxN = 8;
// Each half pass also pulls the record of the FT 2 groups ahead from L2 into L1 (its 96 bytes: 2
// lines), so that a group's decode does not wait on L2: at 7-8 tokens an FT feeds 16 dot products
// and the pass runs at ~24 cycles per FT with the records in L2 against ~20 with them in L1.
// Side by side (weights cache-cold): 1.01-1.03x on one thread at 7-8 tokens (8192x1024, 1024x4096,
// 2048x1024, 1024x1024), 1.01-1.04x on two at 8 (also 4096x4096, 11008x4096).
constexpr int kHalfL1Ahead = 2;

template <int NB>
__attribute__((noinline)) void stream_half(const uint8_t* tiles, const uint8_t* luts, int64_t g0, int64_t tn, int mm,
                                           int rb, const uint16_t* x, int64_t kp, uint16_t* const* patched,
                                           const char* pf, float* acc_mem) {
  __m512 acc[NB][2];
#pragma GCC unroll 8
  for (int t = 0; t < NB; ++t)
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) acc[t][j] = _mm512_load_ps(acc_mem + (t * 4 + 2 * rb + j) * 16);
  const __m512i shifts = ft_shifts(), nib = ft_nib();
  for (int64_t tc = 0; tc < tn; ++tc) {
    const int64_t g = g0 + tc;
    const uint8_t* ft = tiles + g * kPkTileBytes + mm * 16 * kPkFtBytes + rb * kPkFtBytes;
    if (pf) {
#pragma GCC unroll 12
      for (int i = 0; i < 8 * kPkFtBytes; i += 64) _mm_prefetch(pf + tc * (16 * kPkFtBytes) + i, _MM_HINT_T1);
    }
    const uint16_t* pb = patched[tc] ? patched[tc] + rb * kFragElems : nullptr;
    const __m512i lut = lut_at(luts + g * kPkLutEntries);
    const uint16_t* xc = x + tc * kTile;
#pragma GCC unroll 2
    for (int cg = 0; cg < 8; ++cg) {
      __m512bh w0, w1;
      {  // the FT kHalfL1Ahead groups ahead into L1: in this tile, or the next tile's first ones
        const int fa = 2 * (cg + kHalfL1Ahead);
        const uint8_t* na = fa < 16 ? ft + fa * kPkFtBytes
                            : tc + 1 < tn ? ft + kPkTileBytes + (fa - 16) * kPkFtBytes : nullptr;
        if (na != nullptr) {
          _mm_prefetch(reinterpret_cast<const char*>(na), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(na) + kPkFtBytes - 1, _MM_HINT_T0);
        }
      }
      if (pb) {
        w0 = (__m512bh)_mm512_load_si512(pb + 2 * cg * kFragElems);
        w1 = (__m512bh)_mm512_load_si512(pb + 2 * cg * kFragElems + 32);
      } else {
        __m512i a, b;
        ft_words(ft + 2 * cg * kPkFtBytes, lut, shifts, nib, a, b);
        w0 = (__m512bh)a;
        w1 = (__m512bh)b;
      }
#pragma GCC unroll 8
      for (int t = 0; t < NB; ++t) {
        const __m512bh xb =
            (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xc + t * kp + cg * 8)));
        acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, xb);
        acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, xb);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NB; ++t)
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) _mm512_store_ps(acc_mem + (t * 4 + 2 * rb + j) * 16, acc[t][j]);
}

using StreamHalfFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, int, int, const uint16_t*, int64_t,
                              uint16_t* const*, const char*, float*);
constexpr StreamHalfFn kStreamHalf[2] = {stream_half<7>, stream_half<8>};
static_assert(kHalfMaxN - kHalfMinN + 1 == 2, "one stream_half instance per token count");

// job.n <= kStreamMaxN: blocks of up to kStreamNb tokens, accumulators per thread ([4 panels][n][64]).
// The last chunk prefetches `after` (the thread's next work item) when given.
void stream_gemm_rows(const Bf16GemmJob& job, int64_t tm0, int64_t tm1, const uint8_t* after) {
  const Packed& w = job.w;
  const int64_t kt = w.kt, n = job.n;
  float* accp = acc_buf.get(static_cast<size_t>(4 * n * 64));
  // medium tiles with exceptions, decoded and patched: [kChunk][4] slots of a medium tile each
  uint16_t* pbuf = accp == nullptr ? nullptr : panel_buf.get(static_cast<size_t>(kChunk * 4 * kMediumWords));
  if (pbuf == nullptr) {
    job.oom->store(true);
    return;
  }
  uint16_t* patched[4][kChunk];
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    const int64_t bad_range = first_bad_range(w, tm * kt, (tm + 1) * kt);
    if (bad_range >= 0) {
      report_bad(job.bad_tile, bad_range);
      return;
    }
    std::memset(accp, 0, static_cast<size_t>(4 * n * 64) * sizeof(float));
    for (int64_t c0 = 0; c0 < kt; c0 += kChunk) {
      const int64_t tn = std::min<int64_t>(kChunk, kt - c0), g0 = tm * kt + c0;
      // exceptions: the medium tiles that have any are decoded and patched here
      for (int64_t tc = 0; tc < tn; ++tc) {
        const int64_t g = g0 + tc;
        TileExc x(w, g);
        const __m512i lut = tile_lut(w, g);
        for (int mm = 0; mm < 4; ++mm) {
          patched[mm][tc] = nullptr;
          if (!x.in_medium(mm)) continue;
          patched[mm][tc] = pbuf + (tc * 4 + mm) * kMediumWords;
          decode_medium(w, g, mm, lut, patched[mm][tc], x);
        }
        if (!x.ok()) {
          report_bad(job.bad_tile, g);
          return;
        }
      }
      // the next chunk's records: the rest of this row, the next row's first chunk, after the item's
      // last row the thread's next item's first chunk, or nothing (the matrix's end and no next
      // item). A shorter next chunk is overrun by a few tiles: prefetches do not fault.
      const bool item_end = tm + 1 == tm1 && c0 + tn == kt;
      const uint8_t* next_rec = !item_end ? w.tiles + (g0 + tn) * kPkTileBytes
                                : after != nullptr ? after
                                : tm1 < w.mt ? w.tiles + (g0 + tn) * kPkTileBytes : nullptr;
      const char* next = reinterpret_cast<const char*>(next_rec);
      const auto next_at = [next](int64_t off) { return next != nullptr ? next + off : nullptr; };
      if (n >= kHalfMinN && n <= kHalfMaxN) {  // two half passes per panel, each prefetching half its quarter
        for (int mm = 0; mm < 4; ++mm)
          for (int rb = 0; rb < 2; ++rb)
            kStreamHalf[n - kHalfMinN](w.tiles, w.luts, g0, tn, mm, rb, job.x + c0 * kTile, job.kp, patched[mm],
                                       next_at(mm * tn * (16 * kPkFtBytes) + rb * (8 * kPkFtBytes)), accp + mm * n * 64);
        continue;
      }
      // ceil(n / 6) blocks whose sizes differ by at most one (7 tokens: 4 + 3, not 6 + 1: a block of
      // one token waits on the latency of its 4 accumulators)
      const int64_t blocks = (n + kStreamNb - 1) / kStreamNb;
      for (int mm = 0; mm < 4; ++mm)
        for (int64_t b = 0, t0 = 0; b < blocks; ++b) {
          const int64_t nb = n / blocks + (b < n % blocks ? 1 : 0);
          kStreamPass[nb](w.tiles, w.luts, g0, tn, mm, job.x + t0 * job.kp + c0 * kTile, job.kp, patched[mm],
                          t0 == 0 ? next_at(mm * tn * (16 * kPkFtBytes)) : nullptr, accp + (mm * n + t0) * 64);
          t0 += nb;
        }
    }
    for (int mm = 0; mm < 4; ++mm) finish_panel(job, accp + mm * n * 64, n, tm * kTile + mm * kPanelRows);
  }
}

// job.n > kStreamMaxN: this thread's tile rows tm0 .. tm1 - 1 as one sequence of chunks (kChunk
// or kWideChunk tiles; a row's last chunk may be shorter), chunk q multiplied from one half of a
// double buffer while chunk q + 1 is decoded into the other, each panel_block call decoding a
// share in proportion to its block's tokens, and chunk q + 2's records are prefetched into L2 by
// the first token block. Only the first chunk is decoded on its own. Each chunk is checked before
// its decode starts, its exceptions patched once it is whole (patch_tiles). A row's first chunk
// starts its accumulators from zero (no memset of the n-token buffer), and its last chunk finishes
// each token block's panel right after multiplying it, while the sums are in L1 (before: the whole
// row's [4][n][64] fp32 sums were set to zero, then read back at the row's end, 512 KiB at 512
// tokens; side by side 1.01-1.05x from 24 to 512 tokens, most where one chunk spans the row).
void buffered_gemm_rows(const Bf16GemmJob& job, int64_t tm0, int64_t tm1, const uint8_t* after) {
  const Packed& w = job.w;
  const int64_t kt = w.kt, n = job.n;
  if (tm1 <= tm0 || kt <= 0) return;
  const bool wide = n >= kWideMinN;
  const int64_t chunk = wide ? kWideChunk : kChunk;
  const int64_t per_row = (kt + chunk - 1) / chunk, chunks = (tm1 - tm0) * per_row;
  // the second half kHalfSkew words further than the first's end: the decode's stores and the
  // multiply's loads then differ in their low 12 address bits (4K aliasing; measured 1.0-1.03x)
  const size_t half = static_cast<size_t>(4 * chunk * kMediumWords + kHalfSkew);
  uint16_t* bufs = panel_buf.get(2 * half);
  float* acc = acc_buf.get(static_cast<size_t>(4 * n * 64));
  if (bufs == nullptr || acc == nullptr) {
    job.oom->store(true);
    return;
  }
  // chunk q: tile row tm0 + q / per_row, its tiles from column (q % per_row) * chunk on
  const auto first_tile = [&](int64_t q) { return (tm0 + q / per_row) * kt + (q % per_row) * chunk; };
  const auto tiles_of = [&](int64_t q) { return std::min<int64_t>(chunk, kt - (q % per_row) * chunk); };
  int64_t bad = decode_tiles(w, first_tile(0), tiles_of(0), bufs);  // 1. (the first chunk)
  if (bad >= 0) {
    report_bad(job.bad_tile, bad);
    return;
  }
  const int64_t blocks = (n + kMaxNb - 1) / kMaxNb, calls = 4 * blocks;  // panel_block calls per chunk
  for (int64_t q = 0; q < chunks; ++q) {
    const int64_t tm = tm0 + q / per_row, tc0 = (q % per_row) * chunk, tn = tiles_of(q);
    const uint16_t* buf = bufs + (q & 1) * half;
    // 1. chunk q + 1, each call's share in proportion to its block's tokens
    ChunkDecode dec;
    int64_t fts = 0;
    const int64_t g1 = first_tile(q + 1);
    if (q + 1 < chunks) {
      dec.tn = tiles_of(q + 1);
      bad = first_bad_range(w, g1, g1 + dec.tn);
      if (bad >= 0) {
        report_bad(job.bad_tile, bad);
        return;
      }
      dec.rec = w.tiles + g1 * kPkTileBytes;
      dec.luts = w.luts + g1 * kPkLutEntries;
      dec.dst = bufs + ((q + 1) & 1) * half;
      fts = dec.tn * kFragsPerTile;
    }
    // chunk q + 2's records into L2, a quarter per panel, by the first token block; past the work
    // item's end the first chunk of the thread's next item (`after`, during the chunk before the
    // last, or during the only one; nothing for its second chunk), or without one the rows that
    // follow within the matrix
    const uint8_t* ahead_rec = nullptr;
    if (q + 2 < chunks)
      ahead_rec = w.tiles + first_tile(q + 2) * kPkTileBytes;
    else if (after != nullptr)
      ahead_rec = q + 2 == chunks || chunks == 1 ? after : nullptr;
    else if (tm1 < w.mt && q + 2 == chunks)  // (no next item given: the rows that follow)
      ahead_rec = w.tiles + tm1 * kt * kPkTileBytes;
    const char* ahead = reinterpret_cast<const char*>(ahead_rec);
    // 2. wide: token blocks outside (a block's activations stay in L1 for its 4 panels);
    //    narrow: panels outside (a panel stays in L1 for every block)
    int64_t done = 0;  // token-panels multiplied: each call decodes its block's share of chunk q + 1
    for (int64_t call = 0; call < calls; ++call) {
      const int64_t b = wide ? call / 4 : call % blocks;
      const int mm = static_cast<int>(wide ? call % 4 : call / blocks);
      const int64_t t0 = b * kMaxNb, nb = std::min<int64_t>(kMaxNb, n - t0);
      done += nb;
      dec.end = fts * done / (4 * n);
      const char* pf = b == 0 && ahead != nullptr ? ahead + mm * tn * (kPkTileBytes / 4) : nullptr;
      panel_tokens(buf + mm * tn * kMediumWords, tn * 8, job.x + t0 * job.kp + tc0 * kTile, job.kp, nb, pf,
                   acc + (mm * n + t0) * 64, fts ? &dec : nullptr, tc0 == 0);
      if (tc0 + tn == kt) finish_panel(job, acc + (mm * n + t0) * 64, nb, tm * kTile + mm * kPanelRows, t0);
    }
    if (fts) {
      bad = patch_tiles(w, g1, dec.tn, dec.dst);
      if (bad >= 0) {
        report_bad(job.bad_tile, bad);
        return;
      }
    }
  }
}

void bf16_gemm_rows(const Bf16GemmJob& job, int64_t tm0, int64_t tm1, const uint8_t* after) {
  if (job.n <= kStreamMaxN)
    stream_gemm_rows(job, tm0, tm1, after);
  else
    buffered_gemm_rows(job, tm0, tm1, after);
}

// The decode step alone, W[m][k] out (tests it bit for bit against the reference decoder).
void bf16_decode_rows(const PackedDecodeJob& job, int64_t tm0, int64_t tm1) {
  const Packed& w = job.w;
  const int64_t kt = w.kt;
  uint16_t* buf = panel_buf.get(static_cast<size_t>(4 * kt * kMediumWords));
  if (buf == nullptr) {
    if (job.oom != nullptr) job.oom->store(true);
    return;
  }
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    const int64_t bad = decode_tiles(w, tm * kt, kt, buf);
    if (bad >= 0) {
      report_bad(job.bad_tile, bad);
      return;
    }
    for (int mm = 0; mm < 4; ++mm)
      for (int64_t tk = 0; tk < kt; ++tk)
        for (int fi = 0; fi < 16; ++fi)
          for (int p = 0; p < kFragElems; ++p) {
            const int64_t row = tm * kTile + mm * kPanelRows + (fi & 1) * 8 + (p >> 3);
            const int64_t col = tk * kTile + (fi >> 1) * 8 + (p & 7);
            if (row < w.m && col < w.k)
              job.out[row * w.k + col] = buf[(mm * kt + tk) * kMediumWords + fi * kFragElems + ft_word(p)];
          }
  }
}

// exp(v) for v in fp32 lanes: 2^(v log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by a degree-6 polynomial (relative error < 2e-7); v clamped to [-87, 88],
// so exp stays finite and normal: silu(g) for g < -87 comes out as g e^-87
// (about 1e-36 |g|) instead of g e^g (smaller still): zero for any purpose here.
inline __m512 exp_ps(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609954e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443423e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284771619e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821579953e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071233e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994530942e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// act[r][i] = bf16(silu(g) * u), g = h[r][i], u = h[r][inter + i] (bf16 -> fp32), RNE, NaN -> 0x7FC0.
void silu_mul_rows(const uint16_t* h, int64_t r0, int64_t r1, int64_t inter, uint16_t* act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* g = h + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* a = act + r * inter;
    for (int64_t i = 0; i < inter; i += 16) {  // inter is a multiple of 64
      const __m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i))), 16));
      const __m512 uv = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i))), 16));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))), uv);
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, y);
      for (int l = 0; l < 16; ++l) a[i + l] = float_to_bf16(tmp[l]);
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace zipserv

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace zipserv {
namespace cpu {

Bf16GemmRowsFn avx512bf16_gemm_rows() { return bf16_gemm_rows; }
PackedDecodeRowsFn avx512bf16_decode_rows() { return bf16_decode_rows; }
void avx512bf16_silu_mul(const uint16_t* h, int64_t r0, int64_t r1, int64_t inter, uint16_t* act) {
  silu_mul_rows(h, r0, r1, inter, act);
}

bool avx512bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}

}  // namespace cpu
}  // namespace zipserv
