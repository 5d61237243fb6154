// The 16-lane float vector layer of the CPU kernels: AVX-512 intrinsics where the build targets
// AVX-512 (F, BW, VL, DQ), two 8-lane AVX2 halves where it targets AVX2 + FMA + F16C (x86-64-v3),
// else a portable fallback. Loads widen bf16 / f16 to fp32; vexp, compress_store, lane ids,
// prefetch; the bf16/f16 aliases and to_f/from_f. Everything here is static inline: every kernel
// source includes it. The portable fallback is correct everywhere but slow to run and to build (gcc
// spends minutes at -O3 on its lane loops, docs/NOTES.md): CPUs without AVX-512 run the AVX2 layer.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPARQ_AVX512 1
#include <immintrin.h>
#endif
// AVX512_BF16 (vdpbf16ps: bf16 pairs dotted straight into fp32 lanes), where the build targets it
#if defined(SPARQ_AVX512) && defined(__AVX512BF16__)
#define SPARQ_AVX512_BF16 1
#endif
// AVX512_VNNI (vpdpbusd: u8 x s8 quadruples summed into int32 lanes), where the build targets it
#if defined(SPARQ_AVX512) && defined(__AVX512VNNI__)
#define SPARQ_AVX512_VNNI 1
#endif
#if !defined(SPARQ_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPARQ_AVX2 1
#include <immintrin.h>
#endif

namespace sparq_cpu {

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
static inline V vmin_masked(V acc, M m, V b) { return {_mm512_mask_min_ps(acc.x, m, acc.x, b.x)}; }
static inline float hmin(V a) { return _mm512_reduce_min_ps(a.x); }
static inline float hsum(V a) { return _mm512_reduce_add_ps(a.x); }
static inline V vabs(V a) { return {_mm512_abs_ps(a.x)}; }
static inline float hmax(V a) { return _mm512_reduce_max_ps(a.x); }
// The sum of a's lanes added in hsum16's order (lanes 0+2 and 1+3 of each 128-bit lane, their sum,
// then 128-bit lanes 0+1 and 2+3, their sum): bit for bit what hsum16 gives for a, so a kernel can
// reduce some sums one at a time and others 16 at a time and every one rounds alike.
static inline float hsum_as16(V a) {
  __m512 x = _mm512_add_ps(a.x, _mm512_permute_ps(a.x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_cvtss_f32(x);
}
// lane i of the result = the sum of the 16 lanes of a[i]: a transposing reduction, 45 shuffles and
// adds for 16 sums where 16 hsum calls take about 130 (pairs within 128-bit lanes, then the lanes)
static inline V hsum16(const V* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i(0+2), a2i+1(0+2), a2i(1+3), a2i+1(1+3)]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].x, a[2 * i + 1].x), _mm512_unpackhi_ps(a[2 * i].x, a[2 * i + 1].x));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane's sums of a4j .. a4j+3
    const __m512d x = _mm512_castps_pd(t[2 * j]), y = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)))};
}
static inline M cmp_ge(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_GE_OQ); }
static inline bool cmp_gt_any(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_GT_OQ) != 0; }
static inline M cmp_gt(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_GT_OQ); }
static inline M cmp_eq(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_EQ_OQ); }
static inline M tail_mask(int64_t n) { return n >= 16 ? (M)0xFFFF : (M)((1u << n) - 1u); }
static inline V vselect(M m, V a, V b) { return {_mm512_mask_blend_ps(m, b.x, a.x)}; }  // m ? a : b
static inline V vlane(V a, int i) { return {_mm512_permutexvar_ps(_mm512_set1_epi32(i), a.x)}; }  // lane i everywhere

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

// Append the lanes of (a, idx) selected by m at dst_s/dst_i (16 slots of slack needed); returns count.
static inline int compress_store(float* dst_s, int32_t* dst_i, M m, V a, __m512i idx) {
  _mm512_storeu_ps(dst_s, _mm512_maskz_compress_ps(m, a.x));
  _mm512_storeu_si512(dst_i, _mm512_maskz_compress_epi32(m, idx));
  return __builtin_popcount((unsigned)m);
}
struct Lanes { __m512i x; };
static inline Lanes lane_ids(int32_t start) {
  return {_mm512_add_epi32(_mm512_set1_epi32(start), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
}
static inline Lanes load_ids(const int32_t* p, M m) { return {_mm512_maskz_loadu_epi32(m, p)}; }
static inline int compress_store(float* dst_s, int32_t* dst_i, M m, V a, Lanes idx) {
  return compress_store(dst_s, dst_i, m, a, idx.x);
}
// 16 int8 -> fp32 (masked: the lanes of m, zeros elsewhere)
static inline V load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline V load_i8(const int8_t* p, M m) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)))}; }
// 16 bytes of 4-bit values -> (low nibbles, high nibbles) - 8 as fp32; vpermps reads only the low
// 4 bits of each index, so the table lookup both masks and converts
// (even, odd) -> (first, second): the lanes of two vectors holding positions 0, 2, 4, ... and 1, 3,
// 5, ... of 32 (an int4 row's low and high nibbles) in position order, 0..15 and 16..31.
static inline void interleave(V even, V odd, V* first, V* second) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  first->x = _mm512_permutex2var_ps(even.x, lo, odd.x);
  second->x = _mm512_permutex2var_ps(even.x, hi, odd.x);
}
static inline void load_nibbles_minus8(const uint8_t* p, V* lo, V* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  lo->x = _mm512_permutexvar_ps(b, table);
  hi->x = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
// 16 int3 codes (cache.unpack_int3's block layout) minus 4: position l's low bits 2l..2l+1 of `low`, its high bit
// bit l of `high`
static inline V int3_minus4(uint32_t low, uint32_t high) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lo = _mm512_srlv_epi32(_mm512_set1_epi32((int)low), _mm512_add_epi32(lane, lane));  // bits 0-1
  const __m512i hi = _mm512_srlv_epi32(_mm512_set1_epi32((int)(high << 2)), lane);  // bit 2: the high bit
  // bits 0-1 from lo, the rest from hi (0xE4: c ? a : b); the table reads 4 bits, its halves alike (bit 3 is the
  // next lane's high bit)
  const __m512i code = _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi32(3), 0xE4);
  const __m512 table = _mm512_setr_ps(-4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f);
  return {_mm512_permutexvar_ps(code, table)};
}
static inline void prefetch(const void* p) { __asm__ __volatile__("prefetcht0 (%0)" : : "r"(p)); }
static inline void prefetch_l2(const void* p) { __asm__ __volatile__("prefetcht1 (%0)" : : "r"(p)); }

#elif defined(SPARQ_AVX2)  // two 8-lane halves: lanes 0-7 in lo, 8-15 in hi

struct V { __m256 lo, hi; };
using M = uint32_t;  // bit l: lane l (16 bits used)
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
// the lanes of m as all-ones / all-zeros 8-lane masks
static inline __m256 half_mask(M m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(m & 0xFF)), bits), bits));
}
static inline V vselect(M m, V a, V b) {  // m ? a : b
  return {_mm256_blendv_ps(b.lo, a.lo, half_mask(m)), _mm256_blendv_ps(b.hi, a.hi, half_mask(m >> 8))};
}
static inline V vmax_masked(V acc, M m, V b) { return vselect(m, vmax(acc, b), acc); }
static inline V vmin_masked(V acc, M m, V b) {
  return vselect(m, V{_mm256_min_ps(acc.lo, b.lo), _mm256_min_ps(acc.hi, b.hi)}, acc);
}
static inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float hsum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
static inline float hmax(V a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float hmin(V a) {
  __m256 m = _mm256_min_ps(a.lo, a.hi);
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  s = _mm_min_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline V vabs(V a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
// lane i of the result = the sum of the 16 lanes of a[i]
static inline V hsum16(const V* a) {
  alignas(32) float r[16];
  for (int i = 0; i < 16; ++i) r[i] = hsum(a[i]);
  return {_mm256_load_ps(r), _mm256_load_ps(r + 8)};
}
template <int CMP> static inline M cmp_mask(V a, V b) {
  return (M)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, CMP)) | ((M)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, CMP)) << 8);
}
static inline M cmp_ge(V a, V b) { return cmp_mask<_CMP_GE_OQ>(a, b); }
static inline M cmp_gt(V a, V b) { return cmp_mask<_CMP_GT_OQ>(a, b); }
static inline M cmp_eq(V a, V b) { return cmp_mask<_CMP_EQ_OQ>(a, b); }
static inline bool cmp_gt_any(V a, V b) { return cmp_gt(a, b) != 0; }
static inline M tail_mask(int64_t n) { return n >= 16 ? (M)0xFFFF : (M)((1u << n) - 1u); }
static inline void store(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline V vlane(V a, int i) {  // lane i everywhere
  alignas(32) float t[16];
  _mm256_store_ps(t, a.lo);
  _mm256_store_ps(t + 8, a.hi);
  return vset(t[i]);
}

static inline __m256 widen_bf16(__m128i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16)); }
static inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V load(const bf16* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {widen_bf16(_mm_loadu_si128(q)), widen_bf16(_mm_loadu_si128(q + 1))};
}
static inline V load(const f16* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
static inline V load(const float* p, M m) {  // vmaskmov never touches the lanes outside m
  return {_mm256_maskload_ps(p, _mm256_castps_si256(half_mask(m))), _mm256_maskload_ps(p + 8, _mm256_castps_si256(half_mask(m >> 8)))};
}
// 16-bit lanes have no masked load in AVX2: the lanes of m go through a zeroed buffer (tails only)
template <typename T> static inline V load_masked16(const T* p, M m) {
  alignas(32) T t[16] = {};
  for (int l = 0; l < 16; ++l)
    if ((m >> l) & 1) t[l] = p[l];
  return load(static_cast<const T*>(t));
}
static inline V load(const bf16* p, M m) { return load_masked16(p, m); }
static inline V load(const f16* p, M m) { return load_masked16(p, m); }
static inline void store(float* p, V a, M m) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(half_mask(m)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(half_mask(m >> 8)), a.hi);
}

// exp as the AVX-512 layer computes it (Cephes polynomial), 2^n applied in two halves so that
// arguments down to -104 underflow to 0 smoothly instead of wrapping the exponent field
static inline __m256 pow2i(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
static inline __m256 vexp8(__m256 v) {
  __m256 x = _mm256_max_ps(_mm256_set1_ps(-104.0f), v);  // NaN (second operand) propagates
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-150, 128]
  const __m256i half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i(half)), pow2i(_mm256_sub_epi32(ni, half)));
}
static inline V vexp(V v) { return {vexp8(v.lo), vexp8(v.hi)}; }

struct Lanes { int32_t x[16]; };
static inline Lanes lane_ids(int32_t start) { Lanes r; for (int l = 0; l < 16; ++l) r.x[l] = start + l; return r; }
static inline Lanes load_ids(const int32_t* p, M m) { Lanes r; for (int l = 0; l < 16; ++l) r.x[l] = ((m >> l) & 1) ? p[l] : 0; return r; }
// Append the lanes of (a, idx) selected by m at dst_s/dst_i; returns the count (no compress in AVX2)
static inline int compress_store(float* dst_s, int32_t* dst_i, M m, V a, Lanes idx) {
  alignas(32) float t[16];
  store(t, a);
  int c = 0;
  for (M rest = m & 0xFFFF; rest; rest &= rest - 1) {
    const int l = __builtin_ctz(rest);
    dst_s[c] = t[l];
    dst_i[c++] = idx.x[l];
  }
  return c;
}
static inline V load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline V load_i8(const int8_t* p, M m) {
  alignas(16) int8_t t[16] = {};
  for (int l = 0; l < 16; ++l)
    if ((m >> l) & 1) t[l] = p[l];
  return load_i8(static_cast<const int8_t*>(t));
}
// 16 bytes of 4-bit values -> (low nibbles, high nibbles) - 8 as fp32
static inline void interleave(V even, V odd, V* first, V* second) {
  const __m256 l0 = _mm256_unpacklo_ps(even.lo, odd.lo), h0 = _mm256_unpackhi_ps(even.lo, odd.lo);
  const __m256 l1 = _mm256_unpacklo_ps(even.hi, odd.hi), h1 = _mm256_unpackhi_ps(even.hi, odd.hi);
  first->lo = _mm256_permute2f128_ps(l0, h0, 0x20);
  first->hi = _mm256_permute2f128_ps(l0, h0, 0x31);
  second->lo = _mm256_permute2f128_ps(l1, h1, 0x20);
  second->hi = _mm256_permute2f128_ps(l1, h1, 0x31);
}
static inline void load_nibbles_minus8(const uint8_t* p, V* lo, V* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  lo->lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, f), eight));
  lo->hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, f), eight));
  hi->lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight));
  hi->hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight));
}
static inline __m256 int3_minus4_8(uint32_t low, uint32_t high, int first) {  // lanes first..first + 7
  const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_add_epi32(lane, lane)),
                                      _mm256_set1_epi32(3));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)high), lane), _mm256_set1_epi32(1));
  const __m256i code = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(4)));
}
// 16 int3 codes (cache.unpack_int3's block layout) minus 4: position l's low bits 2l..2l+1 of `low`, its high bit
// bit l of `high`
static inline V int3_minus4(uint32_t low, uint32_t high) { return {int3_minus4_8(low, high, 0), int3_minus4_8(low, high, 8)}; }
static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
static inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

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
static inline V vmin_masked(V acc, M m, V b) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) && b.x[l] < acc.x[l] ? b.x[l] : acc.x[l]; return r; }
static inline float hmin(V a) { float s = std::numeric_limits<float>::infinity(); SPARQ_LANES s = a.x[l] < s ? a.x[l] : s; return s; }
static inline float hsum(V a) { float s = 0.f; SPARQ_LANES s += a.x[l]; return s; }
static inline V vabs(V a) { V r; SPARQ_LANES r.x[l] = std::fabs(a.x[l]); return r; }
static inline float hmax(V a) { float s = kNegInf; SPARQ_LANES s = a.x[l] > s ? a.x[l] : s; return s; }
static inline V hsum16(const V* a) { V r; SPARQ_LANES r.x[l] = hsum(a[l]); return r; }
static inline M cmp_ge(V a, V b) { M m = 0; SPARQ_LANES m |= (M)(a.x[l] >= b.x[l]) << l; return m; }
static inline bool cmp_gt_any(V a, V b) { bool r = false; SPARQ_LANES r |= a.x[l] > b.x[l]; return r; }
static inline M cmp_gt(V a, V b) { M m = 0; SPARQ_LANES m |= (M)(a.x[l] > b.x[l]) << l; return m; }
static inline M cmp_eq(V a, V b) { M m = 0; SPARQ_LANES m |= (M)(a.x[l] == b.x[l]) << l; return m; }
static inline M tail_mask(int64_t n) { return n >= 16 ? (M)0xFFFF : (M)((1u << n) - 1u); }
static inline V vselect(M m, V a, V b) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) ? a.x[l] : b.x[l]; return r; }
static inline V vlane(V a, int i) { return vset(a.x[i]); }
template <typename T> static inline V load_lanes(const T* p) { V r; SPARQ_LANES r.x[l] = (float)p[l]; return r; }
template <typename T> static inline V load_lanes(const T* p, M m) { V r; SPARQ_LANES r.x[l] = ((m >> l) & 1) ? (float)p[l] : 0.f; return r; }
// Overloads, not a template load<T>: for bf16 / f16 pointers argument-dependent lookup also finds
// the template c10::load (c10/util/Load.h), which a template here would be ambiguous with.
static inline V load(const float* p) { return load_lanes(p); }
static inline V load(const bf16* p) { return load_lanes(p); }
static inline V load(const f16* p) { return load_lanes(p); }
static inline V load(const float* p, M m) { return load_lanes(p, m); }
static inline V load(const bf16* p, M m) { return load_lanes(p, m); }
static inline V load(const f16* p, M m) { return load_lanes(p, m); }
static inline void store(float* p, V a) { SPARQ_LANES p[l] = a.x[l]; }
static inline void store(float* p, V a, M m) { SPARQ_LANES if ((m >> l) & 1) p[l] = a.x[l]; }
static inline V vexp(V v) { V r; SPARQ_LANES r.x[l] = std::exp(v.x[l]); return r; }
struct Lanes { int32_t x[16]; };
static inline Lanes lane_ids(int32_t start) { Lanes r; for (int l = 0; l < 16; ++l) r.x[l] = start + l; return r; }
static inline Lanes load_ids(const int32_t* p, M m) { Lanes r; for (int l = 0; l < 16; ++l) r.x[l] = ((m >> l) & 1) ? p[l] : 0; return r; }
static inline int compress_store(float* dst_s, int32_t* dst_i, M m, V a, Lanes idx) {
  int c = 0;
  for (int l = 0; l < 16; ++l) if ((m >> l) & 1) { dst_s[c] = a.x[l]; dst_i[c++] = idx.x[l]; }
  return c;
}
static inline V load_i8(const int8_t* p) { V r; for (int l = 0; l < 16; ++l) r.x[l] = (float)p[l]; return r; }
static inline V load_i8(const int8_t* p, M m) { V r; for (int l = 0; l < 16; ++l) r.x[l] = ((m >> l) & 1) ? (float)p[l] : 0.f; return r; }
static inline void interleave(V even, V odd, V* first, V* second) {
  for (int l = 0; l < 8; ++l) {
    first->x[2 * l] = even.x[l]; first->x[2 * l + 1] = odd.x[l];
    second->x[2 * l] = even.x[8 + l]; second->x[2 * l + 1] = odd.x[8 + l];
  }
}
static inline void load_nibbles_minus8(const uint8_t* p, V* lo, V* hi) {
  for (int l = 0; l < 16; ++l) { lo->x[l] = (float)(p[l] & 15) - 8.f; hi->x[l] = (float)(p[l] >> 4) - 8.f; }
}
// 16 int3 codes (cache.unpack_int3's block layout) minus 4: position l's low bits 2l..2l+1 of `low`, its high bit
// bit l of `high`
static inline V int3_minus4(uint32_t low, uint32_t high) {
  V r;
  for (int l = 0; l < 16; ++l) r.x[l] = (float)((int)(((low >> (2 * l)) & 3) | (((high >> l) & 1) << 2)) - 4);
  return r;
}
static inline void prefetch(const void* p) { __builtin_prefetch(p); }
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#undef SPARQ_LANES
#endif

// int8 rows of a quantized KV cache load as the other cache dtypes do (their scales are applied by the caller)
static inline V load(const int8_t* p) { return load_i8(p); }
static inline V load(const int8_t* p, M m) { return load_i8(p, m); }

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }
template <typename T> static inline T from_f(float x) { return static_cast<T>(x); }

}  // namespace sparq_cpu
