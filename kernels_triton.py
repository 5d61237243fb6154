"""Triton kernels for decode attention on CUDA, SparQ and dense (kernels.py puts them in the run's Kernels record).

A leaf module, like kernels.py: tensors and ints in, tensors out; the @triton.jit kernels are in
kernels_triton_jit.py, this file plans and launches them. `sparq_attention_triton` computes
what `sparq.sparq_reference` computes, `dense_attention_triton` what `attention.dense_attention_torch`
computes; without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported), which is how the CPU test suite checks them.

SparQ, one call = 4 to 6 Triton launches and nothing else (no eager torch kernel in between):
  step 0  grid (B * n_kv,): ranks |q| summed over the group (a d x d comparison, registers only) and
          writes the top-r components in rank order.
  step 1  grid (B * n_kv, S / (BPP BLOCK_S)): every program takes step 0's components, q[i1] and tau
          once, then for each of its BPP consecutive blocks of positions (loads pipelined across
          blocks) logits = q[i1] . K^T[i1] / tau, all g heads at once (every element of K^T read
          once per KV head), written in fp32 with the block's softmax max and sum per head.
          Blocks past a row's live length do nothing at all.
  select  grid (B * n_kv, chunks). Reduces the block stats to each head's softmax (max, sum), reads
          its chunk of logits once, forms score = sum_g softmax_g (the group sum), forces the local
          window in and dead positions out, and takes the chunk's top-k with an exact radix select
          (16 block-wide counting passes over the chunk's keys, two bits each, then ties to the lower
          position; no sort).
  merge   (only when there are several chunks) grid (B * n_kv,): the same select over the chunks'
          candidates gives the final k positions.
  step 2  grid (B * n_kv, splits): split over the k selected rows (flash-decoding): each program
          gathers its share of the selected rows of K and V once for the g heads (online softmax),
          and sums the approximate mass alpha of its rows from the logits (mean-V). One split
          writes the output directly; several write partials that
  combine grid (B * n_kv * g,) merges (max, sum, acc, alpha), mixes in mean(V) and writes the output.
Bytes beyond the paper's transfer count Sr + 2kd + 4d: the fp32 logits written by step 1 and read
once by select (8 g bytes per position and KV head against 2 r bytes of K^T in bf16; they are
normalised per head before the group sum, so the group cannot be summed before every block is done),
and the tiny stats and partials.

Dense, one call = 1 or 2 launches: a flash-decoding kernel split over S (grid (B * n_kv, splits),
each K/V row read once for the g heads sharing it; dots on tensor cores in a 16-bit cache dtype
(MHA too, its one query row padded to 16), fp32 GQA in tf32x3, fp32 MHA on CUDA cores), and the
same combine when there are several splits. The verify pass of speculative decoding is the same
kernel with a row's T queries folded into its heads (g T rows), each masked to its own causal range.

A quantized cache (cache.KVCache with --kv-dtype int8 / --kt-dtype int8|int4) is read as stored:
int8 K and V rows and an int8 K^T are loaded as bytes, an int4 K^T as bytes of two positions (low
nibble first, stored + 8), and converted in registers; chan (K's per-channel scale) goes into q and
q_hat, each position's scale into its logits (K, K^T) or its softmax weight (V). The dots are then
fp32 (tf32x3). The scales are fp32 tensors beside the buffers (kernels.KVScales).

Live lengths (kernels.py docstring): a python int (exact reads), a 0-dim / 1-element device tensor
(every row), or a (B,) device tensor (ragged rows). With a tensor the shapes and grids follow the
static `length` (one CUDA graph serves every live length, no host sync) while each program loads
its row's live length and does nothing, or only writes sentinels, past it: the work scales with the
live length, row by row.

All softmax arithmetic is fp32. Dots on tensor cores pad the g heads to the MMA minimum of 16 rows
and take bf16/fp16 operands of one dtype directly (exact products, fp32 accumulation; the
probabilities cast to V's dtype before the PV dot, as the torch path does), fp32 operands in
input_precision "tf32x3" (about fp32 accurate). SparQ's step 1 dots for GQA; MHA's step 1
(r rows of K^T for one query row) is a broadcast-multiply-sum on CUDA cores. Step 2 and dense dot
whenever the cache is 16-bit (MHA too) and for fp32 GQA; fp32 MHA and int8 K/V keep the FMAs or
the fp32 dots.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

try:  # the kernels themselves (kernels_triton_jit.py import triton at their top): only where triton is installed
    from kernels_triton_jit import (_combine_kernel, _dense_kernel, _sparq_merge_kernel, _sparq_rank_kernel,
                                    _sparq_select_kernel, _sparq_step1_kernel, _sparq_step2_kernel)

    HAS_TRITON = True
except ImportError:  # kernels.py must import without triton (CPU-only installs)
    HAS_TRITON = False

TRITON_DOT_PRECISION = "tf32x3"  # "ieee" for exact fp32 FMAs (slower; the interpreter is exact either way)
INF_KEY = 0x7F800001  # select key of a forced (local window) position: above every finite score's key
TARGET_PROGRAMS = 4  # launch at least this many programs per SM where the work can be split


# ---------------------------------------------------------------------------------------------
# Launch plans: every size and constexpr fixed by the static shapes (no autotuning), so one CUDA
# graph per shape; tests/test_kernels_triton.py compiles every kernel of these plans for sm_90 and
# checks for register spills.
# ---------------------------------------------------------------------------------------------


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: Optional[int]) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # an H100 SXM: the plans are then the ones the GPU would use
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else _sm_count(None)


def sparq_plan(B: int, n_kv: int, g: int, d: int, S_bound: int, KT: int, native_dot: bool, sms: int = 132,
               r: int = 32, blocks_per_program: Optional[int] = None, select_bits: Optional[int] = None,
               kv_native_dot: Optional[bool] = None) -> dict:
    """Sizes and launch parameters of one SparQ call (see the module docstring for the kernels).
    native_dot: q and step 1's source share a 16-bit dtype (step 1's GQA dot then takes them as they
    are); kv_native_dot: q, K and V do (step 2's dots; default native_dot).
    blocks_per_program, select_bits: step 1's blocks per program and the top-k's bits per counting
    pass instead of the plan's choices (the GPU check's side-by-side comparisons)."""
    rows = B * n_kv
    target = TARGET_PROGRAMS * sms
    use_dot = g > 1  # GQA: tensor-core dots over g padded to >= 16 rows; MHA: CUDA-core FMAs
    G_PAD = max(16, _pow2(g)) if use_dot else 1
    D_PAD = max(16, _pow2(d))
    # Step 0 once per (row, KV head) in its own launch: ranked inside every step-1 program (a
    # bitonic sort each) it was most of step 1's time on an H200 (docs/NOTES.md).
    rank = dict(G_PAD=_pow2(g), D_PAD=D_PAD, num_warps=8, num_stages=1)
    # Step 1: blocks of all r rows x 256 positions of K^T (at most 8192 elements: fewer positions
    # when r > 32); 128 positions when 256 would give < 2 waves. Each program takes BPP consecutive
    # blocks, its q_hat and rows loaded once and the blocks' loads pipelined: one block per program
    # left step 1 latency-bound on an H200 (docs/NOTES.md, 'Figures behind the code's choices').
    R_PAD = max(16, _pow2(r))
    BLOCK_S = min(256 if rows * _cdiv(S_bound, 256) >= 2 * sms else 128, max(16, 8192 // R_PAD))
    NB = _cdiv(S_bound, BLOCK_S)
    BPP = blocks_per_program or max(1, min(16, round(rows * NB / (2 * sms))))
    step1 = dict(G_PAD=G_PAD, D_PAD=D_PAD, R_PAD=R_PAD, BLOCK_S=BLOCK_S, USE_DOT=use_dot,
                 DOT_NATIVE=use_dot and native_dot, PRECISION=TRITON_DOT_PRECISION, num_warps=8, num_stages=3)
    # Select: chunks of S (powers of two, >= 4 KT); the merge takes the chunks' candidates in one
    # program: at most 4096 of them while chunks stay <= 8192 positions. A select's latency grows
    # with its keys per thread (31 passes over them), and the merge's with n_chunks KT: chunks of
    # ~sqrt(S KT) balance the two, rounded down, since a bucketed bound just past a power of two
    # (generation at 32k reads 33024) ran slower in the larger chunks (docs/NOTES.md, 'Figures behind
    # the code's choices').
    kv_native_dot = native_dot if kv_native_dot is None else kv_native_dot
    KT_P2 = _pow2(KT)
    if S_bound <= 4096 and rows >= sms or S_bound <= max(1024, 4 * KT_P2):
        CHUNK, n_chunks = max(16, _pow2(S_bound)), 1
    else:
        CHUNK = max(1024, 4 * KT_P2, 1 << (math.isqrt(S_bound * KT_P2).bit_length() - 1))
        while _cdiv(S_bound, CHUNK) * KT > 4096 and CHUNK < 8192 or _cdiv(S_bound, CHUNK) * KT > 16384:
            CHUNK *= 2
        n_chunks = _cdiv(S_bound, CHUNK)
        if n_chunks == 1:
            CHUNK = max(16, _pow2(S_bound))
    # The top-k's counting passes, one bit each (31 block-wide reductions): two bits a pass (16
    # reductions of packed int64 counts) measured no faster on an H200 (docs/NOTES.md, 'Figures behind
    # the code's choices'); kept for the GPU check's side-by-side sweep.
    PASS_BITS = select_bits or 1
    select = dict(NB_PAD=max(16, _pow2(NB)), CHUNK=CHUNK, BLOCK_S=BLOCK_S, FINAL=n_chunks == 1, PASS_BITS=PASS_BITS,
                  num_warps=8 if CHUNK >= 2048 else 4, num_stages=1)
    merge = None if n_chunks == 1 else dict(N_PAD=_pow2(n_chunks * KT), PASS_BITS=PASS_BITS, num_warps=8,
                                            num_stages=1)
    # Step 2: 16 or 32 selected rows of K and V per loop step (64 spills with the dot); split the
    # selection over programs when the rows alone would not fill the GPU.
    BLOCK_K = 16 if KT <= 16 else 32
    n_split = 1 if rows >= target // 2 else max(1, min(_cdiv(KT, BLOCK_K), _cdiv(target // 2, rows)))
    KS = _cdiv(_cdiv(KT, n_split), BLOCK_K) * BLOCK_K
    n_split = _cdiv(KT, KS)
    # Tensor cores whenever K and V share q's 16-bit dtype, MHA too (one real row of 16), as in dense:
    # MHA's broadcast-multiply-sum reduces each row's d products across lanes (224 shuffles a loop
    # step in its SASS); fp32 or int8 keep the fp32 dots (GQA) and the FMAs (MHA).
    use_dot2 = use_dot or kv_native_dot
    step2 = dict(G_PAD=max(16, _pow2(g)) if use_dot2 else 1, D_PAD=D_PAD, EVEN_D=d == D_PAD, BLOCK_K=BLOCK_K,
                 USE_DOT=use_dot2, DOT_NATIVE=kv_native_dot, PRECISION=TRITON_DOT_PRECISION, FINAL=n_split == 1,
                 num_warps=8 if use_dot else 4, num_stages=3)
    combine = None if n_split == 1 else dict(D_PAD=D_PAD, SPLIT_BLOCK=min(16, _pow2(n_split)), BY_LENGTH=False,
                                             num_warps=4, num_stages=1)
    return dict(NB=NB, BPP=BPP, n_step1=_cdiv(NB, BPP), n_chunks=n_chunks, KS=KS, n_split=n_split, rank=rank,
                step1=step1, select=select, merge=merge, step2=step2, combine=combine)


def dense_plan(B: int, n_kv: int, g: int, d: int, S_bound: int, native_dot: bool, sms: int = 132) -> dict:
    """Sizes and launch parameters of one dense call: SPLIT positions per program, n_split programs per row."""
    rows = B * n_kv
    # Tensor cores whenever the operands are 16-bit (MHA too: one real row of the 16 a dot needs costs
    # nothing in a memory-bound loop, while MHA's CUDA-core path read far slower than SDPA on an H200:
    # docs/NOTES.md, 'Figures behind the code's choices'); fp32 MHA keeps the FMAs.
    use_dot = g > 1 or native_dot
    G_PAD = max(16, _pow2(g)) if use_dot else 1
    D_PAD = max(16, _pow2(d))
    BLOCK_N = 64 if (use_dot and native_dot or d <= 64) else 32  # fp32 tiles: 32 rows (64 spills)
    target = TARGET_PROGRAMS * sms
    per_row = max(1, _cdiv(target, rows))
    SPLIT = max(4 * BLOCK_N, _cdiv(_cdiv(S_bound, per_row), BLOCK_N) * BLOCK_N)
    n_split = _cdiv(S_bound, SPLIT)
    if n_split == 1:
        SPLIT = max(S_bound, 1)
    kernel = dict(G_PAD=G_PAD, D_PAD=D_PAD, EVEN_D=d == D_PAD, BLOCK_N=BLOCK_N, USE_DOT=use_dot,
                  DOT_NATIVE=native_dot and use_dot, PRECISION=TRITON_DOT_PRECISION, FINAL=n_split == 1,
                  num_warps=4, num_stages=3)
    combine = None if n_split == 1 else dict(D_PAD=D_PAD, SPLIT_BLOCK=min(16, _pow2(n_split)), BY_LENGTH=True,
                                             num_warps=4, num_stages=1)
    return dict(SPLIT=SPLIT, n_split=n_split, dense=kernel, combine=combine)


def sparq_launches(plan: dict) -> int:
    """Kernels one SparQ call launches: step 0, step 1, select, step 2, plus merge and combine when split."""
    return 4 + (plan["merge"] is not None) + (plan["combine"] is not None)


def dense_launches(plan: dict) -> int:
    """Kernels one dense call launches: the split kernel, plus the combine when it split."""
    return 1 + (plan["combine"] is not None)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def _triton_ready(device: torch.device) -> None:
    """Raise a one-line error if the Triton kernels cannot run on `device`."""
    if not HAS_TRITON:
        raise RuntimeError("the triton kernel needs the `triton` package")
    if device.type != "cuda" and type(_sparq_step1_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")


def _live_args(q: Tensor, length: int, live: Optional[Tensor]) -> tuple[int, object]:
    """(LIVE mode, the kernels' `live` argument) for a live length None / one element / (B,)."""
    if live is None:
        return 0, length
    if live.device != q.device or live.dtype not in (torch.int32, torch.int64):
        raise ValueError("a tensor live length must be int32/int64 on q's device")
    if live.numel() == 1:
        return 1, live
    if live.shape != (q.shape[0],):
        raise ValueError(f"a live length tensor must have one element or one per batch row ({q.shape[0]}), "
                         f"got shape {tuple(live.shape)}")
    return 2, live.contiguous()


def _native_dot(*tensors: Tensor) -> bool:
    """Dot bf16/fp16 operands as they are (one dtype). Triton's interpreter (CPU tensors) mis-evaluates
    tl.dot on bf16 operands, so there bf16 products go through fp32 dots (exact for 16-bit inputs
    either way); fp16 it evaluates right, which is how the CPU suite covers the native paths."""
    dtype = tensors[0].dtype
    return (all(t.dtype == dtype for t in tensors)
            and (dtype == torch.float16 or dtype == torch.bfloat16 and tensors[0].device.type == "cuda"))


def _native_kv_dot(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Step 2's and dense's dots in q's 16-bit dtype: K and V share it, or are int8 as stored (exact in
    bf16 and fp16, whose 8 and 11 significant bits hold any |x| <= 127): K's channel scales fold into q
    and V's position scales into V or the weights, each rounded once to q's dtype, as a 16-bit cache
    rounds its values. The fp32 alternative ran an H200's int8 dense at a fraction of the read rate,
    slower than the bf16 kernel for half its bytes (docs/NOTES.md, 'Figures behind the code's choices')."""
    if k.dtype == torch.int8 and v.dtype == torch.int8:
        return _native_dot(q)
    return _native_dot(q, k, v)


def _check_layout(q: Tensor, *tensors: Optional[Tensor]) -> None:
    if q.stride(-1) != 1 or any(t is not None and t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v and v_sum must be contiguous along d, k_t along S")


def _rows_of(t: Optional[Tensor], fallback: Tensor) -> tuple[Tensor, int, int]:
    """A (B_max, n_kv, ...) scale tensor and its batch and head strides; an absent one: `fallback`
    (never read: the kernels' constexpr says so) with strides 0."""
    return (fallback, 0, 0) if t is None else (t, t.stride(0), t.stride(1))


def _check_scales(k: Tensor, k_t: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                  chan: Optional[Tensor], kt_scale: Optional[Tensor]) -> None:
    """A quantized cache comes with its scales (cache.KVCache.view(stored=True)), a float one without."""
    int8_kv = k.dtype == torch.int8
    quant_kt = k_t is not None and k_t.dtype in (torch.int8, torch.uint8)
    if (k_scale is None or v_scale is None) == int8_kv or (chan is None) == (int8_kv or quant_kt) \
            or (kt_scale is None) == quant_kt:
        raise ValueError("an int8 K/V needs k_scale, v_scale and chan, a quantized K^T kt_scale and chan; "
                         "a float cache none")
    fp32, fp32_or_bf16 = (torch.float32,), (torch.float32, torch.bfloat16)
    for t, dtypes in ((k_scale, fp32), (v_scale, fp32), (kt_scale, fp32_or_bf16)):
        if t is not None and (t.dtype not in dtypes or t.stride(-1) != 1):
            raise ValueError("the per-position scales must be fp32 (a K^T's own: fp32 or bf16), positions contiguous")
    if int8_kv and k_scale.stride()[:2] != v_scale.stride()[:2]:  # the kernels take one pair of strides for both
        raise ValueError("k_scale and v_scale must share their batch and head strides")


def _sparq_triton_impl(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                       live: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                       k_scale: Optional[Tensor], v_scale: Optional[Tensor], chan: Optional[Tensor],
                       kt_scale: Optional[Tensor], blocks_per_program: Optional[int] = None,
                       select_bits: Optional[int] = None) -> Tensor:
    """The launches behind sparq::sparq_triton (the module docstring): Triton kernels only. A quantized
    cache (int8 K/V with k_scale, v_scale; an int8 or packed int4 K^T with kt_scale; chan with either)
    is read as stored. blocks_per_program, select_bits: sparq_plan's overrides (benchmarks)."""
    _triton_ready(q.device)
    _check_layout(q, k, k_t, v, v_sum)
    _check_scales(k, k_t, k_scale, v_scale, chan, kt_scale)
    B, n_kv, g, d = q.shape
    if not 1 <= r <= d or k_top < 1 or not 0 <= local:
        raise ValueError(f"bad SparQ settings r={r}, k={k_top}, local={local} for head dim {d}")
    LIVE, live_arg = _live_args(q, length, live)
    S_bound, device, rows = length, q.device, B * n_kv
    KT = min(k_top, S_bound)  # with a tensor live length, selections past it get weight 0
    kk = k if k_t is None else k_t  # step 1's source
    plan = sparq_plan(B, n_kv, g, d, S_bound, KT, _native_dot(q, kk), _device_sms(device), r, blocks_per_program,
                      select_bits, _native_kv_dot(q, k, v))
    NB, n_chunks, KS, n_split = plan["NB"], plan["n_chunks"], plan["KS"], plan["n_split"]
    f32, i32 = torch.float32, torch.int32

    logits = torch.empty((rows, g, S_bound), dtype=f32, device=device)
    block_stats = torch.empty((2, rows, g, NB), dtype=f32, device=device)
    if k_t is not None:
        k_strides = (k_t.stride(0), k_t.stride(1), k_t.stride(2), k_t.stride(3))
    else:
        k_strides = (k.stride(0), k.stride(1), k.stride(3), k.stride(2))
    # step 1 on a quantized source (K / chan stored): 1 int8, 2 int4 (uint8 bytes of two positions)
    quant = {torch.int8: 1, torch.uint8: 2}.get(kk.dtype, 0)
    ps = _rows_of(kt_scale if k_t is not None else k_scale, q)
    chan_rows = _rows_of(chan, q)
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    idx = torch.empty((rows, r), dtype=i32, device=device)
    _sparq_rank_kernel[(rows,)](q, *q_strides, idx, n_kv, g, d, r, **plan["rank"])
    _sparq_step1_kernel[(rows, plan["n_step1"])](
        q, *q_strides, idx, kk, *k_strides, *ps, *chan_rows, logits, block_stats[0], block_stats[1], live_arg, n_kv,
        g, d, r, S_bound, NB, plan["BPP"], K_TRANSPOSED=k_t is not None, LIVE=LIVE, QUANT=quant, **plan["step1"])

    stats = torch.empty((rows, 2, g), dtype=f32, device=device)
    if n_chunks == 1:
        positions = torch.empty((rows, KT), dtype=i32, device=device)
        keys = positions  # unused (FINAL)
    else:
        positions = torch.empty((rows, n_chunks, KT), dtype=i32, device=device)
        keys = torch.empty((rows, n_chunks, KT), dtype=i32, device=device)
    _sparq_select_kernel[(rows, n_chunks)](
        logits, block_stats[0], block_stats[1], stats, positions, keys, live_arg, n_kv, g, S_bound, NB, KT, local,
        n_chunks, LIVE=LIVE, **plan["select"])
    if n_chunks > 1:
        final = torch.empty((rows, KT), dtype=i32, device=device)
        _sparq_merge_kernel[(rows,)](positions, keys, final, n_chunks * KT, KT, **plan["merge"])
        positions = final

    out = torch.empty((B, n_kv, g, d), dtype=q.dtype, device=device)
    o_strides = (out.stride(0), out.stride(1), out.stride(2))
    if n_split == 1:
        part_acc = part_ml = out  # unused (FINAL)
    else:
        part_acc = torch.empty((rows, n_split, g, d), dtype=f32, device=device)
        part_ml = torch.empty((rows, n_split, 3, g), dtype=f32, device=device)
    int8_kv = k.dtype == torch.int8
    k_scales, v_scales = _rows_of(k_scale, q), _rows_of(v_scale, q)
    _sparq_step2_kernel[(rows, n_split)](
        q, *q_strides, positions, k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1),
        v.stride(2), k_scales[0], v_scales[0], *k_scales[1:], *chan_rows, logits, stats, v_sum, v_sum.stride(0),
        v_sum.stride(1), out, *o_strides, part_acc, part_ml, live_arg, n_kv, g, d, KT, KS, n_split, S_bound,
        1.0 / math.sqrt(d), MEAN_V=mean_v, LIVE=LIVE, INT8_KV=int8_kv, **plan["step2"])
    if n_split > 1:
        _combine_kernel[(rows * g,)](
            part_acc, part_ml, v_sum, v_sum.stride(0), v_sum.stride(1), out, *o_strides, live_arg, n_kv, g, d,
            n_split, 0, S_bound, MEAN_V=mean_v, LIVE=LIVE, **plan["combine"])
    return out


def _dense_triton_impl(q: Tensor, k: Tensor, v: Tensor, length: int, live: Optional[Tensor], queries: int,
                       k_scale: Optional[Tensor], v_scale: Optional[Tensor], chan: Optional[Tensor]) -> Tensor:
    """The launches behind sparq::dense_triton: the split kernel, and the combine if it split. queries:
    T query tokens per row, q's g = heads x T head-major (the kernel's QUERIES). An int8 K/V is read as
    stored with its k_scale, v_scale and chan."""
    _triton_ready(q.device)
    _check_layout(q, k, v)
    _check_scales(k, None, k_scale, v_scale, chan, None)
    B, n_kv, g, d = q.shape
    LIVE, live_arg = _live_args(q, length, live)
    S_bound, device, rows = length, q.device, B * n_kv
    plan = dense_plan(B, n_kv, g, d, S_bound, _native_kv_dot(q, k, v), _device_sms(device))
    SPLIT, n_split = plan["SPLIT"], plan["n_split"]
    out = torch.empty((B, n_kv, g, d), dtype=q.dtype, device=device)
    o_strides = (out.stride(0), out.stride(1), out.stride(2))
    if n_split == 1:
        part_acc = part_ml = out  # unused (FINAL)
    else:
        part_acc = torch.empty((rows, n_split, g, d), dtype=torch.float32, device=device)
        part_ml = torch.empty((rows, n_split, 3, g), dtype=torch.float32, device=device)
    k_scales, v_scales = _rows_of(k_scale, q), _rows_of(v_scale, q)
    _dense_kernel[(rows, n_split)](
        q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2), k_scales[0], v_scales[0], *k_scales[1:], *_rows_of(chan, q),
        out, *o_strides, part_acc, part_ml, live_arg, n_kv, g, d, S_bound, SPLIT, n_split, 1.0 / math.sqrt(d),
        queries, LIVE=LIVE, INT8_KV=k.dtype == torch.int8, **plan["dense"])
    if n_split > 1:
        _combine_kernel[(rows * g,)](
            part_acc, part_ml, out, 0, 0, out, *o_strides, live_arg, n_kv, g, d, n_split, SPLIT, S_bound,
            MEAN_V=False, LIVE=LIVE, **plan["combine"])
    return out


# torch.compile sees one opaque op per attention call with a fake (shape-only) impl: no tracing into
# the launch code, no graph break, and CUDA-graph capture (mode="reduce-overhead") records the
# launches as they are. Everything inside is a Triton kernel (no eager torch op left to fuse).
# A quantized cache's scales ride along as optional tensors (None for a float cache), always passed.
@torch.library.custom_op("sparq::sparq_triton", mutates_args=())
def _sparq_triton_op(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                     live: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool, k_scale: Optional[Tensor],
                     v_scale: Optional[Tensor], chan: Optional[Tensor], kt_scale: Optional[Tensor]) -> Tensor:
    return _sparq_triton_impl(q, k, k_t, v, v_sum, length, live, r, k_top, local, mean_v, k_scale, v_scale, chan,
                              kt_scale)


@_sparq_triton_op.register_fake
def _sparq_triton_fake(q, k, k_t, v, v_sum, length, live, r, k_top, local, mean_v, k_scale, v_scale, chan, kt_scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("sparq::dense_triton", mutates_args=())
def _dense_triton_op(q: Tensor, k: Tensor, v: Tensor, length: int, live: Optional[Tensor], k_scale: Optional[Tensor],
                     v_scale: Optional[Tensor], chan: Optional[Tensor]) -> Tensor:
    return _dense_triton_impl(q, k, v, length, live, 1, k_scale, v_scale, chan)


@_dense_triton_op.register_fake
def _dense_triton_fake(q, k, v, length, live, k_scale, v_scale, chan):
    return q.new_empty(q.shape)


@torch.library.custom_op("sparq::dense_verify_triton", mutates_args=())
def _dense_verify_triton_op(q: Tensor, k: Tensor, v: Tensor, length: int, live: Tensor, queries: int,
                            k_scale: Optional[Tensor], v_scale: Optional[Tensor], chan: Optional[Tensor]) -> Tensor:
    return _dense_triton_impl(q, k, v, length, live, queries, k_scale, v_scale, chan)


@_dense_verify_triton_op.register_fake
def _dense_verify_triton_fake(q, k, v, length, live, queries, k_scale, v_scale, chan):
    return q.new_empty(q.shape)


def sparq_attention_triton(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                           live_length: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                           scales=None) -> Tensor:
    """sparq_attention (kernels.py's contract) with the Triton kernels. `length` is a Python int (shapes
    and grids follow it); live_length may also be a 0-dim / 1-element device tensor (bucketed reads:
    CUDA-graph safe, no host sync) that `length` bounds. CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1. scales (kernels.KVScales): a quantized cache's, read as stored."""
    s = (None,) * 4 if scales is None else (scales.k_scale, scales.v_scale, scales.chan, scales.kt_scale)
    return _sparq_triton_op(q, k, k_t, v, v_sum, length, live_length, r, k_top, local, mean_v, *s)


def dense_verify_triton(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Tensor, scales=None) -> Tensor:
    """dense_verify (kernels.py's contract) with the flash-decoding kernel: a row's T queries fold into its
    query heads (head-major), each K/V row read once for all of them, each query masked to its own
    causal range. q (B, n_kv, g, T, d) -> (B, n_kv, g, T, d). scales: an int8 K/V's (kernels.KVScales)."""
    B, n_kv, g, T, d = q.shape
    s = (None,) * 3 if scales is None else (scales.k_scale, scales.v_scale, scales.chan)
    return _dense_verify_triton_op(q.reshape(B, n_kv, g * T, d), k, v, length, live_length, T, *s).view(B, n_kv, g, T, d)


def dense_attention_triton(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Optional[Tensor] = None,
                           scales=None) -> Tensor:
    """dense_attention (kernels.py's contract) with the Triton flash-decoding kernel, split over S so that
    B = 1 fills the GPU; lengths as sparq_attention_triton's. scales: an int8 K/V's (kernels.KVScales)."""
    s = (None,) * 3 if scales is None else (scales.k_scale, scales.v_scale, scales.chan)
    return _dense_triton_op(q, k, v, length, live_length, *s)
