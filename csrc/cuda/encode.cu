// GPU encoder, byte-identical to zipserv_vllm.format.reference.encode.
//
// Kernel 1 (encode_tiles_kernel, one tile per 256-thread block): exponent
// histogram of the non-padding elements, the 7-wide window (largest cover,
// smallest start on ties), codes, the three bit-planes, and the tile's
// compaction into scratch (sm bytes and fallback patterns in increasing q),
// plus H. Python then derives segment lengths (Hp, Fp), their exclusive prefix
// sums (the canonical offsets, torch.cumsum), allocates zeroed streams, and
// kernel 2 (encode_scatter_kernel) copies each tile's scratch into its segment.
#include "device_common.cuh"
#include "encode_layout.cuh"
#include "launch.h"

namespace zipserv {
namespace cuda {
namespace {

using namespace zipserv::enc;
constexpr int kEncThreads = enc::kThreads;

__global__ void __launch_bounds__(kEncThreads) encode_tiles_kernel(EncodeArgs a) {
  ZS_SHARED(int, hist, [256]);
  ZS_SHARED(unsigned long long, planes, [kPlanes * kFragsPerTile]);
  ZS_SHARED(int, best, );
  ZS_SHARED(int, warp_tot, [kEncThreads / 32]);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kt = (a.K + kTile - 1) / kTile;
  const int64_t gl = blockIdx.x;
  const int tm = a.tm0 + static_cast<int>(gl / kt), tk = static_cast<int>(gl % kt);

  hist[tid] = 0;
  if (tid < kPlanes * kFragsPerTile) planes[tid] = 0ull;
  if (tid == 0) best = -1;
  __syncthreads();

  uint16_t v[kPerThread];
  bool ok[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int q = elem_q(tid, i);
    const int r = tm * kTile + elem_row(q), c = tk * kTile + elem_col(q);
    ok[i] = r < a.M && c < a.K;
    v[i] = ok[i] ? a.w[static_cast<int64_t>(r) * a.K + c] : uint16_t{0};
    if (ok[i]) atomicAdd(&hist[(v[i] >> 7) & 0xFF], 1);
  }
  __syncthreads();

  if (tid < kMaxWindowStart) {
    int cover = 0;
    for (int e = 0; e < kWindow; ++e) cover += hist[tid + kMinWindowStart + e];
    atomicMax(&best, window_key(cover, tid));
  }
  __syncthreads();
  const int base_exp = base_of_key(best);

  uint64_t w0 = 0, w1 = 0, w2 = 0;
  int cnt = 0;
  unsigned code[kPerThread];
  const int pos0 = thread_bit0(tid);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    code[i] = code_of(v[i], ok[i], base_exp);
    w0 |= static_cast<uint64_t>(code[i] & 1u) << (pos0 + i);
    w1 |= static_cast<uint64_t>((code[i] >> 1) & 1u) << (pos0 + i);
    w2 |= static_cast<uint64_t>((code[i] >> 2) & 1u) << (pos0 + i);
    cnt += code[i] != 0u;
  }
  const int f = thread_ft(tid);
  atomicOr(&planes[f], static_cast<unsigned long long>(w0));
  atomicOr(&planes[kFragsPerTile + f], static_cast<unsigned long long>(w1));
  atomicOr(&planes[2 * kFragsPerTile + f], static_cast<unsigned long long>(w2));

  // Exclusive scan of cnt over the block (q order = thread order).
  int incl = cnt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += o;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int before = 0, total = 0;
  for (int w = 0; w < kEncThreads / 32; ++w) {
    before += w < warp ? warp_tot[w] : 0;
    total += warp_tot[w];
  }
  int h = before + incl - cnt;

  uint8_t* ssm = a.scratch_sm + gl * kTileElems;
  uint16_t* sfb = a.scratch_fb + gl * kTileElems;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int q = elem_q(tid, i);
    if (code[i] != 0u) {
      ssm[h] = sm_byte_of(v[i], ok[i]);
      ++h;
    } else {
      sfb[q - h] = v[i];
    }
  }
  __syncthreads();  // planes complete
  if (tid < kPlanes * kFragsPerTile) a.bitmaps[gl * kPlanes * kFragsPerTile + tid] = planes[tid];
  if (tid == 0) {
    a.base[gl] = static_cast<uint8_t>(base_exp);
    a.hcount[gl] = total;
  }
}

__global__ void __launch_bounds__(kEncThreads) encode_scatter_kernel(ScatterArgs a) {
  const int64_t g = blockIdx.x;
  const int h = static_cast<int>(a.hcount[g]);
  const int64_t o_sm = a.offsets[2 * g], o_fb = a.offsets[2 * g + 1];
  const uint8_t* ssm = a.scratch_sm + g * kTileElems;
  const uint16_t* sfb = a.scratch_fb + g * kTileElems;
  for (int i = threadIdx.x; i < h; i += blockDim.x) a.sm[o_sm + i] = ssm[i];
  for (int i = threadIdx.x; i < kTileElems - h; i += blockDim.x) a.fb[o_fb + i] = sfb[i];
}

}  // namespace

int encode_tiles(const EncodeArgs& a, uintptr_t stream) {
  const int kt = (a.K + kTile - 1) / kTile;
  const int64_t g = static_cast<int64_t>(a.tm_count) * kt;
  if (a.M < 1 || a.K < 1 || a.tm_count < 1 || g > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidValue);
  ZS_LAUNCH(encode_tiles_kernel, static_cast<unsigned>(g), kEncThreads, 0, reinterpret_cast<cudaStream_t>(stream))(a);
  return static_cast<int>(cudaGetLastError());
}

int encode_scatter(const ScatterArgs& a, uintptr_t stream) {
  if (a.G < 1 || a.G > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidValue);
  ZS_LAUNCH(encode_scatter_kernel, static_cast<unsigned>(a.G), kEncThreads, 0,
            reinterpret_cast<cudaStream_t>(stream))(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace zipserv
