// The problem one SparQ call solves: sizes, strides, ragged rows and the chunking over S.
// Part of the fused SparQ kernel (sparq_decode.cpp, whose header comment describes the passes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace sparq_cpu {
namespace {

// Step 1's per-position scales of one (row, KV head), as stored: fp32, or a K^T's own scales in bf16
// (--kt-scale-dtype bfloat16); both nullptr where step 1 reads a float source.
struct PosScales {
  const float* f32 = nullptr;
  const bf16* b16 = nullptr;
};

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
  // A quantized cache (cache.KVCache; nullptr otherwise). int8 K and V: K[p] = k[p] k_scale[p] chan,
  // V[p] = v[p] v_scale[p]. Step 1's source (K^T, or K with layout "once") when quantized: its
  // per-position scales kt_scale (k_scale for K itself; kt_scale_b16 instead for a K^T's own bf16
  // scales; neither for a K^T without position scales, cache.py's --kt-scale-dtype none) and chan, folded
  // into q_hat.
  const float *k_scale = nullptr, *v_scale = nullptr, *chan = nullptr, *kt_scale = nullptr;
  const bf16* kt_scale_b16 = nullptr;
  int64_t ksc0 = 0, ksc1 = 0, vsc0 = 0, vsc1 = 0, chs0 = 0, chs1 = 0, ktsc0 = 0, ktsc1 = 0;
  const float* chan_of(int64_t b, int64_t h) const { return chan ? chan + b * chs0 + h * chs1 : nullptr; }
  bool step1_quantized = false;  // step 1's source holds K / chan (int8 or int4): chan goes into q_hat
  bool step1_scaled() const { return step1_quantized; }
  PosScales kt_scale_of(int64_t b, int64_t h) const {
    const int64_t at = b * ktsc0 + h * ktsc1;
    return {kt_scale ? kt_scale + at : nullptr, kt_scale_b16 ? kt_scale_b16 + at : nullptr};
  }
  // ragged rows and chunking over S (parallel.h: each row's chunk length is its own, as if alone)
  const int64_t* len;            // (B,) live length of each row
  std::vector<int64_t> cs;       // (B,) each row's chunk length (multiple of 64)
  int64_t most_cs;               // the largest of them: a chunk's buffers are sized by it
  std::vector<int64_t> unit0;    // (B * H + 1,) first unit of each bh: bh owns ceil(len / cs) chunks
  std::vector<int32_t> unit_bh;  // the bh of each unit
  int64_t units() const { return unit0.back(); }
  int64_t chunks(int64_t bh) const { return unit0[bh + 1] - unit0[bh]; }
  int64_t cs_of(int64_t bh) const { return cs[bh / H]; }
  int64_t most_chunks() const {  // the most chunks of one bh (a merge concatenates its chunks' candidates)
    int64_t n = 1;
    for (size_t bh = 0; bh + 1 < unit0.size(); ++bh) n = std::max(n, unit0[bh + 1] - unit0[bh]);
    return n;
  }
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

constexpr int64_t kBlock = 32;  // positions per block of pass A (two vectors)

// An int4 K^T (cache.KVCache, --kt-dtype int4): two positions per byte, the even one in the low
// nibble, each stored as q + 8. A row pointer of this type points at bytes; position p is in byte p / 2.
struct int4x2 {
  uint8_t bits;
};
template <typename T> constexpr int64_t kPerElement = 1;  // positions per element of a K^T row
template <> constexpr int64_t kPerElement<int4x2> = 2;
// An int3 K^T (--kt-dtype int3, without position scales): blocks of 32 positions in 12 bytes, position j of a
// block its low two bits at bits 2 (j % 4) of byte j / 4 and its high bit at bit j % 8 of byte 8 + j / 8, each
// stored as q + 4 (cache.unpack_int3). A row pointer of this type points at bytes; pass A reads whole blocks
// (its blocks start at multiples of 32 positions: chunks are multiples of 64).
struct int3x32 {
  uint8_t bits;
};
constexpr int64_t kInt3Block = 32, kInt3BlockBytes = 12;
// The element of a K^T row where position p is (for int3 the byte its block starts at)
template <typename T> constexpr int64_t kt_element(int64_t p) {
  if constexpr (std::is_same_v<T, int3x32>) return p / kInt3Block * kInt3BlockBytes;
  else return p / kPerElement<T>;
}

#define SPARQ_INLINE inline __attribute__((always_inline))

}  // namespace
}  // namespace sparq_cpu
