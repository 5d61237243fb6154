"""Generate text with dense or SparQ decode attention, and report speed honestly.

    python generate.py --prompt "Tell me a story" --chat
    python generate.py --checkpoint checkpoints/SmolLM2-135M-Instruct --prompt-tokens 4096 --sparq-r 32

"Bandwidth achieved" counts the weight bytes plus the KV-cache bytes each decode step reads
(by the transfer formulas of the attention policy in use), not the weights alone.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

import cli
import data
import quantize
import tokenizer as tokenizer_module
from cli import UserError
from kernels import KERNEL_CHOICES, Kernels, resolve_kernels
from model import Transformer, checkpoint_paths, load_model
from model import ModelArgs
from sparq import (POLICIES, AttentionSettings, add_attention_flags, attention_settings, describe_layers,
                   model_compression, policy_factory)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def sample(logits: Tensor, temperature: float, top_k: Optional[int]) -> Tensor:
    """logits (B, vocab) fp32 -> next tokens (B,). temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(-1)


PREFILL_CHUNK = 2048  # prompt tokens per prefill step: memory stays bounded at any prompt length


def prefill_chunk(model: Transformer, tokens: Tensor, input_pos: Tensor, end: int) -> Tensor:
    """tokens (B, T) at positions input_pos = [end - T, end) -> logits (B, vocab) of the last one."""
    return model(tokens, input_pos, end)


def prefill(model: Transformer, prompt: Tensor, chunk: int = PREFILL_CHUNK, step: Callable = prefill_chunk,
            progress: bool = False) -> Tensor:
    """prompt (B, T) at positions [0, T), in chunks of `chunk` tokens (each attends to the cache the
    chunks before it wrote) -> logits (B, vocab) of the last position. progress: a bar on stderr."""
    from tqdm import tqdm

    T = prompt.shape[1]
    starts = range(0, T, chunk)
    with tqdm(total=T, desc="prefill", unit="tok", file=sys.stderr, disable=not progress or len(starts) < 2,
              leave=False) as bar:
        for start in starts:
            end = min(start + chunk, T)
            logits = step(model, prompt[:, start:end], torch.arange(start, end, device=prompt.device), end)
            bar.update(end - start)
    return logits


def decode_step(model: Transformer, token: Tensor, input_pos: Tensor, length: int) -> Tensor:
    """token (B, 1) at position input_pos (1,); length = live length including it -> logits (B, vocab)."""
    return model(token, input_pos, length)


@dataclass
class DecodeStats:
    prefill_s: float
    decode_s: float
    steps: int  # decode steps actually run (the first token comes from prefill)
    kv_bytes_read: int  # KV-cache bytes read over all decode steps


@dataclass
class Generator:
    """Prefill + token-by-token decode on a model with caches set up, optionally compiled."""

    model: Transformer
    stop_ids: set[int] = field(default_factory=set)
    temperature: float = 0.0
    top_k: Optional[int] = None
    compile_decode: bool = False
    compile_prefill: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    progress: bool = False  # a progress bar over long prefills

    def __post_init__(self):
        self._prefill_chunk = prefill_chunk
        self._decode = decode_step
        device_type = self.model.device.type
        if self.compile_decode:
            mode = "reduce-overhead" if device_type == "cuda" else None
            self._decode = torch.compile(decode_step, mode=mode, fullgraph=True, dynamic=True)
        if self.compile_prefill:
            self._prefill_chunk = torch.compile(prefill_chunk, fullgraph=True, dynamic=True)

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        """prompt (B, T) -> the new tokens of each row (cut after a stop token) and timings."""
        B, T = prompt.shape
        device = prompt.device
        self.model.reset_caches()
        start = time.perf_counter()
        logits = prefill(self.model, prompt, self.prefill_chunk, self._prefill_chunk, self.progress)
        next_token = sample(logits, self.temperature, self.top_k)
        synchronize(device)
        prefill_s = time.perf_counter() - start

        generated = [next_token]
        done = self._is_stop(next_token)
        kv_bytes = 0
        start = time.perf_counter()
        steps = 0
        for position in range(T, T + max_new_tokens - 1):
            if bool(done.all()):
                break
            input_pos = torch.tensor([position], device=device)
            logits = self._decode(self.model, next_token.view(B, 1), input_pos, self.model.read_length(position + 1))
            next_token = sample(logits, self.temperature, self.top_k)
            generated.append(next_token)
            done |= self._is_stop(next_token)
            kv_bytes += self.model.decode_kv_bytes(position + 1, B)
            steps += 1
        synchronize(device)
        decode_s = time.perf_counter() - start

        tokens = torch.stack(generated, dim=1).tolist()  # (B, n)
        return [self._cut_at_stop(row) for row in tokens], DecodeStats(prefill_s, decode_s, steps, kv_bytes)

    def _is_stop(self, token: Tensor) -> Tensor:
        if not self.stop_ids:
            return torch.zeros_like(token, dtype=torch.bool)
        return torch.isin(token, torch.tensor(sorted(self.stop_ids), device=token.device))

    def _cut_at_stop(self, row: list[int]) -> list[int]:
        for i, token in enumerate(row):
            if token in self.stop_ids:
                return row[: i + 1]
        return row


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Loading a run: kernels, checkpoint, policies
# ---------------------------------------------------------------------------------------------


def load_checkpoint(checkpoint: Path, device: str, dtype: torch.dtype, kernels: Kernels) -> Transformer:
    """The model of a float or quantized checkpoint, running `kernels` (bench.py and eval.py load this way too)."""
    return load_model(checkpoint, device=device, dtype=dtype, kernels=kernels, quantized=quantize.LOADING)


def load_tokenizer(checkpoint: Path):
    _, checkpoint_dir = checkpoint_paths(checkpoint)
    try:
        return tokenizer_module.load_tokenizer(checkpoint_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the tokenizer from {checkpoint_dir}: {e}") from None


def model_args(checkpoint: Path) -> ModelArgs:
    """The checkpoint's config.json (read before loading: the kernels depend on it)."""
    return ModelArgs.from_json(checkpoint_paths(checkpoint)[1] / "config.json")


def kernels_for(choice: str, device: str, args: ModelArgs, length_bucket: int = 1) -> Kernels:
    """resolve_kernels for this model, with its one-line ValueError as a user error."""
    try:
        return resolve_kernels(choice, device, length_bucket, softcap=args.attn_softcap is not None)
    except ValueError as e:
        raise UserError(str(e)) from None


def install_policy(model: Transformer, settings: AttentionSettings) -> None:
    """Every layer gets its own instance of the settings' policy, running the model's kernels."""
    try:
        model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
    except ValueError as e:
        raise UserError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT,
                   help="model.pth or its directory (default: the embedded SmolLM2-135M-Instruct)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    prompt.add_argument("--prompt-tokens", type=cli.positive_int,
                        help="a synthetic prompt of exactly N tokens cut from the Paul Graham essays")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=200)
    p.add_argument("--batch-size", type=cli.positive_int, default=1)
    p.add_argument("--num-samples", type=cli.positive_int, default=1, help="repeat generation (the first warms up)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=cli.positive_int, default=None)
    p.add_argument("--max-seq-length", type=cli.positive_int, default=None,
                   help="KV cache length (default: prompt + new tokens, capped at the model's context)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile-prefill", action="store_true", help="torch.compile the prefill")
    p.add_argument("--length-bucket", type=cli.positive_int, default=None,
                   help="decode attention reads the live length rounded up to a multiple of this, masking "
                        "the rest (default: 1 on CPU = exact; 256 on CUDA = one CUDA graph per bucket)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--kv-layout", choices=["twice", "once"], default="twice",
                   help="store K twice (d- and S-contiguous) or once (the paper's 1xK variant)")
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto",
                   help="decode kernels: auto = the fused kernels of the device (cpu: C++ dense and SparQ attention "
                        "and linears; cuda: Triton SparQ), torch = plain PyTorch everywhere")
    add_attention_flags(p)
    return p


def prompt_tokens(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_tokens is not None:
        return data.essay_tokens(tokenizer, args.prompt_tokens)
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    else:
        text = args.prompt
    try:
        return tokenizer.encode_prompt(text, chat=args.chat)
    except ValueError as e:
        raise UserError(str(e)) from None


def check_device(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    check_device(args)
    settings = attention_settings(args)
    length_bucket = args.length_bucket or (256 if args.device == "cuda" else 1)
    if length_bucket > 1 and not POLICIES[settings.policy].reads_buckets:
        raise UserError(f"--length-bucket applies to dense and sparq attention, not {settings.policy}")
    torch.manual_seed(args.seed)
    kernels = kernels_for(args.kernel, args.device, model_args(args.checkpoint), length_bucket)
    model = load_checkpoint(args.checkpoint, args.device, DTYPES[args.dtype], kernels)
    tokenizer = load_tokenizer(args.checkpoint)

    ids = prompt_tokens(args, tokenizer)
    max_context = model.args.max_context
    max_seq_length = args.max_seq_length or min(len(ids) + args.max_new_tokens, max_context)
    if len(ids) + 1 > max_seq_length:
        raise UserError(f"the prompt has {len(ids)} tokens; it does not fit --max-seq-length {max_seq_length}")
    if max_seq_length > max_context:
        raise UserError(f"--max-seq-length {max_seq_length} exceeds the model's context of {max_context} tokens")
    max_new_tokens = min(args.max_new_tokens, max_seq_length - len(ids))

    try:
        model.setup_caches(args.batch_size, max_seq_length, kv_layout=args.kv_layout, length_bucket=length_bucket)
    except ValueError as e:
        raise UserError(str(e)) from None
    install_policy(model, settings)
    policy = next((layer.attention.decode_attention for layer in model.layers
                   if layer.attention.decode_attention.name == settings.policy), model.layers[0].attention.decode_attention)

    print(f"model: {model.args.n_layer} layers, dim {model.args.dim}, {model.args.n_head} heads / "
          f"{model.args.n_kv_head} KV heads, {args.dtype} on {args.device}; "
          f"KV cache {model.kv_cache_bytes() / 2**20:.1f} MiB (layout {args.kv_layout}, "
          f"batch {args.batch_size} x {max_seq_length} positions); kernels: {kernels.name} ({kernels.describe})",
          file=sys.stderr)
    print(f"attention: {describe_layers(model)}", file=sys.stderr)
    generator = Generator(model, stop_ids=tokenizer.stop_ids, temperature=args.temperature, top_k=args.top_k,
                          compile_decode=args.compile, compile_prefill=args.compile_prefill,
                          progress=sys.stderr.isatty())
    prompt = torch.tensor([ids] * args.batch_size, device=args.device)

    results = []
    for i in range(args.num_samples):
        samples, stats = generator.generate(prompt, max_new_tokens)
        results.append((samples, stats))
        for b, row in enumerate(samples):
            header = f"--- sample {i + 1}" + (f", row {b + 1}" if args.batch_size > 1 else "")
            print(header)
            print(tokenizer.decode(row))
        report(stats, args.batch_size, model.weight_bytes(), len(ids))

    samples, stats = results[-1]
    summary = summarize(stats, args.batch_size, model.weight_bytes(), len(ids))
    print(f"peak memory: {peak_memory_bytes(args.device) / 2**30:.2f} GiB", file=sys.stderr)
    if settings.policy != "dense":
        ratio = model_compression(model, len(ids) + stats.steps)
        print(f"attention: {settings.policy}, KV transfers {ratio:.3f} of dense at the final length "
              f"(compression 1/{1 / ratio:.1f})", file=sys.stderr)
    if args.json:
        write_json(args, settings, model, tokenizer, samples, summary, policy)
    return 0


def summarize(stats: DecodeStats, batch_size: int, weights: int, prompt_len: int) -> dict:
    steps_per_s = stats.steps / stats.decode_s if stats.decode_s > 0 else float("nan")
    bytes_per_s = (weights * stats.steps + stats.kv_bytes_read) / stats.decode_s if stats.decode_s > 0 else float("nan")
    return {
        "prompt_tokens": prompt_len,
        "prefill_s": stats.prefill_s,
        "decode_tokens_per_s": steps_per_s,
        "total_tokens_per_s": steps_per_s * batch_size,
        "bandwidth_gb_s": bytes_per_s / 1e9,
        "weight_bytes": weights,
        "kv_bytes_read_per_step": stats.kv_bytes_read // max(stats.steps, 1),
    }


def report(stats: DecodeStats, batch_size: int, weights: int, prompt_len: int) -> None:
    s = summarize(stats, batch_size, weights, prompt_len)
    print(f"prefill: {prompt_len} tokens x {batch_size} in {s['prefill_s']:.2f} s; decode: {stats.steps} steps, "
          f"{s['decode_tokens_per_s']:.2f} tokens/s per sequence, {s['total_tokens_per_s']:.2f} tokens/s total; "
          f"bandwidth achieved {s['bandwidth_gb_s']:.2f} GB/s (weights {weights / 1e6:.1f} MB + "
          f"KV {s['kv_bytes_read_per_step'] / 1e6:.2f} MB per step)", file=sys.stderr)


def write_json(args, settings, model, tokenizer, samples, summary, policy) -> None:
    out = {
        "prompt_tokens": summary["prompt_tokens"],
        "batch_size": args.batch_size,
        "samples": [{"text": tokenizer.decode(row), "tokens": row} for row in samples],
        **{k: v for k, v in summary.items() if k != "prompt_tokens"},
        "device": args.device,
        "dtype": args.dtype,
        "attention": settings.policy,
        "kernels": model.kernels.name,
    }
    if settings.policy == "sparq":
        c = policy.config
        out["sparq"] = {"r": c.r, "k": c.k, "local": c.local, "mean_v": c.mean_v}
        final_len = summary["prompt_tokens"] + len(samples[0])
        out["compression_ratio"] = model_compression(model, final_len)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
