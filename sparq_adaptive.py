"""Adaptive SparQ: a compression target instead of one (r, k), split per layer and step.

adaptive_split turns the target into the step's (r, k) at the layer's visible length, in the bytes the
cache stores (StepCosts: an int4 K^T buys more components), so a step moves what fixed SparQ (sparq.py)
moves at that (r, k). Each KV head then takes its own r components and k positions (per_head, the
default), or a row's KV heads pool n_kv x r and n_kv x k so that one whose |q| is concentrated, or whose
step-1 scores are peaked, lends to one that needs more (`--adaptive-heads pooled`: it lost common-word
extraction, docs/accuracy.md). Components rank by |q_i| times the keys' spread in dimension i
(key_spread, from the cache's running sums).

sparq_adaptive_reference is the loop reference, sparq_adaptive_torch the batched path the model
runs without a fused kernel (kernels.sparq_adaptive_cpu is the fused one), SparQAdaptiveDecode the
decode policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import Tensor

from attention import DenseDecode, KernelPolicy, beyond_live, per_row, softcap
from cache import CacheView, KVCache, KVFormat, stored_bytes
from kernels import TORCH_KERNELS, Kernels
from sparq import SparQConfig


def sparq_adaptive_reference(q: Tensor, k: Tensor, v: Tensor, v_sum: Tensor, length: int, config: SparQConfig,
                             cap: Optional[float] = None, spread: Optional[Tensor] = None,
                             k_t: Optional[Tensor] = None, per_head: bool = True) -> Tensor:
    """Adaptive SparQ with loops, as sparq_reference, at one (r, k) = config's. The selection is made over a
    pool of P KV heads: each head alone (per_head, P = 1), or a row's n_kv heads (P = n_kv), which then share
    P x r components and P x k positions, so the step moves what fixed SparQ moves, but a head whose |q|
    is concentrated, or whose step-1 scores are peaked, lends to one that needs more.

      1. Components: each head's group-summed |q_i| sigma_i as a share of its sum, sigma_i the keys'
         spread (standard deviation over the positions) in dimension i, so a component counts by how
         much it moves the logits q . k from position to position: every head keeps its largest, and
         the other P (r - 1) go to the largest shares over the pool's heads. Each head's s_hat =
         softmax(q[i1_h] . K^T[i1_h] / tau_h) as in SparQ, with its own i1_h and tau_h^2 = d x the
         share of sum |q_i| sigma_i its components hold (the paper's |q[i1]|_1 / |q|_1 with sigma = 1).
      2. Positions: every head keeps its last `local` positions; the other P (k - local) go to the
         largest group-summed s_hat over the pool's heads (each head's sums to g: comparable masses).
      3. Mean-V (optional) with each head's alpha = its s_hat mass on its own selection.

    q (B, n_kv, g, d); k, v (B, n_kv, S_max, d); v_sum (B, n_kv, d); spread (B, n_kv, d), None: all 1
    (the paper's ranking by |q| alone); k_t (B, n_kv, d, S_max): the K^T step 1 reads, None: K's
    (a quantized cache stores its own) -> (B, n_kv, g, d) in q.dtype."""
    B, n_kv, g, d = q.shape
    S = length
    r, kk, n_local = config.r, min(config.k_top, S), min(config.local, S, config.k_top)
    out = torch.empty(B, n_kv, g, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        qs = [q[b, h].float() for h in range(n_kv)]  # (g, d) each
        Ks, Vs = [k[b, h, :S].float() for h in range(n_kv)], [v[b, h, :S].float() for h in range(n_kv)]
        Ks1 = Ks if k_t is None else [k_t[b, h, :, :S].T.float() for h in range(n_kv)]  # step 1's (S, d) each
        pools = [[h] for h in range(n_kv)] if per_head else [list(range(n_kv))]
        # Step 1: each pool's components
        sigma = [torch.ones(d, device=q.device) if spread is None else spread[b, h].float()
                 for h in range(n_kv)]  # (d,) each
        weight = [qh.abs() * sigma[h] for h, qh in enumerate(qs)]  # (g, d) each
        shares = [w.sum(0) / w.sum() for w in weight]  # (d,) each
        chosen = [[int(sh.argmax())] for sh in shares]
        for pool in pools:
            rest = sorted(((float(shares[h][i]), h, i) for h in pool for i in range(d) if i != chosen[h][0]),
                          key=lambda t: -t[0])
            for _, h, i in rest[: len(pool) * (r - 1)]:
                chosen[h].append(i)
        s_hats = []
        for h, qh in enumerate(qs):
            i1 = torch.tensor(chosen[h], device=q.device)
            tau = torch.sqrt(d * weight[h][:, i1].sum(-1) / weight[h].sum(-1))  # (g,)
            s_hats.append(torch.softmax(softcap(qh[:, i1] @ Ks1[h][:, i1].T / tau[:, None], cap), dim=-1))  # (g, S)
        # Step 2: each pool's positions, each head's local window first
        positions = [list(range(S - n_local, S)) for _ in range(n_kv)]
        for pool in pools:
            rest = sorted(((float(s_hats[h].sum(0)[p]), h, p) for h in pool for p in range(S - n_local)),
                          key=lambda t: -t[0])
            for _, h, p in rest[: len(pool) * (kk - n_local)]:
                positions[h].append(p)
        for h, qh in enumerate(qs):
            i2 = torch.tensor(sorted(positions[h]), dtype=torch.long, device=q.device)
            probs = torch.softmax(softcap(qh @ Ks[h][i2].T / math.sqrt(d), cap), dim=-1)  # (g, k_h)
            y = probs @ Vs[h][i2]
            # Step 3
            if config.mean_v:
                alpha = s_hats[h][:, i2].sum(-1, keepdim=True)
                y = alpha * y + (1 - alpha) * (v_sum[b, h] / S)
            out[b, h] = y
    return out.to(q.dtype)


def _take_top(score: Tensor, counts: Tensor) -> Tensor:
    """score (B, N) -> (B, N) bool: each row's counts[b] largest entries."""
    top = score.topk(int(counts.max()), dim=-1).indices  # (B, max count)
    keep = torch.arange(top.shape[1], device=score.device) < counts[:, None]
    return torch.zeros_like(score, dtype=torch.bool).scatter(1, top, keep)


SPREAD_FLOOR = 1e-6  # a row of one position has spread 0 everywhere: it then ranks by |q| alone


def key_spread(k_moments: Tensor, count: Tensor | int) -> Tensor:
    """The keys' standard deviation per dimension over `count` positions (an int, or (B,) per row), from
    the cache's running sums of K and K^2 (KVCache.k_moments (B, n_kv, 2, d)) -> (B, n_kv, d) fp32,
    at least SPREAD_FLOOR."""
    n = count.view(-1, 1, 1) if isinstance(count, Tensor) else count
    mean = k_moments[:, :, 0] / n
    return (k_moments[:, :, 1] / n - mean * mean).clamp(min=SPREAD_FLOOR ** 2).sqrt()


def _take_top_for_heads(score: Tensor, counts: Tensor, per_head: bool) -> Tensor:
    """score (B, n_kv, N) -> (B, n_kv, N) bool: n_kv x counts[b] entries of row b shared by its heads (the
    largest over all of them), or per_head: counts[b] of each head's own."""
    B, n_kv, N = score.shape
    if per_head:
        return _take_top(score.flatten(0, 1), counts.repeat_interleave(n_kv)).view(B, n_kv, N)
    return _take_top(score.flatten(1), n_kv * counts).view(B, n_kv, N)


def select_components(q: Tensor, r: Tensor | int, spread: Tensor, per_head: bool = True) -> Tensor:
    """Step 1's components (r: an int, or (B,) per row): per_head, each head's r largest group-summed
    |q_i| spread_i (the paper's per-head ranking, spread-weighted); else n_kv x r shared by a row's KV
    heads: each head's largest, then the largest shares of their heads' sums over all heads.
    q (B, n_kv, g, d), spread (B, n_kv, d) -> (B, n_kv, 1, d) bool."""
    B, n_kv, _, d = q.shape
    a = q.float().abs().sum(2) * spread  # (B, n_kv, d)
    share = (a / a.sum(-1, keepdim=True)).scatter(-1, a.argmax(-1, keepdim=True), float("inf"))
    counts = torch.as_tensor(r, device=q.device).expand(B)  # (B,) per head
    return _take_top_for_heads(share, counts, per_head).view(B, n_kv, 1, d)


def select_positions(s_hat: Tensor, length: int, k: Tensor | int, local: Tensor | int,
                     live_length: Optional[Tensor], per_head: bool = True) -> Tensor:
    """Step 2's positions (k, local: ints or (B,) per row): each head's last `local` live positions, then
    per_head its own largest group-summed s_hat up to min(k, S); else n_kv x min(k, S) shared by a row's KV
    heads, the largest over all of them.
    s_hat (B, n_kv, g, S) -> (B, n_kv, 1, S) bool (positions past a row's live length never selected)."""
    B, n_kv = s_hat.shape[:2]
    position = torch.arange(length, device=s_hat.device)
    live = length if live_length is None else per_row(live_length, 3)  # against (B, n_kv, S)
    local = torch.as_tensor(local, device=s_hat.device).expand(B).view(B, 1, 1)
    score = s_hat.sum(2)  # (B, n_kv, S)
    score = torch.where(position >= live - local, float("inf"), score)
    score = torch.where(position >= live, float("-inf"), score)
    counts = torch.as_tensor(k, device=s_hat.device).clamp(max=length).expand(B)  # (B,) per head
    return _take_top_for_heads(score, counts, per_head).view(B, n_kv, 1, length) & (position < live)[..., None, :]


def sparq_adaptive_torch(q: Tensor, k: Tensor, v: Tensor, v_sum: Tensor, spread: Tensor, length: int,
                         live_length: Optional[Tensor], r: Tensor | int, k_top: Tensor | int, local: Tensor | int,
                         mean_v: bool, cap: Optional[float] = None, k_t: Optional[Tensor] = None,
                         per_head: bool = True) -> Tensor:
    """sparq_adaptive_reference for all rows at once, with masks where the heads' counts differ: the
    components a head did not get are zeros of q (so step 1 multiplies all of K^T here: this path is
    the readable one, the transfers counted are the policy's), the positions it did not get are -inf
    before the softmax. q (B, n_kv, g, d) -> (B, n_kv, g, d); spread (B, n_kv, d) (key_spread);
    live_length as sparq_attention_torch's; r, k_top, local: ints, or (B,) per row (ragged rows, each
    at its own split). Step 1 reads k_t (B_max, n_kv, d, S_max) where given (a quantized cache's K^T
    holds other values than its K), else K. per_head: each KV head its own r components and k positions;
    False: a row's heads pool them (sparq_adaptive_reference)."""
    B, d = q.shape[0], q.shape[-1]
    qf = q.float()
    keys, values = k[:B, :, :length].float(), v[:B, :, :length].float()  # (B, n_kv, S, d)
    if live_length is not None:  # whatever lies past a row's live length (weights 0 below) must not be NaN
        live = (torch.arange(length, device=q.device) < per_row(live_length, 3))[..., None]  # (B or 1, 1, S, 1)
        keys, values = keys.masked_fill(~live, 0.0), values.masked_fill(~live, 0.0)
    # Step 1
    chosen = select_components(q, r, spread, per_head)  # (B, n_kv, 1, d)
    q_hat = qf * chosen  # (B, n_kv, g, d)
    weight = qf.abs() * spread[:, :, None, :]  # (B, n_kv, g, d)
    tau = torch.sqrt(d * (weight * chosen).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True))  # (B, n_kv, g, 1)
    keys_t = keys.transpose(-1, -2) if k_t is None else k_t[:B, :, :, :length].float()  # (B, n_kv, d, S)
    logits = softcap((q_hat @ keys_t) / tau, cap)  # (B, n_kv, g, S)
    if live_length is not None:
        logits = logits.masked_fill(beyond_live(length, live_length), float("-inf"))
    s_hat = torch.softmax(logits, dim=-1)
    # Step 2
    selected = select_positions(s_hat, length, k_top, local, live_length, per_head)  # (B, n_kv, 1, S)
    scores = softcap((qf @ keys.transpose(-1, -2)) / math.sqrt(d), cap).masked_fill(~selected, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ values  # (B, n_kv, g, d)
    # Step 3
    if mean_v:
        alpha = (s_hat * selected).sum(-1, keepdim=True)
        n = length if live_length is None else per_row(live_length, 3)
        y = alpha * y + (1 - alpha) * (v_sum[:B] / n)[:, :, None, :]
    return y.to(q.dtype)


@dataclass(frozen=True)
class StepCosts:
    """Step 1's reads in units of one K or V element as the cache stores it (its row scale's share
    included): a K^T element (`kt`) and the scale step 1 reads per position (`kt_scale`). A float
    cache's K^T is K's dtype: 1 and 0, the paper's element count. An int4 K^T beside bf16 K and V:
    1/4 and 2 (a 4-byte scale per position), so the same bytes buy up to 4x the components (the scales take some)."""

    kt: float = 1.0
    kt_scale: float = 0.0

    @classmethod
    def of(cls, fmt: KVFormat, activation: torch.dtype, head_dim: int) -> StepCosts:
        element = fmt.bytes_per_element(activation) + fmt.row_scale_bytes(activation) / head_dim
        return cls(fmt.kt_bytes_per_element(activation) / element, fmt.kt_scale_bytes(activation) / element)


ELEMENTS = StepCosts()  # a float cache


def sparq_adaptive_attention_torch(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor,
                                   spread: Tensor, length: int, live_length: Optional[Tensor], compression: float,
                                   k_max: int, k_cap: Optional[int], mean_v: bool, per_head: bool = True,
                                   cap: Optional[float] = None, costs: StepCosts = ELEMENTS) -> Tensor:
    """The kernel contract's sparq_adaptive (kernels.py) in PyTorch: each row splits the budget at its own
    live length (adaptive_split at `costs`, the cache's: a float cache's by default, k at most k_cap; a
    row that sees at most k_max positions takes all of them and every component; the host reads the
    lengths: this is the reference path) and sparq_adaptive_torch runs the rows at their splits, step 1 on k_t."""
    B, d = q.shape[0], q.shape[-1]
    lengths = [length] * B if live_length is None else live_length.expand(B).tolist()
    splits = [(d, n) if n <= k_max else adaptive_split(n, d, compression, k_cap, costs) for n in lengths]
    r, k_top = (torch.tensor(column, device=q.device) for column in zip(*splits))  # (B,) each
    local = (k_top // 4).clamp(min=1)  # every head keeps at least its last position, however small k is
    return sparq_adaptive_torch(q, k, v, v_sum, spread, length, live_length, r, k_top, local, mean_v, cap, k_t,
                                per_head)


MIN_COMPONENTS = 12  # step 1's components below which adaptive_split takes budget from the positions
HALF_COMPONENTS_AT_MOST = 3 / 4  # the most of a step's budget step 1 may spend on half the components (a cheap K^T)


def position_share(compression: float, head_dim: int, costs: StepCosts = ELEMENTS,
                   seq_len: Optional[int] = None) -> float:
    """The share of a step's budget adaptive_split gives to positions (k), the rest going to step 1's
    components (r) and the step's fixed 6 d (counted per position over seq_len where it is given).
    On a K^T stored in fewer bytes than K (an int4 one, or int8 beside fp32 K and V), where half the
    components (d / 2) cost at most HALF_COMPONENTS_AT_MOST of the budget, step 1 reads d / 2 and the
    positions take the rest (near the best share measured on an int4 K^T). Otherwise half, unless half
    leaves step 1 fewer than MIN_COMPONENTS components, in which case the positions give up what it takes
    to reach them, keeping at least 1/8: with too few components step 1 ranks positions worse than a larger
    k makes up for, while a model with many components to spare (Gemma 3's d = 256) needs the positions.
    Both measured with scripts/studies/adaptive_split_study.py on SQuAD prompts; the shares measured and
    what this rule gives: docs/NOTES.md, 'Figures behind the code's choices'."""
    def need(components: float, extra: float = 0.0) -> float:  # their share of the budget (+ extra per position)
        return (components * costs.kt + costs.kt_scale + extra) / (2 * compression * head_dim)

    if costs.kt < 1.0:
        half = need(head_dim / 2, 0.0 if seq_len is None else 6 * head_dim / seq_len)  # with the step's fixed 6 d
        if half <= HALF_COMPONENTS_AT_MOST:
            return 1 - half
    return min(0.5, max(0.125, 1 - need(MIN_COMPONENTS)))


def adaptive_split(seq_len: int, head_dim: int, compression: float, k_cap: Optional[int] = None,
                   costs: StepCosts = ELEMENTS, share: Optional[float] = None) -> tuple[int, int]:
    """(r, k) of one layer's step over seq_len visible positions at `compression` of dense's transfers:
    the positions take position_share of the budget (k = share c S, at most k_cap if one is given), the
    components the rest (r in [1, d]), and what rounding r down leaves goes back to k, so S r + 2 k d + 6 d (SparQ's
    transfers and the keys' running sums, 2 d) is within 2d of c (2 S d + 2 d): a window layer and a global
    one get splits of their own where one (r, k) for every layer starved one of them (the examples:
    docs/NOTES.md, 'Figures behind the code's choices'). The fused kernel (csrc/sparq_adaptive.cpp) repeats this arithmetic for each row. On a cache whose
    K^T is stored in fewer bytes than K (`costs`), step 1's S r becomes S (r costs.kt + costs.kt_scale):
    the same bytes, more components. `share` overrides position_share (scripts/studies/adaptive_split_study.py)."""
    d = head_dim
    share = position_share(compression, d, costs, seq_len) if share is None else share
    budget = int(compression * (2 * seq_len * d + 2 * d))
    k = max(1, min(seq_len if k_cap is None else k_cap, int(compression * share * seq_len)))
    scales = seq_len * costs.kt_scale  # read whatever r is
    # floats: exact for a float cache's integers (below 2^52), and for an int4 K^T's 1/4 and 2
    r = max(1, min(d, math.floor((budget - 2 * k * d - 6 * d - scales) / (seq_len * costs.kt))))
    k = max(1, min(seq_len, k + math.floor((budget - seq_len * r * costs.kt - scales - 2 * k * d - 6 * d) / (2 * d))))
    return r, k


class SparQAdaptiveDecode(KernelPolicy):
    """Adaptive SparQ: a compression target instead of one (r, k) for every layer and step. Each step
    splits the layer's budget at its visible length (adaptive_split: a window layer and a global one
    get different splits, and the split follows S as it grows); each KV head takes its own r components
    and k positions, or with per_head=False (--adaptive-heads pooled) a layer's KV heads share n_kv r and
    n_kv k (sparq_adaptive_reference), the components ranked by |q_i| times the keys' spread in dimension i
    (key_spread, from the cache's running sums: Gemma 3's k_norm scales its key dimensions far apart,
    which |q| alone does not see). Each head its own is the default since pooling let one head's sharper
    scores take the positions another needed: common-word extraction lost recall pooled (docs/accuracy.md).
    Local window k / 4, at least 1.
    Dense attention while a layer sees at most k_max positions, as SparQDecode (--sparq-k). k_cap bounds
    k where given (--adaptive-k-cap; what rounding r down leaves still goes back to k); by default the
    budget's share alone sets it, since a cap (once 128, SparQ's k) starves the positions of a task that
    copies long spans (README: repetition at 1/4)."""

    name = "sparq-adaptive"

    def __init__(self, compression: float, k_max: int = 128, mean_v: bool = False, kernels: Kernels = TORCH_KERNELS,
                 cap: Optional[float] = None, k_cap: Optional[int] = None, per_head: bool = True):
        super().__init__()
        if not 0 < compression <= 1:
            raise ValueError(f"--compression must be in (0, 1], got {compression}")
        if k_max < 1:
            raise ValueError(f"--sparq-k must be at least 1, got {k_max}")
        if k_cap is not None and k_cap < 1:
            raise ValueError(f"--adaptive-k-cap must be at least 1, got {k_cap}")
        self.compression, self.k_max, self.k_cap, self.mean_v = compression, k_max, k_cap, mean_v
        self.per_head = per_head
        self.bind_kernels(kernels.sparq_adaptive, partial(sparq_adaptive_attention_torch, cap=cap), kernels, cap)

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        B, d = q.shape[0], q.shape[-1]
        if cache.visible_length(length) <= self.k_max:
            return self.dense(q, cache, length)

        def arguments(view: CacheView) -> tuple:
            return (view.k, view.k_t, view.v, view.v_sum, self.spread(view, B), view.length, view.live_length,
                    self.compression, self.k_max, self.k_cap, self.mean_v, self.per_head)

        # a quantized cache's budget in the bytes it stores (a float cache's: in elements, the paper's)
        return self.attend_cache(q, cache, length, arguments, costs=StepCosts.of(cache.format, cache.dtype, d))

    @staticmethod
    def spread(view, B: int) -> Tensor:
        """The keys' spread per dimension over the visible live positions of rows [:B]: (B, n_kv, d)."""
        return key_spread(view.k_moments[:B], view.length if view.live_length is None else view.live_length)

    def split(self, seq_len: int, head_dim: int, costs: StepCosts = ELEMENTS) -> Optional[tuple[int, int]]:
        """(r, k) of a step over seq_len visible positions on a cache of `costs`; None while it runs dense."""
        if seq_len <= self.k_max:
            return None
        return adaptive_split(seq_len, head_dim, self.compression, self.k_cap, costs)

    def transfer_elements(self, seq_len: int, head_dim: int, costs: StepCosts = ELEMENTS) -> int:
        """SparQ's (eq. 11) at this step's split, on average over the layer's heads, and the keys' running
        sums of K and K^2: S r + 2 k d + 6 d; dense's while S <= k_max."""
        split = self.split(seq_len, head_dim, costs)
        if split is None:
            return DenseDecode().transfer_elements(seq_len, head_dim)
        r, k = split
        return seq_len * r + 2 * k * head_dim + 6 * head_dim

    def step1_reads(self, seq_len: int, head_dim: int, costs: StepCosts = ELEMENTS) -> tuple[int, int]:
        split = self.split(seq_len, head_dim, costs)
        return (0, 0) if split is None else (seq_len, split[0])

    def transfer_bytes(self, seq_len: int, head_dim: int, fmt: KVFormat, activation: torch.dtype) -> float:
        """At the split this cache's bytes give (forward's): more components where K^T is stored smaller."""
        costs = StepCosts.of(fmt, activation, head_dim)
        positions, rows = self.step1_reads(seq_len, head_dim, costs)
        return stored_bytes(self.transfer_elements(seq_len, head_dim, costs), positions, rows, head_dim, fmt,
                            activation)
