// Register-tiled dot products: R weight rows against up to TT activation rows at once (4 x 4, 2 x 8 or
// 8 x 2: 16 accumulators), so each weight vector loaded from memory feeds TT multiply-adds. Decode is bound by
// streaming the weights, and this reads each weight row once per tile of tokens (from L1 for the second
// tile on). bf16 uses the
// AVX512-BF16 dot-product instruction (two bf16 products summed into an fp32 lane), fp32 plain FMA; a
// build without AVX-512 (arch 'cpu', x86-64-v3) falls back to the portable dot().
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace tideflow {

constexpr int kTileTokens = 4;  // TT unless a caller asks for 8

// Portable fallback: out[r][t] = dot(w[r], x[t]).
template <int R, int NT, int TT, typename T>
inline void tile_dot_generic(const T* const* w, const T* const* x, int64_t len, float (*out)[TT]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = dot(w[r], x[t], len);
}

// Horizontal sums of R x NT accumulators into out[r][t]. A full tile of 16 accumulators (4 x 4, or 2 x 8)
// comes out of one transposing reduction (4 shuffle+add levels, 15 adds in all) instead of 16 separate
// lane reductions: with a short dot product (hidden 512: 16 steps of 32 bf16) those reductions cost
// about as many instructions as the products. After the levels, float 4(k % 4) + k / 4 of the result
// holds the sum of accumulator k (counted row by row), which is where it is read from.
#if defined(__AVX512F__)
template <int R, int NT, int TT>
inline void reduce_tile(__m512 (&acc)[R][NT], float (*out)[TT]) {
  if constexpr (R * NT == 16) {
    const __m512* a = &acc[0][0];
    __m512 s[8], u[4];
    for (int m = 0; m < 8; ++m) {  // a[2m], a[2m+1] -> halves of the 128-bit lanes summed
      const __m512 v = a[2 * m], w = a[2 * m + 1];
      s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x44), _mm512_shuffle_f32x4(v, w, 0xEE));
    }
    for (int n = 0; n < 4; ++n)  // lane k of u[n]: the 4 partial sums of a[4n + k]
      u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * n], s[2 * n + 1], 0x88),
                           _mm512_shuffle_f32x4(s[2 * n], s[2 * n + 1], 0xDD));
    const __m512 p = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x88), _mm512_shuffle_ps(p, q, 0xDD));
    alignas(64) float sums[16];
    _mm512_store_ps(sums, r);
    for (int row = 0; row < R; ++row)
      for (int t = 0; t < NT; ++t) {
        const int k = row * NT + t;
        out[row][t] = sums[4 * (k % 4) + k / 4];
      }
  } else {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
  }
}
#endif

template <int R, int NT, int TT>
inline void tile_dot_n(const float* const* w, const float* const* x, int64_t len, float (*out)[TT]) {
#if defined(__AVX512F__)
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_ps(x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w[r] + i);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w[r] + i);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  reduce_tile<R, NT, TT>(acc, out);
#else
  tile_dot_generic<R, NT, TT>(w, x, len, out);
#endif
}

template <int R, int NT, int TT>
inline void tile_dot_n(const uint16_t* const* w, const uint16_t* const* x, int64_t len, float (*out)[TT]) {
#if defined(__AVX512BF16__)
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_loadu_si512(x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[r] + i);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  }
  if (i < len) {  // masked lanes load as +0.0, which adds nothing
    const __mmask32 m = __mmask32((uint64_t(1) << (len - i)) - 1);
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w[r] + i);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  }
  reduce_tile<R, NT, TT>(acc, out);
#else
  tile_dot_generic<R, NT, TT>(w, x, len, out);
#endif
}

// out[r][t] = dot(w[r], x[t]) for r < R and t < nt (1..TT): R rows by TT tokens, at most 16 accumulators.
template <int R, int TT = kTileTokens, typename T>
inline void tile_dot(const T* const* w, const T* const* x, int nt, int64_t len, float (*out)[TT]) {
  static_assert(R * TT <= 16 && (TT == 2 || TT == 4 || TT == 8), "tile_dot: 2, 4 or 8 tokens, 16 accumulators at most");
  if constexpr (TT == 2) {
    if (nt == 1) return tile_dot_n<R, 1, TT>(w, x, len, out);
    return tile_dot_n<R, 2, TT>(w, x, len, out);
  } else {
    switch (nt) {
      case 1: return tile_dot_n<R, 1, TT>(w, x, len, out);
      case 2: return tile_dot_n<R, 2, TT>(w, x, len, out);
      case 3: return tile_dot_n<R, 3, TT>(w, x, len, out);
    }
    if constexpr (TT == 4) {
      return tile_dot_n<R, 4, TT>(w, x, len, out);
    } else {
      switch (nt) {
        case 4: return tile_dot_n<R, 4, TT>(w, x, len, out);
        case 5: return tile_dot_n<R, 5, TT>(w, x, len, out);
        case 6: return tile_dot_n<R, 6, TT>(w, x, len, out);
        case 7: return tile_dot_n<R, 7, TT>(w, x, len, out);
        default: return tile_dot_n<R, 8, TT>(w, x, len, out);
      }
    }
  }
}

}  // namespace tideflow
