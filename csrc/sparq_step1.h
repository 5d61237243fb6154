// Step 1 (passes A and B): the approximate scores s_hat from the r rows of K^T, the exp fused in.
// Part of the fused SparQ kernel (sparq_decode.cpp, whose header comment describes the passes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "parallel.h"
#include "simd.h"
#include "sparq_problem.h"
#include "sparq_select.h"

namespace sparq_cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Per-bh preparation: q in fp32, i1, q_hat = q[i1] / tau (laid out [i][h])
// ---------------------------------------------------------------------------------------------

template <typename QT>
static void prepare(const Problem& P, const QT* q, int64_t b, int64_t h, float* qf, int32_t* order,
                    int32_t* i1, float* qhat) {
  const int64_t g = P.g, d = P.d, r = P.r;
  const QT* qb = q + b * P.qs0 + h * P.qs1;
  if (P.qs3 == 1) {
    for (int64_t hh = 0; hh < g; ++hh)
      for (int64_t j = 0; j < d; j += 16) store(qf + hh * d + j, load(qb + hh * P.qs2 + j, tail_mask(d - j)), tail_mask(d - j));
  } else {
    for (int64_t hh = 0; hh < g; ++hh)
      for (int64_t j = 0; j < d; ++j) qf[hh * d + j] = to_f(qb[hh * P.qs2 + j * P.qs3]);
  }
  // i1: top-r of |q| summed over the group, ascending (qf has d + 16 floats of scratch after g x d)
  float* a = qf + g * d;
  for (int64_t j = 0; j < d; j += 16) {
    const M mk = tail_mask(d - j);
    V s = vzero();
    for (int64_t hh = 0; hh < g; ++hh) s = vadd(s, vabs(load(qf + hh * d + j, mk)));
    store(a + j, s, mk);
  }
  for (int64_t j = 0; j < d; ++j) order[j] = (int32_t)j;
  const int64_t n = select_from(a, order, d, r);  // ascending indices: friendlier K^T streams
  (void)n;
  std::copy(order, order + r, i1);
  for (int64_t hh = 0; hh < g; ++hh) {
    V t = vzero();
    for (int64_t j = 0; j < d; j += 16) t = vadd(t, vabs(load(qf + hh * d + j, tail_mask(d - j))));
    const float tot = hsum(t);
    float sel = 0.f;
    for (int64_t i = 0; i < r; ++i) sel += std::fabs(qf[hh * d + i1[i]]);
    const float inv_tau = 1.0f / std::sqrt((float)d * sel / tot);
    for (int64_t i = 0; i < r; ++i) qhat[i * g + hh] = qf[hh * d + i1[i]] * inv_tau;
  }
  // a quantized step-1 source holds K / chan: chan goes into q_hat; an int8 K (step 2) likewise into q
  if (const float* chan = P.chan_of(b, h)) {
    if (P.step1_scaled())
      for (int64_t i = 0; i < r; ++i)
        for (int64_t hh = 0; hh < g; ++hh) qhat[i * g + hh] *= chan[i1[i]];
    if (P.k_scale)
      for (int64_t hh = 0; hh < g; ++hh)
        for (int64_t j = 0; j < d; ++j) qf[hh * d + j] *= chan[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Pass A, fused with the exp of the softmax: for 32-position blocks of [p0, p1) and a group of G
// heads, logits l = q_hat . K^T[i1, p], then e = exp(l - m_run) stored in E, with m_run the running
// max (raised lazily: only when a block exceeds it, rescaling the running sum Z). mb[blk] records
// the m_run each block used, so the true s_hat = e * exp(mb[blk] - m) / Z once the final max m and
// sum Z (over all chunks) are known. One pass over K^T, the exps overlap with the memory stream.
// ---------------------------------------------------------------------------------------------

// 1024: at 4096 positions of an int4 K^T (a 2 KB row) 2048 bytes aimed every prefetch at the next row group, never
// further along the rows being read, and the step's pass A waited on DRAM (docs/serving.md, "The K^T stream's
// prefetch": a B = 16 step at 4096 positions 12% slower on a Zen 5)
#ifndef SPARQ_PF_BYTES
#define SPARQ_PF_BYTES 1024
#endif
constexpr int64_t kPrefetchAhead = SPARQ_PF_BYTES;  // bytes ahead in each of the r streams

struct RunState {  // per head of a chunk: running max, running sum (16 lanes)
  alignas(64) float z[16];
  float m;
};


// ps: the block's per-position scales of a quantized step-1 source (nullptr: none)
template <int G, bool TAIL>
static SPARQ_INLINE void finish_block(V* acc0, V* acc1, M m0, M m1, float* E, int64_t ldE, RunState* st, float* mb,
                                int64_t ldmb, const float* ps) {
  V s0 = vset(1.f), s1 = vset(1.f);
  if (ps) {
    s0 = TAIL ? load(ps, m0) : load(ps);
    s1 = TAIL ? load(ps + 16, m1) : load(ps + 16);
  }
  for (int h = 0; h < G; ++h) {
    V a0 = acc0[h], a1 = acc1[h];
    if (ps) {
      a0 = vmul(a0, s0);
      a1 = vmul(a1, s1);
    }
    if (TAIL) {
      a0 = vselect(m0, a0, vset(kNegInf));
      a1 = vselect(m1, a1, vset(kNegInf));
    }
    const V bm = vmax(a0, a1);
    float mr = st[h].m;
    if (cmp_gt_any(bm, vset(mr))) {
      const float nm = hmax(bm);
      const float scale = std::exp(mr - nm);  // 0 on the first block (mr = -inf)
      store(st[h].z, vmul(load(st[h].z), vset(scale)));
      st[h].m = mr = nm;
    }
    const V cur = vset(mr);
    V e0 = vexp(vsub(a0, cur)), e1 = vexp(vsub(a1, cur));
    if (TAIL) {
      e0 = vselect(m0, e0, vzero());
      e1 = vselect(m1, e1, vzero());
      store(E + h * ldE, e0, m0);
      store(E + h * ldE + 16, e1, m1);
    } else {
      store(E + h * ldE, e0);
      store(E + h * ldE + 16, e1);
    }
    store(st[h].z, vadd(load(st[h].z), vadd(e0, e1)));
    mb[h * ldmb] = mr;
  }
}

// One 32-position block of pass A over the rows [i0, i1): starts from zero (first row group) or
// from the partial logits the previous group left in E, and ends with finish_block (last group)
// or by storing the partial logits back.
// The 32 positions [p, p + n) of a K^T row as two vectors: in position order, or for an int4 row the
// even positions then the odd ones (block_2k interleaves its sums once, at the end). An int3 row's lanes past n
// hold the block's unwritten codes, an int4 tail's -8: finite, and masked where the block is finished.
template <typename KT, bool TAIL>
static SPARQ_INLINE void load_block(const KT* row, int64_t p, int64_t n, M m0, M m1, V* k0, V* k1) {
  if constexpr (std::is_same_v<KT, int3x32>) {  // the whole block: the cache holds it (bind_cache checks)
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + kt_element<int3x32>(p);
    uint32_t low0, low1, high;
    std::memcpy(&low0, bytes, 4);
    std::memcpy(&low1, bytes + 4, 4);
    std::memcpy(&high, bytes + 8, 4);
    *k0 = int3_minus4(low0, high & 0xFFFF);
    *k1 = int3_minus4(low1, high >> 16);
  } else if constexpr (std::is_same_v<KT, int4x2>) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + p / 2;
    if (TAIL) {  // never read past the row's live bytes
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, bytes, (size_t)((n + 1) / 2));
      load_nibbles_minus8(tail, k0, k1);
    } else {
      load_nibbles_minus8(bytes, k0, k1);
    }
  } else if (TAIL) {
    *k0 = load(row + p, m0);
    *k1 = load(row + p + 16, m1);
  } else {
    *k0 = load(row + p);
    *k1 = load(row + p + 16);
  }
}

template <int G, typename KT, bool TAIL>
static SPARQ_INLINE void block_2k(const KT* const* rows, int64_t i0, int64_t i1, const float* qhat, int64_t qstride,
                            int64_t p, int64_t n, bool first, bool last, int64_t pf_i0, int64_t pf_i1, int64_t pf_pos,
                            float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb, const float* ps) {
  constexpr bool kInt4 = std::is_same_v<KT, int4x2>;
  for (int64_t i = pf_i0; i < pf_i1; ++i) {  // the stream position kPrefetchAhead bytes ahead
    prefetch_l2(rows[i] + kt_element<KT>(pf_pos));
    if (sizeof(KT) == 4) prefetch_l2(rows[i] + pf_pos + 16);
  }
  const M m0 = TAIL ? tail_mask(n) : (M)0xFFFF, m1 = TAIL ? tail_mask(std::max<int64_t>(0, n - 16)) : (M)0xFFFF;
  // An int4 block's accumulators hold its even positions, then its odd ones (not position order):
  // partial sums between row groups go to E and back whole (E has the block's 32 slots)
  const M pm0 = kInt4 ? (M)0xFFFF : m0, pm1 = kInt4 ? (M)0xFFFF : m1;
  V acc0[G], acc1[G];
  for (int h = 0; h < G; ++h) {
    if (first) {
      acc0[h] = acc1[h] = vzero();
    } else if (TAIL) {
      acc0[h] = load(E + h * ldE, pm0);
      acc1[h] = load(E + h * ldE + 16, pm1);
    } else {
      acc0[h] = load(E + h * ldE);
      acc1[h] = load(E + h * ldE + 16);
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    V k0, k1;
    load_block<KT, TAIL>(rows[i], p, n, m0, m1, &k0, &k1);
    const float* qi = qhat + i * qstride;
#pragma GCC unroll 8
    for (int h = 0; h < G; ++h) {
      const V qv = vset(qi[h]);
      acc0[h] = vfma(qv, k0, acc0[h]);
      acc1[h] = vfma(qv, k1, acc1[h]);
    }
  }
  if (last) {
    if constexpr (kInt4)  // sums of even and odd positions -> position order
      for (int h = 0; h < G; ++h) interleave(V(acc0[h]), V(acc1[h]), &acc0[h], &acc1[h]);
    finish_block<G, TAIL>(acc0, acc1, m0, m1, E, ldE, st, mb, ldmb, ps);
  } else {
    for (int h = 0; h < G; ++h) {
      store(E + h * ldE, acc0[h], pm0);
      store(E + h * ldE + 16, acc1[h], pm1);
    }
  }
}

// The fp32 scales of the block of n <= kBlock positions at p: the stored ones, or bf16 ones widened
// into buf (32 conversions per block against r rows of 32 FMAs; nullptr: no scales).
static SPARQ_INLINE const float* block_scales(PosScales ps, int64_t p, int64_t n, float* buf) {
  if (ps.f32) return ps.f32 + p;
  if (!ps.b16) return nullptr;
  store(buf, load(ps.b16 + p, tail_mask(n)));
  store(buf + 16, load(ps.b16 + p + 16, tail_mask(std::max<int64_t>(0, n - 16))));
  return buf;
}

// Pass A over one segment [p0, p1) of at most kSegment positions, rows in groups of at most
// kRowGroup: a group's rows are streamed over the whole segment before the next group's. Fewer
// concurrent streams than r (32 for Llama) keep DRAM efficient (docs/NOTES.md).
#ifndef SPARQ_SEGMENT
#define SPARQ_SEGMENT 4096
#endif
#ifndef SPARQ_ROW_GROUP
#define SPARQ_ROW_GROUP 8
#endif
constexpr int64_t kSegment = SPARQ_SEGMENT;
constexpr int64_t kRowGroup = SPARQ_ROW_GROUP;

template <typename KT>
constexpr int64_t kPrefetchPositions = std::is_same_v<KT, int3x32> ? kPrefetchAhead * kInt3Block / kInt3BlockBytes
                                                                   : kPrefetchAhead * kPerElement<KT> / (int64_t)sizeof(KT);
static inline int64_t row_groups(int64_t r) { return (r + kRowGroup - 1) / kRowGroup; }
// Row group gi of row_groups(r): rows [*i0, *i1), the r rows shared out as evenly as the division allows.
static inline void row_group(int64_t r, int64_t gi, int64_t* i0, int64_t* i1) {
  const int64_t ng = row_groups(r);
  *i0 = r * gi / ng;
  *i1 = r * (gi + 1) / ng;
}

// The first row group's first kPrefetchAhead bytes (at most to p1), asked for before a chunk's pass A starts:
// pass_a_2k's prefetches run kPrefetchAhead bytes ahead of its reads (into the next row group near a segment's
// end), so without this those first bytes of the chunk's first group would be read cold.
template <typename KT>
static void prefetch_first_group(const KT* const* rows, int64_t r, int64_t p0, int64_t p1) {
  int64_t i0, i1;
  row_group(r, 0, &i0, &i1);
  const int64_t bytes = (kt_element<KT>(std::min(p1, p0 + kPrefetchPositions<KT>)) - kt_element<KT>(p0)) *
                        (int64_t)sizeof(KT);
  for (int64_t i = i0; i < i1; ++i) {
    const char* row = reinterpret_cast<const char*>(rows[i] + kt_element<KT>(p0));
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(row + o);
  }
}

// A segment's per-position scales, asked for at its start: pass A reads them with the last row group only, a
// stream too sparse for the hardware prefetcher to follow (at B = 16 and 4096 positions, 8% of pass A's time
// waited on them).
static inline void prefetch_scales(PosScales ps, int64_t p0, int64_t p1) {
  const char* at = ps.f32 ? reinterpret_cast<const char*>(ps.f32 + p0) : reinterpret_cast<const char*>(ps.b16 + p0);
  const int64_t bytes = ps.f32 ? (p1 - p0) * 4 : ps.b16 ? (p1 - p0) * 2 : 0;
  for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(at + o);
}

template <int G, typename KT>
static void pass_a_2k(const KT* const* rows, int64_t r, const float* qhat, int64_t qstride, int64_t p0, int64_t p1,
                      int64_t pf_end, float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb, PosScales ps) {
  alignas(64) float widened[kBlock];  // a block's bf16 scales as fp32 (block_scales)
  constexpr int64_t PF = kPrefetchPositions<KT>;  // positions
  const int64_t ng = row_groups(r);
  for (int64_t gi = 0; gi < ng; ++gi) {
    int64_t i0, i1;
    row_group(r, gi, &i0, &i1);
    const bool first = gi == 0, last = gi == ng - 1;
    int64_t p = p0;
    for (; p + kBlock <= p1; p += kBlock) {
      // prefetch target PF positions ahead in streaming order: this group further on, else the
      // next group from the segment start, else (last group) the first group in the next segment
      int64_t t = p + PF, q0 = i0, q1 = i1;
      if (t + kBlock > p1) {
        if (!last) {
          row_group(r, gi + 1, &q0, &q1);
          t = p0 + (t - p1);
        } else {
          row_group(r, 0, &q0, &q1);
          if (t + kBlock > pf_end) q1 = q0;  // past the chunk: nothing to prefetch
        }
      }
      block_2k<G, KT, false>(rows, i0, i1, qhat, qstride, p, kBlock, first, last, q0, q1, t, E + (p - p0), ldE, st,
                             mb + (p - p0) / kBlock, ldmb, last ? block_scales(ps, p, kBlock, widened) : nullptr);
    }
    if (p < p1)
      block_2k<G, KT, true>(rows, i0, i1, qhat, qstride, p, p1 - p, first, last, 0, 0, 0, E + (p - p0), ldE, st,
                            mb + (p - p0) / kBlock, ldmb, last ? block_scales(ps, p, p1 - p, widened) : nullptr);
  }
}

// Pass A without K^T (the 1xK layout): every live K row is read whole (its r columns are spread
// over its cache lines anyway) and dotted with q masked to i1 (zeros elsewhere, 1/tau folded in),
// so each row costs d/16 FMAs and a horizontal sum per head instead of r gathers.
template <int G, typename KT>
static void pass_a_1k(const KT* kbh, int64_t stride, const float* qmask, int64_t d, int64_t p0, int64_t p1,
                      float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb, const float* ps) {
  const int64_t nfull = d / 16, rem = d % 16;
  const M mrem = tail_mask(rem);
  alignas(64) float lt[G][kBlock];
  for (int64_t p = p0; p < p1; p += kBlock) {
    const int64_t n = std::min(kBlock, p1 - p);
    for (int64_t s = 0; s < n; ++s) {
      const KT* row = kbh + (p + s) * stride;
      if (s + 4 < n) prefetch(row + 4 * stride);
      V acc[G];
      for (int h = 0; h < G; ++h) acc[h] = vzero();
      for (int64_t c = 0; c < nfull; ++c) {
        const V kv = load(row + 16 * c);
#pragma GCC unroll 8
        for (int h = 0; h < G; ++h) acc[h] = vfma(load(qmask + h * d + 16 * c), kv, acc[h]);
      }
      if (rem) {
        const V kv = load(row + 16 * nfull, mrem);
        for (int h = 0; h < G; ++h) acc[h] = vfma(load(qmask + h * d + 16 * nfull, mrem), kv, acc[h]);
      }
      const float sc = ps ? ps[p + s] : 1.0f;  // an int8 K's per-position scale
      for (int h = 0; h < G; ++h) lt[h][s] = hsum(acc[h]) * sc;
    }
    V acc0[G], acc1[G];
    const M m0 = tail_mask(n), m1 = tail_mask(std::max<int64_t>(0, n - 16));
    for (int h = 0; h < G; ++h) {
      acc0[h] = load(lt[h], m0);
      acc1[h] = load(lt[h] + 16, m1);
    }
    if (n < kBlock) finish_block<G, true>(acc0, acc1, m0, m1, E + (p - p0), ldE, st, mb + (p - p0) / kBlock, ldmb, nullptr);
    else finish_block<G, false>(acc0, acc1, m0, m1, E + (p - p0), ldE, st, mb + (p - p0) / kBlock, ldmb, nullptr);
  }
}

// r: the rows of K^T streamed (P.r in SparQ; a head's own count in adaptive SparQ). KTT: K^T's element
// type (int8_t, int4x2 or int3x32 for a quantized K^T); ps: the bh's per-position scales of a quantized step-1
// source (its K^T's, fp32 or bf16, or an int8 K's fp32 ones with layout "once"), none for a float one.
template <typename KT, typename KTT = KT>
static void pass_a(const Problem& P, int64_t r, const KTT* const* rows, const KT* kbh, const float* qmask,
                   const float* qhat, int64_t p0, int64_t p1, float* E, int64_t ldE, RunState* st, float* mb,
                   int64_t ldmb, PosScales ps = {}) {
  // segment by segment; within one, head groups after the first re-read the rows from L2
  if (P.two_k) prefetch_first_group(rows, r, p0, p1);
  for (int64_t a = p0; a < p1; a += kSegment) {
    const int64_t b = std::min(p1, a + kSegment);
    prefetch_scales(ps, a, b);
    for (int64_t h0 = 0; h0 < P.g; h0 += 8) {
      const int64_t G = std::min<int64_t>(8, P.g - h0);
      const float* qh = qhat + h0;
      float* Eh = E + h0 * ldE + (a - p0);
      float* mbh = mb + h0 * ldmb + (a - p0) / kBlock;
      RunState* sh = st + h0;
#define SPARQ_CASE(n)                                                                              \
  case n:                                                                                          \
    if (P.two_k) pass_a_2k<n, KTT>(rows, r, qh, P.g, a, b, p1, Eh, ldE, sh, mbh, ldmb, ps);        \
    else pass_a_1k<n, KT>(kbh, P.ks2, qmask + h0 * P.d, P.d, a, b, Eh, ldE, sh, mbh, ldmb, ps.f32);\
    break;
      switch (G) {
        SPARQ_CASE(1) SPARQ_CASE(2) SPARQ_CASE(3) SPARQ_CASE(4)
        SPARQ_CASE(5) SPARQ_CASE(6) SPARQ_CASE(7) SPARQ_CASE(8)
      }
#undef SPARQ_CASE
    }
  }
}

// corr[blk] = exp(mb[blk] - m) / Z in place, for n blocks.
static void block_weights(float* mb, int64_t n, float m, float Z) {
  const V vm = vset(m), inv = vset(1.0f / Z);
  for (int64_t b = 0; b < n; b += 16) {
    const M mk = tail_mask(n - b);
    store(mb + b, vmul(vexp(vsub(load(mb + b, mk), vm)), inv), mk);
  }
}

// A chunk's block weights for head hh: the head's softmax (max, sum) over its bh's nc chunks, from
// each chunk's stat (stat_of(u): max at [hh], sum at [g + hh]; a chunk with sum 0 saw no live
// position), then block_weights over the chunk's n blocks.
template <class StatOf>
static void chunk_block_weights(StatOf stat_of, int64_t u0, int64_t nc, int64_t g, int64_t hh, float* mb, int64_t n) {
  float m = kNegInf, Z = 0.f;
  for (int64_t c = 0; c < nc; ++c) m = std::max(m, stat_of(u0 + c)[hh]);
  for (int64_t c = 0; c < nc; ++c) {
    const float* s = stat_of(u0 + c);
    if (s[g + hh] > 0.f) Z += s[g + hh] * std::exp(s[hh] - m);
  }
  block_weights(mb, n, m, Z);
}

}  // namespace
}  // namespace sparq_cpu
