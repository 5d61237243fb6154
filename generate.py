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

import data
from model import CheckpointError, DenseDecode, Transformer, checkpoint_paths, load_model
from sparq import (H2ODecode, LocalDecode, OracleDecode, SparQConfig, SparQDecode, TopKDecode, compression_ratio,
                   kv_bytes_read_per_step)

ATTENTION_POLICIES = ["dense", "sparq", "topk", "oracle", "h2o", "local"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 1."""


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


def prefill(model: Transformer, prompt: Tensor) -> Tensor:
    """prompt (B, T) at positions [0, T) -> logits (B, vocab) of the last position."""
    T = prompt.shape[1]
    return model(prompt, torch.arange(T, device=prompt.device), T)


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
    kv_bytes_per_step: Callable[[int, int], int] = lambda seq_len, batch: 0
    compile_decode: bool = False
    compile_prefill: bool = False

    def __post_init__(self):
        self._prefill = prefill
        self._decode = decode_step
        device_type = self.model.norm.weight.device.type
        if self.compile_decode:
            mode = "reduce-overhead" if device_type == "cuda" else None
            self._decode = torch.compile(decode_step, mode=mode, fullgraph=True, dynamic=True)
        if self.compile_prefill:
            self._prefill = torch.compile(prefill, fullgraph=True, dynamic=True)

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        """prompt (B, T) -> the new tokens of each row (cut after a stop token) and timings."""
        B, T = prompt.shape
        device = prompt.device
        self.model.reset_caches()
        start = time.perf_counter()
        next_token = sample(self._prefill(self.model, prompt), self.temperature, self.top_k)
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
            logits = self._decode(self.model, next_token.view(B, 1), input_pos, self._read_length(position + 1))
            next_token = sample(logits, self.temperature, self.top_k)
            generated.append(next_token)
            done |= self._is_stop(next_token)
            kv_bytes += self.kv_bytes_per_step(position + 1, B)
            steps += 1
        synchronize(device)
        decode_s = time.perf_counter() - start

        tokens = torch.stack(generated, dim=1).tolist()  # (B, n)
        return [self._cut_at_stop(row) for row in tokens], DecodeStats(prefill_s, decode_s, steps, kv_bytes)

    def _read_length(self, live_length: int) -> int:
        """Cache positions decode attention reads: the live length rounded up to the length bucket."""
        bucket = self.model.layers[0].attention.kv_cache.length_bucket
        return min(-(-live_length // bucket) * bucket, self.model.max_seq_length)

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
# Attention policies from the command line
# ---------------------------------------------------------------------------------------------


def decode_policy_factory(args: argparse.Namespace, model: Transformer):
    """make_policy(layer_index) for Transformer.set_decode_attention, from the parsed flags.

    Every layer gets its own instance: H2O keeps per-layer state.
    """
    model_args = model.args
    budget = args.kv_budget if args.kv_budget is not None else args.sparq_k
    mean_v = {"on": True, "off": False, "auto": model_args.n_kv_head == model_args.n_head}[args.sparq_mean_v]
    r = args.sparq_r if args.sparq_r is not None else model_args.head_dim  # oracle: exact scores
    config = SparQConfig(r=r, k=budget, local=args.sparq_local, mean_v=mean_v)
    try:
        config.validate(model_args.head_dim)
        if args.attention == "local":
            LocalDecode(budget)  # validates the budget against the sink tokens
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.attention == "sparq":
        kernel = resolve_kernel(args.kernel, args.device, args.kv_layout)
        return lambda layer: SparQDecode(config, kernel)
    if args.attention == "dense":
        kernel = resolve_kernel(args.kernel, args.device, "twice")  # dense reads only k and v
        return lambda layer: DenseDecode(kernel)
    return {
        "oracle": lambda layer: OracleDecode(config),
        "topk": lambda layer: TopKDecode(budget),
        "h2o": lambda layer: H2ODecode(budget, config.local),
        "local": lambda layer: LocalDecode(budget),
    }[args.attention]


def resolve_kernel(kernel: str, device: str, kv_layout: str) -> str:
    if kernel == "torch":
        return "torch"
    import kernels  # only the fused paths need it

    try:
        resolved = kernels.resolve_kernel(kernel, device, kv_layout)
    except ValueError as e:
        raise UserError(str(e)) from None
    if resolved == "cpu" and not kernels.cpu_kernel_available():
        return "torch"  # cpu_kernel_available() has printed a one-line warning
    return resolved


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT,
                   help="model.pth or its directory (default: the embedded SmolLM2-135M-Instruct)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    prompt.add_argument("--prompt-tokens", type=positive_int,
                        help="a synthetic prompt of exactly N tokens cut from the Paul Graham essays")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=200)
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--num-samples", type=positive_int, default=1, help="repeat generation (the first warms up)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--max-seq-length", type=positive_int, default=None,
                   help="KV cache length (default: prompt + new tokens, capped at the model's context)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile-prefill", action="store_true", help="torch.compile the prefill")
    p.add_argument("--length-bucket", type=positive_int, default=None,
                   help="decode attention reads the live length rounded up to a multiple of this, masking "
                        "the rest (default: 1 on CPU = exact; 256 on CUDA = one CUDA graph per bucket)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    add_attention_flags(p)
    return p


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    """Decode attention flags, shared by generate.py, bench.py and eval.py."""
    p.add_argument("--attention", choices=ATTENTION_POLICIES, default=None,
                   help="decode attention policy (default: sparq when --sparq-r is given, else dense)")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="positions attended by topk/oracle/h2o/local (default: --sparq-k)")
    p.add_argument("--sparq-r", type=int, default=None, help="query components used for approximate scores")
    p.add_argument("--sparq-k", type=int, default=128, help="positions attended exactly")
    p.add_argument("--sparq-local", type=int, default=None, help="recent positions always kept (default k/4)")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="mean-value reallocation (auto: on for MHA, off for GQA)")
    p.add_argument("--kv-layout", choices=["twice", "once"], default="twice",
                   help="store K twice (d- and S-contiguous) or once (the paper's 1xK variant)")
    p.add_argument("--kernel", choices=["auto", "triton", "cpu", "torch"], default="auto",
                   help="decode kernels: auto = Triton SparQ on CUDA (dense attention and linears stay torch), "
                        "the fused C++ kernels on CPU (dense and SparQ attention, linear layers); "
                        "torch = plain PyTorch")


def resolve_attention_flags(args: argparse.Namespace) -> None:
    if args.attention is None:
        args.attention = "sparq" if args.sparq_r is not None else "dense"
    if args.attention == "sparq" and args.sparq_r is None:
        raise UserError("--attention sparq needs --sparq-r")
    if args.attention not in ("dense", "sparq") and args.sparq_r is not None:
        raise UserError(f"--sparq-r applies to --attention sparq, not {args.attention}")


def prompt_tokens(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_tokens is not None:
        try:
            return data.essay_tokens(tokenizer, args.prompt_tokens)
        except (data.DataMissing, ValueError) as e:
            raise UserError(str(e)) from None
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


def weight_bytes(model: Transformer) -> int:
    """Bytes of every weight read per decode step (tied embeddings counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "kv_cache" not in n and n != "rope"]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UserError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    import tokenizer as tokenizer_module

    check_device(args)
    resolve_attention_flags(args)
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    model = load_model(args.checkpoint, device=args.device, dtype=dtype)
    _, checkpoint_dir = checkpoint_paths(args.checkpoint)
    try:
        tokenizer = tokenizer_module.load_tokenizer(checkpoint_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the tokenizer from {checkpoint_dir}: {e}") from None

    ids = prompt_tokens(args, tokenizer)
    max_context = model.args.max_context
    max_seq_length = args.max_seq_length or min(len(ids) + args.max_new_tokens, max_context)
    if len(ids) + 1 > max_seq_length:
        raise UserError(f"the prompt has {len(ids)} tokens; it does not fit --max-seq-length {max_seq_length}")
    if max_seq_length > max_context:
        raise UserError(f"--max-seq-length {max_seq_length} exceeds the model's context of {max_context} tokens")
    max_new_tokens = min(args.max_new_tokens, max_seq_length - len(ids))

    length_bucket = args.length_bucket or (256 if args.device == "cuda" else 1)
    if length_bucket > 1 and args.attention not in ("dense", "sparq"):
        raise UserError(f"--length-bucket applies to dense and sparq attention, not {args.attention}")
    model.setup_caches(args.batch_size, max_seq_length, kv_layout=args.kv_layout, length_bucket=length_bucket)
    model.set_decode_attention(decode_policy_factory(args, model))
    model.set_linear_kernel(resolve_kernel(args.kernel, args.device, "twice"))  # "cpu": the fused GEMV
    policy = model.layers[0].attention.decode_attention
    element_bytes = model.layers[0].attention.kv_cache.k.element_size()

    def kv_bytes(seq_len: int, batch: int) -> int:
        return kv_bytes_read_per_step(model.args, policy, seq_len, batch, element_bytes)

    print(f"model: {model.args.n_layer} layers, dim {model.args.dim}, {model.args.n_head} heads / "
          f"{model.args.n_kv_head} KV heads, {args.dtype} on {args.device}; "
          f"KV cache {model.kv_cache_bytes() / 2**20:.1f} MiB (layout {args.kv_layout}, "
          f"batch {args.batch_size} x {max_seq_length} positions)", file=sys.stderr)
    generator = Generator(model, stop_ids=tokenizer.stop_ids, temperature=args.temperature, top_k=args.top_k,
                          kv_bytes_per_step=kv_bytes, compile_decode=args.compile,
                          compile_prefill=args.compile_prefill)
    prompt = torch.tensor([ids] * args.batch_size, device=args.device)

    results = []
    for i in range(args.num_samples):
        samples, stats = generator.generate(prompt, max_new_tokens)
        results.append((samples, stats))
        for b, row in enumerate(samples):
            header = f"--- sample {i + 1}" + (f", row {b + 1}" if args.batch_size > 1 else "")
            print(header)
            print(tokenizer.decode(row))
        report(stats, args.batch_size, weight_bytes(model), len(ids))

    samples, stats = results[-1]
    summary = summarize(stats, args.batch_size, weight_bytes(model), len(ids))
    print(f"peak memory: {peak_memory_bytes(args.device) / 2**30:.2f} GiB", file=sys.stderr)
    if args.attention != "dense":
        ratio = compression_ratio(policy, DenseDecode(), len(ids) + stats.steps, model.args.head_dim)
        print(f"attention: {args.attention}, KV transfers {ratio:.3f} of dense at the final length "
              f"(compression 1/{1 / ratio:.1f})", file=sys.stderr)
    if args.json:
        write_json(args, model, tokenizer, samples, summary, policy)
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


def write_json(args, model, tokenizer, samples, summary, policy) -> None:
    out = {
        "prompt_tokens": summary["prompt_tokens"],
        "batch_size": args.batch_size,
        "samples": [{"text": tokenizer.decode(row), "tokens": row} for row in samples],
        **{k: v for k, v in summary.items() if k != "prompt_tokens"},
        "device": args.device,
        "dtype": args.dtype,
        "attention": args.attention,
    }
    if args.attention == "sparq":
        c = policy.config
        out["sparq"] = {"r": c.r, "k": c.k, "local": c.local, "mean_v": c.mean_v}
        final_len = summary["prompt_tokens"] + len(samples[0])
        out["compression_ratio"] = compression_ratio(policy, DenseDecode(), final_len, model.args.head_dim)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
