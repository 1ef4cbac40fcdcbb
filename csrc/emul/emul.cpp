// zipserv_vllm._emul: a CPU emulation of the CUDA kernels' data path, built
// with g++ from the SAME headers the kernels use (decode_lane.h,
// zipgemm_layout.cuh). No GPU is needed: the tests run every lane of every FT
// through decode_lane_pair and replay the fused kernel at fragment level.
//
// What is shared with the kernels (one definition): the per-lane decode, the
// per-warp counts and staging ranges (lane_count_share, warp_segment), the FT
// that feeds each A register (a_frag_ft), the X shared-memory swizzle
// (x_smem_index), the B and C fragment maps the kernel believes in
// (b_frag_*, c_frag_*), the split-K partition, and the epilogue.
// What is independent here: the PTX definition of mma.m16n8k16 (which lane
// register holds which A/B/C element, section "ptx" below). A kernel-side map
// that disagrees with the hardware definition therefore fails the tests.
//
// `perturb` deliberately breaks one mapping (negative tests):
//   1 decode with lane ^ 1         2 swap A registers a1 and a2
//   4 read X without the swizzle   8 fallback index off by one
//  16 drop the last K tile of every split part
//  32 swap the C row / column map
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "encode_layout.cuh"
#include "gather_layout.cuh"
#include "zipgemm_layout.cuh"
#include "zipserv/decode_lane.h"
#include "zipserv/format.h"

namespace py = pybind11;
using namespace zipserv;
using namespace zipserv::gemm;

namespace {

template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

// ------------------------------------------------------------------ ptx
// PTX ISA, "Matrix fragments for mma.m16n8k16" (bf16): groupID = lane >> 2,
// threadID_in_group = lane % 4.
//  A (16x16, row): a_i holds rows groupID + 8 * (i % 2), cols 2 t + e + 8 * (i / 2)
//  B (16x8, col):  b_i holds rows (k) 2 t + e + 8 i, col groupID
//  C (16x8, f32):  c_i holds row groupID + 8 * (i / 2), col 2 t + i % 2
int ptx_a_row(int lane, int i) { return (lane >> 2) + 8 * (i % 2); }
int ptx_a_col(int lane, int i, int e) { return 2 * (lane % 4) + e + 8 * (i / 2); }
int ptx_b_k(int lane, int i, int e) { return 2 * (lane % 4) + e + 8 * i; }
int ptx_b_n(int lane) { return lane >> 2; }
int ptx_c_row(int lane, int i) { return (lane >> 2) + 8 * (i / 2); }
int ptx_c_col(int lane, int i) { return 2 * (lane % 4) + i % 2; }

float half_f32(uint32_t packed, int e) { return gemm::bf16_bits_to_f32(static_cast<uint16_t>(packed >> (16 * e))); }

// One warp-wide mma.sync: acc[lane][i] += (A . B) at the hardware positions.
void mma_emul(float (&acc)[32][4], const uint32_t (&a)[32][4], const uint32_t (&b)[32][2]) {
  float A[16][16], B[16][8], C[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 2; ++e) A[ptx_a_row(l, i)][ptx_a_col(l, i, e)] = half_f32(a[l][i], e);
    for (int i = 0; i < 2; ++i)
      for (int e = 0; e < 2; ++e) B[ptx_b_k(l, i, e)][ptx_b_n(l)] = half_f32(b[l][i], e);
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float s = 0.f;
      for (int k = 0; k < 16; ++k) s += A[m][k] * B[k][n];
      C[m][n] = s;
    }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) acc[l][i] += C[ptx_c_row(l, i)][ptx_c_col(l, i)];
}

// ------------------------------------------------------------------ input
struct Compressed {
  const uint64_t* bitmaps;
  const uint8_t* base;
  const int64_t* offsets;
  const uint8_t* sm;
  int64_t sm_len;
  const uint16_t* fb;
  int64_t fb_len;
  int M, K, Mt, Kt;
};

Compressed view(const Arr<uint64_t>& bitmaps, const Arr<uint8_t>& base, const Arr<int64_t>& offsets,
                const Arr<uint8_t>& sm, const Arr<uint16_t>& fb, int M, int K) {
  Compressed c{bitmaps.data(), base.data(), offsets.data(), sm.data(), static_cast<int64_t>(sm.size()),
               fb.data(), static_cast<int64_t>(fb.size()), M, K, (M + kTile - 1) / kTile, (K + kTile - 1) / kTile};
  if (bitmaps.size() != static_cast<py::ssize_t>(c.Mt) * c.Kt * kPlanes * kFragsPerTile ||
      base.size() != static_cast<py::ssize_t>(c.Mt) * c.Kt || offsets.size() != static_cast<py::ssize_t>(c.Mt) * c.Kt * 2)
    throw std::invalid_argument("array sizes do not fit an " + std::to_string(M) + " x " + std::to_string(K) + " matrix");
  return c;
}

// Copies [begin, begin + n) of a stream; reading outside it is a kernel bug
// (the kernels must never over-read a stream), so it throws.
template <typename T>
void copy_checked(T* dst, const T* src, int64_t len, int64_t begin, int64_t n, const char* what) {
  if (begin < 0 || begin + n > len)
    throw std::out_of_range(std::string("emulated cp.async reads ") + what + " [" + std::to_string(begin) + ", " +
                            std::to_string(begin + n) + ") outside the stream of " + std::to_string(len));
  std::memcpy(dst, src + begin, static_cast<size_t>(n) * sizeof(T));
}

// Per-warp staging exactly as the kernels do it: counts from the lanes'
// shares, chunk copies of warp_segment's ranges into staging that holds
// garbage elsewhere (a decode that depended on uncopied bytes would fail).
struct WarpStage {
  WarpSegment seg;
  std::vector<uint8_t> sm;
  std::vector<uint16_t> fb;
};

void stage_warp(WarpStage& st, const Compressed& c, int64_t g, int warp, std::mt19937& rng) {
  const uint64_t* bmp = c.bitmaps + g * kPlanes * kFragsPerTile;
  int hb = 0, hc = 0;
  for (int lane = 0; lane < 32; ++lane) {  // __reduce_add_sync over the lanes' shares
    const int pc_lo = popc64(indicator(bmp[lane], bmp[64 + lane], bmp[128 + lane]));
    const int pc_hi = popc64(indicator(bmp[lane + 32], bmp[64 + lane + 32], bmp[128 + lane + 32]));
    int before, inside;
    lane_count_share(warp, lane, pc_lo, pc_hi, &before, &inside);
    hb += before;
    hc += inside;
  }
  st.seg = warp_segment(c.offsets[2 * g], c.offsets[2 * g + 1], warp, hb, hc);
  st.sm.resize(kSmStageBytes);
  st.fb.resize(kFbStageElems);
  for (auto& v : st.sm) v = static_cast<uint8_t>(rng());
  for (auto& v : st.fb) v = static_cast<uint16_t>(rng());
  if (st.seg.sm_chunks * kChunk > kSmStageBytes - kSmSlack || st.seg.fb_chunks * 8 > kFbStageElems - kFbSlack)
    throw std::logic_error("warp_segment exceeds the staging size");
  if (st.seg.sm_begin % kChunk || st.seg.fb_begin % 8) throw std::logic_error("unaligned cp.async source");
  copy_checked(st.sm.data(), c.sm, c.sm_len, st.seg.sm_begin, int64_t{st.seg.sm_chunks} * kChunk, "sm");
  copy_checked(st.fb.data(), c.fb, c.fb_len, st.seg.fb_begin, int64_t{st.seg.fb_chunks} * 8, "fb");
}

// ------------------------------------------------------------------ API
uint32_t lane_decode_one(uint64_t p0, uint64_t p1, uint64_t p2, int base_exp, const Arr<uint8_t>& sm,
                         const Arr<uint16_t>& fb, int h_before, int f_before, int lane) {
  if (lane < 0 || lane > 31) throw std::invalid_argument("lane must be 0..31, got " + std::to_string(lane));
  return decode_lane_pair(p0, p1, p2, base_exp, sm.data(), fb.data(), h_before, f_before, lane);
}

// Every lane of every FT of every tile through decode_lane_pair, each tile's
// whole segments staged (with slack) at offset 0: rebuilds W [M, K].
py::array_t<uint16_t> lane_decode_matrix(const Arr<uint64_t>& bitmaps, const Arr<uint8_t>& base,
                                         const Arr<int64_t>& offsets, const Arr<uint8_t>& sm,
                                         const Arr<uint16_t>& fb, int M, int K, int perturb) {
  const Compressed c = view(bitmaps, base, offsets, sm, fb, M, K);
  py::array_t<uint16_t> out({M, K});
  uint16_t* o = out.mutable_data();
  std::mt19937 rng(1234);
  std::vector<uint8_t> ssm(kTileElems + kSmSlack);
  std::vector<uint16_t> sfb(kTileElems + kFbSlack);
  for (int64_t g = 0; g < int64_t{c.Mt} * c.Kt; ++g) {
    const uint64_t* bmp = c.bitmaps + g * kPlanes * kFragsPerTile;
    int h = 0;
    for (int f = 0; f < kFragsPerTile; ++f) h += popc64(indicator(bmp[f], bmp[64 + f], bmp[128 + f]));
    for (auto& v : ssm) v = static_cast<uint8_t>(rng());
    for (auto& v : sfb) v = static_cast<uint16_t>(rng());
    copy_checked(ssm.data(), c.sm, c.sm_len, c.offsets[2 * g], h, "sm");
    copy_checked(sfb.data(), c.fb, c.fb_len, c.offsets[2 * g + 1], kTileElems - h, "fb");
    const int tm = static_cast<int>(g / c.Kt), tk = static_cast<int>(g % c.Kt);
    int hrun = 0;
    for (int f = 0; f < kFragsPerTile; ++f) {
      const uint64_t p0 = bmp[f], p1 = bmp[64 + f], p2 = bmp[128 + f];
      for (int lane = 0; lane < 32; ++lane) {
        const int dl = (perturb & 1) ? lane ^ 1 : lane;
        const uint32_t v = decode_lane_pair(p0, p1, p2, c.base[g], ssm.data(), sfb.data(), hrun,
                                            f * kFragElems - hrun + ((perturb & 8) ? 1 : 0), dl);
        const int row = tm * kTile + frag_row0(f) + lane / 4, col = tk * kTile + frag_col0(f) + 2 * (lane % 4);
        for (int e = 0; e < 2; ++e)
          if (row < M && col + e < K) o[int64_t{row} * K + col + e] = static_cast<uint16_t>(v >> (16 * e));
      }
      hrun += popc64(indicator(p0, p1, p2));
    }
  }
  return out;
}

// The embedding kernel (csrc/cuda/embedding.cu): its block body, the phase functions of
// gather_layout.cuh, run for every block and every thread, with the barriers between phases.
// The output starts as 0xFFFF everywhere, so an element the kernel would not write shows.
py::array_t<uint16_t> emulate_embedding(const py::array& ids, const Arr<uint64_t>& bitmaps, const Arr<uint8_t>& base,
                                        const Arr<int64_t>& offsets, const Arr<uint8_t>& sm, const Arr<uint16_t>& fb,
                                        int M, int K, int64_t rows) {
  const Compressed c = view(bitmaps, base, offsets, sm, fb, M, K);
  if (!(ids.flags() & py::array::c_style) || ids.dtype().kind() != 'i' || (ids.itemsize() != 4 && ids.itemsize() != 8))
    throw py::value_error("ids must be a C-contiguous int32 or int64 array");
  const int64_t n = ids.size();
  py::array_t<uint16_t> out({n, static_cast<int64_t>(K)});
  std::memset(out.mutable_data(), 0xFF, sizeof(uint16_t) * size_t(n) * K);
  gather::GatherArgs a{ids.data(), ids.itemsize() == 8, n, c.bitmaps, c.base, c.offsets, c.sm, c.fb,
                       out.mutable_data(), M, K, rows};
  const int kt = static_cast<int>(tile_count(K));
  for (int64_t i = 0; i < n; ++i)        // blockIdx.x
    for (int tk = 0; tk < kt; ++tk) {    // blockIdx.y
      gather::Shared s;
      std::memset(&s, 0xA5, sizeof s);   // shared memory starts as garbage
      const int64_t row = gather::gather_row(a, i);
      const int64_t g = gather::gather_tile(a, row, tk);
      for (int t = 0; t < gather::kThreads; ++t) gather::gather_load(a, g, t, s);
      gather::gather_scan(g, s);         // thread 0, between the two barriers
      for (int t = 0; t < gather::kThreads; ++t) gather::gather_decode(a, i, row, g, tk, t, s);
    }
  return out;
}

// Replay of decompress_kernel (csrc/cuda/decompress.cu).
py::array_t<uint16_t> emulate_decompress(const Arr<uint64_t>& bitmaps, const Arr<uint8_t>& base,
                                         const Arr<int64_t>& offsets, const Arr<uint8_t>& sm,
                                         const Arr<uint16_t>& fb, int M, int K) {
  const Compressed c = view(bitmaps, base, offsets, sm, fb, M, K);
  py::array_t<uint16_t> out({M, K});
  uint16_t* o = out.mutable_data();
  std::memset(o, 0xFF, sizeof(uint16_t) * size_t(M) * K);
  std::mt19937 rng(99);
  WarpStage st;
  std::vector<uint16_t> tile(kTile * kOutPitch);
  for (int64_t g = 0; g < int64_t{c.Mt} * c.Kt; ++g) {
    const uint64_t* bmp = c.bitmaps + g * kPlanes * kFragsPerTile;
    const int tm = static_cast<int>(g / c.Kt), tk = static_cast<int>(g % c.Kt);
    for (int warp = 0; warp < kWarps; ++warp) {
      stage_warp(st, c, g, warp, rng);
      int hrun = 0;
      for (int i = 0; i < kFtPerMed; ++i) {
        const int f = warp * kFtPerMed + i;
        const uint64_t p0 = bmp[f], p1 = bmp[64 + f], p2 = bmp[128 + f];
        for (int lane = 0; lane < 32; ++lane) {
          const uint32_t v = decode_lane_pair(p0, p1, p2, c.base[g], st.sm.data(), st.fb.data(),
                                              ft_sm_before(st.seg, hrun), ft_fb_before(st.seg, i, hrun), lane);
          const int idx = out_tile_index(frag_row0(f) + lane / 4, frag_col0(f) + 2 * (lane % 4));
          tile[idx] = static_cast<uint16_t>(v);
          tile[idx + 1] = static_cast<uint16_t>(v >> 16);
        }
        hrun += popc64(indicator(p0, p1, p2));
      }
      for (int ci = 0; ci < kMedRows * 8; ++ci) {  // the lanes' 16-byte row chunks of the medium tile
        const int r = warp * kMedRows + ci / 8, c0 = (ci % 8) * 8;
        const int row = tm * kTile + r, col = tk * kTile + c0;
        if (row >= M) continue;
        for (int e = 0; e < 8; ++e)
          if (col + e < K) o[int64_t{row} * K + col + e] = tile[out_tile_index(r, c0 + e)];
      }
    }
  }
  return out;
}

// Replay of fused_kernel<NT8> + splitk_reduce (csrc/cuda/zipgemm.cu).
// Returns (y bf16 bits [N, M], y fp32 before rounding [N, M]).
py::tuple emulate_zipgemm(const Arr<uint16_t>& x, const Arr<uint64_t>& bitmaps, const Arr<uint8_t>& base,
                          const Arr<int64_t>& offsets, const Arr<uint8_t>& sm, const Arr<uint16_t>& fb,
                          py::object bias_obj, int M, int K, int tile_n, int split, int perturb) {
  const Compressed c = view(bitmaps, base, offsets, sm, fb, M, K);
  if (x.ndim() != 2 || x.shape(1) != K) throw std::invalid_argument("x must be [N, K]");
  const int N = static_cast<int>(x.shape(0));
  if (tile_n != 8 && tile_n != 16 && tile_n != 32 && tile_n != 64 && tile_n != 128)
    throw std::invalid_argument("tile_n must be 8, 16, 32, 64 or 128, got " + std::to_string(tile_n));
  if (split < 1) throw std::invalid_argument("split must be >= 1");
  const int nt8 = tile_n / 8;
  const int parts = splitk_parts(c.Kt, split);  // what the host passes as a.split
  Arr<uint16_t> bias_arr;
  const uint16_t* bias = nullptr;
  if (!bias_obj.is_none()) {
    bias_arr = bias_obj.cast<Arr<uint16_t>>();
    if (bias_arr.size() != M) throw std::invalid_argument("bias must have M elements");
    bias = bias_arr.data();
  }
  const uint16_t* X = x.data();
  const bool x_vec = K % 8 == 0;  // numpy rows are 16-byte aligned whenever K % 8 == 0 (array base aligned)
  std::vector<float> ws(static_cast<size_t>(parts) * N * M, std::nanf(""));
  py::array_t<uint16_t> y({N, M});
  py::array_t<float> yf({N, M});
  std::fill(y.mutable_data(), y.mutable_data() + size_t(N) * M, uint16_t{0x7FC1});  // unwritten = NaN
  std::fill(yf.mutable_data(), yf.mutable_data() + size_t(N) * M, std::nanf(""));
  std::mt19937 rng(7);
  std::vector<uint16_t> sx(static_cast<size_t>(tile_n) * kTile);
  std::vector<WarpStage> st(kWarps);
  std::vector<float> acc(static_cast<size_t>(kWarps) * nt8 * 32 * 4);

  for (int bx = 0; bx * tile_n < N; ++bx)
    for (int tm = 0; tm < c.Mt; ++tm)
      for (int part = 0; part < parts; ++part) {
        const int col0 = bx * tile_n, ncols = N - col0;
        int kb, ke;
        splitk_range(c.Kt, parts, part, &kb, &ke);
        if (perturb & 16) ke -= 1;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int kt = kb; kt < ke; ++kt) {
          const int64_t g = int64_t{tm} * c.Kt + kt;
          const uint64_t* bmp = c.bitmaps + g * kPlanes * kFragsPerTile;
          // issue_x, chunk by chunk (both the cp.async and the element-wise path
          // of the kernel store the same 8 elements; the cp.async path must only
          // be taken for chunks wholly inside K).
          for (auto& v : sx) v = static_cast<uint16_t>(rng());
          for (int ci = 0; ci < tile_n * 8; ++ci) {
            const XChunk xc = x_chunk(ci, col0, kt, N, K, x_vec);
            if (xc.vec && xc.k0 + 8 > K) throw std::logic_error("cp.async chunk crosses K");
            for (int e = 0; e < 8; ++e)
              sx[xc.dst + e] = (xc.n_ok && xc.k0 + e < K) ? X[int64_t{xc.n} * K + xc.k0 + e] : uint16_t{0};
          }
          for (int warp = 0; warp < kWarps; ++warp) stage_warp(st[warp], c, g, warp, rng);
          for (int warp = 0; warp < kWarps; ++warp) {
            const WarpSegment& seg = st[warp].seg;
            int hrun = 0;
            for (int kg = 0; kg < 4; ++kg) {
              uint32_t af[32][4];
              for (int j = 0; j < 4; ++j) {
                const int jj = (perturb & 2) ? (j == 1 ? 2 : j == 2 ? 1 : j) : j;
                const int f = a_frag_ft(warp, kg, jj);
                const uint64_t p0 = bmp[f], p1 = bmp[64 + f], p2 = bmp[128 + f];
                // hrun runs over the FTs in kernel order (kg, j); with the a1/a2
                // swap the FT's own running count is rebuilt so only the register
                // assignment is wrong.
                int hr = 0;
                for (int ff = warp * kFtPerMed; ff < f; ++ff)
                  hr += popc64(indicator(bmp[ff], bmp[64 + ff], bmp[128 + ff]));
                if (!(perturb & 2) && hr != hrun) throw std::logic_error("running count disagrees");
                const int i_ft = f - warp * kFtPerMed;
                for (int lane = 0; lane < 32; ++lane) {
                  const int dl = (perturb & 1) ? lane ^ 1 : lane;
                  af[lane][j] = decode_lane_pair(p0, p1, p2, c.base[g], st[warp].sm.data(), st[warp].fb.data(),
                                                 ft_sm_before(seg, hr),
                                                 ft_fb_before(seg, i_ft, hr) + ((perturb & 8) ? 1 : 0), dl);
                }
                if (!(perturb & 2)) hrun += popc64(indicator(p0, p1, p2));
              }
              for (int t = 0; t < nt8; ++t) {
                if (!(t * 8 < ncols)) continue;
                uint32_t bf[32][2];
                for (int lane = 0; lane < 32; ++lane) {
                  const int n = t * 8 + b_frag_n(lane);
                  const int k = kg * 16 + b_frag_k(lane, 0, 0);
                  for (int r = 0; r < 2; ++r) {
                    const int idx = (perturb & 4) ? n * kTile + k + 8 * r : b_frag_smem(t, kg, lane, r);
                    bf[lane][r] = sx[idx] | (uint32_t{sx[idx + 1]} << 16);  // one 32-bit LDS
                  }
                }
                float (&a4)[32][4] = *reinterpret_cast<float(*)[32][4]>(&acc[((size_t)warp * nt8 + t) * 128]);
                mma_emul(a4, af, bf);
              }
            }
          }
        }
        // Epilogue.
        for (int warp = 0; warp < kWarps; ++warp)
          for (int t = 0; t < nt8; ++t)
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 4; ++r) {
                int m = c_out_m(tm, warp, lane, r), n = c_out_n(col0, t, lane, r);
                if (perturb & 32) {  // rows and columns of the C fragment swapped
                  m = tm * kTile + warp * kMedRows + c_frag_n(lane, r);
                  n = col0 + t * 8 + c_frag_m(lane, r);
                }
                const float v = acc[(((size_t)warp * nt8 + t) * 32 + lane) * 4 + r];
                if (m < M && n < N) {
                  if (parts == 1) {
                    const float s = epilogue_sum(&v, 0, 1, bias, m);
                    y.mutable_data()[y_index(n, m, M)] = f32_to_bf16_bits(s);
                    yf.mutable_data()[y_index(n, m, M)] = s;
                  } else {
                    ws[ws_index(part, n, m, N, M)] = v;
                  }
                }
              }
      }
  if (parts > 1) {  // splitk_reduce
    const int64_t mn = int64_t{M} * N;
    for (int64_t i = 0; i < mn; ++i) {
      const float s = epilogue_sum(ws.data() + i, mn, parts, bias, static_cast<int>(i % M));
      y.mutable_data()[i] = f32_to_bf16_bits(s);
      yf.mutable_data()[i] = s;
    }
  }
  return py::make_tuple(y, yf);
}

// Replay of encode_tiles_kernel (csrc/cuda/encode.cu), thread by thread.
// Returns (bitmaps [Mt, Kt, 3, 64], base [Mt, Kt], hcount [G], scratch_sm [G, 4096], scratch_fb [G, 4096]).
py::tuple emulate_encode_tiles(const Arr<uint16_t>& w) {
  if (w.ndim() != 2 || w.shape(0) < 1 || w.shape(1) < 1) throw std::invalid_argument("w must be a non-empty 2-D array");
  const int M = static_cast<int>(w.shape(0)), K = static_cast<int>(w.shape(1));
  const int Mt = (M + kTile - 1) / kTile, Kt = (K + kTile - 1) / kTile;
  const int64_t G = int64_t{Mt} * Kt;
  py::array_t<uint64_t> bitmaps({int64_t{Mt}, int64_t{Kt}, int64_t{kPlanes}, int64_t{kFragsPerTile}});
  py::array_t<uint8_t> base({Mt, Kt});
  py::array_t<int64_t> hcount(G);
  py::array_t<uint8_t> ssm({G, int64_t{kTileElems}});
  py::array_t<uint16_t> sfb({G, int64_t{kTileElems}});
  std::memset(ssm.mutable_data(), 0xCD, size_t(G) * kTileElems);           // scratch is uninitialised on the GPU
  std::memset(sfb.mutable_data(), 0xCD, size_t(G) * kTileElems * 2);
  const uint16_t* W = w.data();
  constexpr int T = enc::kThreads, P = enc::kPerThread;
  std::vector<uint16_t> v(size_t(T) * P);
  std::vector<char> ok(size_t(T) * P);
  std::vector<unsigned> code(size_t(T) * P);
  for (int64_t g = 0; g < G; ++g) {
    const int tm = static_cast<int>(g / Kt), tk = static_cast<int>(g % Kt);
    int hist[256] = {};
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < P; ++i) {
        const int q = enc::elem_q(t, i), r = tm * kTile + enc::elem_row(q), c = tk * kTile + enc::elem_col(q);
        const size_t e = size_t(t) * P + i;
        ok[e] = r < M && c < K;
        v[e] = ok[e] ? W[int64_t{r} * K + c] : uint16_t{0};
        if (ok[e]) ++hist[(v[e] >> 7) & 0xFF];
      }
    int best = -1;
    for (int t = 0; t < kMaxWindowStart; ++t) {
      int cover = 0;
      for (int e = 0; e < kWindow; ++e) cover += hist[t + kMinWindowStart + e];
      best = std::max(best, enc::window_key(cover, t));
    }
    const int base_exp = enc::base_of_key(best);
    uint64_t* planes = bitmaps.mutable_data() + g * kPlanes * kFragsPerTile;
    std::memset(planes, 0, sizeof(uint64_t) * kPlanes * kFragsPerTile);
    int h = 0;  // the block scan, in thread order
    for (int t = 0; t < T; ++t) {
      const int f = enc::thread_ft(t), pos0 = enc::thread_bit0(t);
      for (int i = 0; i < P; ++i) {
        const size_t e = size_t(t) * P + i;
        code[e] = enc::code_of(v[e], ok[e], base_exp);
        for (int b = 0; b < kPlanes; ++b) planes[b * kFragsPerTile + f] |= uint64_t((code[e] >> b) & 1u) << (pos0 + i);
      }
      for (int i = 0; i < P; ++i) {
        const size_t e = size_t(t) * P + i;
        const int q = enc::elem_q(t, i);
        if (code[e] != 0u) {
          ssm.mutable_data()[g * kTileElems + h] = enc::sm_byte_of(v[e], ok[e]);
          ++h;
        } else {
          sfb.mutable_data()[g * kTileElems + (q - h)] = v[e];
        }
      }
    }
    base.mutable_data()[g] = static_cast<uint8_t>(base_exp);
    hcount.mutable_data()[g] = h;
  }
  return py::make_tuple(bitmaps, base, hcount, ssm, sfb);
}

// Replay of encode_scatter_kernel: streams of S bytes / F elements, zero-initialised.
py::tuple emulate_encode_scatter(const Arr<int64_t>& hcount, const Arr<int64_t>& offsets, const Arr<uint8_t>& ssm,
                                 const Arr<uint16_t>& sfb, int64_t S, int64_t F) {
  const int64_t G = hcount.size();
  if (offsets.size() != 2 * G || ssm.size() != G * kTileElems || sfb.size() != G * kTileElems)
    throw std::invalid_argument("scatter arrays do not agree in tile count");
  py::array_t<uint8_t> sm(S);
  py::array_t<uint16_t> fb(F);
  std::memset(sm.mutable_data(), 0, size_t(S));
  std::memset(fb.mutable_data(), 0, size_t(F) * 2);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hcount.data()[g], osm = offsets.data()[2 * g], ofb = offsets.data()[2 * g + 1];
    if (osm < 0 || osm + h > S || ofb < 0 || ofb + (kTileElems - h) > F) throw std::out_of_range("scatter out of the streams");
    std::memcpy(sm.mutable_data() + osm, ssm.data() + g * kTileElems, size_t(h));
    std::memcpy(fb.mutable_data() + ofb, sfb.data() + g * kTileElems, size_t(kTileElems - h) * 2);
  }
  return py::make_tuple(sm, fb);
}

// Hazard check of the fused kernel's pipeline schedule (pipe_* in
// zipgemm_layout.cuh) for a split part of nt K tiles. Events happen in
// program order; "wait_all + __syncthreads" ends an epoch and completes every
// pending cp.async. Within one epoch the warps are not ordered, so a buffer
// that is both read and written in an epoch is a race; a read must see the
// tile it expects, written in an earlier epoch. Returns the violations
// (empty = the schedule is sound). nbmp overrides the planes buffer count
// (negative test).
std::vector<std::string> pipeline_check(int nt, int nbmp) {
  std::vector<std::string> bad;
  struct Buf {
    int tile = -1, pending = -1;        // committed tile, tile in flight
    bool read = false, written = false; // in the current epoch
  };
  std::vector<Buf> bmp(std::max(nbmp, 3)), stage(2);
  auto end_epoch = [&]() {
    for (auto* v : {&bmp, &stage})
      for (auto& b : *v) {
        if (b.pending >= 0) b.tile = b.pending;
        b.pending = -1;
        b.read = b.written = false;
      }
  };
  auto write = [&](std::vector<Buf>& v, int idx, int tile, const std::string& what) {
    Buf& b = v[idx];
    if (b.read) bad.push_back(what + ": buffer " + std::to_string(idx) + " written while read in the same epoch");
    b.pending = tile;
    b.written = true;
  };
  auto read = [&](std::vector<Buf>& v, int idx, int tile, const std::string& what) {
    Buf& b = v[idx];
    if (b.written) bad.push_back(what + ": buffer " + std::to_string(idx) + " read while written in the same epoch");
    if (b.tile != tile)
      bad.push_back(what + ": buffer " + std::to_string(idx) + " holds tile " + std::to_string(b.tile) + ", wants " +
                    std::to_string(tile));
    b.read = true;
  };
  if (nt <= 0) return bad;
  write(bmp, pipe_issue_bmp(-2, nbmp), 0, "prologue planes(0)");
  end_epoch();
  read(bmp, pipe_counts_bmp(-1, nbmp), 0, "prologue counts(0)");
  write(stage, pipe_issue_stage(-1), 0, "prologue values(0)");
  if (nt > 1) write(bmp, pipe_issue_bmp(-1, nbmp), 1, "prologue planes(1)");
  for (int i = 0; i < nt; ++i) {
    end_epoch();
    const std::string it = " (i=" + std::to_string(i) + ")";
    if (i + 1 < nt) {
      read(bmp, pipe_counts_bmp(i, nbmp), i + 1, "counts" + it);
      write(stage, pipe_issue_stage(i), i + 1, "values/X" + it);
    }
    if (i + 2 < nt) write(bmp, pipe_issue_bmp(i, nbmp), i + 2, "planes" + it);
    read(bmp, pipe_compute_bmp(i, nbmp), i, "compute planes" + it);
    read(stage, pipe_compute_stage(i), i, "compute stage" + it);
  }
  return bad;
}

uint16_t f32_to_bf16(float f) { return f32_to_bf16_bits(f); }

}  // namespace

PYBIND11_MODULE(_emul, m) {
  m.doc() = "CPU emulation of the zipserv CUDA kernels (host build of decode_lane.h / zipgemm_layout.cuh)";
  m.def("lane_decode_one", &lane_decode_one, "decode_lane_pair for one lane (host build)");
  m.def("lane_decode_matrix", &lane_decode_matrix, py::arg("bitmaps"), py::arg("base"), py::arg("offsets"),
        py::arg("sm"), py::arg("fb"), py::arg("M"), py::arg("K"), py::arg("perturb") = 0,
        "Every lane of every FT of every tile through decode_lane_pair -> W [M, K] (uint16 bits)");
  m.def("emulate_decompress", &emulate_decompress, "Replay of the decompress kernel -> W [M, K]");
  m.def("emulate_zipgemm", &emulate_zipgemm, py::arg("x"), py::arg("bitmaps"), py::arg("base"), py::arg("offsets"),
        py::arg("sm"), py::arg("fb"), py::arg("bias"), py::arg("M"), py::arg("K"), py::arg("tile_n"),
        py::arg("split"), py::arg("perturb") = 0,
        "Fragment-level replay of the fused kernel (+ split-K reduction) -> (y bf16 bits, y fp32)");
  m.def("emulate_encode_tiles", &emulate_encode_tiles, "Replay of the GPU encoder's per-tile kernel");
  m.def("emulate_embedding", &emulate_embedding, py::arg("ids"), py::arg("bitmaps"), py::arg("base"),
        py::arg("offsets"), py::arg("sm"), py::arg("fb"), py::arg("M"), py::arg("K"), py::arg("rows"),
        "The embedding kernel's block body (gather_layout.cuh) run for every thread of every block -> bf16 bits [n, K]");
  m.def("emulate_encode_scatter", &emulate_encode_scatter, "Replay of the GPU encoder's scatter kernel");
  m.def("pipeline_check", &pipeline_check, py::arg("nt"), py::arg("nbmp") = kBmpBuffers,
        "Hazards of the fused kernel's buffer schedule for nt K tiles (empty list = sound)");
  m.def("splitk_parts", [](int kt, int split) { return splitk_parts(kt, split); });
  m.def("fused_smem_bytes", [](int tile_n) { return fused_smem_bytes(tile_n); });
  m.def("decompress_smem_bytes", []() { return decompress_smem_bytes(); });
  m.def("f32_to_bf16", &f32_to_bf16, "The kernels' fp32 -> bf16 rounding (RNE)");
  m.attr("PERTURBATIONS") = py::dict(py::arg("lane") = 1, py::arg("a_regs") = 2, py::arg("x_swizzle") = 4,
                                     py::arg("fb_offset") = 8, py::arg("splitk_range") = 16, py::arg("c_map") = 32);
}
