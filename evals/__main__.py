"""Task accuracy of sparse decode attention against KV-transfer compression (the paper's Table 2):
the harness, `python -m evals`. The tasks themselves (examples, scoring) live in evals/tasks.py; the
policies in policies.py (the registry) and baselines.py, their budgets in budgets.py.

    python -m evals --task needle,repetition,bpc,retrieval --attention dense,sparq,h2o,local \\
        --compression 1/2,1/4,1/8 --examples 8 --json out/eval.json --plot out/eval.png

Budgets: every method is set to each requested compression at each batch's prompt length S with
the policies' own transfer formulas (paper, Appendix G; sparq.settings_for_compression): SparQ
keeps k = --sparq-k (local window k/4) and takes the r in 1..d whose transfers are closest; H2O,
LM-Infinite ("local"), FlexGen top-k ("topk") and the oracle take the budget k closest to the
target (top-k cannot go below about 1/2). Compression 1 is dense for every method, the shared
baseline column. The compression each row actually achieved (averaged over its decode steps) is
recorded. Results are kept per task and size (--lengths, --squad-contexts), never pooled over sizes: a
task run at several sizes also gets a table and a plot of score against prompt length at each
compression (the paper's Figure 6: --task squad --squad-contexts 7,15,31,63 --attention
dense,sparq-fixed-r,h2o,local --compression 1/4).

Everything after the prompt goes through the model's decode path with the chosen policy, one token
per step, exactly as generate.py and python -m bench run it, with the same kernels (--kernel). The dense
prefill is identical for every policy (H2O observes it), so each batch is prefilled once and every
policy decodes from it: the cache positions past the prompt are never read before they are
rewritten, so restoring the cache's snapshot (KVCache.snapshot) and a copy of each policy's
post-prefill state is an exact rewind (tests/test_eval.py checks it against generate.py's
Generator run from scratch).

Long runs (a SQuAD length sweep is hours on a 2-core CPU): with --json, every finished batch's raw
results go to a journal beside it (FILE.journal.jsonl); the same command with --resume replays those
batches and runs only the rest, and the tables come out as from one uninterrupted run.
`--report FILE.json` prints the tables (and --plot) of the results so far, while the run goes on;
with `--versus quest` also every policy's paired difference from Quest's (the journal's per-example values).

The needle map (the long-context picture: context length against needle depth, per method):

    python -m evals --task needle --lengths 1k,2k,4k,8k,16k,32k --depths 0,10,20,30,40,50,60,70,80,90,100 \\
        --examples 2 --attention dense,sparq-adaptive,sparq,quest --compression 1/8,1/16 \\
        --json results/needle_map.json --plot docs/needle_map.png

builds --examples needle examples at each depth (percent of the haystack before the needle) and length;
the usual tables pool the depths, the JSON's needle_map has a row per (length, depth, method, target),
a text map and the cells where dense finds the needle and a policy misses it are printed last, and
--plot draws the map (the usual score plot goes beside it, FILE_scores.png); --report redraws them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Optional

import torch

import cli
import data
from assemble import DTYPES, add_cache_flags, cache_format, kernels_for, load_checkpoint, load_tokenizer, model_args
from cache import KVFormat
from cli import UserError
from evals.journal import Journal, journal_path
from evals.report import budget_records, budget_summary, no_selection, plot_title, print_results, report, write_json
from evals.runner import Cell, Results, Runner, evaluate_batch
from evals.tasks import TASKS, Example, TaskOptions
from kernels import KERNEL_CHOICES
from baselines import QUEST_PAGE
from policies import (DENSE, POLICIES, AttentionSettings, add_selector_flags, fraction_label, parse_compression, selector_settings)

DEFAULT_LENGTH = 2048
# 2048 tokens everywhere: it keeps the default run near 20 minutes on a shared 2-core CPU (a 4k batch
# costs ~3x a 2k one), lets SparQ's k = 128 reach 1/8 (at S = 1024, k alone costs 1/8 of dense), and
# repetition needs it for >= 6000 characters of Shakespeare. Longer needles: --lengths 2k,4k,8k.


# =============================================================================================
# Command line
# =============================================================================================


def length_batches(examples: list[Example], batch_size: int, seed: int) -> list[list[Example]]:
    """Batches of prompts of similar length (a ragged prefill pads every row to the longest, and a
    batch's budgets are set at its mean length), in a seeded random order so that a run cut short
    has covered the whole range of lengths."""
    by_length = sorted(examples, key=lambda e: len(e.prompt))
    batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def prefill_tokens(batch: list[Example]) -> int:
    """The tokens a batch's prefill runs (rows padded to the longest): the progress bar's measure of
    work, since the prefill is most of a batch's time and SQuAD's sizes differ by 8x."""
    return len(batch) * max(len(e.prompt) for e in batch)


def parse_lengths(text: str) -> list[int]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        match = re.fullmatch(r"(\d+)([kK]?)", item)
        if not match or int(match.group(1)) == 0:
            raise UserError(f"bad --lengths value {item!r} (expected token counts like 2048 or 2k)")
        out.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    if not out:
        raise UserError("--lengths is empty")
    return out


def parse_depths(text: str) -> list[float]:
    """--depths: needle depths in percent of the haystack, 0 (its start) to 100 (its end); whole numbers
    kept as ints, so that the run identity and the JSON read 50, not 50.0."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = float(item.rstrip("%"))
        except ValueError:
            raise UserError(f"bad --depths value {item!r} (expected percentages from 0 to 100, e.g. 0,10,50,100)") from None
        if not 0 <= value <= 100:
            raise UserError(f"--depths {item} is outside 0..100 (percent of the haystack before the needle)")
        out.append(int(value) if value.is_integer() else value)
    if not out:
        raise UserError("--depths is empty")
    return list(dict.fromkeys(out))



def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m evals", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="needle,repetition,bpc,retrieval", help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--attention", default="dense,sparq,h2o,local",
                   help=f"comma list of {', '.join(POLICIES)} (dense is always run as the baseline)")
    p.add_argument("--compression", default="1/2,1/4,1/8", help="comma list of target compressions in (0, 1]")
    p.add_argument("--examples", type=cli.positive_int, default=8, help="examples per task and length")
    p.add_argument("--lengths", default=None,
                   help=f"prompt lengths in tokens for every task sized in tokens, e.g. 2k,4k (default {DEFAULT_LENGTH})")
    p.add_argument("--depths", default=None,
                   help="needle task only: needle depths in percent of the haystack (0 = its start, 100 = its end), "
                        "comma list, --examples at each; the results gain the needle map (table, JSON needle_map, "
                        "--plot draws it)")
    p.add_argument("--squad-contexts", default=None,
                   help="confusion paragraphs per SQuAD prompt, comma list (default 7; the paper's sweep: 7,15,31,63)")
    p.add_argument("--sparq-r", type=cli.positive_int, default=32,
                   help="r of the fixed-r SparQ variant (--attention sparq-fixed-r, budgeted by k)")
    add_selector_flags(p)
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT)
    p.add_argument("--batch-size", type=cli.positive_int, default=8)
    p.add_argument("--seed", type=int, default=0, help="example generation seed")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--sparq-k", type=cli.positive_int, default=128,
                   help="SparQ's k (its local window is k/4); sparq-adaptive: the length up to which a layer runs dense")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="mean-value reallocation (auto: on for MHA, off for GQA)")
    p.add_argument("--kernel", choices=[k for k in KERNEL_CHOICES if k != "triton"], default="auto",
                   help="decode kernels, as in generate.py")
    add_cache_flags(p)
    p.add_argument("--bpc-tokens", type=cli.positive_int, default=64, help="continuation tokens scored by the bpc task")
    p.add_argument("--repetition-chars", type=cli.positive_int, default=256, help="continuation characters the repetition task checks")
    p.add_argument("--repetition-passage", type=int, default=256,
                   help="characters of the repeated passage (>= 128; the 135M model copies 256 far better than 128)")
    p.add_argument("--retrieval-keys", type=cli.positive_int, default=4, help="key-value pairs in each retrieval haystack")
    p.add_argument("--threads", type=cli.positive_int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine two OpenMP threads spin at every "
                        "barrier and decode ~10x slower; use 2 on an idle machine)")
    p.add_argument("--json", type=Path, help="write the results as JSON (after every batch), and a journal of the "
                                              "batches done beside it (FILE.journal.jsonl)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose journal is beside --json: its batches are replayed, the rest run")
    p.add_argument("--plot", type=Path, help="write a PNG of score vs compression per task (vs prompt length for a task at several "
                                              "sizes); with --depths the needle map, the score plot beside it (FILE_scores.png)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                   help="print the tables (and --plot) of an earlier run's --json, also of one still going; "
                        "several files (one run per length, say) as one run; nothing runs")
    p.add_argument("--versus", metavar="METHOD",
                   help="with --report: also the paired differences from this policy at each compression (e.g. "
                        "quest), from the journals beside the files")
    p.add_argument("--against", type=Path, metavar="JSON",
                   help="with --report: also each policy's paired difference from itself in this other run's --json "
                        "(a setting that needs a run of its own, e.g. --kt-scale-dtype; the same examples, dense alike)")
    return p


def run_identity(args: argparse.Namespace, tasks: list[str], methods: list[str], targets: list[Fraction],
                 lengths: dict[str, list[int]], kv_format: KVFormat) -> dict:
    """What decides a run's batches and results: a resumed run must match its journal in all of it (the
    K^T storage as --kt-dtype auto resolved it)."""
    run = {"checkpoint": str(args.checkpoint), "tasks": tasks, "attention": methods,
           "compression": [fraction_label(t) for t in targets], "lengths": lengths}
    for flag in ("examples", "batch_size", "seed", "dtype", "kernel", "kv_layout", "sparq_r", "sparq_k", "sparq_mean_v",
                 "bpc_tokens", "repetition_chars", "repetition_passage", "retrieval_keys"):
        run[flag] = getattr(args, flag)
    for flag, value, default in (("kv_dtype", args.kv_dtype, "auto"), ("kt_dtype", kv_format.kt_dtype, "same"),
                                 ("kt_scale_dtype", kv_format.kt_scale_dtype, "float32"),
                                 ("page_size", args.page_size, QUEST_PAGE),
                                 ("hybrid_r", args.hybrid_r, None)):  # absent from the journals of earlier runs
        if value != default:
            run[flag] = value
    if "sparq-adaptive" in methods and args.adaptive_k_cap != args.sparq_k:  # earlier runs capped k at --sparq-k
        run["adaptive_k_cap"] = args.adaptive_k_cap
    if "sparq-adaptive" in methods and args.adaptive_heads != "pooled":  # earlier runs pooled the KV heads' picks
        run["adaptive_heads"] = args.adaptive_heads
    if "doublesparse" in methods:  # its channels come from a file: a recalibration is another run
        run["doublesparse_channels"] = file_identity(selector_settings(args)["channels"])
    if getattr(args, "depths", None):  # the needle map's (the journals of runs without it have none)
        run["depths"] = parse_depths(args.depths)
    return json.loads(json.dumps(run))  # as the journal's header reads back


def file_identity(path: Optional[Path]) -> Optional[str]:
    """A file's path and the start of its content's SHA-256 (None: no file; the policy then says what
    is missing)."""
    if path is None or not Path(path).is_file():
        return None
    return f"{path} sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def run_with_argv(args: argparse.Namespace) -> int:
        args.argv = argv
        return run(args)

    return cli.main(build_parser(), run_with_argv, argv)


def run(args: argparse.Namespace) -> int:
    if args.report:
        return report(args.report, args.plot, args.versus, args.against)
    if args.versus or args.against:
        flag = "--versus" if args.versus else "--against"
        raise UserError(f"{flag} goes with --report (it compares the policies of finished or running runs)")
    tasks = cli.name_list(args.task, "--task", list(TASKS))
    methods = cli.name_list(args.attention, "--attention", list(POLICIES))
    targets = list(dict.fromkeys([DENSE] + [parse_compression(c) for c in args.compression.split(",") if c.strip()]))
    contexts = cli.int_list(args.squad_contexts, "--squad-contexts") if args.squad_contexts else None
    lengths = {t: (parse_lengths(args.lengths) if args.lengths else list(TASKS[t].default_sizes))
               if TASKS[t].size == "tokens" else (contexts or list(TASKS[t].default_sizes)) for t in tasks}
    if args.repetition_passage < 128:
        raise UserError("--repetition-passage must be at least 128 characters")
    if args.sparq_k < 4:
        raise UserError("--sparq-k must be at least 4")
    depths = parse_depths(args.depths) if args.depths is not None else None
    if depths is not None and "needle" not in tasks:
        raise UserError("--depths is for the needle task (the needle map): add needle to --task, or drop --depths")
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from convert_hf_checkpoint import resolve_checkpoint

    args.checkpoint = resolve_checkpoint(args.checkpoint)  # a .gguf file or an HF directory: converted once
    model_config = model_args(args.checkpoint)
    ragged = [t for t in tasks if not TASKS[t].equal_lengths]
    if model_config.has_window_layers and args.batch_size > 1 and ragged:  # before any data is looked for
        raise UserError(f"{ragged[0]}'s prompts differ in length and this model has sliding-window layers, whose "
                        f"caches cannot batch prompts of different lengths: use --batch-size 1")
    tokenizer = load_tokenizer(args.checkpoint)
    for task, task_lengths in lengths.items():
        for length in task_lengths:
            if TASKS[task].size == "tokens" and length + 300 > model_config.max_context:
                raise UserError(f"--lengths {length} does not fit the model's context of {model_config.max_context} "
                                f"tokens with room for the question and answer: use at most "
                                f"{model_config.max_context - 300}")
    options = TaskOptions(args.bpc_tokens, args.repetition_chars, args.repetition_passage, args.retrieval_keys,
                          tuple(depths) if depths else None)

    # Build every example first (fast), so that a prompt that cannot run is an error before the model
    # loads and the progress bar knows the total. Batches are interleaved across tasks and lengths, so a
    # run cut short still has results for all of them.
    queues = []
    for task in tasks:
        for length in lengths[task]:
            examples = TASKS[task].build(tokenizer, length, args.examples, args.seed, options)
            longest = max(len(e.prompt) + max(len(e.answer), e.max_new) for e in examples)
            if longest + 1 > model_config.max_context:
                raise UserError(f"{task} at size {length}: prompts of up to {longest} tokens do not fit the model's "
                                f"context of {model_config.max_context} (fewer --squad-contexts?)")
            batches = length_batches(examples, args.batch_size, args.seed)
            if model_config.has_window_layers and any(len({len(e.prompt) for e in b}) > 1 for b in batches):
                raise UserError(f"{task} at size {length}: this model has sliding-window layers, whose caches "
                                f"cannot batch prompts of different lengths: use --batch-size 1")
            queues.append([(task, length, batch) for batch in batches])
    work = [queue[i] for i in range(max(map(len, queues))) for queue in queues if i < len(queue)]

    if args.resume and not args.json:
        raise UserError("--resume continues the run whose journal is beside --json: give that --json")
    kv_format = cache_format(args, "cpu", methods)  # one cache for every method: int4 K^T if one scans it
    journal = Journal(journal_path(args.json), run_identity(args, tasks, methods, targets, lengths, kv_format),
                      args.resume) if args.json else None
    from_journal = [journal.check(done, task, length, len(batch)) if journal else None  # before the model loads
                    for done, (task, length, batch) in enumerate(work, 1)]

    kernels = kernels_for(args.kernel, "cpu", model_config, kv_formats=[kv_format])
    model = load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels)
    try:
        kv_format.kv_storage(model.cache_dtype)  # a float --kv-dtype other than the activations' is refused
    except ValueError as e:
        raise UserError(str(e)) from None
    base = AttentionSettings(sparq_r=args.sparq_r, sparq_k=args.sparq_k, sparq_mean_v=args.sparq_mean_v,
                             **selector_settings(args))
    runner = Runner(model, base, kv_format)
    results = Results()
    replayed = 0
    start = time.perf_counter()

    def meta() -> dict:
        return {"checkpoint": str(args.checkpoint), "tasks": tasks, "attention": methods,
                "compression": [fraction_label(t) for t in targets], "lengths": lengths,
                "examples": args.examples, "batch_size": args.batch_size, "seed": args.seed, "dtype": args.dtype,
                "kernels": kernels.name, "kv_layout": args.kv_layout, "kv_dtype": args.kv_dtype,
                "kt_dtype": kv_format.kt_dtype, "kt_scale_dtype": kv_format.kt_scale_dtype, "sparq_k": args.sparq_k,
                "adaptive_k_cap": args.adaptive_k_cap, "adaptive_heads": args.adaptive_heads,
                **({"depths": depths} if depths else {}),
                "threads": args.threads, "argv": args.argv, "elapsed_s": time.perf_counter() - start,
                "batches_from_journal": replayed, "budgets": budget_records(results.budgets)}

    # The bar counts prompt tokens, those from the journal as done before it starts; its rate is the
    # average since the start (smoothing=0), which the batches' interleaved sizes make a steady ETA.
    with tqdm(total=sum(prefill_tokens(batch) for _, _, batch in work), disable=args.quiet, unit="tok",
              unit_scale=True, smoothing=0, file=sys.stderr,
              initial=sum(prefill_tokens(batch) for (_, _, batch), e in zip(work, from_journal) if e)) as progress:
        for done, ((task, length, batch), entry) in enumerate(zip(work, from_journal), 1):
            progress.set_description(f"{task} {'S' if TASKS[task].size == 'tokens' else 'contexts'}={length} "
                                     f"B={len(batch)}")
            # budgets at the batch's prompt length (SQuAD's vary: their mean)
            seq_len = round(sum(len(e.prompt) for e in batch) / len(batch))
            configs = runner.configs(methods, targets, seq_len)
            for c in configs:
                results.budgets[(task, c.method, c.budget.target, length)] = c.budget
            if entry is not None:  # run before this --resume
                results.add_record(entry["record"])
                replayed += 1
            else:
                batch_results = Results()
                share = prefill_tokens(batch) / len(configs)
                evaluate_batch(Cell(task, length), runner, tokenizer, batch, configs, batch_results,
                               lambda: progress.update(share))
                record = batch_results.record()
                results.add_record(record)
                if journal:  # the batch's raw results
                    journal.append(done, task, length, len(batch), record)
            if args.json and (entry is None or done == len(work)):  # the results so far (and at the end, always)
                write_json(args.json, results.rows(), {**meta(), "complete": done == len(work),
                                                       "batches_done": done, "batches": len(work)},
                           results.needle_map())
    elapsed = time.perf_counter() - start

    print(f"model {args.checkpoint}: {model.args.n_layer} layers, head dim {model.args.head_dim}, "
          f"{model.args.n_head} heads / {model.args.n_kv_head} KV heads, {args.dtype}, kernels {kernels.name}; "
          f"{args.examples} examples per task and length{' (needle: per depth)' if depths else ''}; "
          f"{elapsed / 60:.1f} min"
          + (f" ({replayed} of {len(work)} batches from the journal)" if replayed else ""))
    print(budget_summary(results.budgets))
    print_results(results.rows(), methods, targets, args.plot, plot_title(args.checkpoint, args.dtype),
                  no_selection(budget_records(results.budgets), args.page_size), results.needle_map())
    return 0


if __name__ == "__main__":
    sys.exit(main())
