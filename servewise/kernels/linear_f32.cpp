// y = x @ w.T (+ bias) for fp32 weights laid out in column panels, for every row count; and for bf16
// weights where the CPU has bf16 dot products (AVX512_BF16), the same scheme below.
//
// x: [M, K] float (contiguous rows), panels: [P, K, NP] float (w's columns NP at a time; the last panel's
// rounded up to whole vectors, its rows that far apart: see pack_panels in servewise/models/linear.py),
// returns [M, N]. oneDNN's GEMM reaches its peak when a weight sits in cache, but a model's weights do
// not: every decode step reads all of them from memory, and there (llama-200m's layers, 64 rows, 2
// threads of an AVX-512 EPYC) it ran at 410 GFLOP/s against 430 in cache and 500 for one weight called
// again and again. Here each thread takes a run of panels (cut by work: over_panels); a panel is
// multiplied by every row of x, MR rows at a time with their MR x NP sums in registers, and while it is,
// the thread asks for its next panel (spread evenly over the row tiles), so that the next panel is read
// from memory while the arithmetic runs. Rows are taken MC at a time (so that a large prefill's rows
// stay in cache while the panels pass; 64 to 512 measured level). Sums run over K in order, in float, one
// output from one thread: the result does not depend on the thread count (it differs from oneDNN's in the
// last bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "native_vector.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using servewise::kNative, servewise::vn, servewise::load_native;
// The last panel holds only the vectors its columns need (its rows closer together; pack_panels in
// servewise/models/linear.py): llama-200m's o and down projections (1,024 out-features: 21 panels of 48
// and 16 columns) read and multiply no padding. A pass over llama-200m's layers from memory, 2 threads,
// padded -> this: 8 rows 16.4 -> 16.1 ms, 64 rows 46.2 -> 44.5, 256 rows 173.8 -> 169.4 (with the
// broadcast below). Tiles of 6 rows x 64 columns (no padding either) were level from 64 rows (44.7,
// 166.8), but a step of 7 or 8 rows takes two passes over each panel there: 17.4 ms at 8 rows.
constexpr int kNV = 3;                    // vectors a panel row
constexpr int64_t kNP = kNV * kNative;    // columns a panel: 48 with AVX-512, 24 with AVX2
constexpr int kMR = kNative == 16 ? 8 : 4;  // rows a tile: kMR x kNV sums, plus kNV + 1, fill the registers
constexpr int64_t kMC = 256;              // rows of x a pass over the panels
constexpr int64_t kAheadEvery = 4;        // k steps between two requests for the next panel (see tile)

// Rows [0, R) of x (row stride lda) times one panel into R x ncols outputs (row stride ldc); meanwhile
// asks for pf_bytes of the next panel from pf (nullptr: none), a few lines every kAheadEvery steps. The
// non-temporal hint with requests every 4 steps read fastest of the hints (T0 / T1 / T2 / NTA) and
// spacings (1, 2, 4, 8 steps) tried: 64 rows of llama-200m's layers, 2 threads, 468-473 GFLOP/s
// against 434-444 for T1 every 8 steps.
template <int R, int NV>  // (a panel of NV vectors a row: kNV but in the last panel)
void tile(const float* x, int64_t lda, const float* panel, int64_t K, const float* bias, float* y, int64_t ldc,
          int64_t ncols, const char* pf, int64_t pf_bytes) {
  vn acc[R][NV] = {};
  const int64_t steps = std::max<int64_t>(1, K / kAheadEvery);
  const int64_t pf_step = (pf_bytes + steps - 1) / steps;
  int64_t pf_at = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr && k % kAheadEvery == 0 && pf_at < pf_bytes) {
      for (int64_t off = 0; off < pf_step && pf_at + off < pf_bytes; off += 64)
        __builtin_prefetch(pf + pf_at + off, 0, 0);
      pf_at += pf_step;
    }
    vn b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = load_native(panel + (k * NV + j) * kNative);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float a = x[i * lda + k];  // (a float times a vector: one broadcast load; `vn{} + x` was an add and
                                       // a shuffle on the arithmetic pipes: 2,048-row layers 468-486 -> 490-498
                                       // GFLOP/s, llama-200m's offline run 8.71 -> 8.49-8.56 s)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  float out[NV * kNative];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) std::memcpy(out + j * kNative, &acc[i][j], sizeof(vn));
    if (bias != nullptr)
      for (int64_t c = 0; c < ncols; ++c) out[c] += bias[c];
    std::memcpy(y + i * ldc, out, ncols * sizeof(float));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const char*, int64_t);

template <int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles_for(std::integer_sequence<int, R...>) {
  return {tile<R + 1, NV>...};
}
// kTiles[nv - 1][r - 1]: r rows of a panel of nv vectors
constexpr std::array<TileFn, kMR> kTiles[kNV] = {tiles_for<1>(std::make_integer_sequence<int, kMR>{}),
                                                 tiles_for<2>(std::make_integer_sequence<int, kMR>{}),
                                                 tiles_for<3>(std::make_integer_sequence<int, kMR>{})};
static_assert(kNV == 3, "kTiles lists a row of tiles for each panel width");

// The rows are taken kMC at a time, and the work of each such block, its (panel, row tile) pairs in panel
// order, is cut into one run a thread with about equal multiply-adds each: a whole number of panels a
// thread left the one with the narrow last panel idle for a third of a panel (1,024 out-features: 11 panels
// against 10 and a third; a pass over llama-200m's layers, 2,048 rows, 1,416 -> 1,401 ms, 256 rows 170.8 ->
// 168.8, level at 8 and 64). tile(r, rows, p, nv, ncols, pf, pf_bytes) for rows [r, r + rows) and panel p
// (of nv vectors a row), asking meanwhile for pf_bytes of the thread's next panel from pf.
template <typename Tile>
void over_panels(int64_t M, int64_t N, int64_t P, const char* W, int64_t panel_bytes, const Tile& tile) {
  const int64_t nv_last = (N - (P - 1) * kNP + kNative - 1) / kNative;  // the last panel's vectors
  const int64_t pairs = P * ((std::min(M, kMC) + kMR - 1) / kMR);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMC) {
      const int64_t m1 = std::min(M, m0 + kMC), tiles = (m1 - m0 + kMR - 1) / kMR;
      // pair u: panel u / tiles, row tile u % tiles; the pairs before u hold u * kNV vectors' work (fewer
      // past the full panels)
      const int64_t full = (P - 1) * tiles, total = full * kNV + tiles * nv_last;
      auto first = [&](int64_t t) {  // the first pair with at least t / nt of the work before it
        const int64_t w = total * t;
        if (w <= full * kNV * nt) return (w + kNV * nt - 1) / (kNV * nt);
        return std::min(full + tiles, full + (w - full * kNV * nt + nv_last * nt - 1) / (nv_last * nt));
      };
      const int64_t u0 = first(t0), u1 = first(t1);
      for (int64_t u = u0; u < u1;) {
        const int64_t p = u / tiles, ta = u % tiles, tb = std::min(tiles, ta + (u1 - u));
        // the panel this thread takes next: the next of its run, or its first again for the next rows
        const int64_t q = p < (u1 - 1) / tiles ? p + 1 : (m1 < M ? u0 / tiles : -1);
        const char* next = q < 0 ? nullptr : W + q * panel_bytes;
        const int64_t share = panel_bytes / (tb - ta), ncols = std::min(kNP, N - p * kNP);
        const int nv = static_cast<int>(p + 1 < P ? kNV : nv_last);
        for (int64_t t = ta; t < tb; ++t) {
          const int64_t r = m0 + t * kMR;
          tile(r, static_cast<int>(std::min<int64_t>(kMR, m1 - r)), p, nv, ncols,
               next ? next + (t - ta) * share : nullptr, share);
        }
        u += tb - ta;
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bf16: the same panels with the inner dimension in pairs ([P, K / 2, NP, 2]), multiplied by vdpbf16ps
// (each instruction 16 columns x one pair of k for one row), sums in float, rounded to bf16 at the end
// (to nearest even, as PyTorch rounds; bias added before).
template <int R, int NV>
void tile_bf16(const c10::BFloat16* x, int64_t lda, const uint16_t* panel, int64_t K2, const c10::BFloat16* bias,
               c10::BFloat16* y, int64_t ldc, int64_t ncols, const char* pf, int64_t pf_bytes) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t steps = std::max<int64_t>(1, K2 / (kAheadEvery / 2)), pf_step = (pf_bytes + steps - 1) / steps;
  int64_t pf_at = 0;
  for (int64_t kp = 0; kp < K2; ++kp) {
    if (pf != nullptr && kp % (kAheadEvery / 2) == 0 && pf_at < pf_bytes) {
      for (int64_t off = 0; off < pf_step && pf_at + off < pf_bytes; off += 64)
        __builtin_prefetch(pf + pf_at + off, 0, 0);
      pf_at += pf_step;
    }
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j)
      b[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + (kp * NV + j) * 16 * 2));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * lda + 2 * kp, sizeof pair);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float sums[NV * 16];
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(sums + 16 * j, acc[i][j]);
    if (bias != nullptr)
      for (int64_t c = 0; c < ncols; ++c) sums[c] += static_cast<float>(bias[c]);
    for (int64_t c = 0; c < ncols; ++c) y[i * ldc + c] = static_cast<c10::BFloat16>(sums[c]);
  }
}

using TileBf16 = void (*)(const c10::BFloat16*, int64_t, const uint16_t*, int64_t, const c10::BFloat16*,
                          c10::BFloat16*, int64_t, int64_t, const char*, int64_t);

template <int NV, int... R>
constexpr std::array<TileBf16, sizeof...(R)> bf16_tiles_for(std::integer_sequence<int, R...>) {
  return {tile_bf16<R + 1, NV>...};
}
constexpr std::array<TileBf16, kMR> kTilesBf16[kNV] = {bf16_tiles_for<1>(std::make_integer_sequence<int, kMR>{}),
                                                       bf16_tiles_for<2>(std::make_integer_sequence<int, kMR>{}),
                                                       bf16_tiles_for<3>(std::make_integer_sequence<int, kMR>{})};
#endif

}  // namespace

#if defined(__AVX512BF16__)
// x: [M, K] bf16, panels: [P, K / 2, NP, 2] bf16 (see pack_panels in servewise/models/linear.py), K even.
at::Tensor linear_bf16_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "linear_bf16_panels: x must be [M, K] bf16");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kNP && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              "linear_bf16_panels: panels must be [P, K / 2, ", kNP, ", 2] bf16, contiguous");
  TORCH_CHECK(2 * panels.size(1) == x.size(1), "linear_bf16_panels: x has ", x.size(1), " columns, the weight ",
              2 * panels.size(1));
  TORCH_CHECK(N > (panels.size(0) - 1) * kNP && N <= panels.size(0) * kNP, "linear_bf16_panels: N does not match");
  TORCH_CHECK(!bias.has_value() ||
                  (bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16),
              "linear_bf16_panels: bias must be [N] bf16");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0), panel = K * kNP;  // (bf16 elements)
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const c10::BFloat16* X = xc.data_ptr<c10::BFloat16>();
  const uint16_t* W = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* Y = y.data_ptr<c10::BFloat16>();
  over_panels(M, N, P, reinterpret_cast<const char*>(W), panel * 2,
              [&](int64_t r, int rows, int64_t p, int nv, int64_t ncols, const char* pf, int64_t pf_bytes) {
                kTilesBf16[nv - 1][rows - 1](
                    X + r * K, K, W + p * panel, K / 2, b ? b + p * kNP : nullptr, Y + r * N + p * kNP, N, ncols,
                    pf, pf_bytes);
              });
  return y;
}
#endif

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& panels, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "linear_f32: x must be [M, K] float");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kNP && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "linear_f32: panels must be [P, K, ", kNP, "] float, contiguous");
  TORCH_CHECK(panels.size(1) == x.size(1), "linear_f32: x has ", x.size(1), " columns, the weight ", panels.size(1));
  TORCH_CHECK(N > (panels.size(0) - 1) * kNP && N <= panels.size(0) * kNP, "linear_f32: N does not match the panels");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat),
              "linear_f32: bias must be [N] float");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0), panel = K * kNP;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* X = xc.data_ptr<float>();
  const float* W = panels.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  over_panels(M, N, P, reinterpret_cast<const char*>(W), panel * static_cast<int64_t>(sizeof(float)),
              [&](int64_t r, int rows, int64_t p, int nv, int64_t ncols, const char* pf, int64_t pf_bytes) {
                kTiles[nv - 1][rows - 1](
                    X + r * K, K, W + p * panel, K, b ? b + p * kNP : nullptr, Y + r * N + p * kNP, N, ncols,
                    pf, pf_bytes);
              });
  return y;
}

int64_t linear_f32_panel_width() { return kNP; }

int64_t linear_f32_lanes() { return kNative; }
