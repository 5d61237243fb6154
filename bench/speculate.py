"""`python -m bench speculate`: speculative decoding beside the policies it combines, timed by generation.

Acceptance depends on the tokens, so unlike `decode` (one step at fixed positions) every method here
generates --new-tokens greedy tokens per row for real. Each case (context, batch) prefills the essay
once; dense, SparQ and each speculator (SparQ drafting for dense on the same cache, and a draft
model with --draft-checkpoint) then generate from that same state (the caches restored before
each), taking turns round by round (--rounds: the median is reported), so a slow spell of the
machine lands on all alike. Printed per method: tokens/s per row, the speedup over dense, and for
the speculators the acceptance, the tokens per round, the theory (the speedup the measured tokens
per round, draft steps and verify passes predict against dense's measured step) and whether the
tokens equal dense's.

--predict SHAPE times nothing: it prints the speedup the byte model predicts for a published shape
(model.SHAPES) where decode is bandwidth-bound (a GPU), drafted by --draft-shape or by SparQ at
--compression: every step costs the bytes it reads (weights, and the KV bytes its policy reads),
a verify pass of n + 1 tokens the verifier's one step (the same bytes: compute is not the limit at
these few rows), and a round yields (1 - a^(n+1)) / (1 - a) tokens at acceptance a.
"""
from __future__ import annotations

import statistics

import cli
from bench.common import DTYPES, torch_dtype
from cli import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("speculate", help="speculative decoding vs dense and SparQ, by generation")
    p.add_argument("--checkpoint", default="checkpoints/SmolLM2-135M-Instruct", help="model.pth or its directory, a .gguf file or a Hugging Face directory (converted once, beside it)")
    p.add_argument("--draft-checkpoint", default=None, help="also time this draft model (same tokenizer)")
    p.add_argument("--prompt-tokens", default="8000", help="comma list of contexts")
    p.add_argument("--batch-size", default="8", help="comma list")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--speculate-k", default="4", help="comma list: tokens proposed per round")
    p.add_argument("--sparq-r", type=cli.positive_int, default=16)
    p.add_argument("--sparq-k", type=cli.positive_int, default=128)
    p.add_argument("--new-tokens", type=cli.positive_int, default=32, help="greedy tokens generated per row")
    p.add_argument("--rounds", type=cli.positive_int, default=2, help="turns of every method (median)")
    p.add_argument("--kernel", default="auto", choices=("auto", "cpu", "torch"), help="decode kernels (as generate.py)")
    p.add_argument("--goal", type=float, default=1.15,
                   help="print the acceptance each speculator would need for this speedup over dense at its measured "
                        "step costs (default 1.15)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every method's steps (the speculators' draft steps and verify passes); an "
                        "untimed generation of each compiles them first")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--predict", default=None, metavar="SHAPE",
                   help="time nothing: the byte model's speedup for this published shape (model.SHAPES) at "
                        "--prompt-tokens, --batch-size, --speculate-k and --acceptance, in --dtype")
    p.add_argument("--draft-shape", default=None, help="--predict: the draft model's shape (default: SparQ self-speculation)")
    p.add_argument("--compression", default="1/8", help="--predict: the SparQ draft's KV transfers (of dense)")
    p.add_argument("--acceptance", default="0.6,0.8,0.9", help="--predict: comma list of acceptance rates")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.predict:
        return predict(args)
    import torch

    import data
    from decoding import Generator
    from speculation import Speculator, acceptance_needed, speculation_summary
    from assemble import check_same_tokenizer, kernels_for, load_checkpoint, load_tokenizer, model_args
    from policies import AttentionSettings, policy_factory

    contexts = cli.int_list(args.prompt_tokens, "--prompt-tokens")
    batches = cli.int_list(args.batch_size, "--batch-size")
    ks = cli.int_list(args.speculate_k, "--speculate-k")
    dtype = cli.name_list(args.dtype, "dtype", DTYPES)[0]
    from convert_hf_checkpoint import resolve_checkpoint

    args.checkpoint = resolve_checkpoint(args.checkpoint)  # a .gguf file or an HF directory: converted once
    config = model_args(args.checkpoint)
    tok = load_tokenizer(args.checkpoint)
    kernels = kernels_for(args.kernel, "cpu", config)
    model = load_checkpoint(args.checkpoint, "cpu", torch_dtype(dtype), kernels)
    draft = None
    if args.draft_checkpoint:
        draft_config = model_args(args.draft_checkpoint)
        check_same_tokenizer(tok, load_tokenizer(args.draft_checkpoint), draft_config, config)
        draft = load_checkpoint(args.draft_checkpoint, "cpu", torch_dtype(dtype),
                                kernels_for(args.kernel, "cpu", draft_config))
    longest = max(contexts) + args.new_tokens + max(ks) + 1
    if longest > config.max_context:
        raise UserError(f"--prompt-tokens plus --new-tokens and --speculate-k exceed the model's context of "
                        f"{config.max_context} tokens")
    essay = data.essay_tokens(tok, max(contexts))
    sparq = AttentionSettings("sparq", sparq_r=args.sparq_r, sparq_k=args.sparq_k)
    try:
        layers = {name: [policy_factory(s, config, kernels)(i) for i in range(config.n_layer)]
                  for name, s in (("dense", AttentionSettings("dense")), ("sparq", sparq))}
    except ValueError as e:
        raise UserError(str(e)) from None

    print(f"# speculate, {args.checkpoint}, {dtype}, threads={torch.get_num_threads()}, kernels={kernels.name}, "
          f"{'compiled' if args.compile else 'eager'}, "
          f"SparQ r={args.sparq_r} k={args.sparq_k}, {args.new_tokens} greedy tokens per row, median of "
          f"{args.rounds} rounds" + (f", draft model {args.draft_checkpoint}" if draft else ""))
    print(f"{'context':>8} {'B':>3} {'method':<14} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/round':>9} "
          f"{'theory':>7} {'= dense':>7} {'accept for ' + format(args.goal, 'g') + 'x':>16}", flush=True)
    rows_out = []
    for context in contexts:
        for B in batches:
            prompt = essay[:context]
            cache_length = context + args.new_tokens + max(ks) + 1
            engines: dict[str, tuple] = {}  # method -> (kind, payload)
            model.setup_caches(B, cache_length)
            model.set_decode_attention(lambda i: layers["dense"][i])
            first = prefill_every_row(model, prompt, B)
            saved = model.save_caches()
            if draft is not None:
                draft.setup_caches(B, cache_length)
                draft.set_decode_attention(policy_factory(AttentionSettings("dense"), draft.args, draft.kernels))
                prefill_every_row(draft, prompt, B)
                draft_saved = draft.save_caches()
            for name in ("dense", "sparq"):
                engines[name] = ("generator", (layers[name], Generator(model, compile_decode=args.compile,
                                                                       compile_name=f"{name}_{context}_{B}")))
            for n in ks:
                engines[f"sparq-draft k={n}"] = ("speculator", Speculator(
                    model, n, layers["dense"], layers["sparq"], compile=args.compile, compile_name=f"self_{n}_{context}_{B}"))
                if draft is not None:
                    engines[f"model-draft k={n}"] = ("speculator", Speculator(
                        model, n, layers["dense"], draft_model=draft, compile=args.compile,
                        compile_name=f"model_{n}_{context}_{B}"))
            times: dict[str, list[float]] = {name: [] for name in engines}
            results: dict[str, tuple] = {}

            def run_engine(name: str, new_tokens: int):
                kind, payload = engines[name]
                model.restore_caches(saved)
                if draft is not None:
                    draft.restore_caches(draft_saved)
                if kind == "speculator":
                    return payload.decode(first, [context] * B, new_tokens)
                policies, generator = payload
                model.set_decode_attention(lambda i: policies[i])
                return generator.decode(first, [context] * B, new_tokens)

            if args.compile:  # an untimed generation of each compiles its steps (every length: dynamic)
                torch._dynamo.config.recompile_limit = 64
                for name in engines:
                    run_engine(name, args.new_tokens)
            for _ in range(args.rounds):
                for name in engines:
                    tokens, stats = run_engine(name, args.new_tokens)
                    times[name].append(stats.decode_s / max(stats.steps, 1))
                    results[name] = (tokens, stats)
            dense_s = statistics.median(times["dense"])
            for name, (tokens, stats) in results.items():
                seconds = statistics.median(times[name])
                row = {"prompt_tokens": context, "batch_size": B, "method": name, "dtype": dtype, "compiled": args.compile,
                       "decode_tokens_per_s": 1 / seconds, "speedup_vs_dense": dense_s / seconds,
                       "same_tokens_as_dense": tokens == results["dense"][0]}
                if stats.rounds:
                    n = engines[name][1].n
                    row.update(speculate_k=n, **speculation_summary(stats, n))
                    # the speedup over dense these step costs and this acceptance predict (dense's step measured)
                    row["theory_vs_dense"] = (row["tokens_per_round"] * dense_s
                                              / (n * row["draft_step_s"] + row["verify_pass_s"]))
                    row["goal"] = args.goal  # and the acceptance it needs at these costs (None: out of reach)
                    row["acceptance_for_goal"] = acceptance_needed(args.goal, n, row["draft_step_s"],
                                                                   row["verify_pass_s"], dense_s)
                rows_out.append(row)
                print(_line(row), flush=True)
    if args.json:
        cli.write_json(args.json, {"rows": rows_out})
    return 0


def weight_bytes(args, dtype) -> int:
    """Bytes of the weights a decode step of a model of `args` reads (built on the meta device: nothing
    is allocated)."""
    import torch

    from model import Transformer

    with torch.device("meta"):
        return Transformer(args).to(dtype).weight_bytes()


def kv_bytes(args, dtype, batch: int, seq_len: int, settings) -> int:
    """KV bytes one decode step of a model of `args` reads at seq_len, batch rows, its layers running
    `settings`' policy."""
    import torch

    from budgets import layer_transfers

    from policies import policy_factory

    element = torch.finfo(dtype).bits // 8
    return layer_transfers(policy_factory(settings, args), args, seq_len) * args.n_kv_head * batch * element


def predict(args) -> int:
    """--predict: the byte model's speedups (module docstring), one row per context, batch, n and acceptance."""
    from fractions import Fraction

    from speculation import speculative_speedup
    from model import ModelArgs
    from budgets import solve_budget
    from policies import AttentionSettings

    verifier = ModelArgs.from_shape(args.predict)
    draft = ModelArgs.from_shape(args.draft_shape) if args.draft_shape else None
    dtype = torch_dtype(cli.name_list(args.dtype, "dtype", DTYPES)[0])
    accept = [float(a) for a in args.acceptance.split(",")]
    if not all(0 <= a <= 1 for a in accept):
        raise UserError(f"--acceptance values must be in [0, 1], got {args.acceptance!r}")
    try:
        target = Fraction(args.compression)
    except (ValueError, ZeroDivisionError):
        raise UserError(f"bad --compression {args.compression!r} (expected e.g. 1/8)") from None
    dense = AttentionSettings("dense")
    drafter = args.draft_shape or f"SparQ at {args.compression} of the KV bytes (r solved at k = {args.sparq_k})"
    print(f"# predicted speedup of speculation over {args.predict} alone, {args.dtype}, bandwidth-bound steps: "
          f"draft {drafter}")
    print(f"{'context':>8} {'B':>4} {'verifier step':>14} {'draft step':>11} {'n':>3} "
          + " ".join(f"{'a=' + str(a):>7}" for a in accept))
    rows = []
    verifier_weights = weight_bytes(verifier, dtype)
    draft_weights = verifier_weights if draft is None else weight_bytes(draft, dtype)
    for context in cli.int_list(args.prompt_tokens, "--prompt-tokens"):
        for B in cli.int_list(args.batch_size, "--batch-size"):
            verify = verifier_weights + kv_bytes(verifier, dtype, B, context, dense)
            if draft is None:
                budget = solve_budget("sparq", target, context, verifier, AttentionSettings("sparq", sparq_k=args.sparq_k))
                draft_step = draft_weights + kv_bytes(verifier, dtype, B, context, budget.settings)
            else:
                draft_step = draft_weights + kv_bytes(draft, dtype, B, context, dense)
            for n in cli.int_list(args.speculate_k, "--speculate-k"):
                speedups = [speculative_speedup(a, n, draft_step, verify) for a in accept]
                rows.append({"prompt_tokens": context, "batch_size": B, "speculate_k": n, "verifier_step_bytes": verify,
                             "draft_step_bytes": draft_step,
                             "predicted_speedup": dict(zip(map(str, accept), speedups))})
                print(f"{context:>8} {B:>4} {verify / 1e9:>11.2f} GB {draft_step / 1e9:>8.2f} GB {n:>3} "
                      + " ".join(f"{s:>6.2f}x" for s in speedups))
    if args.json:
        cli.write_json(args.json, {"rows": rows})
    return 0


def prefill_every_row(model, prompt: list[int], rows: int):
    """Prefill the prompt once into row 0 and copy it into the other rows (every row holds the same
    prompt): the first token of each row (rows,)."""
    import torch

    from decoding import prefill

    with torch.no_grad():
        first = prefill(model, torch.tensor([prompt]), progress=True).argmax(dim=-1)
    for cache in model.caches:
        cache.broadcast_row(rows)
    return first.expand(rows).contiguous()


def _line(row: dict) -> str:
    spec = (f"{row['acceptance_rate']:>7.2f} {row['tokens_per_round']:>9.2f} {row['theory_vs_dense']:>6.2f}x"
            if "acceptance_rate" in row else f"{'':>7} {'':>9} {'':>7}")
    needed = ""
    if "acceptance_for_goal" in row:
        a = row["acceptance_for_goal"]
        needed = f"{'out of reach' if a is None else format(a, '.2f'):>16}"
    return (f"{row['prompt_tokens']:>8} {row['batch_size']:>3} {row['method']:<14} {row['decode_tokens_per_s']:>8.2f} "
            f"{row['speedup_vs_dense']:>7.2f}x {spec} {'yes' if row['same_tokens_as_dense'] else 'NO':>7} {needed}")
