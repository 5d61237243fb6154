"""Long outputs (issue 89): does a policy's greedy continuation keep dense's for as long as dense's own bf16
continuation keeps fp32's?

    python -m scripts.studies.long_output_study --checkpoint checkpoints/Qwen2.5-Coder-0.5B-Instruct \
        --examples 32 --json results/long_output_agreement_qwen05.json

Per example (evals' bpc examples, seed 0: an essay window of --context tokens, held-out text), one dense prefill
per model, then greedy decoding step by step (evals.Runner: the same kernels and cache as every eval): dense in
float32 decodes --tokens tokens, the reference; dense in --dtype the same; every policy at every --compression in
--dtype (its K^T as --kt-dtype auto chooses it for the run) decodes until it has left both dense continuations.
Agreement: greedy tokens equal to a reference's before the first difference (a row that ends at a stop token
with its reference agrees to the end). Printed per config: the mean (with its standard error) and the median of
the agreement with fp32 dense and with --dtype dense, and each policy's paired difference from --dtype dense's
own agreement with fp32. Teacher-forced perplexity over long continuations is the harness's (`python -m evals
--task bpc --bpc-tokens 4096 --lengths 512`: answer_nll, whose paired difference d is a perplexity ratio of
exp(d)). --json: every example's agreements, written after each batch.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
from assemble import DTYPES, add_cache_flags, cache_format, kernels_for, load_checkpoint, load_tokenizer  # noqa: E402
from cache import KVFormat  # noqa: E402
from evals.runner import Config, Runner, mean_stderr, paired_difference  # noqa: E402
from evals.tasks import bpc_examples  # noqa: E402
from model import ModelArgs, checkpoint_paths  # noqa: E402
from policies import DENSE, POLICIES, fraction_label, parse_compression  # noqa: E402

REFERENCE_DTYPE = "float32"


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.studies.long_output_study", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/Qwen2.5-Coder-0.5B-Instruct"))
    p.add_argument("--dtype", choices=sorted(set(DTYPES) - {REFERENCE_DTYPE}), default="bfloat16",
                   help="the policies' activations (the reference is dense in float32)")
    p.add_argument("--attention", default="sparq-adaptive", help="comma list of policies beside dense")
    p.add_argument("--compression", default="1/8,1/16", help="comma list of targets")
    p.add_argument("--examples", type=cli.positive_int, default=32)
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--context", type=cli.positive_int, default=512, help="prompt tokens of essay text")
    p.add_argument("--tokens", type=cli.positive_int, default=1024, help="greedy tokens of the references")
    p.add_argument("--threads", type=cli.positive_int, default=1)
    p.add_argument("--json", type=Path, help="every example's agreements, written after each batch")
    add_cache_flags(p)
    return p


def agreement(tokens: list[int], reference: list[int]) -> int:
    """Tokens equal to the reference's before the first difference (all of the shorter when none differs:
    a row that stopped with its reference agrees to its end)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def greedy_until_left(runner: Runner, config: Config, n: int, stop_ids: set[int],
                      references: list[list[list[int]]]) -> list[list[int]]:
    """config's greedy tokens per row, each row stopped once it differs from every one of its references (the
    tokens past that point would not change an agreement)."""
    def finished(b: int, tokens: list[int]) -> bool:
        return all(agreement(tokens, ref[b]) < len(tokens) for ref in references)

    tokens, _ = runner.greedy(config, n, stop_ids, finished)
    return tokens


def summary(values: list[int]) -> str:
    mean, se = mean_stderr([float(v) for v in values])
    return f"{mean:.1f}" + ("" if se is None else f"±{se:.1f}") + f" (median {statistics.median(values):g})"


def continuation_setup(args):
    """What a study of essay continuations (this one, loss_by_position) reads from its flags, checked: the
    policies beside dense, the targets, the tokenizer, the model's args, the cache format and the kernels."""
    torch.set_num_threads(args.threads)
    methods = cli.name_list(args.attention, "--attention", [m for m in POLICIES if m != "dense"])
    targets = [parse_compression(c) for c in args.compression.split(",") if c.strip()]
    tokenizer = load_tokenizer(args.checkpoint)
    config = ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json")
    if args.context + args.tokens + 1 > config.max_context:
        raise cli.UserError(f"--context {args.context} + --tokens {args.tokens} do not fit the model's context of "
                            f"{config.max_context} tokens")
    kv_format = cache_format(args, "cpu", methods)
    kernels = kernels_for("auto", "cpu", config, kv_formats=[kv_format])
    return methods, targets, tokenizer, config, kv_format, kernels


def run(args) -> int:
    methods, targets, tokenizer, config, kv_format, kernels = continuation_setup(args)
    reference = Runner(load_checkpoint(args.checkpoint, "cpu", DTYPES[REFERENCE_DTYPE], kernels), kv_format=KVFormat())
    runner = Runner(load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels), kv_format=kv_format)
    examples = bpc_examples(tokenizer, args.context, args.examples, seed=0, continuation_tokens=1)
    stop_ids = set(tokenizer.stop_ids)
    dense = f"dense {args.dtype}"
    splits: dict[str, str] = {}  # config name -> its budget's split at the prompt's length
    agree_fp32: dict[str, list[int]] = {}  # config name -> per example, dense first (the table's order)
    agree_own: dict[str, list[int]] = {}  # with --dtype dense
    start = time.perf_counter()
    batches = [examples[i:i + args.batch_size] for i in range(0, len(examples), args.batch_size)]
    with torch.no_grad(), tqdm(total=len(examples), unit="ex", file=sys.stderr) as progress:
        for batch in batches:
            prompts = [e.prompt for e in batch]
            [dense32] = reference.configs(["dense"], [DENSE], args.context)
            reference.prefill(prompts, [dense32], args.tokens + 1)
            ref32, _ = reference.greedy(dense32, args.tokens, stop_ids, lambda b, t: False)
            configs = runner.configs(methods, targets, args.context)  # dense first
            runner.prefill(prompts, configs, args.tokens + 1)
            own, _ = runner.greedy(configs[0], args.tokens, stop_ids, lambda b, t: False)
            agree_fp32.setdefault(dense, []).extend(agreement(t, r) for t, r in zip(own, ref32))
            agree_own.setdefault(dense, []).extend(len(t) for t in own)
            for c in configs[1:]:
                name = f"{c.method} {fraction_label(c.budget.target)}"
                if c.budget.split:  # adaptive SparQ's grows with the continuation
                    splits[name] = f"r = {c.budget.split[0]}, k = {c.budget.split[1]} at {args.context} tokens"
                tokens = greedy_until_left(runner, c, args.tokens, stop_ids, [ref32, own])
                agree_fp32.setdefault(name, []).extend(agreement(t, r) for t, r in zip(tokens, ref32))
                agree_own.setdefault(name, []).extend(agreement(t, r) for t, r in zip(tokens, own))
            progress.update(len(batch))
            if args.json:
                cli.write_json(args.json, {"argv": sys.argv[1:], "kv_format": str(kv_format),
                                           "examples_done": len(agree_fp32[dense]), "tokens": args.tokens,
                                           "agreement_with_fp32_dense": agree_fp32,
                                           f"agreement_with_{args.dtype}_dense": agree_own,
                                           "elapsed_s": time.perf_counter() - start})
    print(f"{args.checkpoint.name}: {len(examples)} essay continuations after {args.context} tokens, references of "
          f"{args.tokens} greedy tokens, K^T {kv_format.kt_dtype}; {(time.perf_counter() - start) / 60:.1f} min")
    base = agree_fp32[dense]
    print(f"{'config':<24} {'agrees with fp32 dense':>28} {f'with {args.dtype} dense':>28} "
          f"{f'minus {args.dtype} dense vs fp32':>30}")
    for name in agree_fp32:
        diff: Optional[str] = None
        if name != dense:
            d, se = paired_difference([float(v) for v in agree_fp32[name]], [float(v) for v in base])
            diff = f"{d:+.1f}" + ("" if se is None else f"±{se:.1f}")
        own_text = summary(agree_own[name]) if name != dense else "(itself)"
        print(f"{name:<24} {summary(agree_fp32[name]):>28} {own_text:>28} {diff or '':>30}  {splits.get(name, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
