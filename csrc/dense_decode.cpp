// Fused dense decode attention for CPU (flash-decoding), one query token per row: the baseline
// SparQ is measured against.
//
// Registered as the CPU kernel of sparq::dense_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   dense_cpu(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? lengths=None, int queries=1) -> Tensor
//   dense_quant_cpu(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? lengths, int queries,
//                   Tensor k_scale, Tensor v_scale, Tensor chan) -> Tensor   (an int8 cache)
//   dense_int8_path() -> str   how this build reads an int8 cache (below)
// (Two ops, not optional scales with defaults: inductor's C++ wrapper passes a call's leading
// arguments only, and the dispatcher then reads the defaulted ones past the end.)
// lengths: None (every row reads positions [0, length)) or (B,) int: row b reads [0, lengths[b])
// (ragged batches: a short row costs only what it reads).
// An int8 cache (cache.KVCache with --kv-dtype int8) is read as stored: K[p] = k[p] k_scale[p] chan,
// V[p] = v[p] v_scale[p], with k_scale, v_scale (B_max, n_kv, S_max) and chan (B_max, n_kv, d) fp32:
// chan is folded into q, k_scale into each position's logit, v_scale into its softmax weight. With
// AVX512_VNNI (d = 64, 128, 256) q is quantized to int8 per (head, 4 channels) and the softmax
// weights to int16 per (head, chunk), as llama.cpp's q8_0 path quantizes its activations; the
// rounding is tested against a reference that rounds alike (tests/test_kv_quant.py).
// queries: T > 1 query tokens per row (speculative verification), q's g = heads x T (head-major):
// query t of a row of length n attends to positions [0, n - T + 1 + t), as the one-token step at
// its position would; every K and V row is still read once, for all of them.
// Each row splits its positions into chunks as it would alone (parallel.h), so each row of a batch
// is that row's call alone bit for bit, whatever the other rows and their lengths.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "parallel.h"
#include "simd.h"
#include "workspace.h"

namespace sparq_cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Dense decode attention, fused (flash-decoding): every K and V row read once, for all g heads,
// split over (bh, S chunk) units; chunk results (max, sum, unnormalised output) are combined.
// ---------------------------------------------------------------------------------------------

struct DenseProblem {
  int64_t B, H, g, d, S;  // S: the longest row's length
  int64_t T;              // query tokens per row (g = heads x T)
  int64_t qs0, qs1, qs2, qs3, ks0, ks1, ks2, vs0, vs1, vs2;
  // an int8 cache's scales (nullptr otherwise): per position (strides ss0, ss1; positions contiguous), per channel
  const float *k_scale = nullptr, *v_scale = nullptr, *chan = nullptr;
  int64_t kss0 = 0, kss1 = 0, vss0 = 0, vss1 = 0, cs0 = 0, cs1 = 0;
  const int64_t* len;              // (B,) live length of each row
  std::vector<int64_t> cs;         // (B,) each row's chunk length, as alone (parallel.h; a multiple of 64)
  int64_t most_cs;                 // the largest of them: the logits buffer's length
  std::vector<int64_t> unit0;      // (B * H + 1,) first unit of each bh: bh owns ceil(len / cs) chunks
  std::vector<int32_t> unit_bh;    // the bh of each unit
  int64_t units() const { return unit0.back(); }
  int64_t chunks(int64_t bh) const { return unit0[bh + 1] - unit0[bh]; }
};

// The logits of n positions for the g heads, 16 positions at a time: row_dots(s, out) leaves position
// s's dot product with head hh as one vector at out + hh * 256 (T: g x 16 x 16 floats, L1), and hsum16
// turns a head's 16 vectors into its 16 logits, scaled (lanes >= nb sum stale vectors: never
// stored). A reduction per logit would cost more than the dot product itself at d = 64.
template <typename RowDots>
static inline void logits_by_16(int64_t g, int64_t n, float scale, float* T, float* L, int64_t ldL,
                                RowDots row_dots) {
  const V vscale = vset(scale);
  for (int64_t s0 = 0; s0 < n; s0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n - s0);
    for (int64_t r = 0; r < nb; ++r) row_dots(s0 + r, T + r * 16);
    for (int64_t hh = 0; hh < g; ++hh)
      store(L + hh * ldL + s0, vmul(hsum16(reinterpret_cast<const V*>(T + hh * 256)), vscale), tail_mask(nb));
  }
}

// Register-blocked dense logits for d = 16 * NV: each K row is loaded (widened) once for the g heads.
template <int NV, typename KT>
static void dense_logits_nv(const float* qf, int64_t g, const KT* kb, int64_t ks, int64_t p0, int64_t n, float scale,
                            float* T, float* L, int64_t ldL) {
  constexpr int64_t d = 16 * NV;
  logits_by_16(g, n, scale, T, L, ldL, [&](int64_t s, float* out) {
    const KT* row = kb + (p0 + s) * ks;
    V kv[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) kv[c] = load(row + 16 * c);
    for (int64_t hh = 0; hh < g; ++hh) {
      const float* qh = qf + hh * d;
      V a = vmul(load(qh), kv[0]);
#pragma GCC unroll 16
      for (int c = 1; c < NV; ++c) a = vfma(load(qh + 16 * c), kv[c], a);
      store(out + hh * 256, a);
    }
  });
}

#ifdef SPARQ_AVX512_BF16
// The same for a bf16 cache with vdpbf16ps: K rows go into the dot products as loaded (32 per
// instruction, no widening), q as NT bf16 planes (q itself when it is bf16: exact products; else
// hi = bf16(q), lo = bf16(q - hi), |q - hi - lo| <= 2^-17 |q|). qh: NT planes of g x d.
template <int NV, int NT>
static void dense_logits_bf16(const bf16* qh, int64_t g, const bf16* kb, int64_t ks, int64_t p0, int64_t n,
                              float scale, float* T, float* L, int64_t ldL) {
  static_assert(NV % 2 == 0, "32 bf16 per vector");
  constexpr int64_t d = 16 * NV, NW = NV / 2;
  logits_by_16(g, n, scale, T, L, ldL, [&](int64_t s, float* out) {
    const bf16* row = kb + (p0 + s) * ks;
    __m512bh kv[NW];
#pragma GCC unroll 8
    for (int c = 0; c < NW; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
    for (int64_t hh = 0; hh < g; ++hh) {
      __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < NW; ++c)
          a = _mm512_dpbf16_ps(a, kv[c], (__m512bh)_mm512_loadu_si512(qh + (t * g + hh) * d + 32 * c));
      _mm512_storeu_ps(out + hh * 256, a);
    }
  });
}
#endif

// Whether this build reads an int8 cache of head dim d with integer dot products (the VNNI kernels
// below: whole 64-channel blocks, up to four): the one place that decides it.
static constexpr bool int8_vnni(int64_t d) {
#ifdef SPARQ_AVX512_VNNI
  return d == 64 || d == 128 || d == 256;
#else
  return (void)d, false;
#endif
}

#ifdef SPARQ_AVX512_VNNI
// The same for an int8 cache with vpdpbusd, llama.cpp's q8_0 way: q (chan folded in) quantized to
// int8 once per unit, K rows dotted as stored (64 per instruction, no widening). Lane l of a
// 64-channel block takes channels 4l..4l+3; q has one scale per (head, lane), shared by the d / 64
// blocks, so a lane's int32 sum times its scale is exact up to one rounding. vpdpbusd wants
// unsigned q: it takes q + 128, and 128 x (the lane's sum of k), from the same instruction with
// all-128 bytes, is taken off once per row for the g heads.
// q8: g x d bytes (q + 128), qs: g x 16 scales.
static void quantize_q_lanes(const float* qf, int64_t g, int64_t d, uint8_t* q8, float* qs) {
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t l = 0; l < 16; ++l) {
      float m = 0.f;
      for (int64_t c = 0; c < d; c += 64)
        for (int64_t j = 0; j < 4; ++j) m = std::max(m, std::fabs(qf[hh * d + c + 4 * l + j]));
      const float inv = m > 0.f ? 127.0f / m : 0.f;
      qs[hh * 16 + l] = m / 127.0f;
      for (int64_t c = 0; c < d; c += 64)
        for (int64_t j = 0; j < 4; ++j)
          q8[hh * d + c + 4 * l + j] = (uint8_t)(std::nearbyint(qf[hh * d + c + 4 * l + j] * inv) + 128.0f);
    }
}

template <int NB>
static void dense_logits_vnni(const uint8_t* q8, const float* qs, int64_t g, const int8_t* kb, int64_t ks,
                              int64_t p0, int64_t n, float scale, float* T, float* L, int64_t ldL) {
  constexpr int64_t d = 64 * NB;
  const __m512i all128 = _mm512_set1_epi8((char)0x80);
  logits_by_16(g, n, scale, T, L, ldL, [&](int64_t s, float* out) {
    const int8_t* row = kb + (p0 + s) * ks;
    __m512i kv[NB];
    __m512i off = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < NB; ++c) {
      kv[c] = _mm512_loadu_si512(row + 64 * c);
      off = _mm512_dpbusd_epi32(off, all128, kv[c]);
    }
    const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), off);  // -128 x (sum of k) per lane
    for (int64_t hh = 0; hh < g; ++hh) {
      __m512i a = neg;
#pragma GCC unroll 4
      for (int c = 0; c < NB; ++c) a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(q8 + hh * d + 64 * c), kv[c]);
      _mm512_storeu_ps(out + hh * 256, _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(qs + hh * 16)));
    }
  });
}
#endif

// y (g x d) = e @ V for heads [h0, h0 + HB): each V row is widened once for the HB heads, whose
// HB x DB output vectors stay in registers; the dims go DB vectors at a time.
template <int NV, int HB, typename KT>
static void dense_pv_heads(const float* L, int64_t ldL, int64_t h0, const KT* vb, int64_t vs, int64_t p0, int64_t n,
                           float* y) {
  constexpr int64_t d = 16 * NV;
  constexpr int DB = HB <= 2 ? 8 : 4;
  for (int c0 = 0; c0 < NV; c0 += DB) {
    V acc[HB][DB];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < DB; ++c) acc[h][c] = vzero();
    for (int64_t s = 0; s < n; ++s) {
      const KT* row = vb + (p0 + s) * vs + 16 * c0;
      V es[HB];
      for (int h = 0; h < HB; ++h) es[h] = vset(L[(h0 + h) * ldL + s]);
#pragma GCC unroll 8
      for (int c = 0; c < DB; ++c) {
        if (c0 + c >= NV) break;
        const V vr = load(row + 16 * c);
        for (int h = 0; h < HB; ++h) acc[h][c] = vfma(es[h], vr, acc[h][c]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < DB && c0 + c < NV; ++c) store(y + (h0 + h) * d + 16 * (c0 + c), acc[h][c]);
  }
}

#ifdef SPARQ_AVX512_VNNI
// y (g x d) = e @ V for an int8 V with vpdpwssd: the weights (e times V's scales) as int16, one scale
// per head (its largest weight -> 32767), and two positions' rows interleaved byte by byte and widened
// to int16, so each int32 lane sums position s and s + 1 of one channel; 16 lanes x 4 vectors per
// 64-channel block and head in registers. The int32 sums go to fp32 every 256 positions (|sum| <=
// 256 x 32767 x 127 < 2^31). Lane order after the interleave: vector 0 holds channels 0-7 and 16-23,
// 1: 32-39, 48-55; 2: 8-15, 24-31; 3: 40-47, 56-63 (vpunpck works within 128-bit lanes).
static void quantize_weights(const float* L, int64_t ldL, int64_t g, int64_t n, int16_t* w16, float* wscale) {
  const int64_t n2 = round_up(n, 2);
  for (int64_t hh = 0; hh < g; ++hh) {
    const float* l = L + hh * ldL;
    V m = vzero();
    for (int64_t s = 0; s < n; s += 16) m = vmax(m, load(l + s, tail_mask(n - s)));
    const float mx = hmax(m);
    wscale[hh] = mx / 32767.0f;
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.0f / mx : 0.f);
    int16_t* w = w16 + hh * ldL;
    for (int64_t s = 0; s < n2; s += 16) {
      const M mk = tail_mask(n - s);
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, l + s), inv));
      _mm256_mask_storeu_epi16(w + s, tail_mask(n2 - s), _mm512_cvtsepi32_epi16(r));
    }
  }
}

template <int NB, int HB>
static void dense_pv_vnni_heads(const int16_t* w16, int64_t ldL, const float* wscale, int64_t h0, const int8_t* vb,
                                int64_t vs, int64_t p0, int64_t n, float* y) {
  constexpr int64_t d = 64 * NB;
  for (int64_t hh = h0; hh < h0 + HB; ++hh) std::fill(y + hh * d, y + (hh + 1) * d, 0.f);
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int c = 0; c < NB; ++c)
    for (int64_t s0 = 0; s0 < n; s0 += 256) {
      const int64_t s1 = std::min<int64_t>(n, s0 + 256);
      __m512i acc[HB][4];
      for (int h = 0; h < HB; ++h)
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_si512();
      for (int64_t s = s0; s < s1; s += 2) {
        const int8_t* row = vb + (p0 + s) * vs + 64 * c;
        const __m512i r0 = _mm512_loadu_si512(row);
        const __m512i r1 = s + 1 < s1 ? _mm512_loadu_si512(row + vs) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi8(r0, r1), hi = _mm512_unpackhi_epi8(r0, r1);
        const __m512i x[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                              _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                              _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                              _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
        for (int h = 0; h < HB; ++h) {
          int32_t pair;  // weights of positions s and s + 1 (the latter 0 past the end: w16 is padded)
          std::memcpy(&pair, w16 + (h0 + h) * ldL + s, 4);
          const __m512i wv = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_dpwssd_epi32(acc[h][j], x[j], wv);
        }
      }
      for (int h = 0; h < HB; ++h) {
        const __m512 sc = _mm512_set1_ps(wscale[h0 + h]);
        __m512 f[4];
        for (int j = 0; j < 4; ++j) f[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h][j]), sc);
        // back to channel order: [0-15] = lanes 0-7 of f0, f2; [16-31] = lanes 8-15; [32-63] the same of f1, f3
        const __m512 out[4] = {_mm512_permutex2var_ps(f[0], lo_idx, f[2]), _mm512_permutex2var_ps(f[0], hi_idx, f[2]),
                               _mm512_permutex2var_ps(f[1], lo_idx, f[3]), _mm512_permutex2var_ps(f[1], hi_idx, f[3])};
        float* yh = y + (h0 + h) * d + 64 * c;
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(yh + 16 * j, _mm512_add_ps(_mm512_loadu_ps(yh + 16 * j), out[j]));
      }
    }
}

template <int NB>
static void dense_pv_vnni(const int16_t* w16, int64_t ldL, const float* wscale, int64_t g, const int8_t* vb,
                          int64_t vs, int64_t p0, int64_t n, float* y) {
  for (int64_t h0 = 0; h0 < g;) {
    switch (std::min<int64_t>(3, g - h0)) {
      case 1: dense_pv_vnni_heads<NB, 1>(w16, ldL, wscale, h0, vb, vs, p0, n, y); h0 += 1; break;
      case 2: dense_pv_vnni_heads<NB, 2>(w16, ldL, wscale, h0, vb, vs, p0, n, y); h0 += 2; break;
      default: dense_pv_vnni_heads<NB, 3>(w16, ldL, wscale, h0, vb, vs, p0, n, y); h0 += 3; break;
    }
  }
}
#endif

template <int NV, typename KT>
static void dense_pv_nv(const float* L, int64_t ldL, int64_t g, const KT* vb, int64_t vs, int64_t p0, int64_t n,
                        float* y) {
  for (int64_t h0 = 0; h0 < g;) {
    switch (std::min<int64_t>(4, g - h0)) {
      case 1: dense_pv_heads<NV, 1, KT>(L, ldL, h0, vb, vs, p0, n, y); h0 += 1; break;
      case 2: dense_pv_heads<NV, 2, KT>(L, ldL, h0, vb, vs, p0, n, y); h0 += 2; break;
      case 3: dense_pv_heads<NV, 3, KT>(L, ldL, h0, vb, vs, p0, n, y); h0 += 3; break;
      default: dense_pv_heads<NV, 4, KT>(L, ldL, h0, vb, vs, p0, n, y); h0 += 4; break;
    }
  }
}

// Per-thread scratch of one unit: q in fp32 (g x d), q's bf16 planes (2 x g x d) or its int8 bytes
// (g x d) and lane scales (g x 16), T (g x 256), an int8 V's int16 softmax weights (g x ldL).
struct DenseScratch {
  float* qf;
  bf16* qh;
  uint8_t* q8;
  float* qs;
  float* T;
  int16_t* w16;
  static int64_t floats(int64_t g, int64_t d, int64_t ldL) {
    return round_up(g * d, 16) * 2 + g * 16 + g * 256 + g * ldL / 2;
  }
  DenseScratch(float* base, int64_t g, int64_t d)
      : qf(base), qh(reinterpret_cast<bf16*>(base + round_up(g * d, 16))), q8(reinterpret_cast<uint8_t*>(qh)),
        qs(base + 2 * round_up(g * d, 16)), T(qs + g * 16), w16(reinterpret_cast<int16_t*>(T + g * 256)) {}
};

// The logits of positions [p0, p0 + n) for the g heads into L (g x ldL): true when a blocked path
// took them, false for the caller's unblocked loop.
template <typename KT, typename QT>
static bool blocked_logits(const DenseScratch& w, int64_t g, int64_t d, const KT* kb, int64_t ks, int64_t p0,
                           int64_t n, float scale, float* L, int64_t ldL) {
  if (d % 16) return false;
#ifdef SPARQ_AVX512_VNNI
  if constexpr (std::is_same_v<KT, int8_t>) {
    if (int8_vnni(d)) {
      switch (d / 64) {
        case 1: dense_logits_vnni<1>(w.q8, w.qs, g, kb, ks, p0, n, scale, w.T, L, ldL); return true;
        case 2: dense_logits_vnni<2>(w.q8, w.qs, g, kb, ks, p0, n, scale, w.T, L, ldL); return true;
        default: dense_logits_vnni<4>(w.q8, w.qs, g, kb, ks, p0, n, scale, w.T, L, ldL); return true;
      }
    }
  }
#endif
#ifdef SPARQ_AVX512_BF16
  if constexpr (std::is_same_v<KT, bf16>) {
    constexpr int NT = std::is_same_v<QT, bf16> ? 1 : 2;
    switch (d / 16) {
#define SPARQ_DLB(n_) case n_: dense_logits_bf16<n_, NT>(w.qh, g, kb, ks, p0, n, scale, w.T, L, ldL); return true;
      SPARQ_DLB(2) SPARQ_DLB(4) SPARQ_DLB(6) SPARQ_DLB(8) SPARQ_DLB(16)
#undef SPARQ_DLB
    }
  }
#endif
  switch (d / 16) {
#define SPARQ_DL(n_) case n_: dense_logits_nv<n_, KT>(w.qf, g, kb, ks, p0, n, scale, w.T, L, ldL); return true;
    SPARQ_DL(2) SPARQ_DL(3) SPARQ_DL(4) SPARQ_DL(5) SPARQ_DL(6) SPARQ_DL(7) SPARQ_DL(8) SPARQ_DL(16)
#undef SPARQ_DL
  }
  return false;
}

template <typename KT>
static bool blocked_pv(const DenseScratch& w, const float* L, int64_t ldL, int64_t g, int64_t d, const KT* vb,
                       int64_t vs, int64_t p0, int64_t n, float* y) {
  if (d % 16) return false;
#ifdef SPARQ_AVX512_VNNI
  if constexpr (std::is_same_v<KT, int8_t>) {
    if (int8_vnni(d)) {
      float* wscale = w.qs;  // q's lane scales are spent once the logits are taken
      quantize_weights(L, ldL, g, n, w.w16, wscale);
      switch (d / 64) {
        case 1: dense_pv_vnni<1>(w.w16, ldL, wscale, g, vb, vs, p0, n, y); return true;
        case 2: dense_pv_vnni<2>(w.w16, ldL, wscale, g, vb, vs, p0, n, y); return true;
        default: dense_pv_vnni<4>(w.w16, ldL, wscale, g, vb, vs, p0, n, y); return true;
      }
    }
  }
#endif
  switch (d / 16) {
#define SPARQ_DPV(n_) case n_: dense_pv_nv<n_, KT>(L, ldL, g, vb, vs, p0, n, y); return true;
    SPARQ_DPV(2) SPARQ_DPV(3) SPARQ_DPV(4) SPARQ_DPV(5) SPARQ_DPV(6) SPARQ_DPV(7) SPARQ_DPV(8) SPARQ_DPV(16)
#undef SPARQ_DPV
  }
  return false;
}

// L[hh][s] *= scale[s] for the g heads and n positions (an int8 cache's per-position scales).
static inline void scale_positions(float* L, int64_t ldL, int64_t g, const float* scale, int64_t n) {
  for (int64_t s = 0; s < n; s += 16) {
    const M mk = tail_mask(n - s);
    const V c = load(scale + s, mk);
    for (int64_t hh = 0; hh < g; ++hh) store(L + hh * ldL + s, vmul(load(L + hh * ldL + s, mk), c), mk);
  }
}

// One unit: positions [p0, p1) of bh. Writes y (g x d, unnormalised) and mz = [m(g), Z(g)].
template <typename KT, typename QT>
static void dense_unit(const DenseProblem& P, const QT* q, const KT* k, const KT* v, int64_t bh, int64_t p0,
                       int64_t p1, const DenseScratch& w, float* L, int64_t ldL, float* y, float* mz) {
  const int64_t g = P.g, d = P.d, b = bh / P.H, h = bh % P.H;
  const float scale = 1.0f / std::sqrt((float)d);
  const QT* qb = q + b * P.qs0 + h * P.qs1;
  const float* chan = P.chan ? P.chan + b * P.cs0 + h * P.cs1 : nullptr;
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t j = 0; j < d; ++j) w.qf[hh * d + j] = to_f(qb[hh * P.qs2 + j * P.qs3]) * (chan ? chan[j] : 1.0f);
  if constexpr (std::is_same_v<KT, bf16>) {  // q's bf16 planes: dense_logits_bf16's operand
    for (int64_t i = 0; i < g * d; ++i) {
      const bf16 hi(w.qf[i]);
      w.qh[i] = hi;
      w.qh[g * d + i] = bf16(w.qf[i] - static_cast<float>(hi));
    }
  }
#ifdef SPARQ_AVX512_VNNI
  if (std::is_same_v<KT, int8_t> && int8_vnni(d)) quantize_q_lanes(w.qf, g, d, w.q8, w.qs);
#endif
  const KT* kb = k + b * P.ks0 + h * P.ks1;
  const KT* vb = v + b * P.vs0 + h * P.vs1;
  const int64_t n = p1 - p0;
  // logits
  if (!blocked_logits<KT, QT>(w, g, d, kb, P.ks2, p0, n, scale, L, ldL))
    for (int64_t s = 0; s < n; ++s) {
      const KT* row = kb + (p0 + s) * P.ks2;
      for (int64_t hh = 0; hh < g; ++hh) L[hh * ldL + s] = dot_d(w.qf + hh * d, row, d) * scale;
    }
  if (P.k_scale) scale_positions(L, ldL, g, P.k_scale + b * P.kss0 + h * P.kss1 + p0, n);
  // T queries per row: query t's future (positions >= n - T + 1 + t, the last T - 1 at most) is masked
  if (P.T > 1)
    for (int64_t hh = 0; hh < g; ++hh)
      for (int64_t s = std::max(P.len[b] - P.T + 1 + hh % P.T, p0); s < p1; ++s) L[hh * ldL + s - p0] = kNegInf;
  // softmax numerators (a chunk wholly in a query's future gives it sum NaN: the combine skips it)
  for (int64_t hh = 0; hh < g; ++hh) {
    const auto [m, sum] = exp_shifted(L + hh * ldL, n);
    mz[hh] = m;
    mz[g + hh] = sum;
  }
  // y = e @ V (an int8 V's scales folded into the weights, after their sum)
  if (P.v_scale) scale_positions(L, ldL, g, P.v_scale + b * P.vss0 + h * P.vss1 + p0, n);
  if (blocked_pv<KT>(w, L, ldL, g, d, vb, P.vs2, p0, n, y)) return;
  std::fill(y, y + g * d, 0.f);
  for (int64_t s = 0; s < n; ++s) add_weighted_row(L + s, ldL, g, vb + (p0 + s) * P.vs2, d, y);
}

template <typename KT, typename QT>
static void run_dense(const DenseProblem& P, const QT* q, const KT* k, const KT* v, QT* out) {
  const int64_t BH = P.B * P.H, units = P.units(), g = P.g, d = P.d;
  const bool single = units == BH;  // one chunk per bh: write the output directly
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), units));
  const int64_t ldL = round_up(P.most_cs, 16);
  const int64_t scratch_floats = DenseScratch::floats(g, d, ldL);
  const int64_t slot_floats = scratch_floats + g * ldL + round_up(g * d, 16) + round_up(2 * g, 16);
  const int64_t unit_floats = single ? 0 : round_up(g * d + 2 * g, 16);  // y (g x d), m (g), Z (g)
  Workspace& ws = workspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  float* base = ws.get(nt * slot_floats + units * unit_floats + 64);
  float* ubase = base + nt * slot_floats;
  auto fn = [&](int phase, int64_t u, int slot) {
    const DenseScratch w(base + slot * slot_floats, g, d);
    float* L = base + slot * slot_floats + scratch_floats;
    float* y = L + g * ldL;
    float* mz = y + round_up(g * d, 16);
    if (phase == 0) {
      const int64_t bh = P.unit_bh[u], c = u - P.unit0[bh], cs = P.cs[bh / P.H];
      const int64_t p0 = c * cs, p1 = std::min(P.len[bh / P.H], p0 + cs);
      if (single) {
        dense_unit<KT, QT>(P, q, k, v, bh, p0, p1, w, L, ldL, y, mz);
        QT* o = out + bh * g * d;
        for (int64_t hh = 0; hh < g; ++hh) {
          const float inv = 1.0f / mz[g + hh];
          for (int64_t j = 0; j < d; ++j) o[hh * d + j] = from_f<QT>(y[hh * d + j] * inv);
        }
        return;
      }
      float* U = ubase + u * unit_floats;
      dense_unit<KT, QT>(P, q, k, v, bh, p0, p1, w, L, ldL, U, U + g * d);
      return;
    }
    const int64_t bh = u;  // phase 1: combine the chunks of bh
    const int64_t u0 = P.unit0[bh], nc = P.chunks(bh);
    QT* o = out + bh * g * d;
    for (int64_t hh = 0; hh < g; ++hh) {
      float M_ = kNegInf;
      for (int64_t c = 0; c < nc; ++c) M_ = std::max(M_, ubase[(u0 + c) * unit_floats + g * d + hh]);
      float Z = 0.f;
      std::fill(y, y + d, 0.f);
      for (int64_t c = 0; c < nc; ++c) {
        const float* U = ubase + (u0 + c) * unit_floats;
        if (!(U[g * d + g + hh] > 0.f)) continue;
        const float w = std::exp(U[g * d + hh] - M_);
        Z += w * U[g * d + g + hh];
        for (int64_t j = 0; j < d; ++j) y[j] += w * U[hh * d + j];
      }
      const float inv = 1.0f / Z;
      for (int64_t j = 0; j < d; ++j) o[hh * d + j] = from_f<QT>(y[j] * inv);
    }
  };
  if (single) run_phases(nt, {units}, fn);
  else run_phases(nt, {units, BH}, fn);
}

at::Tensor dense_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                      const std::optional<at::Tensor>& lengths, int64_t queries, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& chan) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "sparq::dense_cpu: expected q (B, n_kv, g, d), k/v (B_max, n_kv, S_max, d)");
  const int64_t B = q.size(0), H = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "sparq::dense_cpu: CPU tensors only");
  TORCH_CHECK(k.size(0) >= B && k.size(1) == H && k.size(3) == d && v.sizes() == k.sizes(),
              "sparq::dense_cpu: k/v shape ", k.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "sparq::dense_cpu: k and v dtypes differ");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "sparq::dense_cpu: k and v must be contiguous in the head dim");
  TORCH_CHECK(1 <= length && length <= k.size(2), "sparq::dense_cpu: length ", length, " outside [1, ", k.size(2), "]");
  const auto kdt = k.scalar_type(), qdt = q.scalar_type();
  const bool int8 = kdt == at::kChar;
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16 || kdt == at::kHalf || int8, "sparq::dense_cpu: unsupported cache dtype");
  const bool scaled = k_scale.has_value() && k_scale->defined();
  TORCH_CHECK(scaled == int8 && scaled == (v_scale.has_value() && v_scale->defined()) &&
                  scaled == (chan.has_value() && chan->defined()),
              "sparq::dense_cpu: an int8 cache needs k_scale, v_scale and chan (and only an int8 cache takes them)");
  if (int8) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) >= B && t->size(1) == H &&
                      t->size(2) >= length && t->stride(2) == 1,
                  "sparq::dense_cpu: k_scale and v_scale must be fp32 (B_max, n_kv, S_max), positions contiguous");
    TORCH_CHECK(chan->scalar_type() == at::kFloat && chan->dim() == 3 && chan->size(0) >= B && chan->size(1) == H &&
                    chan->size(2) == d && chan->stride(2) == 1,
                "sparq::dense_cpu: chan must be fp32 (B_max, n_kv, d)");
  }
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, "sparq::dense_cpu: unsupported q dtype");
  const std::vector<int64_t> len = row_lengths(lengths, B, length, "sparq::dense_cpu");
  TORCH_CHECK(queries >= 1 && g % queries == 0, "sparq::dense_cpu: queries ", queries, " does not divide g ", g);
  for (int64_t n : len) TORCH_CHECK(n >= queries, "sparq::dense_cpu: a row of ", n, " positions has ", queries, " queries");
  DenseProblem P{};
  P.B = B; P.H = H; P.g = g; P.d = d; P.S = length; P.T = queries; P.len = len.data();
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.ks0 = k.stride(0); P.ks1 = k.stride(1); P.ks2 = k.stride(2);
  P.vs0 = v.stride(0); P.vs1 = v.stride(1); P.vs2 = v.stride(2);
  if (int8) {
    P.k_scale = k_scale->data_ptr<float>(); P.kss0 = k_scale->stride(0); P.kss1 = k_scale->stride(1);
    P.v_scale = v_scale->data_ptr<float>(); P.vss0 = v_scale->stride(0); P.vss1 = v_scale->stride(1);
    P.chan = chan->data_ptr<float>(); P.cs0 = chan->stride(0); P.cs1 = chan->stride(1);
  }
  // chunks: each row's own, the split it takes alone (parallel.h row_chunk_lengths: a row's output
  // never depends on the other rows of its batch), balancing the threads over that row's KV heads and
  // bounding the logits buffer (g x cs floats per thread). The bound counts one query token's heads, so
  // T queries per row split their positions by the one-token step's rule: each query is the one-token
  // step at its position bit for bit where the two split alike (one chunk each: any row of <= 1024).
  P.cs = row_chunk_lengths(len, H, thread_count(),
                           std::max<int64_t>(1024, (int64_t(1) << 18) / std::max<int64_t>(g / queries, 1)));
  P.most_cs = *std::max_element(P.cs.begin(), P.cs.end());
  split_rows(len, H, P.cs, &P.unit0, &P.unit_bh);
  at::Tensor out = at::empty({B, H, g, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
#define SPARQ_RUN(KT, QT) run_dense<KT, QT>(P, q.data_ptr<QT>(), k.data_ptr<KT>(), v.data_ptr<KT>(), out.data_ptr<QT>())
#define SPARQ_Q(KT)                                  \
  if (qdt == at::kFloat) SPARQ_RUN(KT, float);       \
  else if (qdt == at::kBFloat16) SPARQ_RUN(KT, bf16); \
  else SPARQ_RUN(KT, f16);
  if (kdt == at::kFloat) { SPARQ_Q(float) }
  else if (kdt == at::kBFloat16) { SPARQ_Q(bf16) }
  else if (int8) { SPARQ_Q(int8_t) }
  else { SPARQ_Q(f16) }
#undef SPARQ_Q
#undef SPARQ_RUN
  return out;
}

at::Tensor dense_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                     const std::optional<at::Tensor>& lengths, int64_t queries) {
  return dense_impl(q, k, v, length, lengths, queries, std::nullopt, std::nullopt, std::nullopt);
}

at::Tensor dense_quant_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                           const std::optional<at::Tensor>& lengths, int64_t queries, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, const at::Tensor& chan) {
  return dense_impl(q, k, v, length, lengths, queries, k_scale, v_scale, chan);
}

// How this build reads an int8 cache at d = 64, 128, 256: "vnni" (q and the softmax weights
// quantized, integer dot products) or "float" (rows widened to fp32); other d always "float".
std::string dense_int8_path() { return int8_vnni(64) ? "vnni" : "float"; }

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("dense_cpu", &sparq_cpu::dense_cpu);
  m.impl("dense_quant_cpu", &sparq_cpu::dense_quant_cpu);
}
TORCH_LIBRARY_IMPL(sparq, CompositeExplicitAutograd, m) {  // no tensor arguments
  m.impl("dense_int8_path", &sparq_cpu::dense_int8_path);
}
