// Shared helpers for the CPU ops: dtype dispatch and fp32 <-> bf16 conversion that the
// compiler can vectorise (bit shifts instead of c10's branchy conversions).
#pragma once
#include <ATen/ATen.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tideflow {

// bf16 tensors are handled as raw uint16_t so loads/stores are plain integer ops.
inline float to_f(float v) { return v; }
inline float to_f(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline uint16_t from_f<uint16_t>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  // Round to nearest even, NaN stays a quiet NaN (same result as c10::BFloat16).
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// Calls f(T{}) with T = float for fp32 tensors and T = uint16_t for bf16 tensors.
template <typename F>
inline auto dispatch(const at::Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, ": expected float32 or bfloat16, got ",
              t.scalar_type());
  return f(uint16_t{});
}

template <typename T>
inline const T* cptr(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }
template <typename T>
inline T* mptr(at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// Below this much work a parallel region costs more than it saves (and on a loaded machine a
// barrier can wait a whole timeslice for a descheduled thread).
constexpr int64_t kParallelGrain = 65536;

// exp(x) = 2^n * (1 + r + r^2 p(r)) with n = round(x / ln 2) and r = x - n ln 2 (ln 2 split in two
// parts for precision): Cephes' polynomial, ~2 ulp. Inputs below -87 give ~1e-38 instead of 0, which
// is harmless for softmax weights and SiLU.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// The scalar form, which vectorises inside `omp simd` loops.
inline float vexp(float x) {
  x = std::min(std::max(x, kExpMin), kExpMax);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// The same for 16 lanes, where the loop around it is written with intrinsics.
inline __m512 vexp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// SwiGLU's activation: silu(g) = g / (1 + exp(-g)).
inline float silu(float v) { return v / (1.f + vexp(-v)); }

#if defined(__AVX512F__)
// silu(g) * u on 16 lanes.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), vexp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
}
#endif

template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += to_f(a[i]) * to_f(b[i]);
  return acc;
}

}  // namespace tideflow
