// y = x @ w.T for bf16 weights on a CPU without bf16 dot products, for the few rows of a decode step.
//
// x: [M, K] float, w: [N, K] bf16 (a linear layer's weight as stored), returns [M, N] float. oneDNN's
// bf16 GEMM runs emulated on such CPUs (AVX2-only ones: 25-33 ms for 16 rows x 2048 x 8192 on two
// threads, where fp32 takes 10-12), and fp32 copies of the weights would double their memory. Here
// each thread converts a few weight rows at a time into a small float buffer (bf16 is the top half of a
// float: widened and shifted) and multiplies every row of x by them in registers: MR x NR dot products
// at once, 8 lanes a step, summed across lanes at the end. Sums are in float, in another order than
// oneDNN's (results differ in the last bits). Larger row counts are better served by converting larger
// pieces and calling the BLAS (servewise/models/linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum8(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// n rows of w (bf16, row length K) into out as float.
void widen_rows(const c10::BFloat16* w, int64_t n, int64_t K, float* out) {
  const int64_t total = n * K;
  int64_t i = 0;
  for (; i + 8 <= total; i += 8) {
    v8u16 u;
    std::memcpy(&u, w + i, sizeof u);
    const v8u32 f = __builtin_convertvector(u, v8u32) << 16;
    std::memcpy(out + i, &f, sizeof f);
  }
  for (; i < total; ++i) out[i] = static_cast<float>(w[i]);
}

// y[m][n] = dot(x row m, w row n) for MR rows of x and NR (converted) rows of w.
template <int MR, int NR>
void tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  v8 acc[MR][NR] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load8(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      const v8 wv = load8(w + n * K + k);
      for (int m = 0; m < MR; ++m) acc[m][n] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = sum8(acc[m][n]);
      for (int64_t j = k; j < K; ++j) s += x[m * K + j] * w[n * K + j];
      y[m * ldy + n] = s;
    }
}

// 12 accumulators, 4 rows of x and a row of w (17 values for 16 AVX2 registers): measured on two AVX2
// threads against 3 x 4, 2 x 6 and 2 x 4 tiles, the fastest from 8 rows up (81-118 GFLOP/s)
constexpr int kMR = 4, kNR = 3;

template <int NR>
void rows_of_x(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) tile<kMR, NR>(x + m * K, K, w, y + m * N, N);
  if (M - m == 3) tile<3, NR>(x + m * K, K, w, y + m * N, N);
  if (M - m == 2) tile<2, NR>(x + m * K, K, w, y + m * N, N);
  if (M - m == 1) tile<1, NR>(x + m * K, K, w, y + m * N, N);
}

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16, "linear_bf16: float x, bf16 w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_bf16: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  // a work item: 4 tiles' worth of rows of w, converted kNR at a time
  constexpr int64_t kItem = 4 * kNR;
  at::parallel_for(0, (N + kItem - 1) / kItem, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kNR * K);
    for (int64_t n0 = begin * kItem; n0 < std::min(end * kItem, N); n0 += kNR) {
      const int64_t nr = std::min<int64_t>(kNR, N - n0);
      widen_rows(wp + n0 * K, nr, K, buf.data());
      switch (nr) {
        case 3: rows_of_x<3>(xp, M, K, buf.data(), yp + n0, N); break;
        case 2: rows_of_x<2>(xp, M, K, buf.data(), yp + n0, N); break;
        default: rows_of_x<1>(xp, M, K, buf.data(), yp + n0, N);
      }
    }
  });
  return y;
}
