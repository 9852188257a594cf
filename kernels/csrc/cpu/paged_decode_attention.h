// Decode attention over a paged KV cache: one task per (sequence, kv head) handles that head's
// whole query group, so each K/V row is read once for all grouped-query heads.
#pragma once
#include <limits>
#include <vector>

#include "common.h"

namespace tideflow {

template <typename T, typename I>
void paged_attention_rows(const T* q, const T* kc, const T* vc, const I* tables, const I* lens,
                          T* out, int64_t batch, int64_t hq, int64_t hk, int64_t dim,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = hq / hk;
  const int64_t row_stride = hk * dim;  // between consecutive positions of one block
#pragma omp parallel
  {
    std::vector<float> scores, acc(group * dim), qf(group * dim);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < hk; ++h) {
        const int64_t len = lens[b];
        const I* table = tables + b * max_blocks;
        scores.assign(group * len, 0.f);
        for (int64_t g = 0; g < group; ++g) {
          const T* qr = q + (b * hq + h * group + g) * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_f(qr[d]) * scale;
        }
        for (int64_t p = 0; p < len; ++p) {
          const int64_t blk = table[p / block_size];
          const T* kr = kc + (blk * block_size + p % block_size) * row_stride + h * dim;
          for (int64_t g = 0; g < group; ++g) scores[g * len + p] = dot(qf.data() + g * dim, kr, dim);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        std::vector<float> denom(group, 0.f);
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * len;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t p = 0; p < len; ++p) mx = s[p] > mx ? s[p] : mx;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t p = 0; p < len; ++p) {
            s[p] = vexp(s[p] - mx);
            sum += s[p];
          }
          denom[g] = sum;
        }
        for (int64_t p = 0; p < len; ++p) {
          const int64_t blk = table[p / block_size];
          const T* vr = vc + (blk * block_size + p % block_size) * row_stride + h * dim;
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + p];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * to_f(vr[d]);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + (b * hq + h * group + g) * dim;
          const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] = from_f<T>(acc[g * dim + d] * inv);
        }
      }
    }
  }
}

inline at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                                         const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: expected q [B, Hq, D] and caches [N, block, Hk, D]");
  auto q = q_in.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t block_size = kc.size(1), hk = kc.size(2), num_blocks = kc.size(0);
  TORCH_CHECK(hq % hk == 0, "paged_decode_attention: ", hq, " query heads not a multiple of ", hk,
              " kv heads");
  TORCH_CHECK(kc.size(3) == dim && q.scalar_type() == kc.scalar_type(),
              "paged_decode_attention: q and cache head dim / dtype differ");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {  // validated here: no exceptions inside the omp loop
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= max_blocks * block_size, "paged_decode_attention: context ",
                lp[b], " of sequence ", b, " exceeds its block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && tp[b * max_blocks + i] < num_blocks,
                  "paged_decode_attention: block id ", tp[b * max_blocks + i], " out of range");
  }
  auto out = at::empty_like(q);
  dispatch(q, "paged_decode_attention", [&](auto tag) {
    using T = decltype(tag);
    paged_attention_rows<T, int64_t>(cptr<T>(q), cptr<T>(kc), cptr<T>(vc), tp, lp, mptr<T>(out),
                                     batch, hq, hk, dim, block_size, max_blocks, float(scale));
  });
  return out;
}

}  // namespace tideflow
