"""The paper's baselines and the newer selectors, as decode policies on the same cache as SparQ.

- The paper's (Appendix G's transfer counts): the oracle (exact top-k at no transfer cost), FlexGen's
  top-k, LM-Infinite / StreamingLLM (`local`) and H2O.
- The newer selectors: Quest (page min/max bounds), a RocketKV-style hybrid (those bounds on q's top
  components) and DoubleSparse (SparQ with channels fixed offline).

Each class is a DecodePolicy (attention.py): forward(q, cache, length) and transfer_elements. How each is
built from the command line's settings, and the budgets they are solved for, live in policies.py and
budgets.py.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attention import DecodePolicy, beyond_live, per_row, softcap
from cache import CacheView, KVCache
from kernels import TORCH_KERNELS, Kernels
from sparq import (SparQConfig, SparQDecode, approximate_scores, mix_mean_v, select_positions, sparq_attention_torch,
                   sparse_attention, top_components)


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
        self.bind_kernels(None, partial(sparq_attention_torch, cap=cap, channels=channels), kernels, cap)

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
    observes_prefill = True  # its heavy hitters start from the attention the prompt's queries gave
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
