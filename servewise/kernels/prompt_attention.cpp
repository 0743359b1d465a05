// Causal attention of whole prompts on CPU (a prefill step's new tokens, no earlier KV): plain softmax
// attention with grouped KV heads, no window or soft cap (the caller keeps SDPA for those).
//
// q: [T, H, D]; k, v: [T, KVH, D] (rows of any stride, heads and dims contiguous); seq_lens: [B] int64,
// the prompts' lengths in order (summing to T). Returns [T, H * D].
//
// A work item is 16 consecutive queries of one query head (8 with AVX2). Their scores against each key
// are one vector: the queries sit transposed in the lanes ([D][lanes]), and each key's dimensions are
// broadcast into fused multiply-adds, so no dot product is summed across lanes (the decode kernel's
// cost). The softmax runs down the keys, lane by lane, and the weighted sum of values accumulates
// in the same layout, a few dimensions at a time. PyTorch's SDPA on 128-token prompts (tiny-llama's
// and llama-200m's shapes) ran at 50-65 GFLOP/s (120 at 1,024 tokens) on two AVX-512 cores, where the
// machine's linear layers reach 400-490; this kernel, 32 prompts of 128 tokens, llama-200m's shape, fp32:
// 150-160, then 205-220 with the queries transposed by shuffles and the next item's asked for ahead
// (docs/notes/speed.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "native_vector.h"
#include "work_split.h"

namespace {

// kQ: queries a work item, the lanes of one register (16-lane vectors in an AVX2 build ran 4-5x slower
// than SDPA); kKeys, kDims: keys scored and value dims summed at once, their accumulators in registers.
constexpr int kQ = servewise::kNative, kKeys = 8, kDims = 8;
using vq = servewise::vn;
using vqi = servewise::vni;
inline vq loadq(const float* p) { return servewise::load_native(p); }

// One item in float: queries i0 .. i0 + nq - 1 of a prompt (qt: their rows transposed and scaled,
// [D][kQ], lanes past nq zero) against its keys 0 .. i0 + nq - 1. K, V: the prompt's first rows of
// this KV head, `ks` / `vs` floats apart. S: room for (i0 + kQ) * kQ floats. Writes out[l * os + d].
template <typename T>
void tile(const float* qt, const float* K, int64_t ks, const float* V, int64_t vs, int64_t D, int64_t i0, int nq,
          float* S, T* out, int64_t os) {
  const int64_t nk = i0 + nq;
  int64_t j = 0;
  for (; j + kKeys <= nk; j += kKeys) {
    vq acc[kKeys] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vq qd = loadq(qt + d * kQ);
#pragma GCC unroll 8
      for (int u = 0; u < kKeys; ++u) acc[u] += qd * K[(j + u) * ks + d];
    }
#pragma GCC unroll 8
    for (int u = 0; u < kKeys; ++u) std::memcpy(S + (j + u) * kQ, &acc[u], sizeof(vq));
  }
  for (; j < nk; ++j) {
    vq acc = {};
    for (int64_t d = 0; d < D; ++d) acc += loadq(qt + d * kQ) * K[j * ks + d];
    std::memcpy(S + j * kQ, &acc, sizeof acc);
  }
  // causal: query i0 + l sees keys up to i0 + l
  for (int64_t jj = i0 + 1; jj < nk; ++jj)
    for (int64_t l = 0; l < jj - i0; ++l) S[jj * kQ + l] = -std::numeric_limits<float>::infinity();
  vq m = loadq(S);
  for (int64_t jj = 1; jj < nk; ++jj) {
    const vq s = loadq(S + jj * kQ);
    m = s > m ? s : m;
  }
  vq sum = {};
  for (int64_t jj = 0; jj < nk; ++jj) {
    const vq e = servewise::fast_exp<vq, vqi>(loadq(S + jj * kQ) - m);
    std::memcpy(S + jj * kQ, &e, sizeof e);
    sum += e;
  }
  const vq inv = 1.f / sum;
  float o[kDims][kQ];
  for (int64_t d0 = 0; d0 < D; d0 += kDims) {
    vq acc[kDims] = {};
    for (int64_t jj = 0; jj < nk; ++jj) {
      const vq p = loadq(S + jj * kQ);
      const float* vr = V + jj * vs + d0;
#pragma GCC unroll 8
      for (int u = 0; u < kDims; ++u) acc[u] += p * vr[u];
    }
#pragma GCC unroll 8
    for (int u = 0; u < kDims; ++u) {
      const vq y = acc[u] * inv;
      std::memcpy(o[u], &y, sizeof y);
    }
    for (int l = 0; l < nq; ++l)
      for (int u = 0; u < kDims; ++u) out[l * os + d0 + u] = static_cast<T>(o[u][l]);
  }
}

// A kQ x kQ block of floats, a[l] a row, transposed in place (a[d] then holds column d): each round
// swaps one bit of the row index with that of the column index, by two-input shuffles (one instruction
// each with AVX-512).
template <int H>
inline void transpose_block(vq* a) {
  vqi lo, hi;
  for (int j = 0; j < kQ; ++j) {
    lo[j] = (j & H) ? kQ + j - H : j;
    hi[j] = (j & H) ? kQ + j : j + H;
  }
#pragma GCC unroll 16
  for (int i = 0; i < kQ; ++i)
    if (!(i & H)) {
      const vq x = a[i], y = a[i + H];
      a[i] = __builtin_shuffle(x, y, lo);
      a[i + H] = __builtin_shuffle(x, y, hi);
    }
  if constexpr (H > 1) transpose_block<H / 2>(a);
}

template <typename T>
inline vq load_row(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadq(p);
  } else {
    vq v;
    for (int i = 0; i < kQ; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}

// qt [D][kQ] = the nq query rows q[l * qs ...] (D dims each) times scale, transposed; lanes past nq zero.
template <typename T>
void transpose_queries(const T* q, int64_t qs, int nq, int64_t D, float scale, float* qt) {
  int64_t d0 = 0;
  for (; d0 + kQ <= D; d0 += kQ) {
    vq a[kQ];
#pragma GCC unroll 16
    for (int l = 0; l < kQ; ++l) a[l] = l < nq ? load_row(q + l * qs + d0) * scale : vq{};
    transpose_block<kQ / 2>(a);
#pragma GCC unroll 16
    for (int d = 0; d < kQ; ++d) std::memcpy(qt + (d0 + d) * kQ, &a[d], sizeof(vq));
  }
  for (; d0 < D; ++d0)  // (head dims not a multiple of kQ: the last few one by one)
    for (int l = 0; l < kQ; ++l) qt[d0 * kQ + l] = l < nq ? static_cast<float>(q[l * qs + d0]) * scale : 0.f;
}

template <typename T>
void prompts(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lens, int64_t B,
             double scale, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1), G = H / KVH;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), os = H * D;
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // work items in order: prompt, KV head, query head of its group, tile (a group's items reuse its rows)
  std::vector<int64_t> first(B + 1, 0), start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    start[b + 1] = start[b] + lens[b];
    first[b + 1] = first[b] + H * ((lens[b] + kQ - 1) / kQ);
  }
  // Each thread takes a run of items with an equal share of the work (a long prompt's late tiles cost
  // many times a short prompt's). work[i]: the items before i, each its keys plus kQ for its fixed cost.
  std::vector<int64_t> work(first[B] + 1, 0);
  for (int64_t b = 0, it = 0; b < B; ++b)
    for (int64_t r = 0, tiles = (first[b + 1] - first[b]) / H; r < H * tiles; ++r, ++it)
      work[it + 1] = work[it] + (r % tiles + 2) * kQ;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), first[B]));
  const std::vector<int64_t> cut = servewise::cut_by_work(work, nt);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, nt, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> qt(D * kQ), S, kf, vf;
    int64_t loaded = -1;  // the (prompt, KV head) whose rows kf / vf hold
    struct Item {
      int64_t b, n, hq, i0, row0;
      int nq;
    };
    auto item = [&](int64_t it) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t n = lens[b], tiles = (n + kQ - 1) / kQ, r = it - first[b], i0 = (r % tiles) * kQ;
      return Item{b, n, r / tiles, i0, start[b], static_cast<int>(std::min<int64_t>(kQ, n - i0))};
    };
    Item next = cut[t_begin] < cut[t_end] ? item(cut[t_begin]) : Item{};
    for (int64_t it = cut[t_begin]; it < cut[t_end]; ++it) {
      const auto [b, n, hq, i0, row0, nq] = next;
      const int64_t h = hq / G;
      transpose_queries(qp + (row0 + i0) * qs + hq * D, qs, nq, D, fscale, qt.data());
      // The next item's query rows (a prefill's fused projection output is larger than the cache, and
      // reading them when needed cost a third of the time): asked for now, used after this tile.
      if (it + 1 < cut[t_end]) {
        const Item& nx = next = item(it + 1);
        for (int l = 0; l < nx.nq; ++l) {
          const char* src = reinterpret_cast<const char*>(qp + (nx.row0 + nx.i0 + l) * qs + nx.hq * D);
          for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
            __builtin_prefetch(src + off, 0, 3);
        }
      }
      S.resize((i0 + kQ) * kQ);
      T* o = op + (row0 + i0) * os + hq * D;
      if constexpr (std::is_same_v<T, float>) {  // (float rows are read where they are)
        tile(qt.data(), kp + row0 * ks + h * D, ks, vp + row0 * vs + h * D, vs, D, i0, nq, S.data(), o, os);
        continue;
      }
      if (loaded != b * KVH + h) {  // the prompt's rows of this KV head, contiguous and in float
        kf.resize(n * D), vf.resize(n * D);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t d = 0; d < D; ++d) {
            kf[t * D + d] = static_cast<float>(kp[(row0 + t) * ks + h * D + d]);
            vf[t * D + d] = static_cast<float>(vp[(row0 + t) * vs + h * D + d]);
          }
        loaded = b * KVH + h;
      }
      tile(qt.data(), kf.data(), D, vf.data(), D, D, i0, nq, S.data(), o, os);
    }
  });
}

}  // namespace

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prompt_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  const int64_t D = q.size(2);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == D) && t->size(2) == D,
                "each row must hold its heads contiguously");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0), "k and v must be [tokens, KVH, head_dim] as q");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1, "seq_lens must be int64 [B]");
  auto lens = seq_lens.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK(lp[b] > 0, "every prompt needs a token");
    total += lp[b];
  }
  TORCH_CHECK(total == q.size(0), "seq_lens must sum to the number of tokens");
  auto out = at::empty({q.size(0), q.size(1) * D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prompt_attention", [&] {
    prompts<scalar_t>(q, k, v, lp, lens.size(0), scale, out);
  });
  return out;
}
