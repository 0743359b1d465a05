// Paged decode attention on CPU: one query token per request; keys and values are read in place
// from the block pool through the request's block table (no gather into a padded batch).
//
// q: [B, H, D]; k_cache, v_cache: [num_blocks * block_size, KVH, D] (one layer's flat pool, any
// row stride); block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, H, D].
// A work item is one request: each token's keys (and values) of all KV heads are one contiguous row,
// read once, and the H / KVH query heads of a group share it. (Items of (request, KV head) pairs read
// every row in halves, twice: at 256 requests of 257-320 tokens, 2 threads, AVX-512, per request
// took 5.9-6.1 ms in four of five runs against 7.2-8.6 ms, with bit-identical outputs; the kernel
// streams the KV cache from memory there.) Scores, softmax and the weighted sum of values
// accumulate in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

constexpr int64_t kFixedTokens = 8;  // a request's work outside its context, in tokens' worth

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t k_row = k_cache.stride(0), v_row = v_cache.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // Each thread takes a run of requests with an equal share of the work (context tokens, plus a few for
  // a request's fixed cost), not an equal count: in a batch of mixed contexts an equal count leaves one
  // thread idle while the other finishes the long ones.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  std::vector<int64_t> first(nt + 1, B);
  first[0] = 0;
  int64_t total = 0, done = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b] + kFixedTokens;
  for (int64_t b = 0, t = 1; b < B && t < nt; ++b) {
    done += lens[b] + kFixedTokens;
    while (t < nt && done * nt >= total * t) first[t++] = b + 1;
  }
  at::parallel_for(0, nt, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    for (int64_t b = first[t_begin]; b < first[t_end]; ++b) {
      const int64_t n = lens[b];
      const int64_t* table = bt + b * max_blocks;
      const T* qb = qp + b * H * D;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(qb[i]) * fscale;
      scores.resize(H * n);
      for (int64_t t = 0; t < n; ++t) {  // a token's keys of all heads are one contiguous row
        const T* krow = kp + (table[t / block_size] * block_size + t % block_size) * k_row;
        for (int64_t h = 0; h < KVH; ++h) {
          const T* k = krow + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = &qf[(h * G + g) * D];
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(k[d]);
            scores[(h * G + g) * n + t] = s;
          }
        }
      }
      for (int64_t hq = 0; hq < H; ++hq) {
        float* s = &scores[hq * n];
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          const float e = servewise::fast_exp(s[t] - m);
          s[t] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* vrow = vp + (table[t / block_size] * block_size + t % block_size) * v_row;
        for (int64_t h = 0; h < KVH; ++h) {
          const T* v = vrow + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[(h * G + g) * n + t];
            float* a = &acc[(h * G + g) * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      T* ob = op + b * H * D;
      for (int64_t i = 0; i < H * D; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3, "caches must be [slots, KVH, D]");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == q.size(2) && v_cache.stride(2) == 1 &&
                  v_cache.stride(1) == q.size(2), "each cache slot must hold its heads contiguously");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "dtype mismatch");
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q, k_cache, v_cache, bt, lens, block_size, scale, out);
  });
  return out;
}

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor silu_mul_(at::Tensor& gate, const at::Tensor& up);
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) (CPU)");
  m.def("silu_mul_", &silu_mul_, "silu(gate) * up, over gate (CPU)");
  m.def("rotary_", &rotary_, "rotary embedding in place (CPU)");
}
