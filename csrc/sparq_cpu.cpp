// Fused SparQ decode attention for CPU (Ribar et al., ICML 2024), one query token per row.
//
// Registered as the CPU kernel of the op sparq::decode_cpu, whose schema (and fake/meta
// implementation) kernels.py defines:
//   decode_cpu(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length,
//              int r, int k_top, int local, bool mean_v) -> Tensor
// It computes exactly what sparq.sparq_reference computes, in fp32:
//   i1 = top-r of |q| summed over the g query heads of a KV head;
//   s_hat_h = softmax_s(q_h[i1] . K[s, i1] / tau_h), tau_h = sqrt(d |q_h[i1]|_1 / |q_h|_1);
//   i2 = the last min(local, S) positions + the top of sum_h s_hat_h over the others
//        (min(k_top, S) positions in all);
//   y_h = softmax(q_h . K[i2] / sqrt(d)) @ V[i2];  mean-V: y = alpha y + (1 - alpha) v_sum / S,
//        alpha_h = sum_{i2} s_hat_h.
//
// Work plan per (batch row, KV head) -- "bh" -- split over S into chunks when there are too few
// bh for the threads (B = 1 and 3 KV heads on 2 cores):
//   A. stream the r rows i1 of K^T (S-contiguous; or gather r columns of K when k_t is None) once
//      for all g heads, writing the g logits per position into a per-thread buffer (in cache)
//      and keeping a running max per head;
//   B. e = exp(logit - chunk max) in place, chunk sums;
//   C. combine the chunk maxima/sums into the softmax weights w_h = exp(m_chunk - m) / Z, score
//      positions with sum_h w_h e_h and keep the best candidates in a small heap (vectorised
//      threshold test, no sort of the row); merge the chunk candidates;
//   D. gather the selected rows of K and V directly from the cache (software-prefetched) and
//      attend exactly; apply mean-V.
// Positions >= S and batch rows >= B are never loaded (tails use masked loads).
// Buffers are reused across calls (one workspace that only grows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPARQ_AVX512 1
#include <immintrin.h>
#endif

namespace sparq_cpu {
namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// 16-lane float vectors: AVX-512 intrinsics, or a portable fallback the compiler can vectorise.
// ---------------------------------------------------------------------------------------------

#ifdef SPARQ_AVX512
struct V { __m512 x; };
using M = __mmask16;
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vset(float a) { return {_mm512_set1_ps(a)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.x, b.x)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.x, b.x)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.x, b.x)}; }
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }  // a * b + c
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.x, b.x)}; }
static inline V vmax_masked(V acc, M m, V b) { return {_mm512_mask_max_ps(acc.x, m, acc.x, b.x)}; }
static inline float hsum(V a) { return _mm512_reduce_add_ps(a.x); }
static inline float hmax(V a) { return _mm512_reduce_max_ps(a.x); }
static inline M cmp_ge(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_GE_OQ); }
static inline M tail_mask(int64_t n) { return n >= 16 ? (M)0xFFFF : (M)((1u << n) - 1u); }
static inline V vselect(M m, V a, V b) { return {_mm512_mask_blend_ps(m, b.x, a.x)}; }  // m ? a : b

static inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V load(const bf16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
static inline V load(const f16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
static inline V load(const float* p, M m) { return {_mm512_maskz_loadu_ps(m, p)}; }
static inline V load(const bf16* p, M m) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
static inline V load(const f16* p, M m) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p))}; }
static inline void store(float* p, V a) { _mm512_storeu_ps(p, a.x); }
static inline void store(float* p, V a, M m) { _mm512_mask_storeu_ps(p, m, a.x); }

// exp with ~1 ulp error (Cephes polynomial, 2^n applied with scalef: underflows cleanly to 0).
static inline V vexp(V v) {
  __m512 x = _mm512_max_ps(_mm512_set1_ps(-104.0f), v.x);  // NaN (second operand) propagates
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}

// Step 1 without K^T: 16 positions (rows `stride` elements apart) of column `col` of K.
struct ColGather {
  __m512i index;  // lane * stride + col (fp32) or + (col & ~1) (16-bit types, read as 32-bit pairs)
  bool high;      // 16-bit types: the element is the upper half of the pair
};
static inline ColGather col_gather_setup(int64_t stride, int64_t col, bool sixteen_bit) {
  __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int32_t c = (int32_t)(sixteen_bit ? (col & ~int64_t(1)) : col);
  __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32((int32_t)stride)), _mm512_set1_epi32(c));
  return {idx, sixteen_bit && (col & 1)};
}
static inline V gather(const float* base, const ColGather& g, M m) {
  return {_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, g.index, base, 4)};
}
static inline __m512i gather_pairs(const void* base, const ColGather& g, M m) {
  // 4-byte loads at even element offsets: never cross the end of a row (d is even).
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, g.index, base, 2);
}
static inline V gather(const bf16* base, const ColGather& g, M m) {
  __m512i w = gather_pairs(base, g, m);
  w = g.high ? _mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)) : _mm512_slli_epi32(w, 16);
  return {_mm512_castsi512_ps(w)};
}
static inline V gather(const f16* base, const ColGather& g, M m) {
  __m512i w = gather_pairs(base, g, m);
  if (g.high) w = _mm512_srli_epi32(w, 16);
  return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(w))};
}
static inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

#else  // portable fallback

struct V { float x[16]; };
using M = uint32_t;
#define SPARQ_LANES for (int l = 0; l < 16; ++l)
static inline V vzero() { V r; SPARQ_LANES r.x[l] = 0.f; return r; }
static inline V vset(float a) { V r; SPARQ_LANES r.x[l] = a; return r; }
static inline V vadd(V a, V b) { V r; SPARQ_LANES r.x[l] = a.x[l] + b.x[l]; return r; }
static inline V vsub(V a, V b) { V r; SPARQ_LANES r.x[l] = a.x[l] - b.x[l]; return r; }
static inline V vmul(V a, V b) { V r; SPARQ_LANES r.x[l] = a.x[l] * b.x[l]; return r; }
static inline V vfma(V a, V b, V c) { V r; SPARQ_LANES r.x[l] = std::fma(a.x[l], b.x[l], c.x[l]); return r; }
static inline V vmax(V a, V b) { V r; SPARQ_LANES r.x[l] = a.x[l] > b.x[l] ? a.x[l] : b.x[l]; return r; }
static inline V vmax_masked(V acc, M m, V b) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) && b.x[l] > acc.x[l] ? b.x[l] : acc.x[l]; return r; }
static inline float hsum(V a) { float s = 0.f; SPARQ_LANES s += a.x[l]; return s; }
static inline float hmax(V a) { float s = kNegInf; SPARQ_LANES s = a.x[l] > s ? a.x[l] : s; return s; }
static inline M cmp_ge(V a, V b) { M m = 0; SPARQ_LANES m |= (M)(a.x[l] >= b.x[l]) << l; return m; }
static inline M tail_mask(int64_t n) { return n >= 16 ? (M)0xFFFF : (M)((1u << n) - 1u); }
static inline V vselect(M m, V a, V b) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) ? a.x[l] : b.x[l]; return r; }
template <typename T> static inline V load(const T* p) { V r; SPARQ_LANES r.x[l] = (float)p[l]; return r; }
template <typename T> static inline V load(const T* p, M m) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) ? (float)p[l] : 0.f; return r; }
static inline void store(float* p, V a) { SPARQ_LANES p[l] = a.x[l]; }
static inline void store(float* p, V a, M m) { SPARQ_LANES if ((m >> l) & 1) p[l] = a.x[l]; }
static inline V vexp(V v) { V r; SPARQ_LANES r.x[l] = std::exp(v.x[l]); return r; }
struct ColGather { int64_t stride, col; };
static inline ColGather col_gather_setup(int64_t stride, int64_t col, bool) { return {stride, col}; }
template <typename T> static inline V gather(const T* base, const ColGather& g, M m) {
  V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) ? (float)base[l * g.stride + g.col] : 0.f; return r;
}
static inline void prefetch(const void* p) { __builtin_prefetch(p); }
#undef SPARQ_LANES
#endif

static inline float lane(V a, int l) {
  alignas(64) float t[16];
  store(t, a);
  return t[l];
}

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }
template <typename T> static inline T from_f(float x) { return static_cast<T>(x); }

// ---------------------------------------------------------------------------------------------
// Problem description
// ---------------------------------------------------------------------------------------------

struct Problem {
  int64_t B, H, g, d, S, r, kk, n_local, m, n_scored;
  bool mean_v, two_k;
  // strides (elements); the last dim of k, v, k_t, v_sum is contiguous
  int64_t qs0, qs1, qs2, qs3;
  int64_t ks0, ks1, ks2;
  int64_t kts0, kts1, kts2;
  int64_t vs0, vs1, vs2;
  int64_t vss0, vss1;
  const float* vsum;
  // chunking over S
  int nc;
  int64_t cs;  // chunk length (multiple of 64)
};

struct Cand {
  float s;
  int32_t i;
};
// Total order used for every selection: higher score first, then the lower position.
static inline bool better(const Cand& a, const Cand& b) { return a.s > b.s || (a.s == b.s && a.i < b.i); }

// ---------------------------------------------------------------------------------------------
// Per-bh preparation: q in fp32, i1, q_hat = q[i1] / tau (laid out [i][h])
// ---------------------------------------------------------------------------------------------

template <typename QT>
static void prepare(const Problem& P, const QT* q, int64_t b, int64_t h, float* qf, int32_t* order,
                    int32_t* i1, float* qhat) {
  const int64_t g = P.g, d = P.d, r = P.r;
  const QT* qb = q + b * P.qs0 + h * P.qs1;
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t j = 0; j < d; ++j) qf[hh * d + j] = to_f(qb[hh * P.qs2 + j * P.qs3]);
  // |q| summed over the group (accumulated in head order, as torch does for small g)
  float* absum = qhat;  // scratch: qhat has room for r * g >= ... not necessarily d; use order space below
  (void)absum;
  std::vector<float>* dummy = nullptr;
  (void)dummy;
  float* a = qf + g * d;  // qf has d extra floats of scratch
  for (int64_t j = 0; j < d; ++j) {
    float s = 0.f;
    for (int64_t hh = 0; hh < g; ++hh) s += std::fabs(qf[hh * d + j]);
    a[j] = s;
  }
  for (int64_t j = 0; j < d; ++j) order[j] = (int32_t)j;
  auto cmp = [a](int32_t x, int32_t y) { return a[x] > a[y] || (a[x] == a[y] && x < y); };
  if (r < d) std::nth_element(order, order + r, order + d, cmp);
  std::copy(order, order + r, i1);
  std::sort(i1, i1 + r);  // ascending rows of K^T: friendlier streams
  for (int64_t hh = 0; hh < g; ++hh) {
    float tot = 0.f, sel = 0.f;
    for (int64_t j = 0; j < d; ++j) tot += std::fabs(qf[hh * d + j]);
    for (int64_t i = 0; i < r; ++i) sel += std::fabs(qf[hh * d + i1[i]]);
    const float inv_tau = 1.0f / std::sqrt((float)d * sel / tot);
    for (int64_t i = 0; i < r; ++i) qhat[i * g + hh] = qf[hh * d + i1[i]] * inv_tau;
  }
}

// ---------------------------------------------------------------------------------------------
// Pass A: approximate logits for positions [p0, p1), heads [0, G) of a head group.
//   L[h * ldL + (p - p0)]; mx[h] updated with the running max.
// ---------------------------------------------------------------------------------------------

constexpr int64_t kPrefetchAhead = 1024;  // bytes ahead in each of the r streams

template <int G, typename KT>
static void logits_2k(const KT* const* rows, int64_t r, const float* qhat, int64_t qstride, int64_t p0,
                      int64_t p1, float* L, int64_t ldL, float* mx) {
  constexpr int64_t PF = kPrefetchAhead / (int64_t)sizeof(KT);
  V vmx[G];
  for (int h = 0; h < G; ++h) vmx[h] = vset(mx[h]);
  int64_t p = p0;
  for (; p + 32 <= p1; p += 32) {
    V acc0[G], acc1[G];
    for (int h = 0; h < G; ++h) acc0[h] = acc1[h] = vzero();
    const bool pf = p + PF + 32 <= p1;
    for (int64_t i = 0; i < r; ++i) {
      const KT* row = rows[i] + p;
      if (pf) {
        prefetch(row + PF);
        if (sizeof(KT) == 4) prefetch(row + PF + 16);
      }
      const V k0 = load(row), k1 = load(row + 16);
      const float* qi = qhat + i * qstride;
#pragma GCC unroll 8
      for (int h = 0; h < G; ++h) {
        const V qv = vset(qi[h]);
        acc0[h] = vfma(qv, k0, acc0[h]);
        acc1[h] = vfma(qv, k1, acc1[h]);
      }
    }
    float* out = L + (p - p0);
    for (int h = 0; h < G; ++h) {
      store(out + h * ldL, acc0[h]);
      store(out + h * ldL + 16, acc1[h]);
      vmx[h] = vmax(vmx[h], vmax(acc0[h], acc1[h]));
    }
  }
  for (; p < p1; p += 16) {
    const M mk = tail_mask(p1 - p);
    V acc[G];
    for (int h = 0; h < G; ++h) acc[h] = vzero();
    for (int64_t i = 0; i < r; ++i) {
      const V kv = load(rows[i] + p, mk);
      const float* qi = qhat + i * qstride;
      for (int h = 0; h < G; ++h) acc[h] = vfma(vset(qi[h]), kv, acc[h]);
    }
    for (int h = 0; h < G; ++h) {
      store(L + h * ldL + (p - p0), acc[h], mk);
      vmx[h] = vmax_masked(vmx[h], mk, acc[h]);
    }
  }
  for (int h = 0; h < G; ++h) mx[h] = hmax(vmx[h]);
}

template <int G, typename KT>
static void logits_1k(const KT* kbh, int64_t stride, const ColGather* cols, int64_t r, const float* qhat,
                      int64_t qstride, int64_t p0, int64_t p1, float* L, int64_t ldL, float* mx) {
  V vmx[G];
  for (int h = 0; h < G; ++h) vmx[h] = vset(mx[h]);
  for (int64_t p = p0; p < p1; p += 16) {
    const M mk = tail_mask(p1 - p);
    const KT* base = kbh + p * stride;
    V acc[G];
    for (int h = 0; h < G; ++h) acc[h] = vzero();
    for (int64_t i = 0; i < r; ++i) {
      const V kv = gather(base, cols[i], mk);
      const float* qi = qhat + i * qstride;
#pragma GCC unroll 8
      for (int h = 0; h < G; ++h) acc[h] = vfma(vset(qi[h]), kv, acc[h]);
    }
    for (int h = 0; h < G; ++h) {
      store(L + h * ldL + (p - p0), acc[h], mk);
      vmx[h] = vmax_masked(vmx[h], mk, acc[h]);
    }
  }
  for (int h = 0; h < G; ++h) mx[h] = hmax(vmx[h]);
}

template <typename KT>
static void logits_any(const Problem& P, const KT* const* rows, const KT* kbh, const ColGather* cols,
                       const float* qhat, int64_t p0, int64_t p1, float* L, int64_t ldL, float* mx) {
  for (int64_t h0 = 0; h0 < P.g; h0 += 8) {
    const int64_t G = std::min<int64_t>(8, P.g - h0);
    const float* qh = qhat + h0;
    float* Lh = L + h0 * ldL;
    float* mh = mx + h0;
#define SPARQ_CASE(n)                                                                        \
  case n:                                                                                    \
    if (P.two_k) logits_2k<n, KT>(rows, P.r, qh, P.g, p0, p1, Lh, ldL, mh);                \
    else logits_1k<n, KT>(kbh, P.ks2, cols, P.r, qh, P.g, p0, p1, Lh, ldL, mh);            \
    break;
    switch (G) {
      SPARQ_CASE(1) SPARQ_CASE(2) SPARQ_CASE(3) SPARQ_CASE(4)
      SPARQ_CASE(5) SPARQ_CASE(6) SPARQ_CASE(7) SPARQ_CASE(8)
    }
#undef SPARQ_CASE
  }
}

// Pass B: e = exp(L - m) in place for positions [0, n); returns sum(e).
static float exp_inplace(float* L, int64_t n, float m) {
  const V vm = vset(m);
  V s0 = vzero(), s1 = vzero();
  int64_t p = 0;
  for (; p + 32 <= n; p += 32) {
    const V e0 = vexp(vsub(load(L + p), vm)), e1 = vexp(vsub(load(L + p + 16), vm));
    store(L + p, e0);
    store(L + p + 16, e1);
    s0 = vadd(s0, e0);
    s1 = vadd(s1, e1);
  }
  for (; p < n; p += 16) {
    const M mk = tail_mask(n - p);
    const V e = vexp(vsub(load(L + p, mk), vm));
    store(L + p, e, mk);
    s0 = vadd(s0, vselect(mk, e, vzero()));
  }
  return hsum(vadd(s0, s1));
}

// Pass C: candidates among positions [lo, hi) (absolute), scores sum_h w[h] * E[h * ldL + p - base].
// Keeps the best `cap` in a heap (worst on top). Returns how many it holds.
static int64_t select_range(const float* E, int64_t ldL, int64_t base, int64_t g, const float* w, int64_t lo,
                            int64_t hi, int64_t cap, Cand* heap) {
  if (cap <= 0 || hi <= lo) return 0;
  int64_t n = 0;
  V thr = vset(kNegInf);
  alignas(64) float sc_l[16];
  // Backward scan: recent positions tend to score high, which raises the threshold early.
  for (int64_t p = hi; p > lo;) {
    const int64_t cnt = std::min<int64_t>(16, p - lo);
    p -= cnt;
    const M mk = tail_mask(cnt);
    const float* e = E + (p - base);
    V sc = vmul(vset(w[0]), load(e, mk));
    for (int64_t h = 1; h < g; ++h) sc = vfma(vset(w[h]), load(e + h * ldL, mk), sc);
    M hit = n < cap ? mk : (M)(cmp_ge(sc, thr) & mk);
    if (!hit) continue;
    store(sc_l, sc);
    while (hit) {
      const int l = __builtin_ctz((unsigned)hit);
      hit &= hit - 1;
      const Cand c{sc_l[l], (int32_t)(p + l)};
      if (n < cap) {
        heap[n++] = c;
        std::push_heap(heap, heap + n, better);
        if (n == cap) thr = vset(heap[0].s);
      } else if (better(c, heap[0])) {
        std::pop_heap(heap, heap + n, better);
        heap[n - 1] = c;
        std::push_heap(heap, heap + n, better);
        thr = vset(heap[0].s);
      }
    }
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Step 2-3: exact attention over the selected positions, mean-V, output.
// ---------------------------------------------------------------------------------------------

template <typename KT, typename QT>
static void attend(const Problem& P, const KT* k, const KT* v, int64_t b, int64_t h, const float* qf,
                   const int32_t* pos, int64_t kk, const float* alpha, float* lg, float* y, QT* out) {
  const int64_t g = P.g, d = P.d;
  const KT* kb = k + b * P.ks0 + h * P.ks1;
  const KT* vb = v + b * P.vs0 + h * P.vs1;
  const float scale = 1.0f / std::sqrt((float)d);
  const int64_t nfull = d / 16, rem = d % 16;
  const M mrem = tail_mask(rem);
  constexpr int64_t AHEAD = 6;
  const int64_t row_bytes = d * (int64_t)sizeof(KT);
  auto prefetch_row = [row_bytes](const KT* row) {
    const char* c = reinterpret_cast<const char*>(row);
    for (int64_t o = 0; o < row_bytes; o += 64) prefetch(c + o);
    prefetch(c + row_bytes - 1);
  };
  for (int64_t j = 0; j < std::min(AHEAD, kk); ++j) prefetch_row(kb + (int64_t)pos[j] * P.ks2);
  // logits: g x kk
  for (int64_t j = 0; j < kk; ++j) {
    if (j + AHEAD < kk) prefetch_row(kb + (int64_t)pos[j + AHEAD] * P.ks2);
    if (j < 2 * AHEAD) prefetch_row(vb + (int64_t)pos[j] * P.vs2);
    else if (j - 2 * AHEAD < kk) prefetch_row(vb + (int64_t)pos[j - 2 * AHEAD + 2 * AHEAD] * P.vs2);
    const KT* row = kb + (int64_t)pos[j] * P.ks2;
    for (int64_t hh = 0; hh < g; ++hh) {
      const float* qh = qf + hh * d;
      V acc = vzero();
      for (int64_t c = 0; c < nfull; ++c) acc = vfma(load(qh + 16 * c), load(row + 16 * c), acc);
      if (rem) acc = vfma(load(qh + 16 * nfull, mrem), load(row + 16 * nfull, mrem), acc);
      lg[hh * kk + j] = hsum(acc) * scale;
    }
  }
  // softmax per head
  for (int64_t hh = 0; hh < g; ++hh) {
    float* l = lg + hh * kk;
    float mx = kNegInf;
    for (int64_t j = 0; j < kk; ++j) mx = std::max(mx, l[j]);
    const float s = exp_inplace(l, kk, mx);
    const float inv = 1.0f / s;
    for (int64_t j = 0; j < kk; ++j) l[j] *= inv;
  }
  // y = p @ V
  std::fill(y, y + g * d, 0.f);
  for (int64_t j = 0; j < kk; ++j) {
    const KT* row = vb + (int64_t)pos[j] * P.vs2;
    for (int64_t c = 0; c < nfull; ++c) {
      const V vr = load(row + 16 * c);
      for (int64_t hh = 0; hh < g; ++hh) {
        float* yc = y + hh * d + 16 * c;
        store(yc, vfma(vset(lg[hh * kk + j]), vr, load(yc)));
      }
    }
    if (rem) {
      const V vr = load(row + 16 * nfull, mrem);
      for (int64_t hh = 0; hh < g; ++hh) {
        float* yc = y + hh * d + 16 * nfull;
        store(yc, vfma(vset(lg[hh * kk + j]), vr, load(yc, mrem)), mrem);
      }
    }
  }
  QT* o = out + (b * P.H + h) * g * d;
  if (alpha) {
    const float* vs = P.vsum + b * P.vss0 + h * P.vss1;
    const float inv_s = 1.0f / (float)P.S;
    for (int64_t hh = 0; hh < g; ++hh) {
      const float a = alpha[hh];
      for (int64_t j = 0; j < d; ++j) o[hh * d + j] = from_f<QT>(a * y[hh * d + j] + (1.0f - a) * (vs[j] * inv_s));
    }
  } else {
    for (int64_t j = 0; j < g * d; ++j) o[j] = from_f<QT>(y[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Workspace: one buffer that only grows (big allocations are returned to the OS on free, so a
// fresh one per call would page-fault every step).
// ---------------------------------------------------------------------------------------------

struct Workspace {
  std::mutex mu;
  float* data = nullptr;
  size_t cap = 0;  // floats
  float* get(size_t n) {
    if (n > cap) {
      std::free(data);
      size_t bytes = ((n * sizeof(float) + 4095) / 4096) * 4096;
      data = static_cast<float*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(data != nullptr, "sparq::decode_cpu: out of memory for the workspace");
      cap = bytes / sizeof(float);
    }
    return data;
  }
};
static Workspace& workspace() {
  static Workspace* w = new Workspace();  // never destroyed: safe at interpreter exit
  return *w;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch layout (floats).
struct Scratch {
  int64_t qf, order, i1, qhat, rows, cols, stats, cand, pos, lg, y, alpha, total;
};
static Scratch scratch_layout(const Problem& P, int64_t nbuf_logits) {
  Scratch s{};
  int64_t o = 0;
  auto take = [&o](int64_t n) { int64_t at = o; o += round_up(std::max<int64_t>(n, 1), 16); return at; };
  s.qf = take(P.g * P.d + P.d);
  s.order = take(P.d);
  s.i1 = take(P.d);
  s.qhat = take(P.r * P.g);
  s.rows = take(P.r * 2);                      // r pointers
  s.cols = take(P.r * (int64_t)(sizeof(ColGather) / sizeof(float) + 1));
  s.stats = take(3 * P.g);                     // m, Z, w (single-chunk path)
  s.cand = take(2 * std::max<int64_t>(P.m, 1) * P.nc);  // Cand = 2 floats
  s.pos = take(P.kk);
  s.lg = take(P.g * P.kk);
  s.y = take(P.g * P.d);
  s.alpha = take(P.g);
  s.total = o + nbuf_logits;  // logits buffer last
  return s;
}

template <typename KT, typename QT>
static void run(const Problem& P, const QT* q, const KT* k, const KT* kt, const KT* v, QT* out) {
  const int64_t BH = P.B * P.H;
  const int64_t units = BH * P.nc;
  int nt = 1;
#ifdef _OPENMP
  nt = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  if (omp_in_parallel()) nt = 1;
#endif
  const int64_t g = P.g;
  // Logits buffers: one (g x S) per thread when a bh is one unit; else (g x cs) per unit, shared.
  const int64_t ld_single = round_up(P.S, 16);
  const int64_t per_thread_logits = P.nc == 1 ? g * ld_single : 0;
  const Scratch L = scratch_layout(P, per_thread_logits);
  const int64_t thread_floats = round_up(L.total, 16);
  const int64_t shared_logits = P.nc > 1 ? units * g * P.cs : 0;
  const int64_t shared_stats = P.nc > 1 ? units * g * 3 : 0;        // m, Z, w per unit and head
  const int64_t shared_cand = P.nc > 1 ? units * (2 * std::max<int64_t>(P.m, 1) + 16) : 0;  // + count
  Workspace& ws = workspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  float* base = ws.get(nt * thread_floats + shared_logits + shared_stats + shared_cand + 64);
  float* sh_logits = base + nt * thread_floats;
  float* sh_stats = sh_logits + shared_logits;
  float* sh_cand = sh_stats + shared_stats;
  const int64_t cand_stride = 2 * std::max<int64_t>(P.m, 1) + 16;

  auto body = [&](int tid) {
    float* T = base + tid * thread_floats;
    float* qf = T + L.qf;
    int32_t* order = reinterpret_cast<int32_t*>(T + L.order);
    int32_t* i1 = reinterpret_cast<int32_t*>(T + L.i1);
    float* qhat = T + L.qhat;
    const KT** rows = reinterpret_cast<const KT**>(T + L.rows);
    ColGather* cols = reinterpret_cast<ColGather*>(T + L.cols);
    float* stats = T + L.stats;
    Cand* cand = reinterpret_cast<Cand*>(T + L.cand);
    int32_t* pos = reinterpret_cast<int32_t*>(T + L.pos);
    float* lg = T + L.lg;
    float* y = T + L.y;
    float* alpha = T + L.alpha;
    float* Lbuf = T + L.total - per_thread_logits;

    auto setup_bh = [&](int64_t bh) -> const KT* {  // q prep + stream pointers; returns K base of bh
      const int64_t b = bh / P.H, h = bh % P.H;
      prepare(P, q, b, h, qf, order, i1, qhat);
      const KT* kbh = k + b * P.ks0 + h * P.ks1;
      if (P.two_k) {
        const KT* ktbh = kt + b * P.kts0 + h * P.kts1;
        for (int64_t i = 0; i < P.r; ++i) rows[i] = ktbh + (int64_t)i1[i] * P.kts2;
      } else {
        for (int64_t i = 0; i < P.r; ++i) cols[i] = col_gather_setup(P.ks2, i1[i], sizeof(KT) == 2);
      }
      return kbh;
    };
    auto locals_into = [&](int32_t* dst) {
      for (int64_t j = 0; j < P.n_local; ++j) dst[j] = (int32_t)(P.S - P.n_local + j);
    };

    if (P.nc == 1) {
      const int64_t lo = BH * tid / nt, hi = BH * (tid + 1) / nt;
      for (int64_t bh = lo; bh < hi; ++bh) {
        const KT* kbh = setup_bh(bh);
        float* mx = stats;
        float* w = stats + 2 * g;
        for (int64_t hh = 0; hh < g; ++hh) mx[hh] = kNegInf;
        logits_any<KT>(P, rows, kbh, cols, qhat, 0, P.S, Lbuf, ld_single, mx);
        for (int64_t hh = 0; hh < g; ++hh) w[hh] = 1.0f / exp_inplace(Lbuf + hh * ld_single, P.S, mx[hh]);
        const int64_t nsel = select_range(Lbuf, ld_single, 0, g, w, 0, P.n_scored, P.m, cand);
        locals_into(pos);
        for (int64_t j = 0; j < nsel; ++j) pos[P.n_local + j] = cand[j].i;
        const int64_t kk = P.n_local + nsel;
        float* al = nullptr;
        if (P.mean_v) {
          for (int64_t hh = 0; hh < g; ++hh) {
            float a = 0.f;
            for (int64_t j = 0; j < kk; ++j) a += Lbuf[hh * ld_single + pos[j]];
            alpha[hh] = a * w[hh];
          }
          al = alpha;
        }
        attend<KT, QT>(P, k, v, bh / P.H, bh % P.H, qf, pos, kk, al, lg, y, out);
      }
      return;
    }

    // ---- several chunks per bh: three phases separated by barriers
    const int64_t ulo = units * tid / nt, uhi = units * (tid + 1) / nt;
    int64_t prepared = -1;
    const KT* kbh = nullptr;
    for (int64_t u = ulo; u < uhi; ++u) {
      const int64_t bh = u / P.nc, c = u % P.nc;
      const int64_t p0 = c * P.cs, p1 = std::min(P.S, p0 + P.cs);
      float* st = sh_stats + u * g * 3;  // [m(g), Z(g), w(g)]
      for (int64_t hh = 0; hh < g; ++hh) { st[hh] = kNegInf; st[g + hh] = 0.f; }
      if (p1 <= p0) continue;
      if (prepared != bh) { kbh = setup_bh(bh); prepared = bh; }
      float* Lu = sh_logits + u * g * P.cs;
      logits_any<KT>(P, rows, kbh, cols, qhat, p0, p1, Lu, P.cs, st);
      for (int64_t hh = 0; hh < g; ++hh) st[g + hh] = exp_inplace(Lu + hh * P.cs, p1 - p0, st[hh]);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    for (int64_t u = ulo; u < uhi; ++u) {
      const int64_t bh = u / P.nc, c = u % P.nc;
      const int64_t p0 = c * P.cs, p1 = std::min(P.S, p0 + P.cs);
      float* st = sh_stats + u * g * 3;
      const float* st0 = sh_stats + bh * P.nc * g * 3;
      for (int64_t hh = 0; hh < g; ++hh) {
        float M_ = kNegInf;
        for (int64_t cc = 0; cc < P.nc; ++cc) M_ = std::max(M_, st0[cc * g * 3 + hh]);
        float Z = 0.f;
        for (int64_t cc = 0; cc < P.nc; ++cc) {
          const float* s2 = st0 + cc * g * 3;
          if (s2[g + hh] > 0.f) Z += s2[g + hh] * std::exp(s2[hh] - M_);
        }
        st[2 * g + hh] = st[g + hh] > 0.f ? std::exp(st[hh] - M_) / Z : 0.f;
      }
      float* cu = sh_cand + u * cand_stride;
      int32_t* count = reinterpret_cast<int32_t*>(cu);
      Cand* cl = reinterpret_cast<Cand*>(cu + 16);
      *count = 0;
      const int64_t shi = std::min(p1, P.n_scored);
      if (shi > p0)
        *count = (int32_t)select_range(sh_logits + u * g * P.cs, P.cs, p0, g, st + 2 * g, p0, shi, P.m, cl);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    const int64_t lo = BH * tid / nt, hi = BH * (tid + 1) / nt;
    for (int64_t bh = lo; bh < hi; ++bh) {
      int64_t n = 0;
      for (int64_t c = 0; c < P.nc; ++c) {
        const float* cu = sh_cand + (bh * P.nc + c) * cand_stride;
        const int32_t cnt = *reinterpret_cast<const int32_t*>(cu);
        const Cand* cl = reinterpret_cast<const Cand*>(cu + 16);
        std::copy(cl, cl + cnt, cand + n);
        n += cnt;
      }
      if (n > P.m) {
        std::nth_element(cand, cand + P.m, cand + n, better);
        n = P.m;
      }
      locals_into(pos);
      for (int64_t j = 0; j < n; ++j) pos[P.n_local + j] = cand[j].i;
      const int64_t kk = P.n_local + n;
      float* al = nullptr;
      if (P.mean_v) {
        for (int64_t hh = 0; hh < g; ++hh) alpha[hh] = 0.f;
        for (int64_t j = 0; j < kk; ++j) {
          const int64_t c = pos[j] / P.cs;
          const int64_t u = bh * P.nc + c;
          const float* Lu = sh_logits + u * g * P.cs;
          const float* w = sh_stats + u * g * 3 + 2 * g;
          for (int64_t hh = 0; hh < g; ++hh) alpha[hh] += Lu[hh * P.cs + (pos[j] - c * P.cs)] * w[hh];
        }
        al = alpha;
      }
      setup_bh(bh);  // qf for this bh (cheap)
      attend<KT, QT>(P, k, v, bh / P.H, bh % P.H, qf, pos, kk, al, lg, y, out);
    }
  };

#ifdef _OPENMP
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body(omp_get_thread_num());
  } else {
    body(0);
  }
#else
  body(0);
#endif
}

// How many chunks to split S into: enough units to balance the threads, chunks >= 1024 positions.
static int choose_chunks(int64_t BH, int64_t S, int nthreads) {
  if (nthreads <= 1) return 1;
  auto efficiency = [&](int64_t units) {
    const int64_t per = (units + nthreads - 1) / nthreads;
    return (double)units / (double)(per * nthreads);
  };
  int best = 1;
  double best_eff = efficiency(BH);
  for (int nc = 2; nc <= 16; ++nc) {
    if (S / nc < 1024) break;
    if (best_eff >= 0.9) break;
    const double e = efficiency(BH * nc);
    if (e > best_eff + 1e-9) { best = nc; best_eff = e; }
  }
  return best;
}

at::Tensor decode_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                      const at::Tensor& v, const at::Tensor& v_sum, int64_t length, int64_t r, int64_t k_top,
                      int64_t local, bool mean_v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && v_sum.dim() == 3,
              "sparq::decode_cpu: expected q (B, n_kv, g, d), k/v (B_max, n_kv, S_max, d), v_sum (B_max, n_kv, d)");
  const int64_t B = q.size(0), H = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t S_max = k.size(2);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && v_sum.device().is_cpu(),
              "sparq::decode_cpu: CPU tensors only");
  TORCH_CHECK(k.size(0) >= B && k.size(1) == H && k.size(3) == d, "sparq::decode_cpu: k shape ", k.sizes(),
              " does not match q ", q.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "sparq::decode_cpu: v shape ", v.sizes(), " != k shape ", k.sizes());
  TORCH_CHECK(v_sum.size(0) >= B && v_sum.size(1) == H && v_sum.size(2) == d && v_sum.scalar_type() == at::kFloat,
              "sparq::decode_cpu: v_sum must be fp32 (B_max, n_kv, d)");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "sparq::decode_cpu: k and v dtypes differ");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && v_sum.stride(2) == 1,
              "sparq::decode_cpu: k, v and v_sum must be contiguous in the head dim");
  TORCH_CHECK(1 <= length && length <= S_max, "sparq::decode_cpu: length ", length, " outside [1, ", S_max, "]");
  TORCH_CHECK(1 <= r && r <= d, "sparq::decode_cpu: r must be in [1, d]");
  TORCH_CHECK(k_top >= 1 && 0 <= local && local <= k_top, "sparq::decode_cpu: need k_top >= 1 and 0 <= local <= k_top");
  TORCH_CHECK(length < (int64_t(1) << 31), "sparq::decode_cpu: length too large");
  const bool two_k = k_t.has_value() && k_t->defined();
  if (two_k) {
    const at::Tensor& t = *k_t;
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.size(0) >= B && t.size(1) == H && t.size(2) == d &&
                    t.size(3) >= length && t.scalar_type() == k.scalar_type() && t.stride(3) == 1,
                "sparq::decode_cpu: k_t must be (B_max, n_kv, d, S_max), S-contiguous, k's dtype");
  } else {
    TORCH_CHECK(k.stride(2) < (int64_t(1) << 27), "sparq::decode_cpu: k row stride too large for gathers");
  }
  const auto kdt = k.scalar_type(), qdt = q.scalar_type();
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16 || kdt == at::kHalf, "sparq::decode_cpu: unsupported cache dtype");
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, "sparq::decode_cpu: unsupported q dtype");

  Problem P{};
  P.B = B; P.H = H; P.g = g; P.d = d; P.S = length; P.r = r;
  P.kk = std::min(k_top, length);
  P.n_local = std::min(local, length);
  P.m = P.kk - P.n_local;
  P.n_scored = length - P.n_local;
  P.mean_v = mean_v;
  P.two_k = two_k;
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.ks0 = k.stride(0); P.ks1 = k.stride(1); P.ks2 = k.stride(2);
  if (two_k) { P.kts0 = k_t->stride(0); P.kts1 = k_t->stride(1); P.kts2 = k_t->stride(2); }
  P.vs0 = v.stride(0); P.vs1 = v.stride(1); P.vs2 = v.stride(2);
  P.vss0 = v_sum.stride(0); P.vss1 = v_sum.stride(1);
  P.vsum = v_sum.data_ptr<float>();
  int nthreads = 1;
#ifdef _OPENMP
  nthreads = at::get_num_threads();
#endif
  P.nc = choose_chunks(B * H, length, nthreads);
  P.cs = round_up((length + P.nc - 1) / P.nc, 64);
  P.nc = (int)((length + P.cs - 1) / P.cs);

  at::Tensor out = at::empty({B, H, g, d}, q.options().memory_format(at::MemoryFormat::Contiguous));

#define SPARQ_RUN(KT, QT)                                                                               \
  run<KT, QT>(P, q.data_ptr<QT>(), k.data_ptr<KT>(), two_k ? k_t->data_ptr<KT>() : nullptr, v.data_ptr<KT>(), \
              out.data_ptr<QT>())
#define SPARQ_Q(KT)                                  \
  if (qdt == at::kFloat) SPARQ_RUN(KT, float);       \
  else if (qdt == at::kBFloat16) SPARQ_RUN(KT, bf16); \
  else SPARQ_RUN(KT, f16);
  if (kdt == at::kFloat) { SPARQ_Q(float) }
  else if (kdt == at::kBFloat16) { SPARQ_Q(bf16) }
  else { SPARQ_Q(f16) }
#undef SPARQ_Q
#undef SPARQ_RUN
  return out;
}

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) { m.impl("decode_cpu", &sparq_cpu::decode_cpu); }
