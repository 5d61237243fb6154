"""A minimal Llama-family transformer with a static, SparQ-ready KV cache.

Architectures: Llama 2, Llama 3 / 3.1, Mistral, SmolLM2 (RMSNorm, SwiGLU, RoPE, GQA).
The configuration always comes from the `config.json` written next to `model.pth` by
convert_hf_checkpoint.py.

Shapes: B batch, T new tokens, S cache positions, H query heads, n_kv KV heads,
g = H // n_kv query heads per KV head, d head dim, D model dim.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cli import UserError
from kernels import TORCH_KERNELS, Kernels


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or of an unsupported kind (a user error)."""


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
    rope_scaling: Optional[dict] = None  # Llama 3.1: {"rope_type": "llama3", "factor", ...}
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_context: int = 4096
    architecture: str = "llama"  # informational: llama | mistral
    bos_id: Optional[int] = None
    eos_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.n_head % self.n_kv_head:
            raise CheckpointError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head

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


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


class KVCache(nn.Module):
    """Static cache, preallocated for (max_batch, max_seq_length), written in place.

    k     (B, n_kv, S_max, d)  d-contiguous: rows gathered by SparQ step 2 and by dense attention
    k_t   (B, n_kv, d, S_max)  S-contiguous: the r rows SparQ step 1 reads (absent with layout "once")
    v     (B, n_kv, S_max, d)
    v_sum (B, n_kv, d) fp32    running sum of V over the live positions (SparQ mean-V)
    live_length ()  int64      positions [0, live_length) are live: a device tensor, so a step
                               never syncs with the host

    length_bucket: decode attention reads `read_length(live)` positions, the live length rounded up
    to a multiple of length_bucket. With 1 (CPU) it reads exactly the live prefix and needs no
    mask; with larger buckets (CUDA graphs: one graph per bucket, not per length) the positions
    from live_length to the read length are masked (`masked_live_length`).

    Only this class names its buffers: the rest of the repo uses the methods below.
    """

    def __init__(self, max_batch: int, max_seq_length: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, layout: str = "twice", length_bucket: int = 1):
        super().__init__()
        if layout not in ("twice", "once"):
            raise ValueError(f"unknown KV layout {layout!r} (expected 'twice' or 'once')")
        self.layout = layout
        self.length_bucket = length_bucket
        shape = (max_batch, n_kv_head, max_seq_length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)
        k_t = torch.zeros((max_batch, n_kv_head, head_dim, max_seq_length), dtype=dtype) if layout == "twice" else None
        self.register_buffer("k_t", k_t, persistent=False)
        self.register_buffer("v_sum", torch.zeros((max_batch, n_kv_head, head_dim), dtype=torch.float32),
                             persistent=False)
        self.register_buffer("live_length", torch.zeros((), dtype=torch.long), persistent=False)

    @property
    def max_seq_length(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v (B, n_kv, T, d) at positions input_pos (T,). Positions must be new."""
        B, n_kv = k.shape[:2]
        # Advanced indexing on the whole buffers, not index_copy_ into a [:B] slice: with a dynamic
        # batch size torch.compile cannot write through that slice in place and copied every
        # cache buffer whole, several times per layer and step.
        rows = torch.arange(B, device=k.device).view(B, 1, 1)
        heads = torch.arange(n_kv, device=k.device).view(1, n_kv, 1)
        self.k[rows, heads, input_pos] = k  # indexes (B, n_kv, T) -> rows of d
        self.v[rows, heads, input_pos] = v
        if self.k_t is not None:
            self.k_t[rows, heads, :, input_pos] = k  # advanced indices first: the same (B, n_kv, T, d)
        self.v_sum[:B] += v.float().sum(dim=2)
        self.live_length.copy_(input_pos[-1] + 1)

    def read_length(self, live_length: int) -> int:
        """Positions decode attention reads at this live length: rounded up to the bucket, capped at S_max."""
        return min(-(-live_length // self.length_bucket) * self.length_bucket, self.max_seq_length)

    @property
    def masked_live_length(self) -> Optional[Tensor]:
        """None when reads are exact (bucket 1); else the live length (a device tensor) beyond which reads are masked."""
        return self.live_length if self.length_bucket > 1 else None

    def reset(self) -> None:
        for buffer in (self.k, self.v, self.k_t, self.v_sum, self.live_length):
            if buffer is not None:
                buffer.zero_()

    def snapshot(self) -> dict[str, Tensor]:
        """Copies of the state that is not indexed by position (running V sum, live length).

        Decode steps write K, K^T and V only at new positions, which are never read before being
        rewritten, so restore(snapshot) rewinds the cache exactly to when the snapshot was taken."""
        return {"v_sum": self.v_sum.clone(), "live_length": self.live_length.clone()}

    def restore(self, snapshot: dict[str, Tensor]) -> None:
        self.v_sum.copy_(snapshot["v_sum"])
        self.live_length.copy_(snapshot["live_length"])

    def rewind(self, length: int) -> None:
        """Keep positions [0, length) live, as if nothing after them had been written."""
        self.v_sum.copy_(self.v[:, :, :length].float().sum(dim=2))
        self.live_length.fill_(length)

    def broadcast_row(self, n_rows: int) -> None:
        """Copy batch row 0 into rows 1..n_rows-1 (every row then holds the same prompt)."""
        for buffer in (self.k, self.k_t, self.v, self.v_sum):
            if buffer is not None:
                buffer[1:n_rows].copy_(buffer[:1].expand_as(buffer[1:n_rows]))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.k, self.v, self.k_t, self.v_sum) if b is not None)


# ---------------------------------------------------------------------------------------------
# Decode attention: the dense policy lives here; SparQ and the baselines live in sparq.py
# ---------------------------------------------------------------------------------------------


def beyond_live(length: int, live_length: Tensor) -> Tensor:
    """(length,) True at the positions a bucketed read covers but that are not live yet."""
    return torch.arange(length, device=live_length.device) >= live_length


def dense_attention_torch(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Optional[Tensor] = None) -> Tensor:
    """Exact attention of one decode query over positions [0, length) of the cache.

    q (B, n_kv, g, d); k, v (B_max, n_kv, S_max, d) -> (B, n_kv, g, d); positions >= live_length
    are masked when it is given (bucketed reads). Matmul-softmax-matmul with fp32 softmax: on CPU
    it matches SDPA in fp32 and is several times faster in bf16.
    """
    B = q.shape[0]
    k, v = k[:B, :, :length], v[:B, :, :length]
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # (B, n_kv, g, S)
    if live_length is not None:
        scores = scores.masked_fill(beyond_live(length, live_length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return probs @ v


class DecodePolicy(nn.Module):
    """How one layer attends during single-token decode (dense here; SparQ and baselines in sparq.py,
    where the registry of policies lives).

    forward(q (B, n_kv, g, d), cache, length) -> (B, n_kv, g, d) reads positions [0, length)
    of the cache: exactly the live ones (the current token included) when cache.length_bucket
    is 1, else the live ones (cache.live_length) and masked ones up to the bucket's end.
    """

    name = "policy"

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None) -> None:
        """Called with the prefill's q (B, H, T, d) and k (B, n_kv, T, d); stateful policies (H2O) use it.
        memo: shared by policies observing the same prefill (eval.py), for work that does not depend
        on their settings."""

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Elements of K/V moved per KV head per decode step at live length seq_len."""
        raise NotImplementedError


class DenseDecode(DecodePolicy):
    """Dense decode attention that reads only the live prefix [0, length) of the cache."""

    name = "dense"

    def __init__(self, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.attend = kernels.dense_attention or dense_attention_torch

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        return self.attend(q, cache.k, cache.v, length, cache.masked_live_length)

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        """Paper, Appendix G: 2Sd + 2d (read K and V, write the new k and v)."""
        return 2 * seq_len * head_dim + 2 * head_dim


# ---------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_frequencies(head_dim: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """Inverse frequencies (head_dim/2,) fp32, with Llama 3.1 scaling when `scaling` asks for it."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq.float()
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
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


def rope_cache(args: ModelArgs, max_seq_length: int) -> Tensor:
    """cos and sin for every position: (max_seq_length, 2, d/2) fp32."""
    positions = torch.arange(max_seq_length, dtype=torch.float32)
    angles = torch.outer(positions, rope_frequencies(args.head_dim, args.rope_base, args.rope_scaling))  # (S, d/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate-half RoPE (the HF layout). x (B, T, heads, d); rope (T, 2, d/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos = rope[:, 0].unsqueeze(1)  # (T, 1, d/2)
    sin = rope[:, 1].unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear whose matmul is the run's linear kernel (Kernels.linear: the fused CPU GEMV for
    decode steps), F.linear by default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernels: Kernels = TORCH_KERNELS):
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = kernels.linear or F.linear

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        qkv_dim = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim, kernels=kernels)
        self.wo = Linear(args.n_head * args.head_dim, args.dim, kernels=kernels)
        self.kv_cache: Optional[KVCache] = None
        self.decode_attention: DecodePolicy = DenseDecode(kernels)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, length: int) -> Tensor:
        B, T, _ = x.shape
        H, n_kv, d = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.wqkv(x).split([H * d, n_kv * d, n_kv * d], dim=-1)
        q = apply_rope(q.view(B, T, H, d), rope)
        k = apply_rope(k.view(B, T, n_kv, d), rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, n_kv, d).transpose(1, 2)  # (B, heads, T, d)
        self.kv_cache.update(input_pos, k, v)
        if T > 1:
            # Prefill always starts at position 0, so it only attends within the new tokens.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != H)  # (B, H, T, d)
            self.decode_attention.observe_prefill(q, k)
        else:
            q = q.view(B, n_kv, H // n_kv, d)  # query heads grouped by the KV head they share
            y = self.decode_attention(q, self.kv_cache, length).view(B, H, 1, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * d))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels):
        super().__init__()
        self.w1 = Linear(args.dim, args.intermediate_size, kernels=kernels)  # gate
        self.w3 = Linear(args.dim, args.intermediate_size, kernels=kernels)  # up
        self.w2 = Linear(args.intermediate_size, args.dim, kernels=kernels)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, kernels)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args, kernels)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor, length: int) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, input_pos, length)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The model. `kernels` (kernels.resolve_kernels) are the run's decode kernels: every linear layer
    and the default dense decode attention call them; decode policies get them when they are built."""

    def __init__(self, args: ModelArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.args = args
        self.kernels = kernels
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, kernels) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, kernels=kernels)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.max_batch_size = -1
        self.max_seq_length = -1

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_caches(self, max_batch_size: int, max_seq_length: int, kv_layout: str = "twice",
                     length_bucket: int = 1) -> None:
        """Allocate the static KV caches (in the model's dtype, on its device); see KVCache for length_bucket."""
        dtype = self.tok_embeddings.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32  # quantized embeddings keep fp32 activations
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.args.n_kv_head,
                                               self.args.head_dim, dtype, kv_layout, length_bucket).to(self.device)
        self.rope = rope_cache(self.args, max_seq_length).to(self.device)

    @property
    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers]

    def reset_caches(self) -> None:
        for cache in self.caches:
            cache.reset()

    def read_length(self, live_length: int) -> int:
        """Cache positions decode attention reads at this live length (the caches' length bucket)."""
        return self.caches[0].read_length(live_length)

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def set_decode_attention(self, make_policy: Callable[[int], DecodePolicy]) -> None:
        """Give every layer its own decode attention policy: make_policy(layer_index) -> module."""
        for i, layer in enumerate(self.layers):
            layer.attention.decode_attention = make_policy(i)

    def decode_kv_bytes(self, seq_len: int, batch_size: int) -> int:
        """KV-cache bytes one decode step moves at live length seq_len, by each layer's policy's transfer formula."""
        total = 0
        for layer in self.layers:
            per_head = layer.attention.decode_attention.transfer_elements(seq_len, self.args.head_dim)
            total += per_head * self.args.n_kv_head * batch_size * layer.attention.kv_cache.k.element_size()
        return total

    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads: parameters and weight buffers (packed quantized
        weights included), tied tensors once; the KV caches and the RoPE table excluded."""
        tensors = {}
        for module in self.modules():
            if isinstance(module, KVCache):
                continue
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if t is not None and t is not self.rope:
                    tensors[id(t)] = t
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def forward(self, idx: Tensor, input_pos: Tensor, length: int) -> Tensor:
        """idx (B, T) tokens at positions input_pos (T,); length = cache positions decode attention reads:
        the live length after this step, rounded up to the caches' length_bucket (read_length).

        Returns logits (B, vocab) for the last position only, in fp32.
        """
        rope = self.rope[input_pos]  # (T, 2, d/2)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, rope, input_pos, length)
        x = self.norm(x[:, -1])
        return self.output(x).float()


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
    return state


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
    model.rope = torch.empty(0)
    floating = {name for name, p in model.named_parameters() if p.is_floating_point()}
    model = model.to(device=device)
    for name, p in model.named_parameters():
        if name in floating:
            p.data = p.data.to(dtype)
    if quantization is not None:
        quantized.finalize(model, kernels)  # pick the kernels and pack the weights for `device`
    return model.eval()
