"""Triton kernels for decode attention on CUDA, SparQ and dense (kernels.py puts them in the run's Kernels record).

A leaf module, like kernels.py: tensors and ints in, tensors out. `sparq_attention_triton` computes
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
once by select (8 g bytes per position and KV head against 2 r bytes of K^T in bf16: +12% for MHA
at r = 32, +50% for GQA g = 4; they are normalised per head before the group sum, so the group
cannot be summed before every block is done), and the tiny stats and partials.

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

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # kernels.py must import without triton (CPU-only installs)
    triton = tl = None
    HAS_TRITON = False

TRITON_DOT_PRECISION = "tf32x3"  # "ieee" for exact fp32 FMAs (slower; the interpreter is exact either way)
INF_KEY = 0x7F800001  # select key of a forced (local window) position: above every finite score's key
TARGET_PROGRAMS = 4  # launch at least this many programs per SM where the work can be split


if HAS_TRITON:

    @triton.jit
    def _live_length(live, b, S_bound, LIVE: tl.constexpr):
        """A row's live length: LIVE 0 = the int `live`, 1 = a device scalar, 2 = per row (live[b])."""
        if LIVE == 0:
            n = live
        elif LIVE == 1:
            n = tl.load(live).to(tl.int32)
        else:
            n = tl.load(live + b).to(tl.int32)
        return tl.minimum(n, S_bound)

    @triton.jit
    def _topk_select(key, KT, PASS_BITS: tl.constexpr):
        """Exact top-KT of int32 keys >= -1 (-1 = never): (selected mask, its slot 0..KT-1 in key order).

        Finds the KT-th largest key T bit by bit, high to low (bits 30..0: keys are non-negative or
        -1), takes every key > T and the first (lowest-index) keys == T up to KT. Fewer than KT keys
        >= 0: all of them. PASS_BITS 1: one block-wide count per bit (at most 31 passes); 2: bit 30, then two
        bits per pass, their three candidates' counts packed into one int64 sum in 21-bit fields
        (16 passes; each pass is a reduction across the program's warps, whose latency dominates).
        """
        t = tl.sum(tl.zeros_like(key), axis=0)
        if PASS_BITS == 1:
            # Stops once exactly KT keys reach t (they are then the top KT; the ties below take them
            # all): at the highest bit where the KT-th and (KT+1)-th keys differ, for a score's float
            # bits about 8 + log2(N) passes, not 31; each pass is a block-wide reduction whose
            # latency dominates (the select and the merge took 31 each).
            bit = t + (1 << 30)
            more = bit > 0
            while more:
                cand = t | bit
                count = tl.sum((key >= cand).to(tl.int32), axis=0)
                t = tl.where(count >= KT, cand, t)
                bit = bit >> 1
                more = (bit > 0) & (count != KT)
        else:
            cand = t | (1 << 30)
            t = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= KT, cand, t)
            hi = tl.zeros_like(t) + (1 << 29)  # a scalar tensor: the loop carries it
            for _ in range(15):
                lo = hi >> 1
                c1 = t | lo
                c2 = t | hi
                c3 = c2 | lo
                packed = ((key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 21)
                          + ((key >= c3).to(tl.int64) << 42))
                counts = tl.sum(packed, axis=0)
                n1 = counts & 0x1FFFFF
                n2 = (counts >> 21) & 0x1FFFFF
                n3 = counts >> 42
                t = tl.where(n3 >= KT, c3, tl.where(n2 >= KT, c2, tl.where(n1 >= KT, c1, t)))
                hi = hi >> 2
        above = key > t
        need = KT - tl.sum(above.to(tl.int32), axis=0)
        tie = key == t
        chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        return chosen, slot

    @triton.jit
    def _sparq_rank_kernel(q_ptr, stride_qb, stride_qh, stride_qg, idx_ptr, n_kv, G, D, R,
                           G_PAD: tl.constexpr, D_PAD: tl.constexpr):
        """Step 0, one program per (batch row, KV head): the top-R components of |q| summed over the
        group, in decreasing order (ties: the lower index first), written to idx (B * n_kv, R) int32."""
        pid_bh = tl.program_id(0)
        b = pid_bh // n_kv
        h = pid_bh % n_kv
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < D
        q_row = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        q = tl.load(q_row + offs_g[:, None] * stride_qg + offs_d[None, :],
                    mask=(offs_g < G)[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # (G_PAD, D_PAD)
        a = tl.sum(tl.abs(q), axis=0)  # (D_PAD,); padding 0 with a higher index: it never outranks a component
        # rank[i] = how many components come before i: a d x d comparison (one tensor `a` on both
        # sides, so every pair is compared consistently). Each component's index is then stored at
        # its rank: a scatter, no sort.
        beats = (a[None, :] > a[:, None]) | ((a[None, :] == a[:, None]) & (offs_d[None, :] < offs_d[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)  # [i, j]: j ranks above i
        tl.store(idx_ptr + pid_bh * R + rank, offs_d, mask=d_mask & (rank < R))

    @triton.jit
    def _sparq_step1_block(q_hat, tau, k_rows, r_mask, ps_row, out_rows, bmax_rows, bsum_rows, g_mask, blk, n,
                           stride_ks, BLOCK_S: tl.constexpr, USE_DOT: tl.constexpr, DOT_NATIVE: tl.constexpr,
                           K_TRANSPOSED: tl.constexpr, MASK_S: tl.constexpr, PRECISION: tl.constexpr,
                           QUANT: tl.constexpr):
        """One block of BLOCK_S positions: logits = q_hat . K^T[rows, block] / tau for the G_PAD heads,
        written with the block's softmax max and sum per head. k_rows: (R_PAD, 1) pointers to step 0's
        rows of the source; MASK_S: the block holds the live end (masked along S; else no masks, so
        loads and stores vectorize). QUANT (K / chan stored): 1 int8, 2 int4 K^T (two positions per
        byte, low nibble first, stored + 8); chan is already in q_hat, each position's scale goes in here."""
        offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
        live_s = offs_s < n
        if QUANT == 2:  # an int4 K^T (always transposed): BLOCK_S / 2 contiguous bytes a row, each loaded
            # once and split into its two positions (indexing bytes by offs_s // 2 loaded each twice,
            # a gather the compiler cannot vectorize)
            offs_byte = blk * (BLOCK_S // 2) + tl.arange(0, BLOCK_S // 2)
            if MASK_S:  # a byte whose first position is live (an odd end: its high half is not)
                byte_mask = r_mask[:, None] & (2 * offs_byte < n)[None, :]
            else:
                byte_mask = r_mask[:, None]
            byte = tl.load(k_rows + offs_byte[None, :], mask=byte_mask, other=0x88).to(tl.int32)
            pair = tl.join((byte & 15) - 8, (byte >> 4) - 8)  # (R_PAD, BLOCK_S / 2, 2): low nibble first
            k_tile = tl.reshape(pair, (r_mask.shape[0], BLOCK_S)).to(tl.float32)  # position 2j, then 2j + 1
        else:
            if K_TRANSPOSED:  # K^T rows: BLOCK_S contiguous elements each (coalesced)
                k_ptrs = k_rows + offs_s[None, :]
            else:  # 1xK layout: gather r columns of d-contiguous rows
                k_ptrs = k_rows + offs_s[None, :].to(tl.int64) * stride_ks
            if MASK_S:
                k_mask = r_mask[:, None] & live_s[None, :]
            else:
                k_mask = r_mask[:, None]
            if QUANT:
                k_tile = tl.load(k_ptrs, mask=k_mask, other=0).to(tl.float32)
            else:
                k_tile = tl.load(k_ptrs, mask=k_mask, other=0.0)  # (R_PAD, BLOCK_S)
        if USE_DOT:  # GQA: tensor cores, g padded to G_PAD >= 16 rows
            if DOT_NATIVE:  # bf16/fp16 q and K: exact products, fp32 accumulation
                acc = tl.dot(q_hat, k_tile)
            else:
                acc = tl.dot(q_hat.to(tl.float32), k_tile.to(tl.float32), input_precision=PRECISION)
        else:  # MHA (G_PAD = 1): one FMA per K element on CUDA cores
            acc = tl.sum(q_hat.to(tl.float32)[:, :, None] * k_tile.to(tl.float32)[None, :, :], axis=1)
        if QUANT:
            if MASK_S:
                acc = acc * tl.load(ps_row + offs_s, mask=live_s, other=0.0).to(tl.float32)[None, :]
            else:
                acc = acc * tl.load(ps_row + offs_s).to(tl.float32)[None, :]  # fp32 or bf16 as stored
        logits = acc / tau[:, None]  # (G_PAD, BLOCK_S)
        if MASK_S:
            tl.store(out_rows + offs_s[None, :], logits, mask=g_mask[:, None] & live_s[None, :])
            logits = tl.where(live_s[None, :], logits, float("-inf"))
        else:
            tl.store(out_rows + offs_s[None, :], logits, mask=g_mask[:, None])
        m_blk = tl.max(logits, axis=1)  # finite: the block holds a live position
        l_blk = tl.sum(tl.exp(logits - m_blk[:, None]), axis=1)
        tl.store(bmax_rows + blk, m_blk, mask=g_mask)
        tl.store(bsum_rows + blk, l_blk, mask=g_mask)

    @triton.jit(do_not_specialize=["live", "S_bound", "BPP"])
    def _sparq_step1_kernel(
        q_ptr, stride_qb, stride_qh, stride_qg,  # q (B, n_kv, G, D), D unit-stride
        idx_ptr,  # (B * n_kv, R) int32: step 0's components by rank
        k_ptr, stride_kb, stride_kh, stride_krow, stride_ks,  # k_t (rows = d, S unit-stride) or k (S, d unit-stride)
        ps_ptr, stride_psb, stride_psh,  # QUANT: the step-1 source's per-position scales (S unit-stride)
        chan_ptr, stride_cb, stride_ch,  # QUANT: the per-channel scales (D unit-stride)
        logits_ptr,  # (B * n_kv, G, S_bound) fp32: written at live positions only
        bmax_ptr, bsum_ptr,  # (B * n_kv, G, NB) fp32: each block's max of the logits, and sum of exp(logit - max)
        live, n_kv, G, D, R, S_bound, NB, BPP,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_NATIVE: tl.constexpr, K_TRANSPOSED: tl.constexpr, LIVE: tl.constexpr,
        PRECISION: tl.constexpr, QUANT: tl.constexpr,
    ):
        """One program per (batch row, KV head, BPP consecutive blocks of S): approximate logits of all G
        heads. q_hat, tau and the rows' addresses are loaded once per program, before its blocks: the
        loop's loads depend on nothing the loop computes, so they run num_stages blocks ahead."""
        pid_bh = tl.program_id(0)
        pid_p = tl.program_id(1)
        b = pid_bh // n_kv
        h = pid_bh % n_kv
        n = _live_length(live, b, S_bound, LIVE)
        first = pid_p * BPP  # this program's first block
        if first * BLOCK_S < n:  # blocks past the live length: no work, no traffic (select never reads them)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            offs_r = tl.arange(0, R_PAD)
            g_mask = offs_g < G
            r_mask = offs_r < R
            q_row = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            q = tl.load(q_row + offs_g[:, None] * stride_qg + offs_d[None, :],
                        mask=g_mask[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)  # (G_PAD, D_PAD)
            total = tl.where(g_mask, tl.sum(tl.abs(q), axis=1), 1.0)  # sum |q| per head (padded heads: 1)
            rows = tl.load(idx_ptr + pid_bh * R + offs_r, mask=r_mask, other=0)  # the top-R components
            q_hat = tl.load(q_row + offs_g[:, None] * stride_qg + rows[None, :],
                            mask=g_mask[:, None] & r_mask[None, :], other=0.0)  # (G_PAD, R_PAD)
            tau = tl.where(g_mask, tl.sqrt(D * tl.sum(tl.abs(q_hat.to(tl.float32)), axis=1) / total), 1.0)
            if QUANT:
                chan_row = chan_ptr + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
                q_hat = q_hat.to(tl.float32) * tl.load(chan_row + rows, mask=r_mask, other=0.0)[None, :]
            k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
            if K_TRANSPOSED:
                k_rows = k_base + rows.to(tl.int64)[:, None] * stride_krow  # (R_PAD, 1)
            else:
                k_rows = k_base + rows.to(tl.int64)[:, None]
            ps_row = ps_ptr + b.to(tl.int64) * stride_psb + h.to(tl.int64) * stride_psh
            rows_g = (pid_bh * G + offs_g).to(tl.int64)
            out_rows = logits_ptr + rows_g[:, None] * S_bound  # (G_PAD, 1)
            bmax_rows = bmax_ptr + rows_g * NB
            bsum_rows = bsum_ptr + rows_g * NB
            left = n - first * BLOCK_S
            n_full = tl.minimum(BPP, left // BLOCK_S)  # fully live blocks
            for j in tl.range(0, n_full):
                _sparq_step1_block(q_hat, tau, k_rows, r_mask, ps_row, out_rows, bmax_rows, bsum_rows, g_mask,
                                   first + j, n, stride_ks, BLOCK_S, USE_DOT, DOT_NATIVE, K_TRANSPOSED, False,
                                   PRECISION, QUANT)
            if n_full < BPP and n_full * BLOCK_S < left:  # the block holding the live end
                _sparq_step1_block(q_hat, tau, k_rows, r_mask, ps_row, out_rows, bmax_rows, bsum_rows, g_mask,
                                   first + n_full, n, stride_ks, BLOCK_S, USE_DOT, DOT_NATIVE, K_TRANSPOSED, True,
                                   PRECISION, QUANT)

    @triton.jit(do_not_specialize=["live", "S_bound"])
    def _sparq_select_kernel(
        logits_ptr, bmax_ptr, bsum_ptr,  # from step 1
        stat_ptr,  # (B * n_kv, 2, G) fp32 out: each head's softmax max and sum (written by chunk 0)
        pos_ptr,  # (B * n_kv, n_chunks, KT) int32 out: selected positions, ascending
        key_ptr,  # (B * n_kv, n_chunks, KT) int32 out: their keys, -1 past the chunk's candidates (not FINAL)
        live, n_kv, G, S_bound, NB, KT, LOCAL, n_chunks,
        NB_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, LIVE: tl.constexpr,
        FINAL: tl.constexpr, PASS_BITS: tl.constexpr,
    ):
        """One program per (batch row, KV head, chunk of S): the chunk's top-KT positions by group score."""
        pid_bh = tl.program_id(0)
        pid_c = tl.program_id(1)
        b = pid_bh // n_kv
        n = _live_length(live, b, S_bound, LIVE)
        offs = pid_c * CHUNK + tl.arange(0, CHUNK)
        key = tl.where(offs < S_bound, 0, -1)  # dead positions rank above nothing but padding
        if pid_c * CHUNK < n:
            live_c = offs < n
            offs_j = tl.arange(0, NB_PAD)
            j_mask = offs_j < (n + BLOCK_S - 1) // BLOCK_S  # the blocks step 1 wrote
            score = tl.zeros((CHUNK,), dtype=tl.float32)
            for g in range(0, G):
                row = (pid_bh * G + g).to(tl.int64)
                m_blk = tl.load(bmax_ptr + row * NB + offs_j, mask=j_mask, other=float("-inf"))
                l_blk = tl.load(bsum_ptr + row * NB + offs_j, mask=j_mask, other=0.0)
                m_g = tl.max(m_blk, axis=0)
                z_g = tl.sum(l_blk * tl.exp(m_blk - m_g), axis=0)
                if pid_c == 0:
                    tl.store(stat_ptr + pid_bh * 2 * G + g, m_g)
                    tl.store(stat_ptr + pid_bh * 2 * G + G + g, z_g)
                logit = tl.load(logits_ptr + row * S_bound + offs, mask=live_c, other=float("-inf"))
                score += tl.exp(logit - m_g) / z_g
            key = tl.where(live_c, score.to(tl.int32, bitcast=True) + 1, key)  # scores >= 0: bits are ordered
            key = tl.where(live_c & (offs >= n - LOCAL), 2139095041, key)  # INF_KEY
        # Chunk 0 always selects (a row of live length 0 takes dead positions, weighted 0 in step 2;
        # it alone holds >= KT candidates); a later chunk wholly past the live end (a bucketed bound)
        # would choose none of its dead positions in the merge, so it skips the passes.
        if pid_c == 0 or pid_c * CHUNK < n:
            chosen, slot = _topk_select(key, KT, PASS_BITS)
            n_chosen = tl.sum(chosen.to(tl.int32), axis=0)
            out = (pid_bh * n_chunks + pid_c).to(tl.int64) * KT
            tl.store(pos_ptr + out + slot, offs, mask=chosen)
            if not FINAL:
                tl.store(key_ptr + out + slot, key, mask=chosen)
        else:
            n_chosen = tl.sum(tl.zeros_like(key), axis=0)
        if not FINAL:
            offs_k = tl.arange(0, CHUNK)
            out = (pid_bh * n_chunks + pid_c).to(tl.int64) * KT
            tl.store(key_ptr + out + offs_k, tl.full((CHUNK,), -1, tl.int32), mask=(offs_k >= n_chosen) & (offs_k < KT))

    @triton.jit
    def _sparq_merge_kernel(pos_in_ptr, key_in_ptr, pos_ptr, N, KT, N_PAD: tl.constexpr, PASS_BITS: tl.constexpr):
        """One program per (batch row, KV head): the top-KT of the chunks' N candidates (ascending positions)."""
        pid_bh = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, N_PAD)
        mask = offs < N
        key = tl.load(key_in_ptr + pid_bh * N + offs, mask=mask, other=-1)
        pos = tl.load(pos_in_ptr + pid_bh * N + offs, mask=mask, other=0)
        chosen, slot = _topk_select(key, KT, PASS_BITS)
        tl.store(pos_ptr + pid_bh * KT + slot, pos, mask=chosen)

    @triton.jit
    def _write_output(y, alpha, n, v_sum_ptr, stride_sb, stride_sh, out_ptr, stride_ob, stride_oh, stride_og, b, h,
                      offs_g, g_mask, offs_d, d_mask, MEAN_V: tl.constexpr):
        """y (G_PAD, D_PAD) normalised attention; with MEAN_V mix in mean(V) by alpha (G_PAD,); store."""
        if MEAN_V:
            v_mean = tl.load(v_sum_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + offs_d,
                             mask=d_mask, other=0.0) / n.to(tl.float32)
            y = alpha[:, None] * y + (1.0 - alpha[:, None]) * v_mean[None, :]
        out = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(out + offs_g[:, None] * stride_og + offs_d[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _write_partial(acc, m_i, l_i, alpha, part_acc_ptr, part_ml_ptr, pid_bh, pid_s, NSPLIT, G, D,
                       offs_g, g_mask, offs_d, d_mask):
        """One split's unnormalised state: acc (G, D) and (max, sum, alpha) (3, G), fp32."""
        base = (pid_bh * NSPLIT + pid_s).to(tl.int64)
        tl.store(part_acc_ptr + base * G * D + offs_g[:, None] * D + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + base * 3 * G + offs_g, m_i, mask=g_mask)
        tl.store(part_ml_ptr + base * 3 * G + G + offs_g, l_i, mask=g_mask)
        tl.store(part_ml_ptr + base * 3 * G + 2 * G + offs_g, alpha, mask=g_mask)

    @triton.jit
    def _load_query(q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, b, h, offs_g, offs_d,
                    g_mask, d_mask, DOT_NATIVE: tl.constexpr, INT8_KV: tl.constexpr):
        """The (G_PAD, D_PAD) query rows of step 2 and dense: in q's dtype for the native dots, else fp32;
        an int8 K's channel scales folded in (rounded once to q's dtype for the native dots)."""
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_g[:, None] * stride_qg
                    + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if not DOT_NATIVE:
            q = q.to(tl.float32)
        if INT8_KV:
            chan = tl.load(chan_ptr + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + offs_d,
                           mask=d_mask, other=0.0)
            if DOT_NATIVE:
                q = (q.to(tl.float32) * chan[None, :]).to(q_ptr.dtype.element_ty)
            else:
                q = q * chan[None, :]
        return q

    @triton.jit(do_not_specialize=["live", "S_bound"])
    def _sparq_step2_kernel(
        q_ptr, stride_qb, stride_qh, stride_qg,  # (B, n_kv, G, D), D unit-stride
        pos_ptr,  # (B * n_kv, KT) int32 selected positions
        k_ptr, stride_kb, stride_kh, stride_ks,  # (B_max, n_kv, S_max, D), D unit-stride
        v_ptr, stride_vb, stride_vh, stride_vs,
        ks_ptr, vs_ptr, stride_xb, stride_xh,  # INT8_KV: K's and V's per-position scales (S unit-stride)
        chan_ptr, stride_cb, stride_ch,  # INT8_KV: K's per-channel scales (D unit-stride)
        logits_ptr, stat_ptr,  # step 1's logits and select's (max, sum) per head: alpha (MEAN_V)
        v_sum_ptr, stride_sb, stride_sh,  # (B_max, n_kv, D) fp32, D unit-stride
        out_ptr, stride_ob, stride_oh, stride_og,  # (B, n_kv, G, D) in q's dtype (FINAL)
        part_acc_ptr, part_ml_ptr,  # partials (not FINAL)
        live, n_kv, G, D, KT, KS, NSPLIT, S_bound, sm_scale,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_NATIVE: tl.constexpr, MEAN_V: tl.constexpr, FINAL: tl.constexpr,
        LIVE: tl.constexpr, PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
    ):
        """One program per (batch row, KV head, split of the selection): exact attention of all G heads
        over its KS selected rows (online softmax); selected positions past the live length get weight 0.
        INT8_KV: the rows are int8 as stored, K = k k_scale chan (chan into q), V = v v_scale.
        DOT_NATIVE: q, K and V in one 16-bit dtype dot on tensor cores as they are (MHA too, its one
        query row padded to G_PAD = 16), the probabilities cast to V's dtype, as the dense kernel does;
        an int8 K/V converts to q's dtype exactly, q chan and v v_scale rounded once to it."""
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // n_kv
        h = pid_bh % n_kv
        n = _live_length(live, b, S_bound, LIVE)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < G
        d_mask = offs_d < D
        q = _load_query(q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, b, h, offs_g, offs_d,
                        g_mask, d_mask, DOT_NATIVE, INT8_KV)
        k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        x_off = b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh  # the scales' row
        rows_g = (pid_bh * G + offs_g).to(tl.int64)
        if MEAN_V:
            m_hat = tl.load(stat_ptr + pid_bh * 2 * G + offs_g, mask=g_mask, other=0.0)
            z_hat = tl.load(stat_ptr + pid_bh * 2 * G + G + offs_g, mask=g_mask, other=1.0)
        m_i = tl.full((G_PAD,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block gives p = 0, not NaN
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
        alpha = tl.zeros((G_PAD,), dtype=tl.float32)
        k_end = tl.minimum(pid_s * KS + KS, KT)
        for k0 in range(pid_s * KS, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            pos = tl.load(pos_ptr + pid_bh.to(tl.int64) * KT + offs_k, mask=offs_k < k_end, other=0)
            valid = (offs_k < k_end) & (pos < n)
            pos = pos.to(tl.int64)
            if EVEN_D:  # no mask along d (D == D_PAD): the row loads vectorize
                kv_mask = valid[:, None]
            else:
                kv_mask = valid[:, None] & d_mask[None, :]
            # K's, V's and (MEAN_V) the logits' gathers all issued before any use: each depends only on
            # pos, so their latencies overlap instead of adding up within the iteration
            k_sel = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
            v_sel = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
            if MEAN_V:
                logit = tl.load(logits_ptr + rows_g[:, None] * S_bound + pos[None, :],
                                mask=g_mask[:, None] & valid[None, :], other=float("-inf"))
            if not DOT_NATIVE:
                k_sel = k_sel.to(tl.float32)
                v_sel = v_sel.to(tl.float32)
            if USE_DOT:
                if DOT_NATIVE:  # bf16/fp16 operands (int8 converts exactly): exact products, fp32 accumulation
                    s = tl.dot(q, tl.trans(k_sel.to(q.dtype)))  # (G_PAD, BLOCK_K)
                else:
                    s = tl.dot(q, tl.trans(k_sel), input_precision=PRECISION)
            else:
                s = tl.sum(q[:, None, :] * k_sel[None, :, :], axis=2)
            if INT8_KV:
                s = s * tl.load(ks_ptr + x_off + pos, mask=valid, other=0.0)[None, :]
            s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            correction = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * correction + tl.sum(p, axis=1)
            if INT8_KV:  # V = v v_scale (in q's dtype for the native dot)
                v_sel = (v_sel * tl.load(vs_ptr + x_off + pos, mask=valid, other=0.0)[:, None]).to(q.dtype)
            if USE_DOT:
                if DOT_NATIVE:  # probabilities in V's dtype, as the torch path multiplies them
                    pv = tl.dot(p.to(q.dtype), v_sel.to(q.dtype))  # (G_PAD, D_PAD)
                else:
                    pv = tl.dot(p, v_sel, input_precision=PRECISION)
            else:
                pv = tl.sum(p[:, :, None] * v_sel[None, :, :], axis=1)
            acc = acc * correction[:, None] + pv
            m_i = m_new
            if MEAN_V:  # alpha_h = approximate mass of the selection = sum of s_hat_h over it
                alpha += tl.sum(tl.exp(logit - m_hat[:, None]) / z_hat[:, None], axis=1)
        if FINAL:
            _write_output(acc / l_i[:, None], alpha, n, v_sum_ptr, stride_sb, stride_sh, out_ptr, stride_ob,
                          stride_oh, stride_og, b, h, offs_g, g_mask, offs_d, d_mask, MEAN_V)
        else:
            _write_partial(acc, m_i, l_i, alpha, part_acc_ptr, part_ml_ptr, pid_bh, pid_s, NSPLIT, G, D,
                           offs_g, g_mask, offs_d, d_mask)

    @triton.jit(do_not_specialize=["live", "S_bound"])
    def _dense_kernel(
        q_ptr, stride_qb, stride_qh, stride_qg,  # (B, n_kv, G, D), D unit-stride
        k_ptr, stride_kb, stride_kh, stride_ks,  # (B_max, n_kv, S_max, D), D unit-stride
        v_ptr, stride_vb, stride_vh, stride_vs,
        ks_ptr, vs_ptr, stride_xb, stride_xh,  # INT8_KV: K's and V's per-position scales (S unit-stride)
        chan_ptr, stride_cb, stride_ch,  # INT8_KV: K's per-channel scales (D unit-stride)
        out_ptr, stride_ob, stride_oh, stride_og,  # (B, n_kv, G, D) in q's dtype (FINAL)
        part_acc_ptr, part_ml_ptr,  # partials (not FINAL)
        live, n_kv, G, D, S_bound, SPLIT, NSPLIT, sm_scale, QUERIES,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_NATIVE: tl.constexpr, FINAL: tl.constexpr, LIVE: tl.constexpr,
        PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
    ):
        """Flash-decoding: one program per (batch row, KV head, SPLIT positions); exact attention of all G
        heads over the live positions of its range (each K and V row read once). Splits past the live
        length do nothing (the combine skips them). QUERIES = T > 1 (speculative verification): the G
        rows are heads x T, head-major, and row i, query t = i % T, sees positions below n - T + 1 + t
        (a split wholly in its future leaves it the empty softmax (m = -1e30, l = 0) the combine weighs 0).
        INT8_KV: K and V int8 as stored, K = k k_scale chan (chan into q, k_scale into the logits), V =
        v v_scale (into the weights); with DOT_NATIVE the int8 rows convert to q's 16-bit dtype exactly and
        q chan and the weights round once to it (_native_kv_dot), else all in fp32."""
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // n_kv
        h = pid_bh % n_kv
        n = _live_length(live, b, S_bound, LIVE)
        start = pid_s * SPLIT
        if start < n:
            end = tl.minimum(start + SPLIT, n)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            g_mask = offs_g < G
            d_mask = offs_d < D
            q = _load_query(q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, b, h, offs_g, offs_d,
                            g_mask, d_mask, DOT_NATIVE, INT8_KV)
            k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
            v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
            x_off = b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh  # the scales' row
            m_i = tl.full((G_PAD,), -1.0e30, dtype=tl.float32)
            l_i = tl.zeros((G_PAD,), dtype=tl.float32)
            acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
            for j in range(start, end, BLOCK_N):
                offs_n = j + tl.arange(0, BLOCK_N)
                valid = offs_n < end
                if EVEN_D:
                    kv_mask = valid[:, None]
                else:
                    kv_mask = valid[:, None] & d_mask[None, :]
                rows = offs_n.to(tl.int64)
                k_blk = tl.load(k_base + rows[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
                v_blk = tl.load(v_base + rows[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
                if USE_DOT:
                    if DOT_NATIVE:  # bf16/fp16 operands (int8 converts exactly): exact products, fp32 accumulation
                        s = tl.dot(q, tl.trans(k_blk.to(q.dtype)))
                    else:
                        s = tl.dot(q, tl.trans(k_blk.to(tl.float32)), input_precision=PRECISION)
                else:
                    s = tl.sum(q.to(tl.float32)[:, None, :] * k_blk.to(tl.float32)[None, :, :], axis=2)
                if INT8_KV:
                    s = s * tl.load(ks_ptr + x_off + rows, mask=valid, other=0.0)[None, :]
                seen = valid[None, :] & (offs_n[None, :] < (n - QUERIES + 1 + offs_g % QUERIES)[:, None])
                s = tl.where(seen, s * sm_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                correction = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * correction + tl.sum(p, axis=1)
                if INT8_KV:  # V's scales into the weights
                    p = p * tl.load(vs_ptr + x_off + rows, mask=valid, other=0.0)[None, :]
                if USE_DOT:
                    if DOT_NATIVE:  # probabilities in q's (V's) dtype, as the torch path multiplies them
                        pv = tl.dot(p.to(q.dtype), v_blk.to(q.dtype))
                    else:
                        pv = tl.dot(p, v_blk.to(tl.float32), input_precision=PRECISION)
                else:
                    pv = tl.sum(p[:, :, None] * v_blk.to(tl.float32)[None, :, :], axis=1)
                acc = acc * correction[:, None] + pv
                m_i = m_new
            if FINAL:
                _write_output(acc / l_i[:, None], l_i, n, q_ptr, 0, 0, out_ptr, stride_ob, stride_oh, stride_og, b, h,
                              offs_g, g_mask, offs_d, d_mask, False)
            else:
                _write_partial(acc, m_i, l_i, l_i, part_acc_ptr, part_ml_ptr, pid_bh, pid_s, NSPLIT, G, D,
                               offs_g, g_mask, offs_d, d_mask)

    @triton.jit(do_not_specialize=["live", "S_bound"])
    def _combine_kernel(
        part_acc_ptr, part_ml_ptr,  # (B * n_kv, NSPLIT, G, D) and (B * n_kv, NSPLIT, 3, G) fp32
        v_sum_ptr, stride_sb, stride_sh,
        out_ptr, stride_ob, stride_oh, stride_og,
        live, n_kv, G, D, NSPLIT, SPLIT, S_bound,
        D_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, BY_LENGTH: tl.constexpr, MEAN_V: tl.constexpr,
        LIVE: tl.constexpr,
    ):
        """One program per (batch row, KV head, query head): merge the splits' (max, sum, acc[, alpha]).
        BY_LENGTH (dense): split s covers positions [s SPLIT, (s + 1) SPLIT); those past the live length
        were not written."""
        pid = tl.program_id(0)
        pid_bh = pid // G
        g = pid % G
        b = pid_bh // n_kv
        h = pid_bh % n_kv
        n = _live_length(live, b, S_bound, LIVE)
        if BY_LENGTH:
            n_valid = tl.minimum((n + SPLIT - 1) // SPLIT, NSPLIT)
        else:
            n_valid = NSPLIT
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < D
        m = tl.full((), -1.0e30, dtype=tl.float32)
        l = tl.full((), 0.0, dtype=tl.float32)
        alpha = tl.full((), 0.0, dtype=tl.float32)
        acc = tl.zeros((D_PAD,), dtype=tl.float32)
        for s0 in range(0, n_valid, SPLIT_BLOCK):
            offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
            s_mask = offs_s < n_valid
            base = (pid_bh * NSPLIT + offs_s).to(tl.int64)
            m_s = tl.load(part_ml_ptr + base * 3 * G + g, mask=s_mask, other=-1.0e30)
            l_s = tl.load(part_ml_ptr + base * 3 * G + G + g, mask=s_mask, other=0.0)
            a_s = tl.load(part_acc_ptr + (base * G + g)[:, None] * D + offs_d[None, :],
                          mask=s_mask[:, None] & d_mask[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(m_s, axis=0))
            scale = tl.exp(m_s - m_new)
            correction = tl.exp(m - m_new)
            l = l * correction + tl.sum(l_s * scale, axis=0)
            acc = acc * correction + tl.sum(a_s * scale[:, None], axis=0)
            m = m_new
            if MEAN_V:
                alpha += tl.sum(tl.load(part_ml_ptr + base * 3 * G + 2 * G + g, mask=s_mask, other=0.0), axis=0)
        y = acc / l
        if MEAN_V:
            v_mean = tl.load(v_sum_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + offs_d,
                             mask=d_mask, other=0.0) / n.to(tl.float32)
            y = alpha * y + (1.0 - alpha) * v_mean
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + g * stride_og + offs_d,
                 y.to(out_ptr.dtype.element_ty), mask=d_mask)


# ---------------------------------------------------------------------------------------------
# Launch plans: every size and constexpr fixed by the static shapes (no autotuning), so one CUDA
# graph per shape; tests/test_kernels_triton.py compiles every kernel of these plans for sm_90 and
# checks for register spills.
# ---------------------------------------------------------------------------------------------


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


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
    # left step 1 latency-bound on an H200 (46% of the read rate at best, README).
    R_PAD = max(16, _pow2(r))
    BLOCK_S = min(256 if rows * triton.cdiv(S_bound, 256) >= 2 * sms else 128, max(16, 8192 // R_PAD))
    NB = triton.cdiv(S_bound, BLOCK_S)
    BPP = blocks_per_program or max(1, min(16, round(rows * NB / (2 * sms))))
    step1 = dict(G_PAD=G_PAD, D_PAD=D_PAD, R_PAD=R_PAD, BLOCK_S=BLOCK_S, USE_DOT=use_dot,
                 DOT_NATIVE=use_dot and native_dot, PRECISION=TRITON_DOT_PRECISION, num_warps=8, num_stages=3)
    # Select: chunks of S (powers of two, >= 4 KT); the merge takes the chunks' candidates in one
    # program: at most 4096 of them while chunks stay <= 8192 positions. A select's latency grows
    # with its keys per thread (31 passes over them; on an H200 a 16384-position chunk took 100 us,
    # 4096 took 17 us), and the merge's with n_chunks KT: chunks of ~sqrt(S KT) balance the two,
    # rounded down: a bucketed bound just past a power of two (generation at 32k reads 33024) took
    # 4096-position chunks at 40 us a layer where 2048 took 19 (H200, the e2e profile, README).
    kv_native_dot = native_dot if kv_native_dot is None else kv_native_dot
    KT_P2 = _pow2(KT)
    if S_bound <= 4096 and rows >= sms or S_bound <= max(1024, 4 * KT_P2):
        CHUNK, n_chunks = max(16, _pow2(S_bound)), 1
    else:
        CHUNK = max(1024, 4 * KT_P2, 1 << (math.isqrt(S_bound * KT_P2).bit_length() - 1))
        while triton.cdiv(S_bound, CHUNK) * KT > 4096 and CHUNK < 8192 or triton.cdiv(S_bound, CHUNK) * KT > 16384:
            CHUNK *= 2
        n_chunks = triton.cdiv(S_bound, CHUNK)
        if n_chunks == 1:
            CHUNK = max(16, _pow2(S_bound))
    # The top-k's counting passes, one bit each (31 block-wide reductions): two bits a pass (16
    # reductions of packed int64 counts) measured no faster on an H200, 5-7% slower at 32k-128k and
    # Table 4's shape (results/gpu/2026-11-27b-h200); kept for the GPU check's side-by-side sweep.
    PASS_BITS = select_bits or 1
    select = dict(NB_PAD=max(16, _pow2(NB)), CHUNK=CHUNK, BLOCK_S=BLOCK_S, FINAL=n_chunks == 1, PASS_BITS=PASS_BITS,
                  num_warps=8 if CHUNK >= 2048 else 4, num_stages=1)
    merge = None if n_chunks == 1 else dict(N_PAD=_pow2(n_chunks * KT), PASS_BITS=PASS_BITS, num_warps=8,
                                            num_stages=1)
    # Step 2: 16 or 32 selected rows of K and V per loop step (64 spills with the dot); split the
    # selection over programs when the rows alone would not fill the GPU.
    BLOCK_K = 16 if KT <= 16 else 32
    n_split = 1 if rows >= target // 2 else max(1, min(triton.cdiv(KT, BLOCK_K), triton.cdiv(target // 2, rows)))
    KS = triton.cdiv(triton.cdiv(KT, n_split), BLOCK_K) * BLOCK_K
    n_split = triton.cdiv(KT, KS)
    # Tensor cores whenever K and V share q's 16-bit dtype, MHA too (one real row of 16), as in dense:
    # MHA's broadcast-multiply-sum reduces each row's d products across lanes (224 shuffles a loop
    # step in its SASS); fp32 or int8 keep the fp32 dots (GQA) and the FMAs (MHA).
    use_dot2 = use_dot or kv_native_dot
    step2 = dict(G_PAD=max(16, _pow2(g)) if use_dot2 else 1, D_PAD=D_PAD, EVEN_D=d == D_PAD, BLOCK_K=BLOCK_K,
                 USE_DOT=use_dot2, DOT_NATIVE=kv_native_dot, PRECISION=TRITON_DOT_PRECISION, FINAL=n_split == 1,
                 num_warps=8 if use_dot else 4, num_stages=3)
    combine = None if n_split == 1 else dict(D_PAD=D_PAD, SPLIT_BLOCK=min(16, _pow2(n_split)), BY_LENGTH=False,
                                             num_warps=4, num_stages=1)
    return dict(NB=NB, BPP=BPP, n_step1=triton.cdiv(NB, BPP), n_chunks=n_chunks, KS=KS, n_split=n_split, rank=rank,
                step1=step1, select=select, merge=merge, step2=step2, combine=combine)


def dense_plan(B: int, n_kv: int, g: int, d: int, S_bound: int, native_dot: bool, sms: int = 132) -> dict:
    """Sizes and launch parameters of one dense call: SPLIT positions per program, n_split programs per row."""
    rows = B * n_kv
    # Tensor cores whenever the operands are 16-bit (MHA too: one real row of the 16 a dot needs costs
    # nothing in a memory-bound loop, while MHA's CUDA-core path read 2.3x slower than SDPA on an H200,
    # README); fp32 MHA keeps the FMAs.
    use_dot = g > 1 or native_dot
    G_PAD = max(16, _pow2(g)) if use_dot else 1
    D_PAD = max(16, _pow2(d))
    BLOCK_N = 64 if (use_dot and native_dot or d <= 64) else 32  # fp32 tiles: 32 rows (64 spills)
    target = TARGET_PROGRAMS * sms
    per_row = max(1, triton.cdiv(target, rows))
    SPLIT = max(4 * BLOCK_N, triton.cdiv(triton.cdiv(S_bound, per_row), BLOCK_N) * BLOCK_N)
    n_split = triton.cdiv(S_bound, SPLIT)
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
    rounds its values. The fp32 alternative ran an H200's int8 dense at 12-14% of the read rate, 4.3x
    the bf16 kernel's time for half its bytes (Llama-2-7B, 32k; results/gpu/2026-11-27b-h200)."""
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
