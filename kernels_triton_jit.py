"""The Triton kernels of kernels_triton.py's decode attention, SparQ's steps and dense flash-decoding: the
@triton.jit code alone. It imports triton at the top: kernels_triton.py imports this module only where
triton is installed (a CPU-only machine runs without it); what each kernel computes, and how a call
launches them, is kernels_triton.py's docstring.
"""
import triton
import triton.language as tl


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
        # latency dominates the select and the merge.
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


@triton.jit
def _attend_prologue(q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, k_ptr, stride_kb,
                     stride_kh, v_ptr, stride_vb, stride_vh, stride_xb, stride_xh, b, h, G, D,
                     G_PAD: tl.constexpr, D_PAD: tl.constexpr, DOT_NATIVE: tl.constexpr, INT8_KV: tl.constexpr):
    """What step 2 and dense attention start from: the G query rows of (b, h) (_load_query) with their
    offsets and masks, and the bases of the row's K, V and per-position scales."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    q = _load_query(q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, b, h, offs_g, offs_d,
                    g_mask, d_mask, DOT_NATIVE, INT8_KV)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    x_off = b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh  # the scales' row
    return offs_g, offs_d, g_mask, d_mask, q, k_base, v_base, x_off


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
    offs_g, offs_d, g_mask, d_mask, q, k_base, v_base, x_off = _attend_prologue(
        q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, k_ptr, stride_kb, stride_kh,
        v_ptr, stride_vb, stride_vh, stride_xb, stride_xh, b, h, G, D, G_PAD, D_PAD, DOT_NATIVE, INT8_KV)
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
        offs_g, offs_d, g_mask, d_mask, q, k_base, v_base, x_off = _attend_prologue(
            q_ptr, stride_qb, stride_qh, stride_qg, chan_ptr, stride_cb, stride_ch, k_ptr, stride_kb, stride_kh,
            v_ptr, stride_vb, stride_vh, stride_xb, stride_xh, b, h, G, D, G_PAD, D_PAD, DOT_NATIVE, INT8_KV)
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
