"""Where an eager decode step's time goes: torch.profiler's table of the ops of a few steps of one policy at
B rows of S positions, on the fused CPU kernels (docs/serving.md, "Conversations with the replies kept").

    python -m scripts.studies.decode_step_profile --checkpoint checkpoints/SmolLM2-135M-Instruct \
        --attention sparq-adaptive --compression 1/8 --batch-size 16 --context 4096 [--compile --steps 200]

The caches hold one essay prefilled once and copied to every row (the rows read the same bytes as B distinct
prompts); K^T is int4, the CPU's default for a SparQ run. Eager: the table's ops are what a compiled step runs
too, but the Python between them (the worker thread's wait in libgomp under `perf`) is the eager step's own.
"""
from __future__ import annotations

import argparse
import os
import time
from fractions import Fraction

import torch
from torch.profiler import ProfilerActivity, profile

import cli
import data
from assemble import kernels_for, load_checkpoint, load_tokenizer
from cache import KVFormat
from decoding import compiled_decode_step, decode_step, prefill
from model import ModelArgs, checkpoint_paths
from policies import AttentionSettings, parse_compression, policy_factory


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--attention", default="sparq-adaptive", help="dense, sparq-adaptive, ... (policies.POLICIES)")
    p.add_argument("--compression", type=parse_compression, default=Fraction(1, 8))
    p.add_argument("--batch-size", type=cli.positive_int, default=16)
    p.add_argument("--context", type=cli.positive_int, default=4096)
    p.add_argument("--steps", type=cli.positive_int, default=10)
    p.add_argument("--compile", action="store_true",
                   help="time the step built ahead of time (aot, as serve.py runs it) instead of profiling the "
                        "eager one: run `perf record -p PID` beside its timed steps for where its time goes")
    args = p.parse_args(argv)

    torch.set_grad_enabled(False)
    B, S = args.batch_size, args.context
    model_args = ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json")
    fmt = KVFormat(kt_dtype="int4")
    kern = kernels_for("auto", "cpu", model_args, kv_formats=[fmt])
    model = load_checkpoint(args.checkpoint, "cpu", torch.bfloat16, kern, "auto")
    model.setup_caches(B, S + 2 * args.steps + 4, fmt)
    prefill(model, torch.tensor([data.essay_tokens(load_tokenizer(args.checkpoint), S)]))
    for cache in model.caches:
        cache.broadcast_row(B)
    settings = AttentionSettings(args.attention, compression=None if args.attention == "dense" else args.compression)
    make = policy_factory(settings, model_args, kern)
    policies = [make(i) for i in range(model_args.n_layer)]
    model.set_decode_attention(lambda layer: policies[layer])
    token = torch.zeros(B, 1, dtype=torch.long)

    step = compiled_decode_step(decode_step, "cpu", "aot") if args.compile else decode_step

    def steps(first: int, n: int) -> None:
        for i in range(first, first + n):
            step(model, token, torch.tensor([S + i]), S + i + 1)

    steps(0, 3)  # warm-up: thread pools, the allocator, the policies' first binding (a compiled step's build)
    print(f"timing {args.steps} steps (pid {os.getpid()})", flush=True)
    start = time.perf_counter()
    steps(3, args.steps)
    print(f"{args.attention} B={B} S={S}: {1e3 * (time.perf_counter() - start) / args.steps:.1f} ms a step "
          f"({'compiled, aot' if args.compile else 'eager'})")
    if args.compile:
        return 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps(3 + args.steps, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
