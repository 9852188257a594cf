// RMSNorm, optionally fused with the residual add: one pass writes x + residual (rounded to
// the input dtype, like the reference) and accumulates the sum of squares, a second pass scales.
#pragma once
#include "common.h"

namespace tideflow {

template <typename T, typename W>
void rms_norm_rows(const T* x, const T* res, const W* w, T* out, T* res_out, int64_t rows,
                   int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    T* orow = out + r * hidden;
    const T* src = xr;
    float sumsq = 0.f;
    if (res != nullptr) {
      const T* rr = res + r * hidden;
      T* sr = res_out + r * hidden;
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < hidden; ++i) {
        T s = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        sr[i] = s;
        float v = to_f(s);
        sumsq += v * v;
      }
      src = sr;
    } else {
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < hidden; ++i) {
        float v = to_f(xr[i]);
        sumsq += v * v;
      }
    }
    const float inv = 1.f / std::sqrt(sumsq / float(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) orow[i] = from_f<T>(to_f(src[i]) * inv * to_f(w[i]));
  }
}

inline void rms_norm_launch(const at::Tensor& x, const at::Tensor* res, const at::Tensor& weight,
                            at::Tensor& out, at::Tensor* res_out, double eps) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden, "rms_norm: weight has ", weight.numel(),
              " elements, hidden size is ", hidden);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  dispatch(x, "rms_norm x", [&](auto xt) {
    using T = decltype(xt);
    dispatch(weight, "rms_norm weight", [&](auto wt) {
      using W = decltype(wt);
      rms_norm_rows<T, W>(cptr<T>(x), res ? cptr<T>(*res) : nullptr, cptr<W>(weight),
                          mptr<T>(out), res_out ? mptr<T>(*res_out) : nullptr, rows, hidden,
                          float(eps));
    });
  });
}

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  rms_norm_launch(xc, nullptr, wc, out, nullptr, eps);
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                             const at::Tensor& residual,
                                                             const at::Tensor& weight,
                                                             double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes(), "rms_norm: residual shape ", residual.sizes(),
              " differs from x shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "rms_norm: residual dtype ",
              residual.scalar_type(), " differs from x dtype ", x.scalar_type());
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  auto res_out = at::empty_like(xc);
  rms_norm_launch(xc, &rc, wc, out, &res_out, eps);
  return {out, res_out};
}

}  // namespace tideflow
