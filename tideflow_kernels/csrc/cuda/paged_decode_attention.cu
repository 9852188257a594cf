// Paged decode attention: one block per (sequence, query head), each warp streams a strided
// share of the positions with an online softmax (running max, sum and D-wide accumulator kept
// in registers, D <= 256), then the warps' partial states are merged in shared memory.
#include <math_constants.h>

#include "common.cuh"

constexpr int kAttnWarps = 4;
constexpr int kMaxDimPerLane = 8;  // D <= 256

template <typename T>
__global__ void paged_attention_kernel(const T* q, const T* kc, const T* vc, const int* tables,
                                       const int* lens, T* out, int hq, int hk, int dim,
                                       int block_size, int max_blocks, float scale) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int kvh = h / (hq / hk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int len = lens[b];
  const int* table = tables + int64_t(b) * max_blocks;
  const T* qr = q + (int64_t(b) * hq + h) * dim;
  float qv[kMaxDimPerLane], acc[kMaxDimPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < dim ? to_f(qr[d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -CUDART_INF_F, l = 0.f;
  const int64_t row_stride = int64_t(hk) * dim;
  for (int p = warp; p < len; p += kAttnWarps) {
    const int64_t base = (int64_t(table[p / block_size]) * block_size + p % block_size) * row_stride +
                         int64_t(kvh) * dim;
    float sdot = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < dim) sdot += qv[i] * to_f(kc[base + d]);
    }
    const float s = warp_sum(sdot);
    const float m_new = fmaxf(m, s);
    const float correction = __expf(m - m_new);
    const float w = __expf(s - m_new);
    l = l * correction + w;
#pragma unroll
    for (int i = 0; i < kMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * correction + (d < dim ? w * to_f(vc[base + d]) : 0.f);
    }
    m = m_new;
  }
  __shared__ float sm[kAttnWarps], sl[kAttnWarps];
  __shared__ float sacc[kAttnWarps][32 * kMaxDimPerLane];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) sacc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  float gm = -CUDART_INF_F;
  for (int w = 0; w < kAttnWarps; ++w) gm = fmaxf(gm, sm[w]);
  float gl = 0.f, scale_w[kAttnWarps];
  for (int w = 0; w < kAttnWarps; ++w) {
    scale_w[w] = sl[w] > 0.f ? __expf(sm[w] - gm) : 0.f;
    gl += sl[w] * scale_w[w];
  }
  const float inv = gl > 0.f ? 1.f / gl : 0.f;
  T* orow = out + (int64_t(b) * hq + h) * dim;
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d >= dim) continue;
    float v = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) v += sacc[w][d] * scale_w[w];
    orow[d] = from_f<T>(v * inv);
  }
}

extern "C" int tf_paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                         const int* block_tables, const int* context_lens, void* out,
                                         int64_t batch, int64_t hq, int64_t hk, int64_t dim,
                                         int64_t block_size, int64_t max_blocks, float scale,
                                         int dtype, void* stream) {
  if (dim > 32 * kMaxDimPerLane || hk == 0 || hq % hk != 0) return (int)cudaErrorInvalidValue;
  if (batch == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  const dim3 grid((unsigned)batch, (unsigned)hq);
  TF_DISPATCH(dtype, T,
      paged_attention_kernel<T><<<grid, 32 * kAttnWarps, 0, s>>>(
          (const T*)q, (const T*)k_cache, (const T*)v_cache, block_tables, context_lens, (T*)out,
          int(hq), int(hk), int(dim), int(block_size), int(max_blocks), scale));
  return (int)cudaGetLastError();
}
