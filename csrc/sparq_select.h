// Top-k without sorting: the top-r components of |q|, pass C (the top k positions) and the merge of chunk candidates.
// Part of the fused SparQ kernel (sparq_decode.cpp, whose header comment describes the passes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "simd.h"
#include "sparq_problem.h"

namespace sparq_cpu {
namespace {

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
  // invariant: count(>= lo) >= cap > count(>= hi); a count of exactly cap ends the search early (every
  // value >= mid is kept, the ties below follow), which distinct scores reach after ~log2(n) halvings
  // instead of the ~30 the bit range takes
  uint32_t lo = float_bits(std::max(hmin(vmn), 0.f)), hi = float_bits(hmax(vmx)) + 1;
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    const int64_t c = count_ge(ss, n, bits_float(mid));
    if (c >= cap) lo = mid; else hi = mid;
    if (c == cap) break;
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
// Pass C: scores and the top-k selection without sorting the row (a threshold, then select_from).
// ---------------------------------------------------------------------------------------------

// A threshold exactly k of n >= k non-negative floats reach where one exists (else the k-th largest):
// binary search on the bits, vectorised counts. At least k reach it, every one of the top k.
static float kth_largest(const float* x, int64_t n, int64_t k) {
  V vmx = vzero();
  for (int64_t j = 0; j < n; j += 16) vmx = vmax_masked(vmx, tail_mask(n - j), load(x + j, tail_mask(n - j)));
  uint32_t lo = 0, hi = float_bits(hmax(vmx)) + 1;  // count(>= lo) >= k > count(>= hi)
  while (hi - lo > 1) {  // a count of exactly k ends it early, as in select_from
    const uint32_t mid = lo + (hi - lo) / 2;
    const int64_t c = count_ge(x, n, bits_float(mid));
    if (c >= k) lo = mid; else hi = mid;
    if (c == k) break;
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
  } else {  // the cap-th largest maximum of G >= 2 cap disjoint groups (cap of them hold a position >= it)
    // Lane-strided groups: lane j of D consecutive vectors, so a vector of maxima is D vertical maxes.
    // Masked-off tail lanes read 0, which a threshold above 0 never counts (and at 0 every position
    // qualifies). The former groups, `cap` contiguous runs and the least of their maxima, let 40-60%
    // of the positions through to select_from when cap is several times k (adaptive SparQ's H m:
    // the selection then took a third of pass A's time, perf at B = 8, 8k).
    const int64_t nv = (n + 15) / 16, D = std::max<int64_t>(1, std::min<int64_t>(16, n / (2 * cap)));
    int64_t G = 0;
    for (int64_t i0 = 0; i0 < nv; i0 += D, G += 16) {  // ss as scratch: the survivors overwrite it below
      V mx = vzero();
      for (int64_t i = i0; i < std::min(nv, i0 + D); ++i) mx = vmax(mx, load(sc + i * 16, tail_mask(n - i * 16)));
      store(ss + G, mx);
    }
    t0 = kth_largest(ss, G, cap);
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

}  // namespace
}  // namespace sparq_cpu
