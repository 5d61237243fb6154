"""Fused SparQ decode-attention kernels: Triton for CUDA, a fused C++ kernel for CPU.

Every kernel computes exactly what `sparq.sparq_reference` computes (the oracle in the tests):
  q (B, n_kv, g, d), the static cache (k, k_t, v, v_sum) and the live length S
  -> (B, n_kv, g, d) in q.dtype.

Dispatch: kernel "auto" = Triton on CUDA, the fused CPU kernel on CPU; "torch" = sparq.py's path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model import KVCache
from sparq import SparQConfig, sparq_attention_torch

KERNELS = ("auto", "triton", "cpu", "torch")


# =============================================================================================
# CPU: fused C++ kernel (csrc/sparq_cpu.cpp), built on first use, registered as a torch.library op
# =============================================================================================

# The ops sparq::decode_cpu and sparq::dense_cpu are defined here at import (schema + fake impl, no
# compiler needed), so torch.compile(fullgraph=True) can trace calls to them before anything is
# built; `length` is a SymInt. Their kernels:
#   CPU                        the C++ kernel, registered by the extension when it loads;
#   CompositeExplicitAutograd  this module's Python impl, reached only while the C++ kernel is not
#                              registered: it builds/loads the extension on first use and re-dispatches
#                              to it, or falls back to the torch path (one warning) if building fails.
# So eager calls after the first go straight from the dispatcher to C++ (no Python in between).

import hashlib
import os
import sys
import threading
import time
import types
import warnings
from typing import Optional

from model import dense_attention as _model_dense_attention

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _csrc_files(suffixes: tuple[str, ...] = (".cpp", ".h")) -> list[str]:
    """Every source and header of csrc/, sorted: the build compiles the .cpp files, the tag hashes all."""
    return sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC) if f.endswith(suffixes))
_CPU_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_CPU_LDFLAGS = ["-fopenmp"]
_cpu_ext = {"ok": None, "error": None}  # ok: None = not tried yet, True = loaded, False = unavailable
_cpu_ext_lock = threading.Lock()

_DECODE_CPU_SCHEMA = ("(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length, int r, "
                      "int k_top, int local, bool mean_v) -> Tensor")


def _cpu_build_tag() -> str:
    """Hash of every file in csrc/, the flags, torch version and CPU: a -march=native build never crosses machines."""
    h = hashlib.sha1()
    for path in _csrc_files():
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(_CPU_CFLAGS + _CPU_LDFLAGS).encode())
    h.update(torch.__version__.encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update("".join(line for line in f if line.startswith(("model name", "flags"))).encode())
    except OSError:
        pass
    return h.hexdigest()[:12]


def _load_cpu_extension() -> bool:
    """Build (first use only; cached in the torch extensions dir) and load the C++ kernel. Never raises."""
    if _cpu_ext["ok"] is not None:
        return _cpu_ext["ok"]
    with _cpu_ext_lock:
        if _cpu_ext["ok"] is not None:
            return _cpu_ext["ok"]
        try:
            from torch.utils import cpp_extension

            name = f"sparq_cpu_{_cpu_build_tag()}"  # the tag covers source, flags, torch and CPU
            build_dir = cpp_extension._get_build_directory(name, False)
            so_path = os.path.join(build_dir, name + ".so")
            loaded = False
            if os.path.exists(so_path):  # built before: load it directly (no ninja, no build lock)
                try:
                    torch.ops.load_library(so_path)
                    loaded = True
                except OSError:  # e.g. truncated by a killed build: rebuild below
                    pass
            if not loaded:
                lock = os.path.join(build_dir, "lock")
                if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > 600:
                    os.remove(lock)  # left by a build that was killed: torch would wait on it forever
                print("building the fused CPU SparQ kernel (first use only)...", file=sys.stderr, flush=True)
                cpp_extension.load(name=name, sources=_csrc_files((".cpp",)), extra_cflags=_CPU_CFLAGS,
                                   extra_ldflags=_CPU_LDFLAGS, is_python_module=False, verbose=False)
            _cpu_ext["ok"] = True
        except Exception as e:  # no compiler, no ninja, a build error: run the torch path instead
            msg = str(e).strip().splitlines()
            _cpu_ext["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"
            warnings.warn(f"fused CPU SparQ kernel unavailable ({_cpu_ext['error']}); using the torch path",
                          RuntimeWarning, stacklevel=3)
            _cpu_ext["ok"] = False
    return _cpu_ext["ok"]


def cpu_kernel_available() -> bool:
    """True if the fused C++ kernel is built and loaded (builds it on first call; False if it cannot)."""
    return _load_cpu_extension()


def _sparq_cpu_fallback(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v) -> Tensor:
    cache = types.SimpleNamespace(k=k, k_t=k_t, v=v, v_sum=v_sum, length_bucket=1, live_length=None)
    return sparq_attention_torch(q, cache, int(length), SparQConfig(r=r, k=k_top, local=local, mean_v=mean_v))


if not hasattr(torch.ops.sparq, "decode_cpu"):  # a reimported kernels.py must not redefine the op
    torch.library.define("sparq::decode_cpu", _DECODE_CPU_SCHEMA)

    @torch.library.impl("sparq::decode_cpu", "CompositeExplicitAutograd")
    def _decode_cpu_first_use(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v):
        if q.device.type == "cpu" and _load_cpu_extension():
            return torch.ops.sparq.decode_cpu.default(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v)
        return _sparq_cpu_fallback(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v)

    @torch.library.register_fake("sparq::decode_cpu")
    def _decode_cpu_fake(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v):
        return q.new_empty(q.shape)


if not hasattr(torch.ops.sparq, "dense_cpu"):
    torch.library.define("sparq::dense_cpu", "(Tensor q, Tensor k, Tensor v, SymInt length) -> Tensor")

    @torch.library.impl("sparq::dense_cpu", "CompositeExplicitAutograd")
    def _dense_cpu_first_use(q, k, v, length):
        if q.device.type == "cpu" and _load_cpu_extension():
            return torch.ops.sparq.dense_cpu.default(q, k, v, length)
        B = q.shape[0]
        return _model_dense_attention(q, k[:B, :, :length], v[:B, :, :length])

    @torch.library.register_fake("sparq::dense_cpu")
    def _dense_cpu_fake(q, k, v, length):
        return q.new_empty(q.shape)


if not hasattr(torch.ops.sparq, "linear_cpu"):
    torch.library.define("sparq::linear_cpu", "(Tensor x, Tensor w) -> Tensor")

    @torch.library.impl("sparq::linear_cpu", "CompositeExplicitAutograd")
    def _linear_cpu_first_use(x, w):
        if x.device.type == "cpu" and _load_cpu_extension():
            return torch.ops.sparq.linear_cpu.default(x, w)
        return torch.nn.functional.linear(x, w)

    @torch.library.register_fake("sparq::linear_cpu")
    def _linear_cpu_fake(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))


_decode_cpu = torch.ops.sparq.decode_cpu.default
_dense_cpu = torch.ops.sparq.dense_cpu.default
_linear_cpu = torch.ops.sparq.linear_cpu.default

LINEAR_CPU_MAX_ROWS = 16  # the fused GEMV serves decode steps; prefill-sized inputs go to F.linear


def linear_cpu_pays(rows: int, weight_dtype: torch.dtype) -> bool:
    """Whether the fused GEMV beats F.linear for `rows` input rows (bench.py linear, this machine:
    fp32 weights 2-3x faster at 1-4 rows, 1.4x at 16; bf16 weights 1.35x at 1 row, 1.1x at 4, but
    slower from 8 rows on, where torch's bf16 GEMM uses the CPU's bf16 dot-product instructions)."""
    return rows <= (LINEAR_CPU_MAX_ROWS if weight_dtype == torch.float32 else 4)


def linear_cpu(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., K) @ weight (N, K)^T with the fused C++ GEMV, for decode-sized x (at most 16 rows).

    fp32 accumulation, result in x.dtype; weight fp32/bf16/fp16, contiguous along K. torch's
    GEMV streams weights at 7-9 GB/s on this machine, this kernel at close to the memory
    bandwidth (bench.py linear): the weights are most of the bytes of a decode step.
    """
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    return _linear_cpu(rows, weight).reshape(*x.shape[:-1], weight.shape[0])


def dense_attention_cpu(q: Tensor, k: Tensor, v: Tensor, length: int) -> Tensor:
    """Exact decode attention over positions [0, length) with the fused C++ CPU kernel.

    q (B, n_kv, g, d); k, v (B_max, n_kv, S_max, d) d-contiguous (the static cache; rows [:B] and
    positions [:length] are read, once each, for all g heads). fp32 softmax and accumulation;
    returns (B, n_kv, g, d) in q.dtype. Same result as model.dense_attention (which rounds the
    bf16 logits and probabilities that this kernel keeps in fp32). On this 2-core machine it
    streams the cache at 2-3x the bandwidth of the matmul path and of SDPA (bench.py attention).
    """
    return _dense_cpu(q, k, v, length)


def sparq_attention_cpu(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                        r: int, k_top: int, local: int, mean_v: bool) -> Tensor:
    """SparQ decode attention with the fused C++ CPU kernel: same semantics as `sparq.sparq_reference`.

    q (B, n_kv, g, d) fp32/bf16/fp16; k, v (B_max, n_kv, S_max, d) d-contiguous; k_t (B_max, n_kv, d,
    S_max) S-contiguous, or None (1xK layout: step 1 reads whole rows of k, which holds the r
    columns in every cache line anyway); v_sum (B_max, n_kv, d) fp32; length = live length S (int
    or SymInt), 1 <= S <= S_max; 1 <= r <= d; 0 <= local <= k_top (else RuntimeError).
    Reads only rows [:B] and positions [:S]. Returns (B, n_kv, g, d) in q.dtype; ties in the
    top-r / top-k go to the lower index. Threads: torch.get_num_threads(). Falls back to the
    torch path (one warning) if the kernel cannot be built.
    """
    return _decode_cpu(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v)


# =============================================================================================
# CUDA: Triton kernels
# =============================================================================================

import math
from typing import Optional

# Two Triton kernels around a few torch ops, all on the device, no host sync:
#   step 0 (torch)  i1 = top-r of |q| summed over the group, q_hat = q[i1], tau    (B, n_kv, g, r) tiny
#   step 1 (Triton) logits = q_hat . K^T[i1] / tau: gathers the r rows of K^T    (B, n_kv, g, S_bound)
#                   grid (B * n_kv, S blocks): every K element is read once per KV head, for all g
#                   heads; blocks past the live length only write -inf; fully live blocks load unmasked
#   select (torch)  s_hat = softmax(logits); score = sum_g s_hat, local window forced, dead = -inf; topk
#                   (fp32 round trips of (B, n_kv, g, S): small next to K^T for MHA, not for GQA at small r)
#   step 2 (Triton) grid (B * n_kv,): gathers the k selected rows of K and V once for the g heads, exact
#                   online softmax(q K_sel^T / sqrt(d)) V_sel, then the mean-V mix
# `length` is a python int (shapes follow it) or a 0-dim / 1-element int device tensor (shapes follow
# the static bound S_bound = max_length or S_max; positions >= length are masked everywhere), so a
# decode step can be captured once in a CUDA graph. On CPU tensors the kernels run only in Triton's
# interpreter (TRITON_INTERPRET=1 set before triton is imported): that is how the tests run them.
#
# All arithmetic is fp32 (K/V tiles are upcast after the load). GQA (g > 1): tl.dot on fp32 operands
# with input_precision "tf32x3" (3 TF32 tensor-core MMAs, about fp32 accurate), g padded to the MMA
# minimum of 16 rows: the kernels are memory bound and the padded rows cost tensor-core time only,
# whereas a broadcast-multiply-sum over (g, r, BLOCK_S) would hold a 3-D tile in registers (spills)
# and a CUDA-core fp32 dot would pay 16 FMAs per K element. MHA (g = 1): broadcast-multiply-sum,
# one FMA per K element on CUDA cores, no padding and no tensor-core detour.

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # kernels.py must import without triton (CPU-only installs)
    triton = tl = None
    HAS_TRITON = False

TRITON_DOT_PRECISION = "tf32x3"  # "ieee" for exact fp32 FMAs (slower; the interpreter is exact either way)


if HAS_TRITON:

    @triton.jit
    def _sparq_step1_rows(qhat_row, idx_row, k_base, stride_krow, stride_ks, offs_g, g_mask, offs_s, live, G, R, r_end,
                          G_PAD: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, USE_DOT: tl.constexpr,
                          K_TRANSPOSED: tl.constexpr, MASK_S: tl.constexpr, PRECISION: tl.constexpr):
        """sum over the selected rows r < r_end of q_hat[:, r] * K^T[i1[r], offs_s]: (G_PAD, BLOCK_S) fp32."""
        acc = tl.zeros((G_PAD, BLOCK_S), dtype=tl.float32)
        for r0 in range(0, r_end, R_BLOCK):
            offs_r = r0 + tl.arange(0, R_BLOCK)
            r_mask = offs_r < R
            rows = tl.load(idx_row + offs_r, mask=r_mask, other=0).to(tl.int64)
            q_hat = tl.load(qhat_row + offs_g[:, None] * R + offs_r[None, :],
                            mask=g_mask[:, None] & r_mask[None, :], other=0.0)  # (G_PAD, R_BLOCK)
            if K_TRANSPOSED:  # K^T rows: BLOCK_S contiguous elements each (coalesced)
                k_ptrs = k_base + rows[:, None] * stride_krow + offs_s[None, :]
            else:  # 1xK layout: gather r columns of d-contiguous rows
                k_ptrs = k_base + rows[:, None] + offs_s[None, :].to(tl.int64) * stride_ks
            if MASK_S:
                k_mask = r_mask[:, None] & live[None, :]
            else:
                k_mask = r_mask[:, None]
            k_tile = tl.load(k_ptrs, mask=k_mask, other=0.0).to(tl.float32)  # (R_BLOCK, BLOCK_S)
            if USE_DOT:  # GQA: tensor cores, g padded to G_PAD >= 16 rows
                acc = tl.dot(q_hat, k_tile, acc, input_precision=PRECISION)
            else:  # MHA (G_PAD = 1): one FMA per K element on CUDA cores
                acc += tl.sum(q_hat[:, :, None] * k_tile[None, :, :], axis=1)
        return acc

    @triton.jit(do_not_specialize=["length", "S_bound"])
    def _sparq_step1_kernel(
        qhat_ptr, tau_ptr, idx_ptr,  # (B, n_kv, G, R) fp32, (B, n_kv, G) fp32, (B, n_kv, R) int32; contiguous
        k_ptr, stride_kb, stride_kh, stride_krow, stride_ks,  # k_t (rows = d, S unit-stride) or k (S, d unit-stride)
        logits_ptr,  # (B, n_kv, G, S_bound) fp32, contiguous
        length, n_kv, G, R, S_bound,
        G_PAD: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, USE_DOT: tl.constexpr,
        K_TRANSPOSED: tl.constexpr, LEN_IS_PTR: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program per (batch row, KV head, block of S): approximate logits of all G query heads."""
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = (pid_bh // n_kv).to(tl.int64)
        h = (pid_bh % n_kv).to(tl.int64)
        if LEN_IS_PTR:
            n = tl.load(length).to(tl.int32)
        else:
            n = length
        offs_g = tl.arange(0, G_PAD)
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        g_mask = offs_g < G
        live = offs_s < n
        k_base = k_ptr + b * stride_kb + h * stride_kh
        qhat_row = qhat_ptr + pid_bh * G * R
        idx_row = idx_ptr + pid_bh * R
        if (pid_s + 1) * BLOCK_S <= n:  # fully live block: no mask along S, so loads vectorize (16 B)
            acc = _sparq_step1_rows(qhat_row, idx_row, k_base, stride_krow, stride_ks, offs_g, g_mask, offs_s,
                                    live, G, R, R, G_PAD, R_BLOCK, BLOCK_S, USE_DOT, K_TRANSPOSED, False, PRECISION)
        else:  # the block holding the live end (masked), or one past it: no K traffic, only -inf written
            r_end = tl.where(pid_s * BLOCK_S < n, R, 0)
            acc = _sparq_step1_rows(qhat_row, idx_row, k_base, stride_krow, stride_ks, offs_g, g_mask, offs_s,
                                    live, G, R, r_end, G_PAD, R_BLOCK, BLOCK_S, USE_DOT, K_TRANSPOSED, True, PRECISION)
        tau = tl.load(tau_ptr + pid_bh * G + offs_g, mask=g_mask, other=1.0)
        logits = tl.where(live[None, :], acc / tau[:, None], float("-inf"))
        out_ptrs = logits_ptr + pid_bh.to(tl.int64) * G * S_bound + offs_g[:, None] * S_bound + offs_s[None, :]
        tl.store(out_ptrs, logits, mask=g_mask[:, None] & (offs_s < S_bound)[None, :])

    @triton.jit(do_not_specialize=["length", "S_bound"])
    def _sparq_step2_kernel(
        q_ptr,  # (B, n_kv, G, D) fp32, contiguous
        pos_ptr,  # (B, n_kv, KT) int32 selected positions, contiguous
        k_ptr, stride_kb, stride_kh, stride_ks,  # (B_max, n_kv, S_max, D), D unit-stride
        v_ptr, stride_vb, stride_vh, stride_vs,
        s_hat_ptr,  # (B, n_kv, G, S_bound) fp32, contiguous (read only with MEAN_V)
        v_sum_ptr, stride_sb, stride_sh,  # (B_max, n_kv, D) fp32, D unit-stride
        out_ptr,  # (B, n_kv, G, D) in q's dtype, contiguous
        length, n_kv, G, D, KT, S_bound, sm_scale,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, MEAN_V: tl.constexpr, LEN_IS_PTR: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program per (batch row, KV head): exact attention of all G heads over the KT selected rows.

        Online softmax over blocks of BLOCK_K gathered rows; selected positions >= length get weight 0.
        """
        pid_bh = tl.program_id(0)
        b = (pid_bh // n_kv).to(tl.int64)
        h = (pid_bh % n_kv).to(tl.int64)
        if LEN_IS_PTR:
            n = tl.load(length).to(tl.int32)
        else:
            n = length
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < G
        d_mask = offs_d < D
        q = tl.load(q_ptr + pid_bh * G * D + offs_g[:, None] * D + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (G_PAD, D_PAD)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        m_i = tl.full((G_PAD,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block gives p = 0, not NaN
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
        alpha = tl.zeros((G_PAD,), dtype=tl.float32)
        for k0 in range(0, KT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            pos = tl.load(pos_ptr + pid_bh * KT + offs_k, mask=offs_k < KT, other=0)
            valid = (offs_k < KT) & (pos < n)
            pos = pos.to(tl.int64)
            if EVEN_D:  # no mask along d (D == D_PAD): the row loads vectorize (16 B)
                kv_mask = valid[:, None]
            else:
                kv_mask = valid[:, None] & d_mask[None, :]
            k_sel = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k_sel), input_precision=PRECISION)  # (G_PAD, BLOCK_K)
            else:
                s = tl.sum(q[:, None, :] * k_sel[None, :, :], axis=2)
            s = s * sm_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            correction = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * correction + tl.sum(p, axis=1)
            v_sel = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                pv = tl.dot(p, v_sel, input_precision=PRECISION)  # (G_PAD, D_PAD)
            else:
                pv = tl.sum(p[:, :, None] * v_sel[None, :, :], axis=1)
            acc = acc * correction[:, None] + pv
            m_i = m_new
            if MEAN_V:  # alpha_h = approximate mass of the selection = sum of s_hat_h over it
                s_hat = tl.load(s_hat_ptr + pid_bh.to(tl.int64) * G * S_bound + offs_g[:, None] * S_bound + pos[None, :],
                                mask=g_mask[:, None] & valid[None, :], other=0.0)
                alpha += tl.sum(s_hat, axis=1)
        y = acc / l_i[:, None]
        if MEAN_V:
            v_mean = tl.load(v_sum_ptr + b * stride_sb + h * stride_sh + offs_d, mask=d_mask, other=0.0) / n.to(tl.float32)
            y = alpha[:, None] * y + (1.0 - alpha[:, None]) * v_mean[None, :]
        tl.store(out_ptr + pid_bh * G * D + offs_g[:, None] * D + offs_d[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def _triton_ready(device: torch.device) -> None:
    """Raise a one-line error if the Triton kernels cannot run on `device`."""
    if not HAS_TRITON:
        raise RuntimeError("the triton kernel needs the `triton` package")
    if device.type != "cuda" and type(_sparq_step1_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")


def _triton_configs(B: int, n_kv: int, g: int, d: int, S_bound: int, KT: int) -> tuple[dict, dict]:
    """Launch parameters (constexprs, num_warps, num_stages) of step 1 and step 2. No autotuning:
    fixed choices that compile for sm_90 without register spills (tests/test_kernels_triton.py)."""
    use_dot = g > 1  # GQA: tensor-core dots over g padded to >= 16 rows; MHA: CUDA-core FMAs
    G_PAD = max(16, triton.next_power_of_2(g)) if use_dot else 1
    # Step 1: 256 positions x 16 rows of K^T per loop step (R_BLOCK = 32 doubles the registers, to
    # ~160 with the dot: 1 CTA per SM); 128 positions when 256 would give < 2 waves on 132 SMs.
    BLOCK_S = 256 if B * n_kv * triton.cdiv(S_bound, 256) >= 264 else 128
    step1 = dict(G_PAD=G_PAD, R_BLOCK=16, BLOCK_S=BLOCK_S, USE_DOT=use_dot, PRECISION=TRITON_DOT_PRECISION,
                 num_warps=8 if BLOCK_S >= 256 else 4, num_stages=3)
    # Step 2: 32 selected rows of K and V per loop step (64 spills with the dot).
    D_PAD = max(16, triton.next_power_of_2(d))
    step2 = dict(G_PAD=G_PAD, D_PAD=D_PAD, EVEN_D=d == D_PAD, BLOCK_K=16 if KT <= 16 else 32,
                 USE_DOT=use_dot, PRECISION=TRITON_DOT_PRECISION, num_warps=8 if use_dot else 4, num_stages=3)
    return step1, step2


def _sparq_triton_impl(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                       length_t: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                       max_length: int) -> Tensor:
    """The launches behind sparq::decode_triton; length_t (device tensor) overrides length when given."""
    _triton_ready(q.device)
    B, n_kv, g, d = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or v_sum.stride(-1) != 1 or (k_t is not None and k_t.stride(-1) != 1):
        raise ValueError("k, v and v_sum must be contiguous along d, k_t along S")
    dynamic = length_t is not None
    if dynamic and (length_t.device != q.device or length_t.dtype not in (torch.int32, torch.int64)
                    or length_t.numel() != 1):
        raise ValueError("a tensor length must be one int32/int64 element on q's device")
    S_bound = max_length if dynamic else length  # width of the logits: static under CUDA graphs
    len_arg = length_t.reshape(()) if dynamic else length
    device = q.device

    # Step 0: top-r components of |q| (summed over the group) and the temperature, per query head.
    qf = q.float().contiguous()
    q_abs = qf.abs()
    i1 = torch.topk(q_abs.sum(2), r, dim=-1).indices  # (B, n_kv, r)
    q_hat = torch.gather(qf, 3, i1[:, :, None, :].expand(B, n_kv, g, r)).contiguous()  # (B, n_kv, g, r)
    tau = torch.sqrt(d * q_hat.abs().sum(-1) / q_abs.sum(-1)).contiguous()  # (B, n_kv, g)
    i1 = i1.to(torch.int32).contiguous()

    # Step 1: approximate logits; programs past the live length write -inf.
    KT = min(k_top, S_bound)  # with a tensor length, selections past the live length get weight 0
    step1, step2 = _triton_configs(B, n_kv, g, d, S_bound, KT)
    logits = torch.empty((B, n_kv, g, S_bound), dtype=torch.float32, device=device)
    if k_t is not None:
        kk, strides = k_t, (k_t.stride(0), k_t.stride(1), k_t.stride(2), k_t.stride(3))
    else:
        kk, strides = k, (k.stride(0), k.stride(1), k.stride(3), k.stride(2))
    grid1 = (B * n_kv, triton.cdiv(S_bound, step1["BLOCK_S"]))
    _sparq_step1_kernel[grid1](q_hat, tau, i1, kk, *strides, logits, len_arg, n_kv, g, r, S_bound,
                               K_TRANSPOSED=k_t is not None, LEN_IS_PTR=dynamic, **step1)

    # Selection: softmax per head over live positions, group sum, local window forced, top-k.
    s_hat = torch.softmax(logits, dim=-1)  # dead positions: -inf -> 0
    if dynamic:  # one pass: live positions outside the window keep their score, the window gets inf, dead -inf
        pos = torch.arange(S_bound, device=device)
        fill = torch.where(pos < length_t, float("inf"), float("-inf"))  # (S_bound,) tiny
        score = torch.where(pos < length_t - local, s_hat[:, :, 0] if g == 1 else s_hat.sum(2), fill)
    else:
        score = s_hat.sum(2)  # (B, n_kv, S_bound), a fresh tensor: force the window in place
        if local > 0:
            score[..., max(length - local, 0):] = float("inf")
    positions = torch.topk(score, KT, dim=-1).indices.to(torch.int32).contiguous()  # (B, n_kv, KT)

    # Step 2: exact attention over the selection, then the mean-V mix.
    out = torch.empty((B, n_kv, g, d), dtype=q.dtype, device=device)
    _sparq_step2_kernel[(B * n_kv,)](
        qf, positions, k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2),
        s_hat, v_sum, v_sum.stride(0), v_sum.stride(1), out, len_arg, n_kv, g, d, KT, S_bound, 1.0 / math.sqrt(d),
        MEAN_V=mean_v, LEN_IS_PTR=dynamic, **step2)
    return out


# torch.compile sees one opaque op with a fake (shape-only) impl: no tracing into the launch code,
# no graph break, and CUDA-graph capture (mode="reduce-overhead") records the launches as they are.
@torch.library.custom_op("sparq::decode_triton", mutates_args=())
def _decode_triton_op(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                      length_t: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                      max_length: int) -> Tensor:
    return _sparq_triton_impl(q, k, k_t, v, v_sum, length, length_t, r, k_top, local, mean_v, max_length)


@_decode_triton_op.register_fake
def _decode_triton_fake(q, k, k_t, v, v_sum, length, length_t, r, k_top, local, mean_v, max_length):
    return q.new_empty(q.shape)


def sparq_attention_triton(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor,
                           length: int | Tensor, r: int, k_top: int, local: int, mean_v: bool,
                           max_length: Optional[int] = None) -> Tensor:
    """SparQ decode attention with the Triton kernels: same semantics as `sparq.sparq_reference`.

    q (B, n_kv, g, d); k, v (B_max, n_kv, S_max, d) d-contiguous; k_t (B_max, n_kv, d, S_max)
    S-contiguous or None (1xK layout: step 1 gathers r columns of k); v_sum (B_max, n_kv, d) fp32.
    length: python int, or a 0-dim / 1-element int32/int64 device tensor (CUDA-graph safe: no host
    sync, shapes sized by max_length, default S_max, which must bound the live length).
    Returns (B, n_kv, g, d) in q.dtype. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    if isinstance(length, Tensor):
        bound = k.shape[2] if max_length is None else max_length
        return _decode_triton_op(q, k, k_t, v, v_sum, 0, length, r, k_top, local, mean_v, bound)
    return _decode_triton_op(q, k, k_t, v, v_sum, length, None, r, k_top, local, mean_v, length)


# =============================================================================================
# Dispatch
# =============================================================================================


# Kernels that read K only in both layouts; the rest also run on the 1xK layout ("once").
NEEDS_BOTH_K_LAYOUTS: set[str] = set()


def resolve_kernel(kernel: str, device: torch.device | str, kv_layout: str = "twice") -> str:
    """The concrete kernel for `kernel` on `device`; ValueError (one line) if it cannot run there."""
    device_type = torch.device(device).type
    resolved = _resolve_for_device(kernel, device_type)
    if kv_layout == "once" and resolved in NEEDS_BOTH_K_LAYOUTS:
        raise ValueError(f"--kernel {resolved} needs K stored twice: drop --kv-layout once")
    return resolved


def _resolve_for_device(kernel: str, device_type: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (choose from {', '.join(KERNELS)})")
    if kernel == "auto":
        return "triton" if device_type == "cuda" else "cpu"
    if kernel == "triton" and device_type != "cuda":
        raise ValueError("--kernel triton needs --device cuda (set TRITON_INTERPRET=1 only for tests)")
    if kernel == "cpu" and device_type != "cpu":
        raise ValueError("--kernel cpu needs --device cpu")
    return kernel


def sparq_attention(q: Tensor, cache: KVCache, length: int, config: SparQConfig, kernel: str) -> Tensor:
    """SparQ decode attention with the chosen (already resolved) kernel.

    `length` positions are read: exactly the live ones when cache.length_bucket is 1, else the
    live ones (the device tensor cache.live_length) plus masked ones up to the bucket's end.
    """
    bucketed = cache.length_bucket > 1
    if kernel == "torch" or (kernel == "cpu" and bucketed):  # the CPU kernel reads exact lengths only
        return sparq_attention_torch(q, cache, length, config)
    if kernel == "cpu":
        return sparq_attention_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, length,
                                   config.r, config.k, config.local, config.mean_v)
    if kernel == "triton":
        live = cache.live_length if bucketed else length
        return sparq_attention_triton(q, cache.k, cache.k_t, cache.v, cache.v_sum, live,
                                      config.r, config.k, config.local, config.mean_v,
                                      max_length=length if bucketed else None)
    raise ValueError(f"unknown kernel {kernel!r}")
