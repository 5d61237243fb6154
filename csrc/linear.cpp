// Decode-step GEMV for CPU: y = x @ w^T for the few rows of one decode step.
//
// Registered as the CPU kernels of sparq::linear_cpu and sparq::linear_cpu_isa, whose schemas (and
// fake implementations, for torch.compile) kernels.py defines:
//   linear_cpu(Tensor x, Tensor w) -> Tensor
//   linear_cpu_isa() -> str      which path this build compiled (see below)
//
// At batch 1 every weight is read once per step, so this is a bandwidth problem that stock torch's
// GEMV leaves far from the memory's speed (python -m bench linear; docs/NOTES.md). Each thread streams
// its weight rows in order, 4 at a time for several rows of x (each x vector loaded once for 4 rows),
// one at a time for a single row or on AVX2 (linear_rows), dotted with every row of x (L1-resident);
// the rows of w are split over torch's threads in units claimed dynamically.
//
// The instruction set is chosen at build time from the compiler's feature macros (the build is
// -march=native, and kernels.py puts the CPU's flags in the build tag), never per call:
//   "avx512-bf16"  bf16 weights: vdpbf16ps, 32 weights per instruction with no widening (x in bf16:
//                  exact products; x in fp32 / fp16: split into bf16 hi + lo parts, two dot products,
//                  |x - hi - lo| <= 2^-17 |x|); fp32 / fp16 weights as "avx512".
//   "avx512"       every weight dtype widened to fp32 (16 lanes), FMA: the readable reference path.
//   "avx2"         8-lane AVX2 vectors, FMA, one weight row at a time; bf16 weights widened as even / odd
//                  halves of 32-bit lanes (CPUs without AVX-512).
//   "portable"     the reference path on simd.h's portable vectors.
// (AMX-BF16 would add tile multiplies for many rows; at <= 16 rows the GEMV is bound by the weight
// stream, which vdpbf16ps already keeps up with. Not tried on the one AMX machine seen so far, a VM
// where llama.cpp's AMX tiles died with SIGILL: docs/NOTES.md.)
// tests/test_kernels_cpu.py builds this file alone with features turned off and checks each path.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"


// Software prefetch distance, in weight rows: while a block of rows streams, the rows SPARQ_LPF ahead
// (the next block) are prefetched into L2 line by line, so a new block does not start cold (0: off;
// 4 measured best, docs/NOTES.md; the AVX2 path streams one row at a time and prefetching 4 rows ahead made it
// slower on a Zen 3: it uses SPARQ_AVX2_PF_BYTES instead).
#ifndef SPARQ_LPF
#define SPARQ_LPF 4
#endif
// The AVX2 path's prefetch distance in bytes along its one stream (0: off): each 64-byte line of a weight row
// asks for the line this far ahead into L1. Its loop spends ~7 instructions per 32 weight bytes, so the
// out-of-order window alone keeps too few lines in flight: on a Zen 3, 1 KB ahead streamed a step's bf16
// GEMVs 1.11x faster (0.5 KB 1.05x, 1.5 KB 1.08x, 2 KB 1.05x), fp32 1.04x (docs/NOTES.md).
#ifndef SPARQ_AVX2_PF_BYTES
#define SPARQ_AVX2_PF_BYTES 1024
#endif

namespace sparq_cpu {
namespace {

static const char* gemv_isa() {
#if defined(SPARQ_AVX512_BF16)
  return "avx512-bf16";
#elif defined(SPARQ_AVX512)
  return "avx512";
#elif defined(SPARQ_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// The layouts of x: fp32 rows; fp32 rows with each full 16-block stored as its 8 even then its 8 odd
// elements (the AVX2 path's bf16 weights); bf16 planes (the vdpbf16ps path's bf16 weights).
enum class XLayout { rows, pairs, planes };

// The rows of x, prepared once per call for the path that reads them.
struct XRows {
  int64_t M, K;
  std::vector<float> f;   // (M, K) fp32: the widening paths, rows or pairs (empty on the bf16 planes' path)
  int64_t Kp = 0;         // bf16 planes: K padded to 32 with zeros
  int nt = 0;             // bf16 terms: 1 (x was bf16), 2 (hi + lo of fp32 / fp16 x)
  std::vector<bf16> h;    // (nt, M, Kp)
};

// ---------------------------------------------------------------------------------------------
// Reference path: widen every weight to fp32 (simd.h's 16-lane V), FMA with x in fp32.
// y[m * N + r] = x_m . w_r for MB rows of x (K floats apart) and RB rows of w (ws elements apart):
// each 16-wide slice of the RB weight rows is loaded once and used for all MB rows of x; the
// MB * RB accumulators stay in registers.
// ---------------------------------------------------------------------------------------------

template <int MB, int RB, class WT>
static inline void dot_block(const float* x, int64_t K, const WT* w, int64_t ws, float* y, int64_t N) {
  V acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = vzero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = load(w + r * ws + k);
    if (SPARQ_LPF > 0 && (sizeof(WT) == 4 || k % 32 == 0))  // a 64-byte line: 16 fp32 or 32 16-bit weights
      for (int r = 0; r < RB; ++r) prefetch_l2(w + (r + SPARQ_LPF) * ws + k);
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
static inline void dot_rows(const XRows& x, const WT* w, int64_t ws, float* y, int64_t N) {
  for (int64_t m = 0; m < x.M; m += 4) {  // x in blocks of up to 4 rows
    const float* xm = x.f.data() + m * x.K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(4, x.M - m)) {
      case 1: dot_block<1, RB>(xm, x.K, w, ws, ym, N); break;
      case 2: dot_block<2, RB>(xm, x.K, w, ws, ym, N); break;
      case 3: dot_block<3, RB>(xm, x.K, w, ws, ym, N); break;
      default: dot_block<4, RB>(xm, x.K, w, ws, ym, N); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2: one weight row at a time (one sequential stream per thread: 4 interleaved rows streamed a
// step's weights 1.3-1.5x slower on a Zen 3, docs/NOTES.md), dotted with up to 4 rows of x; each x row
// keeps 2 accumulators (16 weights an iteration) and the K % 16 tail is scalar, so a row's sums are the
// same in every block. bf16 weights are widened in place: the low half of each 32-bit lane is the even
// weight (a shift moves it up), the high half the odd one (a mask keeps it), so x is stored per
// 16-block as its 8 even then its 8 odd elements (XRows::pairs): one 256-bit load and 2 integer ops
// per 16 weights, against 2 loads and 4 ops widening 8 at a time.
// ---------------------------------------------------------------------------------------------
#ifdef SPARQ_AVX2
// 16 weights from k as (w[k..k+8), w[k+8..k+16)), or for bf16 as (evens, odds)
static inline void load16(const float* p, __m256& a, __m256& b) { a = _mm256_loadu_ps(p); b = _mm256_loadu_ps(p + 8); }
static inline void load16(const f16* p, __m256& a, __m256& b) {
  a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
static inline void load16(const bf16* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y[m * N] = x_m . w for MB rows of x (K floats apart, in the layout load16 pairs with) and one row w
template <int MB, class WT>
static inline void dot_row_avx2(const float* x, int64_t K, const WT* w, float* y, int64_t N) {
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256 wa, wb;
    if constexpr (SPARQ_AVX2_PF_BYTES > 0)
      if (((k * (int64_t)sizeof(WT)) & 63) == 0)  // once a line (a hint: no fault past the weight's end)
        _mm_prefetch(reinterpret_cast<const char*>(w + k) + SPARQ_AVX2_PF_BYTES, _MM_HINT_T0);
    load16(w + k, wa, wb);
    for (int m = 0; m < MB; ++m) {
      acc[m][0] = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(x + m * K + k + 8), acc[m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    float s = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
    for (int64_t t = k; t < K; ++t) s += x[m * K + t] * to_f(w[t]);  // the tail is in x's natural order
    y[m * N] = s;
  }
}

template <class WT>
static inline void dot_rows_avx2(const XRows& x, const WT* w, float* y, int64_t N) {
  for (int64_t m = 0; m < x.M; m += 4) {
    const float* xm = x.f.data() + m * x.K;
    switch (std::min<int64_t>(4, x.M - m)) {
      case 1: dot_row_avx2<1>(xm, x.K, w, y + m * N, N); break;
      case 2: dot_row_avx2<2>(xm, x.K, w, y + m * N, N); break;
      case 3: dot_row_avx2<3>(xm, x.K, w, y + m * N, N); break;
      default: dot_row_avx2<4>(xm, x.K, w, y + m * N, N); break;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// AVX512_BF16: bf16 weights straight into vdpbf16ps (acc[i] += w[2i] x[2i] + w[2i+1] x[2i+1]),
// 32 weights per load and instruction; x as NT bf16 planes (hi, and lo for fp32 / fp16 x).
// ---------------------------------------------------------------------------------------------
#ifdef SPARQ_AVX512_BF16
template <int MB, int RB, int NT>
static inline void dot_block_bf16(const bf16* x, int64_t Kp, int64_t plane, int64_t K, const bf16* w, int64_t ws,
                                  float* y, int64_t N) {
  __m512 acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_setzero_ps();
  auto step = [&](const __m512bh* wv, int64_t k) {
    for (int m = 0; m < MB; ++m)
      for (int t = 0; t < NT; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * plane + m * Kp + k);
        for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
      }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ws + k);
    if constexpr (SPARQ_LPF > 0)
      for (int r = 0; r < RB; ++r) prefetch_l2(w + (r + SPARQ_LPF) * ws + k);
    step(wv, k);
  }
  if (k < K) {  // masked weights; x is zero-padded to Kp
    const __mmask32 mask = (__mmask32)((K - k) >= 32 ? 0xFFFFFFFFu : ((1u << (K - k)) - 1u));
    __m512bh wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ws + k);
    step(wv, k);
  }
  // One transposing reduction (hsum16) for a full block's 16 sums (at 8 rows of x, 16 separate ones were a
  // fifth of the block's instructions); others one by one in the same order (hsum_as16), so a row of y
  // is bit for bit the same whichever block it falls in (a verify pass equals its one-token steps).
  if constexpr (MB == 4 && RB == 4) {
    V a[16];
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) a[m * 4 + r].x = acc[m][r];
    const V s = hsum16(a);  // lane 4m + r: acc[m][r]
    _mm_storeu_ps(y, _mm512_extractf32x4_ps(s.x, 0));
    _mm_storeu_ps(y + N, _mm512_extractf32x4_ps(s.x, 1));
    _mm_storeu_ps(y + 2 * N, _mm512_extractf32x4_ps(s.x, 2));
    _mm_storeu_ps(y + 3 * N, _mm512_extractf32x4_ps(s.x, 3));
  } else {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < RB; ++r) y[m * N + r] = hsum_as16(V{acc[m][r]});
  }
}

template <int RB, int NT>
static inline void dot_rows_bf16_nt(const XRows& x, const bf16* w, int64_t ws, float* y, int64_t N) {
  const int64_t plane = x.M * x.Kp;
  for (int64_t m = 0; m < x.M; m += 4) {
    const bf16* xm = x.h.data() + m * x.Kp;
    float* ym = y + m * N;
    switch (std::min<int64_t>(4, x.M - m)) {
      case 1: dot_block_bf16<1, RB, NT>(xm, x.Kp, plane, x.K, w, ws, ym, N); break;
      case 2: dot_block_bf16<2, RB, NT>(xm, x.Kp, plane, x.K, w, ws, ym, N); break;
      case 3: dot_block_bf16<3, RB, NT>(xm, x.Kp, plane, x.K, w, ws, ym, N); break;
      default: dot_block_bf16<4, RB, NT>(xm, x.Kp, plane, x.K, w, ws, ym, N); break;
    }
  }
}

template <int RB>
static inline void dot_rows_bf16(const XRows& x, const bf16* w, int64_t ws, float* y, int64_t N) {
  if (x.nt == 1) dot_rows_bf16_nt<RB, 1>(x, w, ws, y, N);
  else dot_rows_bf16_nt<RB, 2>(x, w, ws, y, N);
}
#endif

// rows [n0, n1) of w: y[m, n] for every m, on this build's path: 4 weight rows at a time (each x
// vector loaded once for 4 rows), or on the AVX-512 paths one row at a time when x is a single row (a
// B = 1 decode step: one sequential stream per thread read 9-24% faster than 4 interleaved, Zen 5,
// docs/NOTES.md); the AVX2 path always one row at a time (see dot_row_avx2)
template <class WT>
static void linear_rows(const XRows& x, const WT* w, int64_t ws, int64_t n0, int64_t n1, float* y, int64_t N) {
#if defined(SPARQ_AVX512)
  [[maybe_unused]] const bool blocks = x.M > 1;
#else
  [[maybe_unused]] const bool blocks = true;
#endif
  int64_t n = n0;
#if defined(SPARQ_AVX512_BF16)
  if constexpr (std::is_same_v<WT, bf16>) {
    for (; blocks && n + 4 <= n1; n += 4) dot_rows_bf16<4>(x, w + n * ws, ws, y + n, N);
    for (; n < n1; ++n) dot_rows_bf16<1>(x, w + n * ws, ws, y + n, N);
    return;
  }
#endif
#if defined(SPARQ_AVX2)
  for (; n < n1; ++n) dot_rows_avx2(x, w + n * ws, y + n, N);
#else
  for (; blocks && n + 4 <= n1; n += 4) dot_rows<4>(x, w + n * ws, ws, y + n, N);
  for (; n < n1; ++n) dot_rows<1>(x, w + n * ws, ws, y + n, N);
#endif
}

// x (M, K) of any float dtype -> what this call's path reads: (bf16 weights on the vdpbf16ps path) the
// bf16 planes only, x's own rows when it is bf16, else hi = bf16(x), lo = bf16(x - hi); otherwise the
// fp32 rows, in pairs order for the AVX2 path's bf16 weights. (Converting every element both ways took ~5 us a call at 8 rows, a third of a small
// layer's GEMV.)
template <class XT>
static XRows prepare_x(const XT* x, int64_t M, int64_t K, int64_t xs, XLayout layout) {
  XRows r;
  r.M = M;
  r.K = K;
  if (layout == XLayout::planes) {
    r.Kp = round_up(std::max<int64_t>(K, 1), 32);
    r.nt = std::is_same_v<XT, bf16> ? 1 : 2;
    r.h.assign(r.nt * M * r.Kp, bf16(0.f));
    for (int64_t m = 0; m < M; ++m) {
      if constexpr (std::is_same_v<XT, bf16>) {
        std::copy(x + m * xs, x + m * xs + K, r.h.data() + m * r.Kp);
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const float v = static_cast<float>(x[m * xs + k]);
          const bf16 hi(v);
          r.h[m * r.Kp + k] = hi;
          r.h[(M + m) * r.Kp + k] = bf16(v - static_cast<float>(hi));
        }
      }
    }
    return r;
  }
  r.f.resize(std::max<int64_t>(M * K, 1));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) r.f[m * K + k] = static_cast<float>(x[m * xs + k]);
  if (layout == XLayout::pairs)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k0 = 0; k0 + 16 <= K; k0 += 16)
        for (int64_t i = 0; i < 8; ++i) {
          r.f[m * K + k0 + i] = static_cast<float>(x[m * xs + k0 + 2 * i]);
          r.f[m * K + k0 + 8 + i] = static_cast<float>(x[m * xs + k0 + 2 * i + 1]);
        }
  return r;
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
#if defined(SPARQ_AVX512_BF16)
  const XLayout layout = wdt == at::kBFloat16 ? XLayout::planes : XLayout::rows;
#elif defined(SPARQ_AVX2)
  const XLayout layout = wdt == at::kBFloat16 ? XLayout::pairs : XLayout::rows;
#else
  const XLayout layout = XLayout::rows;
#endif
  XRows xr;
  if (xdt == at::kFloat) xr = prepare_x(x.data_ptr<float>(), M, K, x.stride(0), layout);
  else if (xdt == at::kBFloat16) xr = prepare_x(x.data_ptr<bf16>(), M, K, x.stride(0), layout);
  else xr = prepare_x(x.data_ptr<f16>(), M, K, x.stride(0), layout);
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t ws = w.stride(0);
  over_weight_rows_into(y, [&](int64_t n0, int64_t n1, float* out, int64_t ldo) {
    if (wdt == at::kFloat) linear_rows(xr, w.data_ptr<float>() + n0 * ws, ws, 0, n1 - n0, out, ldo);
    else if (wdt == at::kBFloat16) linear_rows(xr, w.data_ptr<bf16>() + n0 * ws, ws, 0, n1 - n0, out, ldo);
    else linear_rows(xr, w.data_ptr<f16>() + n0 * ws, ws, 0, n1 - n0, out, ldo);
  });
  return y;
}

std::string linear_cpu_isa() { return gemv_isa(); }

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("linear_cpu", &sparq_cpu::linear_cpu);
}
TORCH_LIBRARY_IMPL(sparq, CompositeExplicitAutograd, m) {  // no tensor arguments
  m.impl("linear_cpu_isa", &sparq_cpu::linear_cpu_isa);
}
