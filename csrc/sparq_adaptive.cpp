// Fused adaptive SparQ decode attention for CPU (sparq-adaptive): the passes of sparq_decode.cpp with
// each layer's budget split per row and step, each KV head selecting its own (the default) or a row's
// heads pooling their picks.
//
// Registered as the CPU kernel of sparq::adaptive_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   adaptive_cpu(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, Tensor spread, SymInt length,
//                float compression, int k_max, int? k_cap, bool mean_v, bool per_head, Tensor? lengths=None)
//                -> Tensor
//   adaptive_quant_cpu(..., Tensor? lengths, Tensor? k_scale, Tensor? v_scale, Tensor chan, Tensor? kt_scale,
//                      float kt_cost, float kt_scale_cost, int kt_bits) -> Tensor
// the second on a quantized cache, read as stored as decode_quant_cpu reads it (sparq_decode.cpp's
// header), its budget split in stored bytes (kt_cost, kt_scale_cost: sparq_adaptive.StepCosts); kt_bits: a uint8
// k_t's bits per position, 4 (int4) or 3 (int3).
// It computes what sparq_adaptive.sparq_adaptive_attention_torch computes (sparq_adaptive.sparq_adaptive_reference at
// each row's split), in fp32. Per batch row b, of live length S_b, and pool of P heads (per_head: P = 1, each
// head alone; else P = H, the row's heads pooled):
//   (r, k) = adaptive_split(S_b, d, compression, k_cap, costs), or (d, S_b) when S_b <= k_max (k_cap:
//     the most positions a row's split may take, none when absent; k_max: the length up to which it is dense);
//     local = max(1, k / 4) (a head never ends with no position);
//   components: w_hi = sum_g |q_hgi| spread_hi, each head's share w_hi / sum_i w_hi; every head keeps
//     its largest, the other P (r - 1) go to the largest shares over the pool's P heads (ties: lower head,
//     then lower index); head h streams its r_h rows of K^T: s_hat_h = softmax(q[i1_h] . K^T[i1_h] / tau),
//     tau^2 = d sum_{i1_h} |q_gi| spread_i / sum_i |q_gi| spread_i per query head g;
//   positions: each head its last min(local, S_b), the other P (min(k, S_b) - local) the largest
//     group-summed s_hat over the pool's heads (ties: lower head, then lower position);
//   y_h = softmax(q_h . K[i2_h] / sqrt(d)) @ V[i2_h], mean-V as SparQ's with alpha over i2_h.
//
// Phases over units (bh = b * H + h split over S into chunks, as sparq_decode.cpp's chunked path; each
// row's chunk length the one it takes alone, parallel.h, so a row of any batch is the row alone):
//   0 (units)  the pool's components (cheap: P x d values, recomputed by each unit), pass A over
//              the unit's chunk with the head's r_h rows (a bh of one chunk, without mean-V, goes on
//              to phase 1's work at once, from its E still in L2);
//   1 (units)  softmax weights from all chunks' maxima and sums, the chunk's best P m candidates
//              (every member of the pool's top P m is among its chunk's top P m);
//   2 (rows)   merge each pool's candidates over heads and chunks, keep the top P m: per-head positions;
//   3 (bh)     mean-V's alpha, then exact attention over the head's positions (pass D).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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
#include "sparq_cache.h"
#include "sparq_problem.h"
#include "sparq_select.h"
#include "sparq_step1.h"
#include "sparq_step2.h"
#include "workspace.h"

namespace sparq_cpu {
namespace {

// sparq_adaptive.adaptive_split, the same arithmetic in the same order (doubles, floors): kt and kt_scale are
// sparq_adaptive.StepCosts (1 and 0 on a float cache, where it is the paper's element count).
struct Split {
  int64_t r, k;
};
static Split adaptive_split(int64_t S, int64_t d, double c, int64_t k_max, std::optional<int64_t> k_cap, double kt,
                            double kt_scale) {
  if (S <= k_max) return {d, S};  // the row sees at most k_max positions: all of them, every component
  const int64_t budget = (int64_t)(c * (double)(2 * S * d + 2 * d));
  // sparq_adaptive.position_share: on a K^T cheaper than K, d / 2 components where they (and the fixed 6 d) cost at most
  // 3/4 of the budget (HALF_COMPONENTS_AT_MOST); else half to positions unless that leaves fewer than
  // MIN_COMPONENTS = 12
  const double fixed = (double)(6 * d) / (double)S;
  const double need_half = ((double)d / 2 * kt + kt_scale + fixed) / (2 * c * (double)d);
  const double need = (12 * kt + kt_scale) / (2 * c * (double)d);
  const double share = kt < 1.0 && need_half <= 3.0 / 4.0 ? 1 - need_half : std::min(0.5, std::max(0.125, 1 - need));
  int64_t k = std::max<int64_t>(1, std::min<int64_t>(k_cap.value_or(S), (int64_t)(c * share * (double)S)));
  const double scales = (double)S * kt_scale;
  const int64_t r = std::max<int64_t>(
      1, std::min<int64_t>(d, (int64_t)std::floor(((double)(budget - 2 * k * d - 6 * d) - scales) / ((double)S * kt))));
  const double left = (double)budget - (double)(S * r) * kt - scales - (double)(2 * k * d) - (double)(6 * d);
  k = std::max<int64_t>(1, std::min<int64_t>(S, k + (int64_t)std::floor(left / (double)(2 * d))));
  return {r, k};
}

struct RowPlan {  // one batch row: its split and the counts of pass C
  int64_t S, r, n_local, m;  // m: positions chosen per head on average (pool m over a pool of heads)
};

struct Adaptive {
  Problem P;  // sizes are maxima over rows: P.r = d, P.kk = most positions any head can hold
  std::vector<RowPlan> rows;
  int64_t pool;  // heads that share their components and positions: 1 (each its own), or the row's H (pooled)
  const float* spread;
  int64_t sps0, sps1;
};

// The components of head h's pool (itself alone, or the row's H heads), and this head's: i1 (ascending), its
// count, q_hat = q[i1] / tau ([i][g]). qf receives this head's q in fp32 (g x d); w (H x d + 16) and wi
// (H x d + 16) are scratch.
template <typename QT>
static int64_t prepare_components(const Adaptive& A, const QT* q, int64_t b, int64_t h, float* qf, float* w,
                                  int32_t* wi, int32_t* i1, float* qhat) {
  const Problem& P = A.P;
  const int64_t g = P.g, d = P.d, pool = A.pool, h0 = h - h % pool;
  auto q_at = [&](int64_t hh, int64_t gg, int64_t j) { return to_f(q[b * P.qs0 + hh * P.qs1 + gg * P.qs2 + j * P.qs3]); };
  for (int64_t hh = h0; hh < h0 + pool; ++hh) {  // shares of each head's sum of |q_i| spread_i
    const float* sp = A.spread + b * A.sps0 + hh * A.sps1;
    float* wh = w + (hh - h0) * d;
    float tot = 0.f;
    int64_t best = 0;
    for (int64_t j = 0; j < d; ++j) {
      float a = 0.f;
      for (int64_t gg = 0; gg < g; ++gg) a += std::fabs(q_at(hh, gg, j));
      wh[j] = a * sp[j];
      tot += wh[j];
      if (wh[j] > wh[best]) best = j;
    }
    const float inv = tot > 0.f ? 1.0f / tot : 0.f;
    for (int64_t j = 0; j < d; ++j) wh[j] *= inv;
    wh[best] += 2.0f;  // every head keeps its largest (shares are at most 1)
  }
  for (int64_t j = 0; j < pool * d; ++j) wi[j] = (int32_t)j;
  const int64_t n = select_from(w, wi, pool * d, pool * A.rows[b].r);  // ascending ids: head-major, then index
  int64_t r_h = 0;
  for (int64_t j = 0; j < n; ++j)
    if (wi[j] / d == h - h0) i1[r_h++] = wi[j] % (int32_t)d;
  const float* sp = A.spread + b * A.sps0 + h * A.sps1;
  for (int64_t gg = 0; gg < g; ++gg) {
    for (int64_t j = 0; j < d; ++j) qf[gg * d + j] = q_at(h, gg, j);
    float tot = 0.f, sel = 0.f;
    for (int64_t j = 0; j < d; ++j) tot += std::fabs(qf[gg * d + j]) * sp[j];
    for (int64_t i = 0; i < r_h; ++i) sel += std::fabs(qf[gg * d + i1[i]]) * sp[i1[i]];
    const float inv_tau = 1.0f / std::sqrt((float)d * sel / tot);
    for (int64_t i = 0; i < r_h; ++i) qhat[i * g + gg] = qf[gg * d + i1[i]] * inv_tau;
  }
  const float* chan = P.chan_of(b, h);  // a quantized step-1 source holds K / chan: chan goes into q_hat
  if (chan && P.step1_scaled())
    for (int64_t i = 0; i < r_h; ++i)
      for (int64_t gg = 0; gg < g; ++gg) qhat[i * g + gg] *= chan[i1[i]];
  return r_h;
}

template <typename KT, typename KTT, typename QT>
static void run(const Adaptive& A, const QT* q, const KT* k, const KTT* kt, const KT* v, QT* out) {
  const Problem& P = A.P;
  const int64_t H = P.H, g = P.g, d = P.d, BH = P.B * H;
  const int64_t units = P.units();
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), units));
  const int64_t ldE = round_up(P.most_cs, kBlock), nblk = ldE / kBlock;
  const int64_t most_chunks = P.most_chunks();
  int64_t cap = 1;  // candidates per unit: pool m of its row
  for (const RowPlan& w : A.rows) cap = std::max(cap, A.pool * w.m);
  // per-thread scratch
  auto take = [](int64_t& o, int64_t n) { int64_t at = o; o += round_up(std::max<int64_t>(n, 1), 16); return at; };
  int64_t o = 0;
  const int64_t s_qf = take(o, g * d + 16), s_w = take(o, H * d + 16), s_wi = take(o, H * d + 16),
                s_i1 = take(o, d), s_qhat = take(o, d * g), s_rows = take(o, 2 * d), s_qmask = take(o, g * d + 16),
                s_st = take(o, g * (int64_t)(sizeof(RunState) / sizeof(float))), s_sc = take(o, ldE),
                s_bmax = take(o, nblk + 1), merge = std::max(ldE, A.pool * most_chunks * cap) + 16,
                s_ss = take(o, merge), s_si = take(o, merge), s_lg = take(o, g * P.kk), s_y = take(o, g * d),
                s_alpha = take(o, g), s_E = take(o, g * ldE), s_mb = take(o, g * nblk);
  const int64_t slot_floats = round_up(o, 16);
  // per unit: E (g x cs), block maxima then weights (g x cs / 32), m and Z per head, candidates;
  // per bh: its positions (count, then up to P.kk)
  const int64_t u_E = g * ldE, u_mb = g * nblk, u_stat = round_up(2 * g, 16), u_cand = 16 + 2 * cap;
  const int64_t unit_floats = round_up(u_E + u_mb + u_stat + u_cand, 16), bh_floats = round_up(16 + P.kk, 16);
  Workspace& ws = workspace();
  std::lock_guard<std::mutex> lock(ws.mu);
  float* base = ws.get(nt * slot_floats + units * unit_floats + BH * bh_floats + 64);
  float* units_base = base + nt * slot_floats;
  float* bh_base = units_base + units * unit_floats;
  auto uE = [&](int64_t u) { return units_base + u * unit_floats; };
  auto umb = [&](int64_t u) { return uE(u) + u_E; };
  auto ustat = [&](int64_t u) { return umb(u) + u_mb; };  // [m(g), Z(g)]
  auto ucand = [&](int64_t u) { return ustat(u) + u_stat; };
  auto bh_count = [&](int64_t bh) { return reinterpret_cast<int32_t*>(bh_base + bh * bh_floats); };
  auto bh_pos = [&](int64_t bh) { return reinterpret_cast<int32_t*>(bh_base + bh * bh_floats + 16); };
  auto scratch = [&](int slot, int64_t at) { return base + slot * slot_floats + at; };

  // A bh of one chunk without mean-V finishes its unit in phase 0 from the slot's own E (still in L2);
  // writing every bh's E out for phase 1 cost a fifth of the step at B = 8 (README, adaptive SparQ).
  auto own = [&](int64_t u) { return !P.mean_v && P.chunks(P.unit_bh[u]) == 1; };
  // softmax weights from every chunk's maximum and sum, then the chunk's best pool m candidates
  auto candidates = [&](int64_t u, int slot, float* E, float* mb) {
    const int64_t bh = P.unit_bh[u], u0 = P.unit0[bh], nc = P.chunks(bh), cs = P.cs_of(bh);
    const RowPlan& w = A.rows[bh / H];
    const int64_t p0 = (u - u0) * cs, p1 = std::min(w.S, p0 + cs);
    for (int64_t gg = 0; gg < g; ++gg)
      chunk_block_weights(ustat, u0, nc, g, gg, mb + gg * nblk, (p1 - p0 + kBlock - 1) / kBlock);
    int32_t* count = reinterpret_cast<int32_t*>(ucand(u));
    *count = 0;
    const int64_t shi = std::min(p1, w.S - w.n_local);
    if (shi > p0) {
      float* ss = scratch(slot, s_ss);
      int32_t* si = reinterpret_cast<int32_t*>(scratch(slot, s_si));
      const int64_t cnt = select_top(E, ldE, mb, nblk, g, p0, shi, A.pool * w.m, scratch(slot, s_sc), scratch(slot, s_bmax),
                                     ss, si);
      *count = (int32_t)cnt;
      std::copy(ss, ss + cnt, ucand(u) + 16);
      std::copy(si, si + cnt, reinterpret_cast<int32_t*>(ucand(u) + 16 + cap));
    }
  };

  auto fn = [&](int phase, int64_t u, int slot) {
    float* qf = scratch(slot, s_qf);
    if (phase == 0) {  // pass A over the unit's chunk with the head's own components
      const int64_t bh = P.unit_bh[u], b = bh / H, h = bh % H, c = u - P.unit0[bh], cs = P.cs_of(bh);
      const int64_t p0 = c * cs, p1 = std::min(P.len[b], p0 + cs);
      int32_t* i1 = reinterpret_cast<int32_t*>(scratch(slot, s_i1));
      float* qhat = scratch(slot, s_qhat);
      const int64_t r_h = prepare_components(A, q, b, h, qf, scratch(slot, s_w),
                                             reinterpret_cast<int32_t*>(scratch(slot, s_wi)), i1, qhat);
      const KTT** rows = reinterpret_cast<const KTT**>(scratch(slot, s_rows));
      float* qmask = scratch(slot, s_qmask);
      const KT* kbh = k + b * P.ks0 + h * P.ks1;
      if (P.two_k) {
        const KTT* ktbh = kt + b * P.kts0 + h * P.kts1;
        for (int64_t i = 0; i < r_h; ++i) rows[i] = ktbh + (int64_t)i1[i] * P.kts2;
      } else {  // q masked to i1, scaled by 1/tau
        std::fill(qmask, qmask + g * d, 0.f);
        for (int64_t i = 0; i < r_h; ++i)
          for (int64_t gg = 0; gg < g; ++gg) qmask[gg * d + i1[i]] = qhat[i * g + gg];
      }
      RunState* st = reinterpret_cast<RunState*>(scratch(slot, s_st));
      for (int64_t gg = 0; gg < g; ++gg) {
        st[gg].m = kNegInf;
        std::fill(st[gg].z, st[gg].z + 16, 0.f);
      }
      float* E = own(u) ? scratch(slot, s_E) : uE(u);
      float* mb = own(u) ? scratch(slot, s_mb) : umb(u);
      pass_a<KT, KTT>(P, r_h, rows, kbh, qmask, qhat, p0, p1, E, ldE, st, mb, nblk, P.kt_scale_of(b, h));
      float* stat = ustat(u);
      for (int64_t gg = 0; gg < g; ++gg) { stat[gg] = st[gg].m; stat[g + gg] = hsum(load(st[gg].z)); }
      if (own(u)) candidates(u, slot, E, mb);
    } else if (phase == 1) {
      if (!own(u)) candidates(u, slot, uE(u), umb(u));
    } else if (phase == 2) {  // each pool's top pool m over its heads: ids (h - h0) S + position, ascending
      const int64_t b = u, pool = A.pool;
      const RowPlan& w = A.rows[b];
      float* ss = scratch(slot, s_ss);
      int32_t* si = reinterpret_cast<int32_t*>(scratch(slot, s_si));
      for (int64_t h0 = 0; h0 < H; h0 += pool) {
        int64_t n = 0;
        for (int64_t h = h0; h < h0 + pool; ++h) {
          const int64_t bh = b * H + h;
          for (int64_t c = 0; c < P.chunks(bh); ++c) {
            const float* cu = ucand(P.unit0[bh] + c);
            const int32_t cnt = *reinterpret_cast<const int32_t*>(cu);
            const int32_t* ci = reinterpret_cast<const int32_t*>(cu + 16 + cap);
            std::copy(cu + 16, cu + 16 + cnt, ss + n);
            for (int32_t j = 0; j < cnt; ++j) si[n + j] = (int32_t)((h - h0) * w.S) + ci[j];
            n += cnt;
          }
        }
        n = select_from(ss, si, n, pool * w.m);
        int64_t j = 0;
        for (int64_t h = h0; h < h0 + pool; ++h) {  // each head: its local window, then its chosen positions
          int32_t* pos = bh_pos(b * H + h);
          int64_t kk = 0;
          for (int64_t p = w.S - w.n_local; p < w.S; ++p) pos[kk++] = (int32_t)p;
          for (; j < n && si[j] / w.S == h - h0; ++j) pos[kk++] = si[j] % (int32_t)w.S;
          *bh_count(b * H + h) = (int32_t)kk;
        }
      }
    } else {  // mean-V's alpha, exact attention over the head's positions
      const int64_t bh = u, b = bh / H, h = bh % H, u0 = P.unit0[bh], cs = P.cs_of(bh);
      const int32_t* pos = bh_pos(bh);
      const int64_t kk = *bh_count(bh);
      float* alpha = scratch(slot, s_alpha);
      if (P.mean_v) {
        for (int64_t gg = 0; gg < g; ++gg) alpha[gg] = 0.f;
        for (int64_t j = 0; j < kk; ++j) {
          const int64_t c = pos[j] / cs, off = pos[j] - c * cs;
          for (int64_t gg = 0; gg < g; ++gg)
            alpha[gg] += uE(u0 + c)[gg * ldE + off] * umb(u0 + c)[gg * nblk + off / kBlock];
        }
      }
      prefetch_rows(P, k, v, b, h, pos, kk);
      const float* chan = P.k_scale ? P.chan_of(b, h) : nullptr;  // an int8 K holds K / chan: chan goes into q
      for (int64_t gg = 0; gg < g; ++gg)
        for (int64_t j = 0; j < d; ++j)
          qf[gg * d + j] = to_f(q[b * P.qs0 + h * P.qs1 + gg * P.qs2 + j * P.qs3]) * (chan ? chan[j] : 1.0f);
      attend<KT, QT>(P, k, v, b, h, qf, pos, kk, P.mean_v ? alpha : nullptr, scratch(slot, s_lg), scratch(slot, s_y),
                     out);
    }
  };
  run_phases(nt, {units, units, P.B, BH}, fn);
}

at::Tensor adaptive_impl(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                         const at::Tensor& v, const at::Tensor& v_sum, const at::Tensor& spread, int64_t length,
                         double compression, int64_t k_max, std::optional<int64_t> k_cap, bool mean_v, bool per_head,
                         const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& chan,
                         const std::optional<at::Tensor>& kt_scale, double kt_cost, double kt_scale_cost,
                         int64_t kt_bits) {
  const char* op = "sparq::adaptive_cpu";
  TORCH_CHECK(q.dim() == 4 && v_sum.dim() == 3 && spread.dim() == 3, op,
              ": expected q (B, n_kv, g, d), v_sum and spread (B_max, n_kv, d)");
  const int64_t B = q.size(0), H = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(q.device().is_cpu() && v_sum.device().is_cpu() && spread.device().is_cpu(), op, ": CPU tensors only");
  for (const at::Tensor* t : {&v_sum, &spread})
    TORCH_CHECK(t->size(0) >= B && t->size(1) == H && t->size(2) == d && t->scalar_type() == at::kFloat &&
                    t->stride(2) == 1, op, ": v_sum and spread must be fp32 (B_max, n_kv, d), contiguous in d");
  TORCH_CHECK(0 < compression && compression <= 1 && k_max >= 1 && k_cap.value_or(1) >= 1, op,
              ": need 0 < compression <= 1, k_max >= 1, k_cap >= 1");
  TORCH_CHECK(kt_cost > 0 && kt_scale_cost >= 0, op, ": need kt_cost > 0 and kt_scale_cost >= 0");
  TORCH_CHECK(H * length < (int64_t(1) << 31), op, ": n_kv x length too large");
  const auto qdt = q.scalar_type();
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, op, ": unsupported q dtype");

  const std::vector<int64_t> len = row_lengths(lengths, B, length, op);
  Adaptive A{};
  A.pool = per_head ? 1 : H;
  Problem& P = A.P;
  const CacheKind cache = bind_cache(P, op, B, H, d, length, k, k_t, v, k_scale, v_scale, chan, kt_scale, kt_bits);
  int64_t most_k = 1;
  for (int64_t b = 0; b < B; ++b) {
    const Split s = adaptive_split(len[b], d, compression, k_max, k_cap, kt_cost, kt_scale_cost);
    const int64_t kk = std::min(s.k, len[b]), n_local = std::min(std::max<int64_t>(1, kk / 4), len[b]);
    A.rows.push_back({len[b], s.r, n_local, kk - n_local});
    most_k = std::max(most_k, n_local + A.pool * (kk - n_local));  // one head may take all of its pool's positions
  }
  P.B = B; P.H = H; P.g = g; P.d = d; P.r = d; P.len = len.data();
  P.S = *std::max_element(len.begin(), len.end());
  P.kk = most_k;
  P.mean_v = mean_v;
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.vss0 = v_sum.stride(0); P.vss1 = v_sum.stride(1);
  P.vsum = v_sum.data_ptr<float>();
  A.spread = spread.data_ptr<float>();
  A.sps0 = spread.stride(0); A.sps1 = spread.stride(1);
  P.cs = row_chunk_lengths(len, H, thread_count(), std::numeric_limits<int64_t>::max());
  P.most_cs = *std::max_element(P.cs.begin(), P.cs.end());
  split_rows(len, H, P.cs, &P.unit0, &P.unit_bh);

  at::Tensor out = at::empty({B, H, g, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_cache(q, k, k_t, v, out, cache,
                 [&](auto qp, auto kp, auto ktp, auto vp, auto op) { run(A, qp, kp, ktp, vp, op); });
  return out;
}

at::Tensor adaptive_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                        const at::Tensor& v, const at::Tensor& v_sum, const at::Tensor& spread, int64_t length,
                        double compression, int64_t k_max, std::optional<int64_t> k_cap, bool mean_v, bool per_head,
                        const std::optional<at::Tensor>& lengths) {
  return adaptive_impl(q, k, k_t, v, v_sum, spread, length, compression, k_max, k_cap, mean_v, per_head, lengths,
                       std::nullopt, std::nullopt, std::nullopt, std::nullopt, 1.0, 0.0, 4);
}

// A quantized cache (its scales as decode_quant_cpu's) and step 1's costs in K/V elements (sparq_adaptive.StepCosts).
at::Tensor adaptive_quant_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                              const at::Tensor& v, const at::Tensor& v_sum, const at::Tensor& spread, int64_t length,
                              double compression, int64_t k_max, std::optional<int64_t> k_cap, bool mean_v,
                              bool per_head, const std::optional<at::Tensor>& lengths,
                              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                              const at::Tensor& chan, const std::optional<at::Tensor>& kt_scale, double kt_cost,
                              double kt_scale_cost, int64_t kt_bits) {
  return adaptive_impl(q, k, k_t, v, v_sum, spread, length, compression, k_max, k_cap, mean_v, per_head, lengths,
                       k_scale, v_scale, chan, kt_scale, kt_cost, kt_scale_cost, kt_bits);
}

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("adaptive_cpu", &sparq_cpu::adaptive_cpu);
  m.impl("adaptive_quant_cpu", &sparq_cpu::adaptive_quant_cpu);
}
