// Thread scheduling shared by the CPU kernels: the threads to use, phases of units claimed by
// torch's OpenMP team, per-row live lengths and the S chunks of the attention kernels.
#pragma once

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // _mm_pause
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <queue>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "workspace.h"  // round_up

namespace sparq_cpu {

// ---------------------------------------------------------------------------------------------
// Threads: torch's OpenMP team (the same threads as torch's own ops, so nothing else spins on the
// cores between calls). Work comes in phases of independent units that the threads claim with an
// atomic counter (dynamic balance: a thread the OS starts late finds the units taken); between
// phases a thread waits only for the units others have claimed.
// (A separate helper pool was tried: its spinning threads and torch's OpenMP threads then
// competed for the 2 cores and both slowed down by milliseconds per call.)
// ---------------------------------------------------------------------------------------------

struct Job {
  static constexpr int kMaxPhases = 4;
  int phases = 0;
  int64_t total[kMaxPhases] = {};
  std::atomic<int64_t> next[kMaxPhases];
  std::atomic<int64_t> done[kMaxPhases];
  Job() {
    for (int i = 0; i < kMaxPhases; ++i) { next[i].store(0); done[i].store(0); }
  }
};

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spin until done() (pausing, then yielding the core after 20000 tries).
template <class Done>
static inline void spin_until(Done&& done) {
  for (int64_t spins = 0; !done(); ++spins) {
    if (spins < 20000) cpu_relax();
    else std::this_thread::yield();
  }
}

template <class F>
static void participate(Job& job, F& fn, int slot) {
  for (int ph = 0; ph < job.phases; ++ph) {
    for (;;) {
      const int64_t u = job.next[ph].fetch_add(1, std::memory_order_relaxed);
      if (u >= job.total[ph]) break;
      fn(ph, u, slot);
      job.done[ph].fetch_add(1, std::memory_order_release);
    }
    // the next phase reads what this one wrote: wait for the units others claimed
    spin_until([&] { return job.done[ph].load(std::memory_order_acquire) >= job.total[ph]; });
  }
}

// work(slot) on nt threads of torch's OpenMP team (slots 0 .. nt - 1), or on this thread alone.
template <class W>
static void on_team(int nt, W&& work) {
#ifdef _OPENMP
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    work(omp_get_thread_num());
    return;
  }
#endif
  work(0);
}

// Phases of units over up to nthreads threads: fn(phase, unit, slot) with slot < nthreads.
template <class F>
static void run_phases(int nthreads, std::initializer_list<int64_t> units, F& fn) {
  Job job;
  job.phases = (int)units.size();
  int64_t most = 0;
  int i = 0;
  for (int64_t n : units) { job.total[i++] = n; most = std::max(most, n); }
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, most));
  on_team(nt, [&](int slot) { participate(job, fn, slot); });
}

// Tasks in a list whose order respects their dependencies: the threads claim tasks in list order
// (one atomic counter) and start each once ready(t) says its inputs are done; fn(t, slot) runs it.
// Every task a task waits for comes earlier in the list, so a thread has claimed it already and no
// wait can deadlock. Unlike run_phases there is no barrier: a thread that finishes its part of one
// stage goes on to a later stage of work whose inputs are done (run_phases left one of 2 threads
// idle while the other attended to the second of 3 KV heads; docs/NOTES.md).
template <class Ready, class F>
static void run_tasks(int nthreads, int64_t ntasks, Ready& ready, F& fn) {
  std::atomic<int64_t> next{0};
  auto work = [&](int slot) {
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= ntasks) break;
      spin_until([&] { return ready(t); });
      fn(t, slot);
    }
  };
  on_team((int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntasks)), work);
}

// Threads to use: torch's intra-op setting, 1 inside a parallel region of torch's.
static inline int thread_count() {
  return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
}

// The GEMVs' split: rows [0, N) of a weight in blocks of about N / (16 nthreads) rows (a multiple of `align`,
// 4 by default, so the kernels' blocks of rows stay whole), each thread owning a contiguous range of them that
// it claims front to back; a thread done with its own range claims from the fronts of the others' (a thread
// the OS starts late, or one on a core with less bandwidth that moment, leaves its tail to the others, to
// within a block). fn(n0, n1) runs on torch's threads. Each thread's stream stays sequential for the
// prefetchers: units of at most 64 rows, taken in turn by the threads, streamed a 17.7 MB int4 weight at
// 17 GB/s, two contiguous units per thread at 38 (docs/NOTES.md). Against two units per thread, owned ranges
// ran a step's GEMVs 1.04x faster in fp32 and 1.03x in bf16 on a Zen 3 (paired runs, docs/NOTES.md).
template <class F>
static void over_weight_rows(int64_t N, F&& fn, int64_t align = 4) {
  const int nt = thread_count();
  const int64_t rows = round_up(std::max<int64_t>(1, (N + 16 * nt - 1) / (16 * nt)), align);
  const int64_t blocks = (N + rows - 1) / rows;
  const int teams = (int)std::max<int64_t>(1, std::min<int64_t>(nt, blocks));
  if (teams == 1) return fn(0, N);
  struct alignas(64) Range {  // blocks [next, end) of one thread's range; a line each: no false sharing
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Range[]> ranges(new Range[teams]);
  for (int t = 0; t < teams; ++t) {
    ranges[t].next.store(blocks * t / teams, std::memory_order_relaxed);
    ranges[t].end = blocks * (t + 1) / teams;
  }
  on_team(teams, [&](int slot) {  // the parallel region's end is the barrier: every block is done after it
    for (int i = 0; i < teams; ++i) {  // its own range first, then the others' in turn
      Range& r = ranges[(slot + i) % teams];
      for (int64_t b; (b = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;)
        fn(b * rows, std::min(N, (b + 1) * rows));
    }
  });
}

// The GEMVs' output y (M, N), in its own dtype (x's), written by the threads unit by unit:
// rows(n0, n1, out, ldo) computes weight rows [n0, n1) in fp32 into out[m * ldo + (n - n0)]. An fp32 y
// is written in place; a 16-bit y through a small fp32 block of 64 weight rows, so no fp32 (M, N)
// intermediate, no second pass and no conversion op after the call.
template <class Rows>
static void over_weight_rows_into(at::Tensor& y, Rows&& rows, int64_t align = 4) {
  const int64_t M = y.size(0), N = y.size(1);
  const auto t = y.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "GEMV output: fp32, bf16 or fp16");
  over_weight_rows(N, [&](int64_t n0, int64_t n1) {
    if (t == at::kFloat) return rows(n0, n1, y.data_ptr<float>() + n0, N);
    constexpr int64_t kRows = 64;
    float stack[16 * kRows];
    std::vector<float> heap(M > 16 ? M * kRows : 0);
    float* block = M > 16 ? heap.data() : stack;
    for (int64_t b0 = n0; b0 < n1; b0 += kRows) {
      const int64_t nb = std::min<int64_t>(kRows, n1 - b0);
      rows(b0, b0 + nb, block, nb);
      for (int64_t m = 0; m < M; ++m) {
        const float* src = block + m * nb;
        if (t == at::kBFloat16) {
          c10::BFloat16* dst = y.data_ptr<c10::BFloat16>() + m * N + b0;
          for (int64_t i = 0; i < nb; ++i) dst[i] = c10::BFloat16(src[i]);
        } else {
          c10::Half* dst = y.data_ptr<c10::Half>() + m * N + b0;
          for (int64_t i = 0; i < nb; ++i) dst[i] = c10::Half(src[i]);
        }
      }
    }
  }, align);
}

// ---------------------------------------------------------------------------------------------
// Ragged batches: each batch row b reads its own live positions [0, len[b]). Every (row, KV head)
// "bh" splits into ceil(len[b] / cs[b]) chunks of its row's own chunk length cs[b]: what
// chunk_length chooses for that row alone (row_chunk_lengths), so a row's split, and with it the
// order of its sums (chunk partials combined, SparQ's chunk candidates merged), depends on its own
// length and the thread count only. A row in any batch is then bit for bit the row alone: a server
// stepping whichever rows are busy relies on it. The cost: a batch that would keep the threads
// busy with fewer chunks may split its rows into more. The units are numbered bh by bh.
// ---------------------------------------------------------------------------------------------

// The live length of each of the B rows: `length` for all (no lengths tensor), else lengths[b],
// checked to lie in [1, length].
static inline std::vector<int64_t> row_lengths(const std::optional<at::Tensor>& lengths, int64_t B, int64_t length,
                                               const char* op) {
  if (!lengths.has_value() || !lengths->defined()) return std::vector<int64_t>(B, length);
  const at::Tensor& t = *lengths;
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == B &&
                  (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt),
              op, ": lengths must be a CPU (B,) integer tensor with B = ", B, ", got ", t.sizes());
  const at::Tensor l = t.to(at::kLong).contiguous();
  std::vector<int64_t> len(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + B);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(1 <= len[b] && len[b] <= length, op, ": lengths[", b, "] = ", len[b], " outside [1, ", length, "]");
  return len;
}

// Fraction of the time nthreads threads are busy when they claim the units of chunk length cs in
// order (each takes the next unit when it finishes one; a unit costs its positions plus a fixed
// overhead of 256): total work / (nthreads x the last finish).
static inline double claim_efficiency(const std::vector<int64_t>& len, int64_t H, int nthreads, int64_t cs) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int t = 0; t < nthreads; ++t) free_at.push(0.0);
  double total = 0.0, last = 0.0;
  for (int64_t l : len)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t p = 0; p < l; p += cs) {
        const double cost = (double)std::min(cs, l - p) + 256.0;
        const double end = free_at.top() + cost;
        free_at.pop();
        free_at.push(end);
        total += cost;
        last = std::max(last, end);
      }
  return total / (nthreads * last);
}

// The chunk length of rows `len`: the fewest chunks of the longest row (chunks >= 1024 positions,
// at most max_cs, a multiple of 64) that keep the threads >= 90% busy, else the best balance found.
// The kernels ask it of one row at a time (row_chunk_lengths).
static inline int64_t chunk_length(const std::vector<int64_t>& len, int64_t H, int nthreads, int64_t max_cs) {
  const int64_t S = len.empty() ? 1 : *std::max_element(len.begin(), len.end());
  auto cs_for = [&](int nc) { return std::min(round_up((S + nc - 1) / nc, 64), std::max<int64_t>(64, max_cs / 64 * 64)); };
  if (nthreads <= 1) return cs_for(1);
  int64_t best = cs_for(1);
  double best_eff = claim_efficiency(len, H, nthreads, best);
  for (int nc = 2; nc <= 16 && best_eff < 0.9; ++nc) {
    if (S / nc < 1024) break;
    const int64_t cs = cs_for(nc);
    const double e = claim_efficiency(len, H, nthreads, cs);
    if (e > best_eff + 1e-9) { best = cs; best_eff = e; }
  }
  return best;
}

// Each row's chunk length: chunk_length of a batch of that row alone (its length, the same H, thread
// count and max_cs), never of the whole batch; a row of the previous row's length reuses its answer.
static inline std::vector<int64_t> row_chunk_lengths(const std::vector<int64_t>& len, int64_t H, int nthreads,
                                                     int64_t max_cs) {
  std::vector<int64_t> cs(len.size());
  for (size_t b = 0; b < len.size(); ++b)
    cs[b] = b > 0 && len[b] == len[b - 1] ? cs[b - 1] : chunk_length({len[b]}, H, nthreads, max_cs);
  return cs;
}

// unit0[bh] = first unit of bh (bh = b * H + h, ceil(len[b] / cs[b]) of them), unit0[B * H] = the
// number of units; unit_bh[u] = its bh.
static inline void split_rows(const std::vector<int64_t>& len, int64_t H, const std::vector<int64_t>& cs,
                              std::vector<int64_t>* unit0, std::vector<int32_t>* unit_bh) {
  const int64_t B = (int64_t)len.size();
  unit0->assign(B * H + 1, 0);
  unit_bh->clear();
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t n = (len[bh / H] + cs[bh / H] - 1) / cs[bh / H];
    (*unit0)[bh + 1] = (*unit0)[bh] + n;
    for (int64_t c = 0; c < n; ++c) unit_bh->push_back((int32_t)bh);
  }
}

}  // namespace sparq_cpu
