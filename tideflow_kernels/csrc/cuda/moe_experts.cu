// MoE experts as a grouped GEMM over tokens sorted by expert:
//   1. counting sort of the (token, slot) pairs by expert id (one block, shared-memory counts);
//   2. up/gate projection + SwiGLU: grid (row tiles, experts), a warp per intermediate row j,
//      looping over its expert's tokens so the row pair stays in L1;
//   3. down projection: a warp per hidden row, weighted atomicAdd into an fp32 accumulator;
//   4. cast the accumulator to the output dtype.
#include "common.cuh"

constexpr int kWarps = 8;
constexpr int kMaxExperts = 1024;

__global__ void sort_by_expert(const int64_t* ids, const float* topk_w, int64_t pairs, int k,
                               int experts, int* offsets, int* sorted_tok, float* sorted_w) {
  __shared__ int counts[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t a = threadIdx.x; a < pairs; a += blockDim.x) {
    const int64_t e = ids[a];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < experts; ++e) {
      offsets[e] = run;
      cursor[e] = run;
      run += counts[e];
    }
    offsets[experts] = run;
  }
  __syncthreads();
  for (int64_t a = threadIdx.x; a < pairs; a += blockDim.x) {
    const int64_t e = ids[a];
    if (e < 0 || e >= experts) continue;
    const int slot = atomicAdd(&cursor[e], 1);
    sorted_tok[slot] = int(a / k);
    sorted_w[slot] = topk_w[a];
  }
}

template <typename T>
__global__ void up_swiglu(const T* x, const T* w13, const int* offsets, const int* sorted_tok,
                          float* act, int hidden, int inter) {
  const int e = blockIdx.y;
  const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int begin = offsets[e], end = offsets[e + 1];
  if (j >= inter || begin == end) return;
  const T* gate = w13 + (int64_t(e) * 2 * inter + j) * hidden;
  const T* up = gate + int64_t(inter) * hidden;
  for (int s = begin; s < end; ++s) {
    const T* xr = x + int64_t(sorted_tok[s]) * hidden;
    const float g = warp_dot(gate, xr, hidden);
    const float u = warp_dot(up, xr, hidden);
    if ((threadIdx.x & 31) == 0) act[int64_t(s) * inter + j] = g / (1.f + __expf(-g)) * u;
  }
}

template <typename T>
__global__ void down_scatter(const T* w2, const int* offsets, const int* sorted_tok,
                             const float* sorted_w, const float* act, float* acc, int hidden,
                             int inter) {
  const int e = blockIdx.y;
  const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int begin = offsets[e], end = offsets[e + 1];
  if (j >= hidden || begin == end) return;
  const T* row = w2 + (int64_t(e) * hidden + j) * inter;
  for (int s = begin; s < end; ++s) {
    const float y = warp_dot(row, act + int64_t(s) * inter, inter);
    if ((threadIdx.x & 31) == 0) atomicAdd(&acc[int64_t(sorted_tok[s]) * hidden + j], sorted_w[s] * y);
  }
}

template <typename T>
__global__ void cast_out(const float* acc, T* out, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_f<T>(acc[i]);
}

// Workspace layout (bytes, caller-allocated): offsets int[E+1] | sorted_tok int[P] |
// sorted_w float[P] | act float[P*I] | acc float[T*H], with P = tokens * k.
extern "C" int64_t tf_moe_workspace_bytes(int64_t tokens, int64_t k, int64_t experts,
                                          int64_t hidden, int64_t inter) {
  const int64_t pairs = tokens * k;
  return 4 * (experts + 1) + 4 * pairs + 4 * pairs + 4 * pairs * inter + 4 * tokens * hidden;
}

extern "C" int tf_moe_experts(const void* x, const void* w13, const void* w2, const float* topk_w,
                              const int64_t* topk_ids, void* out, void* workspace, int64_t tokens,
                              int64_t k, int64_t experts, int64_t hidden, int64_t inter, int dtype,
                              void* stream) {
  if (experts > kMaxExperts) return (int)cudaErrorInvalidValue;
  if (tokens == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  const int64_t pairs = tokens * k;
  int* offsets = (int*)workspace;
  int* sorted_tok = offsets + experts + 1;
  float* sorted_w = (float*)(sorted_tok + pairs);
  float* act = sorted_w + pairs;
  float* acc = act + pairs * inter;
  cudaMemsetAsync(acc, 0, sizeof(float) * tokens * hidden, s);
  sort_by_expert<<<1, 1024, 0, s>>>(topk_ids, topk_w, pairs, int(k), int(experts), offsets,
                                    sorted_tok, sorted_w);
  const dim3 up_grid(unsigned((inter + kWarps - 1) / kWarps), unsigned(experts));
  const dim3 down_grid(unsigned((hidden + kWarps - 1) / kWarps), unsigned(experts));
  const int64_t n = tokens * hidden;
  TF_DISPATCH(dtype, T, {
    up_swiglu<T><<<up_grid, 32 * kWarps, 0, s>>>((const T*)x, (const T*)w13, offsets, sorted_tok,
                                                 act, int(hidden), int(inter));
    down_scatter<T><<<down_grid, 32 * kWarps, 0, s>>>((const T*)w2, offsets, sorted_tok, sorted_w,
                                                      act, acc, int(hidden), int(inter));
    cast_out<T><<<unsigned((n + 255) / 256), 256, 0, s>>>(acc, (T*)out, n);
  });
  return (int)cudaGetLastError();
}
