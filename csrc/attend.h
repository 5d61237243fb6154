// Pieces of exact attention shared by SparQ step 2 (attend, sparq_decode.cpp) and the dense kernel
// (dense_unit, dense_decode.cpp): the unblocked paths, for head dims the register-blocked
// templates of those files do not cover.
#pragma once

#include <cstdint>
#include <utility>

#include "simd.h"

namespace sparq_cpu {

// x . row over d elements (16 lanes at a time, masked tail)
template <typename KT>
static inline float dot_d(const float* x, const KT* row, int64_t d) {
  const int64_t nfull = d / 16, rem = d % 16;
  V acc = vzero();
  for (int64_t c = 0; c < nfull; ++c) acc = vfma(load(x + 16 * c), load(row + 16 * c), acc);
  if (rem) acc = vfma(load(x + 16 * nfull, tail_mask(rem)), load(row + 16 * nfull, tail_mask(rem)), acc);
  return hsum(acc);
}

// l[0, n) <- exp(l - max l) in place; returns {max, sum of the exps}
static inline std::pair<float, float> exp_shifted(float* l, int64_t n) {
  V mx = vset(kNegInf);
  for (int64_t j = 0; j < n; j += 16) mx = vmax_masked(mx, tail_mask(n - j), load(l + j, tail_mask(n - j)));
  const float m = hmax(mx);
  const V vm = vset(m);
  V sum = vzero();
  for (int64_t j = 0; j < n; j += 16) {
    const M mk = tail_mask(n - j);
    const V e = vselect(mk, vexp(vsub(load(l + j, mk), vm)), vzero());
    store(l + j, e, mk);
    sum = vadd(sum, e);
  }
  return {m, hsum(sum)};
}

// y[hh] += p[hh * ldp] * row for the g heads (y: g x d floats)
template <typename KT>
static inline void add_weighted_row(const float* p, int64_t ldp, int64_t g, const KT* row, int64_t d, float* y) {
  const int64_t nfull = d / 16, rem = d % 16;
  for (int64_t c = 0; c < nfull; ++c) {
    const V vr = load(row + 16 * c);
    for (int64_t hh = 0; hh < g; ++hh) {
      float* yc = y + hh * d + 16 * c;
      store(yc, vfma(vset(p[hh * ldp]), vr, load(yc)));
    }
  }
  if (rem) {
    const M mrem = tail_mask(rem);
    const V vr = load(row + 16 * nfull, mrem);
    for (int64_t hh = 0; hh < g; ++hh) {
      float* yc = y + hh * d + 16 * nfull;
      store(yc, vfma(vset(p[hh * ldp]), vr, load(yc, mrem)), mrem);
    }
  }
}

}  // namespace sparq_cpu
