// Rotate-half rotary embedding: one block per token over all heads; input strides honoured so
// q/k views of a fused projection need no copy; output is contiguous [T, H, D].
#include "common.cuh"

template <typename T>
__global__ void rotary_kernel(const T* x, T* out, const int64_t* pos, const float* cos_sin,
                              int heads, int dim, int64_t token_stride, int64_t head_stride) {
  const int64_t t = blockIdx.x;
  const int half = dim / 2;
  const float* cosv = cos_sin + pos[t] * dim;
  const float* sinv = cosv + half;
  for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    const T* xr = x + t * token_stride + h * head_stride;
    T* orow = out + (t * heads + h) * dim;
    const float x1 = to_f(xr[i]), x2 = to_f(xr[i + half]);
    orow[i] = from_f<T>(x1 * cosv[i] - x2 * sinv[i]);
    orow[i + half] = from_f<T>(x2 * cosv[i] + x1 * sinv[i]);
  }
}

extern "C" int tf_rotary_embedding(const void* x, void* out, const int64_t* positions,
                                   const float* cos_sin, int64_t tokens, int64_t heads, int64_t dim,
                                   int64_t token_stride, int64_t head_stride, int dtype,
                                   void* stream) {
  if (tokens == 0) return 0;
  const int64_t work = heads * dim / 2;
  const int threads = work >= 512 ? 512 : ((int(work) + 31) / 32) * 32;
  cudaStream_t s = (cudaStream_t)stream;
  TF_DISPATCH(dtype, T,
      rotary_kernel<T><<<tokens, threads, 0, s>>>((const T*)x, (T*)out, positions, cos_sin,
                                                  int(heads), int(dim), token_stride, head_stride));
  return (int)cudaGetLastError();
}
