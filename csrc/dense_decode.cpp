// Fused dense decode attention for CPU (flash-decoding), one query token per row: the baseline
// SparQ is measured against.
//
// Registered as the CPU kernel of sparq::dense_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   dense_cpu(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? lengths=None) -> Tensor
// lengths: None (every row reads positions [0, length)) or (B,) int: row b reads [0, lengths[b])
// (ragged batches: a short row costs only what it reads).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
// Dense decode attention, fused (flash-decoding): every K and V row read once, for all g heads,
// split over (bh, S chunk) units; chunk results (max, sum, unnormalised output) are combined.
// ---------------------------------------------------------------------------------------------

struct DenseProblem {
  int64_t B, H, g, d, S;  // S: the longest row's length
  int64_t qs0, qs1, qs2, qs3, ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t cs;                      // chunk length (a multiple of 64)
  const int64_t* len;              // (B,) live length of each row
  std::vector<int64_t> unit0;      // (B * H + 1,) first unit of each bh: bh owns ceil(len / cs) chunks
  std::vector<int32_t> unit_bh;    // the bh of each unit
  int64_t units() const { return unit0.back(); }
  int64_t chunks(int64_t bh) const { return unit0[bh + 1] - unit0[bh]; }
};

// Register-blocked dense pieces for d = 16 * NV: blocks of 64 positions (in L1 after the first
// head), four independent dot products at a time, output accumulators in registers.
template <int NV, typename KT>
static void dense_logits_nv(const float* qf, int64_t g, const KT* kb, int64_t ks, int64_t p0, int64_t n, float* L,
                            int64_t ldL) {
  constexpr int64_t d = 16 * NV;
  for (int64_t s0 = 0; s0 < n; s0 += 64) {
    const int64_t s1 = std::min(n, s0 + 64);
    for (int64_t hh = 0; hh < g; ++hh) {
      V qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = load(qf + hh * d + 16 * c);
      float* l = L + hh * ldL;
      int64_t s = s0;
      for (; s + 4 <= s1; s += 4) {
        const KT* r0 = kb + (p0 + s) * ks;
        V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) {
          a0 = vfma(qv[c], load(r0 + 16 * c), a0);
          a1 = vfma(qv[c], load(r0 + ks + 16 * c), a1);
          a2 = vfma(qv[c], load(r0 + 2 * ks + 16 * c), a2);
          a3 = vfma(qv[c], load(r0 + 3 * ks + 16 * c), a3);
        }
        l[s] = hsum(a0);
        l[s + 1] = hsum(a1);
        l[s + 2] = hsum(a2);
        l[s + 3] = hsum(a3);
      }
      for (; s < s1; ++s) {
        const KT* r0 = kb + (p0 + s) * ks;
        V a0 = vzero();
        for (int c = 0; c < NV; ++c) a0 = vfma(qv[c], load(r0 + 16 * c), a0);
        l[s] = hsum(a0);
      }
    }
  }
}

template <int NV, typename KT>
static void dense_pv_nv(const float* L, int64_t ldL, int64_t g, const KT* vb, int64_t vs, int64_t p0, int64_t n,
                        float* y) {
  constexpr int64_t d = 16 * NV;
  std::fill(y, y + g * d, 0.f);
  for (int64_t s0 = 0; s0 < n; s0 += 64) {
    const int64_t s1 = std::min(n, s0 + 64);
    for (int64_t hh = 0; hh < g; ++hh) {
      V acc[NV];
      for (int c = 0; c < NV; ++c) acc[c] = load(y + hh * d + 16 * c);
      const float* e = L + hh * ldL;
      for (int64_t s = s0; s < s1; ++s) {
        const KT* row = vb + (p0 + s) * vs;
        const V es = vset(e[s]);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) acc[c] = vfma(es, load(row + 16 * c), acc[c]);
      }
      for (int c = 0; c < NV; ++c) store(y + hh * d + 16 * c, acc[c]);
    }
  }
}

// One unit: positions [p0, p1) of bh. Writes y (g x d, unnormalised) and mz = [m(g), Z(g)].
template <typename KT, typename QT>
static void dense_unit(const DenseProblem& P, const QT* q, const KT* k, const KT* v, int64_t bh, int64_t p0,
                       int64_t p1, float* qf, float* L, int64_t ldL, float* y, float* mz) {
  const int64_t g = P.g, d = P.d, b = bh / P.H, h = bh % P.H;
  const int64_t nfull = d / 16, rem = d % 16;
  const float scale = 1.0f / std::sqrt((float)d);
  const QT* qb = q + b * P.qs0 + h * P.qs1;
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t j = 0; j < d; ++j) qf[hh * d + j] = to_f(qb[hh * P.qs2 + j * P.qs3]) * scale;
  const KT* kb = k + b * P.ks0 + h * P.ks1;
  const KT* vb = v + b * P.vs0 + h * P.vs1;
  const int64_t n = p1 - p0;
  bool blocked = rem == 0;
#define SPARQ_NV_CASES(X) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(16)
  if (blocked) {
    switch (nfull) {
#define SPARQ_DL(n_) case n_: dense_logits_nv<n_, KT>(qf, g, kb, P.ks2, p0, n, L, ldL); break;
      SPARQ_NV_CASES(SPARQ_DL)
#undef SPARQ_DL
      default: blocked = false;
    }
  }
  // logits
  for (int64_t s = 0; s < n && !blocked; ++s) {
    const KT* row = kb + (p0 + s) * P.ks2;
    for (int64_t hh = 0; hh < g; ++hh) L[hh * ldL + s] = dot_d(qf + hh * d, row, d);
  }
  // softmax numerators
  for (int64_t hh = 0; hh < g; ++hh) {
    const auto [m, sum] = exp_shifted(L + hh * ldL, n);
    mz[hh] = m;
    mz[g + hh] = sum;
  }
  // y = e @ V
  if (blocked) {
    switch (nfull) {
#define SPARQ_DPV(n_) case n_: dense_pv_nv<n_, KT>(L, ldL, g, vb, P.vs2, p0, n, y); break;
      SPARQ_NV_CASES(SPARQ_DPV)
#undef SPARQ_DPV
    }
    return;
  }
#undef SPARQ_NV_CASES
  std::fill(y, y + g * d, 0.f);
  for (int64_t s = 0; s < n; ++s) add_weighted_row(L + s, ldL, g, vb + (p0 + s) * P.vs2, d, y);
}

template <typename KT, typename QT>
static void run_dense(const DenseProblem& P, const QT* q, const KT* k, const KT* v, QT* out) {
  const int64_t BH = P.B * P.H, units = P.units(), g = P.g, d = P.d;
  const bool single = units == BH;  // one chunk per bh: write the output directly
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), units));
  const int64_t ldL = round_up(P.cs, 16);
  const int64_t slot_floats = round_up(g * d, 16) + g * ldL + round_up(g * d, 16) + round_up(2 * g, 16);
  const int64_t unit_floats = single ? 0 : round_up(g * d + 2 * g, 16);  // y (g x d), m (g), Z (g)
  Workspace& ws = workspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  float* base = ws.get(nt * slot_floats + units * unit_floats + 64);
  float* ubase = base + nt * slot_floats;
  auto fn = [&](int phase, int64_t u, int slot) {
    float* qf = base + slot * slot_floats;
    float* L = qf + round_up(g * d, 16);
    float* y = L + g * ldL;
    float* mz = y + round_up(g * d, 16);
    if (phase == 0) {
      const int64_t bh = P.unit_bh[u], c = u - P.unit0[bh];
      const int64_t p0 = c * P.cs, p1 = std::min(P.len[bh / P.H], p0 + P.cs);
      if (single) {
        dense_unit<KT, QT>(P, q, k, v, bh, p0, p1, qf, L, ldL, y, mz);
        QT* o = out + bh * g * d;
        for (int64_t hh = 0; hh < g; ++hh) {
          const float inv = 1.0f / mz[g + hh];
          for (int64_t j = 0; j < d; ++j) o[hh * d + j] = from_f<QT>(y[hh * d + j] * inv);
        }
        return;
      }
      float* U = ubase + u * unit_floats;
      dense_unit<KT, QT>(P, q, k, v, bh, p0, p1, qf, L, ldL, U, U + g * d);
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

at::Tensor dense_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                     const std::optional<at::Tensor>& lengths) {
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
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16 || kdt == at::kHalf, "sparq::dense_cpu: unsupported cache dtype");
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, "sparq::dense_cpu: unsupported q dtype");
  const std::vector<int64_t> len = row_lengths(lengths, B, length, "sparq::dense_cpu");
  DenseProblem P{};
  P.B = B; P.H = H; P.g = g; P.d = d; P.S = length; P.len = len.data();
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.ks0 = k.stride(0); P.ks1 = k.stride(1); P.ks2 = k.stride(2);
  P.vs0 = v.stride(0); P.vs1 = v.stride(1); P.vs2 = v.stride(2);
  // chunks: balance the threads, and bound the logits buffer (g x cs floats per thread)
  P.cs = chunk_length(len, H, thread_count(), std::max<int64_t>(1024, (int64_t(1) << 18) / std::max<int64_t>(g, 1)));
  split_rows(len, H, P.cs, &P.unit0, &P.unit_bh);
  at::Tensor out = at::empty({B, H, g, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
#define SPARQ_RUN(KT, QT) run_dense<KT, QT>(P, q.data_ptr<QT>(), k.data_ptr<KT>(), v.data_ptr<KT>(), out.data_ptr<QT>())
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
  m.impl("dense_cpu", &sparq_cpu::dense_cpu);
}
