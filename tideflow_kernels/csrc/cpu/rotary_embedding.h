// Rotate-half rotary embedding over [T, H, D] views (token and head strides honoured, so
// q/k sliced out of a fused qkv projection need no copy); cos|sin halves per position.
#pragma once
#include "common.h"

namespace tideflow {

template <typename T>
void rotary_rows(const T* x, T* out, const int64_t* pos, const float* cs, int64_t tokens,
                 int64_t heads, int64_t dim, int64_t st, int64_t sh) {
  const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= kParallelGrain)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cosv = cs + pos[t] * dim;
    const float* sinv = cosv + half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * st + h * sh;
      T* orow = out + (t * heads + h) * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(xr[i]);
        const float x2 = to_f(xr[i + half]);
        orow[i] = from_f<T>(x1 * cosv[i] - x2 * sinv[i]);
        orow[i + half] = from_f<T>(x2 * cosv[i] + x1 * sinv[i]);
      }
    }
  }
}

inline at::Tensor rotary_one(const at::Tensor& x_in, const at::Tensor& pos, const at::Tensor& cs) {
  TORCH_CHECK(x_in.dim() == 3, "rotary_embedding: expected [T, H, D], got ", x_in.sizes());
  TORCH_CHECK(x_in.size(2) == cs.size(1), "rotary_embedding: head dim ", x_in.size(2),
              " differs from cos_sin width ", cs.size(1));
  auto x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  dispatch(x, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(cptr<T>(x), mptr<T>(out), pos.data_ptr<int64_t>(), cs.data_ptr<float>(),
                   x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1));
  });
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q,
                                                           const at::Tensor& k,
                                                           const at::Tensor& positions,
                                                           const at::Tensor& cos_sin) {
  auto pos = positions.to(at::kLong).contiguous();
  auto cs = cos_sin.to(at::kFloat).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "rotary_embedding: ", pos.numel(), " positions for ",
              q.size(0), " tokens");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)  // checked here: no exceptions inside the omp loop
    TORCH_CHECK(p[t] >= 0 && p[t] < cs.size(0), "rotary_embedding: position ", p[t],
                " outside the table of ", cs.size(0));
  return {rotary_one(q, pos, cs), rotary_one(k, pos, cs)};
}

}  // namespace tideflow
