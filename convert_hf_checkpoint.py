"""Convert a Hugging Face checkpoint or a llama.cpp GGUF file to our format.

    python convert_hf_checkpoint.py SRC [--out DIR]

SRC is either
  * an HF model directory: config.json plus model.safetensors, sharded safetensors
    (model.safetensors.index.json), pytorch_model.bin, or sharded .bin (pytorch_model.bin.index.json),
    of a family in FAMILIES (Llama, Mistral, Qwen 2 / 2.5 / 3, Gemma 1 / 2 / 3, GPT-NeoX);
  * a .gguf file of an architecture llama.cpp writes for those families (every tensor is
    dequantized to fp32: F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants, through `gguf`).

Writes DIR/model.pth (a plain state dict, see model.py for the names), DIR/config.json
(model.ModelArgs: every architecture switch spelled out) and the tokenizer files (tokenizer.py).
DIR defaults to checkpoints/<name>, <name> being the GGUF file stem or the HF directory name.

Strict: every source tensor is consumed or explicitly ignored, every shape is checked against the
configuration; anything else is an error. User errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

import cli
from convert import (DEFAULT_OUT_ROOT, ConversionError, build_state_dict, check_sources, convert_gguf, plan_targets,
                     save_checkpoint, write_tokenizer)
from model import ModelArgs


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

# HF source tensor names by role (the roles: convert.py's comment above _GGUF)
HF_LLAMA = {
    "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias", "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
# Gemma 2 / 3: post_attention_layernorm is the norm AFTER attention; the MLP has its own pre-norm.
HF_GEMMA2 = {**HF_LLAMA, "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
              "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
              "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight"}
HF_NEOX = {
    "embed": "gpt_neox.embed_in.weight", "norm": "gpt_neox.final_layer_norm.weight",
    "norm_bias": "gpt_neox.final_layer_norm.bias", "output": "embed_out.weight",
    "attn_norm": "gpt_neox.layers.{i}.input_layernorm.weight", "attn_norm_bias": "gpt_neox.layers.{i}.input_layernorm.bias",
    "qkv": "gpt_neox.layers.{i}.attention.query_key_value.weight",
    "qkv_bias": "gpt_neox.layers.{i}.attention.query_key_value.bias",
    "o": "gpt_neox.layers.{i}.attention.dense.weight", "o_bias": "gpt_neox.layers.{i}.attention.dense.bias",
    "ffn_norm": "gpt_neox.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm_bias": "gpt_neox.layers.{i}.post_attention_layernorm.bias",
    "up": "gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight", "up_bias": "gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias",
    "down": "gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight", "down_bias": "gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias",
}
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


@dataclass(frozen=True)
class HFFamily:
    """How one HF architecture maps to ModelArgs and to our tensors."""

    name: str  # ModelArgs.architecture
    architectures: tuple[str, ...]  # config.json "architectures"
    model_types: tuple[str, ...]  # config.json "model_type" (when "architectures" is absent)
    names: dict[str, str]  # role -> source tensor name template
    switches: Callable[[dict], dict] = lambda config: {}  # extra ModelArgs fields from the config
    fused_qkv: bool = False
    ignored: re.Pattern = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def _sliding(config: dict) -> dict:
    """Mistral / Gemma 2 / Gemma 3 sliding-window layers: config's layer_types (or the family default)."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if not window or not types:
        return {}
    kinds = ["window" if t == "sliding_attention" else "global" for t in types]
    if any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConversionError(f"unsupported layer_types {sorted(set(types))}")
    return {"sliding_window": int(window), "layer_types": kinds if "window" in kinds else None}


def _gemma(config: dict, version: int) -> dict:
    switches = {"norm_offset": 1.0, "embedding_scale": math.sqrt(config["hidden_size"])}
    if version >= 2:
        scalar = config.get("query_pre_attn_scalar")
        switches.update(sandwich_norms=True, **_sliding(config),
                        attn_scale=None if scalar is None else float(scalar) ** -0.5,
                        attn_softcap=config.get("attn_logit_softcapping"),
                        final_softcap=config.get("final_logit_softcapping"))
    if version == 3:
        switches["qk_norm"] = True
        local = (config.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        switches["rope_local_base"] = float(local if local is not None else config.get("rope_local_base_freq", 10000.0))
    return switches


def _mistral(config: dict) -> dict:
    window = config.get("sliding_window")
    if window and int(window) < int(config.get("max_position_embeddings") or 0):
        return {"sliding_window": int(window), "layer_types": ["window"] * int(config["num_hidden_layers"])}
    return {}


def _qwen(config: dict) -> dict:
    if config.get("use_sliding_window"):
        raise ConversionError("unsupported: this Qwen config turns use_sliding_window on (no released "
                              "checkpoint does); set it false to run every layer with full attention")
    return {}


def _neox(config: dict) -> dict:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    params = config.get("rope_parameters") or {}
    pct = params.get("partial_rotary_factor", config.get("rotary_pct", config.get("partial_rotary_factor", 1.0)))
    return {"norm": "layer", "norm_eps": float(config.get("layer_norm_eps", 1e-5)), "mlp": "plain",
            "qkv_bias": bool(config.get("attention_bias", True)), "out_bias": bool(config.get("attention_bias", True)),
            "mlp_bias": True, "parallel_residual": bool(config.get("use_parallel_residual", True)),
            "rotary_dim": int(head_dim * pct), "intermediate_size": int(config.get("intermediate_size") or 4 * config["hidden_size"])}


HF_FAMILIES = [
    HFFamily("llama", ("LlamaForCausalLM",), ("llama",), HF_LLAMA),
    HFFamily("mistral", ("MistralForCausalLM",), ("mistral",), HF_LLAMA, _mistral),
    HFFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), HF_LLAMA, lambda c: {**_qwen(c), "qkv_bias": True}),
    HFFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), HF_LLAMA, lambda c: {**_qwen(c), "qk_norm": True}),
    HFFamily("gemma", ("GemmaForCausalLM",), ("gemma",), HF_LLAMA, lambda c: _gemma(c, 1)),
    HFFamily("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), HF_GEMMA2, lambda c: _gemma(c, 2)),
    HFFamily("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), HF_GEMMA2, lambda c: _gemma(c, 3)),
    HFFamily("gpt_neox", ("GPTNeoXForCausalLM",), ("gpt_neox",), HF_NEOX, _neox, fused_qkv=True,
             ignored=re.compile(r"^gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")),
]


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
    """(rope_theta, rope_scaling) of the global layers, from an old-style (rope_theta + rope_scaling)
    or a transformers-5 style (rope_parameters, maybe per layer type) config."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(config.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", config.get("rotary_emb_base", 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)  # GPT-NeoX: read by _neox
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "linear":
        return float(theta), {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rope_type != "llama3":
        raise ConversionError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if any(k not in scaling for k in keys):
        raise ConversionError(f"llama3 rope scaling needs {', '.join(keys)}; config has {sorted(scaling)}")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def hf_family(config: dict) -> HFFamily:
    """The family of an HF config, or a one-line ConversionError naming the supported ones."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    supported = ", ".join(a for f in HF_FAMILIES for a in f.architectures)
    for family in HF_FAMILIES:
        if any(a in family.architectures for a in architectures):
            return family
    if architectures:
        raise ConversionError(f"unsupported architecture {', '.join(map(str, architectures))} (supported: {supported})")
    model_type = config.get("model_type")
    for family in HF_FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConversionError(f"unsupported model_type {model_type!r} (supported: "
                          f"{', '.join(t for f in HF_FAMILIES for t in f.model_types)})")


def hf_model_args(config: dict, hf_dir: Path, family: HFFamily, has_lm_head: bool) -> ModelArgs:
    def need(key):
        if key not in config or config[key] is None:
            raise ConversionError(f"config.json ({hf_dir}) lacks {key}")
        return config[key]

    dim, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(config.get("num_key_value_heads") or n_head)
    head_dim = config.get("head_dim") or dim // n_head
    rope_base, rope_scaling = hf_rope(config)
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS:
        raise ConversionError(f"unsupported activation {act!r} (supported: {', '.join(HF_ACTIVATIONS)})")
    if family.name in ("llama", "mistral", "qwen3", "gemma", "gemma2", "gemma3") and config.get("attention_bias"):
        raise ConversionError(f"unsupported: this {family.name} checkpoint has attention biases")
    if config.get("mlp_bias"):
        raise ConversionError("unsupported: this checkpoint has MLP biases")

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
    fields = dict(
        vocab_size=int(need("vocab_size")), dim=dim, n_layer=int(need("num_hidden_layers")), n_head=n_head,
        n_kv_head=n_kv, head_dim=int(head_dim), intermediate_size=int(config.get("intermediate_size") or 0),
        rope_base=rope_base, rope_scaling=rope_scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tied), max_context=int(config.get("max_position_embeddings") or 4096),
        architecture=family.name, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
        activation=HF_ACTIVATIONS[act])
    fields.update(family.switches(config))
    return ModelArgs(**fields)


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
    family = hf_family(config)  # unsupported architectures fail before the weights are read
    tensors = HFTensors(hf_dir)
    names = family.names
    try:
        args = hf_model_args(config, hf_dir, family, has_lm_head=names["output"] in tensors.shapes)
    except (TypeError, ValueError, ZeroDivisionError, KeyError) as e:
        raise ConversionError(f"config.json ({hf_dir}) has an invalid value: {e}") from None
    what = f"checkpoint {hf_dir}"
    tied_lm_head = args.tie_embeddings and names["output"] in tensors.shapes
    check_sources(args, names, family.fused_qkv, tensors.shapes,
                  lambda n: bool(family.ignored.match(n)) or (tied_lm_head and n == names["output"]), what)
    if tied_lm_head:
        # Some tied checkpoints still store lm_head: accept it only when it is the embedding.
        lm_head, embed = tensors.load(names["output"]), tensors.load(names["embed"])
        if lm_head.shape != embed.shape or not torch.equal(lm_head, embed):
            raise ConversionError(f"{what}: tie_word_embeddings is set but lm_head.weight differs from the embedding")
    # HF stores q and k in the rotate-half layout our RoPE uses: fuse them as they are.
    targets = plan_targets(args, names, family.fused_qkv)
    state = build_state_dict(targets, tensors.load, f"converting {hf_dir.name}")
    save_checkpoint(state, args, out_dir)
    write_tokenizer(lambda tokenizer: tokenizer.copy_tokenizer_files(hf_dir, out_dir))
    return args


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


CONVERTED = "sparq-fast"  # a converted checkpoint's folder: inside an HF directory, or FILE.sparq-fast beside a GGUF
SOURCE_STAMP = "converted_from.json"  # in it: what it was converted from (path, size, mtime), to know it is current


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not (path / "model.pth").is_file() and any(
        path.glob(pattern) for pattern in ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json"))


def _stamp(src: Path) -> dict:
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    return {"source": str(src.resolve()), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def _converted_dir(src: Path) -> Path:
    """Where a source's conversion lives: beside it (FILE.sparq-fast, or DIR/sparq-fast) where that can be
    written, else in the user cache (data.cache_dir() / "converted" / a hash of the source's path)."""
    import hashlib

    import data

    beside = src.parent / f"{src.stem}.{CONVERTED}" if src.is_file() else src / CONVERTED
    try:
        beside.mkdir(parents=True, exist_ok=True)
        probe = beside / ".write-probe"
        probe.write_text("")
        probe.unlink()
        return beside
    except OSError:
        digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:16]
        return data.cache_dir() / "converted" / f"{src.stem}-{digest}"


def resolve_checkpoint(path: Path | str) -> Path:
    """What --checkpoint takes, as a converted checkpoint (model.pth and config.json, or their directory): a
    converted one as it is; a .gguf file or a Hugging Face directory converted once into a folder beside it
    (said in one line; later runs find it current and load it at once). A missing one is a one-line
    UserError naming the commands that make one."""
    src = Path(path)
    if (src.is_file() and src.suffix != ".gguf") or (src / "model.pth").is_file():
        return src
    if not src.exists():
        raise ConversionError(f"checkpoint not found: {src} (give --checkpoint a converted directory, a .gguf "
                              f"file or a Hugging Face directory; `make model` converts the embedded one)")
    if not (src.suffix.lower() == ".gguf" and src.is_file()) and not is_hf_directory(src):
        raise ConversionError(f"{src} holds no checkpoint: expected model.pth and config.json, a .gguf file or a "
                              f"Hugging Face directory (config.json and safetensors); convert one with "
                              f"`python convert_hf_checkpoint.py SRC`")
    out = _converted_dir(src)
    stamp = _stamp(src)
    try:
        current = json.loads((out / SOURCE_STAMP).read_text()) == stamp and (out / "model.pth").is_file()
    except (OSError, ValueError):
        current = False
    if not current:
        start = time.perf_counter()
        print(f"converting {src} into {out} (once: later runs load the converted checkpoint)...", file=sys.stderr,
              flush=True)
        convert(src, out)
        (out / SOURCE_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        print(f"converted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


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
