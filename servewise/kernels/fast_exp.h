// exp(x) in float, written so that loops over it vectorize (std::exp does not): x = k ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (truncation error under 1.3e-7 relative),
// times 2^k assembled in the exponent bits. Inputs are clamped to [-87, 88], where 2^k stays a normal
// float: exp(-87) is 1.6e-38 instead of a smaller subnormal, which no softmax or sigmoid here can tell.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace servewise {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;  // ln2 in two parts: k * hi is exact
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace servewise
