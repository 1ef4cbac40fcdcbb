// Where the kernels meet what runs them. The kernel sources (csrc/cuda/*.cu,
// *.cuh) are compiled two ways:
//
//  * by nvcc for a GPU: the CUDA runtime, `<<<...>>>` launches, __shared__
//    storage and inline PTX (device_common.cuh);
//  * by g++ with ZIPSERV_SIMT defined, for the SIMT harness (csrc/simt/): the
//    same source runs on the CPU, each block's threads as fibers, with
//    barriers, warp intrinsics, cp.async and mma.sync given host twins that
//    check how they are used (docs/ZIPGEMM.md, "The kernels on the CPU").
//
// The only constructs that differ are spelled through the macros below; the
// kernels contain no other #if on the target.
//
//   ZS_LAUNCH(kernel, grid, block, smem, stream)(args...)   a kernel launch
//   ZS_SHARED(T, name, dims);       __shared__ __align__(16) T name dims
//                                    (dims: "[a][b]" or empty for a scalar)
//   ZS_DYNAMIC_SHARED(name);        the block's dynamic shared memory, bytes
#pragma once

#if defined(ZIPSERV_SIMT)

#include "simt/simt.h"

#else

#include <cuda_runtime.h>

#define ZS_LAUNCH(kernel, grid, block, smem, stream) kernel<<<(grid), (block), (smem), (stream)>>>
#define ZS_SHARED(T, name, dims) __shared__ __align__(16) T name dims
#define ZS_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

#endif
