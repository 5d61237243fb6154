"""Decode attention policies beside SparQ, and the one registry of them all.

- The paper's baselines on the same cache (Appendix G's transfer counts): the oracle (exact top-k at
  no transfer cost), FlexGen's top-k, LM-Infinite / StreamingLLM (`local`) and H2O; and the newer
  selectors: Quest (page min/max bounds), a RocketKV-style hybrid (those bounds on q's top components)
  and DoubleSparse (SparQ with channels fixed offline).
- POLICIES: name -> how to build a layer's policy from AttentionSettings, which flags it reads and
  which knob a target compression solves for. generate.py, bench and evals take names, flags,
  budgets and transfer formulas from here. Adding a policy is one class and one registry entry.
- Budgets: the compression a policy achieves on a model (every layer, windows included), and the
  knob that comes closest to a target (settings_for_compression).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import cli
from attention import DecodePolicy, DenseDecode, beyond_live, per_row, softcap
from cache import CacheView, KVCache, KVFormat
from kernels import TORCH_KERNELS, Kernels
from model import ModelArgs
from sparq import (SparQConfig, SparQDecode, approximate_scores, mix_mean_v, select_positions, sparq_attention_torch,
                   sparse_attention, top_components)
from sparq_adaptive import SparQAdaptiveDecode, StepCosts

# ---------------------------------------------------------------------------------------------
# Baselines from the paper, as decode policies on the same cache (transfers: paper, Appendix G)
# ---------------------------------------------------------------------------------------------


def exact_scores(q: Tensor, k: Tensor, length: int, cap: Optional[float] = None,
                 live_length: Optional[Tensor] = None) -> Tensor:
    """softmax(cap(q . K / sqrt(d))) over the live positions: (B, n_kv, g, S) fp32."""
    B, _, _, d = q.shape
    logits = softcap((q.float() @ k[:B, :, :length].float().transpose(-1, -2)) / math.sqrt(d), cap)
    if live_length is not None:
        logits = logits.masked_fill(beyond_live(length, live_length), float("-inf"))
    return torch.softmax(logits, dim=-1)


def selection_agreement(q: Tensor, cache: KVCache, length: int, r: int, k: int) -> Tensor:
    """(B,) fraction of the exact top-k positions (group-summed scores) that SparQ's step 1 with r
    components also ranks in its top k: the paper's Figure 4e diagnostic, local window off."""
    view = cache.view(length, q.shape[0])
    n = view.length
    exact = select_positions(exact_scores(q, view.k, n), n, k, 0)  # (B, n_kv, k)
    approx = select_positions(approximate_scores(q, view.k, view.k_t, n, r), n, k, 0)
    hit = (approx[..., :, None] == exact[..., None, :]).any(-1).float()  # (B, n_kv, k)
    return hit.mean(dim=(1, 2))


class OracleDecode(DecodePolicy):
    """SparQ step 2 on the exact top-k positions, chosen at no transfer cost (the paper's upper bound)."""

    name = "oracle"

    def __init__(self, config: SparQConfig, cap: Optional[float] = None):
        super().__init__()
        self.config, self.cap = config, cap

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        view = cache.view(length, q.shape[0], with_k_t=False)
        n, live = view.length, view.live_length
        scores = exact_scores(q, view.k, n, self.cap, live)  # (B, n_kv, g, S)
        positions = select_positions(scores, n, self.config.k_top, self.config.local, live)
        y = sparse_attention(q, view.k, view.v, positions, live, self.cap)
        if self.config.mean_v:
            y = mix_mean_v(y, scores, positions, view.v_sum, n, live)
        return y.to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.config.k_top, seq_len) * head_dim + 2 * head_dim


class TopKDecode(DecodePolicy):
    """FlexGen-style top-k: exact scores over the whole K, then only the top-k values are read."""

    name = "topk"

    def __init__(self, k: int, cap: Optional[float] = None):
        super().__init__()
        self.k_top, self.cap = k, cap

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        view = cache.view(length, q.shape[0], with_k_t=False)
        n, live = view.length, view.live_length
        positions = select_positions(exact_scores(q, view.k, n, self.cap, live), n, self.k_top, 0, live)
        return sparse_attention(q, view.k, view.v, positions, live, self.cap).to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return seq_len * head_dim + min(self.k_top, seq_len) * head_dim + 2 * head_dim


class LocalDecode(DecodePolicy):
    """LM-Infinite / StreamingLLM: the first `sinks` positions plus the k - sinks most recent ones."""

    name = "local"
    SINKS = 16

    def __init__(self, k: int, sinks: int = SINKS, cap: Optional[float] = None):
        super().__init__()
        if k <= sinks:
            raise ValueError(f"--kv-budget must exceed the {sinks} sink tokens of local attention, got {k}")
        self.k_top, self.sinks, self.cap = k, sinks, cap

    def positions(self, length: int, device: torch.device) -> Tensor:
        """The attended positions (min(k, length),), sinks first."""
        if length <= self.k_top:
            return torch.arange(length, device=device)
        recent = self.k_top - self.sinks
        return torch.cat([torch.arange(self.sinks, device=device), torch.arange(length - recent, length, device=device)])

    def row_positions(self, live_length: Tensor) -> Tensor:
        """(B, k) attended positions per row (ragged rows): sinks, then the row's most recent; a row
        shorter than k gets [0, k), whose positions past its live length sparse_attention masks."""
        slot = torch.arange(self.k_top, device=live_length.device)
        recent_start = (live_length - (self.k_top - self.sinks)).clamp(min=self.sinks)[:, None]  # (B, 1)
        return torch.where(slot < self.sinks, slot, recent_start + slot - self.sinks)

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, n_kv = q.shape[:2]
        view = cache.view(length, B, with_k_t=False)
        if view.live_length is None:
            positions = self.positions(view.length, q.device).expand(B, n_kv, -1)
        else:
            positions = self.row_positions(view.live_length).clamp(max=view.k.shape[2] - 1)[:, None].expand(B, n_kv, -1)
        return sparse_attention(q, view.k, view.v, positions, view.live_length, self.cap).to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.k_top, seq_len) * head_dim + 2 * head_dim


QUEST_PAGE = 16  # positions per page by default: the min/max metadata costs 2d per page, 1/16 of dense's transfers
QUEST_PAGES = (16, 32, 64)  # --page-size: larger pages cost less metadata per position, so reach lower targets


class QuestDecode(DecodePolicy):
    """Quest (Tang et al., 2024): each page of P positions is summarised by the element-wise min and
    max of its keys; from q, an upper bound of every page's logits, sum_i max(q_i min_i, q_i max_i),
    summed over the query heads of a KV head (as SparQ sums its group); the top pages, the page of
    the newest position always among them, are read in full and attended exactly. The summaries are
    computed here from the cache for each step (the plain-PyTorch path: the same values a cache that
    kept them as pages fill would hold), and counted as read: 2d per page."""

    name = "quest"

    def __init__(self, k: int, page: int = QUEST_PAGE, cap: Optional[float] = None):
        super().__init__()
        if k < page:
            raise ValueError(f"--kv-budget must cover at least one page of {page} positions, got {k}")
        self.k_top, self.page, self.cap = k, page, cap

    def pages_read(self, seq_len: int) -> int:
        return min(-(-self.k_top // self.page), -(-seq_len // self.page))

    def page_bounds(self, q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
        """Upper bounds of each page's logits: q (B, n_kv, g, d) fp32, kmin, kmax (B, n_kv, pages, d)
        -> (B, n_kv, pages), sum over the g query heads and d channels of max(q_i min_i, q_i max_i).
        Since min_i <= max_i, that max is q_i max_i where q_i >= 0 and q_i min_i where q_i < 0, so the
        sum is two matrix-vector products with the group's summed positive and negative parts of q,
        not a (g, pages, d) product per KV head."""
        q_pos = q.clamp(min=0).sum(2)[..., None]  # (B, n_kv, d, 1)
        q_neg = q.clamp(max=0).sum(2)[..., None]
        return (kmax @ q_pos + kmin @ q_neg).squeeze(-1)

    def metadata_elements(self, n_pages: int, head_dim: int) -> int:
        """Elements of the page summaries one step reads per KV head: min and max of every channel."""
        return 2 * head_dim * n_pages

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, n_kv, g, d = q.shape
        view = cache.view(length, B, with_k_t=False)  # K and V alone: the page summaries come from K
        n, P = view.length, self.page
        n_pages = -(-n // P)
        live = torch.tensor(n, device=q.device) if view.live_length is None else view.live_length
        live_row = per_row(live, 3)  # broadcasts against (B, n_kv, positions)
        # The complete pages' summaries, in K's own dtype (a min or max is one of its values: exact
        # without widening K). A page holding a position past a row's live length (its last page, a
        # partial one, a ragged row's) is that row's newest page or lies past it: its bound is set
        # below whatever its summary, so such pages need no masking and the partial one no summary.
        full = n // P
        pages_k = view.k[:B, :, :full * P].view(B, n_kv, full, P, d)  # (B, n_kv, full pages, P, d)
        kmax = F.pad(pages_k.amax(3).float(), (0, 0, 0, n_pages - full))  # (B, n_kv, n_pages, d)
        kmin = F.pad(pages_k.amin(3).float(), (0, 0, 0, n_pages - full))
        bound = self.page_bounds(q.float(), kmin, kmax)  # (B, n_kv, n_pages)
        page = torch.arange(n_pages, device=q.device)
        bound = torch.where(page == (live_row - 1) // P, float("inf"), bound)  # the newest position's page
        bound = torch.where(page * P >= live_row, float("-inf"), bound)  # pages past a row's live length
        pages = torch.topk(bound, self.pages_read(n), dim=-1).indices  # (B, n_kv, m)
        positions = (pages[..., None] * P + torch.arange(P, device=q.device)).flatten(-2)  # (B, n_kv, m P)
        valid = positions < live_row
        index = positions.clamp(max=n - 1)[..., None].expand(-1, -1, -1, d)
        k_sel, v_sel = torch.gather(view.k[:B], 2, index), torch.gather(view.v[:B], 2, index)  # (B, n_kv, m P, d)
        scores = softcap((q.float() @ k_sel.float().transpose(-1, -2)) / math.sqrt(d), self.cap)  # (B, n_kv, g, m P)
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v_sel.float()).to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        n_pages = -(-seq_len // self.page)
        pages = self.metadata_elements(n_pages, head_dim)
        return pages + 2 * head_dim * min(self.pages_read(seq_len) * self.page, seq_len) + 2 * head_dim


class RocketKVHybridDecode(QuestDecode):
    """RocketKV's decode stage (Behnam et al., 2025), "hybrid sparse attention": Quest's page bounds
    computed on only the r components of q largest in magnitude (summed over the group, as SparQ's
    step 1 picks them), so a step reads r of the d rows of the page summaries (2r per page instead of
    2d) and spends the rest of its budget on more pages. r: --hybrid-r (default d / 4). Like Quest's,
    the summaries are computed here from the cache and counted as read."""

    name = "rocketkv-hybrid"

    def __init__(self, k: int, r: int, page: int = QUEST_PAGE, cap: Optional[float] = None):
        super().__init__(k, page, cap)
        self.r = r

    def page_bounds(self, q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
        B, n_kv, g, d = q.shape
        n_pages = kmin.shape[2]
        i1 = top_components(q, self.r)  # (B, n_kv, r)
        q_hat = torch.gather(q, 3, i1[:, :, None, :].expand(B, n_kv, g, self.r))  # (B, n_kv, g, r)
        rows = i1[:, :, None, :].expand(B, n_kv, n_pages, self.r)
        return super().page_bounds(q_hat, torch.gather(kmin, 3, rows), torch.gather(kmax, 3, rows))

    def metadata_elements(self, n_pages: int, head_dim: int) -> int:
        return 2 * self.r * n_pages


class DoubleSparseDecode(SparQDecode):
    """DoubleSparse (Yang et al., 2024): step 1 reads a fixed set of r channels of K^T per layer and KV
    head (its "label cache"), found offline on calibration text (scripts/calibrate_doublesparse.py),
    instead of the query's top-r components; the rest is SparQ's (temperature, group-summed top-k with
    the local window, mean-V as --sparq-mean-v), so the two differ only in how the r channels are
    chosen. Transfers as SparQ's: S r + 2 k d + 4 d. Plain PyTorch (the fused SparQ kernels rank |q|
    themselves); dense attention while a layer sees at most k positions, as SparQ."""

    name = "doublesparse"

    def __init__(self, config: SparQConfig, channels: Tensor, kernels: Kernels = TORCH_KERNELS,
                 cap: Optional[float] = None):
        super().__init__(config, kernels, cap)
        self.channels = channels  # (n_kv, r) int64: the layer's calibrated channels per KV head
        self.attend = self.attend_torch = partial(sparq_attention_torch, cap=cap, channels=channels)
        self.fused = False

    def torch_view(self, cache: KVCache, length: int, rows: int) -> CacheView:
        """K^T holds just the calibrated rows (B, n_kv, r, S), gathered before a quantized K^T is
        dequantized: r of its d rows, not all of them."""
        view = cache.view(length, rows, with_k_t=False)
        return replace(view, k_t=cache.read_k_t(slice(0, rows), view.start, length, self.channels))


CHANNELS_FILE = "doublesparse_channels.pt"  # beside the checkpoint: scripts/calibrate_doublesparse.py writes it


def default_channels_file(checkpoint: Optional[Path]) -> Optional[Path]:
    """Where DoubleSparse's calibration of `checkpoint` (a model.pth or its directory) lives by default."""
    if checkpoint is None:
        return None
    return (checkpoint if checkpoint.is_dir() else checkpoint.parent) / CHANNELS_FILE


@lru_cache(maxsize=4)
def load_channel_ranking(path: Path) -> Tensor:
    """(n_layer, n_kv, d) int64: each layer's and KV head's channels, most important first (the file
    scripts/calibrate_doublesparse.py writes)."""
    return torch.load(path, map_location="cpu", weights_only=True)["ranking"].long()


def _build_doublesparse(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> DoubleSparseDecode:
    if s.sparq_r is None:
        raise ValueError("--attention doublesparse needs --sparq-r (or --compression)")
    if s.channels is None or not Path(s.channels).exists():
        where = f" ({s.channels} does not exist)" if s.channels is not None else ""
        raise ValueError(f"--attention doublesparse needs its calibrated channels{where}: make them with "
                         f"`python -m scripts.calibrate_doublesparse --checkpoint CHECKPOINT`")
    ranking = load_channel_ranking(Path(s.channels))
    expected = (args.n_layer, args.kv_head_total or args.n_kv_head, args.head_dim)  # the whole model's
    if tuple(ranking.shape) != expected:
        raise ValueError(f"{s.channels} calibrates a model of (layers, KV heads, head dim) {tuple(ranking.shape)}, "
                         f"not this one's {expected}")
    config = s.sparq_config(args)
    heads = slice(args.kv_head_start, args.kv_head_start + args.n_kv_head)  # a tensor-parallel rank's own
    return DoubleSparseDecode(config, ranking[layer, heads, :config.r].contiguous(), kernels, args.attn_softcap)


def _build_quest(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> QuestDecode:
    return QuestDecode(s.budget, s.page_size, cap=args.attn_softcap)


def _build_rocketkv(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> RocketKVHybridDecode:
    r = max(1, args.head_dim // 4) if s.hybrid_r is None else s.hybrid_r
    if not 1 <= r <= args.head_dim:
        raise ValueError(f"--hybrid-r must be in [1, {args.head_dim}] (the head dim), got {r}")
    return RocketKVHybridDecode(s.budget, r, s.page_size, cap=args.attn_softcap)


# Query rows per step of H2O's prefill scores: 32 keeps a step's fp32 logits (g * 32 rows by S keys)
# near cache-sized (docs/NOTES.md).
H2O_PREFILL_ROWS = 32


class H2ODecode(DecodePolicy):
    """H2O: an evicting cache of k positions, the `local` most recent plus k - local heavy hitters.

    Heavy hitters are ranked by the attention they received, summed over every prefill and decode
    query and averaged over the query heads of a GQA group. An evicted position never returns.
    State per (batch row, KV head): the kept positions and their cumulative scores; a slot with
    position -1 is empty (before the budget fills).

    On a sliding-window layer the evicting cache lives inside the window: prefill queries score only
    the keys they see, and a position that slides out of the window is evicted first (never attended).
    """

    name = "h2o"
    follows_rows = False  # its evictions cannot be undone: a truncated row would keep scores of dropped positions

    def __init__(self, k: int, local: Optional[int] = None, prefill_chunk: int = H2O_PREFILL_ROWS,
                 cap: Optional[float] = None):
        super().__init__()
        self.k_top = k
        self.local = k // 4 if local is None else local
        if k < 1 or not 0 <= self.local <= k:
            raise ValueError(f"H2O needs --kv-budget >= 1 and 0 <= --sparq-local <= it, got {k} and {self.local}")
        self.prefill_chunk, self.cap = prefill_chunk, cap
        self.received: Optional[Tensor] = None  # (B, n_kv, S) fp32 attention received during the prefill so far
        self.kept: Optional[Tensor] = None  # (B, n_kv, k) positions, -1 = empty
        self.score: Optional[Tensor] = None  # (B, n_kv, k) fp32 cumulative attention

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None,
                        lengths: Optional[Tensor] = None, window: Optional[int] = None) -> None:
        """Add the attention a prefill chunk's queries give every key so far; keep the budget's best.
        lengths (B,): right-padded prompts; padding queries give nothing and padding keys are never kept.
        window: a sliding-window layer's (queries see the last `window` keys; older ones are never kept)."""
        S = k.shape[2]
        key = ("h2o received", self.prefill_chunk, self.cap, S, window)  # budget-independent: shared via the memo
        memo = {} if memo is None else memo
        if key not in memo:
            memo[key] = self.prefill_received(q, k, self.prefill_chunk, self.cap, lengths, window)
        if q.shape[2] == S:  # the first chunk of a prefill: its queries are at every position
            self.received = memo[key].clone()
        else:
            self.received = F.pad(self.received, (0, S - self.received.shape[2])) + memo[key]
        self.start_from_prefill(self.received, lengths, window)

    @staticmethod
    def prefill_received(q: Tensor, k: Tensor, chunk: int = H2O_PREFILL_ROWS, cap: Optional[float] = None,
                         lengths: Optional[Tensor] = None, window: Optional[int] = None) -> Tensor:
        """(B, n_kv, S) fp32: attention each key received from the T queries at the last T of its S
        positions (causal; with a window, the query at p sees keys (p - window, p]), summed over the
        queries and averaged over the group; with lengths (B,), queries at positions >= lengths[b]
        (padding) give nothing. Independent of the budget, so several H2O budgets can share it
        (observe_prefill's memo)."""
        B, H, T, d = q.shape
        n_kv, S = k.shape[1], k.shape[2]
        g = H // n_kv
        offset = S - T  # position of the first query
        received = torch.zeros(B, n_kv, S, dtype=torch.float32, device=q.device)  # attention each key received
        if B > 1 or lengths is not None:
            # A row at a time, without its padding queries (keys after them receive nothing): each
            # step's logits stay cache-sized.
            for b in range(B):
                real = T if lengths is None else max(0, min(T, int(lengths[b]) - offset))  # row b's real queries
                if real:
                    received[b:b + 1, :, :offset + real] = H2ODecode.prefill_received(
                        q[b:b + 1, :, :real], k[b:b + 1, :, :offset + real], chunk, cap, None, window)
            return received
        qf = q.float().reshape(B, n_kv, g, T, d) / math.sqrt(d)  # query heads grouped by their KV head, pre-scaled
        kf = k.float()
        future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # (row, key) above the diagonal
        for start in range(0, T, chunk):
            end = min(start + chunk, T)  # rows [start, end) see only keys [lo, offset + end)
            n = end - start
            lo = 0 if window is None else max(0, offset + start - window + 1)
            # The group's rows stacked into one GEMM per (batch row, KV head): (B, n_kv, g * n, offset + end - lo).
            qc = qf[:, :, :, start:end].reshape(B, n_kv, g * n, d)
            logits = torch.matmul(qc, kf[:, :, lo:offset + end].transpose(-1, -2))
            if cap is not None:
                logits = softcap(logits, cap)
            grid = logits.view(B, n_kv, g, n, offset + end - lo)
            grid[..., offset + start - lo:].masked_fill_(future[:n, :n], float("-inf"))  # causal: the diagonal block
            if window is not None:  # and the window's far edge: key position <= query position - window
                q_pos = torch.arange(offset + start, offset + end, device=q.device)[:, None]
                grid.masked_fill_(torch.arange(lo, offset + end, device=q.device) <= q_pos - window, float("-inf"))
            # softmax rows summed into columns without materialising the probabilities: each row's
            # exp(logits - max) weighted by 1 / (its sum * g).
            logits = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # (B, n_kv, g * n, offset + end - lo)
            weight = 1.0 / (logits.sum(dim=-1) * g)  # (B, n_kv, g * n)
            received[..., lo:offset + end] += torch.matmul(weight.unsqueeze(2), logits).squeeze(2)
        return received

    def start_from_prefill(self, received: Tensor, lengths: Optional[Tensor] = None,
                           window: Optional[int] = None) -> None:
        """Keep the budget's positions of a prefill from prefill_received's scores (row b's prompt:
        lengths[b] positions, or all of them; on a window layer, only its last `window`)."""
        B, n_kv, T = received.shape
        device = received.device
        length = T if lengths is None else lengths.view(B, 1, 1)
        first = 0 if window is None else length - window  # positions before it have left the window
        key = self._keep_priority(received, torch.arange(T, device=device), length, first)
        count = min(self.k_top, T)
        top = torch.topk(key, count, dim=-1)  # (B, n_kv, count); a short row's extra picks are padding
        self.kept = torch.full((B, n_kv, self.k_top), -1, dtype=torch.long, device=device)
        self.score = torch.zeros(B, n_kv, self.k_top, dtype=torch.float32, device=device)
        self.kept[..., :count] = torch.where(top.values > float("-inf"), top.indices, -1)
        self.score[..., :count] = torch.gather(received, 2, top.indices)

    def _keep_priority(self, score: Tensor, positions: Tensor, length: int | Tensor,
                       first: int | Tensor = 0) -> Tensor:
        """Higher = kept longer: recent positions first, then cumulative score; empty slots (and
        positions at or past the row's length: padding, or before `first`: out of a window) last.
        length, first: ints, or (B, 1, 1) per row."""
        recent = positions >= length - self.local
        priority = torch.where(recent, float("inf"), score)
        gone = (positions < 0) | (positions < first) | (positions >= length)
        return torch.where(gone, float("-inf"), priority)

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, n_kv, g, d = q.shape
        view = cache.view(length, B, with_k_t=False)  # positions [view.start, length): view.start > 0 on a window layer
        ragged = view.live_length is not None and view.live_length.dim() == 1
        now = view.live_length.view(B, 1, 1) if ragged else length  # each row's live length
        current = (now - 1 if ragged else torch.full((B, 1, 1), length - 1, device=q.device)).expand(B, n_kv, 1)
        candidates = torch.cat([self.kept, current], dim=-1)  # (B, n_kv, k + 1) absolute positions
        valid = candidates >= view.start  # empty slots (-1) and positions that left the window are out
        index = (candidates - view.start).clamp(min=0)[..., None].expand(-1, -1, -1, d)
        k_sel = torch.gather(view.k[:B], 2, index).float()  # (B, n_kv, k + 1, d)
        v_sel = torch.gather(view.v[:B], 2, index).float()
        logits = softcap((q.float() @ k_sel.transpose(-1, -2)) / math.sqrt(d), self.cap)  # (B, n_kv, g, k + 1)
        probs = torch.softmax(logits.masked_fill(~valid[:, :, None, :], float("-inf")), dim=-1)
        y = probs @ v_sel

        score = torch.cat([self.score, torch.zeros_like(current, dtype=torch.float32)], dim=-1) + probs.mean(2)
        keep = torch.topk(self._keep_priority(score, candidates, now, view.start), self.k_top, dim=-1).indices  # evict
        self.kept = torch.gather(torch.where(valid, candidates, -1), 2, keep)
        self.score = torch.gather(score, 2, keep)
        return y.to(q.dtype)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 2 * min(self.k_top, seq_len) * head_dim + 2 * head_dim + 2 * seq_len


# ---------------------------------------------------------------------------------------------
# The registry of decode attention policies
# ---------------------------------------------------------------------------------------------


DEFAULT_SPARQ_K = 128
ADAPTIVE_DEFAULT = Fraction(1, 8)  # sparq-adaptive's compression when neither --sparq-r nor --compression is given
ADAPTIVE_HEADS = ("each", "pooled")  # --adaptive-heads: sparq_adaptive.SparQAdaptiveDecode's per_head, or not


@dataclass(frozen=True)
class AttentionSettings:
    """The decode-attention choices of a run, as values: flags (attention_settings) or eval's budgets."""

    policy: str = "dense"
    sparq_r: Optional[int] = None  # SparQ: query components for the approximate scores
    sparq_k: int = DEFAULT_SPARQ_K  # SparQ: positions attended exactly
    sparq_local: Optional[int] = None  # SparQ, H2O, the oracle: recent positions always kept (None: k / 4)
    sparq_mean_v: str = "auto"  # "on", "off", or "auto": on for MHA, off for GQA (the paper's choice)
    kv_budget: Optional[int] = None  # baselines: positions attended (None: sparq_k)
    compression: Optional[Fraction] = None  # a target (--compression): solve_target sets the policy's knob
    page_size: int = QUEST_PAGE  # Quest and the RocketKV hybrid: positions per page
    hybrid_r: Optional[int] = None  # the RocketKV hybrid: components of q its page bounds use (None: d / 4)
    channels: Optional[Path] = None  # DoubleSparse: its calibration file (default_channels_file)
    adaptive_k_cap: Optional[int] = None  # sparq-adaptive: a cap on k (sparq_adaptive.adaptive_split; None: the budget's share)
    adaptive_heads: str = "each"  # sparq-adaptive: "each" KV head selects its own, or a row's heads "pooled"

    @property
    def budget(self) -> int:
        return self.sparq_k if self.kv_budget is None else self.kv_budget

    def mean_v(self, args: ModelArgs) -> bool:
        return {"on": True, "off": False, "auto": args.n_kv_head == args.n_head}[self.sparq_mean_v]

    def sparq_config(self, args: ModelArgs, r: Optional[int] = None, k: Optional[int] = None) -> SparQConfig:
        """SparQConfig(r, k) from these settings (validated: ValueError in one line)."""
        config = SparQConfig(r=self.sparq_r if r is None else r, k_top=self.sparq_k if k is None else k,
                             local=self.sparq_local, mean_v=self.mean_v(args))
        config.validate(args.head_dim)
        return config


def _build_sparq(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> SparQDecode:
    if s.sparq_r is None:
        raise ValueError("--attention sparq needs --sparq-r")
    return SparQDecode(s.sparq_config(args), kernels, args.attn_softcap)


def _build_sparq_adaptive(s: AttentionSettings, args: ModelArgs, kernels: Kernels,
                          layer: int) -> SparQAdaptiveDecode:
    compression = ADAPTIVE_DEFAULT if s.compression is None else s.compression
    return SparQAdaptiveDecode(float(compression), s.sparq_k, s.mean_v(args), kernels, args.attn_softcap,
                               s.adaptive_k_cap, per_head=s.adaptive_heads == "each")


# The settings only some policies read (Policy.flags), each with its value when not given
OPTIONAL_SETTINGS = (("sparq_r", None), ("kv_budget", None), ("page_size", QUEST_PAGE), ("hybrid_r", None),
                     ("adaptive_k_cap", None), ("adaptive_heads", "each"))


@dataclass(frozen=True)
class Policy:
    """A registry entry: how to build one layer's policy from settings, and which setting a target
    compression solves for (eval's budgets)."""

    build: Callable[[AttentionSettings, ModelArgs, Kernels, int], DecodePolicy]  # (settings, args, kernels, layer)
    help: str
    flags: tuple[str, ...] = ()  # the OPTIONAL_SETTINGS it reads: others given are an error
    knob: Optional[str] = None  # the setting a target compression solves for (sparq_r, sparq_k, kv_budget), or
    # "compression": the policy takes the target itself
    knob_min: Callable[[AttentionSettings], int] = lambda s: 1  # the knob's smallest value (LM-Infinite: more than
    # its sink tokens; Quest: a page)
    reads_buckets: bool = False  # honours bucketed reads (CacheView.live_length): CUDA graphs per bucket
    reads_kt: bool = False  # its step 1 scans rows of the cache's K^T copy (assemble.kt_storage_for decides its storage)


POLICIES: dict[str, Policy] = {
    "dense": Policy(lambda s, args, kernels, layer: DenseDecode(kernels, args.attn_softcap),
                    "exact attention over the live prefix", reads_buckets=True),
    "sparq": Policy(_build_sparq, "SparQ (--sparq-r/-k/-local/-mean-v)", ("sparq_r",), knob="sparq_r",
                    reads_buckets=True, reads_kt=True),
    # The same policy, budgeted the other way (the paper's length sweep): r fixed, k set by the compression.
    "sparq-fixed-r": Policy(_build_sparq, "SparQ budgeted by k at a fixed --sparq-r", ("sparq_r",), knob="sparq_k",
                            reads_buckets=True, reads_kt=True),
    # Budgeted by the target itself: r and k per layer and step (sparq_adaptive.adaptive_split)
    "sparq-adaptive": Policy(_build_sparq_adaptive, "SparQ with r and k per layer and step from --compression "
                             f"(default 1/{ADAPTIVE_DEFAULT.denominator}; --adaptive-k-cap, --adaptive-heads)",
                             ("adaptive_k_cap", "adaptive_heads"), knob="compression", reads_kt=True),
    "topk": Policy(lambda s, args, kernels, layer: TopKDecode(s.budget, args.attn_softcap),
                   "FlexGen top-k: exact scores, top-k values", ("kv_budget",), knob="kv_budget"),
    "oracle": Policy(lambda s, args, kernels, layer: OracleDecode(s.sparq_config(args, r=args.head_dim, k=s.budget),
                                                                  args.attn_softcap),
                     "exact top-k at no transfer cost (upper bound)", ("kv_budget",), knob="kv_budget"),
    "h2o": Policy(lambda s, args, kernels, layer: H2ODecode(s.budget, s.sparq_local, cap=args.attn_softcap),
                  "H2O: evicting heavy hitters + recent window", ("kv_budget",), knob="kv_budget"),
    "quest": Policy(_build_quest, "Quest: page min/max bounds, the top pages (--page-size) read in full",
                    ("kv_budget", "page_size"), knob="kv_budget", knob_min=lambda s: s.page_size),
    "rocketkv-hybrid": Policy(_build_rocketkv, "RocketKV's hybrid: Quest's page bounds on the top --hybrid-r "
                              "components of q (default d/4), the top pages read in full",
                              ("kv_budget", "hybrid_r", "page_size"), knob="kv_budget", knob_min=lambda s: s.page_size),
    "doublesparse": Policy(_build_doublesparse, "DoubleSparse: SparQ with r channels per head fixed offline "
                           "(scripts/calibrate_doublesparse.py)", ("sparq_r",), knob="sparq_r", reads_kt=True),
    "local": Policy(lambda s, args, kernels, layer: LocalDecode(s.budget, cap=args.attn_softcap),
                    "LM-Infinite: 16 sinks + recent window", ("kv_budget",), knob="kv_budget",
                    knob_min=lambda s: LocalDecode.SINKS + 1),
}


def policy_factory(settings: AttentionSettings, args: ModelArgs,
                   kernels: Kernels = TORCH_KERNELS) -> Callable[[int], DecodePolicy]:
    """make_policy(layer) for Transformer.set_decode_attention: a fresh instance per layer (H2O keeps
    per-layer state). Checks the settings once: ValueError in one line.

    Sliding-window layers read min(S, window) positions: the policy replaces dense attention there
    only when it moves fewer elements than dense over a full window; elsewhere they stay dense.
    Global layers always get the policy."""
    if settings.policy not in POLICIES:
        raise ValueError(f"unknown attention policy {settings.policy!r} (choose from {', '.join(POLICIES)})")
    entry = POLICIES[settings.policy]
    for flag, unset in OPTIONAL_SETTINGS:
        if getattr(settings, flag) != unset and flag not in entry.flags:
            users = "/".join(name for name, e in POLICIES.items() if flag in e.flags)
            raise ValueError(f"--{flag.replace('_', '-')} applies to --attention {users}, not {settings.policy}")
    policy = entry.build(settings, args, kernels, 0)  # validate now, not in the middle of a run
    W = args.sliding_window
    on_windows = W is not None and (
        policy.transfer_elements(W, args.head_dim) < DenseDecode().transfer_elements(W, args.head_dim))

    def make(layer: int) -> DecodePolicy:
        if args.layer_kind(layer) == "window" and not on_windows:
            return DenseDecode(kernels, args.attn_softcap)
        return entry.build(settings, args, kernels, layer)

    return make


def describe_layers(model) -> str:
    """Which policy each kind of layer runs, for the startup line: e.g. 'sparq on 3 global layers,
    dense on 15 window layers (window 512)'."""
    groups: dict[tuple[str, str], int] = {}
    for i, layer in enumerate(model.layers):
        key = (layer.attention.decode_attention.name, model.args.layer_kind(i))
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{name} on {n} {kind} layer{'s' if n > 1 else ''}" for (name, kind), n in groups.items()]
    window = f" (window {model.args.sliding_window})" if model.args.has_window_layers else ""
    return ", ".join(parts) + window


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    """Decode attention flags, shared by generate.py and python -m bench (attention_settings reads them)."""
    p.add_argument("--attention", choices=list(POLICIES), default=None,
                   help="decode attention policy (default: sparq when --sparq-r is given, else dense): "
                        + "; ".join(f"{name}: {entry.help}" for name, entry in POLICIES.items()))
    p.add_argument("--kv-budget", type=cli.positive_int, default=None,
                   help="positions attended by topk/oracle/h2o/local (default: --sparq-k)")
    p.add_argument("--sparq-r", type=cli.positive_int, default=None, help="query components used for approximate scores")
    p.add_argument("--sparq-k", type=cli.positive_int, default=None,
                   help=f"positions attended exactly (default {DEFAULT_SPARQ_K}); sparq-adaptive: the visible length "
                        "up to which a layer runs dense")
    p.add_argument("--sparq-local", type=cli.non_negative_int, default=None,
                   help="recent positions always kept (default k/4)")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="mean-value reallocation (auto: on for MHA, off for GQA)")
    add_selector_flags(p)
    p.add_argument("--compression", type=parse_compression, default=None, metavar="TARGET",
                   help="KV transfers as a fraction of dense (1/8 or 0.125) at the longest prompt: the policy's "
                        "budget solver picks its knob (" + "; ".join(
                            f"{name}: {knob_flag(e.knob)}" for name, e in POLICIES.items() if e.knob) + ")")


def add_selector_flags(p: argparse.ArgumentParser) -> None:
    """The newer selectors' settings (Quest's pages, the hybrid's r, DoubleSparse's calibration, adaptive
    SparQ's cap on k), shared by add_attention_flags and python -m evals."""
    p.add_argument("--page-size", type=int, choices=QUEST_PAGES, default=QUEST_PAGE,
                   help="positions per page of quest and rocketkv-hybrid (default %(default)s)")
    p.add_argument("--hybrid-r", type=cli.positive_int, default=None,
                   help="components of q in rocketkv-hybrid's page bounds (default head dim / 4)")
    p.add_argument("--doublesparse-channels", type=Path, default=None, metavar="FILE",
                   help=f"doublesparse's calibrated channels (default: {CHANNELS_FILE} beside --checkpoint; "
                        "python -m scripts.calibrate_doublesparse makes it)")
    p.add_argument("--adaptive-k-cap", type=cli.positive_int, default=None, metavar="K",
                   help="cap on the positions sparq-adaptive's split gives step 2, before what rounding r down leaves "
                        "is added back (default: none, the budget's share decides)")
    p.add_argument("--adaptive-heads", choices=ADAPTIVE_HEADS, default="each",
                   help="sparq-adaptive's selection: each KV head its own components and positions (default), or "
                        "a layer's KV heads pooling theirs (the earlier default, weaker on common-word extraction)")


def selector_settings(args: argparse.Namespace) -> dict:
    """The AttentionSettings fields of add_selector_flags' flags: DoubleSparse's calibration defaults to the
    file beside the run's --checkpoint, where the command has one."""
    checkpoint = None if getattr(args, "checkpoint", None) is None else Path(args.checkpoint)
    return dict(page_size=args.page_size, hybrid_r=args.hybrid_r, adaptive_k_cap=args.adaptive_k_cap,
                adaptive_heads=args.adaptive_heads,
                channels=args.doublesparse_channels or default_channels_file(checkpoint))


def knob_flag(knob: str) -> str:
    """The command-line flag of a setting: sparq_r -> --sparq-r."""
    return "--" + knob.replace("_", "-")


def attention_settings(args: argparse.Namespace) -> AttentionSettings:
    """AttentionSettings from the flags of add_attention_flags. A --compression target is refused with
    dense attention and beside the flag of the knob it solves (the policy's other settings stay: SparQ's
    --sparq-k is the k at which r is solved, as --sparq-r is for sparq-fixed-r)."""
    target = args.compression
    policy = args.attention or ("sparq" if args.sparq_r is not None or target is not None else "dense")
    if target is not None:
        knob = POLICIES[policy].knob
        if knob is None:
            raise cli.UserError(f"--compression sets the budget of a sparse policy; --attention {policy} has none")
        if knob != "compression" and getattr(args, knob) is not None:
            raise cli.UserError(f"--compression {fraction_label(target)} chooses {knob_flag(knob)} for --attention "
                                f"{policy}: give one or the other")
    return AttentionSettings(policy=policy, sparq_r=args.sparq_r,
                             sparq_k=DEFAULT_SPARQ_K if args.sparq_k is None else args.sparq_k,
                             sparq_local=args.sparq_local, sparq_mean_v=args.sparq_mean_v, kv_budget=args.kv_budget,
                             compression=target, **selector_settings(args))


# ---------------------------------------------------------------------------------------------
# Transfer accounting and budgets
# ---------------------------------------------------------------------------------------------


def compression_ratio(policy: DecodePolicy, seq_len: int, head_dim: int) -> float:
    """Transfers of `policy` relative to dense attention at the same length (paper, Appendix G)."""
    return policy.transfer_elements(seq_len, head_dim) / DenseDecode().transfer_elements(seq_len, head_dim)


def model_compression(model, seq_len: int, policies: Optional[list[DecodePolicy]] = None) -> float:
    """KV transfers of a decode step at live length seq_len with `policies` (default: the installed
    ones) relative to dense, over every layer (a window layer counts the min(S, window) it reads)."""
    dense = [DenseDecode()] * model.args.n_layer
    return model.decode_kv_bytes(seq_len, 1, policies) / model.decode_kv_bytes(seq_len, 1, dense)


def _closest(ratio: Callable[[int], float], lo: int, hi: int, target: float) -> int:
    """The integer x in [lo, hi] with ratio(x) closest to target, for ratio non-decreasing in x."""
    a, b = lo, hi
    while a < b:  # smallest x with ratio(x) >= target (or hi)
        mid = (a + b) // 2
        if ratio(mid) >= target:
            b = mid
        else:
            a = mid + 1
    best = a
    if a > lo and abs(ratio(a - 1) - target) <= abs(ratio(a) - target):
        best = a - 1
    return best


def visible_lengths(args: ModelArgs, seq_len: int) -> list[int]:
    """The positions each layer of `args` reads at live length seq_len: min(S, window) on a window layer."""
    return [seq_len if args.window(layer) is None else min(seq_len, args.window(layer)) for layer in range(args.n_layer)]


def layer_transfers(make_policy: Callable[[int], DecodePolicy], args: ModelArgs, seq_len: int) -> int:
    """KV elements one decode step moves per KV head, summed over the layers of `args`, with layer i
    running make_policy(i) over the positions it sees (min(S, window) on a window layer): the
    element count behind Transformer.decode_kv_bytes, from the args alone."""
    return sum(make_policy(layer).transfer_elements(visible, args.head_dim)
               for layer, visible in enumerate(visible_lengths(args, seq_len)))


@dataclass(frozen=True)
class Storage:
    """How the cache stores K, V and K^T (--kv-dtype / --kt-dtype) for activations in `activation`:
    what a budget counts, since a quantized K^T makes step 1's rows cheaper than K and V's."""

    fmt: KVFormat = KVFormat()
    activation: torch.dtype = torch.float32


FLOAT_CACHE = Storage()  # any float cache: bytes per element cancel, the ratio is the paper's in elements


def layer_bytes(make_policy: Callable[[int], DecodePolicy], args: ModelArgs, seq_len: int, storage: Storage) -> float:
    """layer_transfers in bytes as `storage` holds them (scales included): DecodePolicy.transfer_bytes
    summed over the layers, each over the positions it sees."""
    return sum(make_policy(layer).transfer_bytes(visible, args.head_dim, storage.fmt, storage.activation)
               for layer, visible in enumerate(visible_lengths(args, seq_len)))


def settings_for_compression(settings: AttentionSettings, target: float, seq_len: int, args: ModelArgs,
                             storage: Storage = FLOAT_CACHE) -> tuple[AttentionSettings, float]:
    """The settings of `settings.policy` whose model-wide transfers at seq_len are closest to target x
    dense, and the compression they achieve. Its registry knob is solved (SparQ: r at fixed k, or k at
    fixed r; the baselines: their budget k); target 1, or a policy without a knob, is dense.

    The ratio is over every layer as policy_factory installs them: a sliding-window layer reads only
    min(S, window) positions, and stays dense where the policy would not save there, so on a model
    with window layers (Gemma 3) the global layers' budget is not the model's compression. It counts
    bytes as `storage` holds them, against dense on the same cache: on a float cache, the paper's
    element ratio; with an int4 K^T, step 1's rows at half a byte (and its scales), so r grows."""
    entry = POLICIES[settings.policy]
    if entry.knob is None or target >= 1:
        return AttentionSettings("dense"), 1.0
    if entry.knob == "compression":
        best = replace(settings, compression=Fraction(target).limit_denominator(1 << 16))
        return best, _compression_ratio(best, seq_len, args, storage)
    ratio, lo, hi = _knob_ratio(settings, seq_len, args, storage)
    best = replace(settings, **{entry.knob: _closest(ratio, lo, hi, target)})
    return best, ratio(getattr(best, entry.knob))


def _knob_ratio(settings: AttentionSettings, seq_len: int, args: ModelArgs,
                storage: Storage) -> tuple[Callable[[int], float], int, int]:
    """(ratio(x): model-wide transfers / dense with the policy's knob at x, the knob's lowest and highest value)."""
    entry = POLICIES[settings.policy]

    def ratio(x: int) -> float:
        return _compression_ratio(replace(settings, **{entry.knob: x}), seq_len, args, storage)

    lo = entry.knob_min(settings)
    hi = args.head_dim if entry.knob == "sparq_r" else max(seq_len - 1, lo)
    return ratio, lo, hi


def _compression_ratio(settings: AttentionSettings, seq_len: int, args: ModelArgs, storage: Storage) -> float:
    """Model-wide transfers / dense of settings at seq_len, in bytes as `storage` holds them."""
    dense = layer_bytes(lambda layer: DenseDecode(), args, seq_len, storage)
    return layer_bytes(policy_factory(settings, args), args, seq_len, storage) / dense


def reachable_compression(settings: AttentionSettings, seq_len: int, args: ModelArgs,
                          storage: Storage = FLOAT_CACHE) -> tuple[float, float]:
    """The lowest and highest compression settings.policy reaches at seq_len over its knob's range (a policy
    taking the target itself: from the smallest target, r = k = 1, to 1)."""
    if POLICIES[settings.policy].knob == "compression":
        return _compression_ratio(replace(settings, compression=Fraction(1, 1 << 16)), seq_len, args, storage), 1.0
    ratio, lo, hi = _knob_ratio(settings, seq_len, args, storage)
    return ratio(lo), ratio(hi)


DENSE = Fraction(1)  # the target compression that is dense attention, every method's baseline


def fraction_label(c: Fraction) -> str:
    return str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def parse_compression(text: str) -> Fraction:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise cli.UserError(f"bad --compression value {text!r} (expected e.g. 1/4 or 0.25)") from None
    if not 0 < value <= 1:
        raise cli.UserError(f"--compression values must be in (0, 1], got {text!r}")
    return value.limit_denominator(1 << 16)



@dataclass(frozen=True)
class Budget:
    """A method's settings for one target compression at sequence length seq_len."""

    method: str
    target: Fraction
    seq_len: int
    settings: AttentionSettings
    achieved: float = 1.0  # transfers / dense at seq_len
    split: Optional[tuple[int, int]] = None  # sparq-adaptive: its (r, k) on a layer that sees all seq_len positions

    @property
    def r(self) -> Optional[int]:
        """SparQ's fixed r (None: a policy without one; adaptive SparQ's varies, `split` has it at seq_len)."""
        return self.settings.sparq_r

    @property
    def k_top(self) -> Optional[int]:
        """The positions the method attends (its budget, SparQ's k, or adaptive SparQ's at seq_len)."""
        if self.split is not None:
            return self.split[1]
        uses_budget = self.method != "dense" and "kv_budget" in POLICIES[self.method].flags
        return self.settings.budget if uses_budget else self.settings.sparq_k

    def describe(self) -> str:
        if self.method == "dense":
            return "dense"
        if POLICIES[self.method].knob == "compression":
            cap = self.settings.adaptive_k_cap
            at = "" if self.split is None else f": r={self.split[0]}, k={self.split[1]} on a full-length layer"
            capped = "" if cap is None else f", k capped at {cap} plus what rounding r down leaves"
            capped += ", the KV heads pooled" if self.settings.adaptive_heads == "pooled" else ""
            setting = f"r and k per layer and step (sparq_adaptive.adaptive_split{capped}){at}"
        else:
            setting = f"r={self.r}, k={self.k_top}" if self.r is not None else f"k={self.k_top}"
        return f"{self.method} {setting} ({self.achieved:.3f} of dense at S={self.seq_len})"


def solve_budget(method: str, target: Fraction, seq_len: int, args: ModelArgs,
                 base: AttentionSettings = AttentionSettings(), storage: Storage = FLOAT_CACHE) -> Budget:
    """Budget for `method` whose transfers at seq_len are closest to target x dense (Appendix G), in
    bytes as `storage` holds them."""
    flags = POLICIES[method].flags  # the base's optional settings (fixed-r SparQ's r, a page size) only where
    unset = {flag: default for flag, default in OPTIONAL_SETTINGS if flag not in flags}  # the policy reads them
    start = replace(base, **{**unset, "policy": method, "kv_budget": None})
    settings, achieved = settings_for_compression(start, float(target), seq_len, args, storage)
    if settings.policy == "dense":
        return Budget("dense", DENSE, seq_len, settings)
    split = None
    if POLICIES[method].knob == "compression":  # adaptive SparQ: its split at seq_len, in the cache's bytes
        policy = POLICIES[method].build(settings, args, TORCH_KERNELS, 0)
        split = policy.split(seq_len, args.head_dim, StepCosts.of(storage.fmt, storage.activation, args.head_dim))
    return Budget(method, target, seq_len, settings, achieved, split)


REACH_TOLERANCE = 0.02  # a target this far (relative) beyond what the knob's range reaches is refused


def solve_target(settings: AttentionSettings, seq_len: int, args: ModelArgs, storage: Storage = FLOAT_CACHE) -> Budget:
    """The budget for settings.compression (generate.py's --compression) at seq_len (a batch's longest
    prompt), in bytes as `storage` holds them. A target outside what the policy reaches is a one-line
    error naming the range: below it, e.g. FlexGen's top-k (which reads all of K) under 1/2, or SparQ
    on a model whose window layers stay dense; within it, the closest knob (reported as achieved)."""
    budget = solve_budget(settings.policy, settings.compression, seq_len, args, settings, storage)
    if budget.method == "dense":  # a target of 1
        return budget
    lowest, highest = reachable_compression(budget.settings, seq_len, args, storage)
    target = float(settings.compression)
    if not lowest * (1 - REACH_TOLERANCE) <= target <= highest * (1 + REACH_TOLERANCE):
        raise cli.UserError(f"--compression {fraction_label(settings.compression)} is out of reach of "
                            f"{settings.policy} at {seq_len} tokens: its transfers range from {lowest:.3f} "
                            f"(1/{1 / lowest:.1f}, the lowest target it reaches) to {highest:.3f} of dense")
    return budget
