// Kernels that misuse the CUDA model on purpose, one per class of mistake the
// SIMT harness must catch, and small probes of its built-ins (mma.sync, warp
// shuffles). Compiled like the real kernels (ZIPSERV_SIMT, target.cuh); run
// by tests/simt/test_harness.py through zipserv_vllm._simt.selftest.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device_common.cuh"
#include "simt/selftest.h"

namespace simt {
namespace selftest {
namespace {

using zipserv::dev::cp_async16;
using zipserv::dev::cp_async_commit;
using zipserv::dev::cp_async_wait_all;
using zipserv::dev::mma_bf16_16816;

struct Args {
  uint32_t* out;      // per-thread results
  const uint32_t* in;
  int arg, width, op;
};

__global__ void barrier_divergent(Args a) {
  if (threadIdx.x < 32) __syncthreads();
  a.out[threadIdx.x] = 1;
}

__global__ void barrier_sites(Args a) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  a.out[threadIdx.x] = 1;
}

__global__ void collective_divergent(Args a) {
  if (threadIdx.x < 16) a.out[threadIdx.x] = __reduce_add_sync(0xFFFFFFFFu, 1u);
  else a.out[threadIdx.x] = __shfl_sync(0xFFFFFFFFu, 1u, 0);
}

__global__ void collective_exited(Args a) {
  if (threadIdx.x < 31) a.out[threadIdx.x] = __reduce_add_sync(0xFFFFFFFFu, 1u);
}

// Thread 0 reads its cp.async destination before and after its wait.
__global__ void read_before_wait(Args a) {
  ZS_SHARED(uint32_t, buf, [4]);
  if (threadIdx.x == 0) {
    cp_async16(buf, a.in);
    cp_async_commit();
    a.out[0] = buf[0];  // before the wait: garbage (poisoned under ASan)
    cp_async_wait_all();
    a.out[1] = buf[0];
  }
}

__global__ void cp_async_misaligned(Args a) {
  ZS_SHARED(uint32_t, buf, [4]);
  cp_async16(buf, a.in + 1);
  cp_async_wait_all();
  a.out[threadIdx.x] = buf[0];
}

__global__ void cp_async_to_global(Args a) {
  cp_async16(a.out, a.in);
  cp_async_wait_all();
}

// Thread 0 writes, the last thread reads, no barrier between: a race.
__global__ void shared_race(Args a) {
  ZS_SHARED(uint32_t, x, );
  if (threadIdx.x == 0) x = a.in[0];
  if (threadIdx.x == blockDim.x - 1) a.out[0] = x;
}

// The same with the barrier: well defined.
__global__ void shared_ordered(Args a) {
  ZS_SHARED(uint32_t, x, );
  if (threadIdx.x == 0) x = a.in[0];
  __syncthreads();
  if (threadIdx.x == blockDim.x - 1) a.out[0] = x;
}

// One element past a __shared__ array.
__global__ void shared_overflow(Args a) {
  ZS_SHARED(uint32_t, arr, [8]);
  arr[threadIdx.x] = a.in[0];
  __syncthreads();
  a.out[threadIdx.x] = arr[threadIdx.x];
}

__global__ void dynamic_touch(Args a) {
  ZS_DYNAMIC_SHARED(smem);
  smem[threadIdx.x] = 1;
  a.out[threadIdx.x] = smem[threadIdx.x];
}

// Each lane runs one mma.sync with registers in[lane * 10 .. + 10): a[4], b[2], c[4] (floats as bits).
__global__ void mma_probe(Args a) {
  const uint32_t* r = a.in + threadIdx.x * 10;
  uint32_t af[4] = {r[0], r[1], r[2], r[3]};
  float c[4];
  std::memcpy(c, r + 6, 16);
  mma_bf16_16816(c, af, r[4], r[5]);
  std::memcpy(a.out + threadIdx.x * 4, c, 16);
}

__global__ void shuffle_probe(Args a) {
  const unsigned v = a.in[threadIdx.x];
  unsigned r = 0;
  switch (a.op) {
    case 0: r = __shfl_sync(0xFFFFFFFFu, v, a.arg, a.width); break;
    case 1: r = __shfl_up_sync(0xFFFFFFFFu, v, a.arg, a.width); break;
    case 2: r = __shfl_down_sync(0xFFFFFFFFu, v, a.arg, a.width); break;
    case 3: r = __shfl_xor_sync(0xFFFFFFFFu, v, a.arg, a.width); break;
    case 4: r = __reduce_add_sync(0xFFFFFFFFu, v); break;
    case 5: r = __ballot_sync(0xFFFFFFFFu, v & 1u); break;
    case 6: r = static_cast<unsigned>(__any_sync(0xFFFFFFFFu, v & 1u)); break;
    case 7: r = static_cast<unsigned>(__all_sync(0xFFFFFFFFu, v & 1u)); break;
  }
  a.out[threadIdx.x] = r;
}

}  // namespace

Result run(const std::string& name, const std::vector<uint32_t>& in, int threads, int arg, int width, int op,
           int dynamic_smem) {
  Result res;
  std::vector<uint32_t> out_buf(std::max(threads * 4, 16), 0xDEADBEEFu);
  // inputs copied into a 16-byte aligned buffer (cp.async sources must be)
  uint32_t* src = nullptr;
  if (posix_memalign(reinterpret_cast<void**>(&src), 16, std::max<size_t>(16, in.size() * 4))) throw std::bad_alloc();
  std::memset(src, 0, std::max<size_t>(16, in.size() * 4));
  if (!in.empty()) std::memcpy(src, in.data(), in.size() * 4);
  Args a{out_buf.data(), src, arg, width, op};
  const dim3 grid(1), block(static_cast<unsigned>(threads));
  cudaStream_t st = nullptr;
  if (name == "barrier_divergent") ZS_LAUNCH(barrier_divergent, grid, block, 0, st)(a);
  else if (name == "barrier_sites") ZS_LAUNCH(barrier_sites, grid, block, 0, st)(a);
  else if (name == "collective_divergent") ZS_LAUNCH(collective_divergent, grid, block, 0, st)(a);
  else if (name == "collective_exited") ZS_LAUNCH(collective_exited, grid, block, 0, st)(a);
  else if (name == "read_before_wait") ZS_LAUNCH(read_before_wait, grid, block, 0, st)(a);
  else if (name == "cp_async_misaligned") ZS_LAUNCH(cp_async_misaligned, grid, block, 0, st)(a);
  else if (name == "cp_async_to_global") ZS_LAUNCH(cp_async_to_global, grid, block, 0, st)(a);
  else if (name == "shared_race") ZS_LAUNCH(shared_race, grid, block, 0, st)(a);
  else if (name == "shared_ordered") ZS_LAUNCH(shared_ordered, grid, block, 0, st)(a);
  else if (name == "shared_overflow") ZS_LAUNCH(shared_overflow, grid, block, 0, st)(a);
  else if (name == "dynamic_touch") ZS_LAUNCH(dynamic_touch, grid, block, dynamic_smem, st)(a);
  else if (name == "dynamic_touch_raised") {
    const cudaError_t e = cudaFuncSetAttribute(dynamic_touch, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem);
    if (e == cudaSuccess) ZS_LAUNCH(dynamic_touch, grid, block, dynamic_smem, st)(a);
    else res.error = static_cast<int>(e);
  } else if (name == "mma_probe") ZS_LAUNCH(mma_probe, grid, block, 0, st)(a);
  else if (name == "shuffle_probe") ZS_LAUNCH(shuffle_probe, grid, block, 0, st)(a);
  else {
    std::free(src);
    throw std::invalid_argument("no self-test named " + name);
  }
  const cudaError_t e = cudaGetLastError();
  if (!res.error) res.error = static_cast<int>(e);
  if (res.error) res.message = cudaGetErrorString(static_cast<cudaError_t>(res.error));
  res.out = out_buf;
  std::free(src);
  if (name == "dynamic_touch_raised")  // back to the default for the next test
    cudaFuncSetAttribute(dynamic_touch, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024);
  return res;
}

}  // namespace selftest
}  // namespace simt
