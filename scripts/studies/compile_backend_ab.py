"""The compiled decode step against the step built ahead of time (inductor's torch.compile against
AOTInductor, decoding.compiled_decode_step's two CPU backends), alternating in one process on the same
model and cache: what dynamo, its guards and the Python around each step cost (README, "Measured here").

    python -m scripts.studies.compile_backend_ab --checkpoint checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth \\
        --dtype bfloat16 --context 16,1024 --attention dense,sparq

Each (context, policy) gets both steps; blocks of --steps steps take turns, and the medians of --rounds
blocks are printed with their ratio. The cache holds the essays' tokens (one prefill of the longest context).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import cli
import data
import kernels
from bench.common import alternating_medians
from cache import KVFormat
from decoding import compiled_decode_step, decode_step, own_step, prefill
from assemble import DTYPES, load_checkpoint, load_tokenizer
from policies import AttentionSettings, policy_factory

BACKENDS = ("inductor", "aot")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    contexts = cli.int_list(args.context, "--context")
    policies = cli.name_list(args.attention, "--attention", ("dense", "sparq"))
    settings = {"dense": AttentionSettings("dense"), "sparq": AttentionSettings("sparq", sparq_r=args.sparq_r)}
    model = load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels.resolve_kernels("cpu", "cpu"))
    longest = max(contexts)
    model.setup_caches(1, longest + args.steps + 2, KVFormat())
    with torch.no_grad():
        prefill(model, torch.tensor([data.essay_tokens(load_tokenizer(args.checkpoint), longest)]))
    print(f"# {args.checkpoint}, {args.dtype}, threads={torch.get_num_threads()}: ms per decode step, medians of "
          f"{args.rounds} blocks of {args.steps} steps, the backends taking turns")
    print("| context | policy | inductor ms | aot ms | aot speedup |\n|---|---|---|---|---|")
    for name in policies:
        layers = [policy_factory(settings[name], model.args, model.kernels)(i) for i in range(model.args.n_layer)]
        model.set_decode_attention(lambda i: layers[i])
        for context in contexts:
            steps = {backend: compiled_decode_step(own_step(decode_step, f"{name}_{context}_{backend}"), "cpu", backend)
                     for backend in BACKENDS}
            token, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([context])
            # each call rewrites position `context`: the same work every time
            calls = {backend: lambda step=step: step(model, token, pos, context + 1) for backend, step in steps.items()}
            with torch.no_grad():
                seconds = alternating_medians(calls, args.rounds, args.steps)
            ms = {backend: s * 1e3 for backend, s in seconds.items()}
            print(f"| {context} | {name} | {ms['inductor']:.2f} | {ms['aot']:.2f} | {ms['inductor'] / ms['aot']:.2f}x |",
                  flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--context", default="16,1024", help="comma-separated positions in the cache before the step")
    p.add_argument("--attention", default="dense,sparq", help="dense, sparq or both")
    p.add_argument("--sparq-r", type=cli.positive_int, default=16)
    p.add_argument("--steps", type=cli.positive_int, default=20)
    p.add_argument("--rounds", type=cli.positive_int, default=9)
    p.add_argument("--threads", type=cli.positive_int, default=2)
    return cli.main(p, run)


if __name__ == "__main__":
    raise SystemExit(main())
