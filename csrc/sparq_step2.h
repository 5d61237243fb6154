// Step 2 (pass D): gather the k selected rows of K and V, attend exactly, mix in mean(V).
// Part of the fused SparQ kernel (sparq_decode.cpp, whose header comment describes the passes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "attend.h"
#include "simd.h"
#include "sparq_problem.h"

namespace sparq_cpu {
namespace {

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
  if (P.k_scale) {  // an int8 cache: each row's scale sits in its own line
    const float* ks = P.k_scale + b * P.ksc0 + h * P.ksc1;
    const float* vs = P.v_scale + b * P.vsc0 + h * P.vsc1;
    for (int64_t j = 0; j < kk; ++j) prefetch_l2(ks + pos[j]);
    for (int64_t j = 0; j < kk; ++j) prefetch_l2(vs + pos[j]);
  }
}

// lg[hh][j] *= scale[pos[j]] for the g heads (an int8 cache's per-position scales)
static inline void scale_selected(float* lg, int64_t g, int64_t kk, const float* scale, const int32_t* pos) {
  for (int64_t j = 0; j < kk; ++j) {
    const float c = scale[pos[j]];
    for (int64_t hh = 0; hh < g; ++hh) lg[hh * kk + j] *= c;
  }
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
  if (P.k_scale) scale_selected(lg, g, kk, P.k_scale + b * P.ksc0 + h * P.ksc1, pos);
  // softmax per head
  for (int64_t hh = 0; hh < g; ++hh) {
    float* l = lg + hh * kk;
    const V inv = vset(1.0f / exp_shifted(l, kk).second);
    for (int64_t j = 0; j < kk; j += 16) store(l + j, vmul(load(l + j, tail_mask(kk - j)), inv), tail_mask(kk - j));
  }
  if (P.v_scale) scale_selected(lg, g, kk, P.v_scale + b * P.vsc0 + h * P.vsc1, pos);  // weights of int8 V rows
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

}  // namespace
}  // namespace sparq_cpu
