// Decode-step GEMV for CPU: y = x @ w^T for the few rows of one decode step.
//
// Registered as the CPU kernel of sparq::linear_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   linear_cpu(Tensor x, Tensor w) -> Tensor

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace sparq_cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Decode linear: y (M, N) = x (M, K) @ w (N, K)^T for the few rows of one decode step (M <= 16).
// At batch 1 every weight is read once per step, so this is a bandwidth problem: stock torch's
// GEMV streams fp32 and bf16 weights at 7-9 GB/s on this machine against ~22 GB/s for a plain
// sum (bench.py linear). Here each thread streams 4 weight rows at a time (4 sequential streams
// the hardware prefetcher follows), dotted with every row of x (held in fp32, L1-resident);
// the rows of w are split over torch's threads in units claimed dynamically.
// ---------------------------------------------------------------------------------------------

// y[m * N + r] = x_m . w_r for MB rows of x (K floats apart) and RB rows of w (ws elements
// apart): each 16-wide slice of the RB weight rows is loaded (and widened to fp32) once and used
// for all MB rows of x; MB * RB <= 16 accumulators stay in registers.
template <int MB, int RB, class WT>
static inline void dot_block(const float* x, int64_t K, const WT* w, int64_t ws, float* y, int64_t N) {
  V acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = vzero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = load(w + r * ws + k);
    for (int m = 0; m < MB; ++m) {
      const V xv = load(x + m * K + k);
      for (int r = 0; r < RB; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
    }
  }
  if (k < K) {
    const M mask = tail_mask(K - k);
    V wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = load(w + r * ws + k, mask);
    for (int m = 0; m < MB; ++m) {
      const V xv = load(x + m * K + k, mask);
      for (int r = 0; r < RB; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) y[m * N + r] = hsum(acc[m][r]);
}

template <int RB, class WT>
static inline void dot_rows(const float* xf, int64_t M, int64_t K, const WT* w, int64_t ws, float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += 4) {  // x in blocks of up to 4 rows
    const float* x = xf + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(4, M - m)) {
      case 1: dot_block<1, RB>(x, K, w, ws, ym, N); break;
      case 2: dot_block<2, RB>(x, K, w, ws, ym, N); break;
      case 3: dot_block<3, RB>(x, K, w, ws, ym, N); break;
      default: dot_block<4, RB>(x, K, w, ws, ym, N); break;
    }
  }
}

// rows [n0, n1) of w: y[m, n] for every m, 4 weight rows at a time (4 sequential streams the
// hardware prefetcher follows)
template <class WT>
static void linear_rows(const float* xf, int64_t M, int64_t K, const WT* w, int64_t ws, int64_t n0, int64_t n1,
                        float* y, int64_t N) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) dot_rows<4>(xf, M, K, w + n * ws, ws, y + n, N);
  for (; n < n1; ++n) dot_rows<1>(xf, M, K, w + n * ws, ws, y + n, N);
}

template <class XT>
static void to_f32(const XT* x, int64_t M, int64_t K, int64_t xs, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = static_cast<float>(x[m * xs + k]);
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "sparq::linear_cpu: expected x (M, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "sparq::linear_cpu: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "sparq::linear_cpu: x and w must be contiguous along K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= 16, "sparq::linear_cpu: at most 16 rows (decode); use F.linear for more");
  const auto xdt = x.scalar_type(), wdt = w.scalar_type();
  TORCH_CHECK(xdt == at::kFloat || xdt == at::kBFloat16 || xdt == at::kHalf, "sparq::linear_cpu: unsupported x dtype");
  TORCH_CHECK(wdt == at::kFloat || wdt == at::kBFloat16 || wdt == at::kHalf, "sparq::linear_cpu: unsupported w dtype");
  std::vector<float> xf(std::max<int64_t>(M * K, 1));
  if (xdt == at::kFloat) to_f32(x.data_ptr<float>(), M, K, x.stride(0), xf.data());
  else if (xdt == at::kBFloat16) to_f32(x.data_ptr<bf16>(), M, K, x.stride(0), xf.data());
  else to_f32(x.data_ptr<f16>(), M, K, x.stride(0), xf.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int nt = thread_count();
  // units of 64 rows (a multiple of 4), at least 4 per thread so a late thread is not waited on
  int64_t rows = 64;
  while (rows > 4 && (N + rows - 1) / rows < 4 * nt) rows /= 2;
  const int64_t units = (N + rows - 1) / rows;
  const int64_t ws = w.stride(0);
  auto fn = [&](int, int64_t u, int) {
    const int64_t n0 = u * rows, n1 = std::min(N, n0 + rows);
    if (wdt == at::kFloat) linear_rows(xf.data(), M, K, w.data_ptr<float>(), ws, n0, n1, yp, N);
    else if (wdt == at::kBFloat16) linear_rows(xf.data(), M, K, w.data_ptr<bf16>(), ws, n0, n1, yp, N);
    else linear_rows(xf.data(), M, K, w.data_ptr<f16>(), ws, n0, n1, yp, N);
  };
  run_phases(nt, {units}, fn);
  return xdt == at::kFloat ? y : y.to(xdt);
}

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("linear_cpu", &sparq_cpu::linear_cpu);
}
