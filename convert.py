"""Checkpoint conversion's shared machinery and the GGUF reader (convert_hf_checkpoint.py is the command
line and the Hugging Face reader): the targets, our tensor names with their shapes and how each is built
from a family's source tensors, planned and checked strictly; a llama.cpp GGUF file read into them (every
tensor dequantized to fp32 through `gguf`); and the writer of model.pth + config.json + the tokenizer.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

import cli
from model import ModelArgs, rope_frequencies

DEFAULT_OUT_ROOT = Path("checkpoints")


class ConversionError(cli.UserError):
    """A source that is missing, corrupt, inconsistent or unsupported (a user error)."""


# A target tensor: its name in our state dict, its expected shape, and how to build it from the
# source tensors (by name). `load` returns the source tensor, as stored, for a source name.
@dataclass
class Target:
    name: str
    shape: tuple[int, ...]
    sources: list[str]
    build: Callable[[list[Tensor]], Tensor]


def _single(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


# ---------------------------------------------------------------------------------------------
# Families: source tensor names by role, per format
# ---------------------------------------------------------------------------------------------
# Roles, per layer ({i}): attn_norm, q, k, v (or qkv, fused), o, q_norm, k_norm, post_attn_norm,
# ffn_norm, post_ffn_norm, gate, up, down; and embed, norm, output. A bias is the role with
# "_bias" (attn_norm_bias, q_bias, ...). Which roles a model has follows from its ModelArgs.

_GGUF = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "norm_bias": "output_norm.bias",
    "output": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "attn_norm_bias": "blk.{i}.attn_norm.bias",
    "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias", "k_bias": "blk.{i}.attn_k.bias", "v_bias": "blk.{i}.attn_v.bias",
    "qkv": "blk.{i}.attn_qkv.weight", "qkv_bias": "blk.{i}.attn_qkv.bias",
    "o": "blk.{i}.attn_output.weight", "o_bias": "blk.{i}.attn_output.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight", "ffn_norm_bias": "blk.{i}.ffn_norm.bias",
    "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
    "up_bias": "blk.{i}.ffn_up.bias", "down_bias": "blk.{i}.ffn_down.bias",
}


def roles(args: ModelArgs, fused_qkv: bool) -> tuple[list[str], list[str]]:
    """(global roles, per-layer roles) a model with these args has."""
    layer = ["attn_norm", "o", "ffn_norm", "up", "down"] + (["qkv"] if fused_qkv else ["q", "k", "v"])
    if args.norm == "layer":
        layer += ["attn_norm_bias", "ffn_norm_bias"]
    if args.qkv_bias:
        layer += ["qkv_bias"] if fused_qkv else ["q_bias", "k_bias", "v_bias"]
    if args.out_bias:
        layer.append("o_bias")
    if args.mlp_bias:
        layer += ["up_bias", "down_bias"]
    if args.mlp == "gated":
        layer.append("gate")
    if args.qk_norm:
        layer += ["q_norm", "k_norm"]
    if args.sandwich_norms:
        layer += ["post_attn_norm", "post_ffn_norm"]
    global_roles = ["embed", "norm"] + (["norm_bias"] if args.norm == "layer" else [])
    if not args.tie_embeddings:
        global_roles.append("output")
    return global_roles, layer


def source_shapes(args: ModelArgs, fused_qkv: bool) -> dict[str, tuple[int, ...]]:
    """The (PyTorch-order) shape of every role's tensor; per-layer roles are the same in each layer."""
    D, H, K, d, F, V = args.dim, args.n_head, args.n_kv_head, args.head_dim, args.intermediate_size, args.vocab_size
    return {"embed": (V, D), "norm": (D,), "norm_bias": (D,), "output": (V, D),
            "attn_norm": (D,), "attn_norm_bias": (D,), "q": (H * d, D), "k": (K * d, D), "v": (K * d, D),
            "q_bias": (H * d,), "k_bias": (K * d,), "v_bias": (K * d,), "qkv": (3 * H * d, D), "qkv_bias": (3 * H * d,),
            "o": (D, H * d), "o_bias": (D,), "q_norm": (d,), "k_norm": (d,), "post_attn_norm": (D,),
            "ffn_norm": (D,), "ffn_norm_bias": (D,), "post_ffn_norm": (D,),
            "gate": (F, D), "up": (F, D), "down": (D, F), "up_bias": (F,), "down_bias": (D,)}


def split_neox_qkv(w: Tensor, n_head: int) -> Tensor:
    """GPT-NeoX's fused query_key_value holds, per head, [q_h; k_h; v_h] (weight rows or bias):
    reorder to our [Q; K; V] (every q head, then every k head, then every v head)."""
    per_head = w.reshape(n_head, 3, -1, *w.shape[1:])  # (H, 3, d, ...)
    return per_head.transpose(0, 1).reshape(w.shape)


def plan_targets(args: ModelArgs, names: dict[str, str], fused_qkv: bool,
                 qk_transform: Callable[[Tensor, int], Tensor] = lambda w, heads: w) -> list[Target]:
    """Our tensors, in order, from the sources named by role (`names`, {i} = layer). qk_transform(w, heads)
    maps a source q or k weight to the rotate-half layout (GGUF llama: undo llama.cpp's permutation)."""
    D, H, K, d, F, V = args.dim, args.n_head, args.n_kv_head, args.head_dim, args.intermediate_size, args.vocab_size
    _, layer_roles = roles(args, fused_qkv)
    has = set(layer_roles)
    targets = [Target("tok_embeddings.weight", (V, D), [names["embed"]], _single)]
    for i in range(args.n_layer):
        src = {role: template.format(i=i) for role, template in names.items()}
        p = f"layers.{i}."

        if fused_qkv:  # GPT-NeoX: one fused tensor, per-head [q; k; v]
            qkv_weight = ([src["qkv"]], lambda t: split_neox_qkv(t[0], H))
            qkv_bias = ([src.get("qkv_bias")], lambda t: split_neox_qkv(t[0], H))
        else:
            qkv_weight = ([src["q"], src["k"], src["v"]],
                          lambda t: torch.cat([qk_transform(t[0], H), qk_transform(t[1], K), t[2]]))
            qkv_bias = ([src.get("q_bias"), src.get("k_bias"), src.get("v_bias")],
                        lambda t: torch.cat([qk_transform(t[0], H), qk_transform(t[1], K), t[2]]))
        targets.append(Target(p + "attention_norm.weight", (D,), [src["attn_norm"]], _single))
        if "attn_norm_bias" in has:
            targets.append(Target(p + "attention_norm.bias", (D,), [src["attn_norm_bias"]], _single))
        targets.append(Target(p + "attention.wqkv.weight", ((H + 2 * K) * d, D), *qkv_weight))
        if args.qkv_bias:
            targets.append(Target(p + "attention.wqkv.bias", ((H + 2 * K) * d,), *qkv_bias))
        if args.qk_norm:
            targets += [Target(p + "attention.q_norm.weight", (d,), [src["q_norm"]], _single),
                        Target(p + "attention.k_norm.weight", (d,), [src["k_norm"]], _single)]
        targets.append(Target(p + "attention.wo.weight", (D, H * d), [src["o"]], _single))
        if args.out_bias:
            targets.append(Target(p + "attention.wo.bias", (D,), [src["o_bias"]], _single))
        if args.sandwich_norms:
            targets += [Target(p + "post_attention_norm.weight", (D,), [src["post_attn_norm"]], _single),
                        Target(p + "post_ffn_norm.weight", (D,), [src["post_ffn_norm"]], _single)]
        targets.append(Target(p + "ffn_norm.weight", (D,), [src["ffn_norm"]], _single))
        if "ffn_norm_bias" in has:
            targets.append(Target(p + "ffn_norm.bias", (D,), [src["ffn_norm_bias"]], _single))
        if args.mlp == "gated":  # one matrix [gate; up] (model.FeedForward)
            targets.append(Target(p + "feed_forward.w13.weight", (2 * F, D), [src["gate"], src["up"]], torch.cat))
        else:
            targets.append(Target(p + "feed_forward.w1.weight", (F, D), [src["up"]], _single))
        targets.append(Target(p + "feed_forward.w2.weight", (D, F), [src["down"]], _single))
        if args.mlp_bias:
            targets += [Target(p + "feed_forward.w1.bias", (F,), [src["up_bias"]], _single),
                        Target(p + "feed_forward.w2.bias", (D,), [src["down_bias"]], _single)]
    targets.append(Target("norm.weight", (D,), [names["norm"]], _single))
    if args.norm == "layer":
        targets.append(Target("norm.bias", (D,), [names["norm_bias"]], _single))
    if not args.tie_embeddings:
        targets.append(Target("output.weight", (V, D), [names["output"]], _single))
    return targets


def check_sources(args: ModelArgs, names: dict[str, str], fused_qkv: bool, shapes: dict[str, tuple[int, ...]],
                  ignored: Callable[[str], bool], what: str) -> None:
    """Every expected tensor present with its shape, every other tensor explicitly ignored."""
    global_roles, layer_roles = roles(args, fused_qkv)
    role_shapes = source_shapes(args, fused_qkv)
    expected = {names[r]: role_shapes[r] for r in global_roles}
    for i in range(args.n_layer):
        expected.update({names[r].format(i=i): role_shapes[r] for r in layer_roles})
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{what}: missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ConversionError(f"{what}: tensor {name} has shape {_shape_str(shapes[name])}, "
                                  f"the config implies {_shape_str(shape)}")
    leftover = sorted(n for n in shapes if n not in expected and not ignored(n))
    if leftover:
        more = f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""
        raise ConversionError(f"{what}: unexpected tensor {leftover[0]}{more}; this architecture variant "
                              f"is not supported")


def build_state_dict(targets: list[Target], load: Callable[[str], Tensor], desc: str) -> dict[str, Tensor]:
    from tqdm import tqdm

    state = {}
    # disable=None: a bar on a terminal, nothing when stderr is a pipe or a file.
    for target in tqdm(targets, desc=desc, unit="tensor", disable=None):
        tensor = target.build([load(s) for s in target.sources]).contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view into a shared storage: save only this tensor's bytes
        if tuple(tensor.shape) != target.shape:  # the sources were checked; this guards the plumbing
            raise ConversionError(f"internal error: {target.name} has shape {_shape_str(tensor.shape)}, "
                                  f"expected {_shape_str(target.shape)}")
        state[target.name] = tensor
    return state


# ---------------------------------------------------------------------------------------------
# GGUF files (llama.cpp)
# ---------------------------------------------------------------------------------------------

GGUF_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 GGUFs store the llama3 rope factors as a tensor


@dataclass(frozen=True)
class GGUFArch:
    """What an architecture llama.cpp writes needs beyond the common keys (`{arch}.block_count`...).

    llama.cpp permutes q/k rows into interleaved RoPE pairs for llama only (its converter's
    LlamaModel); the others keep HF's rotate-half rows. It stores Gemma's RMSNorm weights with the
    +1 already added, so they load with norm_offset 0; Gemma's embedding scale, sliding-window
    pattern and local RoPE base are not in the file: llama.cpp (and transformers' GGUF loader)
    take them from the family, as done here.
    """

    family: str  # ModelArgs.architecture
    switches: Callable[[Callable, dict], dict] = lambda field_, shapes: {}  # extra ModelArgs fields
    permuted_qk: bool = False
    fused_qkv: bool = False


def _gguf_gemma(version: int) -> Callable[[Callable, dict], dict]:
    def switches(field_, shapes) -> dict:
        dim, n_layer = int(field_("embedding_length")), int(field_("block_count"))
        out = {"embedding_scale": math.sqrt(dim), "activation": "gelu_tanh"}
        if version >= 2:
            pattern = 2 if version == 2 else 6  # every 2nd (Gemma 2) / 6th (Gemma 3) layer is global
            window = field_("attention.sliding_window")
            out.update(sandwich_norms=True, attn_softcap=field_("attn_logit_softcapping"),
                       final_softcap=field_("final_logit_softcapping"))
            if window:
                out.update(sliding_window=int(window),
                           layer_types=["global" if (i + 1) % pattern == 0 else "window" for i in range(n_layer)])
        if version == 3:
            out.update(qk_norm=True, rope_local_base=10000.0)
            if field_("rope.scaling.type") == "linear":
                out["rope_scaling"] = {"rope_type": "linear", "factor": float(field_("rope.scaling.factor"))}
        return out
    return switches


def _gguf_neox(field_, shapes) -> dict:
    head_dim = int(field_("embedding_length")) // int(field_("attention.head_count"))
    return {"norm": "layer", "norm_eps": float(field_("attention.layer_norm_epsilon")), "mlp": "plain",
            "qkv_bias": True, "out_bias": True, "mlp_bias": True, "activation": "gelu",
            "parallel_residual": bool(field_("use_parallel_residual", True)),
            "rotary_dim": int(field_("rope.dimension_count", head_dim))}


GGUF_ARCHS = {
    "llama": GGUFArch("llama", permuted_qk=True),
    "qwen2": GGUFArch("qwen2", lambda f, shapes: {"qkv_bias": True}),
    "qwen3": GGUFArch("qwen3", lambda f, shapes: {"qk_norm": True}),
    "gemma": GGUFArch("gemma", _gguf_gemma(1)),
    "gemma2": GGUFArch("gemma2", _gguf_gemma(2)),
    "gemma3": GGUFArch("gemma3", _gguf_gemma(3)),
    "gptneox": GGUFArch("gpt_neox", _gguf_neox, fused_qkv=True),
}


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs) back to HF's rotate-half rows.

    llama.cpp: w.reshape(n_heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape), i.e. row
    2j (resp. 2j+1) of a head holds HF row j (resp. j + head_dim/2). The inverse swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_field(reader, key: str, default=None):
    field_ = reader.fields.get(key)
    if field_ is None:
        return default
    try:
        return field_.contents()
    except Exception as e:
        raise ConversionError(f"corrupt GGUF metadata {key}: {e}") from None


def _llama3_rope_from_freqs(freqs: Tensor, rope_base: float, head_dim: int) -> dict:
    """Recover Llama 3.1-style rope scaling parameters from llama.cpp's rope_freqs tensor, which holds
    the factor each inverse frequency is divided by."""
    unscaled = rope_frequencies(head_dim, rope_base)
    factor = float(freqs.max())
    for original in (8192, 4096, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                       "original_max_position_embeddings": original}
            expected = unscaled / rope_frequencies(head_dim, rope_base, scaling)
            if torch.allclose(expected, freqs.float(), rtol=1e-4, atol=1e-4):
                return scaling
    raise ConversionError("unsupported rope_freqs tensor: not a recognisable Llama 3.1 rope scaling")


def gguf_model_args(reader, tensor_shapes: dict[str, tuple[int, ...]], path: Path) -> tuple[ModelArgs, GGUFArch]:
    arch_name = _gguf_field(reader, "general.architecture")
    if arch_name not in GGUF_ARCHS:
        raise ConversionError(f"unsupported GGUF architecture {arch_name!r} (supported: {', '.join(GGUF_ARCHS)})")
    arch = GGUF_ARCHS[arch_name]

    def field_(key, default=None):
        return _gguf_field(reader, f"{arch_name}.{key}", default)

    def need(key):
        value = field_(key)
        if value is None:
            raise ConversionError(f"GGUF file {path} lacks {arch_name}.{key}")
        return value

    dim, n_head = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(field_("attention.head_count_kv", n_head))
    head_dim = int(field_("attention.key_length", dim // n_head))
    if arch_name != "gptneox" and int(field_("rope.dimension_count", head_dim)) != head_dim:
        raise ConversionError("unsupported: rope.dimension_count differs from the head dim (partial RoPE)")
    vocab = field_("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConversionError(f"GGUF file {path} has neither {arch_name}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    scaling_type = field_("rope.scaling.type", "none")
    if scaling_type not in ("none", None) and not (arch_name == "gemma3" and scaling_type == "linear"):
        raise ConversionError(f"unsupported GGUF rope scaling {scaling_type!r}")
    if field_("expert_count", 0):
        raise ConversionError("unsupported: mixture-of-experts GGUF")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _gguf_field(reader, key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    fields = dict(
        vocab_size=int(vocab), dim=dim, n_layer=int(need("block_count")), n_head=n_head, n_kv_head=n_kv,
        head_dim=head_dim, intermediate_size=int(need("feed_forward_length")),
        rope_base=float(field_("rope.freq_base", 10000.0)), rope_scaling=None,
        norm_eps=float(field_("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=GGUF_NAMES_OUTPUT not in tensor_shapes, max_context=int(field_("context_length", 4096)),
        architecture=arch.family, bos_id=None if bos is None else int(bos), eos_ids=eos_ids)
    fields.update(arch.switches(field_, tensor_shapes))
    return ModelArgs(**fields), arch


GGUF_NAMES_OUTPUT = _GGUF["output"]


def gguf_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first (ne0 = columns): PyTorch order is the reverse."""
    return tuple(int(s) for s in reversed(tensor.shape.tolist()))


def read_gguf_tensor(tensor) -> Tensor:
    """One tensor of a GGUFReader, dequantized to fp32 by the `gguf` package (F32, F16, BF16, Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q8_K), in PyTorch order."""
    import gguf
    import numpy as np

    shape = gguf_shape(tensor)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ConversionError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} cannot be dequantized") from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.size != int(np.prod(shape)):
        raise ConversionError(f"corrupt GGUF tensor {tensor.name}: {array.size} values for shape {_shape_str(shape)}")
    return torch.from_numpy(array.reshape(shape).copy())


def convert_gguf(path: Path, out_dir: Path) -> ModelArgs:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated/corrupt files raise ValueError, struct errors, ...
        raise ConversionError(f"corrupt GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: gguf_shape(t) for name, t in tensors.items()}
    try:
        args, arch = gguf_model_args(reader, shapes, path)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"GGUF file {path} has an invalid metadata value: {e}") from None

    def load(name: str) -> Tensor:
        return read_gguf_tensor(tensors[name])

    if GGUF_ROPE_FREQS in shapes:
        if shapes[GGUF_ROPE_FREQS] != (args.head_dim // 2,):
            raise ConversionError(f"tensor {GGUF_ROPE_FREQS} has shape {_shape_str(shapes[GGUF_ROPE_FREQS])}, "
                                  f"expected ({args.head_dim // 2},)")
        args.rope_scaling = _llama3_rope_from_freqs(load(GGUF_ROPE_FREQS), args.rope_base, args.head_dim)
    check_sources(args, _GGUF, arch.fused_qkv, shapes, lambda n: n == GGUF_ROPE_FREQS, f"GGUF file {path}")
    targets = plan_targets(args, _GGUF, arch.fused_qkv, unpermute_qk if arch.permuted_qk else lambda w, heads: w)
    state = build_state_dict(targets, load, f"converting {path.name}")
    save_checkpoint(state, args, out_dir)
    write_tokenizer(lambda tokenizer: tokenizer.write_tokenizer_from_gguf(reader, out_dir))
    return args


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def write_tokenizer(write: Callable) -> None:
    """Run write(tokenizer_module). The weights are usable without a tokenizer (token-id prompts,
    benchmarks, tests), so an absent or unsupported tokenizer is a warning, not an error."""
    try:
        import tokenizer
    except ImportError as e:
        raise ConversionError(f"cannot import tokenizer.py: {e}") from None
    try:
        write(tokenizer)
    except ValueError as e:  # tokenizer.py's "absent / unsupported tokenizer"
        print(f"warning: no tokenizer written: {e}", file=sys.stderr)
    except OSError as e:
        raise ConversionError(f"cannot write the tokenizer files: {e}") from None


def save_checkpoint(state: dict[str, Tensor], args: ModelArgs, out_dir: Path) -> None:
    """model.pth and config.json, both written to temporary files first and renamed into place only
    once both are complete: an interrupted conversion leaves the previous checkpoint (or none), never
    a half-written model.pth."""
    model_tmp, config_tmp = out_dir / "model.pth.tmp", out_dir / "config.json.tmp"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # torch.save to a file object: the zip records are named "archive/..." whatever the file name,
        # so the same conversion always produces the same bytes.
        with open(model_tmp, "wb") as f:
            torch.save(state, f)
        args.to_json(config_tmp)
        os.replace(model_tmp, out_dir / "model.pth")
        os.replace(config_tmp, out_dir / "config.json")
    except OSError as e:
        raise ConversionError(f"cannot write to {out_dir}: {e}") from None
    finally:
        for tmp in (model_tmp, config_tmp):
            tmp.unlink(missing_ok=True)
