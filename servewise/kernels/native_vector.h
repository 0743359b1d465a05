// The machine's own vector of floats, for kernels written with GCC's vector extensions: 16 lanes (one
// register) with AVX-512, 8 otherwise. Wider vectors than the registers cost dearly: on AVX2 GCC keeps
// 16-lane vectors on the stack and shuffles them across registers.
#pragma once

#include <cstdint>
#include <cstring>

namespace servewise {

#if defined(__AVX512F__)
constexpr int kNative = 16;
#else
constexpr int kNative = 8;
#endif
typedef float vn __attribute__((vector_size(kNative * sizeof(float))));
typedef int32_t vni __attribute__((vector_size(kNative * sizeof(int32_t))));

inline vn load_native(const float* p) {
  vn v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace servewise
