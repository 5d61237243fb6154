"""SparQ Attention for single-token decode (Ribar et al., ICML 2024), and transfer accounting.

Per batch row and KV head, with q the g query heads sharing that KV head, d the head dim and
S the live length (positions [0, S) of the cache, the current token included):

  1. i1 = top-r of |q| summed over the group. Read the r rows i1 of K^T (S-contiguous) and form
     s_hat = softmax(q[i1] . K^T[i1] / tau), tau = sqrt(d * |q[i1]|_1 / |q|_1) per query head.
  2. Force the last `local` positions in, take the top-k of s_hat summed over the group, read
     those k rows of K and V once and attend exactly over them for all g heads.
  3. Optionally y = alpha * y + (1 - alpha) * mean(V), alpha = sum of s_hat over the selection.

Soft-capped models (Gemma 2): the cap applies wherever dense attention applies it, to the exact
logits of step 2, and also to step 1's approximate logits, s_hat = softmax(cap(q[i1] . K^T[i1] / tau)):
the ranking is unchanged (the cap is monotonic) and s_hat, hence mean-V's alpha, then approximates
the distribution the capped model attends with.

`sparq_reference` follows the paper line by line with loops; `sparq_attention_torch` is the
batched PyTorch path the model runs when the run has no fused SparQ kernel (kernels.py holds those:
its docstring is the kernels' contract); `SparQDecode` is the decode policy that calls either.
Adaptive SparQ (a byte budget split per layer and step) is sparq_adaptive.py; the paper's baselines are
baselines.py, the registry of policies policies.py and the budgets budgets.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import Tensor

from attention import DenseDecode, KernelPolicy, beyond_live, per_row, softcap
from cache import KVCache
from kernels import TORCH_KERNELS, Kernels


@dataclass
class SparQConfig:
    r: int  # components of q used for the approximate scores
    k_top: int = 128  # the paper's k: positions attended exactly (--sparq-k; `k` is the key cache here)
    local: Optional[int] = None  # recent positions always kept; None -> k_top // 4
    mean_v: bool = False  # mean-value reallocation (step 3)

    def __post_init__(self):
        if self.local is None:
            self.local = self.k_top // 4

    def validate(self, head_dim: int) -> None:
        """Raise ValueError with a one-line message for settings the algorithm cannot run."""
        if not 1 <= self.r <= head_dim:
            raise ValueError(f"--sparq-r must be between 1 and the head dim ({head_dim}), got {self.r}")
        if self.k_top < 1:
            raise ValueError(f"--sparq-k must be at least 1, got {self.k_top}")
        if not 0 <= self.local <= self.k_top:
            raise ValueError(f"--sparq-local must be between 0 and --sparq-k ({self.k_top}), got {self.local}")


# ---------------------------------------------------------------------------------------------
# Reference: loops over batch rows and KV heads, exactly as written in the paper
# ---------------------------------------------------------------------------------------------


def sparq_reference(q: Tensor, k: Tensor, v: Tensor, v_sum: Tensor, length: int, config: SparQConfig,
                    cap: Optional[float] = None) -> Tensor:
    """q (B, n_kv, g, d); k, v (B, n_kv, S_max, d); v_sum (B, n_kv, d) -> (B, n_kv, g, d) in q.dtype.

    Computes in fp32. Reads K only in its d-contiguous layout: the layouts hold the same values.
    cap: logit soft-capping (module docstring).
    """
    B, n_kv, g, d = q.shape
    S = length
    out = torch.empty(B, n_kv, g, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(n_kv):
            qh = q[b, h].float()  # (g, d)
            K, V = k[b, h, :S].float(), v[b, h, :S].float()  # (S, d)

            # Step 1: approximate scores from the r largest components of |q| (summed over the group).
            i1 = torch.topk(qh.abs().sum(0), config.r).indices  # (r,)
            tau = torch.sqrt(d * qh[:, i1].abs().sum(-1) / qh.abs().sum(-1))  # (g,)
            s_hat = torch.softmax(softcap(qh[:, i1] @ K[:, i1].T / tau[:, None], cap), dim=-1)  # (g, S)

            # Step 2: top-k of the group's summed scores, with the local window forced in.
            selection_score = s_hat.sum(0)  # (S,)
            n_local = min(config.local, S)
            selection_score[S - n_local:] = float("inf")
            i2 = torch.topk(selection_score, min(config.k_top, S)).indices  # (k,)
            probs = torch.softmax(softcap(qh @ K[i2].T / math.sqrt(d), cap), dim=-1)  # (g, k)
            y = probs @ V[i2]  # (g, d)

            # Step 3: interpolate with the mean value vector by the approximate top-k mass.
            if config.mean_v:
                alpha = s_hat[:, i2].sum(-1, keepdim=True)  # (g, 1)
                y = alpha * y + (1 - alpha) * (v_sum[b, h] / S)
            out[b, h] = y
    return out.to(q.dtype)


def selection_has_ties(q: Tensor, K: Tensor, length: int, config: SparQConfig) -> bool:
    """A tie at the top-r boundary of |q| summed over the group, or at the top-k boundary of the
    reference's selection scores, for one (row, KV head): q (g, d), K (>= length, d). Which of two
    tied candidates is taken is unspecified (the kernels take the lower index, torch.topk does not
    say), so a kernel is compared with sparq_reference only where this is False (low r on bf16
    caches gives equal logits)."""
    g, d = q.shape
    qh, K = q.float(), K[:length].float()
    a = qh.abs().sum(0).sort(descending=True).values
    if config.r < d and not a[config.r - 1] > a[config.r]:
        return True
    n_local = min(config.local, length)
    m = min(config.k_top, length) - n_local
    if m <= 0 or m >= length - n_local:
        return False
    i1 = torch.topk(qh.abs().sum(0), config.r).indices
    tau = torch.sqrt(d * qh[:, i1].abs().sum(-1) / qh.abs().sum(-1))
    score = torch.softmax(qh[:, i1] @ K[:, i1].T / tau[:, None], dim=-1).sum(0)[: length - n_local]
    top = score.sort(descending=True).values
    return not bool(top[m - 1] > top[m])


# ---------------------------------------------------------------------------------------------
# Batched PyTorch path (runs in the model, compile-friendly)
# ---------------------------------------------------------------------------------------------


def top_components(q: Tensor, r: int) -> Tensor:
    """SparQ's choice of step 1's components: each KV head's r largest |q_i| summed over its group of query
    heads. q (B, n_kv, g, d) -> (B, n_kv, r) indices."""
    return torch.topk(q.float().abs().sum(2), r, dim=-1).indices


def approximate_scores(q: Tensor, k: Tensor, k_t: Optional[Tensor], length: int, r: int,
                       mask: Optional[Tensor] = None, cap: Optional[float] = None,
                       channels: Optional[Tensor] = None) -> Tensor:
    """Step 1 for all rows and heads at once: s_hat (B, n_kv, g, S) in fp32.

    q (B, n_kv, g, d). With k_t (B, n_kv, d, S_max) the r rows are read S-contiguously; without it
    (layout "once") the r columns are gathered from k (B, n_kv, S_max, d) along d.
    mask (S,): True at positions that are not live (bucketed lengths only).
    channels (n_kv, r): read these components (DoubleSparse's fixed ones) instead of q's top r; k_t
    then holds just those rows, (B, n_kv, r, S_max) (KVCache.read_k_t(..., channels)).
    """
    B, n_kv, g, d = q.shape
    qf = q.float()
    if channels is None:
        i1 = top_components(qf, r)  # (B, n_kv, r)
    else:
        i1 = channels.to(q.device)[None].expand(B, n_kv, r)
    q_hat = torch.gather(qf, 3, i1[:, :, None, :].expand(B, n_kv, g, r))  # (B, n_kv, g, r)
    if k_t is not None:
        if channels is None:
            rows = torch.gather(k_t[:B, :, :, :length], 2, i1[..., None].expand(B, n_kv, r, length))  # (B, n_kv, r, S)
        else:
            rows = k_t[:B, :, :, :length]  # (B, n_kv, r, S): the channels' rows, read as such
        logits = q_hat @ rows.to(q_hat.dtype)  # (B, n_kv, g, S)
    else:
        cols = torch.gather(k[:B, :, :length], 3, i1[:, :, None, :].expand(B, n_kv, length, r))  # (B, n_kv, S, r)
        logits = q_hat @ cols.to(q_hat.dtype).transpose(-1, -2)
    tau = torch.sqrt(d * q_hat.abs().sum(-1, keepdim=True) / qf.abs().sum(-1, keepdim=True))  # (B, n_kv, g, 1)
    logits = softcap(logits / tau, cap)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def select_positions(s_hat: Tensor, length: int, k: int, local: int, live_length: Optional[Tensor] = None) -> Tensor:
    """Step 2 selection: (B, n_kv, min(k, S)) positions, the last `local` live ones always included.

    With live_length (0-dim: bucketed lengths; (B,): per row) positions beyond it rank last and
    the local window ends there; sparse_attention masks them.
    """
    score = s_hat.sum(2)  # (B, n_kv, S)
    if live_length is None:
        n_local = min(local, length)
        if n_local > 0:
            score[..., length - n_local:] = float("inf")
    else:
        position = torch.arange(length, device=score.device)
        live = per_row(live_length, 3)
        score = torch.where(position >= live - local, float("inf"), score)
        score = torch.where(position >= live, float("-inf"), score)
    return torch.topk(score, min(k, length), dim=-1).indices


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, live_length: Optional[Tensor] = None,
                     cap: Optional[float] = None) -> Tensor:
    """Exact attention over the selected positions (B, n_kv, k): gathers k rows of K and V once per KV head."""
    B, n_kv, g, d = q.shape
    index = positions[..., None].expand(*positions.shape, d)  # (B, n_kv, k, d)
    k_sel = torch.gather(k[:B], 2, index)  # (B, n_kv, k, d)
    v_sel = torch.gather(v[:B], 2, index)
    scores = softcap((q.float() @ k_sel.float().transpose(-1, -2)) / math.sqrt(d), cap)  # (B, n_kv, g, k)
    if live_length is not None:
        scores = scores.masked_fill((positions >= per_row(live_length, 3))[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_sel.float()  # (B, n_kv, g, d) fp32


def mix_mean_v(y: Tensor, scores: Tensor, positions: Tensor, v_sum: Tensor, length: int,
               live_length: Optional[Tensor]) -> Tensor:
    """Step 3: alpha y + (1 - alpha) mean(V) for y (B, n_kv, g, d) fp32, alpha the mass of `scores`
    (B, n_kv, g, S) on the selected positions (B, n_kv, k), mean(V) = v_sum over the live positions."""
    B = y.shape[0]
    alpha = torch.gather(scores, 3, positions[:, :, None, :].expand(-1, -1, scores.shape[2], -1)).sum(-1, keepdim=True)
    n = length if live_length is None else per_row(live_length, 3)
    return alpha * y + (1 - alpha) * (v_sum[:B] / n)[:, :, None, :]  # v_sum (B, n_kv, 1, d)


def sparq_attention_torch(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                          live_length: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                          cap: Optional[float] = None, channels: Optional[Tensor] = None) -> Tensor:
    """SparQ decode attention on the static cache tensors. q (B, n_kv, g, d) -> (B, n_kv, g, d).

    k, v (B_max, n_kv, S_max, d), k_t (B_max, n_kv, d, S_max) or None (layout "once"), v_sum
    (B_max, n_kv, d) fp32. Reads positions [0, length); live_length None: all of them are live,
    else a device tensor beyond which they are masked (bucketed lengths or per-row lengths: the
    kernel contract, kernels.py). cap: logit soft-capping (the kernels take none). channels (n_kv, r):
    step 1's components fixed (DoubleSparse), not q's top r; k_t then holds just their rows
    (B, n_kv, r, S_max), or None (layout "once": gathered from k).
    """
    mask = beyond_live(length, live_length) if live_length is not None else None
    s_hat = approximate_scores(q, k, k_t, length, r, mask, cap, channels)  # (B, n_kv, g, S)
    positions = select_positions(s_hat, length, k_top, local, live_length)  # (B, n_kv, k)
    y = sparse_attention(q, k, v, positions, live_length, cap)  # fp32
    if mean_v:
        y = mix_mean_v(y, s_hat, positions, v_sum, length, live_length)
    return y.to(q.dtype)


class SparQDecode(KernelPolicy):
    """The SparQ decode attention policy: the run's SparQ kernel, or the torch path above.

    While a layer sees at most k positions, SparQ would select all of them (step 2 is then exact
    attention and mean-V's alpha is 1): it runs dense attention instead, which computes the same
    thing without step 1's reads. dense_when_short=False keeps the sparse path (tests of SparQ itself).
    """

    name = "sparq"

    def __init__(self, config: SparQConfig, kernels: Kernels = TORCH_KERNELS, cap: Optional[float] = None,
                 dense_when_short: bool = True):
        super().__init__()
        self.config = config
        self.bind_kernels(kernels.sparq_attention, partial(sparq_attention_torch, cap=cap), kernels, cap)
        self.dense_when_short = dense_when_short

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        c = self.config
        if self.dense_when_short and cache.visible_length(length) <= c.k_top:
            return self.dense(q, cache, length)
        return self.attend_cache(q, cache, length, lambda view: (
            view.k, view.k_t, view.v, view.v_sum, view.length, view.live_length, c.r, c.k_top, c.local, c.mean_v))

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Elements moved per KV head per step at seq_len visible positions (paper, eq. 11): S r + 2 k d + 4 d;
        dense's 2 S d + 2 d while S <= k (the dense path)."""
        if self.dense_when_short and seq_len <= self.config.k_top:
            return DenseDecode().transfer_elements(seq_len, head_dim)
        k = min(self.config.k_top, seq_len)
        return seq_len * self.config.r + 2 * k * head_dim + 4 * head_dim

    def step1_reads(self, seq_len: int, head_dim: int) -> tuple[int, int]:
        if self.dense_when_short and seq_len <= self.config.k_top:
            return 0, 0
        return seq_len, self.config.r
