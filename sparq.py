"""SparQ Attention for single-token decode (Ribar et al., ICML 2024), and transfer accounting.

Per batch row and KV head, with q the g query heads sharing that KV head, d the head dim and
S the live length (positions [0, S) of the cache, the current token included):

  1. i1 = top-r of |q| summed over the group. Read the r rows i1 of K^T (S-contiguous) and form
     s_hat = softmax(q[i1] . K^T[i1] / tau), tau = sqrt(d * |q[i1]|_1 / |q|_1) per query head.
  2. Force the last `local` positions in, take the top-k of s_hat summed over the group, read
     those k rows of K and V once and attend exactly over them for all g heads.
  3. Optionally y = alpha * y + (1 - alpha) * mean(V), alpha = sum of s_hat over the selection.

`sparq_reference` follows the paper line by line with loops; `sparq_attention_torch` is the
batched PyTorch path the model runs when no fused kernel is used (kernels.py holds the fused ones).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from model import DecodePolicy, KVCache, ModelArgs, beyond_live


@dataclass
class SparQConfig:
    r: int  # components of q used for the approximate scores
    k: int = 128  # positions attended exactly
    local: Optional[int] = None  # recent positions always kept; None -> k // 4
    mean_v: bool = False  # mean-value reallocation (step 3)

    def __post_init__(self):
        if self.local is None:
            self.local = self.k // 4

    def validate(self, head_dim: int) -> None:
        """Raise ValueError with a one-line message for settings the algorithm cannot run."""
        if not 1 <= self.r <= head_dim:
            raise ValueError(f"--sparq-r must be between 1 and the head dim ({head_dim}), got {self.r}")
        if self.k < 1:
            raise ValueError(f"--sparq-k must be at least 1, got {self.k}")
        if not 0 <= self.local <= self.k:
            raise ValueError(f"--sparq-local must be between 0 and --sparq-k ({self.k}), got {self.local}")


# ---------------------------------------------------------------------------------------------
# Reference: loops over batch rows and KV heads, exactly as written in the paper
# ---------------------------------------------------------------------------------------------


def sparq_reference(q: Tensor, k: Tensor, v: Tensor, v_sum: Tensor, length: int, config: SparQConfig) -> Tensor:
    """q (B, n_kv, g, d); k, v (B, n_kv, S_max, d); v_sum (B, n_kv, d) -> (B, n_kv, g, d) in q.dtype.

    Computes in fp32. Reads K only in its d-contiguous layout: the layouts hold the same values.
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
            s_hat = torch.softmax(qh[:, i1] @ K[:, i1].T / tau[:, None], dim=-1)  # (g, S)

            # Step 2: top-k of the group's summed scores, with the local window forced in.
            selection_score = s_hat.sum(0)  # (S,)
            n_local = min(config.local, S)
            selection_score[S - n_local:] = float("inf")
            i2 = torch.topk(selection_score, min(config.k, S)).indices  # (k,)
            probs = torch.softmax(qh @ K[i2].T / math.sqrt(d), dim=-1)  # (g, k)
            y = probs @ V[i2]  # (g, d)

            # Step 3: interpolate with the mean value vector by the approximate top-k mass.
            if config.mean_v:
                alpha = s_hat[:, i2].sum(-1, keepdim=True)  # (g, 1)
                y = alpha * y + (1 - alpha) * (v_sum[b, h] / S)
            out[b, h] = y
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Batched PyTorch path (runs in the model, compile-friendly)
# ---------------------------------------------------------------------------------------------


def approximate_scores(q: Tensor, k: Tensor, k_t: Optional[Tensor], length: int, r: int,
                       mask: Optional[Tensor] = None) -> Tensor:
    """Step 1 for all rows and heads at once: s_hat (B, n_kv, g, S) in fp32.

    q (B, n_kv, g, d). With k_t (B, n_kv, d, S_max) the r rows are read S-contiguously; without it
    (layout "once") the r columns are gathered from k (B, n_kv, S_max, d) along d.
    mask (S,): True at positions that are not live (bucketed lengths only).
    """
    B, n_kv, g, d = q.shape
    qf = q.float()
    i1 = torch.topk(qf.abs().sum(2), r, dim=-1).indices  # (B, n_kv, r)
    q_hat = torch.gather(qf, 3, i1[:, :, None, :].expand(B, n_kv, g, r))  # (B, n_kv, g, r)
    if k_t is not None:
        rows = torch.gather(k_t[:B, :, :, :length], 2, i1[..., None].expand(B, n_kv, r, length))  # (B, n_kv, r, S)
        logits = q_hat @ rows.to(q_hat.dtype)  # (B, n_kv, g, S)
    else:
        cols = torch.gather(k[:B, :, :length], 3, i1[:, :, None, :].expand(B, n_kv, length, r))  # (B, n_kv, S, r)
        logits = q_hat @ cols.to(q_hat.dtype).transpose(-1, -2)
    tau = torch.sqrt(d * q_hat.abs().sum(-1, keepdim=True) / qf.abs().sum(-1, keepdim=True))  # (B, n_kv, g, 1)
    logits = logits / tau
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def select_positions(s_hat: Tensor, length: int, k: int, local: int, live_length: Optional[Tensor] = None) -> Tensor:
    """Step 2 selection: (B, n_kv, min(k, S)) positions, the last `local` live ones always included.

    With live_length (bucketed lengths) positions beyond it rank last; sparse_attention masks them.
    """
    score = s_hat.sum(2)  # (B, n_kv, S)
    if live_length is None:
        n_local = min(local, length)
        if n_local > 0:
            score[..., length - n_local:] = float("inf")
    else:
        position = torch.arange(length, device=score.device)
        score = torch.where(position >= live_length - local, float("inf"), score)
        score = torch.where(position >= live_length, float("-inf"), score)
    return torch.topk(score, min(k, length), dim=-1).indices


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, live_length: Optional[Tensor] = None) -> Tensor:
    """Exact attention over the selected positions (B, n_kv, k): gathers k rows of K and V once per KV head."""
    B, n_kv, g, d = q.shape
    index = positions[..., None].expand(*positions.shape, d)  # (B, n_kv, k, d)
    k_sel = torch.gather(k[:B], 2, index)  # (B, n_kv, k, d)
    v_sel = torch.gather(v[:B], 2, index)
    scores = (q.float() @ k_sel.float().transpose(-1, -2)) / math.sqrt(d)  # (B, n_kv, g, k)
    if live_length is not None:
        scores = scores.masked_fill((positions >= live_length)[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_sel.float()  # (B, n_kv, g, d) fp32


def sparq_attention_torch(q: Tensor, cache: KVCache, length: int, config: SparQConfig) -> Tensor:
    """SparQ decode attention on the static cache. q (B, n_kv, g, d) -> (B, n_kv, g, d)."""
    B = q.shape[0]
    live = cache.live_length if cache.length_bucket > 1 else None  # None: exactly `length` live positions
    mask = beyond_live(length, live) if live is not None else None
    s_hat = approximate_scores(q, cache.k, cache.k_t, length, config.r, mask)  # (B, n_kv, g, S)
    positions = select_positions(s_hat, length, config.k, config.local, live)  # (B, n_kv, k)
    y = sparse_attention(q, cache.k, cache.v, positions, live)  # fp32
    if config.mean_v:
        alpha = torch.gather(s_hat, 3, positions[:, :, None, :].expand(-1, -1, s_hat.shape[2], -1)).sum(-1, keepdim=True)
        v_mean = (cache.v_sum[:B] / (length if live is None else live))[:, :, None, :]  # (B, n_kv, 1, d)
        y = alpha * y + (1 - alpha) * v_mean
    return y.to(q.dtype)


class SparQDecode(DecodePolicy):
    """The SparQ decode attention policy, for Transformer.set_decode_attention."""

    name = "sparq"

    def __init__(self, config: SparQConfig, kernel: str = "torch"):
        super().__init__()
        self.config = config
        self.kernel = kernel

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        if self.kernel == "torch":
            return sparq_attention_torch(q, cache, length, self.config)
        import kernels

        return kernels.sparq_attention(q, cache, length, self.config, self.kernel)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Elements moved per KV head per step (paper, eq. 11): S r + 2 k d + 4 d."""
        k = min(self.config.k, seq_len)
        return seq_len * self.config.r + 2 * k * head_dim + 4 * head_dim


# ---------------------------------------------------------------------------------------------
# Baselines from the paper, as decode policies on the same cache (transfers: paper, Appendix G)
# ---------------------------------------------------------------------------------------------


def exact_scores(q: Tensor, k: Tensor, length: int) -> Tensor:
    """softmax(q . K / sqrt(d)) over the live positions: (B, n_kv, g, S) fp32."""
    B, _, _, d = q.shape
    return torch.softmax((q.float() @ k[:B, :, :length].float().transpose(-1, -2)) / math.sqrt(d), dim=-1)


class OracleDecode(DecodePolicy):
    """SparQ step 2 on the exact top-k positions, chosen at no transfer cost (the paper's upper bound)."""

    name = "oracle"

    def __init__(self, config: SparQConfig):
        super().__init__()
        self.config = config

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        scores = exact_scores(q, cache.k, length)  # (B, n_kv, g, S)
        positions = select_positions(scores, length, self.config.k, self.config.local)
        y = sparse_attention(q, cache.k, cache.v, positions)
        if self.config.mean_v:
            alpha = torch.gather(scores, 3, positions[:, :, None, :].expand(-1, -1, scores.shape[2], -1)).sum(-1, keepdim=True)
            y = alpha * y + (1 - alpha) * (cache.v_sum[: q.shape[0]] / length)[:, :, None, :]
        return y.to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.config.k, seq_len) * head_dim + 2 * head_dim


class TopKDecode(DecodePolicy):
    """FlexGen-style top-k: exact scores over the whole K, then only the top-k values are read."""

    name = "topk"

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        positions = select_positions(exact_scores(q, cache.k, length), length, self.k, local=0)
        return sparse_attention(q, cache.k, cache.v, positions).to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return seq_len * head_dim + min(self.k, seq_len) * head_dim + 2 * head_dim


class LocalDecode(DecodePolicy):
    """LM-Infinite / StreamingLLM: the first `sinks` positions plus the k - sinks most recent ones."""

    name = "local"

    def __init__(self, k: int, sinks: int = 16):
        super().__init__()
        if k <= sinks:
            raise ValueError(f"--kv-budget must exceed the {sinks} sink tokens of local attention, got {k}")
        self.k, self.sinks = k, sinks

    def positions(self, length: int, device: torch.device) -> Tensor:
        """The attended positions (min(k, length),), sinks first."""
        if length <= self.k:
            return torch.arange(length, device=device)
        recent = self.k - self.sinks
        return torch.cat([torch.arange(self.sinks, device=device), torch.arange(length - recent, length, device=device)])

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, n_kv = q.shape[:2]
        positions = self.positions(length, q.device).expand(B, n_kv, -1)
        return sparse_attention(q, cache.k, cache.v, positions).to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.k, seq_len) * head_dim + 2 * head_dim


class H2ODecode(DecodePolicy):
    """H2O: an evicting cache of k positions, the `local` most recent plus k - local heavy hitters.

    Heavy hitters are ranked by the attention they received, summed over every prefill and decode
    query and averaged over the query heads of a GQA group. An evicted position never returns.
    State per (batch row, KV head): the kept positions and their cumulative scores; a slot with
    position -1 is empty (before the budget fills).
    """

    name = "h2o"

    def __init__(self, k: int, local: Optional[int] = None, prefill_chunk: int = 256):
        super().__init__()
        self.k = k
        self.local = k // 4 if local is None else local
        self.prefill_chunk = prefill_chunk
        self.kept: Optional[Tensor] = None  # (B, n_kv, k) positions, -1 = empty
        self.score: Optional[Tensor] = None  # (B, n_kv, k) fp32 cumulative attention

    def observe_prefill(self, q: Tensor, k: Tensor) -> None:
        self.start_from_prefill(self.prefill_received(q, k, self.prefill_chunk))

    @staticmethod
    def prefill_received(q: Tensor, k: Tensor, chunk: int = 256) -> Tensor:
        """(B, n_kv, T) fp32: attention each prefill key received, summed over queries, averaged over
        the group. Independent of the budget, so several H2O budgets can share it (eval.py does)."""
        B, H, T, d = q.shape
        n_kv = k.shape[1]
        g = H // n_kv
        received = torch.zeros(B, n_kv, T, dtype=torch.float32, device=q.device)  # attention each key received
        qf = q.float().reshape(B, n_kv, g, T, d)  # query heads grouped by their KV head
        kf = k.float()
        future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # (row, key) above the diagonal
        for start in range(0, T, chunk):
            end = min(start + chunk, T)  # rows [start, end) see only keys [0, end)
            n = end - start
            # The group's rows stacked into one GEMM per (batch row, KV head): (B, n_kv, g * n, end).
            qc = qf[:, :, :, start:end].reshape(B, n_kv, g * n, d)
            logits = torch.matmul(qc, kf[:, :, :end].transpose(-1, -2)).view(B, n_kv, g, n, end)
            logits.div_(math.sqrt(d))
            logits[..., start:end].masked_fill_(future[:n, :n], float("-inf"))  # causal mask: diagonal block only
            received[..., :end] += torch.softmax(logits, dim=-1).sum(3).mean(2)
        return received

    def start_from_prefill(self, received: Tensor) -> None:
        """Keep the budget's positions of a prefill from prefill_received's scores."""
        B, n_kv, T = received.shape
        device = received.device
        key = self._keep_priority(received, torch.arange(T, device=device), T)
        count = min(self.k, T)
        top = torch.topk(key, count, dim=-1).indices  # (B, n_kv, count)
        self.kept = torch.full((B, n_kv, self.k), -1, dtype=torch.long, device=device)
        self.score = torch.zeros(B, n_kv, self.k, dtype=torch.float32, device=device)
        self.kept[..., :count] = top
        self.score[..., :count] = torch.gather(received, 2, top)

    def _keep_priority(self, score: Tensor, positions: Tensor, length: int) -> Tensor:
        """Higher = kept longer: recent positions first, then cumulative score; empty slots last."""
        recent = positions >= length - self.local
        priority = torch.where(recent, float("inf"), score)
        return torch.where(positions < 0, float("-inf"), priority)

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, n_kv, g, d = q.shape
        current = torch.full((B, n_kv, 1), length - 1, dtype=torch.long, device=q.device)
        candidates = torch.cat([self.kept, current], dim=-1)  # (B, n_kv, k + 1)
        valid = candidates >= 0
        index = candidates.clamp(min=0)[..., None].expand(-1, -1, -1, d)
        k_sel = torch.gather(cache.k[:B], 2, index).float()  # (B, n_kv, k + 1, d)
        v_sel = torch.gather(cache.v[:B], 2, index).float()
        logits = (q.float() @ k_sel.transpose(-1, -2)) / math.sqrt(d)  # (B, n_kv, g, k + 1)
        probs = torch.softmax(logits.masked_fill(~valid[:, :, None, :], float("-inf")), dim=-1)
        y = probs @ v_sel

        score = torch.cat([self.score, torch.zeros_like(current, dtype=torch.float32)], dim=-1) + probs.mean(2)
        keep = torch.topk(self._keep_priority(score, candidates, length), self.k, dim=-1).indices  # evict one
        self.kept = torch.gather(candidates, 2, keep)
        self.score = torch.gather(score, 2, keep)
        return y.to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.k, seq_len) * head_dim + 2 * head_dim + 2 * seq_len


# ---------------------------------------------------------------------------------------------
# Transfer accounting
# ---------------------------------------------------------------------------------------------


def kv_bytes_read_per_step(args: ModelArgs, policy: nn.Module, seq_len: int, batch_size: int,
                           element_bytes: int) -> int:
    """KV-cache bytes one decode step moves over all layers and batch rows at live length seq_len."""
    per_head = policy.transfer_elements(seq_len, args.head_dim)
    return per_head * args.n_kv_head * args.n_layer * batch_size * element_bytes


def compression_ratio(policy: nn.Module, dense: nn.Module, seq_len: int, head_dim: int) -> float:
    """Transfers of `policy` relative to dense attention at the same length (paper, Appendix G)."""
    return policy.transfer_elements(seq_len, head_dim) / dense.transfer_elements(seq_len, head_dim)
