"""How a run is assembled: the checkpoint (or random weights), its tokenizer, the decode kernels, the
KV cache's format and its flags, a --compression budget solved, and the memory check before the caches
are allocated (the policy is installed apart: policies.install_policy).

generate.py, serve.py, python -m bench and python -m evals build their runs with these functions, so
a run is put together the same way whichever tool starts it; user mistakes come back as one-line
UserErrors.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import torch

import quantize
import tokenizer as tokenizer_module
from cache import KT_DTYPES, KT_SCALE_DTYPES, KV_DTYPES, KVFormat
from cli import UserError
from kernels import Kernels, resolve_kernels
from budgets import Storage, solve_target
from model import SHAPES, ModelArgs, Transformer, checkpoint_paths, load_model, load_state_dict
from policies import POLICIES, AttentionSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenIds:
    """The stand-in tokenizer of a --random-weights run (a GPU machine carries no tokenizer files): no
    vocabulary, no stop token; prompts are token ids, and a row's text is its token ids."""

    stop_ids: set[int] = set()

    @staticmethod
    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))

    @staticmethod
    def encode_prompt(text: str, chat: bool = False) -> list[int]:
        raise ValueError("random weights have no tokenizer: send the prompt as token ids")

    @staticmethod
    def encode_chat(messages: list[dict]) -> list[int]:
        raise ValueError("random weights have no tokenizer, so no chat template: use /v1/completions with token ids")


def load_checkpoint(checkpoint: Path, device: str, dtype: torch.dtype, kernels: Kernels,
                    quantized_kernel: str = "auto") -> Transformer:
    """The model of a float or quantized checkpoint, running `kernels` (bench and evals load this way too);
    a quantized one's linears run quantize.finalize_model's `quantized_kernel` (--quantized-kernel)."""
    return load_model(checkpoint, device=device, dtype=dtype, kernels=kernels,
                      quantized=quantize.loading(quantized_kernel))


def is_quantized_checkpoint(checkpoint: Path) -> bool:
    """The checkpoint was written by quantize.py (its linears pack their weights for the kernels they load with);
    reads the file's keys only (memory-mapped)."""
    return "__quantization__" in load_state_dict(checkpoint_paths(checkpoint)[0])


def load_tokenizer(checkpoint: Path):
    _, checkpoint_dir = checkpoint_paths(checkpoint)
    try:
        return tokenizer_module.load_tokenizer(checkpoint_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the tokenizer from {checkpoint_dir}: {e}") from None


def model_args(checkpoint: Path) -> ModelArgs:
    """The checkpoint's config.json (read before loading: the kernels depend on it)."""
    return ModelArgs.from_json(checkpoint_paths(checkpoint)[1] / "config.json")


def cache_storage(kv_format: KVFormat, model: Transformer) -> Storage:
    """How the model's cache stores K, V and K^T in `kv_format`, for budgets counted in stored bytes."""
    return Storage(kv_format, model.cache_dtype)


def kernels_for(choice: str, device: str, args: ModelArgs, length_bucket: int = 1,
                kv_formats: Sequence[KVFormat] = (KVFormat(),)) -> Kernels:
    """resolve_kernels for this model and the run's cache formats, with its one-line ValueError as a user error."""
    try:
        return resolve_kernels(choice, device, length_bucket, softcap=args.attn_softcap is not None,
                               int8_kv=any(f.int8_kv for f in kv_formats),
                               quantized_kt=any(f.quantized_kt for f in kv_formats))
    except ValueError as e:
        raise UserError(str(e)) from None


def solve_compression(settings: AttentionSettings, seq_len: int, config: ModelArgs,
                      storage: Storage) -> AttentionSettings:
    """The settings with the knob a --compression target solves for at seq_len (the longest prompt), in
    bytes as the cache stores them (`storage`); said on stderr. Settings without a target come back as
    they are."""
    if settings.compression is None:
        return settings
    try:
        budget = solve_target(settings, seq_len, config, storage)
    except ValueError as e:  # settings the policy refuses (sparq-fixed-r without --sparq-r)
        raise UserError(str(e)) from None
    print(f"budget: --compression {float(settings.compression):.4g} at {seq_len} tokens (the longest prompt): "
          f"{budget.describe()}", file=sys.stderr)
    return replace(budget.settings, compression=settings.compression)


def free_memory_bytes(device: str) -> Optional[int]:
    """Memory available for new allocations on `device` (None if unknown)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_cache_fits(args: ModelArgs, batch: int, seq_len: int, kv_format: KVFormat, dtype: torch.dtype,
                     device: str) -> None:
    """Refuse, with the numbers, a KV cache that cannot be allocated (before trying)."""
    need = Transformer.cache_bytes(args, batch, seq_len, kv_format, dtype)
    free = free_memory_bytes(device)
    if free is not None and need > 0.9 * free:
        hints = [h for h, applies in (("--kv-layout once", kv_format.layout == "twice"),
                                      ("--kv-dtype int8", kv_format.kv_dtype != "int8"),
                                      ("--kt-dtype int4", kv_format.layout == "twice" and kv_format.kt_dtype != "int4"))
                 if applies]
        raise UserError(f"the KV cache needs {need / 2**30:.1f} GiB (batch {batch} x {seq_len} positions, "
                        f"{describe_format(kv_format, dtype)}) but only {free / 2**30:.1f} GiB are free: lower "
                        f"--batch-size or --max-seq-length" + (f" (or use {' or '.join(hints)})" if hints else ""))


def add_model_flags(p: argparse.ArgumentParser, without_tokenizer: str) -> None:
    """--checkpoint or --random-weights (generate.py and serve.py); `without_tokenizer` says what the command
    takes and gives instead of text when random weights bring no tokenizer."""
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", type=Path, default=None,
                       help="model.pth or its directory, a .gguf file or a Hugging Face directory (converted once, into a "
                            "folder beside it; default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--random-weights", choices=list(SHAPES), metavar="SHAPE",
                       help=f"no checkpoint: random weights of a published shape ({', '.join(SHAPES)}); "
                            f"{without_tokenizer}")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The KV cache's storage flags (cache_format reads them), shared by generate.py, serve.py and evals."""
    p.add_argument("--kv-layout", choices=["twice", "once"], default="twice",
                   help="store K twice (d- and S-contiguous) or once (the paper's 1xK variant)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="K and V as stored: auto = the activations' dtype; int8 = per-token int8 (K after a "
                        "per-channel scale fixed by each row's prompt)")
    p.add_argument("--kt-dtype", choices=("auto", *KT_DTYPES), default="auto",
                   help="SparQ's copy of K^T (step 1 only ranks positions with it): auto = int4 on the CPU for the "
                        "policies that read it (kt_storage_for), else as K is stored; same = as K is stored; or "
                        "int8 / int4 (with --kv-layout twice), or int3 (with --kt-scale-dtype none)")
    p.add_argument("--kt-scale-dtype", choices=("auto", *KT_SCALE_DTYPES), default="auto",
                   help="a quantized K^T's per-position scales as stored: auto = none for an int3 K^T, else float32; "
                        "bfloat16 halves what step 1 reads beside its r components, so a budget buys more; none: no "
                        "position scales, each dimension's range fixed by the row's first write (the CPU kernels; "
                        "docs/accuracy.md)")


def kt_storage_for(flag: str, layout: str, device: str, policies: Sequence[str]) -> str:
    """--kt-dtype as KVFormat takes it, "auto" decided once per run: int4 on the CPU when a policy of the
    run scans K^T (SparQ's step 1: POLICIES' reads_kt). At the bytes of a K^T in the activations' dtype,
    an int4 one buys step 1 four times the components, which a low budget needs: adaptive SparQ at 1/8
    keeps dense's answers on it where a K^T in the activations' dtype loses some (docs/accuracy.md).
    Elsewhere "same": on CUDA the int4 step-1 kernel has not been timed against bf16 on a GPU yet
    (docs/gpu.md), and dense and the page selectors never read K^T."""
    if flag != "auto":
        return flag
    reads_kt = any(POLICIES[name].reads_kt for name in policies if name in POLICIES)
    return "int4" if layout == "twice" and device == "cpu" and reads_kt else "same"


def kt_scale_for(flag: str, kt_storage: str) -> str:
    """--kt-scale-dtype as KVFormat takes it: "auto" is none for an int3 K^T (stored without position scales
    alone), float32 for every other."""
    if flag != "auto":
        return flag
    return "none" if kt_storage == "int3" else "float32"


def cache_format(args: argparse.Namespace, device: str, policies: Sequence[str] = ()) -> KVFormat:
    """The KVFormat of add_cache_flags' flags for a run on `device` of these policies (kt_storage_for);
    a combination that makes no sense is a user error."""
    try:
        kt = kt_storage_for(args.kt_dtype, args.kv_layout, device, policies)
        fmt = KVFormat(args.kv_layout, args.kv_dtype, kt, kt_scale_for(args.kt_scale_dtype, kt))
    except ValueError as e:
        raise UserError(str(e)) from None
    if fmt.own_kt_scale and not fmt.position_scaled_kt and device != "cpu":
        raise UserError("--kt-scale-dtype none is read by the CPU kernels only (the Triton SparQ kernel takes a "
                        "quantized K^T with its position scales)")
    return fmt


def describe_format(kv_format: KVFormat, dtype: torch.dtype, kt_flag: Optional[str] = None) -> str:
    """The startup line's words for a cache format: "layout twice, K/V bfloat16, K^T int4", and why
    K^T is stored so when --kt-dtype auto chose it (`kt_flag` "auto")."""
    kt = kv_format.kt_storage(dtype)
    words = f"layout {kv_format.layout}, K/V {kv_format.kv_storage(dtype)}" + (f", K^T {kt}" if kt else "")
    if kv_format.own_kt_scale and not kv_format.position_scaled_kt:
        words += " without position scales"
    elif kv_format.own_kt_scale and kv_format.kt_scale_dtype != "float32":  # fp32 scales: every format's default
        words += f" with {kv_format.kt_scale_dtype} scales"
    if kt_flag == "auto" and kv_format.kt_dtype != "same":
        words += " (--kt-dtype auto: SparQ's step 1 on the CPU; --kt-dtype same keeps the activations')"
    return words




def allocate_caches(model: Transformer, kv_format: KVFormat, batch: int, max_seq_length: int,
                    length_bucket: int) -> None:
    """Allocate the model's KV caches (refused with the numbers if they cannot fit); the decode policy is
    installed apart (policies.install_policy)."""
    try:
        kv_format.kv_storage(model.cache_dtype)  # a float --kv-dtype other than the activations' is refused
        check_cache_fits(model.args, batch, max_seq_length, kv_format, model.cache_dtype, model.device.type)
        model.setup_caches(batch, max_seq_length, kv_format, length_bucket=length_bucket)
    except ValueError as e:
        raise UserError(str(e)) from None


PROBE_TEXT = "Speculative decoding: the draft's token ids must mean the verifier's. 12345 ÉÀ 中文 <|im_end|>"


def check_same_tokenizer(verifier, draft, draft_config: ModelArgs, config: ModelArgs) -> None:
    """A draft's tokens are the verifier's only if both tokenizers map text to the same ids."""
    same = (draft_config.vocab_size == config.vocab_size and verifier.stop_ids == draft.stop_ids
            and verifier.encode(PROBE_TEXT) == draft.encode(PROBE_TEXT))
    if not same:
        raise UserError("the draft checkpoint's tokenizer differs from the verifier's: a draft must share it")
