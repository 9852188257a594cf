// Router gating in one pass per token: softmax over experts in fp32, top-k by insertion
// (k is small), optional renormalisation of the chosen weights.
#pragma once
#include <limits>

#include "common.h"

namespace tideflow {

template <typename T>
void gating_rows(const T* logits, float* w_out, int64_t* id_out, int64_t tokens, int64_t experts,
                 int64_t k, bool renormalize) {
#pragma omp parallel for schedule(static) if (tokens * experts >= kParallelGrain)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = logits + t * experts;
    float* w = w_out + t * k;
    int64_t* ids = id_out + t * k;
    for (int64_t j = 0; j < k; ++j) {
      w[j] = -std::numeric_limits<float>::infinity();
      ids[j] = -1;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < experts; ++e) {
      const float v = to_f(row[e]);
      mx = v > mx ? v : mx;
      if (v > w[k - 1] || ids[k - 1] < 0) {  // strict: the lower index wins a tie
        int64_t j = k - 1;
        while (j > 0 && (v > w[j - 1] || ids[j - 1] < 0)) {
          w[j] = w[j - 1];
          ids[j] = ids[j - 1];
          --j;
        }
        w[j] = v;
        ids[j] = e;
      }
    }
    float denom = 0.f;
#pragma omp simd reduction(+ : denom)
    for (int64_t e = 0; e < experts; ++e) denom += vexp(to_f(row[e]) - mx);
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      w[j] = vexp(w[j] - mx) / denom;
      chosen += w[j];
    }
    if (renormalize)
      for (int64_t j = 0; j < k; ++j) w[j] /= chosen;
  }
}

inline std::tuple<at::Tensor, at::Tensor> topk_gating(const at::Tensor& logits_in, int64_t k,
                                                      bool renormalize) {
  TORCH_CHECK(logits_in.dim() == 2, "topk_gating: expected [T, E] logits, got ", logits_in.sizes());
  auto logits = logits_in.contiguous();
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= experts, "topk_gating: k=", k, " must be in [1, ", experts, "]");
  auto weights = at::empty({tokens, k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({tokens, k}, logits.options().dtype(at::kLong));
  dispatch(logits, "topk_gating", [&](auto tag) {
    using T = decltype(tag);
    gating_rows<T>(cptr<T>(logits), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), tokens,
                   experts, k, renormalize);
  });
  return {weights, ids};
}

}  // namespace tideflow
