// A decoder layer's element-wise work on CPU, one pass over memory each: RMSNorm (with the residual
// add before it), SiLU(gate) * up, rotary embeddings in place, and the new keys and values into the
// cache. PyTorch runs each of these as several operators, every one a full pass over a [tokens, hidden]
// activation; a 4,096-token prefill of a 1,024-wide model moves those activations through memory a dozen
// times per layer. Arithmetic is
// in float whatever the storage type; reductions are vectorized, so sums are not in PyTorch's order
// (results differ from the PyTorch path in the last bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace {

constexpr int64_t kRowGrain = 16;  // rows per parallel work item

template <typename T>
void norm_rows(const T* x, const T* delta, T* sum_out, const T* w, T* out, int64_t rows, int64_t n,
               int64_t x_stride, int64_t d_stride, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      if (delta != nullptr) {
        const T* dr = delta + r * d_stride;
        T* sr = sum_out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
          v[i] = static_cast<float>(sr[i]);
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          v[i] = static_cast<float>(xr[i]);
          ss += v[i] * v[i];
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(v[i] * inv * static_cast<float>(w[i]));
    }
  });
}

template <typename T>
void silu_mul_rows(T* g, const T* u, int64_t rows, int64_t n, int64_t u_stride) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* gr = g + r * n;
      const T* ur = u + r * u_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = static_cast<float>(gr[i]);
        gr[i] = static_cast<T>(a / (1.f + servewise::fast_exp(-a)) * static_cast<float>(ur[i]));
      }
    }
  });
}

template <typename T>
void rotate_rows(T* x, const int64_t* pos, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t D,
                 int64_t row) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + pos[t] * D;
      const T* s = sin + pos[t] * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * row + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          v[i] = static_cast<T>(x1 * static_cast<float>(c[i]) - x2 * static_cast<float>(s[i]));
          v[i + half] = static_cast<T>(x2 * static_cast<float>(c[i + half]) + x1 * static_cast<float>(s[i + half]));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": weight must be a contiguous [hidden] vector of x's dtype");
}

}  // namespace

// RMSNorm of each row: x / sqrt(mean(x^2) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, nullptr, weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), 0, static_cast<float>(eps));
  });
  return out;
}

// (x + delta, RMSNorm(x + delta)): the residual stream and the next sublayer's input, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta must match x");
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  auto out = at::empty_like(sum);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(),
                        weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                        delta.stride(0), static_cast<float>(eps));
  });
  return {sum, out};
}

// silu(gate) * up, written over gate (both [rows, n], contiguous rows); returns gate.
at::Tensor silu_mul_(at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.device().is_cpu() && gate.dim() == 2 && gate.is_contiguous(), "silu_mul_: gate must be contiguous");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.stride(1) == 1 && up.scalar_type() == gate.scalar_type(),
              "silu_mul_: up must match gate");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul_", [&] {
    silu_mul_rows<scalar_t>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), gate.size(0), gate.size(1),
                            up.stride(0));
  });
  return gate;
}

// Rotary embedding in place on x: [tokens, heads, head_dim] (any token stride, heads contiguous), as
// Hugging Face's rotate_half: out = x * cos + [-x2, x1] * sin, with cos, sin: [positions, head_dim].
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: x must be [tokens, heads, head_dim] with each token's heads contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0),
              "rotary_: positions must be int64 [tokens]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2) && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin must be contiguous [positions, head_dim] of x's dtype");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), max_pos = cos.size(0);
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "rotary_: position out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotate_rows<scalar_t>(x.data_ptr<scalar_t>(), p, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), T, H, D,
                          x.stride(0));
  });
}

// A step's keys and values [tokens, kv_heads, head_dim] (each token's heads contiguous, any token stride:
// views of the fused projection's output) copied into cache [2, slots, kv_heads, head_dim] at `slots`:
// one call for both, where index_copy_ takes one each and its dispatch.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(k.device().is_cpu() && cache.device().is_cpu(), "write_kv runs on CPU tensors");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == cache.scalar_type() &&
                  v.scalar_type() == cache.scalar_type(),
              "write_kv: k and v must be [tokens, kv_heads, head_dim] of the cache's dtype");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), n = H * D;
  for (const auto& x : {k, v})
    TORCH_CHECK(x.stride(2) == 1 && (H == 1 || x.stride(1) == D), "write_kv: each token's heads must be contiguous");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(2) == H && cache.size(3) == D &&
                  cache.stride(3) == 1 && (H == 1 || cache.stride(2) == D),
              "write_kv: cache must be [2, slots, kv_heads, head_dim], each slot contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T,
              "write_kv: slots must be int64 [tokens]");
  auto sl = slots.contiguous();
  const int64_t* s = sl.data_ptr<int64_t>();
  const int64_t S = cache.size(1), es = cache.element_size();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < S, "write_kv: slot ", s[t], " out of range [0, ", S, ")");
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(cache.data_ptr());
  char* vc = kc + cache.stride(0) * es;
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es, cs = cache.stride(1) * es, bytes = n * es;
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + s[t] * cs, kp + t * ks, bytes);
      std::memcpy(vc + s[t] * cs, vp + t * vs, bytes);
    }
  });
}
