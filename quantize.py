"""Weight-only int8 / int4 quantization of a checkpoint (the formats and their modules: qlinear.py).

    python quantize.py --checkpoint checkpoints/SmolLM2-135M-Instruct/model.pth --mode int8
    python quantize.py --checkpoint checkpoints/SmolLM2-135M-Instruct --mode int4 [--group-size 32]

writes model_int8.pth / model_int4.g{gs}.pth next to the input (or --out PATH). The file is a state
dict plus a plain "__quantization__" dict (mode, group_size, head, source, ...). model.load_model,
given quantized=LOADING (this module's hooks), pops it, calls prepare_model() on the meta model
before load_state_dict(assign=True, strict=True), and finalize_model() once the model is on its
device. Loading never looks at the file name.

What is quantized, and why:
  * Every linear layer of the blocks (wqkv, wo, w13 or w1, w2): most of the bytes read per step.
  * The output head: int8 in groups of 64 inputs by default, in both modes (--head int8|int4|none).
    At batch 1 the head (49152 x 576 on SmolLM2, 21% of the parameters) is read whole every step, so
    it must be quantized for speed. int8, not int4: the logits are what sampling sees, and an int4
    head multiplies the logit error of the int4 model several times (docs/NOTES.md); the llama.cpp Q4_1 file we compare with keeps this tensor in Q8_0 (int8, blocks of 32) for
    the same reason. Groups of 64 rather than per channel: half the head's KL for the same speed
    (the int4x2 kernel below reads one scale per 64 inputs anyway). --head int4 is faster on the
    head; --head none keeps it (and a tied embedding) in floating point.
  * The embedding. Tied to the head (SmolLM2), it IS the head's tensor: the lookup gathers the B
    rows it needs and dequantizes them with the head's scales (a row of the embedding is an output
    channel of the head), so the file holds the tensor once. An untied embedding is int8 (groups of
    64): a lookup reads B rows, so that saves memory, not time.
  * RMSNorm weights stay floating point (tiny; load_model casts them to the requested dtype).
Quantized embeddings emit fp32 activations (model.setup_caches then keeps fp32 KV caches).

File portability: int4 weights (and int8 ones) are stored unpacked -- two 4-bit values per byte,
low nibble = even column -- and packed for the local kernel at load time, because the CPU packed
layout depends on the machine's vector ISA (64-wide blocks with AVX512, 32 with AVX2) and CUDA's
layout differs again. Packing at load takes seconds for the 135M model on 2 cores.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

import cli
from kernels import Kernels
from qlinear import (Int4Embedding, Int4Linear, Int8Embedding, Int8Linear, QuantizationError,
                     pack_nibbles, quantize_int4, quantize_int8)
from model import CheckpointError, ModelArgs, QuantizedLoading, Transformer, checkpoint_paths, load_state_dict

FORMAT_VERSION = 1
MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 32
HEAD_CHOICES = ("int8", "int4", "none")
BACKENDS = ("auto", "gemv", "gemv-q8", "int4x2", "int8pack", "dequant")  # see Int8Linear; int4: gemv(-q8), int4pack
# =============================================================================================
# Model-level: what gets quantized, prepare (meta swap before loading), finalize (after loading)
# =============================================================================================


def is_quantized(model: nn.Module) -> bool:
    """Some linear layer of the model holds quantized weights (int8 or int4)."""
    return any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())


def has_int8(model: nn.Module) -> bool:
    """Some linear layer of the model holds int8 weights."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _linear_names(model: nn.Module) -> list[str]:
    """The block linears, in model order (the output head is handled separately)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "output"]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def head_int8_group_size(dim: int) -> Optional[int]:
    """Groups of the int8 head / embedding: 64 inputs (32 if the dim needs it), else per channel."""
    return next((g for g in (64, 32) if dim % g == 0), None)


def _check_metadata(quantization: dict) -> tuple[str, Optional[int], str, Optional[int]]:
    """(mode, group_size, head, head_group_size) from a file's metadata; CheckpointError if unknown."""
    if not isinstance(quantization, dict):
        raise CheckpointError("corrupt quantization metadata (not a dict)")
    version = quantization.get("format", 1)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"quantized checkpoint format {version} is not supported (this code reads {FORMAT_VERSION})")
    mode = quantization.get("mode")
    if mode not in MODES:
        raise CheckpointError(f"unknown quantization mode {mode!r} in the checkpoint")
    group_size = quantization.get("group_size")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise CheckpointError(f"unsupported int4 group size {group_size!r} in the checkpoint")
    head = quantization.get("head", "int8")
    if head not in HEAD_CHOICES:
        raise CheckpointError(f"unknown head quantization {head!r} in the checkpoint")
    head_group_size = quantization.get("head_group_size")
    if head_group_size is not None and not (isinstance(head_group_size, int) and head_group_size > 0):
        raise CheckpointError(f"bad head group size {head_group_size!r} in the checkpoint")
    return mode, group_size, head, head_group_size


def prepare_model(model: nn.Module, quantization: dict) -> None:
    """Swap the float modules of a (meta-device) Transformer for the quantized ones the file holds.

    Called by model.load_model before load_state_dict(assign=True, strict=True): the buffer names
    here are exactly the keys quantize_state_dict writes.
    """
    mode, group_size, head, head_gs = _check_metadata(quantization)
    args = model.args
    device = model.norm.weight.device
    try:
        for name in _linear_names(model):
            linear = model.get_submodule(name)
            K, N = linear.in_features, linear.out_features
            bias = linear.bias is not None  # biases stay floating point, added after the quantized matmul
            new = (Int8Linear(K, N, None, device, bias) if mode == "int8" else
                   Int4Linear(K, N, group_size, device, bias))
            _set_module(model, name, new)
        V, D = args.vocab_size, args.dim
        if head == "int8":
            model.output = Int8Linear(D, V, head_gs, device)
        elif head == "int4":
            model.output = Int4Linear(D, V, head_gs, device)
        if args.tie_embeddings:
            if head == "int8":
                model.tok_embeddings = Int8Embedding(V, D, head_gs, device)
            elif head == "int4":
                model.tok_embeddings = Int4Embedding(V, D, head_gs, device)
        else:  # an untied embedding is int8 whatever the head is
            model.tok_embeddings = Int8Embedding(V, D, quantization.get("embedding_group_size"), device)
    except QuantizationError as e:
        raise CheckpointError(f"quantized checkpoint does not fit its config.json: {e}") from None
    model.quantization = dict(quantization)


def check_backend(backend: str) -> None:
    """QuantizationError (one line) unless backend is one of BACKENDS."""
    if backend not in BACKENDS:
        raise QuantizationError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")


def finalize_model(model: nn.Module, kernels: Kernels, backend: Optional[str] = None) -> nn.Module:
    """Pick each quantized linear's kernel and pack its weights for the device it is on. Call once
    the model is on its final device (model.load_model does); the packed layouts are device-specific.

    kernels.packed_quantized False (--kernel torch): "dequant" everywhere. Else backend None or
    "auto" = the fastest kernel that applies and passes its self-check (gemv_kernel's, else "gemv",
    else int8: "int4x2", "int8pack"; int4: "int4pack"), or force "gemv" / "gemv-q8" / "int4x2" /
    "int8pack" / "dequant" (benchmarks).
    Tensors a kernel no longer reads are released; a tied embedding keeps its own reference to the
    head's stored tensors, so the lookup still works, or reads the head's rows16 copies (gemv-q8).
    """
    backend = (backend or "auto") if kernels.packed_quantized else "dequant"
    check_backend(backend)
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            module.finalize(backend)
    embedding, head = model.tok_embeddings, model.output
    if model.args.tie_embeddings and isinstance(embedding, (Int8Embedding, Int4Embedding)) and head.rows16 is not None:
        embedding.read_head_rows16(head)  # the head's stored tensors were dropped for their rows16 copies
    return model


def quantize_state_dict(state: dict, args, mode: str, group_size: Optional[int], head: str,
                        source: str = "", progress: bool = True) -> dict:
    """A float state dict (the converter's names) -> the quantized state dict with its metadata."""
    if mode not in MODES:
        raise QuantizationError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    if head not in HEAD_CHOICES:
        raise QuantizationError(f"unknown --head {head!r} (choose from {', '.join(HEAD_CHOICES)})")
    if mode == "int8":
        if group_size is not None:
            raise QuantizationError("--group-size applies to --mode int4 only (int8 is per output channel)")
        if head == "int4":
            raise QuantizationError("--head int4 needs --mode int4 (it uses the int4 group size)")
    else:
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        if group_size not in GROUP_SIZES:
            raise QuantizationError(f"unsupported group size {group_size} (choose from {', '.join(map(str, GROUP_SIZES))})")

    with torch.device("meta"):
        reference = Transformer(args)
    linear_names = _linear_names(reference)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if args.tie_embeddings:
        expected.pop("output.weight", None)  # the converter omits the tied head
    missing = [k for k in expected if k not in state]
    if missing:
        raise QuantizationError(f"the checkpoint does not match its config.json: missing {missing[0]}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise QuantizationError(f"the checkpoint does not match its config.json: {k} has shape "
                                    f"{tuple(state[k].shape)}, expected {shape}")
    head_gs = {"int8": head_int8_group_size(args.dim), "int4": group_size, "none": None}[head]
    embedding_gs = head_gs if args.tie_embeddings else head_int8_group_size(args.dim)
    # Check every group size before any work (one line, no half-written file).
    if mode == "int4" or head == "int4":
        for name in linear_names + (["output"] if head == "int4" else []):
            K = expected.get(f"{name}.weight", (0, args.dim))[1]
            if K % group_size:
                raise QuantizationError(f"group size {group_size} does not divide the input dimension {K} of {name}")

    out: dict = {}
    for k, v in state.items():  # norms and anything else float: kept as they are
        if k not in expected or k == "tok_embeddings.weight" or k.endswith(".weight") and k[: -len(".weight")] in linear_names:
            continue
        out[k] = v

    def put_linear(prefix: str, w: Tensor, kind: str, gs: Optional[int]) -> None:
        if kind == "int8":
            out[prefix + ".weight"], out[prefix + ".scales"] = quantize_int8(w, gs)
        else:
            q, out[prefix + ".scales"], out[prefix + ".zeros"] = quantize_int4(w, gs)
            out[prefix + ".weight"] = pack_nibbles(q)

    by_layer: dict[str, list[str]] = {}
    for name in linear_names:
        by_layer.setdefault(name.split(".attention")[0].split(".feed_forward")[0], []).append(name)
    bar = _progress(list(by_layer.items()), desc=f"quantizing {mode}", unit="layer", enable=progress)
    for _, names in bar:
        for name in names:
            put_linear(name, state[f"{name}.weight"], mode, group_size if mode == "int4" else None)

    embedding = state["tok_embeddings.weight"]
    head_weight = embedding if args.tie_embeddings else state["output.weight"]
    if head != "none":
        put_linear("output", head_weight, head, head_gs)
    else:
        out["output.weight"] = head_weight
    if args.tie_embeddings:
        for suffix in (".weight", ".scales", ".zeros"):  # the same tensors: torch.save stores them once
            if "output" + suffix in out:
                out["tok_embeddings" + suffix] = out["output" + suffix]
        if head == "none":
            out["tok_embeddings.weight"] = embedding
            out.pop("output.weight")  # tied float head: the converter's convention
    else:
        out["tok_embeddings.weight"], out["tok_embeddings.scales"] = quantize_int8(embedding, embedding_gs)

    out["__quantization__"] = {
        "format": FORMAT_VERSION,
        "mode": mode,
        "group_size": group_size if mode == "int4" else None,
        "head": head,
        "head_group_size": head_gs,
        "embedding": head if args.tie_embeddings else "int8",
        "embedding_group_size": embedding_gs,
        "source": source,
        "int4_layout": "portable: 2 values per byte, low nibble = even column; w = (q - 8) * scale + zero",
        "int8_layout": "symmetric: w = q * scale, per output channel (blocks) or per group (head, embedding)",
        "scale_dtype": "bfloat16",
        "torch": str(torch.__version__),
    }
    return out


def _progress(items, desc: str, unit: str, enable: bool):
    if not enable:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, leave=False)


# =============================================================================================
# Command line
# =============================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="quantize.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="model.pth (fp32/bf16) or its directory")
    p.add_argument("--mode", required=True, choices=MODES, help="int8 (per output channel) or int4 (grouped affine)")
    p.add_argument("--group-size", type=int, default=None, choices=GROUP_SIZES,
                   help=f"int4 group size along the input dim (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--head", default="int8", choices=HEAD_CHOICES,
                   help="output head (and the tied embedding): int8 (default), int4 (int4 mode only) or none")
    p.add_argument("--out", type=Path, default=None,
                   help="output file (default: model_int8.pth / model_int4.g{gs}.pth next to the input)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def default_out(path: Path, mode: str, group_size: Optional[int]) -> Path:
    name = "model_int8.pth" if mode == "int8" else f"model_int4.g{group_size}.pth"
    return path.parent / name


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def bring_along(source_dir: Path, out_dir: Path) -> None:
    """A quantized file written to another directory needs its config.json and tokenizer beside it
    (load_model and generate.py read them from there): copy what the source directory has."""
    import shutil

    import tokenizer

    for name in ("config.json", *tokenizer.HF_FILES):
        if (source_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copyfile(source_dir / name, out_dir / name)


def run(args: argparse.Namespace) -> Path:
    path, directory = checkpoint_paths(args.checkpoint)
    model_args = ModelArgs.from_json(directory / "config.json")
    state = load_state_dict(path)
    if "__quantization__" in state:
        q = state["__quantization__"]
        what = f"{q.get('mode')}" + (f" g{q['group_size']}" if isinstance(q, dict) and q.get("group_size") else "") \
            if isinstance(q, dict) else "?"
        raise QuantizationError(f"{path} is already quantized ({what}); quantize the original float checkpoint")
    if args.mode == "int8" and args.group_size is not None:
        raise QuantizationError("--group-size applies to --mode int4 only (int8 is per output channel)")
    group_size = (args.group_size or DEFAULT_GROUP_SIZE) if args.mode == "int4" else None
    out_path = args.out or default_out(path, args.mode, group_size)
    if out_path.resolve() == path.resolve():
        raise QuantizationError(f"--out {out_path} would overwrite the input checkpoint")
    quantized = quantize_state_dict(state, model_args, args.mode, group_size, args.head, source=str(path),
                                    progress=not args.no_progress)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.parent.resolve() != directory.resolve():
        bring_along(directory, out_path.parent)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        torch.save(quantized, tmp)
        os.replace(tmp, out_path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise QuantizationError(f"cannot write {out_path}: {e}") from None
    meta = quantized["__quantization__"]
    print(f"wrote {out_path}: {meta['mode']}" + (f" group size {meta['group_size']}" if meta["group_size"] else "")
          + f", head {meta['head']}; {out_path.stat().st_size / 1e6:.1f} MB (from {path.stat().st_size / 1e6:.1f} MB)")
    return 0


def loading(backend: str = "auto") -> QuantizedLoading:
    """How model.load_model reads the checkpoints this module writes, their kernels picked by
    finalize_model(backend) (a BACKENDS entry, e.g. "gemv" for fp32 activations in int4 layers)."""
    check_backend(backend)
    return QuantizedLoading(prepare=prepare_model, finalize=functools.partial(finalize_model, backend=backend))


LOADING = loading()  # model.load_model(..., quantized=LOADING): the kernels "auto" picks


if __name__ == "__main__":
    sys.exit(main())
