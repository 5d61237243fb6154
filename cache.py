"""The static KV cache: K twice (d-contiguous for the rows SparQ's step 2 and dense attention read,
S-contiguous K^T for step 1's r rows), V, and running sums, preallocated for (max batch, max length)
and written in place.

KVFormat says how it stores them (--kv-layout, --kv-dtype, --kt-dtype, --kt-scale-dtype: floats, or int8
K and V with fp32 scales and an int8 / int4 K^T with fp32 or bf16 scales); KVCache holds the buffers and
is the only code that names them; CacheView is what one decode step of one layer attends to.
stored_bytes counts a policy's transfers in the bytes this cache stores.

Shapes: B batch, n_kv KV heads, S positions, d head dim, T new tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernels import KVScales



SUM_CHUNK = 1024  # positions per step when the running sums are recomputed


def position_sums(k: Tensor, v: Tensor, weight: Optional[Tensor] = None) -> Tensor:
    """The running sums' terms added over positions: k, v (B, n_kv, T, d) -> (B, n_kv, 3, d) fp32, the
    sums of V, K and K^2 (KVCache.sums); weight (B, T) of 0s and 1s says which positions count."""
    kf, vf = k.float(), v.float()
    terms = torch.stack([vf, kf, kf * kf], dim=3)  # (B, n_kv, T, 3, d)
    return terms.sum(2) if weight is None else torch.einsum("bhtsd,bt->bhsd", terms, weight.float())


KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")  # --kv-dtype: K and V ("auto": the activations')
KT_DTYPES = ("same", "int8", "int4", "int3")  # --kt-dtype: SparQ's copy of K^T ("same": as K is stored)
QMAX = {"int8": 127, "int4": 7, "int3": 3}  # symmetric integer range [-qmax, qmax] of each quantized format
# int3: a K^T without position scales only (--kt-scale-dtype none), 3 bits a position in blocks of 32 positions
# (INT3_BLOCK_BYTES: the low two bits of each, four a byte, then the high bits, eight a byte). Its 3/8 of a byte buys
# step 1 a third more components than int4's 1/2 at the same bytes (r = 15 -> 20 at 1/16 and 4k on
# Qwen2.5-Coder-0.5B: KL from dense 0.46 -> 0.21 in a screen, docs/accuracy.md). The fused CPU kernels read it
# (csrc/sparq_problem.h's int3x32); the Triton ones do not (--kt-scale-dtype none is the CPU's alone).
INT3_BLOCK = 32  # positions per block
INT3_BLOCK_BYTES = 12  # 8 bytes of low bit pairs, 4 of high bits
# --kt-scale-dtype: a quantized K^T's own per-position scale. bf16 halves what step 1 reads per position
# beside the r components (4 of the 16 bytes a position gets at 1/16 on an int4 K^T at d = 64), and its
# 0.4% rounding is small beside int4's steps of 1/7 of the absmax (docs/accuracy.md).
KT_SCALE_DTYPES = ("float32", "bfloat16", "none")
# "none": no scale per position at all (an int4 or int8 K^T beside a float K): each dimension's step is its
# range in the row's first write, the keys centred on that write's mean and clamped to it, so a position's 2-4
# bytes go to step 1's components (4 more at 1/16 and 4k on Qwen2.5-Coder-0.5B; KL from dense 0.61 -> 0.46 in a
# screen, docs/accuracy.md). Centring shifts every step-1 logit of a query by the same q . mean, which the
# softmax does not see.


@dataclass(frozen=True)
class KVFormat:
    """How the KV caches store K, V and SparQ's copy of K^T (--kv-layout, --kv-dtype, --kt-dtype,
    --kt-scale-dtype).

    Float formats store values as they are. Quantized ones store integers and one scale per
    (position, KV head), fp32 (a K^T's own: fp32 or bf16, kt_scale_dtype): a write quantizes only its
    own new positions, so a scale is never revised after its positions are written (snapshot, restore,
    truncate and rollback rely on that). K is first divided by a per-channel scale fixed at each row's
    first write (its prompt's absmax per channel): keys have outlier channels, and a per-token scale
    alone spends the integer range on them (docs/NOTES.md: on Qwen2.5-Coder-0.5B the worst layer's
    int8 attention drifts by a total-variation distance of 0.95 without it, 0.22 with it)."""

    layout: str = "twice"  # "twice": K^T kept beside K for SparQ's step 1; "once": K alone
    kv_dtype: str = "auto"  # KV_DTYPES
    kt_dtype: str = "same"  # KT_DTYPES
    kt_scale_dtype: str = "float32"  # KT_SCALE_DTYPES: the dtype of a K^T's own scales (own_kt_scale)

    def __post_init__(self):
        if self.layout not in ("twice", "once"):
            raise ValueError(f"unknown KV layout {self.layout!r} (expected 'twice' or 'once')")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown --kv-dtype {self.kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if self.kt_dtype not in KT_DTYPES:
            raise ValueError(f"unknown --kt-dtype {self.kt_dtype!r} (choose from {', '.join(KT_DTYPES)})")
        if self.layout == "once" and self.kt_dtype != "same":
            raise ValueError("--kt-dtype stores SparQ's copy of K^T, which --kv-layout once does not keep")
        if self.kt_scale_dtype not in KT_SCALE_DTYPES:
            raise ValueError(f"unknown --kt-scale-dtype {self.kt_scale_dtype!r} "
                             f"(choose from {', '.join(KT_SCALE_DTYPES)})")
        if self.kt_scale_dtype != "float32" and not self.own_kt_scale:
            raise ValueError("--kt-scale-dtype stores the scales of a K^T quantized apart from K (--kt-dtype int4, or "
                             "int8 beside a float K): this cache has none")
        if self.kt_dtype == "int3" and self.kt_scale_dtype != "none":
            raise ValueError("--kt-dtype int3 is stored without position scales: give --kt-scale-dtype none")
        if self.kt_scale_dtype == "none" and self.int8_kv:
            raise ValueError("--kt-scale-dtype none: a K^T without position scales goes beside a float K "
                             "(--kv-dtype auto), not an int8 one")

    @property
    def int8_kv(self) -> bool:
        """K and V are stored as int8 (whatever the activations)."""
        return self.kv_dtype == "int8"

    @property
    def own_kt_scale(self) -> bool:
        """K^T is quantized apart from K, with scales of its own (an int8 K^T beside an int8 K is K's
        int8 transposed and shares K's scales)."""
        return self.layout == "twice" and self.kt_dtype in QMAX and not (self.kt_dtype == "int8" and self.int8_kv)

    @property
    def position_scaled_kt(self) -> bool:
        """K^T's own scales are per position (--kt-scale-dtype float32 / bfloat16), not none."""
        return self.own_kt_scale and self.kt_scale_dtype != "none"

    @property
    def quantized_kt(self) -> bool:
        """SparQ's K^T is stored quantized: int8 or int4, or K's int8 with --kt-dtype same."""
        return self.layout == "twice" and (self.kt_dtype in QMAX or (self.kt_dtype == "same" and self.int8_kv))

    def kv_storage(self, activation: torch.dtype) -> str:
        """K and V's stored format: the activations' dtype's name or "int8". A float cache in another
        dtype than the activations is a ValueError (the torch paths read the cache in theirs)."""
        own = str(activation).removeprefix("torch.")
        if self.kv_dtype not in ("auto", own, *QMAX):
            raise ValueError(f"--kv-dtype {self.kv_dtype} with {own} activations: a float cache is stored in the "
                             f"activations' dtype (give --kv-dtype auto or int8, or --dtype {self.kv_dtype})")
        return own if self.kv_dtype == "auto" else self.kv_dtype

    def kt_storage(self, activation: torch.dtype) -> Optional[str]:
        """K^T's stored format (None without K^T): a float dtype's name, "int8", "int4" or "int3"."""
        if self.layout == "once":
            return None
        return self.kv_storage(activation) if self.kt_dtype == "same" else self.kt_dtype

    def bytes_per_element(self, activation: torch.dtype) -> float:
        """Stored bytes of one K or V element, its share of the row's scale included."""
        return _stored_bytes(self.kv_storage(activation))

    def kt_bytes_per_element(self, activation: torch.dtype) -> float:
        return _stored_bytes(self.kt_storage(activation) or self.kv_storage(activation))

    def kt_scale_bytes(self, activation: torch.dtype) -> int:
        """Bytes of scale per position step 1 reads (K^T's own, or K's fp32 one when K^T is K's int8
        transposed or with layout "once")."""
        if self.own_kt_scale:
            return getattr(torch, self.kt_scale_dtype).itemsize if self.position_scaled_kt else 0
        return 4 if (self.kt_storage(activation) or self.kv_storage(activation)) in QMAX else 0

    def row_scale_bytes(self, activation: torch.dtype) -> int:
        """Bytes of the scale per stored row of K or V."""
        return 4 if self.kv_storage(activation) in QMAX else 0


def _stored_bytes(storage: str) -> float:
    return {"int8": 1.0, "int4": 0.5, "int3": INT3_BLOCK_BYTES / INT3_BLOCK}.get(storage) or getattr(torch, storage).itemsize


def stored_bytes(elements: int, positions: int, rows: int, head_dim: int, fmt: KVFormat,
                 activation: torch.dtype) -> float:
    """`elements` moved per KV head in bytes as `fmt` stores them, `positions` x `rows` of them step 1's
    K^T elements (at K^T's size, plus one scale per position), the rest K and V elements (plus one
    scale per row of head_dim)."""
    kt = positions * rows
    rest = elements - kt
    return (kt * fmt.kt_bytes_per_element(activation) + positions * fmt.kt_scale_bytes(activation)
            + rest * fmt.bytes_per_element(activation) + rest / head_dim * fmt.row_scale_bytes(activation))


def quantize_symmetric(x: Tensor, qmax: int, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """x (..., n) -> (q int8 (..., n) in [-qmax, qmax], scale (...,) in scale_dtype) with x ~ q * scale:
    one scale per row of n (its absmax / qmax), rounding to nearest. The scale is rounded to
    scale_dtype first and q computed with it as stored (a bf16 scale rounded down clamps the absmax's
    q to qmax, off by at most its 0.4% rounding)."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=torch.finfo(scale_dtype).tiny) / qmax
    scale = scale.to(scale_dtype)
    return torch.round(x / scale[..., None].float()).clamp(-qmax, qmax).to(torch.int8), scale


def channel_scale(k: Tensor, counted: Optional[Tensor] = None) -> Tensor:
    """The per-channel scale of a row's keys from its first write k (B, n_kv, T, d) -> (B, n_kv, d)
    fp32: each channel's absmax over the positions `counted` (B, 1, T, 1) bool (default all), floored
    at 1e-3 of the largest so that a channel the prompt left near zero cannot blow up a later token's
    per-token scale."""
    a = k.float().abs()
    a = (a if counted is None else a * counted).amax(2)
    return torch.maximum(a, 1e-3 * a.amax(-1, keepdim=True)).clamp(min=torch.finfo(torch.float32).tiny)


def dequantize_kv(k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, chan: Tensor) -> tuple[Tensor, Tensor]:
    """An int8 cache's K and V as stored -> fp32: k, v (..., T, d) int8, their scales (..., T), K's
    channel scale chan (..., 1, d)."""
    return k.float() * k_scale[..., None] * chan, v.float() * v_scale[..., None]


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """(..., ceil(n / 2)) uint8, position 2i in the low nibble and 2i + 1 in the high one, each
    stored as q + 8 -> (..., n) int8 in [-7, 7]."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :n]
    return nibbles.to(torch.int8) - 8


def unpack_int3(packed: Tensor, n: int) -> Tensor:
    """(..., 12 m) uint8, m blocks of 32 positions (position j of a block: bits 2 (j % 4) of byte j // 4 its low
    two bits, bit j % 8 of byte 8 + j // 8 its high one), each stored as q + 4 -> (..., n) int8 in [-3, 3],
    n <= 32 m."""
    blocks = packed.unflatten(-1, (-1, INT3_BLOCK_BYTES))  # (..., m, 12)
    low = torch.stack([(blocks[..., :8] >> (2 * c)) & 3 for c in range(4)], dim=-1).flatten(-2)  # (..., m, 32)
    high = torch.stack([(blocks[..., 8:] >> c) & 1 for c in range(8)], dim=-1).flatten(-2)
    return ((low | (high << 2)).flatten(-2)[..., :n]).to(torch.int8) - 4


@dataclass
class CacheView:
    """What one decode step of a layer attends to: positions [start, start + length) of its cache.

    k, k_t, v are views of the buffers from position `start` on (so the kernels see a plain prefix
    of `length` positions); v_sum and k_moments are running sums over exactly the visible positions.
    live_length: None when every position read is live; else a device tensor beyond which reads are
    masked: 0-dim (bucketed lengths, every row alike) or (B,) (ragged rows: each row's live length).
    Kernels take exactly these (kernels.py docstring)."""

    k: Tensor  # (B_max, n_kv, S_max - start, d)
    k_t: Optional[Tensor]  # (B_max, n_kv, d, S_max - start)
    v: Tensor  # (B_max, n_kv, S_max - start, d)
    v_sum: Tensor  # (B_max, n_kv, d) fp32: sum of V
    k_moments: Tensor  # (B_max, n_kv, 2, d) fp32: sums of K and K^2
    length: int
    live_length: Optional[Tensor]
    start: int = 0
    scales: Optional[KVScales] = None  # an int8 k and v as stored (KVCache.view(stored=True)): their scales


class KVCache(nn.Module):
    """Static cache, preallocated for (max_batch, max_seq_length), written in place.

    k     (B, n_kv, S_max, d)  d-contiguous: rows gathered by SparQ step 2 and by dense attention
    k_t   (B, n_kv, d, S_max)  S-contiguous: the r rows SparQ step 1 reads (absent with layout "once")
    v     (B, n_kv, S_max, d)
    sums  (B, n_kv, 3, d) fp32 running sums over the visible positions of V (`v_sum`: SparQ mean-V),
                               K and K^2 (`k_moments`: the keys' spread per dimension, sparq-adaptive)
    A quantized cache (KVFormat: --kv-dtype int8, --kt-dtype int8/int4) stores k, v as int8 beside
    k_scale, v_scale (B, n_kv, S) fp32, K^T as int8 (B, n_kv, d, S) or int4 (uint8 (B, n_kv, d,
    S/2 + 1 rounded up to 16), two positions per byte) beside kt_scale (B, n_kv, S) fp32 or bf16
    (--kt-scale-dtype; none when K^T is K's int8 transposed: K's scales), and chan (B, n_kv, d) fp32,
    K's per-channel scale: K = k k_scale chan, V = v v_scale, K^T = k_t kt_scale chan (--kt-scale-dtype none:
    no kt_scale, K^T = k_t chan: the keys less kt_mean (B, n_kv, d) fp32, fixed at the first write). view() gives
    the torch paths dequantized copies, view(stored=True) the kernels that read it the buffers and
    their scales; the sums are over the values as stored.
    live_length (B,) int64     row b's positions [0, live_length[b]) are live: a device tensor, so
                               a step never syncs with the host. Rows share one live length unless
                               set_live_lengths made them ragged (batches of different prompts).

    window: a sliding-window layer's cache; a decode step sees only the last `window` live positions
    (the buffers still hold every position: a window layer reads min(S, window) of them, which is
    what the transfer accounting counts), and the running sums cover only those.

    length_bucket: decode attention reads `read_length(live)` positions, the live length rounded up
    to a multiple of length_bucket. With 1 (CPU) it reads exactly the live prefix and needs no
    mask; with larger buckets (CUDA graphs: one graph per bucket, not per length) the positions
    from live_length to the read length are masked (`CacheView.live_length`).

    Only this class names its buffers: the rest of the repo uses the methods below.
    """

    def __init__(self, max_batch: int, max_seq_length: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, layout: str = "twice", length_bucket: int = 1, window: Optional[int] = None,
                 kv_dtype: str = "auto", kt_dtype: str = "same", kt_scale_dtype: str = "float32"):
        super().__init__()
        if window is not None and length_bucket > 1:
            raise ValueError("sliding-window layers read exact lengths: use --length-bucket 1")
        self.format = KVFormat(layout, kv_dtype, kt_dtype, kt_scale_dtype)
        self.length_bucket = length_bucket
        self.window = window
        self.dtype = dtype  # the activations': what reads return
        self.kv_storage, self.kt_storage = self.format.kv_storage(dtype), self.format.kt_storage(dtype)
        B, S, d = max_batch, max_seq_length, head_dim
        self.quantized = self.kv_storage in QMAX or self.kt_storage in QMAX
        stored = torch.int8 if self.kv_storage in QMAX else dtype
        self.register_buffer("k", torch.zeros((B, n_kv_head, S, d), dtype=stored), persistent=False)
        self.register_buffer("v", torch.zeros((B, n_kv_head, S, d), dtype=stored), persistent=False)
        # int8 K and V: one fp32 scale per (row, head, position); K divided by `chan` first
        row_scales = self.kv_storage in QMAX
        self.register_buffer("k_scale", torch.zeros((B, n_kv_head, S)) if row_scales else None, persistent=False)
        self.register_buffer("v_scale", torch.zeros((B, n_kv_head, S)) if row_scales else None, persistent=False)
        self.register_buffer("chan", torch.ones((B, n_kv_head, d)) if self.quantized else None, persistent=False)
        if self.kt_storage is None:
            k_t = None
        elif self.kt_storage == "int4":  # two positions per byte along S, + a spare column that absorbs
            # no-op writes, the row padded to 16 bytes: with S a multiple of 32 (Transformer.CACHE_ALIGN)
            # every row starts 16-byte aligned, as float and int8 rows do, so a kernel may load it in
            # wide vectors (S / 2 + 1 bytes left every other row at an odd address)
            k_t = torch.zeros((B, n_kv_head, d, -(-(S // 2 + 1) // 16) * 16), dtype=torch.uint8)
        elif self.kt_storage == "int3":  # blocks of 32 positions in 12 bytes (S a multiple of 32), the spare column
            # padded to 16 bytes as int4's
            k_t = torch.zeros((B, n_kv_head, d, -(-(-(-S // INT3_BLOCK) * INT3_BLOCK_BYTES + 1) // 16) * 16),
                              dtype=torch.uint8)
        else:
            k_t = torch.zeros((B, n_kv_head, d, S), dtype=torch.int8 if self.kt_storage == "int8" else dtype)
        self.register_buffer("k_t", k_t, persistent=False)
        # K^T's own scales (in --kt-scale-dtype), unless it is K's int8 transposed (then it shares K's)
        self.shares_k_scale = self.kt_storage == "int8" and self.kv_storage == "int8"
        own = (torch.zeros((B, n_kv_head, S), dtype=getattr(torch, kt_scale_dtype)) if self.format.position_scaled_kt
               else None)
        self.register_buffer("kt_scale", own, persistent=False)
        # no position scales: K^T holds (K - kt_mean) / chan rounded and clamped, kt_mean fixed at the first write
        unscaled = self.format.own_kt_scale and not self.format.position_scaled_kt
        self.register_buffer("kt_mean", torch.zeros((B, n_kv_head, d)) if unscaled else None, persistent=False)
        self.register_buffer("sums", torch.zeros((B, n_kv_head, 3, d), dtype=torch.float32), persistent=False)
        self.register_buffer("live_length", torch.zeros((B,), dtype=torch.long), persistent=False)
        self.ragged = False  # rows have their own live lengths (set_live_lengths); reset clears it

    @property
    def k_t_scale(self) -> Optional[Tensor]:  # (B_max, n_kv, S_max) scales of a quantized K^T (fp32 or bf16)
        return self.k_scale if self.shares_k_scale else self.kt_scale

    @property
    def v_sum(self) -> Tensor:  # (B_max, n_kv, d), strided: the kernels take its strides
        return self.sums[:, :, 0]

    @property
    def k_moments(self) -> Tensor:  # (B_max, n_kv, 2, d)
        return self.sums[:, :, 1:]

    @property
    def max_seq_length(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, row: Optional[int] = None,
               lengths: Optional[Tensor] = None) -> None:
        """Write k, v (B, n_kv, T, d) at positions input_pos: (T,) for every row, or (B, T) per row
        (ragged rows). Positions must be new (past the row's live length). row: write batch row `row`
        alone (B = 1), the others keeping their state: a prefill into one row (the rows are then ragged).
        lengths (B,): a right-padded prefill of prompts of these lengths; the padding does not count
        toward a quantized K's channel scale (a row's cache is then what its prompt alone writes)."""
        B, n_kv = k.shape[:2]
        first = 0 if row is None else row
        if row is not None:
            self._check_row_operation()
            self.ragged = True
        # Advanced indexing on the whole buffers, not index_copy_ into a [:B] slice: with a dynamic
        # batch size torch.compile cannot write through that slice in place and copied every
        # cache buffer whole, several times per layer and step.
        rows = torch.arange(first, first + B, device=k.device).view(B, 1, 1)
        heads = torch.arange(n_kv, device=k.device).view(1, n_kv, 1)
        input_pos = input_pos.view(-1, 1, input_pos.shape[-1])  # (1 or B, 1, T)
        if self.quantized:
            k, v = self._write_quantized(rows, heads, input_pos, k, v, first, B, lengths)
        else:
            self.k[rows, heads, input_pos] = k  # indexes (B, n_kv, T) -> rows of d
            self.v[rows, heads, input_pos] = v
            if self.k_t is not None:
                self.k_t[rows, heads, :, input_pos] = k  # advanced indices first: the same (B, n_kv, T, d)
        self.sums[first:first + B] += position_sums(k, v)  # of the values as stored
        if self.window is not None:  # the positions that leave the window (still in the buffers)
            leaving = input_pos - self.window  # (1 or B, 1, T)
            at, gone = leaving.clamp(min=0), (leaving >= 0)[..., None]
            k_out, v_out = self._stored(rows, heads, at)
            self.sums[first:first + B] -= position_sums(k_out * gone, v_out * gone)
        self.live_length[first:first + B] = input_pos[:, 0, -1] + 1

    def _write_quantized(self, rows: Tensor, heads: Tensor, input_pos: Tensor, k: Tensor, v: Tensor, first: int,
                         B: int, lengths: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """update()'s writes into a cache with a quantized part; returns k, v as stored (fp32)."""
        fresh = (self.live_length[first:first + B] == 0)[:, None, None]  # a row's first write fixes its channel scale
        counted = None if lengths is None else (input_pos[..., None] < lengths.view(-1, 1, 1, 1))  # (B, 1, T, 1)
        if self.kt_mean is not None:  # no position scales: K^T's values are those of the row's first write
            return self._write_unscaled_kt(rows, heads, input_pos, k, v, fresh, counted, first, B)
        chan = torch.where(fresh, channel_scale(k, counted), self.chan[first:first + B])  # (B, n_kv, d)
        self.chan[first:first + B] = chan
        kn = k.float() / chan[:, :, None]  # (B, n_kv, T, d)
        if self.kv_storage in QMAX:
            kq, k_scale = quantize_symmetric(kn, QMAX["int8"])
            vq, v_scale = quantize_symmetric(v, QMAX["int8"])
            self.k[rows, heads, input_pos], self.k_scale[rows, heads, input_pos] = kq, k_scale
            self.v[rows, heads, input_pos], self.v_scale[rows, heads, input_pos] = vq, v_scale
            k, v = dequantize_kv(kq, k_scale, vq, v_scale, chan[:, :, None])
        else:
            self.k[rows, heads, input_pos] = k
            self.v[rows, heads, input_pos] = v
        if self.shares_k_scale:
            self.k_t[rows, heads, :, input_pos] = kq
        elif self.kt_storage == "int8":
            self.k_t[rows, heads, :, input_pos], self.kt_scale[rows, heads, input_pos] = quantize_symmetric(
                kn, QMAX["int8"], self.kt_scale.dtype)
        elif self.kt_storage == "int4":
            q4, self.kt_scale[rows, heads, input_pos] = quantize_symmetric(kn, QMAX["int4"], self.kt_scale.dtype)
            self._write_kt_integers(rows, heads, input_pos, q4)
        return k, v

    def _write_unscaled_kt(self, rows: Tensor, heads: Tensor, input_pos: Tensor, k: Tensor, v: Tensor, fresh: Tensor,
                           counted: Optional[Tensor], first: int, B: int) -> tuple[Tensor, Tensor]:
        """update()'s writes beside a K^T without position scales (--kt-scale-dtype none): K and V as given, K^T =
        (k - kt_mean) / chan rounded and clamped to the integer range, kt_mean and chan (each dimension's absmax
        of the centred keys / qmax) fixed at a row's first write (a write of one position centres on 0)."""
        qmax = QMAX[self.kt_storage]
        rows_now = slice(first, first + B)
        kf = k.float()
        if k.shape[2] > 1:
            weight = torch.ones_like(kf[..., :1]) if counted is None else counted.float()  # (B, 1 or n_kv, T, 1)
            mean = (kf * weight).sum(2) / weight.sum(2).clamp(min=1)  # (B, n_kv, d)
        else:
            mean = torch.zeros_like(kf[:, :, 0])
        mean = torch.where(fresh, mean, self.kt_mean[rows_now])
        centred = kf - mean[:, :, None]
        chan = torch.where(fresh, channel_scale(centred, counted) / qmax, self.chan[rows_now])  # (B, n_kv, d)
        self.kt_mean[rows_now], self.chan[rows_now] = mean, chan
        self.k[rows, heads, input_pos] = k
        self.v[rows, heads, input_pos] = v
        q = torch.round(centred / chan[:, :, None]).clamp(-qmax, qmax).to(torch.int8)  # (B, n_kv, T, d)
        self._write_kt_integers(rows, heads, input_pos, q)
        return k, v

    def _write_kt_integers(self, rows: Tensor, heads: Tensor, input_pos: Tensor, q: Tensor) -> None:
        """K^T's integers q (B, n_kv, T, d) at input_pos: int8 as they are, int4 two positions per byte (the even
        one's in the low nibble, each stored as q + 8), int3 in blocks of 32 positions (unpack_int3)."""
        if self.kt_storage == "int8":
            self.k_t[rows, heads, :, input_pos] = q
            return
        if self.kt_storage == "int4":  # (positions a byte, bits, mask, byte, value) of its one plane
            planes = ((2, 4, 0xF, input_pos // 2, (q + 8).to(torch.uint8)),)
        else:
            code = (q + 4).to(torch.uint8)
            block, j = input_pos // INT3_BLOCK * INT3_BLOCK_BYTES, input_pos % INT3_BLOCK
            planes = ((4, 2, 3, block + j // 4, code & 3), (8, 1, 1, block + 8 + j // 8, code >> 2))
        self._write_packed(rows, heads, input_pos, planes)

    def _write_packed(self, rows: Tensor, heads: Tensor, input_pos: Tensor, planes: tuple) -> None:
        """Packed K^T bits at input_pos (1 or B, 1, T), plane by plane: `classes` positions share a byte, each
        `bits` of it (position p's class p % classes; int3's are taken within its block, whose 32 positions every
        class count divides). One position a row (a decode step) touches one byte of each plane: read-modify-write
        at each row's own shift. More (a prefill chunk) share bytes: one class at a time, the others' writes sent
        to the spare last column, so no byte is written twice in one pass."""
        spare = self.k_t.shape[3] - 1
        for classes, bits, mask, byte_of, value in planes:
            if input_pos.shape[-1] == 1:
                shift = (bits * (input_pos % classes)).to(torch.uint8)[..., None]  # (1 or B, 1, 1, 1)
                old = self.k_t[rows, heads, :, byte_of]
                self.k_t[rows, heads, :, byte_of] = (old & ~(mask << shift)) | (value << shift)
                continue
            for c in range(classes):
                shift = bits * c
                byte = torch.where(input_pos % classes == c, byte_of, spare)
                old = self.k_t[rows, heads, :, byte]
                self.k_t[rows, heads, :, byte] = (old & (0xFF ^ (mask << shift))) | (value << shift)

    def _stored(self, rows, heads, pos) -> tuple[Tensor, Tensor]:
        """K and V at advanced indices (rows, heads, pos) -> (..., d), as stored (dequantized in fp32)."""
        if self.kv_storage not in QMAX:
            return self.k[rows, heads, pos], self.v[rows, heads, pos]
        return dequantize_kv(self.k[rows, heads, pos], self.k_scale[rows, heads, pos], self.v[rows, heads, pos],
                             self.v_scale[rows, heads, pos], self.chan[rows, heads])  # chan: (B, n_kv, 1, d)

    def read(self, rows: slice, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K and V (rows, n_kv, end - start, d) at positions [start, end) of batch rows `rows`, in the
        activations' dtype: the buffers themselves, or dequantized copies of an int8 cache."""
        k, v = self.k[rows, :, start:end], self.v[rows, :, start:end]
        if self.kv_storage not in QMAX:
            return k, v
        k, v = dequantize_kv(k, self.k_scale[rows, :, start:end], v, self.v_scale[rows, :, start:end],
                             self.chan[rows, :, None])
        return k.to(self.dtype), v.to(self.dtype)

    def read_k_t(self, rows: slice, start: int, end: int, channels: Optional[Tensor] = None) -> Optional[Tensor]:
        """K^T (rows, n_kv, d, end - start) at positions [start, end), in the activations' dtype
        (dequantized from int8 or int4), or None with layout "once". channels (n_kv, r): only those
        rows of each KV head, (rows, n_kv, r, end - start), gathered before they are dequantized (a
        reader of r rows then pays for r, not d)."""
        if self.k_t is None:
            return None
        if channels is None:
            heads, chosen = slice(None), slice(None)
        else:  # advanced indices on dims 1 and 2 side by side: the result keeps (rows, n_kv, r, S)
            chosen = channels.to(self.k_t.device)
            heads = torch.arange(chosen.shape[0], device=chosen.device)[:, None]  # (n_kv, 1)
        if self.kt_storage not in QMAX:
            return self.k_t[rows, heads, chosen, start:end]
        if self.kt_storage == "int4":
            lo = start // 2 * 2  # unpack whole bytes
            q = unpack_int4(self.k_t[rows, heads, chosen, lo // 2:-(-end // 2)], end - lo)[..., start - lo:]
        elif self.kt_storage == "int3":
            lo, blocks = start // INT3_BLOCK, -(-end // INT3_BLOCK)  # unpack whole blocks
            packed = self.k_t[rows, heads, chosen, lo * INT3_BLOCK_BYTES:blocks * INT3_BLOCK_BYTES]
            q = unpack_int3(packed, end - lo * INT3_BLOCK)[..., start - lo * INT3_BLOCK:]
        else:
            q = self.k_t[rows, heads, chosen, start:end]
        kt = q.float()
        if self.k_t_scale is not None:  # else --kt-scale-dtype none: chan is each dimension's step
            kt = kt * self.k_t_scale[rows, :, None, start:end].float()
        kt = kt * self.chan[rows, heads, chosen][..., None]  # in read()'s order: K^T shared with K is K bit for bit
        return kt.to(self.dtype)

    def set_live_lengths(self, lengths: Tensor) -> None:
        """Make rows ragged: row b's live positions are [0, lengths[b]) (B,), whatever a padded prefill
        wrote beyond them; the running sums are recomputed over each row's visible positions."""
        if self.window is not None:
            raise ValueError("ragged batches with sliding-window layers are not supported: run such prompts one at a time")
        B = lengths.shape[0]
        self.sums[:B] = 0
        for start in range(0, int(lengths.max()), SUM_CHUNK):  # an fp32 copy of one chunk at a time
            end = min(start + SUM_CHUNK, self.max_seq_length)
            live = torch.arange(start, end, device=lengths.device) < lengths[:, None]  # (B, chunk)
            self.sums[:B] += position_sums(*self.read(slice(0, B), start, end), live)
        self.live_length[:B] = lengths
        self.ragged = True

    def read_length(self, live_length: int) -> int:
        """Positions decode attention reads at this live length: rounded up to the bucket, capped at S_max."""
        return min(-(-live_length // self.length_bucket) * self.length_bucket, self.max_seq_length)

    def visible_start(self, length: int) -> int:
        """The first position a decode step reading `length` positions sees (0 but for window layers)."""
        return 0 if self.window is None else max(0, length - self.window)

    def visible_length(self, length: int) -> int:
        return length - self.visible_start(length)

    def stored_view_readable(self, length: int) -> bool:
        """A fused kernel can read view(length, stored=True): not a window starting inside an int4
        K^T byte (its first position would be a high nibble; the torch paths read it dequantized) or inside an
        int3 block."""
        start = self.visible_start(length)
        return not ((self.kt_storage == "int4" and start % 2) or (self.kt_storage == "int3" and start % INT3_BLOCK))

    def view(self, length: int, rows: int, stored: bool = False, with_k_t: bool = True) -> CacheView:
        """The positions a decode step of `rows` rows reading `length` positions attends to: values in
        the activations' dtype (dequantized copies of a quantized cache's visible positions, for the
        torch paths), or with stored=True the buffers as stored (int8 K and V with their scales, for
        kernels that read them; K^T as stored). with_k_t=False: k_t None, for a policy that reads K and
        V alone (a quantized K^T's dequantized copy costs a step as much as reading K)."""
        start = self.visible_start(length)
        if self.ragged:
            live = self.live_length[:rows]
        elif self.length_bucket > 1:
            live = self.live_length[0]  # every row alike: one 0-dim live length
        else:
            live = None
        scales = None
        if self.quantized and not stored:  # what the torch paths read: dequantized copies of the visible positions
            k, v = self.read(slice(0, rows), start, length)
            k_t = self.read_k_t(slice(0, rows), start, length) if with_k_t else None
        else:
            k, v = self.k[:, :, start:], self.v[:, :, start:]
            if self.k_t is None or not with_k_t or not self.stored_view_readable(length):
                k_t = None  # an int4 K^T is read from an even position (its bytes hold two), an int3 one from a
                # block's first: unreadable here, which stored_view_readable tells SparQ's kernels (dense reads K
                # and V alone)
            else:
                element = {"int4": start // 2, "int3": start // INT3_BLOCK * INT3_BLOCK_BYTES}.get(self.kt_storage, start)
                k_t = self.k_t[..., element:]
            if self.quantized:
                k_scale, v_scale, kt_scale = (None if s is None else s[:, :, start:]
                                              for s in (self.k_scale, self.v_scale, self.kt_scale))
                if self.shares_k_scale:  # K^T is K's int8 transposed: the same scales (the kernels see it is)
                    kt_scale = k_scale
                scales = KVScales(k_scale, v_scale, self.chan, kt_scale, 3 if self.kt_storage == "int3" else 4)
        return CacheView(k, k_t, v, self.v_sum, self.k_moments, length - start, live, start, scales)

    def reset(self, row: Optional[int] = None) -> None:
        """Empty the cache, or batch row `row` alone (the other rows keep their state). An emptied
        row's buffers are not cleared: positions past a live length are never read unmasked."""
        if row is None:
            for buffer in self._buffers.values():
                if buffer is not None:
                    buffer.zero_()
            if self.chan is not None:
                self.chan.fill_(1.0)
            self.ragged = False
            return
        self.truncate(row, 0)

    def truncate(self, row: int, length: int) -> None:
        """Row `row` keeps positions [0, length) live, as if nothing after them had been written; the
        other rows keep their state (the rows are then ragged). The running sums lose exactly the
        removed positions' terms, or are summed again over the kept ones when they are fewer (a window
        layer's: over the window ending at `length`, restoring what the window had dropped): the work
        is min(removed, kept) positions (a window at most), never the whole cache."""
        self._check_row_operation()
        live = int(self.live_length[row])
        if not 0 <= length <= live:
            raise ValueError(f"cannot truncate row {row} to {length} positions: it holds {live}")
        rows = slice(row, row + 1)
        if self.window is None and live - length <= length:
            self.sums[row] -= self.sum_positions(rows, length, live)[0]
        elif self.window is None:  # fewer positions kept than removed: summing the kept ones is cheaper
            self.sums[row] = self.sum_positions(rows, 0, length)[0]
        else:
            self.sums[row] = self.sum_positions(rows, self.visible_start(length), length)[0]
        self.live_length[row] = length
        self.ragged = True

    def row_state(self, rows: list[int]) -> dict:
        """Copies of these rows' running sums and live lengths (restore_row_state puts them back)."""
        index = torch.tensor(rows, device=self.sums.device)
        return {"rows": index, "sums": self.sums[index].clone(), "live_length": self.live_length[index].clone()}

    def restore_row_state(self, state: dict) -> None:
        self.sums[state["rows"]] = state["sums"]
        self.live_length[state["rows"]] = state["live_length"]

    def keep_prefix(self, row: int, length: int, piece: int) -> None:
        """Row `row` keeps positions [0, length) (a prefix a new request shares: engine.py's reuse) with its
        running sums summed again over them piece by piece, [0, piece), [piece, 2 piece)..., in the order and
        the shapes a prefill in pieces of `piece` adds them from zero: the state a cold prefill of the same
        tokens leaves, bit for bit. A window layer (one row) keeps its window's sums as truncate does."""
        if self.window is not None:
            self.truncate(row, length)
            return
        self._check_row_operation()
        live = int(self.live_length[row])
        if not 0 <= length <= live:
            raise ValueError(f"cannot keep {length} positions of row {row}: it holds {live}")
        rows = torch.tensor([row], device=self.k.device).view(1, 1, 1)
        heads = torch.arange(self.k.shape[1], device=self.k.device).view(1, -1, 1)
        total = torch.zeros_like(self.sums[row:row + 1])
        for start in range(0, length, piece):
            positions = torch.arange(start, min(start + piece, length), device=self.k.device).view(1, 1, -1)
            total += position_sums(*self._stored(rows, heads, positions))  # as update() summed them
        self.sums[row:row + 1] = total
        self.live_length[row] = length
        self.ragged = True

    def truncate_rows(self, lengths: Tensor) -> None:
        """Row b keeps positions [0, lengths[b]) (B,) for every row at once (speculative decoding's
        rollback: rows accept different counts in one round); the removed positions' terms leave the
        running sums in one pass over the positions any row removes. Window layers: truncate(0, L)."""
        B = lengths.shape[0]
        if self.window is not None:
            self._check_row_operation()
            self.truncate(0, int(lengths[0]))
            return
        old = self.live_length[:B]
        lo, hi = int(lengths.min()), int(old.max())
        if hi > lo:
            positions = torch.arange(lo, hi, device=lengths.device)
            removed = (positions >= lengths[:, None]) & (positions < old[:, None])  # (B, hi - lo)
            self.sums[:B] -= position_sums(*self.read(slice(0, B), lo, hi), removed)
        self.live_length[:B] = lengths
        self.ragged = True

    def _check_row_operation(self) -> None:
        if self.window is not None and self.max_batch > 1:
            raise ValueError("a sliding-window layer reads one window for every row, so its rows cannot hold "
                             "different lengths: per-row operations need a batch of one on this model")

    @property
    def max_batch(self) -> int:
        return self.k.shape[0]

    def snapshot(self) -> dict[str, Tensor]:
        """Copies of the state that is not indexed by position (running sums, live length).

        Decode steps write K, K^T and V only at new positions, which are never read before being
        rewritten, so restore(snapshot) rewinds the cache exactly to when the snapshot was taken."""
        state = {"sums": self.sums.clone(), "live_length": self.live_length.clone(), "ragged": self.ragged}
        for name in ("chan", "kt_mean"):  # fixed at a row's first write: a snapshot of an empty row precedes it
            if getattr(self, name) is not None:
                state[name] = getattr(self, name).clone()
        return state

    def restore(self, snapshot: dict) -> None:
        self.sums.copy_(snapshot["sums"])
        for name in ("chan", "kt_mean"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(snapshot[name])
        self.live_length.copy_(snapshot["live_length"])
        self.ragged = snapshot["ragged"]

    def rewind(self, length: int) -> None:
        """Keep positions [0, length) of every row live, as if nothing after them had been written."""
        self.sums.copy_(self.sum_positions(slice(None), self.visible_start(length), length))
        self.live_length.fill_(length)
        self.ragged = False

    def broadcast_row(self, n_rows: int) -> None:
        """Copy batch row 0 into rows 1..n_rows-1 (every row then holds the same prompt)."""
        for buffer in self._buffers.values():
            if buffer is not None:
                buffer[1:n_rows].copy_(buffer[:1].expand_as(buffer[1:n_rows]))

    def sum_positions(self, rows: slice, start: int, end: int) -> Tensor:
        """position_sums over positions [start, end) of batch rows `rows` -> (rows, n_kv, 3, d), of the
        values as stored, SUM_CHUNK positions at a time: never a whole fp32 copy of the cache (4.3 GB
        per layer at Llama-2's shape, B = 8, 32k)."""
        k = self.k[rows]
        total = torch.zeros(k.shape[0], k.shape[1], 3, k.shape[3], dtype=torch.float32, device=k.device)
        for s in range(start, end, SUM_CHUNK):
            total += position_sums(*self.read(rows, s, min(s + SUM_CHUNK, end)))
        return total

    def nbytes(self) -> int:
        """Bytes of every buffer as allocated (K, V, K^T, scales, sums; K's scales once when K^T shares them)."""
        return sum(b.numel() * b.element_size() for name, b in self._buffers.items()
                   if b is not None and name != "live_length")
