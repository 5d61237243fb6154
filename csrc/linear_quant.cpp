// Decode-step GEMVs over weight-only quantized weights, for the few rows of one decode step:
// linear_int8_cpu / linear_int4_cpu read quantize.py's stored formats as they are; the *_q8 ops read
// them repacked at load in rows of 16 (below XQ) and round x to int8 first.
//
// Registered as the CPU kernels of these ops, whose schemas (and fake implementations, for
// torch.compile) kernels.py defines:
//   linear_int8_cpu(Tensor x, Tensor w, Tensor scales) -> Tensor
//       w (N, K) int8, scales (N,) per output channel or (N, G) per group of K / G inputs:
//       W[n, k] = w[n, k] * scales[n, k / gs]
//   linear_int4_cpu(Tensor x, Tensor w, Tensor scales, Tensor zeros) -> Tensor
//       w (N, K / 2) uint8, two 4-bit values q per byte (low nibble = even column), scales and
//       zeros (N, G): W[n, k] = (q[n, k] - 8) * scales[n, k / gs] + zeros[n, k / gs]
//   linear_int4_q8_cpu(Tensor x, Tensor w, Tensor scales, Tensor zeros, int N) -> Tensor
//       linear_int4_cpu's weights repacked in rows of 16 (below int4_q8_rows16_ref; N rows), x
//       quantized to int8 per group first (below XQ)
//   linear_int8_q8_cpu(Tensor x, Tensor w, Tensor scales, int N) -> Tensor
//       linear_int8_cpu's weights repacked in rows of 16 (below int8_q8_rows16_ref), x quantized to
//       int8 per group of 32 first
//   linear_int4_q8_gemm_cpu(Tensor x, Tensor w, Tensor scales, Tensor zeros, int N) -> Tensor
//   linear_int8_q8_gemm_cpu(Tensor x, Tensor w, Tensor scales, int N) -> Tensor
//       the two above for any number of rows (a prefill's), each row theirs bit for bit (below
//       gemm_rows16)
//   linear_q8_path() -> str     "vnni" (vpdpbusd), "avx2" (vpmaddubsw) or "portable": this build's path
//                               for the *_q8 ops
// y = x @ W^T in fp32 (x any float dtype, returned in x's dtype); scales / zeros bf16 or fp32.
//
// Each weight vector is dequantized in registers to exactly the fp32 values quantize.py's
// dequantize_int8 / dequantize_int4 produce (q * s and (q - 8) * s + z are exact in fp32, one
// rounding for + z as there), then multiplied with x in fp32: the result is the fp32 GEMV over the
// dequantized weights, while the stream is 1 byte (int8) or 1/2 byte (int4) per weight. Software
// prefetch a block of rows ahead keeps the stream going while the conversions compute (without it
// the int8 stream ran at half the bandwidth). python -m bench linear --quantized compares these with
// torch's packed aten kernels. The code is written once over simd.h's vectors (AVX-512, AVX2 or
// portable), the readable reference; int4 has a second path for CPUs with AVX512_BF16 (below
// int4_block), chosen at build time like linear.cpp's, about 3x faster (docs/NOTES.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd.h"

#ifndef SPARQ_QPF
#define SPARQ_QPF 4
#endif

// The *_q8 ops' integer dot products: vpdpbusd (AVX512_VNNI), else vpmaddubsw where the build has AVX2
// (an AVX-512 CPU without VNNI too), else the readable per-row path.
#if !defined(SPARQ_AVX512_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPARQ_Q8_AVX2 1
#endif

namespace sparq_cpu {
namespace {

template <class ST>
static inline float scale_at(const ST* s, int64_t i) { return to_f(s[i]); }

// Software prefetch distance in weight rows: about 6 KB ahead of the stream (SPARQ_QPF to 16 rows),
// so that short quantized rows (288 bytes for an int4 row of 576) keep enough in flight.
static inline int64_t prefetch_rows(int64_t ws) {
  return std::clamp<int64_t>(6144 / std::max<int64_t>(ws, 1), SPARQ_QPF, 16);
}

// ---------------------------------------------------------------------------------------------
// int8: MB rows of x (fp32, K apart) against RB rows of w (ws bytes apart), W = q * s. Per output
// channel the scale multiplies the finished dot product; per group, each group's partial dot
// product (t) is scaled into the accumulator: one FMA per group instead of a multiply per weight.
// The scales of 16 groups are loaded (widened) as one vector per row and broadcast lane by lane.
// ---------------------------------------------------------------------------------------------

template <int MB, int RB, class ST>
static inline void int8_block(const float* x, int64_t K, const int8_t* w, int64_t ws, const ST* s, int64_t ss,
                              int64_t G, float* y, int64_t N) {
  const int64_t pf = prefetch_rows(ws);
  V acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = vzero();
  if (G == 1) {  // per output channel
    const int64_t kfull = K / 16 * 16;
    for (int64_t k = 0; k < kfull; k += 16) {
      if (k % 64 == 0)
        for (int r = 0; r < RB; ++r) prefetch_l2(w + (r + pf) * ws + k);
      V wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = load_i8(w + r * ws + k);
      for (int m = 0; m < MB; ++m) {
        const V xv = load(x + m * K + k);
        for (int r = 0; r < RB; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);
      }
    }
    if (kfull < K) {
      const M mask = tail_mask(K - kfull);
      for (int r = 0; r < RB; ++r) {
        const V wv = load_i8(w + r * ws + kfull, mask);
        for (int m = 0; m < MB; ++m) acc[m][r] = vfma(wv, load(x + m * K + kfull, mask), acc[m][r]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < RB; ++r) y[m * N + r] = hsum(acc[m][r]) * scale_at(s, r * ss);
    return;
  }
  const int64_t gs = K / G;  // a multiple of 16
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const M gm = tail_mask(G - g0);
    V sv[RB];
    for (int r = 0; r < RB; ++r) sv[r] = load(s + r * ss + g0, gm);
    for (int64_t g = g0; g < std::min(G, g0 + 16); ++g) {
      V t[MB][RB];
      for (int m = 0; m < MB; ++m)
        for (int r = 0; r < RB; ++r) t[m][r] = vzero();
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
        if (k % 64 == 0)  // the next rows' cache lines, a block ahead of the stream
          for (int r = 0; r < RB; ++r) prefetch_l2(w + (r + pf) * ws + k);
        V wv[RB];
        for (int r = 0; r < RB; ++r) wv[r] = load_i8(w + r * ws + k);
        for (int m = 0; m < MB; ++m) {
          const V xv = load(x + m * K + k);
          for (int r = 0; r < RB; ++r) t[m][r] = vfma(wv[r], xv, t[m][r]);
        }
      }
      for (int r = 0; r < RB; ++r) {
        const V sg = vlane(sv[r], (int)(g - g0));
        for (int m = 0; m < MB; ++m) acc[m][r] = vfma(sg, t[m][r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) y[m * N + r] = hsum(acc[m][r]);
}

// ---------------------------------------------------------------------------------------------
// int4: W = (q - 8) s + z, so x . W = sum_g s_g (x_g . (q_g - 8)) + sum_g z_g X_g with X_g the sum
// of x over group g. x is split into its even and odd columns (xe, xo: (M, K / 2) each): the low
// nibbles of 16 bytes (16 even columns) meet 16 consecutive xe, the high nibbles 16 xo. Groups span
// gs / 2 bytes (gs a multiple of 32: whole 16-byte steps); X: (M, G).
// ---------------------------------------------------------------------------------------------

template <int MB, int RB, class ST>
static inline void int4_block(const float* xe, const float* xo, int64_t K2, const float* X, int64_t G,
                              const uint8_t* w, int64_t ws, const ST* s, const ST* z, int64_t ss, float* y, int64_t N) {
  const int64_t pf = prefetch_rows(ws);
  const int64_t gs2 = K2 / G;  // bytes per group
  V acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = vzero();
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const M gm = tail_mask(G - g0);
    V sv[RB];
    for (int r = 0; r < RB; ++r) {
      sv[r] = load(s + r * ss + g0, gm);
      for (int m = 0; m < MB; ++m)  // the zero points' term, 16 groups at a time
        acc[m][r] = vfma(load(z + r * ss + g0, gm), load(X + m * G + g0, gm), acc[m][r]);
    }
    for (int64_t g = g0; g < std::min(G, g0 + 16); ++g) {
      for (int r = 0; r < RB; ++r) {
        const V sg = vlane(sv[r], (int)(g - g0));
        if (MB == 1) {  // one row of x: scale the group's partial dot product (fewest operations)
          V t = vzero();
          for (int64_t b = g * gs2; b < (g + 1) * gs2; b += 16) {
            if (b % 64 == 0) prefetch_l2(w + (r + pf) * ws + b);
            V lo, hi;
            load_nibbles_minus8(w + r * ws + b, &lo, &hi);
            t = vfma(hi, load(xo + b), vfma(lo, load(xe + b), t));
          }
          acc[0][r] = vfma(sg, t, acc[0][r]);
        } else {  // several: scale the weights once, (q - 8) s, shared by every row of x
          for (int64_t b = g * gs2; b < (g + 1) * gs2; b += 16) {
            if (b % 64 == 0) prefetch_l2(w + (r + pf) * ws + b);
            V lo, hi;
            load_nibbles_minus8(w + r * ws + b, &lo, &hi);
            lo = vmul(lo, sg);
            hi = vmul(hi, sg);
            for (int m = 0; m < MB; ++m) acc[m][r] = vfma(hi, load(xo + m * K2 + b), vfma(lo, load(xe + m * K2 + b), acc[m][r]));
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) y[m * N + r] = hsum(acc[m][r]);
}

#ifdef SPARQ_AVX512_BF16
// ---------------------------------------------------------------------------------------------
// int4 on AVX512_BF16 (the build's choice where the CPU has it): 32 bytes, 64 weights, per step.
// The bytes widen to 16-bit lanes and a 16-entry table (vpermw) turns each nibble into bf16(q - 8),
// which is exact; vdpbf16ps then multiplies 32 of them with bf16 planes of x's even and odd columns
// (NT planes: x itself when it is bf16, hi + lo of fp32 / fp16 x as in linear.cpp), 32 products per
// instruction where the widening path above spends two conversions and an FMA per 16 weights.
// Lanes 0-7 of a step's dot products hold its first 16 bytes, lanes 8-15 its second 16; each half
// lies in one group (a group is a multiple of 16 bytes), whose scale one vpermps picks from the 16
// group scales loaded per window. The zero points' term is the widening path's.
// ---------------------------------------------------------------------------------------------

static const std::array<uint16_t, 32> kNibbleBf16 = [] {  // bf16 bits of (i mod 16) - 8
  std::array<uint16_t, 32> t{};
  for (int i = 0; i < 32; ++i) {
    const float v = (float)((i & 15) - 8);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    t[i] = (uint16_t)(u >> 16);  // small integers: the upper half of the fp32 bits, exactly
  }
  return t;
}();

// x (fp32 rows, K apart) -> bf16 planes (nt, even / odd, M, K2p), zero-padded to K2p columns
struct X4Planes {
  int64_t K2p = 0;
  int nt = 1;
  std::vector<bf16> p;
  const bf16* at(int t, int odd, int64_t rows, int64_t m) const { return p.data() + ((t * 2 + odd) * rows + m) * K2p; }
};

static X4Planes x4_planes(const float* xf, int64_t M, int64_t K, bool x_is_bf16) {
  X4Planes r;
  const int64_t K2 = K / 2;
  r.K2p = round_up(std::max<int64_t>(K2, 1), 32);
  r.nt = x_is_bf16 ? 1 : 2;
  r.p.assign(r.nt * 2 * M * r.K2p, bf16(0.f));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float v = xf[m * K + k];
      const bf16 hi(v);
      bf16* dst = r.p.data() + ((k % 2) * M + m) * r.K2p + k / 2;
      dst[0] = hi;
      if (r.nt == 2) dst[2 * M * r.K2p] = bf16(v - static_cast<float>(hi));
    }
  return r;
}

template <int MB, int RB, int NT, class ST>
static inline void int4_block_bf16(const X4Planes& xp, int64_t rows, int64_t m0, int64_t K2, const float* X, int64_t G,
                                   const int32_t* chunk_group, const uint8_t* w, int64_t ws, const ST* s, const ST* z,
                                   int64_t ss, float* y, int64_t N) {
  const int64_t pf = prefetch_rows(ws);
  const int64_t gs2 = K2 / G;  // bytes per group, a multiple of 16
  const __m512i table = _mm512_loadu_si512(kNibbleBf16.data());
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += 16) {  // the zero points' term, 16 groups at a time
    const M gm = tail_mask(G - g0);
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MB; ++m)
        acc[m][r] = vfma(load(z + r * ss + g0, gm), load(X + (m0 + m) * G + g0, gm), V{acc[m][r]}).x;
  }
  const int64_t window = 16 * gs2;  // the bytes of 16 groups, a multiple of 32
  for (int64_t b0 = 0; b0 < K2; b0 += window) {
    const int64_t g0 = b0 / gs2, b1 = std::min(K2, b0 + window);
    const M gm = tail_mask(G - g0);
    __m512 sv[RB];
    for (int r = 0; r < RB; ++r) sv[r] = load(s + r * ss + g0, gm).x;
    for (int64_t b = b0; b < b1; b += 32) {
      const int64_t c = (b - b0) / 16;  // lanes 0-7: the window's group of 16-byte chunk c, lanes 8-15: of chunk c + 1
      const __m512i idx = _mm512_mask_set1_epi32(_mm512_set1_epi32(chunk_group[c]), (__mmask16)0xFF00, chunk_group[c + 1]);
      const __mmask32 bm = b1 - b >= 32 ? 0xFFFFFFFFu : (1u << (b1 - b)) - 1u;  // a last half step: 16 bytes
      for (int r = 0; r < RB; ++r) {
        if (b % 64 == 0) prefetch_l2(w + (r + pf) * ws + b);
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bm, w + r * ws + b));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low4), table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        const __m512 sc = _mm512_permutexvar_ps(idx, sv[r]);
        for (int m = 0; m < MB; ++m) {
          __m512 t = _mm512_setzero_ps();
          for (int tt = 0; tt < NT; ++tt) {  // x's padding columns are zero: a masked-off byte adds nothing
            t = _mm512_dpbf16_ps(t, lo, (__m512bh)_mm512_loadu_si512(xp.at(tt, 0, rows, m0 + m) + b));
            t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(xp.at(tt, 1, rows, m0 + m) + b));
          }
          acc[m][r] = _mm512_fmadd_ps(t, sc, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) y[m * N + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

// ---------------------------------------------------------------------------------------------
// Integer paths (linear_int4_q8_cpu, linear_int8_q8_cpu): x quantized to int8 per group, as
// llama.cpp's Q8_0 does for its Q4 / Q8 dot products: a_g = max|x_g| / 127, xq = round(x / a_g).
// With u the stored unsigned weight codes and u - offset the signed value (int4: nibbles, offset 8;
// int8: q + 128, offset 128),
//   x_g . (u_g - offset) ~ a_g (xq_g . u_g) - offset a_g sum(xq_g)
// where the integer dot product (vpdpbusd: unsigned weights, signed x) is exact, so the only
// approximation is xq's rounding. XQ holds x's side once per call: int8 planes (int4: the even and
// odd columns, which meet the low and high nibbles; int8: the columns in order), zero-padded to
// whole 64-byte steps, and per group a, offset a sum(xq) and X = sum(x) (int4's zero points' term
// runs on x itself, exactly).
// ---------------------------------------------------------------------------------------------

struct XQ {
  int64_t M = 0, G = 0, Kp = 0;  // rows of x, groups, padded plane width
  std::vector<int8_t> q;         // (planes, M, Kp)
  std::vector<float> a, off, X;  // (M, G): scale, offset * a * sum(xq), sum of x
  const int8_t* plane(int p, int64_t m) const { return q.data() + (p * M + m) * Kp; }
};

#if defined(SPARQ_AVX512) || defined(SPARQ_Q8_AVX2)
// 16 quantized values of x (bytes, in column order, from column i of the group) into quantize_group's dst
template <int PLANES>
static inline void store_q16(__m128i bytes, int8_t* dst, int64_t i, int64_t plane_stride) {
  if (PLANES == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bytes);
  } else {  // bytes 0, 2, .., 14 then 1, 3, .., 15: the 16 columns' even then odd values
    const __m128i eo = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 2), eo);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 2 + plane_stride), _mm_unpackhi_epi64(eo, eo));
  }
}
#endif

// One group of x (gs values) -> xq into dst (planes 1: dst[i]; planes 2: even columns to dst[i / 2],
// odd ones to dst[i / 2 + plane_stride]); returns sum(xq), sets *amax and *sum. Rounding to nearest
// even, as std::nearbyint in the default rounding mode (and as the AVX-512 conversion below).
template <int PLANES>
static inline int32_t quantize_group(const float* x, int64_t gs, int8_t* dst, int64_t plane_stride, float* amax_out,
                                     float* sum_out) {
#ifdef SPARQ_AVX512
  if (gs % 16 == 0) {
    V mx = vzero(), sm = vzero();
    for (int64_t i = 0; i < gs; i += 16) {
      const V v = load(x + i);
      mx = vmax(mx, vabs(v));
      sm = vadd(sm, v);
    }
    const float amax = hmax(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t i = 0; i < gs; i += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));  // |q| <= 127
      qsum = _mm512_add_epi32(qsum, q);
      const __m128i bytes = _mm512_cvtepi32_epi8(q);
      store_q16<PLANES>(bytes, dst, i, plane_stride);
    }
    *amax_out = amax;
    *sum_out = hsum(sm);
    return _mm512_reduce_add_epi32(qsum);
  }
#elif defined(SPARQ_Q8_AVX2)
  if (gs % 16 == 0) {  // the same, 8 lanes at a time
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
    for (int64_t i = 0; i < gs; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
      sm = _mm256_add_ps(sm, v);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qsum = _mm256_setzero_si256();
    for (int64_t i = 0; i < gs; i += 16) {
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));  // |q| <= 127
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
      qsum = _mm256_add_epi32(qsum, _mm256_add_epi32(q0, q1));
      const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
      const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));
      const __m128i bytes = _mm_packs_epi16(w0, w1);  // the 16 values in order
      store_q16<PLANES>(bytes, dst, i, plane_stride);
    }
    __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1));
    *amax_out = amax;
    *sum_out = hsum8(sm);
    return _mm_cvtsi128_si32(q4);
  }
#endif
  float amax = 0.f, sum = 0.f;
  for (int64_t i = 0; i < gs; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    sum += x[i];
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t qsum = 0;
  for (int64_t i = 0; i < gs; ++i) {
    const int8_t v = (int8_t)std::nearbyint(x[i] * inv);
    if (PLANES == 1) dst[i] = v;
    else dst[i / 2 + (i % 2) * plane_stride] = v;
    qsum += v;
  }
  *amax_out = amax;
  *sum_out = sum;
  return qsum;
}

// XQ for M rows of K columns in G groups, zero-filled: planes 2: even / odd columns (int4; K / G even);
// 1: columns in order (int8).
static XQ xq_alloc(int64_t M, int64_t K, int64_t G, int planes) {
  XQ r;
  r.M = M, r.G = G, r.Kp = round_up(std::max<int64_t>(K / planes, 1), 64);
  r.q.assign(planes * M * r.Kp, 0);
  r.a.assign(M * G, 0.f);
  r.off.assign(M * G, 0.f);
  r.X.assign(M * G, 0.f);
  return r;
}

// Row m of x (xm: its K values in fp32) into r, group by group: xq, a, offset a sum(xq) and X. Rows
// are independent, so the prefill GEMMs quantize theirs on every thread, to the same bytes.
static void quantize_x_row(XQ& r, int64_t m, const float* xm, int64_t K, int planes, float offset) {
  const int64_t G = r.G, gs = K / G;
  for (int64_t g = 0; g < G; ++g) {
    int8_t* dst = r.q.data() + m * r.Kp + g * gs / planes;
    float amax, sum;
    const int32_t qsum = planes == 1 ? quantize_group<1>(xm + g * gs, gs, dst, 0, &amax, &sum)
                                     : quantize_group<2>(xm + g * gs, gs, dst, r.M * r.Kp, &amax, &sum);
    const float a = amax / 127.f;
    r.a[m * G + g] = a;
    r.off[m * G + g] = offset * a * (float)qsum;
    r.X[m * G + g] = sum;
  }
}

// The GEMVs' x (M rows, fp32, K apart), on the calling thread.
static XQ quantize_x_int8(const float* xf, int64_t M, int64_t K, int64_t G, int planes, float offset) {
  XQ r = xq_alloc(M, K, G, planes);
  for (int64_t m = 0; m < M; ++m) quantize_x_row(r, m, xf + m * K, K, planes, offset);
  return r;
}

// The weights in rows of 16 ("rows16", quantize.pack_int4_rows16, made at load): the N rows in
// blocks of 16 (the last padded with zero rows), each block's bytes in chunks of 4 along K / 2,
//   w16[b, c, r, j] = w[16 b + r, 4 c + j]      (NB, C = K / 8, 16, 4) uint8
//   s16[b, g, r] = scales[16 b + r, g]          (NB, G, 16), zeros alike
// so one 64-byte load holds 8 columns of 16 rows, one int32 lane per row: vpdpbusd against 4 bytes
// of x broadcast adds 4 products to every row's lane at once, and the per-group formula runs on 16
// rows per vector. No horizontal sums, no per-row scale shuffles, and a block's bytes are one
// sequential stream (llama.cpp repacks Q4_0 at load for the same reasons).

// The readable path (every CPU): per row and group, the integer dot product, then the formula.
// y[(m - m0) * ldy + r] for rows [m0, m0 + mb) of x and the 16 rows of block w16 (its s16 / z16).
template <class ST>
static void int4_q8_rows16_ref(const XQ& xq, int64_t m0, int64_t mb, int64_t C, const uint8_t* w16, const ST* s16,
                               const ST* z16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G;  // chunks of 4 bytes per group
  for (int64_t m = m0; m < m0 + mb; ++m) {
    const int8_t* xe = xq.plane(0, m);
    const int8_t* xo = xq.plane(1, m);
    for (int r = 0; r < 16; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = w16[(c * 16 + r) * 4 + j];
            dot += (byte & 15) * xe[4 * c + j] + (byte >> 4) * xo[4 * c + j];
          }
        const float sg = to_f(s16[g * 16 + r]);
        acc += sg * xq.a[m * G + g] * (float)dot - sg * xq.off[m * G + g] + to_f(z16[g * 16 + r]) * xq.X[m * G + g];
      }
      y[(m - m0) * ldy + r] = acc;
    }
  }
}

#ifdef SPARQ_AVX512_VNNI
// The vpdpbusd path (the build's choice where the CPU has AVX512_VNNI): MB rows of x (from m0)
// against NBK blocks of 16 weight rows (C * 64 bytes apart), all 16 rows of each written to
// y[m * ldy + 16 b + r]. Per group and block: even and odd int32 sums (two dependency chains of cpg
// vpdpbusd), then s (a dot - 8 a sum xq) + z X on 16 rows at once.
template <int MB, int NBK, class ST>
static inline void int4_q8_rows16_vnni(const XQ& xq, int64_t m0, int64_t C, const uint8_t* w16, const ST* s16,
                                       const ST* z16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G, bs = C * 64, pf = NBK * bs;  // prefetch: the next blocks, same offset
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB][NBK];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i te[MB][NBK], to[MB][NBK];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NBK; ++b) te[m][b] = to[m][b] = _mm512_setzero_si512();
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      __m512i xe[MB], xo[MB];
      for (int m = 0; m < MB; ++m) {
        int32_t e, o;
        std::memcpy(&e, xq.plane(0, m0 + m) + 4 * c, 4);
        std::memcpy(&o, xq.plane(1, m0 + m) + 4 * c, 4);
        xe[m] = _mm512_set1_epi32(e);
        xo[m] = _mm512_set1_epi32(o);
      }
      for (int b = 0; b < NBK; ++b) {
        const uint8_t* p = w16 + b * bs + c * 64;
        prefetch_l2(p + pf);
        const __m512i bytes = _mm512_loadu_si512(p);
        const __m512i lo = _mm512_and_si512(bytes, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        for (int m = 0; m < MB; ++m) {
          te[m][b] = _mm512_dpbusd_epi32(te[m][b], lo, xe[m]);
          to[m][b] = _mm512_dpbusd_epi32(to[m][b], hi, xo[m]);
        }
      }
    }
    for (int b = 0; b < NBK; ++b) {
      const __m512 sv = load(s16 + (b * G + g) * 16).x, zv = load(z16 + (b * G + g) * 16).x;
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(te[m][b], to[m][b]));
        const __m512 u = _mm512_fmsub_ps(dot, _mm512_set1_ps(xq.a[mg]), _mm512_set1_ps(xq.off[mg]));
        acc[m][b] = _mm512_fmadd_ps(sv, u, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xq.X[mg]), acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) _mm512_storeu_ps(y + m * ldy + 16 * b, acc[m][b]);
}

#endif

#ifdef SPARQ_Q8_AVX2
// 8 scales (bf16 or fp32) as fp32
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// The same on AVX2 (CPUs without AVX512_VNNI), one block of 16 rows per call: its 64-byte chunk is two
// 32-byte halves (rows 0-7, rows 8-15). vpdpbusd has no AVX2 form; vpmaddubsw multiplies unsigned
// nibbles (<= 15) with x's signed int8 (|xq| <= 127) into 16-bit pair sums (<= 3810: no saturation),
// the even and odd columns' pair sums add in 16 bits (<= 7620), and vpmaddwd with ones sums them into
// int32 lanes: the exact integer dot products of the vpdpbusd path, then its formula, in the same order.
template <int MB, class ST>
static inline void int4_q8_rows16_avx2(const XQ& xq, int64_t m0, int64_t C, const uint8_t* w16, const ST* s16,
                                       const ST* z16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i t[MB][2];
    for (int m = 0; m < MB; ++m) t[m][0] = t[m][1] = _mm256_setzero_si256();
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const uint8_t* p = w16 + c * 64;
      prefetch_l2(p + C * 64);  // the next block, same offset
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int m = 0; m < MB; ++m) {
          int32_t e, o;
          std::memcpy(&e, xq.plane(0, m0 + m) + 4 * c, 4);
          std::memcpy(&o, xq.plane(1, m0 + m) + 4 * c, 4);
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(e)),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(o)));
          t[m][h] = _mm256_add_epi32(t[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = load8(s16 + g * 16 + 8 * h), zv = load8(z16 + g * 16 + 8 * h);
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        const __m256 u = _mm256_fmsub_ps(_mm256_cvtepi32_ps(t[m][h]), _mm256_set1_ps(xq.a[mg]), _mm256_set1_ps(xq.off[mg]));
        acc[m][h] = _mm256_fmadd_ps(sv, u, acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(xq.X[mg]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + m * ldy + 8 * h, acc[m][h]);
}
#endif

// int8 in rows of 16 (quantize.pack_int8_rows16, made at load), the same layout over K instead of
// K / 2 with each code stored unsigned:
//   w16[b, c, r, j] = q[16 b + r, 4 c + j] + 128   (NB, C = K / 4, 16, 4) uint8
//   s16[b, g, r] = scales[16 b + r, g]             (NB, Gw, 16); Gw = 1: per output channel
// x's groups are 32 columns (llama.cpp's Q8_0 block; 8 chunks), Gw's a multiple of them:
//   x . W = sum_gw s_gw (sum_{g in gw} a_g (xq_g . u_g) - 128 a_g sum(xq_g))
// The readable path (every CPU): y[(m - m0) * ldy + r] for rows [m0, m0 + mb) of x and the 16 rows of
// block w16.
template <class ST>
static void int8_q8_rows16_ref(const XQ& xq, int64_t m0, int64_t mb, int64_t C, int64_t Gw, const uint8_t* w16,
                               const ST* s16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G, gpw = G / Gw;  // chunks per x group, x groups per weight group
  for (int64_t m = m0; m < m0 + mb; ++m) {
    const int8_t* xm = xq.plane(0, m);
    for (int r = 0; r < 16; ++r) {
      float acc = 0.f;
      for (int64_t gw = 0; gw < Gw; ++gw) {
        float t = 0.f;
        for (int64_t g = gw * gpw; g < (gw + 1) * gpw; ++g) {
          int32_t dot = 0;
          for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
            for (int j = 0; j < 4; ++j) dot += w16[(c * 16 + r) * 4 + j] * xm[4 * c + j];
          t += xq.a[m * G + g] * (float)dot - xq.off[m * G + g];
        }
        acc += to_f(s16[gw * 16 + r]) * t;
      }
      y[(m - m0) * ldy + r] = acc;
    }
  }
}

#ifdef SPARQ_AVX512_VNNI
// MB rows of x (from m0) against NBK blocks of 16 rows (C * 64 bytes apart), all 16 rows of each to
// y[m * ldy + 16 b + r]. Per x group and block: two int32 chains (alternate chunks) of 4 vpdpbusd
// each, then a dot - 128 a sum xq into the weight group's sum, scaled once per weight group.
template <int MB, int NBK, class ST>
static inline void int8_q8_rows16_vnni(const XQ& xq, int64_t m0, int64_t C, int64_t Gw, const uint8_t* w16,
                                       const ST* s16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G, gpw = G / Gw, bs = C * 64, pf = NBK * bs;  // cpg = 8
  __m512 acc[MB][NBK];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t gw = 0; gw < Gw; ++gw) {
    __m512 t[MB][NBK];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NBK; ++b) t[m][b] = _mm512_setzero_ps();
    for (int64_t g = gw * gpw; g < (gw + 1) * gpw; ++g) {
      __m512i d0[MB][NBK], d1[MB][NBK];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NBK; ++b) d0[m][b] = d1[m][b] = _mm512_setzero_si512();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; c += 2) {
        __m512i x0[MB], x1[MB];
        for (int m = 0; m < MB; ++m) {
          int32_t v0, v1;
          std::memcpy(&v0, xq.plane(0, m0 + m) + 4 * c, 4);
          std::memcpy(&v1, xq.plane(0, m0 + m) + 4 * c + 4, 4);
          x0[m] = _mm512_set1_epi32(v0);
          x1[m] = _mm512_set1_epi32(v1);
        }
        for (int b = 0; b < NBK; ++b) {
          const uint8_t* p = w16 + b * bs + c * 64;
          prefetch_l2(p + pf);
          prefetch_l2(p + pf + 64);
          const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64);
          for (int m = 0; m < MB; ++m) {
            d0[m][b] = _mm512_dpbusd_epi32(d0[m][b], w0, x0[m]);
            d1[m][b] = _mm512_dpbusd_epi32(d1[m][b], w1, x1[m]);
          }
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        for (int b = 0; b < NBK; ++b) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0[m][b], d1[m][b]));
          t[m][b] = _mm512_add_ps(t[m][b], _mm512_fmsub_ps(dot, _mm512_set1_ps(xq.a[mg]), _mm512_set1_ps(xq.off[mg])));
        }
      }
    }
    for (int b = 0; b < NBK; ++b) {
      const __m512 sv = load(s16 + (b * Gw + gw) * 16).x;
      for (int m = 0; m < MB; ++m) acc[m][b] = _mm512_fmadd_ps(sv, t[m][b], acc[m][b]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) _mm512_storeu_ps(y + m * ldy + 16 * b, acc[m][b]);
}
#endif

#ifdef SPARQ_Q8_AVX2
// int8 on AVX2, one block of 16 rows per call (halves as int4's). The unsigned codes u = q + 128 times
// xq would overflow vpmaddubsw's 16-bit pair sums, so the signed codes q = u ^ 0x80 meet x as
// |q| (unsigned, <= 128) times xq with q's sign (|pair sum| <= 2 * 128 * 127 < 2^15), llama.cpp's
// way: the exact x_g . q_g = x_g . u_g - 128 sum(xq_g), so a_g x_g . q_g is the formula's term.
template <int MB, class ST>
static inline void int8_q8_rows16_avx2(const XQ& xq, int64_t m0, int64_t C, int64_t Gw, const uint8_t* w16,
                                       const ST* s16, float* y, int64_t ldy) {
  const int64_t G = xq.G, cpg = C / G, gpw = G / Gw;  // cpg = 8
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t gw = 0; gw < Gw; ++gw) {
    __m256 t[MB][2];
    for (int m = 0; m < MB; ++m) t[m][0] = t[m][1] = _mm256_setzero_ps();
    for (int64_t g = gw * gpw; g < (gw + 1) * gpw; ++g) {
      __m256i d[MB][2];
      for (int m = 0; m < MB; ++m) d[m][0] = d[m][1] = _mm256_setzero_si256();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
        const uint8_t* p = w16 + c * 64;
        prefetch_l2(p + C * 64);
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)), flip);
          const __m256i aq = _mm256_abs_epi8(q);
          for (int m = 0; m < MB; ++m) {
            int32_t v;
            std::memcpy(&v, xq.plane(0, m0 + m) + 4 * c, 4);
            const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(v), q);
            d[m][h] = _mm256_add_epi32(d[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones));
          }
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 a = _mm256_set1_ps(xq.a[(m0 + m) * G + g]);
        for (int h = 0; h < 2; ++h) t[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[m][h]), a, t[m][h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = load8(s16 + gw * 16 + 8 * h);
      for (int m = 0; m < MB; ++m) acc[m][h] = _mm256_fmadd_ps(sv, t[m][h], acc[m][h]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + m * ldy + 8 * h, acc[m][h]);
}
#endif

// kernel(mb, m) over the M rows of x, up to 4 at a time (mb: an integral_constant, the block's rows).
template <class Kernel>
static inline void over_x_rows(int64_t M, Kernel&& kernel) {
  for (int64_t m = 0; m < M; m += 4) {
    switch (std::min<int64_t>(4, M - m)) {
      case 1: kernel(std::integral_constant<int, 1>{}, m); break;
      case 2: kernel(std::integral_constant<int, 2>{}, m); break;
      case 3: kernel(std::integral_constant<int, 3>{}, m); break;
      default: kernel(std::integral_constant<int, 4>{}, m); break;
    }
  }
}

// Blocks of up to 4 rows of x over rows [n0, n1) of w, 4 weight rows at a time (4 sequential
// streams for the hardware prefetcher); block(mb, rb, m, n) calls the <MB, RB> kernel.
template <class Block>
static inline void over_blocks(int64_t M, int64_t n0, int64_t n1, Block&& block) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) over_x_rows(M, [&](auto mb, int64_t m) { block(mb, std::integral_constant<int, 4>{}, m, n); });
  for (; n < n1; ++n) over_x_rows(M, [&](auto mb, int64_t m) { block(mb, std::integral_constant<int, 1>{}, m, n); });
}

// The rows16 GEMVs' walk over y (M, N): each thread's units of whole blocks of 16 weight rows, two
// blocks per call where two remain (more independent dependency chains), else one:
// blocks(b, nbk, out, ldo) writes all 16 nbk rows of blocks b.. to out[m * ldo + r]. A last block of
// fewer than 16 live rows goes through a small buffer, so that nothing is written past row N.
template <class Blocks>
static void over_row_blocks(at::Tensor& y, Blocks&& blocks) {
  const int64_t M = y.size(0);
  over_weight_rows_into(y, [&](int64_t n0, int64_t n1, float* out, int64_t ldo) {
    for (int64_t n = n0; n < n1; n += 16) {
      if (n + 32 <= n1) {
        blocks(n / 16, std::integral_constant<int, 2>{}, out + (n - n0), ldo);
        n += 16;
      } else if (n + 16 <= n1) {
        blocks(n / 16, std::integral_constant<int, 1>{}, out + (n - n0), ldo);
      } else {
        std::vector<float> part(M * 16);
        blocks(n / 16, std::integral_constant<int, 1>{}, part.data(), 16);
        for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * ldo + (n - n0), part.data() + m * 16, (n1 - n) * sizeof(float));
      }
    }
  }, 16);
}

template <class XT>
static void x_to_f32(const at::Tensor& x, float* out) {
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0);
  const XT* p = x.data_ptr<XT>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = static_cast<float>(p[m * xs + k]);
}

static std::vector<float> x_f32(const at::Tensor& x) {
  std::vector<float> f(std::max<int64_t>(x.numel(), 1));
  switch (x.scalar_type()) {
    case at::kFloat: x_to_f32<float>(x, f.data()); break;
    case at::kBFloat16: x_to_f32<bf16>(x, f.data()); break;
    default: x_to_f32<f16>(x, f.data()); break;
  }
  return f;
}

// decode: the GEMVs' x, at most 16 rows; else a GEMM's, any number.
static void check_x(const at::Tensor& x, const char* op, bool decode = true) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.stride(1) == 1, op, ": x must be a CPU (M, K) tensor contiguous along K");
  TORCH_CHECK(!decode || x.size(0) <= 16, op, ": at most 16 rows (decode)");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op, ": unsupported x dtype");
}

static int64_t check_scales(const at::Tensor& s, int64_t N, const char* op) {
  TORCH_CHECK(s.device().is_cpu() && s.size(0) == N && (s.dim() == 1 || (s.dim() == 2 && s.stride(1) == 1)) &&
                  (s.scalar_type() == at::kBFloat16 || s.scalar_type() == at::kFloat),
              op, ": scales / zeros must be CPU bf16 or fp32, (N,) or (N, G) contiguous along G");
  return s.dim() == 1 ? 1 : s.size(1);
}

// The int4 GEMVs' arguments (x checked too): w (N, K / 2) nibbles, scales and zeros (N, G) alike,
// groups of whole 32-column steps -> G.
static int64_t check_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                          const char* op) {
  check_x(x, op);
  const int64_t K = x.size(1), N = w.size(0), K2 = K / 2;
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.scalar_type() == at::kByte && w.stride(1) == 1 &&
                  K % 2 == 0 && w.size(1) == K2, op, ": w must be uint8 (N, K / 2) contiguous, K = x's");
  const int64_t G = check_scales(scales, N, op);
  TORCH_CHECK(scales.dim() == 2 && zeros.sizes() == scales.sizes() && zeros.strides() == scales.strides() &&
                  zeros.scalar_type() == scales.scalar_type() && zeros.device().is_cpu(),
              op, ": scales and zeros must be (N, G) alike");
  TORCH_CHECK(K % G == 0 && (K / G) % 32 == 0, op, ": groups must split K into multiples of 32");
  return G;
}

at::Tensor linear_int8_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const char* op = "sparq::linear_int8_cpu";
  check_x(x, op);
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.scalar_type() == at::kChar && w.stride(1) == 1 &&
                  w.size(1) == x.size(1), op, ": w must be int8 (N, K) contiguous along K, K = x's");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t G = check_scales(scales, N, op);
  TORCH_CHECK(K % G == 0 && (G == 1 || (K / G) % 16 == 0), op, ": groups must split K into multiples of 16");
  const int64_t ss = scales.dim() == 1 ? 1 : scales.stride(0), ws = w.stride(0);
  const std::vector<float> xf = x_f32(x);
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype, written by over_weight_rows_into
  const int8_t* wp = w.data_ptr<int8_t>();
  auto run = [&](auto* s) {
    over_weight_rows_into(y, [&](int64_t n0, int64_t n1, float* out, int64_t ldo) {
      over_blocks(M, n0, n1, [&](auto mb, auto rb, int64_t m, int64_t n) {
        int8_block<decltype(mb)::value, decltype(rb)::value>(xf.data() + m * K, K, wp + n * ws, ws, s + n * ss, ss, G,
                                                            out + m * ldo + (n - n0), ldo);
      });
    });
  };
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>());
  else run(scales.data_ptr<float>());
  return y;
}

at::Tensor linear_int4_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros) {
  const int64_t G = check_int4(x, w, scales, zeros, "sparq::linear_int4_cpu");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), K2 = K / 2;
  const int64_t ss = scales.stride(0), ws = w.stride(0);
  const std::vector<float> xf = x_f32(x);
#ifdef SPARQ_AVX512_BF16
  const int64_t half = 0;  // that path reads x as bf16 planes (x4_planes)
#else
  const int64_t half = M * K2;
#endif
  std::vector<float> xeo(2 * half + M * G);  // even columns, odd ones, group sums
  float* xe = xeo.data();
  float* xo = xe + half;
  float* X = xo + half;
  for (int64_t m = 0; m < M; ++m) {
#ifndef SPARQ_AVX512_BF16
    for (int64_t j = 0; j < K2; ++j) {
      xe[m * K2 + j] = xf[m * K + 2 * j];
      xo[m * K2 + j] = xf[m * K + 2 * j + 1];
    }
#endif
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * (K / G); k < (g + 1) * (K / G); ++k) sum += xf[m * K + k];
      X[m * G + g] = sum;
    }
  }
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype, written by over_weight_rows_into
  const uint8_t* wp = w.data_ptr<uint8_t>();
#ifdef SPARQ_AVX512_BF16
  const X4Planes xp = x4_planes(xf.data(), M, K, x.scalar_type() == at::kBFloat16);
  std::vector<int32_t> chunk_group(std::min(16 * K2 / G, round_up(K2, 32)) / 16);  // within a window of 16 groups
  for (size_t c = 0; c < chunk_group.size(); ++c) chunk_group[c] = (int32_t)(c * 16 / (K2 / G));
  auto run = [&](auto* s, auto* z) {
    over_weight_rows_into(y, [&](int64_t n0, int64_t n1, float* out, int64_t ldo) {
      over_blocks(M, n0, n1, [&](auto mb, auto rb, int64_t m, int64_t n) {
        constexpr int MB = decltype(mb)::value, RB = decltype(rb)::value;
        if (xp.nt == 1)
          int4_block_bf16<MB, RB, 1>(xp, M, m, K2, X, G, chunk_group.data(), wp + n * ws, ws, s + n * ss, z + n * ss, ss, out + m * ldo + (n - n0), ldo);
        else
          int4_block_bf16<MB, RB, 2>(xp, M, m, K2, X, G, chunk_group.data(), wp + n * ws, ws, s + n * ss, z + n * ss, ss, out + m * ldo + (n - n0), ldo);
      });
    });
  };
#else
  auto run = [&](auto* s, auto* z) {
    over_weight_rows_into(y, [&](int64_t n0, int64_t n1, float* out, int64_t ldo) {
      over_blocks(M, n0, n1, [&](auto mb, auto rb, int64_t m, int64_t n) {
        int4_block<decltype(mb)::value, decltype(rb)::value>(xe + m * K2, xo + m * K2, K2, X + m * G, G, wp + n * ws, ws,
                                                            s + n * ss, z + n * ss, ss, out + m * ldo + (n - n0), ldo);
      });
    });
  };
#endif
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>(), zeros.data_ptr<bf16>());
  else run(scales.data_ptr<float>(), zeros.data_ptr<float>());
  return y;
}

// The rows16 GEMVs' arguments (x checked too, at most 16 rows where decode, the GEMMs' any number): w
// (NB, K / cols, 16, 4) uint8 contiguous, cols columns per 4-byte chunk of a row (int4: 8, int8: 4),
// 16 NB - 16 < N <= 16 NB; scales (NB, G, 16) CPU bf16 or fp32 contiguous, in groups of whole 32
// columns -> G.
static int64_t check_rows16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t N, int64_t cols,
                            const char* pack, const char* op, bool decode = true) {
  check_x(x, op, decode);
  const int64_t K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  K % 32 == 0 && w.size(1) == K / cols && w.size(2) == 16 && w.size(3) == 4,
              op, ": w must be uint8 (NB, K / ", cols, ", 16, 4) contiguous (quantize.", pack,
              "), K = x's, a multiple of 32");
  const int64_t NB = w.size(0);
  TORCH_CHECK(N > 16 * (NB - 1) && N <= 16 * NB, op, ": N = ", N, " is not a weight of ", NB, " blocks of 16 rows");
  TORCH_CHECK(scales.dim() == 3 && scales.device().is_cpu() && scales.is_contiguous() && scales.size(0) == NB &&
                  scales.size(2) == 16 && (scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat),
              op, ": scales must be CPU bf16 or fp32 (NB, G, 16) contiguous");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, op, ": groups must split K into multiples of 32");
  return G;
}

at::Tensor linear_int4_q8_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                              int64_t N) {
  const char* op = "sparq::linear_int4_q8_cpu";
  const int64_t G = check_rows16(x, w, scales, N, 8, "pack_int4_rows16", op);
  TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.is_contiguous() && zeros.scalar_type() == scales.scalar_type() &&
                  zeros.device().is_cpu(), op, ": zeros must be laid out as scales");
  const int64_t M = x.size(0), K = x.size(1), C = K / 8;
  const std::vector<float> xf = x_f32(x);
  const XQ xq = quantize_x_int8(xf.data(), M, K, G, 2, 8.f);
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype, written by over_weight_rows_into
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto* s, auto* z) {
    over_row_blocks(y, [&](int64_t b, auto nbk, float* out, int64_t ldo) {
      const uint8_t* wb = wp + b * C * 64;
      const auto *sb = s + b * G * 16, *zb = z + b * G * 16;
#if defined(SPARQ_AVX512_VNNI)
      over_x_rows(M, [&](auto mb, int64_t m) {
        int4_q8_rows16_vnni<decltype(mb)::value, decltype(nbk)::value>(xq, m, C, wb, sb, zb, out + m * ldo, ldo);
      });
#elif defined(SPARQ_Q8_AVX2)
      for (int i = 0; i < decltype(nbk)::value; ++i)
        over_x_rows(M, [&](auto mb, int64_t m) {
          int4_q8_rows16_avx2<decltype(mb)::value>(xq, m, C, wb + i * C * 64, sb + i * G * 16, zb + i * G * 16,
                                                   out + m * ldo + 16 * i, ldo);
        });
#else
      for (int i = 0; i < decltype(nbk)::value; ++i)
        int4_q8_rows16_ref(xq, 0, M, C, wb + i * C * 64, sb + i * G * 16, zb + i * G * 16, out + 16 * i, ldo);
#endif
    });
  };
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>(), zeros.data_ptr<bf16>());
  else run(scales.data_ptr<float>(), zeros.data_ptr<float>());
  return y;
}

at::Tensor linear_int8_q8_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t N) {
  const int64_t Gw = check_rows16(x, w, scales, N, 4, "pack_int8_rows16", "sparq::linear_int8_q8_cpu");
  const int64_t M = x.size(0), K = x.size(1), C = K / 4;
  const std::vector<float> xf = x_f32(x);
  const XQ xq = quantize_x_int8(xf.data(), M, K, K / 32, 1, 128.f);
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype, written by over_weight_rows_into
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto* s) {
    over_row_blocks(y, [&](int64_t b, auto nbk, float* out, int64_t ldo) {
      const uint8_t* wb = wp + b * C * 64;
      const auto* sb = s + b * Gw * 16;
#if defined(SPARQ_AVX512_VNNI)
      over_x_rows(M, [&](auto mb, int64_t m) {
        int8_q8_rows16_vnni<decltype(mb)::value, decltype(nbk)::value>(xq, m, C, Gw, wb, sb, out + m * ldo, ldo);
      });
#elif defined(SPARQ_Q8_AVX2)
      for (int i = 0; i < decltype(nbk)::value; ++i)
        over_x_rows(M, [&](auto mb, int64_t m) {
          int8_q8_rows16_avx2<decltype(mb)::value>(xq, m, C, Gw, wb + i * C * 64, sb + i * Gw * 16, out + m * ldo + 16 * i, ldo);
        });
#else
      for (int i = 0; i < decltype(nbk)::value; ++i)
        int8_q8_rows16_ref(xq, 0, M, C, Gw, wb + i * C * 64, sb + i * Gw * 16, out + 16 * i, ldo);
#endif
    });
  };
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>());
  else run(scales.data_ptr<float>());
  return y;
}

// =============================================================================================
// Prefill GEMMs on the same rows16 weights (linear_int4_q8_gemm_cpu, linear_int8_q8_gemm_cpu): any
// number of rows of x, for a prefill chunk's hundreds, where the GEMVs above take a decode step's few.
// There the work is compute-bound, not a stream: x is rounded to int8 once per call, on every thread
// (quantize_x_row, the GEMVs' rounding to the byte), then each tile of NBK blocks of 16 weight rows,
// loaded into L1 once per m-chunk, serves every row of that chunk, MB rows per pass with MB x NBK
// accumulators in registers (each 64-byte weight load feeds MB vpdpbusd pairs, each broadcast of x
// NBK of them), and the threads claim units of (m-chunk, tile). Every output is the GEMV's formula in
// the GEMV's order: the integer dot products are exact in any order of their sums, and the float
// epilogue per group is the same instructions on the same operands, so each row of the GEMM is its
// one-row GEMV call bit for bit, at any M and thread count (tests/test_kernels_cpu.py).
// =============================================================================================

#ifndef SPARQ_GEMM_MC
#define SPARQ_GEMM_MC 256  // rows of x per unit: one m-chunk's int8 x stays in L2 while the tiles pass over it
#endif

#ifdef SPARQ_AVX512_VNNI
// 4 bytes of x at p, in every 32-bit lane (vpdpbusd's signed operand)
static inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// int4 tile: MB rows of x (from m0) against NBK blocks of 16 weight rows (C * 64 bytes apart), the
// whole of K, into t[m * ldt + 16 b + r]. int4_q8_rows16_vnni's arithmetic: per group the exact dot
// product, then s (a dot - 8 a sum xq) + z X on 16 rows at once. Only the blocking differs: a chunk's
// nibbles unpacked once for MB rows, one int32 chain per (row, block) for both nibbles (the GEMV's even
// + odd chains, the same integer), no prefetch (the tile is re-read from L1). CPG, the chunks per
// group, as a constant unrolls the group's loop (GCC kept copying the accumulators of a runtime loop);
// 0: read it from C / G.
template <int MB, int NBK, int CPG, class ST>
static inline void int4_q8_tile_vnni(const XQ& xq, int64_t m0, int64_t C, const uint8_t* w16, const ST* s16,
                                     const ST* z16, float* t, int64_t ldt) {
  const int64_t G = xq.G, cpg = CPG ? CPG : C / G, bs = C * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB][NBK];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) acc[m][b] = _mm512_setzero_ps();
  const int8_t* xe[MB];
  const int8_t* xo[MB];
  for (int m = 0; m < MB; ++m) xe[m] = xq.plane(0, m0 + m), xo[m] = xq.plane(1, m0 + m);
  for (int64_t g = 0; g < G; ++g) {
    __m512i d[MB][NBK];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NBK; ++b) d[m][b] = _mm512_setzero_si512();
    const uint8_t* wg = w16 + g * cpg * 64;
    const int64_t xg = 4 * g * cpg;
#pragma GCC unroll 8
    for (int64_t c = 0; c < cpg; ++c) {
      __m512i lo[NBK], hi[NBK];
      for (int b = 0; b < NBK; ++b) {
        const __m512i bytes = _mm512_loadu_si512(wg + b * bs + c * 64);
        lo[b] = _mm512_and_si512(bytes, low4);
        hi[b] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i e = bcast4(xe[m] + xg + 4 * c);
        for (int b = 0; b < NBK; ++b) d[m][b] = _mm512_dpbusd_epi32(d[m][b], lo[b], e);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i o = bcast4(xo[m] + xg + 4 * c);
        for (int b = 0; b < NBK; ++b) d[m][b] = _mm512_dpbusd_epi32(d[m][b], hi[b], o);
      }
    }
    for (int b = 0; b < NBK; ++b) {
      const __m512 sv = load(s16 + (b * G + g) * 16).x, zv = load(z16 + (b * G + g) * 16).x;
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        const __m512 dot = _mm512_cvtepi32_ps(d[m][b]);
        const __m512 u = _mm512_fmsub_ps(dot, _mm512_set1_ps(xq.a[mg]), _mm512_set1_ps(xq.off[mg]));
        acc[m][b] = _mm512_fmadd_ps(sv, u, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xq.X[mg]), acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) _mm512_storeu_ps(t + m * ldt + 16 * b, acc[m][b]);
}

// int8 tile, as int4's: int8_q8_rows16_vnni's arithmetic (per x group of 32 columns the exact dot
// product, a dot - 128 a sum xq into the weight group's sum, scaled once per weight group) with one
// int32 chain per (row, block) where the GEMV keeps two: the MB x NBK chains are independent enough.
template <int MB, int NBK, class ST>
static inline void int8_q8_tile_vnni(const XQ& xq, int64_t m0, int64_t C, int64_t Gw, const uint8_t* w16,
                                     const ST* s16, float* t, int64_t ldt) {
  constexpr int64_t cpg = 8;  // x's groups of 32 columns
  const int64_t G = xq.G, gpw = G / Gw, bs = C * 64;
  __m512 acc[MB][NBK];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) acc[m][b] = _mm512_setzero_ps();
  const int8_t* xm[MB];
  for (int m = 0; m < MB; ++m) xm[m] = xq.plane(0, m0 + m);
  for (int64_t gw = 0; gw < Gw; ++gw) {
    __m512 sum[MB][NBK];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NBK; ++b) sum[m][b] = _mm512_setzero_ps();
    for (int64_t g = gw * gpw; g < (gw + 1) * gpw; ++g) {
      __m512i d[MB][NBK];
      for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NBK; ++b) d[m][b] = _mm512_setzero_si512();
      const uint8_t* wg = w16 + g * cpg * 64;
#pragma GCC unroll 8
      for (int64_t c = 0; c < cpg; ++c) {
        __m512i w[NBK];
        for (int b = 0; b < NBK; ++b) w[b] = _mm512_loadu_si512(wg + b * bs + c * 64);
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = bcast4(xm[m] + 4 * (g * cpg + c));
          for (int b = 0; b < NBK; ++b) d[m][b] = _mm512_dpbusd_epi32(d[m][b], w[b], xv);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t mg = (m0 + m) * G + g;
        for (int b = 0; b < NBK; ++b) {
          const __m512 dot = _mm512_cvtepi32_ps(d[m][b]);
          sum[m][b] = _mm512_add_ps(sum[m][b], _mm512_fmsub_ps(dot, _mm512_set1_ps(xq.a[mg]), _mm512_set1_ps(xq.off[mg])));
        }
      }
    }
    for (int b = 0; b < NBK; ++b) {
      const __m512 sv = load(s16 + (b * Gw + gw) * 16).x;
      for (int m = 0; m < MB; ++m) acc[m][b] = _mm512_fmadd_ps(sv, sum[m][b], acc[m][b]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NBK; ++b) _mm512_storeu_ps(t + m * ldt + 16 * b, acc[m][b]);
}
#endif

// The tiles' shape, MB rows of x by NBK blocks of 16 weight rows: on VNNI MB x NBK int32 chains and as
// many fp32 sums in registers, with the unpacked nibbles (int4) or weight vectors of the NBK blocks, stay
// within the 32 zmm registers (6 x 2 and 8 x 1 spilled more, 4 x 2 and 4 x 3 ran alike; docs/NOTES.md).
// The GEMVs' AVX2 kernels already hold up to 4 rows of x against one block (16 ymm registers leave no
// room for more), so that path tiles them as they are, and the portable path runs the readable GEMV
// loops on a tile's rows; their NBK blocks share one pass over x, in L1.
constexpr int kTileRows = 4, kTileBlocks = 3;

// tile(mb, nbk) with both as integral_constants: mb <= MB rows of x, nbk <= NBK blocks (a unit's last
// rows and blocks run the smaller kernels).
template <int MB, int NBK, class Tile>
static inline void with_tile_shape(int64_t mb, int64_t nbk, Tile& tile) {
  if constexpr (MB > 1) {
    if (mb < MB) return with_tile_shape<MB - 1, NBK>(mb, nbk, tile);
  }
  if constexpr (NBK > 1) {
    if (nbk < NBK) return with_tile_shape<MB, NBK - 1>(mb, nbk, tile);
  }
  tile(std::integral_constant<int, MB>{}, std::integral_constant<int, NBK>{});
}

// bf16 bits of v rounded to nearest even, NaN as 0x7FC0: c10::BFloat16(v), the GEMVs' rounding,
// written without a branch so that the loop over a row vectorises.
static inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t rounded = (uint16_t)((u + ((u >> 16) & 1) + 0x7FFFu) >> 16);
  return v != v ? (uint16_t)0x7FC0 : rounded;
}

// Rows [m0, m0 + mb) and columns [n0, n0 + cols) of y from the fp32 tile t (rows ldt apart), in y's
// dtype, rounded as over_weight_rows_into rounds the GEMVs' outputs.
static void write_tile(at::Tensor& y, int64_t m0, int64_t mb, int64_t n0, int64_t cols, const float* t, int64_t ldt) {
  const int64_t N = y.size(1);
  for (int64_t m = 0; m < mb; ++m) {
    const float* src = t + m * ldt;
    const int64_t off = (m0 + m) * N + n0;
    switch (y.scalar_type()) {
      case at::kFloat: std::memcpy(y.data_ptr<float>() + off, src, cols * sizeof(float)); break;
      case at::kBFloat16: {
        uint16_t* dst = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()) + off;
        for (int64_t i = 0; i < cols; ++i) dst[i] = bf16_bits(src[i]);
        break;
      }
      default: {
        c10::Half* dst = y.data_ptr<c10::Half>() + off;
        for (int64_t i = 0; i < cols; ++i) dst[i] = c10::Half(src[i]);
      }
    }
  }
}

// Rows [m0, m1) of x (fp32, bf16 or fp16) into xq, through an fp32 copy of each row unless x is fp32
// (the values quantize_x_row reads are the GEMVs' either way: widening is exact).
static void quantize_x_rows(XQ& xq, const at::Tensor& x, int64_t m0, int64_t m1, int planes, float offset) {
  const int64_t K = x.size(1), xs = x.stride(0);
  if (x.scalar_type() == at::kFloat) {
    for (int64_t m = m0; m < m1; ++m) quantize_x_row(xq, m, x.data_ptr<float>() + m * xs, K, planes, offset);
    return;
  }
  std::vector<float> row(K);
  for (int64_t m = m0; m < m1; ++m) {
    if (x.scalar_type() == at::kBFloat16)
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x.data_ptr<bf16>()[m * xs + k]);
    else
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x.data_ptr<f16>()[m * xs + k]);
    quantize_x_row(xq, m, row.data(), K, planes, offset);
  }
}

// The GEMMs' schedule, one parallel region of two phases: x quantized in units of 32 rows, then units
// of (m-chunk of SPARQ_GEMM_MC rows, tile of NBK blocks), m-chunks outermost so that both threads work
// on one chunk of x at a time; tile(mb, nbk, m, b, t, ldt) computes mb rows of x from m against blocks
// [b, b + nbk) into the fp32 tile t, which write_tile then stores (the last block's live rows only).
template <int MB, int NBK, class Tile>
static void gemm_rows16(at::Tensor& y, XQ& xq, const at::Tensor& x, int planes, float offset, int64_t NB, Tile&& tile) {
  const int64_t M = y.size(0), N = y.size(1), kQuantRows = 32, mc = SPARQ_GEMM_MC / MB * MB;  // whole tiles
  const int64_t n_tiles = (NB + NBK - 1) / NBK, m_chunks = (M + mc - 1) / mc;
  auto unit = [&](int phase, int64_t u, int /*slot*/) {
    if (phase == 0) return quantize_x_rows(xq, x, u * kQuantRows, std::min(M, (u + 1) * kQuantRows), planes, offset);
    const int64_t m1 = std::min(M, (u / n_tiles + 1) * mc), b = u % n_tiles * NBK;
    const int64_t nbk = std::min<int64_t>(NBK, NB - b), cols = std::min(16 * nbk, N - 16 * b);
    float t[MB * 16 * NBK];
    for (int64_t m = u / n_tiles * mc; m < m1; m += MB) {
      const int64_t mb = std::min<int64_t>(MB, m1 - m);
      auto run = [&](auto mbc, auto nbkc) { tile(mbc, nbkc, m, b, t, 16 * NBK); };
      with_tile_shape<MB, NBK>(mb, nbk, run);
      write_tile(y, m, mb, 16 * b, cols, t, 16 * NBK);
    }
  };
  run_phases(thread_count(), {(M + kQuantRows - 1) / kQuantRows, m_chunks * n_tiles}, unit);
}

at::Tensor linear_int4_q8_gemm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                   const at::Tensor& zeros, int64_t N) {
  const char* op = "sparq::linear_int4_q8_gemm_cpu";
  const int64_t G = check_rows16(x, w, scales, N, 8, "pack_int4_rows16", op, /*decode=*/false);
  TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.is_contiguous() && zeros.scalar_type() == scales.scalar_type() &&
                  zeros.device().is_cpu(), op, ": zeros must be laid out as scales");
  const int64_t M = x.size(0), K = x.size(1), C = K / 8, NB = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  XQ xq = xq_alloc(M, K, G, 2);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto* s, auto* z) {
    gemm_rows16<kTileRows, kTileBlocks>(y, xq, x, 2, 8.f, NB, [&](auto mbc, auto nbkc, int64_t m, int64_t b, float* t, int64_t ldt) {
      constexpr int MB = decltype(mbc)::value, NBK = decltype(nbkc)::value;
      const uint8_t* wb = wp + b * C * 64;
      const auto *sb = s + b * G * 16, *zb = z + b * G * 16;
#if defined(SPARQ_AVX512_VNNI)
      switch (C / G) {  // chunks per group: groups of 32 and 64 (the default, SmolLM2's) unrolled whole
        case 4: int4_q8_tile_vnni<MB, NBK, 4>(xq, m, C, wb, sb, zb, t, ldt); break;
        case 8: int4_q8_tile_vnni<MB, NBK, 8>(xq, m, C, wb, sb, zb, t, ldt); break;
        default: int4_q8_tile_vnni<MB, NBK, 0>(xq, m, C, wb, sb, zb, t, ldt);
      }
#elif defined(SPARQ_Q8_AVX2)
      for (int i = 0; i < NBK; ++i)
        int4_q8_rows16_avx2<MB>(xq, m, C, wb + i * C * 64, sb + i * G * 16, zb + i * G * 16, t + 16 * i, ldt);
#else
      for (int i = 0; i < NBK; ++i)
        int4_q8_rows16_ref(xq, m, MB, C, wb + i * C * 64, sb + i * G * 16, zb + i * G * 16, t + 16 * i, ldt);
#endif
    });
  };
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>(), zeros.data_ptr<bf16>());
  else run(scales.data_ptr<float>(), zeros.data_ptr<float>());
  return y;
}

at::Tensor linear_int8_q8_gemm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t N) {
  const int64_t Gw = check_rows16(x, w, scales, N, 4, "pack_int8_rows16", "sparq::linear_int8_q8_gemm_cpu",
                                  /*decode=*/false);
  const int64_t M = x.size(0), K = x.size(1), C = K / 4, NB = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  XQ xq = xq_alloc(M, K, K / 32, 1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto* s) {
    gemm_rows16<kTileRows, kTileBlocks>(y, xq, x, 1, 128.f, NB, [&](auto mbc, auto nbkc, int64_t m, int64_t b, float* t, int64_t ldt) {
      constexpr int MB = decltype(mbc)::value, NBK = decltype(nbkc)::value;
      const uint8_t* wb = wp + b * C * 64;
      const auto* sb = s + b * Gw * 16;
#if defined(SPARQ_AVX512_VNNI)
      int8_q8_tile_vnni<MB, NBK>(xq, m, C, Gw, wb, sb, t, ldt);
#elif defined(SPARQ_Q8_AVX2)
      for (int i = 0; i < NBK; ++i)
        int8_q8_rows16_avx2<MB>(xq, m, C, Gw, wb + i * C * 64, sb + i * Gw * 16, t + 16 * i, ldt);
#else
      for (int i = 0; i < NBK; ++i)
        int8_q8_rows16_ref(xq, m, MB, C, Gw, wb + i * C * 64, sb + i * Gw * 16, t + 16 * i, ldt);
#endif
    });
  };
  if (scales.scalar_type() == at::kBFloat16) run(scales.data_ptr<bf16>());
  else run(scales.data_ptr<float>());
  return y;
}

#if defined(SPARQ_AVX512_VNNI)
std::string linear_q8_path() { return "vnni"; }
#elif defined(SPARQ_Q8_AVX2)
std::string linear_q8_path() { return "avx2"; }
#else
std::string linear_q8_path() { return "portable"; }
#endif

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("linear_int8_cpu", &sparq_cpu::linear_int8_cpu);
  m.impl("linear_int4_cpu", &sparq_cpu::linear_int4_cpu);
  m.impl("linear_int4_q8_cpu", &sparq_cpu::linear_int4_q8_cpu);
  m.impl("linear_int8_q8_cpu", &sparq_cpu::linear_int8_q8_cpu);
  m.impl("linear_int4_q8_gemm_cpu", &sparq_cpu::linear_int4_q8_gemm_cpu);
  m.impl("linear_int8_q8_gemm_cpu", &sparq_cpu::linear_int8_q8_gemm_cpu);
}
TORCH_LIBRARY_IMPL(sparq, CompositeExplicitAutograd, m) {  // no tensor arguments
  m.impl("linear_q8_path", &sparq_cpu::linear_q8_path);
}
