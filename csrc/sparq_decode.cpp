// Fused SparQ decode attention for CPU (Ribar et al., ICML 2024), one query token per row.
// (The dense baseline is dense_decode.cpp, the decode GEMV linear.cpp; shared pieces in the .h files.)
//
// Registered as the CPU kernel of sparq::decode_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   decode_cpu(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length,
//              int r, int k_top, int local, bool mean_v, Tensor? lengths=None) -> Tensor
// lengths: None (every row's live length is `length`) or (B,) int: row b's S is lengths[b] (ragged
// batches: the row reads, selects and averages over its own positions only).
// decode_cpu computes what sparq.sparq_reference computes, in fp32:
//   i1 = top-r of |q| summed over the g query heads of a KV head;
//   s_hat_h = softmax_s(q_h[i1] . K[s, i1] / tau_h), tau_h = sqrt(d |q_h[i1]|_1 / |q_h|_1);
//   i2 = the last min(local, S) positions + the top of sum_h s_hat_h over the others
//        (min(k_top, S) positions in all; ties go to the lower position);
//   y_h = softmax(q_h . K[i2] / sqrt(d)) @ V[i2];  mean-V: y = alpha y + (1 - alpha) v_sum / S,
//        alpha_h = sum_{i2} s_hat_h.
//
// Work per (batch row, KV head) -- "bh" -- split over S into chunks when there are too few bh
// for the threads (B = 1 with 3 KV heads on 2 cores):
//   A. stream the r rows i1 of K^T (S-contiguous) once for all g heads (without k_t: read whole
//      K rows, dotted with q masked to i1), in groups of <= 8 rows over 4096-position segments, software-prefetched
//      into L2; the exp of the softmax is fused in (lazy running max, see finish_block), so the
//      buffer holds e = exp(l - m_block) and each 32-position block's m_block;
//   B. combine maxima and sums (over chunks) into per-block weights exp(m_block - m) / Z;
//   C. score positions sum_h s_hat_h, keep those reaching a threshold that at least k positions
//      reach (the k-th largest 32-block maximum), and pick the top k among the few survivors by
//      a binary search on the score: no sort, no heap;
//   D. prefetch the selected rows of K and V in one burst, gather them directly from the cache
//      and attend exactly; mean-V.
// Positions >= S and batch rows >= B are never loaded (tails use masked loads).
// Buffers are reused across calls (one workspace that only grows, on huge pages).
// Threads: torch's OpenMP team, sized by torch.get_num_threads(), claiming units dynamically.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "attend.h"
#include "parallel.h"
#include "simd.h"
#include "workspace.h"

namespace sparq_cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Problem description
// ---------------------------------------------------------------------------------------------

struct Problem {
  int64_t B, H, g, d, S, r, k_top, local, kk, m;  // S, kk, m: the longest row's (buffer sizes)
  bool mean_v, two_k;
  // strides (elements); the last dim of k, v, k_t, v_sum is contiguous
  int64_t qs0, qs1, qs2, qs3;
  int64_t ks0, ks1, ks2;
  int64_t kts0, kts1, kts2;
  int64_t vs0, vs1, vs2;
  int64_t vss0, vss1;
  const float* vsum;
  // ragged rows and chunking over S
  const int64_t* len;            // (B,) live length of each row
  int64_t cs;                    // chunk length (multiple of 64)
  std::vector<int64_t> unit0;    // (B * H + 1,) first unit of each bh: bh owns ceil(len / cs) chunks
  std::vector<int32_t> unit_bh;  // the bh of each unit
  int64_t units() const { return unit0.back(); }
  int64_t chunks(int64_t bh) const { return unit0[bh + 1] - unit0[bh]; }
};

// The lengths of one row: S live positions, the last n_local forced in, m more chosen among the
// n_scored = S - n_local others (kk = n_local + m = min(k_top, S) in all).
struct Row {
  int64_t S, n_local, m, n_scored;
};
static inline Row row_of(const Problem& P, int64_t b) {
  Row w;
  w.S = P.len[b];
  w.n_local = std::min(P.local, w.S);
  w.m = std::min(P.k_top, w.S) - w.n_local;
  w.n_scored = w.S - w.n_local;
  return w;
}

// ---------------------------------------------------------------------------------------------
// Top-k without sorting: i1 (prepare), the positions of pass C, and the merge of chunk candidates.
// ---------------------------------------------------------------------------------------------

// The best `cap` of n candidates (scores ss, positions si, positions ascending; higher score
// first, then the lower position), compacted in place in ascending position order. Binary search on the score (non-negative floats
// order like their bit patterns) with vectorised counting, then one filtering pass: no sort.
static inline int64_t count_ge(const float* ss, int64_t n, float t) {
  const V vt = vset(t);
  int64_t c = 0;
  for (int64_t o = 0; o < n; o += 16) {
    const M mk = tail_mask(n - o);
    c += __builtin_popcount((unsigned)(cmp_ge(load(ss + o, mk), vt) & mk));
  }
  return c;
}
static inline uint32_t float_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float bits_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

static int64_t select_from(float* ss, int32_t* si, int64_t n, int64_t cap) {
  if (n <= cap) return n;
  V vmn = vset(std::numeric_limits<float>::infinity()), vmx = vzero();
  for (int64_t j = 0; j < n; j += 16) {
    const M mk = tail_mask(n - j);
    const V x = load(ss + j, mk);
    vmx = vmax_masked(vmx, mk, x);
    vmn = vmin_masked(vmn, mk, x);
  }
  // invariant: count(>= lo) >= cap > count(>= hi)
  uint32_t lo = float_bits(std::max(hmin(vmn), 0.f)), hi = float_bits(hmax(vmx)) + 1;
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (count_ge(ss, n, bits_float(mid)) >= cap) lo = mid; else hi = mid;
  }
  const float t = bits_float(lo);
  int64_t ties = cap - count_ge(ss, n, bits_float(lo + 1));  // all above t, then the first ties at t
  const V vt = vset(t);
  int64_t k = 0;
  for (int64_t j = 0; j < n; j += 16) {  // in-place compaction: writes stay at or behind the reads
    const M mk = tail_mask(n - j);
    const V x = load(ss + j, mk);
    const Lanes ids = load_ids(si + j, mk);
    const M gt = cmp_gt(x, vt) & mk;
    M eq = cmp_eq(x, vt) & mk;
    if (eq) {
      if (__builtin_popcount((unsigned)eq) > ties) {
        M keep = 0;
        for (int64_t c = 0; c < ties; ++c) { keep |= eq & (M)(-(int32_t)eq); eq &= eq - 1; }
        eq = keep;
      }
      ties -= __builtin_popcount((unsigned)eq);
    }
    k += compress_store(ss + k, si + k, (M)(gt | eq), x, ids);
  }
  return k;
}

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
}

// ---------------------------------------------------------------------------------------------
// Pass A, fused with the exp of the softmax: for 32-position blocks of [p0, p1) and a group of G
// heads, logits l = q_hat . K^T[i1, p], then e = exp(l - m_run) stored in E, with m_run the running
// max (raised lazily: only when a block exceeds it, rescaling the running sum Z). mb[blk] records
// the m_run each block used, so the true s_hat = e * exp(mb[blk] - m) / Z once the final max m and
// sum Z (over all chunks) are known. One pass over K^T, the exps overlap with the memory stream.
// ---------------------------------------------------------------------------------------------

constexpr int64_t kBlock = 32;            // positions per block (two vectors)
#ifndef SPARQ_PF_BYTES
#define SPARQ_PF_BYTES 2048
#endif
constexpr int64_t kPrefetchAhead = SPARQ_PF_BYTES;  // bytes ahead in each of the r streams

struct RunState {  // per head of a chunk: running max, running sum (16 lanes)
  alignas(64) float z[16];
  float m;
};

#define SPARQ_INLINE inline __attribute__((always_inline))

template <int G, bool TAIL>
static SPARQ_INLINE void finish_block(V* acc0, V* acc1, M m0, M m1, float* E, int64_t ldE, RunState* st, float* mb,
                                int64_t ldmb) {
  for (int h = 0; h < G; ++h) {
    V a0 = acc0[h], a1 = acc1[h];
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
template <int G, typename KT, bool TAIL>
static SPARQ_INLINE void block_2k(const KT* const* rows, int64_t i0, int64_t i1, const float* qhat, int64_t qstride,
                            int64_t p, int64_t n, bool first, bool last, int64_t pf_i0, int64_t pf_i1, int64_t pf_pos,
                            float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb) {
  for (int64_t i = pf_i0; i < pf_i1; ++i) {  // the stream position kPrefetchAhead bytes ahead
    prefetch_l2(rows[i] + pf_pos);
    if (sizeof(KT) == 4) prefetch_l2(rows[i] + pf_pos + 16);
  }
  const M m0 = TAIL ? tail_mask(n) : (M)0xFFFF, m1 = TAIL ? tail_mask(std::max<int64_t>(0, n - 16)) : (M)0xFFFF;
  V acc0[G], acc1[G];
  for (int h = 0; h < G; ++h) {
    if (first) {
      acc0[h] = acc1[h] = vzero();
    } else if (TAIL) {
      acc0[h] = load(E + h * ldE, m0);
      acc1[h] = load(E + h * ldE + 16, m1);
    } else {
      acc0[h] = load(E + h * ldE);
      acc1[h] = load(E + h * ldE + 16);
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    const KT* row = rows[i] + p;
    V k0, k1;
    if (TAIL) {
      k0 = load(row, m0);
      k1 = load(row + 16, m1);
    } else {
      k0 = load(row);
      k1 = load(row + 16);
    }
    const float* qi = qhat + i * qstride;
#pragma GCC unroll 8
    for (int h = 0; h < G; ++h) {
      const V qv = vset(qi[h]);
      acc0[h] = vfma(qv, k0, acc0[h]);
      acc1[h] = vfma(qv, k1, acc1[h]);
    }
  }
  if (last) {
    finish_block<G, TAIL>(acc0, acc1, m0, m1, E, ldE, st, mb, ldmb);
  } else {
    for (int h = 0; h < G; ++h) {
      store(E + h * ldE, acc0[h], m0);
      store(E + h * ldE + 16, acc1[h], m1);
    }
  }
}

// Pass A over one segment [p0, p1) of at most kSegment positions, rows in groups of at most
// kRowGroup: a group's rows are streamed over the whole segment before the next group's. Fewer
// concurrent streams than r (32 for Llama) keep DRAM efficient: measured on this machine, 32
// interleaved streams ran at ~14 GB/s on one core, groups of 8 over 2048 positions at ~21 GB/s
// (2 cores: 17.5 vs 41 GB/s).
#ifndef SPARQ_SEGMENT
#define SPARQ_SEGMENT 4096
#endif
#ifndef SPARQ_ROW_GROUP
#define SPARQ_ROW_GROUP 8
#endif
constexpr int64_t kSegment = SPARQ_SEGMENT;
constexpr int64_t kRowGroup = SPARQ_ROW_GROUP;

template <int G, typename KT>
static void pass_a_2k(const KT* const* rows, int64_t r, const float* qhat, int64_t qstride, int64_t p0, int64_t p1,
                      int64_t pf_end, float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb) {
  constexpr int64_t PF = kPrefetchAhead / (int64_t)sizeof(KT);
  const int64_t ng = (r + kRowGroup - 1) / kRowGroup;
  auto group = [&](int64_t gi, int64_t* i0, int64_t* i1) { *i0 = r * gi / ng; *i1 = r * (gi + 1) / ng; };
  for (int64_t gi = 0; gi < ng; ++gi) {
    int64_t i0, i1;
    group(gi, &i0, &i1);
    const bool first = gi == 0, last = gi == ng - 1;
    int64_t p = p0;
    for (; p + kBlock <= p1; p += kBlock) {
      // prefetch target PF positions ahead in streaming order: this group further on, else the
      // next group from the segment start, else (last group) the first group in the next segment
      int64_t t = p + PF, q0 = i0, q1 = i1;
      if (t + kBlock > p1) {
        if (!last) {
          group(gi + 1, &q0, &q1);
          t = p0 + (t - p1);
        } else {
          group(0, &q0, &q1);
          if (t + kBlock > pf_end) q1 = q0;  // past the chunk: nothing to prefetch
        }
      }
      block_2k<G, KT, false>(rows, i0, i1, qhat, qstride, p, kBlock, first, last, q0, q1, t, E + (p - p0), ldE, st,
                             mb + (p - p0) / kBlock, ldmb);
    }
    if (p < p1)
      block_2k<G, KT, true>(rows, i0, i1, qhat, qstride, p, p1 - p, first, last, 0, 0, 0, E + (p - p0), ldE, st,
                            mb + (p - p0) / kBlock, ldmb);
  }
}

// Pass A without K^T (the 1xK layout): every live K row is read whole (its r columns are spread
// over its cache lines anyway) and dotted with q masked to i1 (zeros elsewhere, 1/tau folded in),
// so each row costs d/16 FMAs and a horizontal sum per head instead of r gathers.
template <int G, typename KT>
static void pass_a_1k(const KT* kbh, int64_t stride, const float* qmask, int64_t d, int64_t p0, int64_t p1,
                      float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb) {
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
      for (int h = 0; h < G; ++h) lt[h][s] = hsum(acc[h]);
    }
    V acc0[G], acc1[G];
    const M m0 = tail_mask(n), m1 = tail_mask(std::max<int64_t>(0, n - 16));
    for (int h = 0; h < G; ++h) {
      acc0[h] = load(lt[h], m0);
      acc1[h] = load(lt[h] + 16, m1);
    }
    if (n < kBlock) finish_block<G, true>(acc0, acc1, m0, m1, E + (p - p0), ldE, st, mb + (p - p0) / kBlock, ldmb);
    else finish_block<G, false>(acc0, acc1, m0, m1, E + (p - p0), ldE, st, mb + (p - p0) / kBlock, ldmb);
  }
}

template <typename KT>
static void pass_a(const Problem& P, const KT* const* rows, const KT* kbh, const float* qmask, const float* qhat,
                   int64_t p0, int64_t p1, float* E, int64_t ldE, RunState* st, float* mb, int64_t ldmb) {
  // segment by segment; within one, head groups after the first re-read the rows from L2
  for (int64_t a = p0; a < p1; a += kSegment) {
    const int64_t b = std::min(p1, a + kSegment);
    for (int64_t h0 = 0; h0 < P.g; h0 += 8) {
      const int64_t G = std::min<int64_t>(8, P.g - h0);
      const float* qh = qhat + h0;
      float* Eh = E + h0 * ldE + (a - p0);
      float* mbh = mb + h0 * ldmb + (a - p0) / kBlock;
      RunState* sh = st + h0;
#define SPARQ_CASE(n)                                                                              \
  case n:                                                                                          \
    if (P.two_k) pass_a_2k<n, KT>(rows, P.r, qh, P.g, a, b, p1, Eh, ldE, sh, mbh, ldmb);           \
    else pass_a_1k<n, KT>(kbh, P.ks2, qmask + h0 * P.d, P.d, a, b, Eh, ldE, sh, mbh, ldmb);        \
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

// ---------------------------------------------------------------------------------------------
// Pass C: scores and the top-k selection without sorting the row (a threshold, then select_from).
// ---------------------------------------------------------------------------------------------

// The k-th largest of n >= k non-negative floats (binary search on the bits, vectorised counts).
static float kth_largest(const float* x, int64_t n, int64_t k) {
  V vmx = vzero();
  for (int64_t j = 0; j < n; j += 16) vmx = vmax_masked(vmx, tail_mask(n - j), load(x + j, tail_mask(n - j)));
  uint32_t lo = 0, hi = float_bits(hmax(vmx)) + 1;  // count(>= lo) >= k > count(>= hi)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (count_ge(x, n, bits_float(mid)) >= k) lo = mid; else hi = mid;
  }
  return bits_float(lo);
}

// Scores sum_h s_hat_h over positions [p0, hi) of a chunk starting at p0, and their best `cap`
// (ascending positions in ss/si): a threshold that at least `cap` positions reach keeps every
// member of the top `cap`; select_from then picks them among the few survivors.
static int64_t select_top(const float* E, int64_t ldE, const float* corr, int64_t ldc, int64_t g, int64_t p0,
                          int64_t hi, int64_t cap, float* sc, float* bmax, float* ss, int32_t* si) {
  const int64_t n = hi - p0;
  if (n <= 0 || cap <= 0) return 0;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  for (int64_t blk = 0; blk < nb; ++blk) {  // scores, and the max of each 32-position block
    const int64_t o = blk * kBlock;
    const M m0 = tail_mask(n - o), m1 = tail_mask(std::max<int64_t>(0, n - o - 16));
    V s0 = vzero(), s1 = vzero();
    for (int64_t h = 0; h < g; ++h) {
      const V c = vset(corr[h * ldc + blk]);
      const float* e = E + h * ldE + o;
      s0 = vfma(c, load(e, m0), s0);
      s1 = vfma(c, load(e + 16, m1), s1);
    }
    store(sc + o, s0, m0);
    store(sc + o + 16, s1, m1);
    bmax[blk] = hmax(vmax(vselect(m0, s0, vset(kNegInf)), vselect(m1, s1, vset(kNegInf))));
  }
  if (n <= cap) {
    for (int64_t o = 0; o < n; o += 16)
      compress_store(ss + o, si + o, tail_mask(n - o), load(sc + o, tail_mask(n - o)), lane_ids((int32_t)(p0 + o)));
    return n;
  }
  // threshold t0 that at least `cap` positions reach, so the top `cap` all survive it:
  float t0 = std::numeric_limits<float>::infinity();
  if (nb >= cap) {  // the cap-th largest block maximum (cap blocks hold a position >= it)
    t0 = kth_largest(bmax, nb, cap);
  } else {  // the minimum over `cap` disjoint groups of each group's maximum
    const int64_t bl = n / cap;
    for (int64_t j = 0; j < cap; ++j) {
      const int64_t a = j * bl, b = j == cap - 1 ? n : a + bl;
      V mx = vset(kNegInf);
      for (int64_t o = a; o < b; o += 16) mx = vmax_masked(mx, tail_mask(b - o), load(sc + o, tail_mask(b - o)));
      t0 = std::min(t0, hmax(mx));
    }
  }
  const V vt = vset(t0);
  int64_t cnt = 0;
  for (int64_t blk = 0; blk < nb; ++blk) {  // branchless: survivors are data-dependent and scattered
    if (!(bmax[blk] >= t0)) continue;       // none in this block
    for (int64_t o = blk * kBlock; o < std::min(n, (blk + 1) * kBlock); o += 16) {
      const M mk = tail_mask(n - o);
      const V x = load(sc + o, mk);
      cnt += compress_store(ss + cnt, si + cnt, cmp_ge(x, vt) & mk, x, lane_ids((int32_t)(p0 + o)));
    }
  }
  return select_from(ss, si, cnt, cap);
}

// ---------------------------------------------------------------------------------------------
// Step 2-3: exact attention over the selected positions, mean-V, output.
// ---------------------------------------------------------------------------------------------

template <typename KT>
static inline void prefetch_row_l2(const KT* row, int64_t d) {
  const char* c = reinterpret_cast<const char*>(row);
  const int64_t bytes = d * (int64_t)sizeof(KT);
  for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(c + o);
  if ((reinterpret_cast<uintptr_t>(c) + bytes - 1) / 64 != (reinterpret_cast<uintptr_t>(c) + (bytes - 1) / 64 * 64) / 64)
    prefetch_l2(c + bytes - 1);  // a row straddling one more line
}

// Ask for every selected row of K and V at once (into L2): many independent misses in flight.
template <typename KT>
static void prefetch_rows(const Problem& P, const KT* k, const KT* v, int64_t b, int64_t h, const int32_t* pos,
                          int64_t kk) {
  const KT* kb = k + b * P.ks0 + h * P.ks1;
  const KT* vb = v + b * P.vs0 + h * P.vs1;
  for (int64_t j = 0; j < kk; ++j) prefetch_row_l2(kb + (int64_t)pos[j] * P.ks2, P.d);
  for (int64_t j = 0; j < kk; ++j) prefetch_row_l2(vb + (int64_t)pos[j] * P.vs2, P.d);
}

// Register-blocked pieces of the exact attention for d = 16 * NV.
template <int NV, typename KT>
static void dots_nv(const float* qf, int64_t g, const KT* kb, int64_t ks, const int32_t* pos, int64_t kk,
                    float scale, float* lg) {
  constexpr int64_t d = 16 * NV;
  for (int64_t hh = 0; hh < g; ++hh) {
    V qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = load(qf + hh * d + 16 * c);
    int64_t j = 0;
    for (; j + 4 <= kk; j += 4) {  // four rows at once: independent FMA chains
      const KT* r0 = kb + (int64_t)pos[j] * ks;
      const KT* r1 = kb + (int64_t)pos[j + 1] * ks;
      const KT* r2 = kb + (int64_t)pos[j + 2] * ks;
      const KT* r3 = kb + (int64_t)pos[j + 3] * ks;
      V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        a0 = vfma(qv[c], load(r0 + 16 * c), a0);
        a1 = vfma(qv[c], load(r1 + 16 * c), a1);
        a2 = vfma(qv[c], load(r2 + 16 * c), a2);
        a3 = vfma(qv[c], load(r3 + 16 * c), a3);
      }
      float* l = lg + hh * kk + j;
      l[0] = hsum(a0) * scale;
      l[1] = hsum(a1) * scale;
      l[2] = hsum(a2) * scale;
      l[3] = hsum(a3) * scale;
    }
    for (; j < kk; ++j) {
      const KT* r0 = kb + (int64_t)pos[j] * ks;
      V a0 = vzero();
      for (int c = 0; c < NV; ++c) a0 = vfma(qv[c], load(r0 + 16 * c), a0);
      lg[hh * kk + j] = hsum(a0) * scale;
    }
  }
}

template <int NV, typename KT>
static void pv_nv(const float* lg, int64_t g, const KT* vb, int64_t vs, const int32_t* pos, int64_t kk, float* y) {
  constexpr int64_t d = 16 * NV;
  for (int64_t hh = 0; hh < g; ++hh) {
    V acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = vzero();
    const float* p = lg + hh * kk;
    for (int64_t j = 0; j < kk; ++j) {
      const KT* row = vb + (int64_t)pos[j] * vs;
      const V pj = vset(p[j]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) acc[c] = vfma(pj, load(row + 16 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) store(y + hh * d + 16 * c, acc[c]);
  }
}

template <typename KT, typename QT>
static void attend(const Problem& P, const KT* k, const KT* v, int64_t b, int64_t h, const float* qf,
                   const int32_t* pos, int64_t kk, const float* alpha, float* lg, float* y, QT* out) {
  const int64_t g = P.g, d = P.d;
  const KT* kb = k + b * P.ks0 + h * P.ks1;
  const KT* vb = v + b * P.vs0 + h * P.vs1;
  const float scale = 1.0f / std::sqrt((float)d);
  const int64_t nfull = d / 16, rem = d % 16;
  bool blocked = rem == 0;
#define SPARQ_NV_CASES(X) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(16)
  if (blocked) {
    switch (nfull) {
#define SPARQ_DOTS(n) case n: dots_nv<n, KT>(qf, g, kb, P.ks2, pos, kk, scale, lg); break;
      SPARQ_NV_CASES(SPARQ_DOTS)
#undef SPARQ_DOTS
      default: blocked = false;
    }
  }
  // logits: g x kk
  for (int64_t j = 0; j < kk && !blocked; ++j) {
    const KT* row = kb + (int64_t)pos[j] * P.ks2;
    for (int64_t hh = 0; hh < g; ++hh) lg[hh * kk + j] = dot_d(qf + hh * d, row, d) * scale;
  }
  // softmax per head
  for (int64_t hh = 0; hh < g; ++hh) {
    float* l = lg + hh * kk;
    const V inv = vset(1.0f / exp_shifted(l, kk).second);
    for (int64_t j = 0; j < kk; j += 16) store(l + j, vmul(load(l + j, tail_mask(kk - j)), inv), tail_mask(kk - j));
  }
  // y = p @ V
  if (blocked) {
    switch (nfull) {
#define SPARQ_PV(n) case n: pv_nv<n, KT>(lg, g, vb, P.vs2, pos, kk, y); break;
      SPARQ_NV_CASES(SPARQ_PV)
#undef SPARQ_PV
    }
  } else {
    std::fill(y, y + g * d, 0.f);
  }
  for (int64_t j = 0; j < kk && !blocked; ++j) add_weighted_row(lg + j, kk, g, vb + (int64_t)pos[j] * P.vs2, d, y);
#undef SPARQ_NV_CASES
  QT* o = out + (b * P.H + h) * g * d;
  if (alpha) {
    const float* vs = P.vsum + b * P.vss0 + h * P.vss1;
    const float inv_s = 1.0f / (float)P.len[b];
    for (int64_t hh = 0; hh < g; ++hh) {
      const float a = alpha[hh];
      for (int64_t j = 0; j < d; ++j) o[hh * d + j] = from_f<QT>(a * y[hh * d + j] + (1.0f - a) * (vs[j] * inv_s));
    }
  } else {
    for (int64_t j = 0; j < g * d; ++j) o[j] = from_f<QT>(y[j]);
  }
}

// Offsets (floats, 64-byte aligned) of the per-thread scratch.
struct Scratch {
  int64_t qf, order, i1, qhat, rows, qmask, st, sc, bmax, ss, si, pos, lg, y, alpha, E, mb, total;
};
static Scratch scratch_layout(const Problem& P, int64_t len, bool own_logits) {
  Scratch s{};
  int64_t o = 0;
  auto take = [&o](int64_t n) { int64_t at = o; o += round_up(std::max<int64_t>(n, 1), 16); return at; };
  const int64_t g = P.g, m = std::max<int64_t>(P.m, 1);
  s.qf = take(g * P.d + P.d + 16);
  s.order = take(P.d + 16);
  s.i1 = take(P.d);
  s.qhat = take(P.r * g);
  s.rows = take(P.r * 2);
  s.qmask = take(P.two_k ? 0 : g * P.d + 16);
  s.st = take(g * (int64_t)(sizeof(RunState) / sizeof(float)));
  s.sc = take(len);
  s.bmax = take(len / kBlock + 1);
  const int64_t most_chunks = (P.S + P.cs - 1) / P.cs;  // a merge concatenates a bh's chunk candidates
  s.ss = take(std::max(len, m * most_chunks) + 16);  // + 16: compress_store slack
  s.si = take(std::max(len, m * most_chunks) + 16);
  s.pos = take(P.kk);
  s.lg = take(g * P.kk);
  s.y = take(g * P.d);
  s.alpha = take(g);
  const int64_t ld = round_up(len, kBlock);
  s.E = take(own_logits ? g * ld : 0);
  s.mb = take(own_logits ? g * (ld / kBlock) : 0);
  s.total = o;
  return s;
}

template <typename KT, typename QT>
static void run(const Problem& P, const QT* q, const KT* k, const KT* kt, const KT* v, QT* out) {
  const int64_t BH = P.B * P.H;
  const int64_t units = P.units();
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), units));  // slots
  const int64_t g = P.g;
  const bool single = units == BH;  // one unit per bh: everything in the slot's own buffers
  const int64_t len = single ? P.S : P.cs;
  const int64_t ldE = round_up(len, kBlock), nblk = ldE / kBlock;
  const Scratch L = scratch_layout(P, len, single);
  const int64_t slot_floats = round_up(L.total, 16);
  // chunked path, per unit: E (g x cs), block maxima / weights (g x cs/32), m and Z per head,
  // candidates (count, scores, positions)
  const int64_t m1 = std::max<int64_t>(P.m, 1);
  const int64_t u_E = g * ldE, u_mb = g * nblk, u_stat = round_up(2 * g, 16), u_cand = 16 + 2 * m1;
  const int64_t unit_floats = single ? 0 : round_up(u_E + u_mb + u_stat + u_cand, 16);
  Workspace& ws = workspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  float* base = ws.get(nt * slot_floats + units * unit_floats + 64);
  float* units_base = base + nt * slot_floats;
  auto uE = [&](int64_t u) { return units_base + u * unit_floats; };
  auto umb = [&](int64_t u) { return uE(u) + u_E; };
  auto ustat = [&](int64_t u) { return umb(u) + u_mb; };  // [m(g), Z(g)]
  auto ucand = [&](int64_t u) { return ustat(u) + u_stat; };

  struct Slot {
    float *qf, *qhat, *qmask, *sc, *bmax, *ss, *lg, *y, *alpha, *E, *mb;
    int32_t *order, *i1, *si, *pos;
    const KT** rows;
    RunState* st;
  };
  auto slot_of = [&](int slot) {
    float* T = base + slot * slot_floats;
    Slot x;
    x.qf = T + L.qf;
    x.order = reinterpret_cast<int32_t*>(T + L.order);
    x.i1 = reinterpret_cast<int32_t*>(T + L.i1);
    x.qhat = T + L.qhat;
    x.rows = reinterpret_cast<const KT**>(T + L.rows);
    x.qmask = T + L.qmask;
    x.st = reinterpret_cast<RunState*>(T + L.st);
    x.sc = T + L.sc;
    x.bmax = T + L.bmax;
    x.ss = T + L.ss;
    x.si = reinterpret_cast<int32_t*>(T + L.si);
    x.pos = reinterpret_cast<int32_t*>(T + L.pos);
    x.lg = T + L.lg;
    x.y = T + L.y;
    x.alpha = T + L.alpha;
    x.E = T + L.E;
    x.mb = T + L.mb;
    return x;
  };
  auto setup_bh = [&](const Slot& x, int64_t bh) -> const KT* {  // q prep + stream pointers; K base
    const int64_t b = bh / P.H, h = bh % P.H;
    prepare(P, q, b, h, x.qf, x.order, x.i1, x.qhat);
    const KT* kbh = k + b * P.ks0 + h * P.ks1;
    if (P.two_k) {
      const KT* ktbh = kt + b * P.kts0 + h * P.kts1;
      for (int64_t i = 0; i < P.r; ++i) x.rows[i] = ktbh + (int64_t)x.i1[i] * P.kts2;
    } else {  // q masked to i1, scaled by 1/tau: qhat[i][h] at column i1[i]
      std::fill(x.qmask, x.qmask + g * P.d, 0.f);
      for (int64_t i = 0; i < P.r; ++i)
        for (int64_t hh = 0; hh < g; ++hh) x.qmask[hh * P.d + x.i1[i]] = x.qhat[i * g + hh];
    }
    return kbh;
  };
  auto reset_state = [&](const Slot& x) {
    for (int64_t hh = 0; hh < g; ++hh) {
      x.st[hh].m = kNegInf;
      std::fill(x.st[hh].z, x.st[hh].z + 16, 0.f);
    }
  };
  auto locals_into = [&](const Row& w, int32_t* dst) {
    for (int64_t j = 0; j < w.n_local; ++j) dst[j] = (int32_t)(w.S - w.n_local + j);
  };

  if (single) {
    auto fn = [&](int, int64_t bh, int slot) {
      const Slot x = slot_of(slot);
      const Row w = row_of(P, bh / P.H);
      const int64_t nb = (w.S + kBlock - 1) / kBlock;
      const KT* kbh = setup_bh(x, bh);
      reset_state(x);
      pass_a<KT>(P, x.rows, kbh, x.qmask, x.qhat, 0, w.S, x.E, ldE, x.st, x.mb, nblk);
      for (int64_t hh = 0; hh < g; ++hh) block_weights(x.mb + hh * nblk, nb, x.st[hh].m, hsum(load(x.st[hh].z)));
      const int64_t nsel = select_top(x.E, ldE, x.mb, nblk, g, 0, w.n_scored, w.m, x.sc, x.bmax, x.ss, x.si);
      locals_into(w, x.pos);
      std::copy(x.si, x.si + nsel, x.pos + w.n_local);
      const int64_t kk = w.n_local + nsel;
      if (P.mean_v) {
        for (int64_t hh = 0; hh < g; ++hh) {
          float a = 0.f;
          for (int64_t j = 0; j < kk; ++j) a += x.E[hh * ldE + x.pos[j]] * x.mb[hh * nblk + x.pos[j] / kBlock];
          x.alpha[hh] = a;
        }
      }
      // Overlapping these random reads with the next bh's stream was measured: no gain (they
      // share the core's outstanding-miss capacity); one burst of prefetches is as good.
      prefetch_rows(P, k, v, bh / P.H, bh % P.H, x.pos, kk);
      attend<KT, QT>(P, k, v, bh / P.H, bh % P.H, x.qf, x.pos, kk, P.mean_v ? x.alpha : nullptr, x.lg, x.y, out);
    };
    run_phases(nt, {BH}, fn);
    return;
  }

  // ---- several chunks per bh: pass A per chunk | softmax weights and chunk candidates | merge, attend
  auto fn = [&](int phase, int64_t u, int slot) {
    const Slot x = slot_of(slot);
    if (phase == 0) {
      const int64_t bh = P.unit_bh[u], c = u - P.unit0[bh];
      const int64_t p0 = c * P.cs, p1 = std::min(P.len[bh / P.H], p0 + P.cs);
      float* stat = ustat(u);
      const KT* kbh = setup_bh(x, bh);
      reset_state(x);
      pass_a<KT>(P, x.rows, kbh, x.qmask, x.qhat, p0, p1, uE(u), ldE, x.st, umb(u), nblk);
      for (int64_t hh = 0; hh < g; ++hh) { stat[hh] = x.st[hh].m; stat[g + hh] = hsum(load(x.st[hh].z)); }
    } else if (phase == 1) {
      const int64_t bh = P.unit_bh[u], u0 = P.unit0[bh], nc = P.chunks(bh);
      const Row w = row_of(P, bh / P.H);
      const int64_t p0 = (u - u0) * P.cs, p1 = std::min(w.S, p0 + P.cs);
      int32_t* count = reinterpret_cast<int32_t*>(ucand(u));
      *count = 0;
      for (int64_t hh = 0; hh < g; ++hh) {
        float M_ = kNegInf, Z = 0.f;
        for (int64_t cc = 0; cc < nc; ++cc) M_ = std::max(M_, ustat(u0 + cc)[hh]);
        for (int64_t cc = 0; cc < nc; ++cc) {
          const float* s2 = ustat(u0 + cc);
          if (s2[g + hh] > 0.f) Z += s2[g + hh] * std::exp(s2[hh] - M_);
        }
        block_weights(umb(u) + hh * nblk, (p1 - p0 + kBlock - 1) / kBlock, M_, Z);
      }
      const int64_t shi = std::min(p1, w.n_scored);
      if (shi > p0) {
        const int64_t cnt = select_top(uE(u), ldE, umb(u), nblk, g, p0, shi, w.m, x.sc, x.bmax, x.ss, x.si);
        *count = (int32_t)cnt;
        std::copy(x.ss, x.ss + cnt, ucand(u) + 16);
        std::copy(x.si, x.si + cnt, reinterpret_cast<int32_t*>(ucand(u) + 16 + m1));
      }
    } else {
      const int64_t bh = u, u0 = P.unit0[bh], nc = P.chunks(bh);
      const Row w = row_of(P, bh / P.H);
      int64_t n = 0;
      for (int64_t c = 0; c < nc; ++c) {  // chunks hold ascending positions: so does the concatenation
        const float* cu = ucand(u0 + c);
        const int32_t cnt = *reinterpret_cast<const int32_t*>(cu);
        std::copy(cu + 16, cu + 16 + cnt, x.ss + n);
        const int32_t* ci = reinterpret_cast<const int32_t*>(cu + 16 + m1);
        std::copy(ci, ci + cnt, x.si + n);
        n += cnt;
      }
      n = select_from(x.ss, x.si, n, w.m);
      locals_into(w, x.pos);
      std::copy(x.si, x.si + n, x.pos + w.n_local);
      const int64_t kk = w.n_local + n;
      if (P.mean_v) {
        for (int64_t hh = 0; hh < g; ++hh) x.alpha[hh] = 0.f;
        for (int64_t j = 0; j < kk; ++j) {
          const int64_t c = x.pos[j] / P.cs, o = x.pos[j] - c * P.cs;
          const int64_t uu = u0 + c;
          for (int64_t hh = 0; hh < g; ++hh) x.alpha[hh] += uE(uu)[hh * ldE + o] * umb(uu)[hh * nblk + o / kBlock];
        }
      }
      prefetch_rows(P, k, v, bh / P.H, bh % P.H, x.pos, kk);
      setup_bh(x, bh);  // q in fp32 for this bh (cheap)
      attend<KT, QT>(P, k, v, bh / P.H, bh % P.H, x.qf, x.pos, kk, P.mean_v ? x.alpha : nullptr, x.lg, x.y, out);
    }
  };
  run_phases(nt, {units, units, BH}, fn);
}

at::Tensor decode_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                      const at::Tensor& v, const at::Tensor& v_sum, int64_t length, int64_t r, int64_t k_top,
                      int64_t local, bool mean_v, const std::optional<at::Tensor>& lengths) {
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
  }
  const auto kdt = k.scalar_type(), qdt = q.scalar_type();
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16 || kdt == at::kHalf, "sparq::decode_cpu: unsupported cache dtype");
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, "sparq::decode_cpu: unsupported q dtype");

  const std::vector<int64_t> len = row_lengths(lengths, B, length, "sparq::decode_cpu");
  Problem P{};
  P.B = B; P.H = H; P.g = g; P.d = d; P.r = r; P.k_top = k_top; P.local = local; P.len = len.data();
  P.S = *std::max_element(len.begin(), len.end());
  P.kk = std::min(k_top, P.S);
  P.m = P.kk - std::min(local, P.S);  // the most any row chooses
  P.mean_v = mean_v;
  P.two_k = two_k;
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.ks0 = k.stride(0); P.ks1 = k.stride(1); P.ks2 = k.stride(2);
  if (two_k) { P.kts0 = k_t->stride(0); P.kts1 = k_t->stride(1); P.kts2 = k_t->stride(2); }
  P.vs0 = v.stride(0); P.vs1 = v.stride(1); P.vs2 = v.stride(2);
  P.vss0 = v_sum.stride(0); P.vss1 = v_sum.stride(1);
  P.vsum = v_sum.data_ptr<float>();
  P.cs = chunk_length(len, H, thread_count(), std::numeric_limits<int64_t>::max());
  split_rows(len, H, P.cs, &P.unit0, &P.unit_bh);

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

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("decode_cpu", &sparq_cpu::decode_cpu);
}
