// Thread scheduling shared by the CPU kernels: the threads to use, phases of units claimed by
// torch's OpenMP team, and the number of S chunks for the attention kernels.
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
#include <initializer_list>
#include <thread>

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
    for (int64_t spins = 0; job.done[ph].load(std::memory_order_acquire) < job.total[ph]; ++spins) {
      if (spins < 20000) cpu_relax();
      else std::this_thread::yield();
    }
  }
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
#ifdef _OPENMP
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    participate(job, fn, omp_get_thread_num());
    return;
  }
#endif
  participate(job, fn, 0);
}

// Threads to use: torch's intra-op setting, 1 inside a parallel region of torch's.
static inline int thread_count() {
  return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
}

// How many chunks to split S into: enough units to balance the threads, chunks >= 1024 positions.
static inline int choose_chunks(int64_t BH, int64_t S, int nthreads) {
  if (nthreads <= 1) return 1;
  auto efficiency = [&](int64_t units) {
    const int64_t per = (units + nthreads - 1) / nthreads;
    return (double)units / (double)(per * nthreads);
  };
  int best = 1;
  double best_eff = efficiency(BH);
  for (int nc = 2; nc <= 16; ++nc) {
    if (S / nc < 1024) break;
    if (best_eff >= 0.9) break;
    const double e = efficiency(BH * nc);
    if (e > best_eff + 1e-9) { best = nc; best_eff = e; }
  }
  return best;
}

}  // namespace sparq_cpu
