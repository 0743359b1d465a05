// Paged decode attention on CPU: one query token per request; keys and values are read in place
// from the block pool through the request's block table (no gather into a padded batch).
//
// q: [B, H, D]; k_cache, v_cache: [num_blocks * block_size, KVH, D] (one layer's flat pool, any
// row stride); block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, H, D].
// A work item is one request: each token's keys (and values) of all KV heads are one contiguous row,
// read once, and the H / KVH query heads of a group share it. Scores, softmax and the weighted sum of
// values accumulate in float. Head dims that are a multiple of 16 take the vector path, in the machine's
// vector width (dot products reduced a vector's lanes at a time, bf16 keys by the CPU's bf16 dot-product
// instruction where it has one, the softmax over whole vectors, the value accumulators in registers, rows
// asked for ahead of use); others a scalar loop. At 256 requests
// of 257-320 tokens, 2 threads, AVX-512 (`servewise bench attention`, machine's stream 31.7 GB/s): KV
// read at 28.1 / 18.9 GB/s in fp32 (tiny-llama / llama-200m head shapes) and 24.3 / 19.8 in bf16; the
// scalar loop alone, side by side in one run, read 14.7 / 10.6 and 8.2 / 5.4. On an AVX2-only EPYC
// (stream 29.5 GB/s): 14.8 / 14.7 in fp32 and 13.0 / 9.4 in bf16 (docs/notes/speed.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "native_vector.h"
#include "work_split.h"

#if defined(__AVX512F__)
#include <immintrin.h>  // (the two AVX-512 paths below; every other CPU takes the portable code)
#endif

namespace {

constexpr int64_t kFixedTokens = 8;  // a request's work outside its context, in tokens' worth

// Vector path: head dims that are a multiple of 16 (64, 96, 128, 256 in every supported family). GCC's
// vector extensions, so one source serves AVX-512 (one register per 16 lanes) and AVX2 (two).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bf16 is the top half of a float: lanes widened to 32 bits and shifted (F, U16, U32: one vector width).
template <typename F, typename U16, typename U32>
inline F widen_bf16(const c10::BFloat16* p) {
  U16 u;
  std::memcpy(&u, p, sizeof u);
  const U32 w = __builtin_convertvector(u, U32) << 16;
  F v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline vf load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // (GCC lowers the portable conversion to four instructions, not one)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(w);
#else
  return widen_bf16<vf, vu16, vu32>(p);
#endif
}

template <typename T>  // half (and double): converted lane by lane
inline vf load16(const T* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// Sixteen dot products end as sixteen vectors whose lanes each must be summed. Folding them in pairs
// (each fold halves the lanes a sum still spans and doubles the sums a vector holds) takes 15 folds of
// two shuffles and an add, against 16 horizontal sums of 4 shuffles and 4 adds each. r[i] = sum(a[i]).
inline vf fold(vf x, vf y, vi lo, vi hi) { return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi); }

inline vf sum_lanes16(vf* a) {
  const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, hi8 = lo8 + 8;
  const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, hi4 = lo4 + 4;
  const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, hi2 = lo2 + 2;
  const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, hi1 = lo1 + 1;
  for (int i = 0; i < 8; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo8, hi8);
  for (int i = 0; i < 4; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo4, hi4);
  for (int i = 0; i < 2; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo2, hi2);
  return fold(a[0], a[1], lo1, hi1);
}

// bf16 keys on a CPU with AVX512_BF16: the query's dot products by vdpbf16ps (32 products an
// instruction, against 16 and a conversion).
template <typename T, int NC>
constexpr bool kBf16Dots =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> && NC % 2 == 0;
#else
    false;
#endif

// A request's blocks lie anywhere in the pool, and the hardware prefetcher does not follow a block
// table: the key pass asks for the key and value rows of the token some way ahead, so that both passes
// find them in cache. At 256 requests of 257-320 tokens, 2 threads, tiny-llama's shape, on a Xeon
// (stream 31.7 GB/s): KV read at 13-15 GB/s without, 23-28 GB/s with (64 tokens ahead, prefetcht1;
// prefetcht0 and 32 or 128 tokens did no better). On an AMD EPYC with AVX-512: 16 tokens ahead read
// 1.1-1.3x faster than 64 (8 and 24 within a few points of 16; asking also for the next request's first
// rows: no gain), and into L1 (prefetcht0) rather than L2 1.0-1.1x in fp32 and 1.1-1.6x in bf16 on
// llama-200m's shape (docs/notes/speed.md, thirteenth sitting).
// fp32 rows are also asked for a second time, further ahead and only into L2 (prefetcht2): more rows in
// flight than the L1's miss buffers hold. On the EPYC, 256 requests, 2 threads, at a 72 GB/s stream: KV
// read at 54.6 -> 58.7 GB/s (tiny-llama's shape) and 39.4 -> 44.7 (llama-200m's), at 44 GB/s 42.3 -> 44.0
// and 29.8 -> 34.4; 32, 48 or 64 tokens ahead within a few points, prefetcht1 alike. bf16 is held by its
// arithmetic there: the extra instructions cost it up to 7%, so it asks once (docs/notes/speed.md, fifteenth
// sitting). With the last-level cache flushed before each call (as a serving step finds it), 32 tokens and
// the value pass's own asks (weigh_values) together: llama-200m fp32 36.7 -> 38.2 GB/s at a 49 GB/s stream,
// the other cases 0-2% (sixteenth sitting).
constexpr int64_t kAheadTokens = 16, kAheadBytes = 128 << 10;  // (at most 128 KiB of rows in flight)
constexpr int64_t kFarTokens = 32, kFarBytes = 256 << 10;
constexpr int64_t kValueAhead = 8;  // (see weigh_values)
template <typename T>
constexpr bool kFarAhead = std::is_same_v<T, float>;

template <int kLocality = 3>  // (3: into L1; 1: into L2)
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, kLocality);
}

// One request's share of the inputs.
template <typename T>
struct Request {
  const float* q;  // [H, D] in float, times the scale
  const T* q_raw;  // [H, D] as stored
  float scale;
  const T *k, *v;  // the layer's pools
  int64_t k_row, v_row, block_size, H, KVH;
  const int64_t* table;
  int64_t n;  // context tokens
};

// The key and value rows of one slot, asked for (kLocality as in prefetch).
template <int kLocality, typename T>
inline void prefetch_rows(const Request<T>& r, int64_t slot, int64_t bytes) {
  prefetch<kLocality>(r.k + slot * r.k_row, bytes);
  prefetch<kLocality>(r.v + slot * r.v_row, bytes);
}

// The slots of a request's tokens from `from` on, in order, following its block table.
struct Slots {
  const int64_t* table;
  int64_t n, block_size, t, blk, off;
  Slots(const int64_t* table, int64_t n, int64_t block_size, int64_t from)
      : table(table), n(n), block_size(block_size), t(std::min(from, n)), blk(t / block_size), off(t % block_size) {}
  int64_t next() {  // the next token's slot, or -1 past the last
    if (t >= n) return -1;
    const int64_t slot = table[blk] * block_size + off;
    ++t;
    if (++off == block_size) off = 0, ++blk;
    return slot;
  }
};

// How many tokens ahead to ask for rows `row_bytes` each (key and value): `tokens`, or fewer where that would
// put more than `bytes` of rows in flight; at least one.
inline int64_t ahead_tokens(int64_t tokens, int64_t bytes, int64_t row_bytes) {
  return std::max<int64_t>(1, std::min(tokens, bytes / (2 * row_bytes)));
}

// Each thread takes a run of requests with an equal share of the work: context tokens, plus a few for a
// request's fixed cost. Returns the cuts: thread t takes requests cut[t] .. cut[t + 1] - 1.
inline std::vector<int64_t> cut_requests(const int64_t* lens, int64_t B) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  std::vector<int64_t> work(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) work[b + 1] = work[b] + lens[b] + kFixedTokens;
  return servewise::cut_by_work(work, nt);
}

// The key and value passes run in the machine's own vector width. AVX-512 holds a 16-lane vector in one
// register; AVX2 needs two, and there GCC keeps 16-lane vectors on the stack (the value pass's accumulators
// and weights, the key pass's pending dot products) and shuffles them across registers: 8-lane vectors on
// AVX2, and fewer query heads a value pass so that its accumulators fit the 16 registers.
using servewise::kNative, servewise::vn, servewise::vni, servewise::load_native;
constexpr int kValueHeads = kNative == 16 ? 4 : 2;
typedef uint16_t vn16 __attribute__((vector_size(kNative * sizeof(uint16_t))));
typedef uint32_t vn32 __attribute__((vector_size(kNative * sizeof(uint32_t))));

inline vn load_native(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return load16(p);
#else
  return widen_bf16<vn, vn16, vn32>(p);
#endif
}

template <typename T>
inline vn load_native(const T* p) {
  vn v;
  for (int i = 0; i < kNative; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// kNative dot products end as kNative vectors whose lanes each must be summed: r[i] = sum(a[i]). With
// 8 lanes (AVX2), two rounds of pairwise sums within each 128-bit half, then the halves added.
inline vn sum_lanes_native(vn* a) {
#if defined(__AVX512F__)
  return sum_lanes16(a);
#else
  const vni even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = even + 1;
  const vni lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = lo + 4;
  auto pairs = [&](vn x, vn y) { return __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd); };
  for (int i = 0; i < 4; ++i) a[i] = pairs(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) a[i] = pairs(a[2 * i], a[2 * i + 1]);
  return __builtin_shuffle(a[0], a[1], lo) + __builtin_shuffle(a[0], a[1], hi);
#endif
}

// Each column of S [n, H] (a query head's scores) becomes exp(s - max); inv[hq] = 1 / the column's sum.
// With fewer than 16 heads (a divisor of 16) the loops run over 16 scores at a time, whatever their
// heads, so that the exponentials fill the vector lanes: W scores a row, a multiple of H; each lane j
// keeps the max and sum of column j % H, and the lanes of one column are combined at the end. Rows of
// whole native vectors are written with them (GCC left the plain loops scalar); the rest lane by lane.
inline void softmax_columns(float* S, int64_t n, int64_t H, float* inv) {
  constexpr int64_t kMaxW = 256;
  const int64_t W = kLanes % H == 0 ? kLanes : H, N = n * H, full = N - N % W;  // W: a multiple of H
  const bool vec = W % kNative == 0 && W <= kMaxW;
  const int64_t NV = vec ? W / kNative : 0;
  std::vector<float> m(W, -std::numeric_limits<float>::infinity()), sum(W, 0.f);
  vn mv[kMaxW / kNative], sv[kMaxW / kNative];
  if (vec) {
    for (int64_t v = 0; v < NV; ++v) mv[v] = load_native(m.data() + v * kNative);
    for (int64_t i = 0; i < full; i += W)
      for (int64_t v = 0; v < NV; ++v) {
        const vn x = load_native(S + i + v * kNative);
        mv[v] = x > mv[v] ? x : mv[v];
      }
    for (int64_t v = 0; v < NV; ++v) std::memcpy(m.data() + v * kNative, &mv[v], sizeof(vn));
  } else {
    for (int64_t i = 0; i < full; i += W)
      for (int64_t j = 0; j < W; ++j) m[j] = std::max(m[j], S[i + j]);
  }
  for (int64_t i = full; i < N; ++i) m[i - full] = std::max(m[i - full], S[i]);
  for (int64_t j = H; j < W; ++j) m[j % H] = std::max(m[j % H], m[j]);
  for (int64_t j = H; j < W; ++j) m[j] = m[j % H];
  if (vec) {
    for (int64_t v = 0; v < NV; ++v) mv[v] = load_native(m.data() + v * kNative), sv[v] = vn{};
    for (int64_t i = 0; i < full; i += W)
      for (int64_t v = 0; v < NV; ++v) {
        const vn e = servewise::fast_exp<vn, vni>(load_native(S + i + v * kNative) - mv[v]);
        std::memcpy(S + i + v * kNative, &e, sizeof e);
        sv[v] += e;
      }
    for (int64_t v = 0; v < NV; ++v) std::memcpy(sum.data() + v * kNative, &sv[v], sizeof(vn));
  } else {
    for (int64_t i = 0; i < full; i += W)
      for (int64_t j = 0; j < W; ++j) {
        S[i + j] = servewise::fast_exp(S[i + j] - m[j]);
        sum[j] += S[i + j];
      }
  }
  for (int64_t i = full; i < N; ++i) {
    S[i] = servewise::fast_exp(S[i] - m[i - full]);
    sum[i - full] += S[i];
  }
  for (int64_t j = H; j < W; ++j) sum[j % H] += sum[j];
  for (int64_t hq = 0; hq < H; ++hq) inv[hq] = 1.f / sum[hq];
}

// Scores S[t * H + hq] of every token and query head: each key row is loaded once per KV head and
// its G query heads' dot products gathered kNative at a time for sum_lanes_native. Asks for the rows
// ahead (see prefetch).
template <typename T, int NC>
void score_keys(const Request<T>& r, float* S) {
  constexpr int64_t D = NC * kLanes;
  constexpr int NN = D / kNative;
  const int64_t G = r.H / r.KVH, row_bytes = r.KVH * D * sizeof(T);
  vn pending[kNative];
  int np = 0;
  float* at = S;  // where the pending scores go: they come in S's order
  auto push = [&](vn a) {
    pending[np++] = a;
    if (np == kNative) {
      const vn sums = sum_lanes_native(pending);
      std::memcpy(at, &sums, sizeof sums);
      at += kNative;
      np = 0;
    }
  };
  auto ahead_by = [&](int64_t tokens, int64_t bytes) {
    return Slots(r.table, r.n, r.block_size, ahead_tokens(tokens, bytes, row_bytes));
  };
  Slots ahead = ahead_by(kAheadTokens, kAheadBytes), far = ahead_by(kFarTokens, kFarBytes);
  for (int64_t blk = 0, t = 0; t < r.n; ++blk) {
    const int64_t slot0 = r.table[blk] * r.block_size, end = std::min(r.n, t + r.block_size);
    for (int64_t slot = slot0; t < end; ++t, ++slot) {
      const T* krow = r.k + slot * r.k_row;
      if (const int64_t a = ahead.next(); a >= 0) prefetch_rows<3>(r, a, row_bytes);
      if constexpr (kFarAhead<T>)
        if (const int64_t a = far.next(); a >= 0) prefetch_rows<1>(r, a, row_bytes);
      for (int64_t h = 0; h < r.KVH; ++h) {
        if constexpr (kBf16Dots<T, NC>) {
#if defined(__AVX512BF16__)
          __m512bh k[NC / 2];
          for (int c = 0; c < NC / 2; ++c)
            k[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(krow + h * D + 2 * c * kLanes));
          for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
            const T* qh = r.q_raw + hq * D;
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < NC / 2; ++c)
              a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh + 2 * c * kLanes)), k[c]);
            push(reinterpret_cast<vn>(a) * r.scale);
          }
#endif
        } else {
          vn k[NN];
#pragma GCC unroll 16
          for (int c = 0; c < NN; ++c) k[c] = load_native(krow + h * D + c * kNative);
          for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
            const float* qh = r.q + hq * D;
            vn a = load_native(qh) * k[0];
#pragma GCC unroll 16
            for (int c = 1; c < NN; ++c) a += load_native(qh + c * kNative) * k[c];
            push(a);
          }
        }
      }
    }
  }
  if (np > 0) {
    const int used = np;
    while (np < kNative) pending[np++] = vn{};
    const vn sums = sum_lanes_native(pending);
    std::memcpy(at, &sums, used * sizeof(float));
  }
}

// The values of KV heads h .. h + KH - 1 weighted by the probabilities P of query heads hq0 .. hq0 + GN - 1
// (GN / KH of each KV head), the accumulators in registers, written to out normalized by the softmax sums.
// `ask`: the request's first pass over its values, which asks for each value row again kValueAhead tokens
// ahead: the key pass asked for them, but not all are still in L2 when the values are weighed.
template <typename T, int NC, int GN, int KH = 1>
void weigh_values(const Request<T>& r, int64_t h, int64_t hq0, const float* P, const float* inv, T* out, bool ask) {
  constexpr int64_t D = NC * kLanes;
  constexpr int NN = D / kNative, GK = GN / KH;
  static_assert(GN % KH == 0, "as many query heads of each KV head");
  Slots ahead(r.table, ask ? r.n : 0, r.block_size, kValueAhead);
  const int64_t row_bytes = r.KVH * D * sizeof(T);
  vn acc[GN][NN] = {};
  for (int64_t blk = 0, t = 0; t < r.n; ++blk) {
    const int64_t slot0 = r.table[blk] * r.block_size, end = std::min(r.n, t + r.block_size);
    for (int64_t slot = slot0; t < end; ++t, ++slot) {
      const T* v = r.v + slot * r.v_row + h * D;
      if (const int64_t a = ahead.next(); a >= 0) prefetch(r.v + a * r.v_row, row_bytes);
      vn vv[KH][NN];
#pragma GCC unroll 16
      for (int k = 0; k < KH; ++k)
#pragma GCC unroll 16
        for (int c = 0; c < NN; ++c) vv[k][c] = load_native(v + k * D + c * kNative);
#pragma GCC unroll 16
      for (int g = 0; g < GN; ++g) {
        const float p = P[t * r.H + hq0 + g];
#pragma GCC unroll 16
        for (int c = 0; c < NN; ++c) acc[g][c] += p * vv[g / GK][c];
      }
    }
  }
#pragma GCC unroll 16  // (every index of acc known at compile time: the accumulators stay in registers)
  for (int g = 0; g < GN; ++g) {
    T* o = out + (hq0 + g) * D;
#pragma GCC unroll 16
    for (int c = 0; c < NN; ++c) {
      float x[kNative];
      const vn y = acc[g][c] * inv[hq0 + g];
      std::memcpy(x, &y, sizeof x);
      for (int i = 0; i < kNative; ++i) o[c * kNative + i] = static_cast<T>(x[i]);
    }
  }
}

// The last `rest` (at most GN) query heads of a KV head's group in one pass, not one pass each: groups of 2,
// 6 or 7 (Qwen2.5's) read their values once or twice, not 2, 3 or 4 times. 256 requests from memory,
// side by side: tiny-llama's shape 1.06-1.08x, (14 / 2 / 64) 1.06-1.12x, Qwen2.5-7B's 1.04-1.05x.
template <typename T, int NC, int GN>
void weigh_rest(const Request<T>& r, int64_t h, int64_t hq, int64_t rest, const float* P, const float* inv, T* out,
                bool ask) {
  if constexpr (GN > 0) {
    if (rest == GN) weigh_values<T, NC, GN>(r, h, hq, P, inv, out, ask);
    else weigh_rest<T, NC, GN - 1>(r, h, hq, rest, P, inv, out, ask);
  }
}

// Head dims that are a multiple of 16: scores, softmax, values (up to four query heads a pass).
template <typename T, int NC>
void decode_request(const Request<T>& r, std::vector<float>& scores, std::vector<float>& inv, T* out) {
  const int64_t G = r.H / r.KVH;
  scores.resize(r.H * r.n);
  score_keys<T, NC>(r, scores.data());
  softmax_columns(scores.data(), r.n, r.H, inv.data());
  // Groups of one or two query heads: four or two KV heads' values a pass (16 accumulators, head dims up to 64),
  // their rows read whole. 256 requests from memory, side by side: tiny-llama's shape 1.07-1.08x fp32 and
  // 0.97-1.01x bf16; 12 heads of 64 without grouping 1.05-1.11x and 1.12-1.22x. (Groups of four over two KV heads,
  // 32 accumulators: level, 0.97-1.05x.)
  int64_t h0 = 0;
  if constexpr (kValueHeads == 4 && NC * kLanes <= 64) {
    if (G == 2 && r.KVH % 2 == 0)
      for (; h0 < r.KVH; h0 += 2) weigh_values<T, NC, 4, 2>(r, h0, h0 * 2, scores.data(), inv.data(), out, h0 == 0);
    if (G == 1 && r.KVH % 4 == 0)
      for (; h0 < r.KVH; h0 += 4) weigh_values<T, NC, 4, 4>(r, h0, h0, scores.data(), inv.data(), out, h0 == 0);
  }
  for (int64_t h = h0; h < r.KVH; ++h) {
    int64_t hq = h * G;
    for (; hq + kValueHeads <= (h + 1) * G; hq += kValueHeads)
      weigh_values<T, NC, kValueHeads>(r, h, hq, scores.data(), inv.data(), out, hq == h0 * G);
    weigh_rest<T, NC, kValueHeads - 1>(r, h, hq, (h + 1) * G - hq, scores.data(), inv.data(), out, hq == h0 * G);
  }
}

// Any other head dim: one dot product at a time.
template <typename T>
void decode_request_scalar(const Request<T>& r, int64_t D, std::vector<float>& scores, std::vector<float>& inv,
                           T* out) {
  const int64_t G = r.H / r.KVH, H = r.H, n = r.n;
  auto slot = [&](int64_t t) { return r.table[t / r.block_size] * r.block_size + t % r.block_size; };
  scores.resize(H * n);
  for (int64_t t = 0; t < n; ++t) {
    const T* krow = r.k + slot(t) * r.k_row;
    for (int64_t hq = 0; hq < H; ++hq) {
      const T* k = krow + (hq / G) * D;
      const float* q = r.q + hq * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
      scores[t * H + hq] = s;
    }
  }
  softmax_columns(scores.data(), n, H, inv.data());
  std::vector<float> acc(H * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* vrow = r.v + slot(t) * r.v_row;
    for (int64_t hq = 0; hq < H; ++hq) {
      const T* v = vrow + (hq / G) * D;
      const float p = scores[t * H + hq];
      float* a = &acc[hq * D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t i = 0; i < H * D; ++i) out[i] = static_cast<T>(acc[i] * inv[i / D]);
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const std::vector<int64_t> first = cut_requests(lens, B);
  at::parallel_for(0, static_cast<int64_t>(first.size()) - 1, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> qf(H * D), scores, inv(H);
    Request<T> r{qf.data(), nullptr, fscale, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0),
                 v_cache.stride(0), block_size, H, k_cache.size(1), nullptr, 0};
    for (int64_t b = first[t_begin]; b < first[t_end]; ++b) {
      r.q_raw = qp + b * H * D;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(r.q_raw[i]) * fscale;
      r.table = bt + b * max_blocks;
      r.n = lens[b];
      T* ob = op + b * H * D;
      switch (D % kLanes == 0 ? D / kLanes : 0) {
        case 2: decode_request<T, 2>(r, scores, inv, ob); break;
        case 4: decode_request<T, 4>(r, scores, inv, ob); break;
        case 6: decode_request<T, 6>(r, scores, inv, ob); break;
        case 8: decode_request<T, 8>(r, scores, inv, ob); break;
        case 16: decode_request<T, 16>(r, scores, inv, ob); break;
        default: decode_request_scalar<T>(r, D, scores, inv, ob);
      }
    }
  });
}

// Every request's key and value rows read once through its block table with no arithmetic but a sum: what the
// memory gives the decode kernel's access pattern, its ceiling. The same work items and split between threads;
// a token's key and value rows read together, each asked for 16 tokens ahead into L1 (of the ways tried for
// reading alone, the fastest: at a 66 GB/s stream, llama-200m's fp32 rows in one sweep 51 GB/s, keys then
// values as the kernel's two passes 44). out[b]: the sum of request b's keys and values, in float.
template <typename T>
void read_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
               const at::Tensor& context_lens, int64_t block_size, at::Tensor& out) {
  const int64_t B = context_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t E = k_cache.size(1) * k_cache.size(2), row_bytes = E * sizeof(T);
  const int64_t *bt = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const std::vector<int64_t> first = cut_requests(lens, B);
  const int64_t ahead_by = ahead_tokens(kAheadTokens, kAheadBytes, row_bytes);
  at::parallel_for(0, static_cast<int64_t>(first.size()) - 1, 1, [&](int64_t t_begin, int64_t t_end) {
    Request<T> r{nullptr, nullptr, 0.f, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0),
                 v_cache.stride(0), block_size, 0, k_cache.size(1), nullptr, 0};
    for (int64_t b = first[t_begin]; b < first[t_end]; ++b) {
      r.table = bt + b * max_blocks;
      r.n = lens[b];
      Slots rows(r.table, r.n, block_size, 0), ahead(r.table, r.n, block_size, ahead_by);
      vn acc[4] = {};
      float rest = 0.f;
      for (int64_t slot = rows.next(); slot >= 0; slot = rows.next()) {
        if (const int64_t a = ahead.next(); a >= 0) prefetch_rows<3>(r, a, row_bytes);
        const T *kr = r.k + slot * r.k_row, *vr = r.v + slot * r.v_row;
        int64_t i = 0;  // (four sums, so that the adds do not wait on each other)
        for (; i + 4 * kNative <= E; i += 4 * kNative)
          for (int j = 0; j < 4; ++j) acc[j] += load_native(kr + i + j * kNative) + load_native(vr + i + j * kNative);
        for (; i + kNative <= E; i += kNative) acc[0] += load_native(kr + i) + load_native(vr + i);
        for (; i < E; ++i) rest += static_cast<float>(kr[i]) + static_cast<float>(vr[i]);
      }
      const vn sum = acc[0] + acc[1] + acc[2] + acc[3];
      for (int j = 0; j < kNative; ++j) rest += sum[j];
      o[b] = rest;
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

at::Tensor paged_read_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, int64_t block_size) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "paged_read_rows runs on CPU tensors");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [slots, KVH, D], both alike");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) && v_cache.stride(2) == 1 &&
                  v_cache.stride(1) == v_cache.size(2), "each cache slot must hold its heads contiguously");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty({lens.size(0)}, lens.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_read_rows", [&] {
    read_rows<scalar_t>(k_cache, v_cache, bt, lens, block_size, out);
  });
  return out;
}

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor silu_mul_(at::Tensor& gate, const at::Tensor& up);
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const at::Tensor& slots);
// linear_bf16.cpp
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
// linear_f32.cpp
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& panels, int64_t N, const std::optional<at::Tensor>& bias);
int64_t linear_f32_panel_width();
int64_t linear_f32_lanes();
#if defined(__AVX512BF16__)
at::Tensor linear_bf16_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                              const std::optional<at::Tensor>& bias);
#endif
// prompt_attention.cpp
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_lens,
                            double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("paged_read_rows", &paged_read_rows, "each request's KV rows read as the decode kernel reads them, summed (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) (CPU)");
  m.def("silu_mul_", &silu_mul_, "silu(gate) * up, over gate (CPU)");
  m.def("rotary_", &rotary_, "rotary embedding in place (CPU)");
  m.def("write_kv", &write_kv, "a step's keys and values into the cache at their slots (CPU)");
  m.def("linear_bf16", &linear_bf16, "x @ w.T, float x, bf16 w, few rows (CPU)");
  m.def("linear_f32", &linear_f32, "x @ w.T (+ bias), fp32 weights in column panels (CPU)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias") = py::none());
  m.def("linear_f32_panel_width", &linear_f32_panel_width, "columns a panel of linear_f32's weights holds");
  m.def("linear_f32_lanes", &linear_f32_lanes, "a panel's columns come in multiples of this (its last panel's too)");
#if defined(__AVX512BF16__)  // (only where the CPU has bf16 dot products)
  m.def("linear_bf16_panels", &linear_bf16_panels, "x @ w.T (+ bias), bf16 weights in column panels of k pairs (CPU)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias") = py::none());
#endif
  m.def("prompt_attention", &prompt_attention, "causal attention of whole prompts (CPU)",
        py::call_guard<py::gil_scoped_release>());  // (long prompts: other threads run meanwhile)
}
