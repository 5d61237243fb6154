"""A minimal decoder-only transformer for the Llama, Qwen, Gemma and GPT-NeoX families, with a
static, SparQ-ready KV cache.

Families: Llama 2 / 3 / 3.1, Mistral, SmolLM2, Qwen 2 / 2.5 / 3, Gemma 1 / 2 / 3 (text), GPT-NeoX
(Pythia). What differs between them is a handful of switches in ModelArgs (biases, norms, the MLP,
soft-capping, sliding-window layers, partial RoPE...), always read from the `config.json` the
converter writes next to `model.pth`: nothing is guessed from a name.

Shapes: B batch, T new tokens, S cache positions, H query heads, n_kv KV heads,
g = H // n_kv query heads per KV head, d head dim, D model dim.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cli import UserError
from kernels import TORCH_KERNELS, Kernels, KVScales


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or of an unsupported kind (a user error)."""


NORMS = ("rms", "layer")
MLPS = ("gated", "plain")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
LAYER_KINDS = ("global", "window")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3", "factor", ...} (Llama 3.1) or {"rope_type": "linear", "factor"}
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_context: int = 4096
    architecture: str = "llama"  # informational: the family the converter read; behaviour comes from the fields below
    bos_id: Optional[int] = None
    eos_ids: list[int] = field(default_factory=list)
    # Architecture switches, written by the converter; every default is Llama's.
    norm: str = "rms"  # "rms", or "layer": LayerNorm with a bias (GPT-NeoX)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1 for Gemma's HF weights
    qkv_bias: bool = False  # biases on q, k and v (Qwen 2, GPT-NeoX)
    out_bias: bool = False  # a bias on the attention output projection (GPT-NeoX)
    mlp_bias: bool = False  # biases on the MLP (GPT-NeoX)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen 3, Gemma 3)
    mlp: str = "gated"  # "gated": w2(act(w1 x) * w3 x); "plain": w2(act(w1 x)) (GPT-NeoX)
    activation: str = "silu"  # "silu", "gelu" (erf) or "gelu_tanh"
    embedding_scale: Optional[float] = None  # Gemma: sqrt(dim), multiplied in the activation dtype
    sandwich_norms: bool = False  # Gemma 2 / 3: a norm after attention and after the MLP as well
    parallel_residual: bool = False  # GPT-NeoX: x + attn(norm1(x)) + mlp(norm2(x))
    rotary_dim: Optional[int] = None  # partial RoPE (GPT-NeoX): only the first rotary_dim dims of a head rotate
    attn_scale: Optional[float] = None  # attention score scale; None: head_dim ** -0.5 (Gemma 2 / 3: query_pre_attn_scalar ** -0.5)
    attn_softcap: Optional[float] = None  # Gemma 2: attention logits -> cap * tanh(logits / cap)
    final_softcap: Optional[float] = None  # Gemma 2: the same on the output logits
    sliding_window: Optional[int] = None  # positions a window layer attends to, the current one included
    layer_types: Optional[list[str]] = None  # per layer "global" or "window"; None: every layer global
    rope_local_base: Optional[float] = None  # Gemma 3: the RoPE base of window layers (no scaling); None: rope_base
    # Tensor parallel (tp.shard): this rank's KV heads are the whole model's [kv_head_start,
    # kv_head_start + n_kv_head) of kv_head_total (None: not sharded, n_kv_head): per-head data made
    # for the whole model (DoubleSparse's calibrated channels) is sliced by them.
    kv_head_start: int = 0
    kv_head_total: Optional[int] = None

    def __post_init__(self):
        if self.n_head % self.n_kv_head:
            raise CheckpointError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        for name, value, allowed in (("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS),
                                     ("activation", self.activation, tuple(ACTIVATIONS))):
            if value not in allowed:
                raise CheckpointError(f"config.json: unknown {name} {value!r} (expected one of {', '.join(allowed)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer or any(t not in LAYER_KINDS for t in self.layer_types):
                raise CheckpointError(f"config.json: layer_types must list {self.n_layer} of {', '.join(LAYER_KINDS)}")
            if "window" in self.layer_types and not self.sliding_window:
                raise CheckpointError("config.json: window layers need a sliding_window")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"config.json: rotary_dim {self.rotary_dim} must be even and in (0, head_dim]")

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head

    def layer_kind(self, layer: int) -> str:
        return "global" if self.layer_types is None else self.layer_types[layer]

    def window(self, layer: int) -> Optional[int]:
        """Positions layer `layer` attends to (None: all of them)."""
        return self.sliding_window if self.layer_kind(layer) == "window" else None

    @property
    def has_window_layers(self) -> bool:
        """Some layers attend to a sliding window (their caches cannot hold ragged rows)."""
        return self.layer_types is not None and "window" in self.layer_types

    @classmethod
    def from_json(cls, path: Path | str) -> "ModelArgs":
        try:
            fields = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no config.json next to the checkpoint: {path}") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"corrupt config.json ({path}): {e}") from None
        try:
            return cls(**fields)
        except TypeError as e:
            raise CheckpointError(f"config.json ({path}) does not describe a model: {e}") from None

    def to_json(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_shape(cls, name: str) -> "ModelArgs":
        """The ModelArgs of a named published shape (SHAPES), for random weights: --random-weights."""
        if name not in SHAPES:
            raise UserError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
        return cls(**SHAPES[name])


# Published model shapes for runs with random weights (--random-weights: a GPU machine carries no
# checkpoint). Only the shapes matter there, so every context is 128k: a long-context benchmark of a
# shape needs its cache, not its training length.
_LLAMA_7B = dict(dim=4096, n_layer=32, n_head=32, head_dim=128, norm_eps=1e-5, max_context=131072)
SHAPES: dict[str, dict] = {
    "llama-2-7b": dict(_LLAMA_7B, vocab_size=32000, n_kv_head=32, intermediate_size=11008, rope_base=10000.0,
                       bos_id=1, eos_ids=[2]),
    "llama-3.1-8b": dict(_LLAMA_7B, vocab_size=128256, n_kv_head=8, intermediate_size=14336, rope_base=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # TinyLlama-1.1B: Llama 2's tokenizer, a published draft for llama-2-7b
    "tinyllama-1.1b": dict(vocab_size=32000, dim=2048, n_layer=22, n_head=32, n_kv_head=4, head_dim=64,
                           intermediate_size=5632, rope_base=10000.0, norm_eps=1e-5, max_context=131072,
                           bos_id=1, eos_ids=[2]),
    "qwen2.5-7b": dict(vocab_size=152064, dim=3584, n_layer=28, n_head=28, n_kv_head=4, head_dim=128,
                       intermediate_size=18944, rope_base=1000000.0, norm_eps=1e-6, qkv_bias=True,
                       max_context=131072, architecture="qwen2"),
    "smollm2": dict(vocab_size=49152, dim=576, n_layer=30, n_head=9, n_kv_head=3, head_dim=64, intermediate_size=1536,
                    rope_base=100000.0, tie_embeddings=True, max_context=131072),
    "tiny": dict(vocab_size=256, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=128,
                 max_context=4096),  # the tests' shape: seconds on a CPU
}


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


SUM_CHUNK = 1024  # positions per step when the running sums are recomputed


def position_sums(k: Tensor, v: Tensor, weight: Optional[Tensor] = None) -> Tensor:
    """The running sums' terms added over positions: k, v (B, n_kv, T, d) -> (B, n_kv, 3, d) fp32, the
    sums of V, K and K^2 (KVCache.sums); weight (B, T) of 0s and 1s says which positions count."""
    kf, vf = k.float(), v.float()
    terms = torch.stack([vf, kf, kf * kf], dim=3)  # (B, n_kv, T, 3, d)
    return terms.sum(2) if weight is None else torch.einsum("bhtsd,bt->bhsd", terms, weight.float())


KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")  # --kv-dtype: K and V ("auto": the activations')
KT_DTYPES = ("same", "int8", "int4")  # --kt-dtype: SparQ's copy of K^T ("same": as K is stored)
QMAX = {"int8": 127, "int4": 7}  # symmetric integer range [-qmax, qmax] of each quantized format


@dataclass(frozen=True)
class KVFormat:
    """How the KV caches store K, V and SparQ's copy of K^T (--kv-layout, --kv-dtype, --kt-dtype).

    Float formats store values as they are. Quantized ones store integers and one fp32 scale per
    (position, KV head): a write quantizes only its own new positions, so a scale is never revised
    after its positions are written (snapshot, restore, truncate and rollback rely on that). K is
    first divided by a per-channel scale fixed at each row's first write (its prompt's absmax per
    channel): keys have outlier channels, and a per-token scale alone spends the integer range on
    them (docs/NOTES.md: on Qwen2.5-Coder-0.5B the worst layer's int8 attention drifts by a
    total-variation distance of 0.95 without it, 0.22 with it)."""

    layout: str = "twice"  # "twice": K^T kept beside K for SparQ's step 1; "once": K alone
    kv_dtype: str = "auto"  # KV_DTYPES
    kt_dtype: str = "same"  # KT_DTYPES

    def __post_init__(self):
        if self.layout not in ("twice", "once"):
            raise ValueError(f"unknown KV layout {self.layout!r} (expected 'twice' or 'once')")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown --kv-dtype {self.kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if self.kt_dtype not in KT_DTYPES:
            raise ValueError(f"unknown --kt-dtype {self.kt_dtype!r} (choose from {', '.join(KT_DTYPES)})")
        if self.layout == "once" and self.kt_dtype != "same":
            raise ValueError("--kt-dtype stores SparQ's copy of K^T, which --kv-layout once does not keep")

    @property
    def int8_kv(self) -> bool:
        """K and V are stored as int8 (whatever the activations)."""
        return self.kv_dtype == "int8"

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
        """K^T's stored format (None without K^T): a float dtype's name, "int8" or "int4"."""
        if self.layout == "once":
            return None
        return self.kv_storage(activation) if self.kt_dtype == "same" else self.kt_dtype

    def bytes_per_element(self, activation: torch.dtype) -> float:
        """Stored bytes of one K or V element, its share of the row's scale included."""
        return _stored_bytes(self.kv_storage(activation))

    def kt_bytes_per_element(self, activation: torch.dtype) -> float:
        return _stored_bytes(self.kt_storage(activation) or self.kv_storage(activation))

    def kt_scale_bytes(self, activation: torch.dtype) -> int:
        """Bytes of scale per position step 1 reads (K^T's, or K's with layout "once")."""
        return 4 if (self.kt_storage(activation) or self.kv_storage(activation)) in QMAX else 0

    def row_scale_bytes(self, activation: torch.dtype) -> int:
        """Bytes of the scale per stored row of K or V."""
        return 4 if self.kv_storage(activation) in QMAX else 0


def _stored_bytes(storage: str) -> float:
    return {"int8": 1.0, "int4": 0.5}.get(storage) or getattr(torch, storage).itemsize


def quantize_symmetric(x: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """x (..., n) -> (q int8 (..., n) in [-qmax, qmax], scale (...,) fp32) with x ~ q * scale: one
    scale per row of n (its absmax / qmax), rounding to nearest."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / qmax
    return torch.round(x / scale[..., None]).clamp(-qmax, qmax).to(torch.int8), scale


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
    k_scale, v_scale (B, n_kv, S) fp32, K^T as int8 (B, n_kv, d, S) or int4 (uint8 (B, n_kv, d, S/2 + 1 rounded up to 16),
    two positions per byte) beside kt_scale (B, n_kv, S) (none when K^T is K's int8 transposed: K's
    scales), and chan (B, n_kv, d) fp32, K's per-channel scale: K = k k_scale chan, V = v v_scale,
    K^T = k_t kt_scale chan. view() gives the torch paths dequantized copies, view(stored=True) the
    kernels that read it the buffers and their scales; the sums are over the values as stored.
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
                 kv_dtype: str = "auto", kt_dtype: str = "same"):
        super().__init__()
        if window is not None and length_bucket > 1:
            raise ValueError("sliding-window layers read exact lengths: use --length-bucket 1")
        self.format = KVFormat(layout, kv_dtype, kt_dtype)
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
        else:
            k_t = torch.zeros((B, n_kv_head, d, S), dtype=torch.int8 if self.kt_storage == "int8" else dtype)
        self.register_buffer("k_t", k_t, persistent=False)
        # K^T's own scales, unless it is K's int8 transposed (then it shares K's)
        self.shares_k_scale = self.kt_storage == "int8" and self.kv_storage == "int8"
        own_kt_scale = self.kt_storage in QMAX and not self.shares_k_scale
        self.register_buffer("kt_scale", torch.zeros((B, n_kv_head, S)) if own_kt_scale else None, persistent=False)
        self.register_buffer("sums", torch.zeros((B, n_kv_head, 3, d), dtype=torch.float32), persistent=False)
        self.register_buffer("live_length", torch.zeros((B,), dtype=torch.long), persistent=False)
        self.ragged = False  # rows have their own live lengths (set_live_lengths); reset clears it

    @property
    def k_t_scale(self) -> Optional[Tensor]:  # (B_max, n_kv, S_max) fp32 scales of a quantized K^T
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
            self.k_t[rows, heads, :, input_pos], self.kt_scale[rows, heads, input_pos] = quantize_symmetric(kn, QMAX["int8"])
        elif self.kt_storage == "int4":
            q4, self.kt_scale[rows, heads, input_pos] = quantize_symmetric(kn, QMAX["int4"])
            nibble = (q4 + 8).to(torch.uint8)  # (B, n_kv, T, d)
            # Two positions share a byte: write the even positions' low nibbles, then the odd ones'
            # high nibbles (read-modify-write), each pass sending the other parity's writes to the
            # spare last column, so no byte is written twice in one pass.
            spare = self.k_t.shape[3] - 1
            for parity, keep, shift in ((0, 0xF0, 0), (1, 0x0F, 4)):
                byte = torch.where(input_pos % 2 == parity, input_pos // 2, spare)
                old = self.k_t[rows, heads, :, byte]
                self.k_t[rows, heads, :, byte] = (old & keep) | (nibble << shift)
        return k, v

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

    def read_k_t(self, rows: slice, start: int, end: int) -> Optional[Tensor]:
        """K^T (rows, n_kv, d, end - start) at positions [start, end), in the activations' dtype
        (dequantized from int8 or int4), or None with layout "once"."""
        if self.k_t is None:
            return None
        if self.kt_storage not in QMAX:
            return self.k_t[rows, :, :, start:end]
        if self.kt_storage == "int4":
            lo = start // 2 * 2  # unpack whole bytes
            q = unpack_int4(self.k_t[rows, :, :, lo // 2:-(-end // 2)], end - lo)[..., start - lo:]
        else:
            q = self.k_t[rows, :, :, start:end]
        kt = q.float() * self.k_t_scale[rows, :, None, start:end] * self.chan[rows, :, :, None]
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
        K^T byte (its first position would be a high nibble; the torch paths read it dequantized)."""
        return not (self.kt_storage == "int4" and self.visible_start(length) % 2)

    def view(self, length: int, rows: int, stored: bool = False) -> CacheView:
        """The positions a decode step of `rows` rows reading `length` positions attends to: values in
        the activations' dtype (dequantized copies of a quantized cache's visible positions, for the
        torch paths), or with stored=True the buffers as stored (int8 K and V with their scales, for
        kernels that read them; K^T as stored)."""
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
            k_t = self.read_k_t(slice(0, rows), start, length)
        else:
            if self.kt_storage == "int4" and start % 2:
                raise ValueError("an int4 K^T is read from an even position (its bytes hold two)")
            k, v = self.k[:, :, start:], self.v[:, :, start:]
            k_t = None if self.k_t is None else self.k_t[..., start // 2 if self.kt_storage == "int4" else start:]
            if self.quantized:
                k_scale, v_scale, kt_scale = (None if s is None else s[:, :, start:]
                                              for s in (self.k_scale, self.v_scale, self.kt_scale))
                if self.shares_k_scale:  # K^T is K's int8 transposed: the same scales (the kernels see it is)
                    kt_scale = k_scale
                scales = KVScales(k_scale, v_scale, self.chan, kt_scale)
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
        if self.chan is not None:  # fixed at a row's first write: a snapshot of an empty row precedes it
            state["chan"] = self.chan.clone()
        return state

    def restore(self, snapshot: dict) -> None:
        self.sums.copy_(snapshot["sums"])
        if self.chan is not None:
            self.chan.copy_(snapshot["chan"])
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


# ---------------------------------------------------------------------------------------------
# Attention: prefill, and the dense decode policy (SparQ in sparq.py, the baselines in policies.py)
# ---------------------------------------------------------------------------------------------


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
    """How one layer attends during single-token decode (dense here; SparQ in sparq.py; the baselines
    and the registry of policies in policies.py).

    forward(q (B, n_kv, g, d), cache, length) -> (B, n_kv, g, d) attends to cache.view(length):
    exactly the live positions (the current token included) when cache.length_bucket is 1, else the
    live ones (cache.live_length) and masked ones up to the bucket's end; a window layer's cache
    shows only its last positions.
    """

    name = "policy"
    follows_rows = True  # stateless across steps: the cache's per-row operations (truncate, reset) need nothing

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None,
                        lengths: Optional[Tensor] = None, window: Optional[int] = None) -> None:
        """Called after each prefill chunk with its queries q (B, H, T, d) at the last T positions and
        every key so far k (B, n_kv, S, d); stateful policies (H2O) use it. memo: shared by policies
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


def stored_bytes(elements: int, positions: int, rows: int, head_dim: int, fmt: KVFormat,
                 activation: torch.dtype) -> float:
    """`elements` moved per KV head in bytes as `fmt` stores them, `positions` x `rows` of them step 1's
    K^T elements (at K^T's size, plus one scale per position), the rest K and V elements (plus one
    scale per row of head_dim)."""
    kt = positions * rows
    rest = elements - kt
    return (kt * fmt.kt_bytes_per_element(activation) + positions * fmt.kt_scale_bytes(activation)
            + rest * fmt.bytes_per_element(activation) + rest / head_dim * fmt.row_scale_bytes(activation))


def dense_decode(attend: Callable, fused: bool, q: Tensor, cache: KVCache, length: int) -> Tensor:
    """Dense attention of q (B, n_kv, g, d) over cache.view(length) with `attend`: a fused kernel reads
    the cache as stored (an int8 one with its scales), the torch path the values in the activations' dtype."""
    view = cache.view(length, q.shape[0], stored=fused)
    if view.scales is not None and view.scales.k_scale is not None:  # int8 K and V (a quantized K^T is not read)
        return attend(q, view.k, view.v, view.length, view.live_length, scales=view.scales)
    return attend(q, view.k, view.v, view.length, view.live_length)


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


# ---------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), in fp32 (offset 1: Gemma's parametrisation)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (GPT-NeoX), in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def make_norm(args: ModelArgs, dim: Optional[int] = None) -> nn.Module:
    dim = args.dim if dim is None else dim
    return RMSNorm(dim, args.norm_eps, args.norm_offset) if args.norm == "rms" else LayerNorm(dim, args.norm_eps)


def rope_frequencies(head_dim: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """Inverse frequencies (head_dim/2,) fp32; Llama 3.1 ("llama3") or linear scaling when asked."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type != "llama3":
        raise CheckpointError(f"unsupported rope scaling {scaling}")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(is_medium, medium, scaled).float()


def rope_cache(rotary_dim: int, base: float, scaling: Optional[dict], max_seq_length: int) -> Tensor:
    """cos and sin for every position: (max_seq_length, 2, rotary_dim/2) fp32."""
    positions = torch.arange(max_seq_length, dtype=torch.float32)
    angles = torch.outer(positions, rope_frequencies(rotary_dim, base, scaling))  # (S, rotary_dim/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate-half RoPE (the HF layout) on the first rotary_dim dims of each head, the rest passing
    through (partial RoPE). x (B, T, heads, d); rope (T, 2, rotary_dim/2), or (B, T, 2, rotary_dim/2)
    when rows are at different positions."""
    rotary_dim = 2 * rope.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    cos = rope[..., 0, :].unsqueeze(-2)  # ([B,] T, 1, rotary_dim/2)
    sin = rope[..., 1, :].unsqueeze(-2)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if x_pass.shape[-1] == 0 else torch.cat([rotated, x_pass], dim=-1)


class Linear(nn.Linear):
    """nn.Linear whose matmul is the run's linear kernel (Kernels.linear: the fused CPU GEMV for
    decode steps), F.linear by default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernels: Kernels = TORCH_KERNELS):
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = kernels.linear or F.linear

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, kernels: Kernels):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        self.window = args.window(layer)
        self.cap = args.attn_softcap
        # The kernels scale scores by head_dim ** -0.5; another scale is folded into q.
        self.q_scale = 1.0 if args.attn_scale is None else args.attn_scale * math.sqrt(args.head_dim)
        qkv_dim = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim, bias=args.qkv_bias, kernels=kernels)
        self.wo = Linear(args.n_head * args.head_dim, args.dim, bias=args.out_bias, kernels=kernels)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.kv_cache: Optional[KVCache] = None
        self.decode_attention: DecodePolicy = DenseDecode(kernels, self.cap)
        self.prefill_kernel = kernels.prefill_attention  # None: prefill_attention (SDPA)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, kv_end: int,
                prompt_lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
        """x (B, T, D) at positions input_pos, attending to cache positions below kv_end (see
        Transformer.forward, which also says what prompt_lengths and row are)."""
        B, T, _ = x.shape
        H, n_kv, d = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.wqkv(x).split([H * d, n_kv * d, n_kv * d], dim=-1)
        q, k = q.view(B, T, H, d), k.view(B, T, n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, n_kv, d).transpose(1, 2)  # (B, heads, T, d)
        self.kv_cache.update(input_pos, k, v, row, prompt_lengths)
        if T > 1 and input_pos.dim() == 2:  # T queries per row at its own positions: speculative verification
            q = q.view(B, n_kv, H // n_kv, T, d)
            y = self.decode_attention.verify(q, self.kv_cache, kv_end).view(B, H, T, d)
        elif T > 1 or row is not None:  # a prefill chunk (of one row: even one token): positions [kv_end - T, kv_end)
            rows = slice(0, B) if row is None else slice(row, row + 1)  # the cache rows of x's rows
            k_start = 0 if self.window is None else max(0, kv_end - T - self.window + 1)
            keys, values = self.kv_cache.read(rows, k_start, kv_end)
            y = self.prefill(q, keys, values, kv_end - T)  # (B, H, T, d)
            self.decode_attention.observe_prefill(q, self.kv_cache.read(rows, 0, kv_end)[0], lengths=prompt_lengths,
                                                   window=self.window)
        else:  # a decode step reads kv_end positions
            q = q.view(B, n_kv, H // n_kv, d)  # query heads grouped by the KV head they share
            y = self.decode_attention(q, self.kv_cache, kv_end).view(B, H, 1, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * d))


    def prefill(self, q: Tensor, keys: Tensor, values: Tensor, q_start: int) -> Tensor:
        """prefill_attention, through the run's kernel where it serves (no window, no soft-cap, no autograd)."""
        if self.prefill_kernel is not None and self.window is None and self.cap is None and not q.requires_grad:
            return self.prefill_kernel(q, keys, values)
        return prefill_attention(q, keys, values, q_start, self.window, self.cap)


class FeedForward(nn.Module):
    """gated: w2(act(gate) * up), [gate | up] = w13 x (SwiGLU, GeGLU); plain: w2(act(w1 x)) (GPT-NeoX).
    A gated MLP's two input projections are one matrix, w13 = [w1; w3], as wqkv is three: a decode step
    makes one GEMV call for both (one dispatch, one parallel region, x quantized once)."""

    def __init__(self, args: ModelArgs, kernels: Kernels):
        super().__init__()
        self.act = ACTIVATIONS[args.activation]
        hidden, gated = args.intermediate_size, args.mlp == "gated"
        self.w13 = Linear(args.dim, 2 * hidden, bias=args.mlp_bias, kernels=kernels) if gated else None  # [gate; up]
        self.w1 = None if gated else Linear(args.dim, hidden, bias=args.mlp_bias, kernels=kernels)  # up
        self.w2 = Linear(hidden, args.dim, bias=args.mlp_bias, kernels=kernels)  # down

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is None:
            return self.w2(self.act(self.w1(x)))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.act(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, kernels: Kernels):
        super().__init__()
        self.parallel_residual = args.parallel_residual
        self.attention_norm = make_norm(args)
        self.attention = Attention(args, layer, kernels)
        self.ffn_norm = make_norm(args)
        self.feed_forward = FeedForward(args, kernels)
        self.post_attention_norm = make_norm(args) if args.sandwich_norms else None
        self.post_ffn_norm = make_norm(args) if args.sandwich_norms else None

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, kv_end: int,
                prompt_lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
        a = self.attention(self.attention_norm(x), rope, input_pos, kv_end, prompt_lengths, row)
        if self.parallel_residual:
            return x + a + self.feed_forward(self.ffn_norm(x))
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return h + f


class Transformer(nn.Module):
    """The model. `kernels` (kernels.resolve_kernels) are the run's decode kernels: every linear layer
    and the default dense decode attention call them; decode policies get them when they are built."""

    def __init__(self, args: ModelArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.args = args
        self.kernels = kernels
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i, kernels) for i in range(args.n_layer))
        self.norm = make_norm(args)
        self.output = Linear(args.dim, args.vocab_size, kernels=kernels)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(0), persistent=False)  # global layers
        self.register_buffer("rope_local", torch.empty(0), persistent=False)  # window layers
        self.activation_dtype = torch.float32  # quantized embeddings dequantize to this (load_model's dtype)
        self.max_batch_size = -1
        self.max_seq_length = -1

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV caches' (and activations') dtype: the embedding's; for quantized embeddings the dtype
        load_model was asked for (activation_dtype)."""
        weight = self.tok_embeddings.weight  # None: a quantized embedding reading the head's rows16 tensors
        floating = weight is not None and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return weight.dtype if floating else self.activation_dtype

    @staticmethod
    def cache_bytes(args: ModelArgs, batch: int, seq_len: int, fmt: KVFormat, dtype: torch.dtype) -> int:
        """Bytes setup_caches(batch, seq_len, fmt) allocates with activations in `dtype` (K, V, K^T, their
        scales, the sums): one layer's KVCache built on the meta device (nothing allocated), per layer."""
        with torch.device("meta"):
            cache = KVCache(batch, Transformer.allocated_length(seq_len), args.n_kv_head, args.head_dim, dtype, fmt.layout,
                            kv_dtype=fmt.kv_dtype, kt_dtype=fmt.kt_dtype)
        return cache.nbytes() * args.n_layer

    CACHE_ALIGN = 64  # cache positions are allocated in multiples of this: K^T rows stay 16-byte aligned

    @staticmethod
    def allocated_length(max_seq_length: int) -> int:
        """The positions setup_caches allocates for max_seq_length: rounded up to CACHE_ALIGN."""
        return -(-max_seq_length // Transformer.CACHE_ALIGN) * Transformer.CACHE_ALIGN

    def setup_caches(self, max_batch_size: int, max_seq_length: int, kv_format: KVFormat = KVFormat(),
                     length_bucket: int = 1) -> None:
        """Allocate the static KV caches (stored as kv_format says, on the model's device) for at least
        max_seq_length positions, rounded up to CACHE_ALIGN so that every row of K^T starts 16-byte
        aligned (vectorised loads); see KVCache for length_bucket."""
        args, dtype = self.args, self.cache_dtype
        allocated = self.allocated_length(max_seq_length)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = KVCache(max_batch_size, allocated, args.n_kv_head, args.head_dim, dtype,
                                               kv_format.layout, length_bucket, args.window(i), kv_format.kv_dtype,
                                               kv_format.kt_dtype).to(self.device)
        rotary_dim = args.rotary_dim or args.head_dim
        self.rope = rope_cache(rotary_dim, args.rope_base, args.rope_scaling, allocated).to(self.device)
        if args.rope_local_base is not None:
            self.rope_local = rope_cache(rotary_dim, args.rope_local_base, None, allocated).to(self.device)

    @property
    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers]

    def reset_caches(self) -> None:
        for cache in self.caches:
            cache.reset()

    def save_caches(self) -> list[dict]:
        """Every layer's cache state (KVCache.snapshot): restore_caches(saved) rewinds to it."""
        return [cache.snapshot() for cache in self.caches]

    def restore_caches(self, saved: list[dict]) -> None:
        for cache, snapshot in zip(self.caches, saved, strict=True):
            cache.restore(snapshot)

    @contextmanager
    def preserved_caches(self):
        """`with model.preserved_caches(): ...` runs the block (warm-ups, timed decodes) and leaves
        every cache as it found it, also when the block raises."""
        saved = self.save_caches()
        try:
            yield
        finally:
            self.restore_caches(saved)

    def read_length(self, live_length: int) -> int:
        """Cache positions decode attention reads at this live length (the caches' length bucket). Called
        every decode step: the first layer's cache directly, not the `caches` list built over every layer."""
        return self.layers[0].attention.kv_cache.read_length(live_length)

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def set_decode_attention(self, make_policy: Callable[[int], DecodePolicy]) -> None:
        """Give every layer its own decode attention policy: make_policy(layer_index) -> module."""
        for i, layer in enumerate(self.layers):
            layer.attention.decode_attention = make_policy(i)

    def decode_kv_bytes(self, seq_len: int, batch_size: int, policies: Optional[list[DecodePolicy]] = None) -> int:
        """KV-cache bytes one decode step moves at live length seq_len: each layer's policy (default: the
        installed ones) by its transfer formula over the positions the layer sees (min(S, window))."""
        total = 0
        for i, layer in enumerate(self.layers):
            policy = layer.attention.decode_attention if policies is None else policies[i]
            cache = layer.attention.kv_cache
            per_head = policy.transfer_bytes(cache.visible_length(seq_len), self.args.head_dim, cache.format,
                                             cache.dtype)
            total += per_head * self.args.n_kv_head * batch_size
        return round(total)

    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads: parameters and weight buffers (packed quantized
        weights included), tied tensors once; the KV caches and the RoPE tables excluded."""
        tensors = {}
        for module in self.modules():
            if isinstance(module, KVCache):
                continue
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if t is not None and t is not self.rope and t is not self.rope_local:
                    tensors[id(t)] = t
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def truncate_row(self, row: int, length: int) -> None:
        """Batch row `row` keeps its first `length` positions in every cache (rejected speculative
        tokens, a shared prefix); the other rows keep their state."""
        self.check_row_operations()
        for cache in self.caches:
            cache.truncate(row, length)

    def reset_row(self, row: int) -> None:
        """Empty batch row `row` of every cache (a finished request's row, free for the next); the other
        rows keep their state."""
        self.check_row_operations()
        for cache in self.caches:
            cache.reset(row)

    def check_row_operations(self) -> None:
        """ValueError (one line) when the installed policies cannot follow per-row operations."""
        for layer in self.layers:
            policy = layer.attention.decode_attention
            if not policy.follows_rows:
                raise ValueError(f"{policy.name} attention keeps per-row state its decode steps build up, which "
                                 f"truncating or refilling one row would leave stale: it does not support row operations")

    def set_live_lengths(self, lengths: Tensor) -> None:
        """Ragged rows (batches of different prompts): row b's positions [0, lengths[b]) are live in
        every cache, whatever a right-padded prefill wrote beyond them."""
        for cache in self.caches:
            cache.set_live_lengths(lengths)

    def forward(self, idx: Tensor, input_pos: Tensor, kv_end: int, prompt_lengths: Optional[Tensor] = None,
                row: Optional[int] = None, every_position: bool = False) -> Tensor:
        """idx (B, T) tokens at positions input_pos: (T,) for every row, or (B, T) per row (ragged
        rows decode at their own positions). Attention reads cache positions [0, kv_end): a decode
        step (T = 1) reads kv_end positions (the longest row's live length after this step, rounded
        up to the caches' length_bucket: read_length); a prefill chunk (T > 1) sits at positions
        [kv_end - T, kv_end) and attends causally to everything before its end.

        prompt_lengths (B,): a prefill chunk of a right-padded batch of prompts of these lengths
        (ragged rows); the logits are then row b's at its last real token when the chunk holds it
        (clamped into the chunk otherwise), and stateful policies learn which queries are padding.

        row: a prefill chunk (B = 1) into batch row `row` of the caches, the other rows keeping their
        state (prefill into a row that truncate_row or reset_row freed: speculation, a server's new request).

        Speculative verification: idx (B, T) at per-row positions input_pos (B, T), each row's next T
        positions, read as T decode queries (DecodePolicy.verify); every_position: logits (B, T, vocab).

        Returns logits (B, vocab) in fp32 for the last position (or each row's last real one).
        """
        if row is not None:
            self.check_row_operations()
        rope = self.rope[input_pos]  # (T, 2, rotary_dim/2)
        rope_local = self.rope_local[input_pos] if self.args.rope_local_base is not None else rope
        x = self.tok_embeddings(idx).to(self.cache_dtype)  # quantized embeddings dequantize in fp32
        if self.args.embedding_scale is not None:
            x = x * torch.tensor(self.args.embedding_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope_local if self.args.layer_kind(i) == "window" else rope, input_pos, kv_end, prompt_lengths,
                      row)
        if every_position:
            pass
        elif prompt_lengths is None:
            x = x[:, -1]
        else:
            T = idx.shape[1]
            last = (prompt_lengths - 1 - (kv_end - T)).clamp(0, T - 1)  # each row's last real token in this chunk
            x = x[torch.arange(x.shape[0], device=x.device), last]
        return softcap(self.output(self.norm(x)).float(), self.args.final_softcap)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedLoading:
    """How load_model reads a quantized checkpoint: quantize.LOADING provides it (model.py knows no format)."""

    prepare: Callable[[Transformer, dict], None]  # swap in the modules the file holds (meta model, its metadata)
    finalize: Callable[[Transformer, Kernels], None]  # once on the device: pick their kernels, pack the weights


def checkpoint_paths(checkpoint: Path | str) -> tuple[Path, Path]:
    """(model.pth, its directory) for a checkpoint given as a file or a directory."""
    path = Path(checkpoint)
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path, path.parent


def load_state_dict(path: Path) -> dict:
    """A state dict saved with torch.save (memory-mapped), or CheckpointError in one line."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises many kinds of errors for a damaged file
        raise CheckpointError(f"corrupt checkpoint {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: not a state dict")
    return fuse_gated_mlp(state)


_GATED_UP = re.compile(r"(layers\.\d+\.feed_forward\.)w3\.(\w+)")


def fuse_gated_mlp(state: dict) -> dict:
    """A checkpoint written before a gated MLP's w1 and w3 became one matrix (FeedForward.w13): each of
    their tensors (float, or quantize.py's, all per output row) stacked as w13's [w1; w3]."""
    for up in [m for m in map(_GATED_UP.fullmatch, state) if m is not None]:  # a list: state changes below
        prefix, tensor = up.groups()
        state[f"{prefix}w13.{tensor}"] = torch.cat([state.pop(f"{prefix}w1.{tensor}"), state.pop(up.string)])
    return state


def random_model(args: ModelArgs, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 kernels: Kernels = TORCH_KERNELS, seed: int = 0) -> Transformer:
    """The Transformer of `args` with random weights (N(0, 0.02), norms 1, biases 0), built directly
    in `dtype` on `device` (a 7B model never passes through host memory in fp32)."""
    with torch.device("meta"):
        model = Transformer(args, kernels)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0 - args.norm_offset)
    model.rope = model.rope_local = torch.empty(0, device=device)
    model.activation_dtype = dtype
    return model.eval()


def load_model(checkpoint: Path | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               kernels: Kernels = TORCH_KERNELS, quantized: Optional[QuantizedLoading] = None) -> Transformer:
    """Build the model from config.json and load model.pth (a state dict saved by the converter or
    by quantize.py: pass quantized=quantize.LOADING to read the latter)."""
    path, directory = checkpoint_paths(checkpoint)
    args = ModelArgs.from_json(directory / "config.json")
    state = load_state_dict(path)
    with torch.device("meta"):
        model = Transformer(args, kernels)
    quantization = state.pop("__quantization__", None)
    if quantization is not None:
        if quantized is None:
            raise CheckpointError(f"{path} is a quantized checkpoint: load it with quantized=quantize.LOADING")
        quantized.prepare(model, quantization)
    if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]  # tied: the converter omits it
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not match its config.json: {str(e).splitlines()[0]}") from None
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = model.rope_local = torch.empty(0)
    floating = {name for name, p in model.named_parameters() if p.is_floating_point()}
    model = model.to(device=device)
    for name, p in model.named_parameters():
        if name in floating:
            p.data = p.data.to(dtype)
    model.activation_dtype = dtype
    if quantization is not None:
        quantized.finalize(model, kernels)  # pick the kernels and pack the weights for `device`
    return model.eval()
