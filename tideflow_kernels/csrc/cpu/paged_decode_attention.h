// Decode attention over a paged KV cache: one task per (sequence, kv head) handles that head's
// whole query group, so each K/V row is read once for all grouped-query heads. Scores come from the
// register-tiled dot products (4 cache rows against up to 4 query heads at once), the weighted sum of
// the values from sums held in registers (head sizes 64 and 128), and the cache is walked block by
// block, so no position needs a division to find its block.
#pragma once
#include <limits>
#include <vector>

#include "common.h"
#include "tile_dot.h"

namespace tideflow {

// Asks for the rows of one cache block (one kv head) ahead of their use. At decode the cache is cold:
// the whole model streamed through the caches since the last step, and a block is 4-8 KB somewhere in
// a large cache, so without this each row waits on memory in turn. 32 sequences x 160 positions, 8/2
// heads, bf16, after streaming 400 MB: 793-848 us without, 594-648 us with; 211-331 us cache-hot.
template <typename T>
inline void prefetch_block(const T* rows, int64_t n, int64_t row_stride, int64_t dim) {
  const int64_t bytes = dim * int64_t(sizeof(T));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows + i * row_stride) + off, 0, 3);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32: the bits move to the upper half
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// acc[g * dim + d] = sum_p w[g * len + p] * v_p[d] for NG query heads of one (sequence, kv head), with
// dim = 16 * DV: the sums stay in NG x DV registers over the whole context, so each value row is loaded
// once per NG heads and no partial sum goes through memory.
template <int DV, int NG, typename T, typename I>
inline void weighted_values_n(const T* vc, const I* table, int64_t len, int64_t block_size, int64_t row_stride,
                              const float* w, float* acc) {
  __m512 a[NG][DV];
  for (int g = 0; g < NG; ++g)
    for (int d = 0; d < DV; ++d) a[g][d] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < len; p0 += block_size) {
    const T* block = vc + int64_t(table[p0 / block_size]) * block_size * row_stride;
    const int64_t n = std::min(block_size, len - p0);
    for (int64_t i = 0; i < n; ++i) {
      const T* vr = block + i * row_stride;
      __m512 v[DV];
      for (int d = 0; d < DV; ++d) v[d] = load16(vr + 16 * d);
      for (int g = 0; g < NG; ++g) {
        const __m512 wg = _mm512_set1_ps(w[g * len + p0 + i]);
        for (int d = 0; d < DV; ++d) a[g][d] = _mm512_fmadd_ps(wg, v[d], a[g][d]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + (g * DV + d) * 16, a[g][d]);
}

// All `group` heads, in chunks of as many as 16 accumulator registers hold (4 heads of 64, 2 of 128).
template <int DV, typename T, typename I>
inline void weighted_values(const T* vc, const I* table, int64_t len, int64_t block_size, int64_t row_stride,
                            const float* w, int64_t group, float* acc) {
  constexpr int kChunk = DV >= 8 ? 2 : 4;
  for (int64_t g0 = 0; g0 < group; g0 += kChunk) {
    const float* wg = w + g0 * len;
    float* ag = acc + g0 * DV * 16;
    switch (std::min<int64_t>(kChunk, group - g0)) {
      case 1: weighted_values_n<DV, 1>(vc, table, len, block_size, row_stride, wg, ag); break;
      case 2: weighted_values_n<DV, 2>(vc, table, len, block_size, row_stride, wg, ag); break;
      case 3: weighted_values_n<DV, (kChunk >= 3 ? 3 : 1)>(vc, table, len, block_size, row_stride, wg, ag); break;
      default: weighted_values_n<DV, kChunk>(vc, table, len, block_size, row_stride, wg, ag); break;
    }
  }
}
#endif

// s[g * len + i] = scale * dot(key i, query head g) for the n keys of one block: tiles of R keys by up to TT
// query heads. A group of 1-2 heads takes 8 keys a tile: with 4 keys by 2 heads the tile holds 8
// accumulators, each summed across its lanes on its own; 8 x 2 fills the 16 that one transposing reduction
// sums together (tile_dot.h), a third of the instructions per key at head size 64.
template <int R, int TT, typename T>
inline void block_scores(const T* block, int64_t n, int64_t row_stride, const T* const* qrows, int64_t group,
                         int64_t dim, float scale, float* s, int64_t len) {
  for (int64_t i = 0; i < n; i += R) {
    const T* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = block + std::min<int64_t>(i + r, n - 1) * row_stride;
    const int live = int(std::min<int64_t>(R, n - i));
    for (int64_t g0 = 0; g0 < group; g0 += TT) {
      const int nt = int(std::min<int64_t>(TT, group - g0));
      float r[R][TT];
      tile_dot<R, TT>(rows, qrows + g0, nt, dim, r);
      for (int pr = 0; pr < live; ++pr)
        for (int t = 0; t < nt; ++t) s[(g0 + t) * len + i + pr] = r[pr][t] * scale;
    }
  }
}

template <typename T, typename I>
void paged_attention_rows(const T* q, const T* kc, const T* vc, const I* tables, const I* lens,
                          T* out, int64_t batch, int64_t hq, int64_t hk, int64_t dim,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = hq / hk;
  const int64_t row_stride = hk * dim;  // between consecutive positions of one block
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
#pragma omp parallel
  {
    std::vector<float> scores(group * max_len), acc(group * dim), denom(group);
    std::vector<const T*> qrows(group);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < hk; ++h) {
        const int64_t len = lens[b];
        const I* table = tables + b * max_blocks;
        for (int64_t g = 0; g < group; ++g) qrows[g] = q + (b * hq + h * group + g) * dim;
        for (int64_t p0 = 0; p0 < len; p0 += block_size) {
          const T* block = kc + int64_t(table[p0 / block_size]) * block_size * row_stride + h * dim;
          const int64_t n = std::min(block_size, len - p0);
          if (p0 + block_size < len)  // the next block's keys, and this block's values for the weighted sum
            prefetch_block(kc + int64_t(table[p0 / block_size + 1]) * block_size * row_stride + h * dim,
                           std::min(block_size, len - p0 - block_size), row_stride, dim);
          prefetch_block(vc + int64_t(table[p0 / block_size]) * block_size * row_stride + h * dim, n, row_stride, dim);
          float* s = scores.data() + p0;
          if (group <= 2) block_scores<8, 2>(block, n, row_stride, qrows.data(), group, dim, scale, s, len);
          else block_scores<4, 4>(block, n, row_stride, qrows.data(), group, dim, scale, s, len);
        }
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
#if defined(__AVX512F__)
        if (dim == 64 || dim == 128) {
          const T* vh = vc + h * dim;
          if (dim == 64) weighted_values<4>(vh, table, len, block_size, row_stride, scores.data(), group, acc.data());
          else weighted_values<8>(vh, table, len, block_size, row_stride, scores.data(), group, acc.data());
        } else
#endif
        {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t p0 = 0; p0 < len; p0 += block_size) {
            const T* block = vc + int64_t(table[p0 / block_size]) * block_size * row_stride + h * dim;
            const int64_t n = std::min(block_size, len - p0);
            for (int64_t i = 0; i < n; ++i) {
              const T* vr = block + i * row_stride;
              for (int64_t g = 0; g < group; ++g) {
                const float w = scores[g * len + p0 + i];
                float* a = acc.data() + g * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) a[d] += w * to_f(vr[d]);
              }
            }
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
