// RMSNorm fused with the residual add: one block per row; the rounded sum is written first
// and re-read for the scale pass (it is what the reference normalises).
#include "common.cuh"

template <typename T, typename W>
__global__ void rms_norm_kernel(const T* x, const T* res, const W* w, T* out, T* res_out, int hidden,
                                float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  const T* src = xr;
  float sumsq = 0.f;
  if (res != nullptr) {
    const T* rr = res + row * hidden;
    T* sr = res_out + row * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      T s = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
      sr[i] = s;
      const float v = to_f(s);
      sumsq += v * v;
    }
    src = sr;
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float v = to_f(xr[i]);
      sumsq += v * v;
    }
  }
  const float inv = rsqrtf(block_sum(sumsq) / hidden + eps);
  T* orow = out + row * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    orow[i] = from_f<T>(to_f(src[i]) * inv * to_f(w[i]));
}

extern "C" int tf_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                           void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                           int weight_dtype, void* stream) {
  if (rows == 0) return 0;
  const int threads = hidden >= 1024 ? 1024 : ((int(hidden) + 31) / 32) * 32;
  cudaStream_t s = (cudaStream_t)stream;
  TF_DISPATCH(dtype, T, TF_DISPATCH(weight_dtype, W,
      rms_norm_kernel<T, W><<<rows, threads, 0, s>>>((const T*)x, (const T*)residual,
                                                     (const W*)weight, (T*)out, (T*)residual_out,
                                                     int(hidden), eps)));
  return (int)cudaGetLastError();
}
