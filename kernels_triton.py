"""Triton kernels for SparQ decode attention on CUDA (kernels.py puts them in the run's Kernels record).

A leaf module, like kernels.py: tensors and ints in, tensors out. The kernels compute what
`sparq.sparq_reference` computes; without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1
set before triton is first imported), which is how the CPU test suite checks them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

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


def sparq_attention_triton(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                           live_length: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                           cap: Optional[float] = None) -> Tensor:
    """SparQ decode attention with the Triton kernels: same semantics as `sparq.sparq_reference`.

    q (B, n_kv, g, d); k, v (B_max, n_kv, S_max, d) d-contiguous; k_t (B_max, n_kv, d, S_max)
    S-contiguous or None (1xK layout: step 1 gathers r columns of k); v_sum (B_max, n_kv, d) fp32.
    length: positions read (a python int). live_length: None (exactly `length` are live), or a 0-dim /
    1-element int32/int64 device tensor (CUDA-graph safe: no host sync, shapes sized by `length`,
    which must bound it). Returns (B, n_kv, g, d) in q.dtype. CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1. No soft-cap (cap must be None: resolve_kernels routes soft-capped models
    to the torch path).
    """
    if cap is not None:
        raise ValueError("the Triton SparQ kernels take no attention soft-cap")
    if live_length is not None:
        return _decode_triton_op(q, k, k_t, v, v_sum, 0, live_length, r, k_top, local, mean_v, length)
    return _decode_triton_op(q, k, k_t, v, v_sum, length, None, r, k_top, local, mean_v, length)
