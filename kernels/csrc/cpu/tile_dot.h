// Register-tiled dot products: R weight rows against up to 4 activation rows at once, so each weight
// vector loaded from memory feeds 4 multiply-adds. Decode is bound by streaming the weights, and this
// reads each weight row once per tile of tokens (from L1 for the second tile on). bf16 uses the
// AVX512-BF16 dot-product instruction (two bf16 products summed into an fp32 lane), fp32 plain FMA; a
// build without AVX-512 (arch 'cpu', x86-64-v3) falls back to the portable dot().
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace tideflow {

constexpr int kTileTokens = 4;

// Portable fallback: out[r][t] = dot(w[r], x[t]).
template <int R, int NT, typename T>
inline void tile_dot_generic(const T* const* w, const T* const* x, int64_t len, float (*out)[kTileTokens]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = dot(w[r], x[t], len);
}

template <int R, int NT>
inline void tile_dot_n(const float* const* w, const float* const* x, int64_t len, float (*out)[kTileTokens]) {
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
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#else
  tile_dot_generic<R, NT>(w, x, len, out);
#endif
}

template <int R, int NT>
inline void tile_dot_n(const uint16_t* const* w, const uint16_t* const* x, int64_t len,
                       float (*out)[kTileTokens]) {
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
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#else
  tile_dot_generic<R, NT>(w, x, len, out);
#endif
}

// out[r][t] = dot(w[r], x[t]) for r < R and t < nt (1..kTileTokens).
template <int R, typename T>
inline void tile_dot(const T* const* w, const T* const* x, int nt, int64_t len, float (*out)[kTileTokens]) {
  switch (nt) {
    case 1: return tile_dot_n<R, 1>(w, x, len, out);
    case 2: return tile_dot_n<R, 2>(w, x, len, out);
    case 3: return tile_dot_n<R, 3>(w, x, len, out);
    default: return tile_dot_n<R, 4>(w, x, len, out);
  }
}

}  // namespace tideflow
