"""Two compiled dense decode steps side by side, one on a bf16 (activation-dtype) KV cache and one on an
int8 cache, alternating in one process: the speedup of the int8 cache with nothing else in between
(bench decode interleaves every policy and format; README, "The quantized KV cache, measured here").

    python -m scripts.studies.dense_step_ab --checkpoint checkpoints/SmolLM2-135M-Instruct --batch-size 8 --context 8192

The caches hold random keys and values (no prefill: the steps read the same bytes either way).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import cli
import kernels
from bench.common import alternating_medians
from cache import KVFormat
from decoding import compiled_decode_step, decode_step, own_step
from assemble import load_checkpoint
from policies import AttentionSettings, policy_factory

FORMATS = {"auto": KVFormat("twice", "auto", "same"), "int8": KVFormat("twice", "int8", "same")}


def filled_model(checkpoint: Path, kern: kernels.Kernels, fmt: KVFormat, B: int, S: int):
    """The checkpoint in bf16 with dense attention and B rows of S random positions in caches of `fmt`."""
    model = load_checkpoint(checkpoint, "cpu", torch.bfloat16, kern)
    args = model.args
    model.setup_caches(B, S + 64, fmt)
    for cache in model.caches:
        for p0 in range(0, S, 2048):
            n = min(2048, S - p0)
            k = torch.randn(B, args.n_kv_head, n, args.head_dim).bfloat16()
            cache.update(torch.arange(p0, p0 + n), k, torch.randn_like(k))
    model.set_decode_attention(policy_factory(AttentionSettings("dense"), args, kern))
    return model


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    B, S = args.batch_size, args.context
    kern = kernels.resolve_kernels("cpu", "cpu", int8_kv=True)
    steps = {}
    for name, fmt in FORMATS.items():
        model = filled_model(args.checkpoint, kern, fmt, B, S)
        step = compiled_decode_step(own_step(decode_step, name), "cpu")
        token, pos = torch.zeros(B, 1, dtype=torch.long), torch.tensor([S])
        steps[name] = lambda step=step, model=model, token=token, pos=pos: step(model, token, pos, S + 1)
    with torch.no_grad():
        median = alternating_medians(steps, args.rounds, reps=3)
    print(f"B={B} S={S}: bf16 cache {median['auto'] * 1e3:.1f} ms, int8 cache {median['int8'] * 1e3:.1f} ms per step: "
          f"int8 {median['auto'] / median['int8']:.2f}x (medians of {args.rounds} alternating rounds)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--batch-size", type=cli.positive_int, default=8)
    p.add_argument("--context", type=cli.positive_int, default=8192)
    p.add_argument("--rounds", type=cli.positive_int, default=6)
    p.add_argument("--threads", type=cli.positive_int, default=2)
    return cli.main(p, run)


if __name__ == "__main__":
    raise SystemExit(main())
