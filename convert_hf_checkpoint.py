"""Convert a Hugging Face Llama/Mistral checkpoint or a llama.cpp GGUF file to our format.

    python convert_hf_checkpoint.py SRC [--out DIR]

SRC is either
  * an HF model directory: config.json plus model.safetensors, sharded safetensors
    (model.safetensors.index.json), pytorch_model.bin, or sharded .bin (pytorch_model.bin.index.json);
  * a .gguf file of architecture "llama" (every tensor is dequantized to fp32).

Writes DIR/model.pth (a plain state dict, see model.py for the names), DIR/config.json
(model.ModelArgs) and the tokenizer files (tokenizer.py). DIR defaults to checkpoints/<name>,
<name> being the GGUF file stem or the HF directory name.

Strict: every source tensor is consumed or explicitly ignored, every shape is checked against the
configuration; anything else is an error. User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

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


def _concat(tensors: list[Tensor]) -> Tensor:
    return torch.cat(tensors, dim=0)


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


# ---------------------------------------------------------------------------------------------
# The target layout, common to both source formats
# ---------------------------------------------------------------------------------------------


def plan_targets(args: ModelArgs, names: dict[str, str], qkv_build: Callable[[int], Callable]) -> list[Target]:
    """Our tensors in order. `names` maps our per-layer roles to source name templates ({i} = layer).

    Roles: embed, attn_norm, q, k, v, o, ffn_norm, gate, up, down, norm, output.
    """
    D, H, K, d, F, V = args.dim, args.n_head, args.n_kv_head, args.head_dim, args.intermediate_size, args.vocab_size
    targets = [Target("tok_embeddings.weight", (V, D), [names["embed"]], _single)]
    for i in range(args.n_layer):
        src = {role: template.format(i=i) for role, template in names.items()}
        p = f"layers.{i}."
        targets += [
            Target(p + "attention_norm.weight", (D,), [src["attn_norm"]], _single),
            Target(p + "attention.wqkv.weight", ((H + 2 * K) * d, D), [src["q"], src["k"], src["v"]], qkv_build(i)),
            Target(p + "attention.wo.weight", (D, H * d), [src["o"]], _single),
            Target(p + "ffn_norm.weight", (D,), [src["ffn_norm"]], _single),
            Target(p + "feed_forward.w1.weight", (F, D), [src["gate"]], _single),
            Target(p + "feed_forward.w3.weight", (F, D), [src["up"]], _single),
            Target(p + "feed_forward.w2.weight", (D, F), [src["down"]], _single),
        ]
    targets.append(Target("norm.weight", (D,), [names["norm"]], _single))
    if not args.tie_embeddings:
        targets.append(Target("output.weight", (V, D), [names["output"]], _single))
    return targets


def expected_source_shapes(args: ModelArgs, names: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """The (PyTorch-order) shape every source tensor must have."""
    D, H, K, d, F, V = args.dim, args.n_head, args.n_kv_head, args.head_dim, args.intermediate_size, args.vocab_size
    shapes = {names["embed"]: (V, D), names["norm"]: (D,)}
    if not args.tie_embeddings:
        shapes[names["output"]] = (V, D)
    per_layer = {"attn_norm": (D,), "q": (H * d, D), "k": (K * d, D), "v": (K * d, D), "o": (D, H * d),
                 "ffn_norm": (D,), "gate": (F, D), "up": (F, D), "down": (D, F)}
    for i in range(args.n_layer):
        for role, shape in per_layer.items():
            shapes[names[role].format(i=i)] = shape
    return shapes


def check_sources(args: ModelArgs, names: dict[str, str], source_shapes: dict[str, tuple[int, ...]],
                  ignored: Callable[[str], bool], what: str) -> None:
    """Every expected tensor present with its shape, every other tensor explicitly ignored."""
    expected = expected_source_shapes(args, names)
    missing = [n for n in expected if n not in source_shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{what}: missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(source_shapes[name]) != tuple(shape):
            raise ConversionError(f"{what}: tensor {name} has shape {_shape_str(source_shapes[name])}, "
                                  f"the config implies {_shape_str(shape)}")
    leftover = sorted(n for n in source_shapes if n not in expected and not ignored(n))
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
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral"}

HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "norm": "model.norm.weight",
    "output": "lm_head.weight",
}
HF_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"corrupt {what} {path}: {e}") from None
    if not isinstance(value, dict):
        raise ConversionError(f"corrupt {what} {path}: not a JSON object")
    return value


def _int_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def hf_rope(config: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from an old-style (rope_theta + rope_scaling) or a transformers-5
    style (rope_parameters) config."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(config.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ConversionError(f"unsupported rope scaling type {rope_type!r} (only Llama 3.1 'llama3' is)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if any(k not in scaling for k in keys):
        raise ConversionError(f"llama3 rope scaling needs {', '.join(keys)}; config has {sorted(scaling)}")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def hf_architecture(config: dict) -> str:
    """'llama' or 'mistral', or a ConversionError for anything else."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    known = [HF_ARCHITECTURES[a] for a in architectures if a in HF_ARCHITECTURES]
    if architectures and not known:
        raise ConversionError(f"unsupported architecture {', '.join(map(str, architectures))} "
                              f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if not architectures:
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ConversionError(f"unsupported model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
        known = [HF_MODEL_TYPES[model_type]]
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConversionError("unsupported: this checkpoint has attention/MLP biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"unsupported activation {config.get('hidden_act')!r} (expected silu)")
    return known[0]


def hf_model_args(config: dict, hf_dir: Path, has_lm_head: bool) -> ModelArgs:
    architecture = hf_architecture(config)

    def need(key):
        if key not in config or config[key] is None:
            raise ConversionError(f"config.json ({hf_dir}) lacks {key}")
        return config[key]

    dim, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(config.get("num_key_value_heads") or n_head)
    head_dim = config.get("head_dim") or dim // n_head
    rope_base, rope_scaling = hf_rope(config)
    max_context = int(config.get("max_position_embeddings") or 4096)
    sliding_window = config.get("sliding_window")
    if sliding_window and int(sliding_window) < max_context:
        # Our attention is always full. Within sliding_window positions a sliding-window model
        # computes exactly full attention, so we only claim a context where the two agree.
        print(f"note: the model uses sliding-window attention (window {sliding_window}); our attention is "
              f"full, so max_context is capped from {max_context} to {sliding_window}", file=sys.stderr)
        max_context = int(sliding_window)

    eos_ids = _int_list(config.get("eos_token_id"))
    generation = hf_dir / "generation_config.json"
    if generation.is_file():  # instruct models list their end-of-turn tokens here
        try:
            eos_ids += [e for e in _int_list(json.loads(generation.read_text()).get("eos_token_id")) if e not in eos_ids]
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError, AttributeError):
            pass  # optional file: ignore a damaged one
    tied = config.get("tie_word_embeddings")
    if tied is None:  # older configs omit the key when it has the library default: trust the weights
        tied = not has_lm_head
    bos = config.get("bos_token_id")
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    return ModelArgs(
        vocab_size=int(need("vocab_size")), dim=dim, n_layer=int(need("num_hidden_layers")), n_head=n_head,
        n_kv_head=n_kv, head_dim=int(head_dim), intermediate_size=int(need("intermediate_size")),
        rope_base=rope_base, rope_scaling=rope_scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tied), max_context=max_context,
        architecture=architecture, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
    )


class HFTensors:
    """Lazy access to the tensors of an HF checkpoint: name -> shape up front, data on demand."""

    def __init__(self, hf_dir: Path):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, object] = {}  # name -> safetensors handle, or the tensor itself (.bin)
        self._handles = []
        files, kind, indexed = self._files(hf_dir)
        for file in files:
            if kind == "safetensors":
                self._open_safetensors(file)
            else:
                self._open_bin(file)
        if indexed is not None and indexed != set(self.shapes):
            odd = sorted(indexed ^ set(self.shapes))
            raise ConversionError(f"the shard index of {hf_dir} and its shards disagree about {odd[0]}"
                                  + (f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""))

    @staticmethod
    def _files(hf_dir: Path) -> tuple[list[Path], str, Optional[set[str]]]:
        """The weight files, their kind, and the tensor names a shard index promises (or None)."""
        for single, index, kind in (("model.safetensors", "model.safetensors.index.json", "safetensors"),
                                    ("pytorch_model.bin", "pytorch_model.bin.index.json", "bin")):
            if (hf_dir / single).is_file():
                return [hf_dir / single], kind, None
            if (hf_dir / index).is_file():
                weight_map = _read_json(hf_dir / index, "shard index").get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise ConversionError(f"corrupt shard index {hf_dir / index}: no weight_map")
                files = [hf_dir / f for f in dict.fromkeys(weight_map.values())]
                for f in files:
                    if not f.is_file():
                        raise ConversionError(f"missing shard {f} (listed in {index})")
                return files, kind, set(weight_map)
        raise ConversionError(f"no weights in {hf_dir} (expected model.safetensors, a sharded "
                              f"model.safetensors.index.json, or pytorch_model.bin)")

    def _add(self, name: str, shape, where, file: Path) -> None:
        if name in self.shapes:
            raise ConversionError(f"tensor {name} appears twice (again in {file.name})")
        self.shapes[name] = tuple(int(s) for s in shape)
        self._where[name] = where

    def _open_safetensors(self, file: Path) -> None:
        from safetensors import safe_open

        try:
            handle = safe_open(str(file), framework="pt")
            self._handles.append(handle)
            for name in handle.keys():
                self._add(name, handle.get_slice(name).get_shape(), handle, file)
        except ConversionError:
            raise
        except Exception as e:  # safetensors raises SafetensorError (and others) for damaged files
            raise ConversionError(f"corrupt safetensors file {file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def _open_bin(self, file: Path) -> None:
        try:
            try:
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                state = torch.load(file, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as e:
            raise ConversionError(f"corrupt PyTorch checkpoint {file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise ConversionError(f"corrupt PyTorch checkpoint {file}: not a state dict of tensors")
        for name, tensor in state.items():
            self._add(name, tensor.shape, tensor, file)

    def load(self, name: str) -> Tensor:
        where = self._where[name]
        if isinstance(where, Tensor):
            return where
        try:
            return where.get_tensor(name)
        except Exception as e:
            raise ConversionError(f"cannot read tensor {name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def convert_hf(hf_dir: Path, out_dir: Path) -> ModelArgs:
    config = _read_json(hf_dir / "config.json", "config.json")
    hf_architecture(config)  # unsupported architectures fail before the weights are read
    tensors = HFTensors(hf_dir)
    try:
        args = hf_model_args(config, hf_dir, has_lm_head=HF_NAMES["output"] in tensors.shapes)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"config.json ({hf_dir}) has an invalid value: {e}") from None
    what = f"checkpoint {hf_dir}"
    tied_lm_head = args.tie_embeddings and HF_NAMES["output"] in tensors.shapes
    check_sources(args, HF_NAMES, tensors.shapes,
                  lambda n: bool(HF_IGNORED.match(n)) or (tied_lm_head and n == HF_NAMES["output"]), what)
    if tied_lm_head:
        # Some tied checkpoints still store lm_head: accept it only when it is the embedding.
        lm_head, embed = tensors.load(HF_NAMES["output"]), tensors.load(HF_NAMES["embed"])
        if lm_head.shape != embed.shape or not torch.equal(lm_head, embed):
            raise ConversionError(f"{what}: tie_word_embeddings is set but lm_head.weight differs from the embedding")
    # HF stores q and k in the rotate-half layout our RoPE uses: fuse them as they are.
    targets = plan_targets(args, HF_NAMES, lambda i: _concat)
    state = build_state_dict(targets, tensors.load, f"converting {hf_dir.name}")
    save_checkpoint(state, args, out_dir)
    write_tokenizer(lambda tokenizer: tokenizer.copy_tokenizer_files(hf_dir, out_dir))
    return args


# ---------------------------------------------------------------------------------------------
# GGUF files (llama.cpp)
# ---------------------------------------------------------------------------------------------

GGUF_NAMES = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "norm": "output_norm.weight",
    "output": "output.weight",
}
GGUF_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 GGUFs store the llama3 rope factors as a tensor


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs) back to HF's rotate-half rows.

    llama.cpp: w.reshape(n_heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape), i.e. row
    2j (resp. 2j+1) of a head holds HF row j (resp. j + head_dim/2). The inverse swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
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


def gguf_model_args(reader, tensor_shapes: dict[str, tuple[int, ...]], path: Path) -> ModelArgs:
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")

    def need(key):
        value = _gguf_field(reader, f"llama.{key}")
        if value is None:
            raise ConversionError(f"GGUF file {path} lacks llama.{key}")
        return value

    dim, n_head = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(_gguf_field(reader, "llama.attention.head_count_kv", n_head))
    head_dim = int(_gguf_field(reader, "llama.rope.dimension_count", dim // n_head))
    if head_dim != _gguf_field(reader, "llama.attention.key_length", head_dim):
        raise ConversionError("unsupported: rope.dimension_count differs from attention.key_length (partial RoPE)")
    vocab = _gguf_field(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConversionError(f"GGUF file {path} has neither llama.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    scaling_type = _gguf_field(reader, "llama.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise ConversionError(f"unsupported GGUF rope scaling {scaling_type!r}")
    rope_base = float(_gguf_field(reader, "llama.rope.freq_base", 10000.0))
    if _gguf_field(reader, "llama.expert_count", 0):
        raise ConversionError("unsupported: mixture-of-experts GGUF")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _gguf_field(reader, key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelArgs(
        vocab_size=int(vocab), dim=dim, n_layer=int(need("block_count")), n_head=n_head, n_kv_head=n_kv,
        head_dim=head_dim, intermediate_size=int(need("feed_forward_length")), rope_base=rope_base,
        rope_scaling=None, norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings=GGUF_NAMES["output"] not in tensor_shapes,
        max_context=int(_gguf_field(reader, "llama.context_length", 4096)), architecture="llama",
        bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
    )


def convert_gguf(path: Path, out_dir: Path) -> ModelArgs:
    import gguf
    import numpy as np

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated/corrupt files raise ValueError, struct errors, ...
        raise ConversionError(f"corrupt GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    tensors = {t.name: t for t in reader.tensors}
    # GGUF lists dimensions fastest-first (ne0 = columns): PyTorch order is the reverse.
    shapes = {name: tuple(int(s) for s in reversed(t.shape.tolist())) for name, t in tensors.items()}
    try:
        args = gguf_model_args(reader, shapes, path)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"GGUF file {path} has an invalid metadata value: {e}") from None

    def load(name: str) -> Tensor:
        t = tensors[name]
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConversionError(f"tensor {name}: GGUF type {t.tensor_type.name} cannot be dequantized") from None
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.size != int(np.prod(shapes[name])):
            raise ConversionError(f"corrupt GGUF tensor {name}: {array.size} values for shape {_shape_str(shapes[name])}")
        return torch.from_numpy(array.reshape(shapes[name]).copy())

    if GGUF_ROPE_FREQS in shapes:
        if shapes[GGUF_ROPE_FREQS] != (args.head_dim // 2,):
            raise ConversionError(f"tensor {GGUF_ROPE_FREQS} has shape {_shape_str(shapes[GGUF_ROPE_FREQS])}, "
                                  f"expected ({args.head_dim // 2},)")
        args.rope_scaling = _llama3_rope_from_freqs(load(GGUF_ROPE_FREQS), args.rope_base, args.head_dim)
    check_sources(args, GGUF_NAMES, shapes, lambda n: n == GGUF_ROPE_FREQS, f"GGUF file {path}")

    def qkv_build(i: int):
        def build(qkv: list[Tensor]) -> Tensor:
            q, k, v = qkv
            return torch.cat([unpermute_qk(q, args.n_head), unpermute_qk(k, args.n_kv_head), v], dim=0)
        return build

    targets = plan_targets(args, GGUF_NAMES, qkv_build)
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


def _atomic_write(path: Path, write: Callable) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(state: dict[str, Tensor], args: ModelArgs, out_dir: Path) -> None:
    """model.pth then config.json, each written to a temporary file and renamed into place."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # torch.save to a file object: the zip records are named "archive/..." whatever the file name,
        # so the same conversion always produces the same bytes.
        _atomic_write(out_dir / "model.pth", lambda f: torch.save(state, f))
        config = out_dir / "config.json.tmp"
        args.to_json(config)
        os.replace(config, out_dir / "config.json")
    except OSError as e:
        raise ConversionError(f"cannot write to {out_dir}: {e}") from None


def default_out_dir(src: Path) -> Path:
    return DEFAULT_OUT_ROOT / (src.stem if src.is_file() else src.resolve().name)


def convert(src: Path | str, out: Optional[Path | str] = None) -> Path:
    """Convert SRC (an HF directory or a .gguf file) into `out`; returns the output directory."""
    src = Path(src)
    if not src.exists():
        raise ConversionError(f"source not found: {src}")
    out_dir = Path(out) if out is not None else default_out_dir(src)
    if src.is_dir():
        convert_hf(src, out_dir)
    elif src.suffix.lower() == ".gguf":
        convert_gguf(src, out_dir)
    else:
        raise ConversionError(f"unsupported source {src}: expected an HF model directory or a .gguf file")
    return out_dir


def main(argv: Optional[list[str]] = None) -> int:
    parser = cli.ArgumentParser(prog="convert_hf_checkpoint.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="an HF model directory or a .gguf file")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: checkpoints/<GGUF stem or HF directory name>)")

    def run(options: argparse.Namespace) -> int:
        out_dir = convert(options.src, options.out)
        print(f"wrote {out_dir / 'model.pth'} and {out_dir / 'config.json'}")
        return 0

    return cli.main(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
