// Shared helpers for the CPU ops: dtype dispatch and fp32 <-> bf16 conversion that the
// compiler can vectorise (bit shifts instead of c10's branchy conversions).
#pragma once
#include <ATen/ATen.h>
#include <omp.h>

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

// expf that vectorises inside `omp simd` loops (Cephes polynomial, ~2 ulp); inputs below
// -87 give ~1e-38 instead of 0, which is harmless for softmax weights.
inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += to_f(a[i]) * to_f(b[i]);
  return acc;
}

}  // namespace tideflow
