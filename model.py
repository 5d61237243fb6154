"""A minimal decoder-only transformer for the Llama, Qwen, Gemma and GPT-NeoX families. Its KV cache
is cache.py's; how a layer attends during decode is its DecodePolicy (attention.py: dense by default).

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
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attention import DecodePolicy, DenseDecode, prefill_attention, softcap
from cache import KVCache, KVFormat
from cli import UserError
from kernels import TORCH_KERNELS, Kernels


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or of an unsupported kind (a user error)."""


NORMS = ("rms", "layer")
MLPS = ("gated", "plain")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
LAYER_KINDS = ("global", "window")
# What a forward pass is, chosen by its caller (Transformer.prefill / decode / verify), never by its shapes
PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


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

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, kv_end: int, phase: str,
                prompt_lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
        """x (B, T, D) at positions input_pos, attending to cache positions below kv_end, as `phase` says
        (see Transformer.forward, which also says what prompt_lengths and row are)."""
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
        if phase == DECODE:
            y = self.decode(q, kv_end)
        elif phase == VERIFY:
            y = self.verify(q, kv_end)
        else:
            y = self.prefill_chunk(q, kv_end, prompt_lengths, row)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * d))

    def decode(self, q: Tensor, kv_end: int) -> Tensor:
        """One query per row, q (B, H, 1, d), by the layer's decode policy over kv_end positions."""
        B, H, _, d = q.shape
        q = q.view(B, self.n_kv_head, H // self.n_kv_head, d)  # query heads grouped by the KV head they share
        return self.decode_attention(q, self.kv_cache, kv_end).view(B, H, 1, d)

    def verify(self, q: Tensor, kv_end: int) -> Tensor:
        """T queries per row at its own next T positions (speculative verification), q (B, H, T, d): each
        read as a decode query by the policy's verify (DecodePolicy.verify)."""
        B, H, T, d = q.shape
        q = q.view(B, self.n_kv_head, H // self.n_kv_head, T, d)
        return self.decode_attention.verify(q, self.kv_cache, kv_end).view(B, H, T, d)

    def prefill_chunk(self, q: Tensor, kv_end: int, prompt_lengths: Optional[Tensor], row: Optional[int]) -> Tensor:
        """A prefill chunk's T queries at positions [kv_end - T, kv_end), q (B, H, T, d), attending causally
        (on a window layer, to the window) to what the cache holds of its rows (x's rows, or batch row
        `row` alone). A policy that learns from the prefill (DecodePolicy.observes_prefill: H2O) is then
        shown every key so far; no other pays that read."""
        B, T = q.shape[0], q.shape[2]
        rows = slice(0, B) if row is None else slice(row, row + 1)  # the cache rows of x's rows
        k_start = 0 if self.window is None else max(0, kv_end - T - self.window + 1)
        keys, values = self.kv_cache.read(rows, k_start, kv_end)
        y = self.prefill(q, keys, values, kv_end - T)  # (B, H, T, d)
        if self.decode_attention.observes_prefill:
            every_key = keys if k_start == 0 else self.kv_cache.read(rows, 0, kv_end)[0]
            self.decode_attention.observe_prefill(q, every_key, lengths=prompt_lengths, window=self.window)
        return y

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

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, kv_end: int, phase: str,
                prompt_lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
        a = self.attention(self.attention_norm(x), rope, input_pos, kv_end, phase, prompt_lengths, row)
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

    def use_kernels(self, kernels: Kernels) -> None:
        """Run `kernels` from the next call on: every float linear layer and the prefill attention take them (a
        server that served on the torch kernels while the fused ones built, serve.py). The decode policies bind
        theirs when they are made: install them again (policies.install_policy). Quantized linears keep what
        QuantizedLoading.finalize picked and packed their weights for at load: a float model's call."""
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul = kernels.linear or F.linear
            elif isinstance(module, Attention):
                module.prefill_kernel = kernels.prefill_attention

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
                            kv_dtype=fmt.kv_dtype, kt_dtype=fmt.kt_dtype, kt_scale_dtype=fmt.kt_scale_dtype)
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
                                               kv_format.kt_dtype, kv_format.kt_scale_dtype).to(self.device)
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

    def rows_state(self, rows: list[int]) -> list[dict]:
        """Copies of these batch rows' running sums and live lengths in every cache, for restore_rows_state to
        put back bit for bit: a server's decode step writes a scratch token into the rows among its bucket that
        do not decode (their positions past the live length are never read)."""
        return [cache.row_state(rows) for cache in self.caches]

    def restore_rows_state(self, state: list[dict]) -> None:
        for cache, rows in zip(self.caches, state, strict=True):
            cache.restore_row_state(rows)

    def keep_prefix(self, row: int, length: int, piece: int) -> None:
        """Batch row `row` keeps its first `length` positions in every cache, their running sums as a prefill
        in pieces of `piece` leaves them (KVCache.keep_prefix): a server's prefix reuse."""
        self.check_row_operations()
        for cache in self.caches:
            cache.keep_prefix(row, length, piece)

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

    def prefill(self, idx: Tensor, input_pos: Tensor, kv_end: int, prompt_lengths: Optional[Tensor] = None,
                row: Optional[int] = None, every_position: bool = False) -> Tensor:
        """A prefill chunk: idx (B, T) at positions input_pos = [kv_end - T, kv_end), attending causally to
        everything before its end -> logits (B, vocab) of its last position (every_position: (B, T, vocab)).

        prompt_lengths (B,): a chunk of a right-padded batch of prompts of these lengths (ragged rows); the
        logits are then row b's at its last real token when the chunk holds it (clamped into the chunk
        otherwise), and stateful policies learn which queries are padding.

        row: the chunk (B = 1, any T, one token included) goes into batch row `row` of the caches, the other
        rows keeping their state (a row that truncate_row or reset_row freed: a server's new request)."""
        return self(idx, input_pos, kv_end, PREFILL, prompt_lengths, row, every_position)

    def decode(self, idx: Tensor, input_pos: Tensor, kv_end: int) -> Tensor:
        """A decode step: idx (B, 1) at positions input_pos, (1,) for every row or (B, 1) per row (ragged rows
        decode at their own positions); attention (each layer's decode policy) reads cache positions [0,
        kv_end): the longest row's live length after this step, rounded up to the caches' length_bucket
        (read_length) -> logits (B, vocab)."""
        return self(idx, input_pos, kv_end, DECODE)

    def verify(self, idx: Tensor, input_pos: Tensor, kv_end: int) -> Tensor:
        """Speculative verification: idx (B, T) at per-row positions input_pos (B, T), each row's next T
        positions, read as T decode queries (DecodePolicy.verify) -> logits (B, T, vocab)."""
        return self(idx, input_pos, kv_end, VERIFY, every_position=True)

    def forward(self, idx: Tensor, input_pos: Tensor, kv_end: int, phase: str,
                prompt_lengths: Optional[Tensor] = None, row: Optional[int] = None,
                every_position: bool = False) -> Tensor:
        """The pass `phase` (PREFILL, DECODE or VERIFY) names, as prefill, decode and verify above describe:
        call those. Returns logits in fp32: the last position's (or each row's last real one), every
        position's with every_position."""
        if row is not None:
            self.check_row_operations()
        rope = self.rope[input_pos]  # (T, 2, rotary_dim/2)
        rope_local = self.rope_local[input_pos] if self.args.rope_local_base is not None else rope
        x = self.tok_embeddings(idx).to(self.cache_dtype)  # quantized embeddings dequantize in fp32
        if self.args.embedding_scale is not None:
            x = x * torch.tensor(self.args.embedding_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope_local if self.args.layer_kind(i) == "window" else rope, input_pos, kv_end, phase,
                      prompt_lengths, row)
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
        raise CheckpointError(f"checkpoint not found: {path} (convert a .gguf file or a Hugging Face directory with "
                              f"`python convert_hf_checkpoint.py SRC`, or give that to --checkpoint; the embedded "
                              f"model: `make model`)")
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
    if torch.device(device).type == "cpu":
        weights_on_huge_pages(model)
    return model.eval()


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # linux/mman.h


def _transparent_huge_pages() -> bool:
    """Whether this kernel backs memory advised MADV_HUGEPAGE with 2 MB pages ("always" or "madvise")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:  # not Linux, or no THP
        return False


def weights_on_huge_pages(model: nn.Module) -> None:
    """Copy a CPU model's parameters and buffers into one buffer advised as transparent huge pages.

    A decode step streams every weight once, a page after another: on 4 KB pages (glibc's heap, or the
    checkpoint's file mapping) each 4 KB costs a TLB miss and ends the hardware prefetcher's stream; on 2 MB
    pages a step's GEMVs ran faster (docs/NOTES.md, 'Figures behind the code's choices'). The buffer is
    advised before anything is written to it, so its pages fault in as
    2 MB pages. Values, dtypes and shapes stay; tied weights stay one tensor. A kernel without transparent
    huge pages, or a failed madvise, leaves the model as it was."""
    import ctypes

    if not _transparent_huge_pages():
        return
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = {}  # one slot per tensor (tied ones share it)
    tensors: dict[int, Tensor] = {}
    for module in model.modules():
        for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None and t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous():
                    tensors.setdefault(id(t), t)
                    slots.setdefault(id(t), []).append((module, name, is_parameter))
    sizes = {key: -(-t.numel() * t.element_size() // 64) * 64 for key, t in tensors.items()}
    if sum(sizes.values()) < HUGE_PAGE:
        return
    length = -(-sum(sizes.values()) // HUGE_PAGE) * HUGE_PAGE  # whole huge pages: the last weight's too
    arena = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    start = -arena.data_ptr() % HUGE_PAGE  # the first 2 MB boundary in it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(arena.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        return
    offset = start
    with torch.no_grad():
        for key in list(tensors):
            t = tensors.pop(key)  # the last reference here: each old tensor is freed once moved (peak: one copy)
            moved = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            moved.copy_(t)
            offset += sizes[key]
            del t
            for module, name, is_parameter in slots[key]:
                if is_parameter:
                    module._parameters[name].data = moved
                else:
                    module._buffers[name] = moved


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
    if torch.device(device).type == "cpu":
        weights_on_huge_pages(model)
    return model.eval()
