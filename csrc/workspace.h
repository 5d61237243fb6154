// The scratch memory of the CPU kernels: one growing buffer on huge pages, shared by every call
// of every kernel (under its lock), and round_up for the aligned per-thread / per-unit offsets
// into it.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace sparq_cpu {

// ---------------------------------------------------------------------------------------------
// Workspace: one buffer that only grows (big allocations are returned to the OS on free, so a
// fresh one per call would page-fault every step).
// ---------------------------------------------------------------------------------------------

struct Workspace {
  std::mutex mu;
  float* data = nullptr;
  size_t cap = 0;  // floats
  float* get(size_t n) {
    if (n > cap) {
      std::free(data);
      // 2 MiB-aligned and backed by huge pages where the kernel allows: the scratch is touched
      // between long streams over the cache, and TLB misses are expensive (more so in a VM).
      constexpr size_t kHuge = size_t(2) << 20;
      size_t bytes = (n * sizeof(float) + kHuge - 1) / kHuge * kHuge;
      data = static_cast<float*>(std::aligned_alloc(kHuge, bytes));
      TORCH_CHECK(data != nullptr, "sparq::decode_cpu: out of memory for the workspace");
#ifdef MADV_HUGEPAGE
      madvise(data, bytes, MADV_HUGEPAGE);
#endif
      cap = bytes / sizeof(float);
    }
    return data;
  }
};
// inline, not static: one workspace (and one lock) for every kernel source that includes this
inline Workspace& workspace() {
  static Workspace* w = new Workspace();  // never destroyed: safe at interpreter exit
  return *w;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace sparq_cpu
