// Softmax + top-k + renormalise, one warp per token: k rounds of a warp arg-max over the
// token's logits (kept in shared memory, chosen entries masked), lower index wins ties.
#include <math_constants.h>

#include "common.cuh"

constexpr int kWarpsPerBlock = 4;

template <typename T>
__global__ void gating_kernel(const T* logits, float* weights, int64_t* ids, int64_t tokens,
                              int experts, int k, int renormalize) {
  extern __shared__ float vals[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;
  float* v = vals + warp * experts;
  const T* row = logits + t * experts;
  float mx = -CUDART_INF_F;
  for (int e = lane; e < experts; e += 32) {
    v[e] = to_f(row[e]);
    mx = fmaxf(mx, v[e]);
  }
  mx = warp_max(mx);
  float denom = 0.f;
  for (int e = lane; e < experts; e += 32) denom += __expf(v[e] - mx);
  denom = warp_sum(denom);
  __syncwarp();
  float chosen = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = -CUDART_INF_F;
    int best_id = experts;
    for (int e = lane; e < experts; e += 32)
      if (v[e] > best) best = v[e], best_id = e;
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (ob > best || (ob == best && oi < best_id)) best = ob, best_id = oi;
    }
    const float w = expf(best - mx) / denom;
    chosen += w;
    if (lane == 0) {
      weights[t * k + j] = w;
      ids[t * k + j] = best_id;
      v[best_id] = -CUDART_INF_F;
    }
    __syncwarp();
  }
  if (renormalize && lane == 0)
    for (int j = 0; j < k; ++j) weights[t * k + j] /= chosen;
}

extern "C" int tf_topk_gating(const void* logits, float* weights, int64_t* ids, int64_t tokens,
                              int64_t experts, int64_t k, int renormalize, int dtype, void* stream) {
  if (tokens == 0) return 0;
  const int blocks = int((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const size_t shared = sizeof(float) * kWarpsPerBlock * experts;
  cudaStream_t s = (cudaStream_t)stream;
  TF_DISPATCH(dtype, T,
      gating_kernel<T><<<blocks, 32 * kWarpsPerBlock, shared, s>>>(
          (const T*)logits, weights, ids, tokens, int(experts), int(k), renormalize));
  return (int)cudaGetLastError();
}
