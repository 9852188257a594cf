// Shared device helpers: dtype codes shared with tideflow_kernels/cuda/library.py, fp32 <-> bf16,
// and warp reductions. Standalone CUDA C++ (no torch headers): launchers take raw pointers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define TF_DTYPE_F32 0
#define TF_DTYPE_BF16 1

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of up to 1024 threads; every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = lane < nwarps ? partial[lane] : 0.f;
  return warp_sum(v);
}

template <typename A, typename B>
__device__ __forceinline__ float warp_dot(const A* a, const B* b, int n) {
  float acc = 0.f;
  for (int i = threadIdx.x & 31; i < n; i += 32) acc += to_f(a[i]) * to_f(b[i]);
  return warp_sum(acc);
}

#define TF_DISPATCH(code, T, ...)                 \
  do {                                            \
    if ((code) == TF_DTYPE_F32) {                 \
      typedef float T;                            \
      __VA_ARGS__;                                \
    } else if ((code) == TF_DTYPE_BF16) {         \
      typedef __nv_bfloat16 T;                    \
      __VA_ARGS__;                                \
    } else {                                      \
      return (int)cudaErrorInvalidValue;          \
    }                                             \
  } while (0)
