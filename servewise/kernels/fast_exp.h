// exp(x) in float, written so that loops over it vectorize (std::exp does not): x = k ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (truncation error under 1.3e-7 relative),
// times 2^k assembled in the exponent bits. Inputs are clamped to [-87, 88], where 2^k stays a normal
// float: exp(-87) is 1.6e-38 instead of a smaller subnormal, which no softmax or sigmoid here can tell.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__FAST_MATH__)  // (it would fold the vector form's (y + 1.5 * 2^23) - 1.5 * 2^23 into y)
#error "fast_exp.h needs IEEE float arithmetic: build without -ffast-math"
#endif

namespace servewise {

// exp(x - k ln2), k the integer nearest x / ln2, by the polynomial above (F: a float or a vector of floats).
template <typename F>
inline F exp_reduced(F x, F k) {
  const F r = x - k * 0.693359375f + k * 2.12194440e-4f;  // ln2 in two parts: k * hi is exact
  F p = r * (1.f / 720) + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float p = exp_reduced(x, k);
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The same on a GCC vector of floats V (VI: its int32 vector), lane for lane: GCC does not vectorize the
// loops over the scalar one here. Lanes are rounded to the nearest integer by adding and taking away
// 1.5 * 2^23 (exact for |x| < 2^22, ties to even as nearbyint in the default rounding mode).
template <typename V, typename VI>
inline V fast_exp(V x) {
  const V lo = V{} - 87.f, hi = V{} + 88.f, magic = V{} + 12582912.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V k = (x * 1.44269504088896341f + magic) - magic;
  const V p = exp_reduced(x, k);
  const VI bits = (__builtin_convertvector(k, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace servewise
