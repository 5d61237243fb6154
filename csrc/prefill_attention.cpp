// Causal prefill attention for CPU: the T queries of a prompt chunk over the keys before and in it,
// flash-style (online softmax over blocks of keys; no T x S score matrix in memory).
//
// Registered as the CPU kernel of sparq::prefill_cpu, whose schema (and fake implementation) kernels.py
// defines:
//   prefill_cpu(Tensor q, Tensor k, Tensor v) -> Tensor
// q (B, H, T, d), k and v (B, n_kv, S_k, d) with S_k >= T, any strides but contiguous along d; all of
// one float dtype (fp32, bf16, fp16). The queries are the last T of the S_k positions: query t sees
// keys j <= t + S_k - T. y = softmax(q k^T / sqrt(d)) v per query head, head h reading KV head
// h / (H / n_kv) -> (B, H, T, d) contiguous, q's dtype. It computes what attention.prefill_attention
// computes with SDPA (window None, no soft-cap), in fp32.
//
// Why not SDPA: torch's CPU flash kernel ran SmolLM2's bf16 prefill attention at ~140 GFLOP/s on
// 2 Zen 5 cores, half of a 1k-token prefill, while the GEMMs beside it ran near 1 TFLOP/s (docs/NOTES.md).
//
// Work unit: (batch row, KV head, block of BQ queries); its rows are the g query heads of those
// queries, t-major (row i = query t0 + i / g, head i % g), so a group of 4 rows shares its causal
// limit up to one position. Per block of BK keys (R = kTileRows rows at a time):
//   scores  S (rows x BK) = Q K^T: K's block transposed to fp32 (dp x BK) once per unit and block,
//           then for each channel c one broadcast of q[i][c] against 4 vectors of 16 keys (R rows x
//           64 keys of accumulators in registers);
//   softmax running max m and sum l per row, O rescaled when m grows; masked keys weigh 0;
//   P V     O (rows x dp) += P V: V's block widened to fp32 once, each weight broadcast against 4
//           vectors of 16 channels (R rows).
// The head dim is padded to dp = a multiple of 16 with zeros in Q, K^T and V (any d works).
// Units are claimed longest first (the last query blocks see the most keys) by torch's OpenMP team.
//
// bf16 inputs where the build targets AVX512_BF16 take unit_bf16 (below): the same unit with vdpbf16ps
// dotting bf16 pairs into fp32 lanes, twice the products per instruction of the widened fp32 FMAs.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace sparq_cpu {
namespace {

constexpr int64_t kBQ = 64;  // queries per unit
constexpr int64_t kBK = 64;  // keys per block: 4 vectors of 16

// Rows per micro-kernel call: R rows x 4 vectors of 16 lanes of accumulators, plus the 4 vectors loaded.
// AVX-512 has 32 registers: 4 rows (16 + 4). AVX2's V is two 8-lane halves in 16 registers, where 4 rows
// (32 + 8 halves) spilled: 1 row (8 halves, the loads folded into the FMAs) ran 1.4x faster on a Zen 3,
// 2 x 2 and 3 x 2 tiles in between (docs/NOTES.md).
#if defined(SPARQ_AVX2)
constexpr int kTileRows = 1;
#else
constexpr int kTileRows = 4;
#endif

struct Dims {
  int64_t B, H, n_kv, g, T, S, d, dp, off;  // off = S - T: query t sees keys j <= t + off
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
};

// Per-thread buffers of one unit: fp32, and unit_bf16's bf16 copies (raw bits) of Q, K^T, V and P.
struct Buffers {
  std::vector<float> q, o, p, kt, vf, m, l;
  std::vector<uint16_t> q16, kt16, v16, p16;
  // Both units' running state, sized and started: O = 0, m = -inf, l = 0 per row, P's fp32 scores.
  void start_rows(int64_t rows, int64_t dp) {
    o.resize(rows * dp);
    p.resize(rows * kBK);
    m.resize(rows);
    l.resize(rows);
    std::fill(o.begin(), o.begin() + rows * dp, 0.f);
    std::fill(m.begin(), m.begin() + rows, kNegInf);
    std::fill(l.begin(), l.begin() + rows, 0.f);
  }
  void size_for(int64_t rows, int64_t dp) {
    start_rows(rows, dp);
    q.resize(rows * dp);
    kt.resize(dp * kBK);
    vf.resize(kBK * dp);
  }
  void size_bf16_for(int64_t rows, int64_t dp) {
    start_rows(rows, dp);
    q16.resize(rows * dp);
    kt16.resize(dp * kBK);
    v16.resize(kBK * dp);
    p16.resize(rows * kBK);
  }
};

// S[r][j] for R rows of Q (dp apart) against the block's K^T (dp x kBK): R x 4 vectors of accumulators.
template <int R>
static inline void scores_rows(const float* q, int64_t dp, const float* kt, float* s) {
  V acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = vzero();
  for (int64_t c = 0; c < dp; ++c) {
    V kv[4];
    for (int x = 0; x < 4; ++x) kv[x] = load(kt + c * kBK + 16 * x);
    for (int r = 0; r < R; ++r) {
      const V qb = vset(q[r * dp + c]);
      for (int x = 0; x < 4; ++x) acc[r][x] = vfma(qb, kv[x], acc[r][x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) store(s + r * kBK + 16 * x, acc[r][x]);
}

// O[r][col, col + 16 NX) += sum_j P[r][j] V[j][...] for R rows, over the block's nb keys.
template <int R, int NX>
static inline void pv_rows(const float* p, const float* vf, int64_t dp, int64_t nb, int64_t col, float* o) {
  V acc[R][NX];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NX; ++x) acc[r][x] = load(o + r * dp + col + 16 * x);
  for (int64_t j = 0; j < nb; ++j) {
    V vv[NX];
    for (int x = 0; x < NX; ++x) vv[x] = load(vf + j * dp + col + 16 * x);
    for (int r = 0; r < R; ++r) {
      const V pb = vset(p[r * kBK + j]);
      for (int x = 0; x < NX; ++x) acc[r][x] = vfma(pb, vv[x], acc[r][x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NX; ++x) store(o + r * dp + col + 16 * x, acc[r][x]);
}

// O's columns [0, dp) in runs of 4 vectors of 16, then the 3, 2 or 1 left: run(nx, col), nx an
// std::integral_constant (a micro-kernel's vector count is its template argument).
template <class F>
static inline void by_column_runs(int64_t dp, F&& run) {
  int64_t col = 0;
  for (; col + 64 <= dp; col += 64) run(std::integral_constant<int, 4>{}, col);
  switch ((dp - col) / 16) {
    case 3: run(std::integral_constant<int, 3>{}, col); break;
    case 2: run(std::integral_constant<int, 2>{}, col); break;
    case 1: run(std::integral_constant<int, 1>{}, col); break;
    default: break;
  }
}

template <int R>
static inline void pv_cols(const float* p, const float* vf, int64_t dp, int64_t nb, float* o) {
  by_column_runs(dp, [&](auto nx, int64_t col) { pv_rows<R, decltype(nx)::value>(p, vf, dp, nb, col, o); });
}

// Rows [0, rows) in groups of kTileRows, then the rest one by one.
template <class FT, class F1>
static inline void by_tiles(int64_t rows, FT&& tile, F1&& one) {
  int64_t i = 0;
  for (; i + kTileRows <= rows; i += kTileRows) tile(i);
  for (; i < rows; ++i) one(i);
}

// The online softmax of one row over the block's scores s (kBK wide, `valid` leading keys count):
// p = exp(s - m_new) (0 past `valid`), l and O rescaled. valid <= 0: nothing to add.
static inline void softmax_row(float* s, int64_t valid, float& m, float& l, float* o, int64_t dp) {
  if (valid <= 0) {
    std::fill(s, s + kBK, 0.f);
    return;
  }
  M mask[4];
  V mx = vset(kNegInf);
  for (int x = 0; x < 4; ++x) {
    mask[x] = tail_mask(std::clamp<int64_t>(valid - 16 * x, 0, 16));
    mx = vmax_masked(mx, mask[x], load(s + 16 * x));
  }
  const float m_new = std::max(m, hmax(mx));
  V sum = vzero();
  for (int x = 0; x < 4; ++x) {
    const V e = vselect(mask[x], vexp(vsub(load(s + 16 * x), vset(m_new))), vzero());
    store(s + 16 * x, e);
    sum = vadd(sum, e);
  }
  if (m_new > m) {  // rescale what was summed under the old max (nothing yet when m = -inf)
    const float corr = std::exp(m - m_new);
    l *= corr;
    const V cv = vset(corr);
    for (int64_t c = 0; c < dp; c += 16) store(o + c, vmul(load(o + c), cv));
    m = m_new;
  }
  l += hsum(sum);
}

// O / l of the unit's rows -> out (B, H, T, d) contiguous.
template <class T>
static void write_out(const Dims& D, const Buffers& w, T* out, int64_t b, int64_t h, int64_t t0, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = 1.f / w.l[i];
    const float* src = w.o.data() + i * D.dp;
    T* dst = out + ((b * D.H + h * D.g + i % D.g) * D.T + t0 + i / D.g) * D.d;
    for (int64_t c = 0; c < D.d; ++c) dst[c] = static_cast<T>(src[c] * inv);
  }
}

template <class T>
static void unit(const Dims& D, const T* q, const T* k, const T* v, T* out, int64_t b, int64_t h, int64_t t0,
                 Buffers& w) {
  const int64_t g = D.g, dp = D.dp, d = D.d;
  const int64_t tb = std::min(kBQ, D.T - t0), rows = g * tb;
  w.size_for(rows, dp);  // O, m, l started
  const float scale = 1.f / std::sqrt((float)d);
  for (int64_t i = 0; i < rows; ++i) {  // Q rows, scaled, zero-padded to dp
    const T* src = q + b * D.qs0 + (h * g + i % g) * D.qs1 + (t0 + i / g) * D.qs2;
    float* dst = w.q.data() + i * dp;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * scale;
    std::fill(dst + d, dst + dp, 0.f);
  }
  const T* kh = k + b * D.ks0 + h * D.ks1;
  const T* vh = v + b * D.vs0 + h * D.vs1;
  const int64_t keys = t0 + tb + D.off;  // keys [0, keys) reach some query of the unit
  std::fill(w.kt.begin(), w.kt.end(), 0.f);  // the padding channels stay 0; a block writes the rest
  for (int64_t j0 = 0; j0 < keys; j0 += kBK) {
    const int64_t nb = std::min(kBK, keys - j0);
    if (nb < kBK) std::fill(w.kt.begin(), w.kt.end(), 0.f);  // a last, partial block: its missing keys score 0
    for (int64_t j = 0; j < nb; ++j) {  // K^T and V of the block in fp32
      const T* kr = kh + (j0 + j) * D.ks2;
      const T* vr = vh + (j0 + j) * D.vs2;
      float* vd = w.vf.data() + j * dp;
      for (int64_t c = 0; c < d; ++c) {
        w.kt[c * kBK + j] = static_cast<float>(kr[c]);
        vd[c] = static_cast<float>(vr[c]);
      }
      std::fill(vd + d, vd + dp, 0.f);
    }
    float* P = w.p.data();
    const float* Q = w.q.data();
    by_tiles(rows, [&](int64_t i) { scores_rows<kTileRows>(Q + i * dp, dp, w.kt.data(), P + i * kBK); },
             [&](int64_t i) { scores_rows<1>(Q + i * dp, dp, w.kt.data(), P + i * kBK); });
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t valid = std::min(nb, t0 + i / g + D.off - j0 + 1);  // keys j0 .. t + off
      softmax_row(P + i * kBK, valid, w.m[i], w.l[i], w.o.data() + i * dp, dp);
    }
    float* O = w.o.data();
    by_tiles(rows, [&](int64_t i) { pv_cols<kTileRows>(P + i * kBK, w.vf.data(), dp, nb, O + i * dp); },
             [&](int64_t i) { pv_cols<1>(P + i * kBK, w.vf.data(), dp, nb, O + i * dp); });
  }
  write_out(D, w, out, b, h, t0, rows);
}

#ifdef SPARQ_AVX512_BF16
// ---------------------------------------------------------------------------------------------
// unit_bf16: unit() for bf16 Q, K, V with vdpbf16ps, lane l += a[2l] b[2l] + a[2l+1] b[2l+1] in fp32.
// Q and K are bf16 already, so the score products are exact, as in the widened path (the 1/sqrt(d)
// goes onto the fp32 scores instead of into Q). P is rounded to bf16 for P V, as GPU flash attention
// does; its row sums l stay fp32. The blocks are laid out in 32-bit words of two bf16 (the pairs
// the instruction dots), every array dp or kBK words wide:
//   Q     q16[i][c2]   = (Q[i][2 c2], Q[i][2 c2 + 1])        rows x dp / 2
//   K^T   kt16[c2][j]  = (K[j][2 c2], K[j][2 c2 + 1])        dp / 2 x kBK
//   V     v16[j2][c]   = (V[2 j2][c], V[2 j2 + 1][c])        kBK / 2 x dp
//   P     p16[i][j2]   = (P[i][2 j2], P[i][2 j2 + 1])        rows x kBK / 2
// ---------------------------------------------------------------------------------------------

static inline __m512bh pair_everywhere(const uint16_t* p) {  // the bf16 pair at p in all 16 lanes
  return (__m512bh)_mm512_set1_epi32(_mm_cvtsi128_si32(_mm_loadu_si32(p)));
}

// S[r][j] (scaled) for R rows of Q (dp bf16 apart) against the block's K^T pairs: R x 4 vectors of 16 keys.
template <int R>
static inline void scores_rows_bf16(const uint16_t* q, int64_t dp, const uint16_t* kt, float scale, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_setzero_ps();
  for (int64_t c2 = 0; c2 < dp / 2; ++c2) {
    __m512bh kv[4];
    for (int x = 0; x < 4; ++x) kv[x] = (__m512bh)_mm512_loadu_si512(kt + 2 * (c2 * kBK + 16 * x));
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = pair_everywhere(q + r * dp + 2 * c2);
      for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], qb, kv[x]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) _mm512_storeu_ps(s + r * kBK + 16 * x, _mm512_mul_ps(acc[r][x], sc));
}

// O[r][col, col + 16 NX) += sum_j P[r][j] V[j][...] for R rows, over the block's nw key pairs.
template <int R, int NX>
static inline void pv_rows_bf16(const uint16_t* p, const uint16_t* v16, int64_t dp, int64_t nw, int64_t col, float* o) {
  __m512 acc[R][NX];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NX; ++x) acc[r][x] = _mm512_loadu_ps(o + r * dp + col + 16 * x);
  for (int64_t j2 = 0; j2 < nw; ++j2) {
    __m512bh vv[NX];
    for (int x = 0; x < NX; ++x) vv[x] = (__m512bh)_mm512_loadu_si512(v16 + 2 * (j2 * dp + col + 16 * x));
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = pair_everywhere(p + r * kBK + 2 * j2);
      for (int x = 0; x < NX; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pb, vv[x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NX; ++x) _mm512_storeu_ps(o + r * dp + col + 16 * x, acc[r][x]);
}

template <int R>
static inline void pv_cols_bf16(const uint16_t* p, const uint16_t* v16, int64_t dp, int64_t nw, float* o) {
  by_column_runs(dp, [&](auto nx, int64_t col) { pv_rows_bf16<R, decltype(nx)::value>(p, v16, dp, nw, col, o); });
}

static void unit_bf16(const Dims& D, const bf16* q, const bf16* k, const bf16* v, bf16* out, int64_t b, int64_t h,
                      int64_t t0, Buffers& w) {
  const int64_t g = D.g, dp = D.dp, d = D.d;
  const int64_t tb = std::min(kBQ, D.T - t0), rows = g * tb;
  w.size_bf16_for(rows, dp);  // O, m, l started
  const float scale = 1.f / std::sqrt((float)d);
  std::fill(w.q16.begin(), w.q16.begin() + rows * dp, 0);  // the padding channels stay 0
  for (int64_t i = 0; i < rows; ++i) {
    const bf16* src = q + b * D.qs0 + (h * g + i % g) * D.qs1 + (t0 + i / g) * D.qs2;
    for (int64_t c = 0; c < d; ++c) w.q16[i * dp + c] = src[c].x;
  }
  const bf16* kh = k + b * D.ks0 + h * D.ks1;
  const bf16* vh = v + b * D.vs0 + h * D.vs1;
  const int64_t keys = t0 + tb + D.off;  // keys [0, keys) reach some query of the unit
  std::fill(w.kt16.begin(), w.kt16.end(), 0);  // padding channels (and a partial block's keys) stay 0
  std::fill(w.v16.begin(), w.v16.end(), 0);
  for (int64_t j0 = 0; j0 < keys; j0 += kBK) {
    const int64_t nb = std::min(kBK, keys - j0), nw = (nb + 1) / 2;
    if (nb < kBK) {  // a last, partial block: its missing keys score 0 and weigh 0 (never NaN x 0)
      std::fill(w.kt16.begin(), w.kt16.end(), 0);
      std::fill(w.v16.begin(), w.v16.end(), 0);
    }
    for (int64_t j = 0; j < nb; ++j) {  // the pair layouts above
      const bf16* kr = kh + (j0 + j) * D.ks2;
      const bf16* vr = vh + (j0 + j) * D.vs2;
      uint16_t* vd = w.v16.data() + (j / 2) * 2 * dp + (j & 1);
      for (int64_t c = 0; c < d; ++c) {
        w.kt16[(c / 2) * 2 * kBK + 2 * j + (c & 1)] = kr[c].x;
        vd[2 * c] = vr[c].x;
      }
    }
    float* P = w.p.data();
    uint16_t* Ph = w.p16.data();
    const uint16_t* Q = w.q16.data();
    by_tiles(rows, [&](int64_t i) { scores_rows_bf16<kTileRows>(Q + i * dp, dp, w.kt16.data(), scale, P + i * kBK); },
             [&](int64_t i) { scores_rows_bf16<1>(Q + i * dp, dp, w.kt16.data(), scale, P + i * kBK); });
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t valid = std::min(nb, t0 + i / g + D.off - j0 + 1);  // keys j0 .. t + off
      softmax_row(P + i * kBK, valid, w.m[i], w.l[i], w.o.data() + i * dp, dp);
      for (int64_t x = 0; x < kBK; x += 32)  // P in bf16 pairs (round to nearest even)
        _mm512_storeu_si512(Ph + i * kBK + x, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(P + i * kBK + x + 16),
                                                                             _mm512_loadu_ps(P + i * kBK + x)));
    }
    float* O = w.o.data();
    by_tiles(rows, [&](int64_t i) { pv_cols_bf16<kTileRows>(Ph + i * kBK, w.v16.data(), dp, nw, O + i * dp); },
             [&](int64_t i) { pv_cols_bf16<1>(Ph + i * kBK, w.v16.data(), dp, nw, O + i * dp); });
  }
  write_out(D, w, out, b, h, t0, rows);
}
#endif

template <class T>
static void run(const Dims& D, const T* q, const T* k, const T* v, T* out) {
  const int64_t nqb = (D.T + kBQ - 1) / kBQ, heads = D.B * D.n_kv;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(thread_count(), heads * nqb));
  std::vector<Buffers> bufs(nt);
  auto fn = [&](int, int64_t u, int slot) {
    const int64_t bh = u % heads, qb = nqb - 1 - u / heads;  // the longest units first
#ifdef SPARQ_AVX512_BF16
    if constexpr (std::is_same_v<T, bf16>) {
      unit_bf16(D, q, k, v, out, bh / D.n_kv, bh % D.n_kv, qb * kBQ, bufs[slot]);
      return;
    }
#endif
    unit<T>(D, q, k, v, out, bh / D.n_kv, bh % D.n_kv, qb * kBQ, bufs[slot]);
  };
  run_phases(nt, {heads * nqb}, fn);
}

at::Tensor prefill_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const char* op = "sparq::prefill_cpu";
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": expected q (B, H, T, d), k and v (B, n_kv, S_k, d)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, op, ": q, k and v must have one dtype");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": unsupported dtype ", dt);
  Dims D{};
  D.B = q.size(0); D.H = q.size(1); D.T = q.size(2); D.d = q.size(3);
  D.n_kv = k.size(1); D.S = k.size(2);
  TORCH_CHECK(k.size(0) == D.B && k.size(3) == D.d, op, ": k must be (B, n_kv, S_k, d) for q ", q.sizes());
  TORCH_CHECK(D.n_kv >= 1 && D.H % D.n_kv == 0, op, ": query heads must be a multiple of the KV heads");
  TORCH_CHECK(D.S >= D.T, op, ": the keys must include the queries' own positions (S_k >= T)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, op, ": q, k and v must be contiguous in d");
  D.g = D.H / D.n_kv;
  D.dp = round_up(D.d, 16);
  D.off = D.S - D.T;
  D.qs0 = q.stride(0); D.qs1 = q.stride(1); D.qs2 = q.stride(2);
  D.ks0 = k.stride(0); D.ks1 = k.stride(1); D.ks2 = k.stride(2);
  D.vs0 = v.stride(0); D.vs1 = v.stride(1); D.vs2 = v.stride(2);
  at::Tensor out = at::empty({D.B, D.H, D.T, D.d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  if (dt == at::kFloat) run(D, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  else if (dt == at::kBFloat16) run(D, q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), out.data_ptr<bf16>());
  else run(D, q.data_ptr<f16>(), k.data_ptr<f16>(), v.data_ptr<f16>(), out.data_ptr<f16>());
  return out;
}

}  // namespace
}  // namespace sparq_cpu

TORCH_LIBRARY_IMPL(sparq, CPU, m) {
  m.impl("prefill_cpu", &sparq_cpu::prefill_cpu);
}
