"""Where a policy's extra loss on a long teacher-forced continuation sits (issue 89, long outputs): the paired
difference from dense of the mean NLL per token in buckets of absolute position.

    python -m scripts.studies.loss_by_position --checkpoint checkpoints/Qwen2.5-Coder-0.5B-Instruct \\
        --examples 4 --context 512 --tokens 4096 --bucket 512

The examples are the harness's (`python -m evals --task bpc --lengths 512 --bpc-tokens 4096`, seed 0: an essay
window of --context tokens, then --tokens of held-out text), one dense prefill per batch, then every config
teacher-forced through the continuation on the same kernels and cache as every eval (evals.Runner).
--dense-through N prefills the first N continuation tokens too and scores only the rest: the same text and
positions, but the cache before them written by a dense prefill, not by the policy's own decode steps; set
beside a run without it, this separates what a step loses at that length from what the earlier sparse steps
left in the cache (their keys and values past the first layer come from sparse attention). Printed per bucket:
dense's mean NLL (nats per token) and each config's paired difference d (a perplexity ratio of exp(d)) with its
standard error over the examples. --json: the per-example bucket means, written after each batch.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
from assemble import DTYPES, add_cache_flags, load_checkpoint  # noqa: E402
from evals.runner import Config, Runner, paired_difference  # noqa: E402
from evals.tasks import bpc_examples  # noqa: E402
from scripts.studies.adaptive_split_study import SplitAt, SplitByCoverage, fractions  # noqa: E402
from scripts.studies.long_output_study import continuation_setup  # noqa: E402
from policies import AttentionSettings, fraction_label  # noqa: E402


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.studies.loss_by_position", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/Qwen2.5-Coder-0.5B-Instruct"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--attention", default="sparq-adaptive", help="comma list of policies beside dense")
    p.add_argument("--compression", default="1/8,1/16", help="comma list of targets")
    p.add_argument("--examples", type=cli.positive_int, default=4)
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--context", type=cli.positive_int, default=512, help="prompt tokens of essay text")
    p.add_argument("--tokens", type=cli.positive_int, default=4096, help="continuation tokens (teacher-forced)")
    p.add_argument("--dense-through", type=int, default=0,
                   help="prefill this many continuation tokens too (densely) and score only the rest")
    p.add_argument("--shares", default="",
                   help="also sparq-adaptive with the positions given these shares of each step's budget (comma "
                        "list, e.g. 1/3,1/2,2/3: adaptive_split_study's SplitAt, the torch path) at each target")
    p.add_argument("--coverage", default="",
                   help="also sparq-adaptive with each row's split following step 1's coverage toward these targets "
                        "(comma list, e.g. 0.8,0.9: adaptive_split_study's SplitByCoverage) at each target")
    p.add_argument("--bucket", type=cli.positive_int, default=512, help="positions per bucket")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="SparQ's mean-value reallocation (as evals: auto is on for MHA, off for GQA)")
    p.add_argument("--threads", type=cli.positive_int, default=1)
    p.add_argument("--json", type=Path, help="per-example bucket means, written after each batch")
    add_cache_flags(p)
    return p


def bucket_means(logprobs: list[float], first_position: int, bucket: int) -> dict[int, float]:
    """Mean NLL of the tokens in each bucket of absolute positions [b, b + bucket), keyed by b; the token
    scored at logprobs[j] sits at position first_position + j."""
    sums: dict[int, list[float]] = {}
    for j, lp in enumerate(logprobs):
        sums.setdefault((first_position + j) // bucket * bucket, []).append(-lp)
    return {b: sum(v) / len(v) for b, v in sums.items()}


def run(args) -> int:
    if not 0 <= args.dense_through < args.tokens:
        raise cli.UserError(f"--dense-through must be in [0, --tokens), got {args.dense_through}")
    methods, targets, tokenizer, config, kv_format, kernels = continuation_setup(args)
    shares = fractions(args.shares) if args.shares else []
    coverage = [float(a) for a in args.coverage.split(",") if a.strip()]
    runner = Runner(load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels),
                    AttentionSettings(sparq_mean_v=args.sparq_mean_v), kv_format)
    examples = bpc_examples(tokenizer, args.context, args.examples, seed=0, continuation_tokens=args.tokens)
    prompt_length = args.context + args.dense_through  # the first scored token's position
    means: dict[str, list[dict[int, float]]] = {}  # config name -> per example, its bucket means
    start = time.perf_counter()
    batches = [examples[i:i + args.batch_size] for i in range(0, len(examples), args.batch_size)]
    with torch.no_grad(), tqdm(total=len(examples), unit="ex", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [e.prompt + e.answer[:args.dense_through] for e in batch]
            answers = [e.answer[args.dense_through:] for e in batch]
            configs = runner.configs(methods, targets, prompt_length)  # dense first
            named = [("dense" if c.method == "dense" else f"{c.method} {fraction_label(c.budget.target)}", c)
                     for c in configs]
            named += [(f"share {fraction_label(f)} {fraction_label(t)}",
                       Config(configs[0].budget, [SplitAt(float(t), float(f)) for _ in range(config.n_layer)]))
                      for t in targets for f in shares]
            named += [(f"coverage {a:g} {fraction_label(t)}",
                       Config(configs[0].budget, [SplitByCoverage(float(t), a) for _ in range(config.n_layer)]))
                      for t in targets for a in coverage]
            runner.prefill(prompts, [c for _, c in named], len(answers[0]) + 1)
            for name, c in named:
                logprobs, _, _ = runner.teacher_force(c, answers)
                means.setdefault(name, []).extend(bucket_means(lp, prompt_length, args.bucket) for lp in logprobs)
            progress.update(len(batch))
            if args.json:
                cli.write_json(args.json, {"argv": sys.argv[1:], "kv_format": str(kv_format),
                                           "first_scored_position": prompt_length, "bucket": args.bucket,
                                           "bucket_means": {n: [{str(b): m for b, m in e.items()} for e in v]
                                                            for n, v in means.items()},
                                           "elapsed_s": time.perf_counter() - start})
    print(f"{args.checkpoint.name} {args.dtype}: {len(examples)} essay continuations, positions {prompt_length}-"
          f"{args.context + args.tokens} scored (dense prefill to {prompt_length}), K^T {kv_format.kt_dtype}; "
          f"{(time.perf_counter() - start) / 60:.1f} min")
    others = [n for n in means if n != "dense"]
    print(f"{'positions':<12} {'dense nll':>10} " + " ".join(f"{n:>30}" for n in others))
    for b in sorted(means["dense"][0]):
        base = [e[b] for e in means["dense"]]
        cells = []
        for n in others:
            d, se = paired_difference([e[b] for e in means[n]], base)
            cells.append(f"{d:+.3f}" + ("" if se is None else f"±{se:.3f}") + f" ({math.exp(d) - 1:+.1%} ppl)")
        print(f"{f'{b}-{b + args.bucket}':<12} {sum(base) / len(base):>10.3f} " + " ".join(f"{c:>30}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
