// Fused SparQ decode attention for CPU (Ribar et al., ICML 2024), one query token per row.
// (The dense baseline is dense_decode.cpp, the decode GEMV linear.cpp; shared pieces in the .h files.)
//
// Registered as the CPU kernel of sparq::decode_cpu, whose schema (and fake implementation, for
// torch.compile) kernels.py defines:
//   decode_cpu(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length,
//              int r, int k_top, int local, bool mean_v, Tensor? lengths=None) -> Tensor
//   decode_quant_cpu(..., Tensor? lengths, Tensor? k_scale, Tensor? v_scale, Tensor chan,
//                    Tensor? kt_scale, int kt_bits) -> Tensor   (a quantized cache; no defaults: dense_decode.cpp
//                    says why; kt_bits: a uint8 k_t's bits per position, 4 (int4) or 3 (int3))
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
// Work per (batch row, KV head) -- "bh" -- split over S into chunks where the row's bh alone are too
// few for the threads (3 KV heads on 2 cores): each row takes the chunk length it takes alone
// (parallel.h), never one chosen for the whole batch, so a row of any batch is the row alone bit for bit:
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
// A quantized cache (cache.KVCache: --kv-dtype int8, --kt-dtype int8/int4) is read as stored: int8 k
// and v with k_scale, v_scale (B_max, n_kv, S_max) and chan (B_max, n_kv, d), K[p] = k[p] k_scale[p]
// chan, V[p] = v[p] v_scale[p]; an int8 K^T (int8 k_t) or an int4 one (uint8 k_t (B_max, n_kv, d,
// S_max / 2 + 1 rounded up to 16), two positions per byte) with kt_scale (B_max, n_kv, S_max), K^T[c, p] = k_t[c, p]
// kt_scale[p] chan[c]. chan is folded into q (and q_hat), the per-position scales into the logits of
// pass A and step 2 and into step 2's softmax weights: nothing is dequantized into memory.
// Buffers are reused across calls (one workspace that only grows, on huge pages).
// Threads: torch's OpenMP team, sized by torch.get_num_threads(), claiming units dynamically; with
// chunks (any row of more than one), passes A, B-C and D of each bh are tasks of one list, each
// waiting only for its own bh's earlier passes (run_stages); a bh of one chunk there computes what
// the path without chunks computes for it, bit for bit.
//
// The passes live in headers, one step each: sparq_problem.h (the problem), sparq_select.h (top-k
// without sorting, pass C), sparq_step1.h (passes A and B), sparq_step2.h (pass D); this file holds
// the scratch layout, the threading over (row, head, chunk) units and the op's registration.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
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
  const int64_t most_chunks = P.most_chunks();  // a merge concatenates a bh's chunk candidates
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

// The chunked path's three stages as one list of tasks (parallel.h run_tasks): pass A of each chunk
// (stage 0), then the chunk's weights and candidates once every chunk of its bh has its max and sum
// (stage 1), then the bh's merge and attention once all its chunks have candidates (stage 2). The
// list runs a bh's later stages a few bh behind its pass A, so the threads overlap the stages of
// different bh instead of waiting at a barrier after each. fn(stage, unit, slot): unit is a chunk
// (stages 0, 1) or a bh (stage 2).
template <class F>
static void run_stages(const Problem& P, int nt, F& fn) {
  const int64_t BH = P.B * P.H, units = P.units();
  struct Task { int32_t stage; int64_t unit; };
  std::vector<Task> tasks;
  tasks.reserve(2 * units + BH);
  // stage 1 of a bh follows its pass A by enough tasks for every thread to have claimed that pass A
  const int64_t per_bh = std::max<int64_t>(1, units / BH);
  const int64_t lag = std::max<int64_t>(1, (nt + per_bh - 1) / per_bh);
  for (int64_t i = 0; i < BH + 2 * lag; ++i) {
    if (i < BH)
      for (int64_t u = P.unit0[i]; u < P.unit0[i + 1]; ++u) tasks.push_back({0, u});
    if (i >= lag && i - lag < BH)
      for (int64_t u = P.unit0[i - lag]; u < P.unit0[i - lag + 1]; ++u) tasks.push_back({1, u});
    if (i >= 2 * lag) tasks.push_back({2, i - 2 * lag});
  }
  // done[stage][bh]: the bh's finished chunks of stages 0 and 1
  std::unique_ptr<std::atomic<int32_t>[]> done(new std::atomic<int32_t>[2 * BH]);
  for (int64_t i = 0; i < 2 * BH; ++i) done[i].store(0, std::memory_order_relaxed);
  auto bh_of = [&](const Task& t) -> int64_t { return t.stage == 2 ? t.unit : P.unit_bh[t.unit]; };
  auto ready = [&](int64_t i) {
    const Task& t = tasks[i];
    if (t.stage == 0) return true;
    const int64_t bh = bh_of(t);
    return done[(t.stage - 1) * BH + bh].load(std::memory_order_acquire) == (int32_t)P.chunks(bh);
  };
  auto run_one = [&](int64_t i, int slot) {
    const Task& t = tasks[i];
    fn(t.stage, t.unit, slot);
    if (t.stage < 2) done[t.stage * BH + bh_of(t)].fetch_add(1, std::memory_order_release);
  };
  run_tasks(nt, (int64_t)tasks.size(), ready, run_one);
}

template <typename KT, typename KTT, typename QT>
static void run(const Problem& P, const QT* q, const KT* k, const KTT* kt, const KT* v, QT* out) {
  const int64_t BH = P.B * P.H;
  const int64_t units = P.units();
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), units));  // slots
  const int64_t g = P.g;
  const bool single = units == BH;  // one unit per bh: everything in the slot's own buffers
  const int64_t len = single ? P.S : P.most_cs;
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
    const KTT** rows;
    RunState* st;
  };
  auto slot_of = [&](int slot) {
    float* T = base + slot * slot_floats;
    Slot x;
    x.qf = T + L.qf;
    x.order = reinterpret_cast<int32_t*>(T + L.order);
    x.i1 = reinterpret_cast<int32_t*>(T + L.i1);
    x.qhat = T + L.qhat;
    x.rows = reinterpret_cast<const KTT**>(T + L.rows);
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
      const KTT* ktbh = kt + b * P.kts0 + h * P.kts1;
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
      pass_a<KT, KTT>(P, P.r, x.rows, kbh, x.qmask, x.qhat, 0, w.S, x.E, ldE, x.st, x.mb, nblk,
                      P.kt_scale_of(bh / P.H, bh % P.H));
      for (int64_t hh = 0; hh < g; ++hh) block_weights(x.mb + hh * nblk, nb, x.st[hh].m, hsum(load(x.st[hh].z)));
      const int64_t nsel = select_top(x.E, ldE, x.mb, nblk, g, 0, w.n_scored, w.m, x.sc, x.bmax, x.ss, x.si);
      locals_into(w, x.pos);
      std::copy(x.si, x.si + nsel, x.pos + w.n_local);
      const int64_t kk = w.n_local + nsel;
      if (P.mean_v) {  // fused multiply-adds in position order, as the chunked path's (bit for bit)
        for (int64_t hh = 0; hh < g; ++hh) {
          float a = 0.f;
          for (int64_t j = 0; j < kk; ++j) a = std::fma(x.E[hh * ldE + x.pos[j]], x.mb[hh * nblk + x.pos[j] / kBlock], a);
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
      const int64_t bh = P.unit_bh[u], c = u - P.unit0[bh], cs = P.cs_of(bh);
      const int64_t p0 = c * cs, p1 = std::min(P.len[bh / P.H], p0 + cs);
      float* stat = ustat(u);
      const KT* kbh = setup_bh(x, bh);
      reset_state(x);
      pass_a<KT, KTT>(P, P.r, x.rows, kbh, x.qmask, x.qhat, p0, p1, uE(u), ldE, x.st, umb(u), nblk,
                      P.kt_scale_of(bh / P.H, bh % P.H));
      for (int64_t hh = 0; hh < g; ++hh) { stat[hh] = x.st[hh].m; stat[g + hh] = hsum(load(x.st[hh].z)); }
    } else if (phase == 1) {
      const int64_t bh = P.unit_bh[u], u0 = P.unit0[bh], nc = P.chunks(bh), cs = P.cs_of(bh);
      const Row w = row_of(P, bh / P.H);
      const int64_t p0 = (u - u0) * cs, p1 = std::min(w.S, p0 + cs);
      int32_t* count = reinterpret_cast<int32_t*>(ucand(u));
      *count = 0;
      for (int64_t hh = 0; hh < g; ++hh)
        chunk_block_weights(ustat, u0, nc, g, hh, umb(u) + hh * nblk, (p1 - p0 + kBlock - 1) / kBlock);
      const int64_t shi = std::min(p1, w.n_scored);
      if (shi > p0) {
        const int64_t cnt = select_top(uE(u), ldE, umb(u), nblk, g, p0, shi, w.m, x.sc, x.bmax, x.ss, x.si);
        *count = (int32_t)cnt;
        std::copy(x.ss, x.ss + cnt, ucand(u) + 16);
        std::copy(x.si, x.si + cnt, reinterpret_cast<int32_t*>(ucand(u) + 16 + m1));
      }
    } else {
      const int64_t bh = u, u0 = P.unit0[bh], nc = P.chunks(bh), cs = P.cs_of(bh);
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
      if (P.mean_v) {  // as the path without chunks sums them: a bh of one chunk is that path's bit for bit
        for (int64_t hh = 0; hh < g; ++hh) x.alpha[hh] = 0.f;
        for (int64_t j = 0; j < kk; ++j) {
          const int64_t c = x.pos[j] / cs, o = x.pos[j] - c * cs;
          const int64_t uu = u0 + c;
          for (int64_t hh = 0; hh < g; ++hh)
            x.alpha[hh] = std::fma(uE(uu)[hh * ldE + o], umb(uu)[hh * nblk + o / kBlock], x.alpha[hh]);
        }
      }
      prefetch_rows(P, k, v, bh / P.H, bh % P.H, x.pos, kk);
      setup_bh(x, bh);  // q in fp32 for this bh (cheap)
      attend<KT, QT>(P, k, v, bh / P.H, bh % P.H, x.qf, x.pos, kk, P.mean_v ? x.alpha : nullptr, x.lg, x.y, out);
    }
  };
  run_stages(P, nt, fn);
}

at::Tensor decode_impl(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                      const at::Tensor& v, const at::Tensor& v_sum, int64_t length, int64_t r, int64_t k_top,
                      int64_t local, bool mean_v, const std::optional<at::Tensor>& lengths,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                      const std::optional<at::Tensor>& chan, const std::optional<at::Tensor>& kt_scale,
                      int64_t kt_bits) {
  const char* op = "sparq::decode_cpu";
  TORCH_CHECK(q.dim() == 4 && v_sum.dim() == 3, op, ": expected q (B, n_kv, g, d), v_sum (B_max, n_kv, d)");
  const int64_t B = q.size(0), H = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(q.device().is_cpu() && v_sum.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(v_sum.size(0) >= B && v_sum.size(1) == H && v_sum.size(2) == d && v_sum.scalar_type() == at::kFloat &&
                  v_sum.stride(2) == 1, op, ": v_sum must be fp32 (B_max, n_kv, d), contiguous in d");
  TORCH_CHECK(1 <= r && r <= d, op, ": r must be in [1, d]");
  TORCH_CHECK(k_top >= 1 && 0 <= local && local <= k_top, op, ": need k_top >= 1 and 0 <= local <= k_top");
  TORCH_CHECK(length < (int64_t(1) << 31), op, ": length too large");
  const auto qdt = q.scalar_type();
  TORCH_CHECK(qdt == at::kFloat || qdt == at::kBFloat16 || qdt == at::kHalf, op, ": unsupported q dtype");

  const std::vector<int64_t> len = row_lengths(lengths, B, length, op);
  Problem P{};
  const CacheKind cache = bind_cache(P, op, B, H, d, length, k, k_t, v, k_scale, v_scale, chan, kt_scale, kt_bits);
  P.B = B; P.H = H; P.g = g; P.d = d; P.r = r; P.k_top = k_top; P.local = local; P.len = len.data();
  P.S = *std::max_element(len.begin(), len.end());
  P.kk = std::min(k_top, P.S);
  P.m = P.kk - std::min(local, P.S);  // the most any row chooses
  P.mean_v = mean_v;
  P.qs0 = q.stride(0); P.qs1 = q.stride(1); P.qs2 = q.stride(2); P.qs3 = q.stride(3);
  P.vss0 = v_sum.stride(0); P.vss1 = v_sum.stride(1);
  P.vsum = v_sum.data_ptr<float>();
  P.cs = row_chunk_lengths(len, H, thread_count(), std::numeric_limits<int64_t>::max());
  P.most_cs = *std::max_element(P.cs.begin(), P.cs.end());
  split_rows(len, H, P.cs, &P.unit0, &P.unit_bh);

  at::Tensor out = at::empty({B, H, g, d}, q.options().memory_format(at::MemoryFormat::Contiguous));

  dispatch_cache(q, k, k_t, v, out, cache,
                 [&](auto qp, auto kp, auto ktp, auto vp, auto op) { run(P, qp, kp, ktp, vp, op); });
  return out;
}

at::Tensor decode_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                      const at::Tensor& v, const at::Tensor& v_sum, int64_t length, int64_t r, int64_t k_top,
                      int64_t local, bool mean_v, const std::optional<at::Tensor>& lengths) {
  return decode_impl(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v, lengths, std::nullopt, std::nullopt,
                     std::nullopt, std::nullopt, 4);
}

at::Tensor decode_quant_cpu(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                            const at::Tensor& v, const at::Tensor& v_sum, int64_t length, int64_t r, int64_t k_top,
                            int64_t local, bool mean_v, const std::optional<at::Tensor>& lengths,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const at::Tensor& chan, const std::optional<at::Tensor>& kt_scale, int64_t kt_bits) {
  return decode_impl(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v, lengths, k_scale, v_scale, chan, kt_scale,
                     kt_bits);
}

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("decode_cpu", &sparq_cpu::decode_cpu);
  m.impl("decode_quant_cpu", &sparq_cpu::decode_quant_cpu);
}
