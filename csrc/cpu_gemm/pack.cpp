// Packer of the CPU byte-split layout (cpu_layout.h, FORMAT.md appendix A):
// BF16 matrix -> tile records, per-tile tables and exceptions. Tile rows run
// in parallel on torch's OpenMP threads (parallel.cpp); the result does not
// depend on the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "zipserv/cpu_gemm.h"
#include "zipserv/cpu_pack.h"

namespace zipserv {
namespace cpu {
namespace {

// The table of one tile: the (up to) 16 most frequent high bytes of its real
// elements (ties: the smaller byte first), in ascending order, the last one
// repeated up to 16 entries.
void tile_table(const int64_t counts[256], uint8_t lut[kPkLutEntries]) {
  int order[256];
  for (int i = 0; i < 256; ++i) order[i] = i;
  std::stable_sort(order, order + 256, [&](int a, int b) { return counts[a] > counts[b]; });
  int n = 0;
  while (n < kPkLutEntries && counts[order[n]] > 0) ++n;
  if (n == 0) n = 1;  // (a tile always has a real element)
  std::sort(order, order + n);
  for (int i = 0; i < kPkLutEntries; ++i) lut[i] = static_cast<uint8_t>(order[std::min(i, n - 1)]);
}

struct PackCtx {
  const PackJob* job;
  std::vector<std::vector<uint32_t>>* exc;  // per tile
};

void pack_rows(const PackJob& job, std::vector<std::vector<uint32_t>>& exc, int64_t tm0, int64_t tm1) {
  for (int64_t tm = tm0; tm < tm1; ++tm) {
    for (int64_t tk = 0; tk < job.kt; ++tk) {
      const int64_t g = tm * job.kt + tk;
      const int rows = static_cast<int>(std::min<int64_t>(kTile, job.m - tm * kTile));
      const int cols = static_cast<int>(std::min<int64_t>(kTile, job.k - tk * kTile));
      int64_t counts[256] = {0};
      for (int r = 0; r < rows; ++r) {
        const uint16_t* src = job.w + (tm * kTile + r) * job.k + tk * kTile;
        for (int c = 0; c < cols; ++c) ++counts[src[c] >> 8];
      }
      uint8_t* lut = job.luts + g * kPkLutEntries;
      tile_table(counts, lut);
      int code_of[256];
      std::fill(code_of, code_of + 256, -1);
      for (int i = kPkLutEntries - 1; i >= 0; --i) code_of[lut[i]] = i;  // first occurrence wins
      uint8_t* t = job.tiles + g * kPkTileBytes;
      std::memset(t, 0, kPkTileBytes);
      std::vector<uint32_t>& ex = exc[g];
      for (int f = 0; f < kFragsPerTile; ++f) {
        const int r0 = frag_row0(f), c0 = frag_col0(f);
        for (int p = 0; p < kFragElems; ++p) {
          const int r = r0 + p / kFrag, c = c0 + p % kFrag;
          uint8_t lo = kPkPadLo;
          int code = 0;
          if (r < rows && c < cols) {
            const uint16_t v = job.w[(tm * kTile + r) * job.k + tk * kTile + c];
            lo = static_cast<uint8_t>(v);
            code = code_of[v >> 8];
            if (code < 0) {
              ex.push_back(static_cast<uint32_t>(f * kFragElems + p) << kPkExcShift | (v >> 8));
              code = 0;
            }
          }
          t[pk_lo_byte(f, p)] = lo;
          t[pk_code_byte(f, p)] |= static_cast<uint8_t>(code << (4 * pk_code_nibble(p)));
        }
      }
    }
  }
}

}  // namespace

std::vector<uint32_t> pack_matrix(const PackJob& job, int threads, int64_t* exc_start) {
  std::vector<std::vector<uint32_t>> exc(static_cast<size_t>(job.mt * job.kt));
  PackCtx ctx{&job, &exc};
  parallel_for(job.mt, threads, [](void* c, int64_t a, int64_t b) {
    auto* p = static_cast<PackCtx*>(c);
    pack_rows(*p->job, *p->exc, a, b);
  }, &ctx);
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
