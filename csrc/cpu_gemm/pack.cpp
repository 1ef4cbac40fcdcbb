// Packer of the CPU byte-split layout (cpu_layout.h, FORMAT.md appendix A):
// BF16 matrix -> tile records, per-tile tables and exceptions. Tile rows run
// in parallel on torch's OpenMP threads (parallel.cpp); the result does not
// depend on the thread count.
#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "zipserv/cpu_gemm.h"
#include "zipserv/cpu_pack.h"

namespace zipserv {
namespace cpu {
namespace {

// The table of one tile: the (up to) 16 most frequent high bytes of its real
// elements (ties: the smaller byte first), in ascending order, the last one
// repeated up to 16 entries.
void tile_table(const int32_t counts[256], uint8_t lut[kPkLutEntries]) {
  int used[256];
  int n = 0;
  for (int v = 0; v < 256; ++v)
    if (counts[v] > 0) used[n++] = v;  // ascending
  const int keep = std::min(n, kPkLutEntries);
  std::partial_sort(used, used + keep, used + n, [&](int a, int b) {
    return counts[a] != counts[b] ? counts[a] > counts[b] : a < b;
  });
  std::sort(used, used + keep);
  for (int i = 0; i < kPkLutEntries; ++i) lut[i] = static_cast<uint8_t>(keep ? used[std::min(i, keep - 1)] : 0);
}

void pack_rows(const PackJob& job, std::vector<std::vector<uint32_t>>& exc, int64_t tm0, int64_t tm1) {
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    for (int64_t tk = 0; tk < job.kt; ++tk) {
      const int64_t g = tm * job.kt + tk;
      const int rows = static_cast<int>(std::min<int64_t>(kTile, job.m - tm * kTile));
      const int cols = static_cast<int>(std::min<int64_t>(kTile, job.k - tk * kTile));
      // The tile is copied out first: its rows lie K * 2 bytes apart, which for
      // K = 4096 puts all 64 of them in one L1 set (3x slower without the copy).
      alignas(64) uint16_t tile[kTile][kTile];
      int32_t counts[256] = {0};
      for (int r = 0; r < rows; ++r) {
        std::memcpy(tile[r], job.w + (tm * kTile + r) * job.k + tk * kTile, static_cast<size_t>(cols) * 2);
        for (int c = 0; c < cols; ++c) ++counts[tile[r][c] >> 8];
      }
      uint8_t* lut = job.luts + g * kPkLutEntries;
      tile_table(counts, lut);
      int8_t code_of[256];
      std::memset(code_of, -1, sizeof code_of);
      for (int i = kPkLutEntries - 1; i >= 0; --i) code_of[lut[i]] = static_cast<int8_t>(i);  // first occurrence
      int64_t misses = 0;
      for (int v = 0; v < 256; ++v) misses += code_of[v] < 0 ? counts[v] : 0;
      uint8_t* t = job.tiles + g * kPkTileBytes;
      std::vector<uint32_t>& ex = exc[g];
      const bool simple = rows == kTile && cols == kTile && misses == 0;  // no padding, no exceptions
      for (int f = 0; f < kFragsPerTile; ++f) {
        const int r0 = frag_row0(f), c0 = frag_col0(f);
        uint8_t code[kFragElems];
        uint8_t* lo = t + pk_lo_byte(f, 0);
        if (simple) {
          for (int r = 0; r < kFrag; ++r) {
            for (int c = 0; c < kFrag; ++c) {
              const uint16_t v = tile[r0 + r][c0 + c];
              lo[r * kFrag + c] = static_cast<uint8_t>(v);
              code[r * kFrag + c] = static_cast<uint8_t>(code_of[v >> 8]);
            }
          }
        } else {
          for (int r = 0; r < kFrag; ++r) {
            const bool row_ok = r0 + r < rows;
            const uint16_t* src = tile[r0 + r] + c0;
            for (int c = 0; c < kFrag; ++c) {
              const int p = r * kFrag + c;
              if (row_ok && c0 + c < cols) {
                const uint16_t v = src[c];
                const int cd = code_of[v >> 8];
                lo[p] = static_cast<uint8_t>(v);
                code[p] = static_cast<uint8_t>(cd < 0 ? 0 : cd);
                if (cd < 0) ex.push_back(static_cast<uint32_t>(f * kFragElems + p) << kPkExcShift | (v >> 8));
              } else {
                lo[p] = kPkPadLo;
                code[p] = 0;
              }
            }
          }
        }
        uint8_t* cb = t + pk_code_byte(f, 0);
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 16; ++j) cb[16 * h + j] = static_cast<uint8_t>(code[32 * h + j] | code[32 * h + 16 + j] << 4);
      }
    }
  }
}

}  // namespace

std::vector<uint32_t> pack_matrix(const PackJob& job, int threads, int64_t* exc_start) {
  std::vector<std::vector<uint32_t>> exc(static_cast<size_t>(job.mt * job.kt));
  std::atomic<bool> oom{false};
  auto body = [&](int64_t a, int64_t b) {  // exc: per tile
    try {
      pack_rows(job, exc, a, b);
    } catch (const std::bad_alloc&) {  // (no exception may leave the parallel region)
      oom.store(true);
    }
  };
  parallel_for(job.mt, threads, body);
  if (oom.load()) throw std::bad_alloc();  // (MemoryError; nothing is returned)
  std::vector<uint32_t> all;
  exc_start[0] = 0;
  for (size_t g = 0; g < exc.size(); ++g) {
    all.insert(all.end(), exc[g].begin(), exc[g].end());
    exc_start[g + 1] = static_cast<int64_t>(all.size());
  }
  return all;
}

}  // namespace cpu
}  // namespace zipserv
