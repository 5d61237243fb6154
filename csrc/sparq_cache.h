// How a SparQ op's cache tensors become its Problem: their checks, strides and a quantized cache's
// scales (cache.KVCache). sparq_decode.cpp and sparq_adaptive.cpp read the same cache.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "simd.h"
#include "sparq_problem.h"

namespace sparq_cpu {
namespace {

// What the dispatch needs to know of the cache: K^T is present (layout "twice"), K and V are int8,
// K^T is stored apart from K's format (int8 beside a float K, or int4: k_t uint8, two positions a byte, or int3:
// k_t uint8, 32 positions in 12 bytes, beside a float K).
struct CacheKind {
  bool two_k, int8_kv, quantized_kt, int4_kt, int3_kt;
};

static inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Checks k, k_t, v and the scales against q's (B, H, d) and `length`, and fills P's cache strides and
// scale pointers. op: the op's name, for its errors. kt_bits: a uint8 k_t's bits per position (4 or 3).
static CacheKind bind_cache(Problem& P, const char* op, int64_t B, int64_t H, int64_t d, int64_t length,
                            const at::Tensor& k, const std::optional<at::Tensor>& k_t, const at::Tensor& v,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const std::optional<at::Tensor>& chan, const std::optional<at::Tensor>& kt_scale,
                            int64_t kt_bits = 4) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(k.dim() == 4 && k.size(0) >= B && k.size(1) == H && k.size(3) == d, op, ": k shape ", k.sizes(),
              " does not match q's (B, n_kv, g, d)");
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v shape ", v.sizes(), " != k shape ", k.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), op, ": k and v dtypes differ");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, op, ": k and v must be contiguous in the head dim");
  TORCH_CHECK(1 <= length && length <= k.size(2), op, ": length ", length, " outside [1, ", k.size(2), "]");
  const auto kdt = k.scalar_type();
  TORCH_CHECK(kdt == at::kFloat || kdt == at::kBFloat16 || kdt == at::kHalf || kdt == at::kChar, op,
              ": unsupported cache dtype");
  CacheKind c{};
  c.two_k = given(k_t);
  TORCH_CHECK(kt_bits == 4 || kt_bits == 3, op, ": kt_bits must be 4 (int4) or 3 (int3)");
  if (c.two_k) {
    const at::Tensor& t = *k_t;
    const bool packed = t.scalar_type() == at::kByte;
    const int64_t bytes = !packed ? length : kt_bits == 4 ? (length + 1) / 2
                                           : (length + kInt3Block - 1) / kInt3Block * kInt3BlockBytes;
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.size(0) >= B && t.size(1) == H && t.size(2) == d &&
                    t.size(3) >= bytes && t.stride(3) == 1 &&
                    (t.scalar_type() == kdt || t.scalar_type() == at::kChar || packed),
                op, ": k_t must be (B_max, n_kv, d, S_max), S-contiguous, k's dtype or int8 (or uint8: int4, two "
                "positions per byte, or int3, 32 positions in 12 bytes whole)");
  }
  c.int8_kv = kdt == at::kChar;
  c.quantized_kt = c.two_k && k_t->scalar_type() != kdt;
  c.int4_kt = c.quantized_kt && k_t->scalar_type() == at::kByte && kt_bits == 4;
  c.int3_kt = c.quantized_kt && k_t->scalar_type() == at::kByte && kt_bits == 3;
  TORCH_CHECK(!c.int3_kt || (kdt != at::kChar && !given(kt_scale)), op,
              ": an int3 k_t goes beside a float k, without position scales");
  TORCH_CHECK(given(k_scale) == c.int8_kv && given(v_scale) == c.int8_kv, op,
              ": k_scale and v_scale go with an int8 k and v, and only with them");
  TORCH_CHECK(!given(kt_scale) || c.quantized_kt, op, ": kt_scale goes with a k_t quantized apart from k");
  TORCH_CHECK(given(chan) == (c.int8_kv || c.quantized_kt), op, ": chan goes with a quantized k or k_t");
  for (const std::optional<at::Tensor>* s : {&k_scale, &v_scale, &kt_scale})
    if (given(*s)) {
      const at::Tensor& t = **s;
      const bool dtype_ok = t.scalar_type() == at::kFloat || (s == &kt_scale && t.scalar_type() == at::kBFloat16);
      TORCH_CHECK(dtype_ok && t.dim() == 3 && t.size(0) >= B && t.size(1) == H && t.size(2) >= length &&
                      t.stride(2) == 1,
                  op, ": k_scale, v_scale and kt_scale must be (B_max, n_kv, S_max), positions contiguous, fp32 "
                  "(kt_scale fp32 or bf16)");
    }
  if (given(chan))
    TORCH_CHECK(chan->scalar_type() == at::kFloat && chan->dim() == 3 && chan->size(0) >= B && chan->size(1) == H &&
                    chan->size(2) == d && chan->stride(2) == 1,
                op, ": chan must be fp32 (B_max, n_kv, d)");

  P.two_k = c.two_k;
  P.ks0 = k.stride(0); P.ks1 = k.stride(1); P.ks2 = k.stride(2);
  if (c.two_k) { P.kts0 = k_t->stride(0); P.kts1 = k_t->stride(1); P.kts2 = k_t->stride(2); }
  P.vs0 = v.stride(0); P.vs1 = v.stride(1); P.vs2 = v.stride(2);
  if (c.int8_kv) {
    P.k_scale = k_scale->data_ptr<float>(); P.ksc0 = k_scale->stride(0); P.ksc1 = k_scale->stride(1);
    P.v_scale = v_scale->data_ptr<float>(); P.vsc0 = v_scale->stride(0); P.vsc1 = v_scale->stride(1);
  }
  if (given(chan)) { P.chan = chan->data_ptr<float>(); P.chs0 = chan->stride(0); P.chs1 = chan->stride(1); }
  P.step1_quantized = c.quantized_kt || c.int8_kv;  // a K^T without kt_scale (cache.py's "none") still holds K / chan
  // step 1's per-position scales: a quantized K^T's own; an int8 K^T (same dtype as k) or, with
  // layout "once", an int8 K itself, K's
  const std::optional<at::Tensor>& step1_scale = c.quantized_kt ? kt_scale : k_scale;
  if (given(step1_scale)) {
    if (step1_scale->scalar_type() == at::kBFloat16) P.kt_scale_b16 = step1_scale->data_ptr<at::BFloat16>();
    else P.kt_scale = step1_scale->data_ptr<float>();
    P.ktsc0 = step1_scale->stride(0); P.ktsc1 = step1_scale->stride(1);
  }
  return c;
}

// Calls fn(q, k, k_t, v, out) with the tensors' data as typed pointers: K and V's element type KT, K^T's
// KTT (K's own, or int8 / int4 / int3 when quantized apart from it; nullptr without K^T), q's and out's QT.
// The ops' one dispatch: their run<KT, KTT, QT> deduce the types from the pointers.
template <typename T>
struct Type {
  using type = T;
};
template <class F>
static void dispatch_cache(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& k_t,
                           const at::Tensor& v, at::Tensor& out, const CacheKind& c, F&& fn) {
  auto call = [&](auto kt, auto ktt, auto qt) {
    using KT = typename decltype(kt)::type;
    using KTT = typename decltype(ktt)::type;
    using QT = typename decltype(qt)::type;
    fn(q.data_ptr<QT>(), k.data_ptr<KT>(), c.two_k ? reinterpret_cast<const KTT*>(k_t->data_ptr()) : nullptr,
       v.data_ptr<KT>(), out.data_ptr<QT>());
  };
  auto with_q = [&](auto kt, auto ktt) {
    const auto qdt = q.scalar_type();
    if (qdt == at::kFloat) call(kt, ktt, Type<float>{});
    else if (qdt == at::kBFloat16) call(kt, ktt, Type<bf16>{});
    else call(kt, ktt, Type<f16>{});
  };
  auto with_kt = [&](auto kt) {
    using KT = typename decltype(kt)::type;
    if (!c.quantized_kt) with_q(kt, Type<KT>{});
    else if (c.int4_kt) with_q(kt, Type<int4x2>{});
    else if constexpr (!std::is_same_v<KT, int8_t>) {  // int3 beside a float K alone (bind_cache checks)
      if (c.int3_kt) with_q(kt, Type<int3x32>{});
      else with_q(kt, Type<int8_t>{});
    } else {
      with_q(kt, Type<int8_t>{});
    }
  };
  const auto kdt = k.scalar_type();
  if (kdt == at::kFloat) with_kt(Type<float>{});
  else if (kdt == at::kBFloat16) with_kt(Type<bf16>{});
  else if (kdt == at::kChar) with_kt(Type<int8_t>{});
  else with_kt(Type<f16>{});
}

}  // namespace
}  // namespace sparq_cpu
