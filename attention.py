"""Exact attention, and the interface every decode attention policy implements.

prefill_attention: causal attention of a prompt chunk (dense: prefill never goes sparse).
DecodePolicy: how one layer attends during single-token decode; DenseDecode, the exact baseline, reads
only the visible live positions (dense_attention_torch is its readable path, the fused kernels its
fast one). SparQ (sparq.py), adaptive SparQ (sparq_adaptive.py) and the baselines (baselines.py)
subclass DecodePolicy.

Shapes: B batch, H query heads, n_kv KV heads, g = H // n_kv, T new tokens, S positions, d head dim.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, KVFormat, stored_bytes
from kernels import TORCH_KERNELS, Kernels



def softcap(logits: Tensor, cap: Optional[float]) -> Tensor:
    """Gemma 2's soft-capping, cap * tanh(logits / cap); the identity when cap is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def per_row(live_length: Tensor, ndim: int) -> Tensor:
    """A live length (0-dim, or (B,) per row) shaped to broadcast against (B, ..., positions) of ndim dims."""
    return live_length if live_length.dim() == 0 else live_length.view(-1, *([1] * (ndim - 1)))


def beyond_live(length: int, live_length: Tensor) -> Tensor:
    """True at the positions [0, length) a read covers that are not live: (length,) for one live
    length (0-dim), (B, 1, 1, length) for per-row live lengths (B,); both broadcast over the
    scores (B, n_kv, g, length)."""
    return torch.arange(length, device=live_length.device) >= per_row(live_length, 4)


def dense_attention_torch(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Optional[Tensor] = None,
                          cap: Optional[float] = None) -> Tensor:
    """Exact attention of one decode query over positions [0, length) of the cache.

    q (B, n_kv, g, d); k, v (B_max, n_kv, S_max, d) -> (B, n_kv, g, d); positions >= live_length
    are masked when it is given (bucketed reads); cap: logit soft-capping. Matmul-softmax-matmul
    with fp32 softmax: on CPU it matches SDPA in fp32 and is several times faster in bf16.
    """
    B = q.shape[0]
    k, v = k[:B, :, :length], v[:B, :, :length]
    scores = softcap((q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1]), cap)  # (B, n_kv, g, S)
    if live_length is not None:
        scores = scores.masked_fill(beyond_live(length, live_length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return probs @ v


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, window: Optional[int],
                      cap: Optional[float]) -> Tensor:
    """Causal attention of T new queries at positions [q_start, q_start + T) over the keys at the
    last k.shape[2] positions up to q_start + T (a chunk of a long prefill sees the chunks before it).

    q (B, H, T, d) (already carrying the score scale, see Attention); k, v (B, n_kv, S_k, d)
    -> (B, H, T, d). A window layer's query at p sees keys (p - window, p].
    """
    B, H, T, d = q.shape
    n_kv, S_k = k.shape[1], k.shape[2]
    if window is None and cap is None and S_k == T:  # a whole prompt at once: SDPA's causal kernel
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != H)
    q_pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
    k_pos = torch.arange(q_start + T - S_k, q_start + T, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # (T, S_k)
    if window is not None:
        allowed &= k_pos > q_pos - window
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=n_kv != H)
    g = H // n_kv  # soft-capped logits: SDPA cannot, so the group's rows go through one matmul per KV head
    scores = (q.reshape(B, n_kv, g * T, d) @ k.transpose(-1, -2)).float() / math.sqrt(d)  # (B, n_kv, g T, S_k)
    scores = softcap(scores, cap).view(B, n_kv, g, T, S_k).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, n_kv, g * T, S_k)
    return (probs @ v).view(B, H, T, d)


class DecodePolicy(nn.Module):
    """How one layer attends during single-token decode (dense here; SparQ in sparq.py; the baselines in
    baselines.py; the registry of policies in policies.py).

    forward(q (B, n_kv, g, d), cache, length) -> (B, n_kv, g, d) attends to cache.view(length):
    exactly the live positions (the current token included) when cache.length_bucket is 1, else the
    live ones (cache.live_length) and masked ones up to the bucket's end; a window layer's cache
    shows only its last positions.
    """

    name = "policy"
    follows_rows = True  # stateless across steps: the cache's per-row operations (truncate, reset) need nothing
    observes_prefill = False  # True: observe_prefill is called after every prefill chunk (the cache read for it)

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None,
                        lengths: Optional[Tensor] = None, window: Optional[int] = None) -> None:
        """Called after each prefill chunk, where observes_prefill, with its queries q (B, H, T, d) at the
        last T positions and every key so far k (B, n_kv, S, d); stateful policies (H2O) use it. memo: shared by policies
        observing the same prefill (the evals runner), for work that does not depend on their settings.
        lengths (B,): a right-padded batch of prompts of these lengths (queries past them are padding).
        window: the layer's sliding window (a query at p sees keys (p - window, p]), None on a global layer."""

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Elements of K/V moved per KV head per decode step over seq_len visible positions."""
        raise NotImplementedError

    def step1_reads(self, seq_len: int, head_dim: int) -> tuple[int, int]:
        """(positions, rows): the part of transfer_elements that scans K^T (SparQ's step 1: S positions
        of r rows), which the cache may store in another format than K and V; (0, 0) for the others."""
        return 0, 0

    def transfer_bytes(self, seq_len: int, head_dim: int, fmt: KVFormat, activation: torch.dtype) -> float:
        """transfer_elements in bytes as the cache stores them (`fmt`, activations in `activation`):
        step 1's K^T elements at K^T's size plus one scale per position scanned, every other element
        at K and V's size plus one scale per row of head_dim."""
        positions, rows = self.step1_reads(seq_len, head_dim)
        return stored_bytes(self.transfer_elements(seq_len, head_dim), positions, rows, head_dim, fmt, activation)

    def verify(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        """T queries per row at each row's last T live positions (speculative verification): q
        (B, n_kv, g, T, d) -> (B, n_kv, g, T, d), query j attending to its row's positions up to its
        own. Only dense attention verifies (DenseDecode.verify)."""
        raise NotImplementedError(f"{self.name} attention cannot verify speculative tokens")


def dense_decode(attend: Callable, fused: bool, q: Tensor, cache: KVCache, length: int) -> Tensor:
    """Dense attention of q (B, n_kv, g, d) over cache.view(length) with `attend`: a fused kernel reads
    the cache as stored (an int8 one with its scales), the torch path the values in the activations' dtype."""
    view = cache.view(length, q.shape[0], stored=fused)
    if view.scales is not None and view.scales.k_scale is not None:  # int8 K and V (a quantized K^T is not read)
        return attend(q, view.k, view.v, view.length, view.live_length, scales=view.scales)
    return attend(q, view.k, view.v, view.length, view.live_length)


class KernelPolicy(DecodePolicy):
    """A policy with a fused kernel beside its readable torch path (SparQ, adaptive SparQ), which runs dense
    attention while a layer sees too few positions to select from. bind_kernels says which the run has;
    attend_cache calls the right one on the right view of the cache."""

    def bind_kernels(self, fused: Optional[Callable], torch_path: Callable, kernels: Kernels,
                     cap: Optional[float]) -> None:
        """fused: the run's kernel (None: the torch path alone); soft-capped models get no attention kernels
        (resolve_kernels), so the cap binds to the torch paths."""
        if fused is not None and kernels.prepare_sparq is not None:  # fused: the record's SparQ kernel
            kernels.prepare_sparq()
        self.attend_torch = torch_path
        self.attend = fused or torch_path
        self.fused = fused is not None  # reads the cache as stored (resolve_kernels: it can)
        self.attend_dense = kernels.dense_attention or partial(dense_attention_torch, cap=cap)
        self.dense_fused = kernels.dense_attention is not None

    def dense(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        return dense_decode(self.attend_dense, self.dense_fused, q, cache, length)

    def torch_view(self, cache: KVCache, length: int, rows: int):
        """What the torch path reads: the visible positions in the activations' dtype (a quantized cache's
        dequantized)."""
        return cache.view(length, rows)

    def attend_cache(self, q: Tensor, cache: KVCache, length: int, arguments: Callable, **quantized) -> Tensor:
        """The policy's attention over cache.view(length): on a quantized cache the fused kernel reads it as
        stored, with its scales (and `quantized`'s keywords), where the view allows (a window starting inside
        an int4 byte does not), else the torch path the dequantized positions; on a float cache `attend`.
        arguments(view): the call's positional arguments after q."""
        rows = q.shape[0]
        if not cache.quantized:
            return self.attend(q, *arguments(self.torch_view(cache, length, rows)))
        if self.fused and cache.stored_view_readable(length):
            view = cache.view(length, rows, stored=True)
            return self.attend(q, *arguments(view), scales=view.scales, **quantized)
        return self.attend_torch(q, *arguments(self.torch_view(cache, length, rows)), **quantized)


class DenseDecode(DecodePolicy):
    """Dense decode attention that reads only the visible live positions of the cache."""

    name = "dense"

    def __init__(self, kernels: Kernels = TORCH_KERNELS, cap: Optional[float] = None):
        super().__init__()
        # soft-capped models get no attention kernels (resolve_kernels): the cap binds to the torch path
        self.attend = kernels.dense_attention or partial(dense_attention_torch, cap=cap)
        self.fused = kernels.dense_attention is not None  # reads the cache as stored (resolve_kernels: it can)
        self.verify_kernel = kernels.dense_verify  # None: the torch path of verify()
        self.cap = cap

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        return dense_decode(self.attend, self.fused, q, cache, length)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Paper, Appendix G: 2Sd + 2d (read K and V, write the new k and v)."""
        return 2 * seq_len * head_dim + 2 * head_dim

    def verify(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        """DecodePolicy.verify in one read of the cache: the T queries' scores against every position
        [lo, length) at once, each masked to its own causal (and window) range; the run's dense_verify
        kernel where it has one (the fused CPU kernel or the Triton one, not on window layers); the CPU
        kernel's is the one-token kernel's result bit for bit where both read one chunk per row; this
        torch path equals T one-token steps up to fp32 rounding (docs/NOTES.md)."""
        B, n_kv, g, T, d = q.shape
        window = cache.window
        if self.verify_kernel is not None and window is None:
            view = cache.view(length, B, stored=True)
            if view.scales is not None and view.scales.k_scale is not None:  # int8 K and V
                return self.verify_kernel(q, view.k, view.v, length, cache.live_length[:B], scales=view.scales)
            return self.verify_kernel(q, view.k, view.v, length, cache.live_length[:B])
        lo = 0 if window is None else max(0, length - T - window + 1)
        k, v = cache.read(slice(0, B), lo, length)  # (B, n_kv, S, d)
        q_pos = cache.live_length[:B, None] - T + torch.arange(T, device=q.device)  # (B, T)
        k_pos = torch.arange(lo, length, device=q.device)
        allowed = k_pos <= q_pos[..., None]  # (B, T, S)
        if window is not None:
            allowed &= k_pos > q_pos[..., None] - window
        scores = (q.reshape(B, n_kv, g * T, d) @ k.transpose(-1, -2)).float() / math.sqrt(d)
        scores = softcap(scores, self.cap).view(B, n_kv, g, T, -1).masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, n_kv, g * T, -1)
        return (probs @ v).view(B, n_kv, g, T, d)
