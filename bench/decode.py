"""`python -m bench decode`: the whole model's decode step on a checkpoint (or random weights of a
shape), dense and SparQ from the same prefilled cache in one process, every context and batch size
taking turns step by step; tokens/s, KV GB/s (bytes by the transfer formulas), measured speedup and
the theoretical one: (weights + dense KV bytes) / (weights + SparQ KV bytes) per step.
--prefill also times our prefill of each context (N tokens into an empty cache), and --llamacpp
GGUF times llama.cpp (bench/llamacpp.py) after the same contexts in the same format (or
--llamacpp-format's): one run, side by side; with --rounds N, ours and llama.cpp take turns N times
and cells are medians.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import cli
from bench.common import DTYPES, cache_formats, last_level_cache_bytes, torch_dtype
from cli import UserError


def add_parser(sub) -> None:
    """The `decode` subcommand's flags."""
    p = sub.add_parser("decode", help="end-to-end decode on a checkpoint: dense vs SparQ")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", default="checkpoints/SmolLM2-135M-Instruct", help="model.pth or its directory, a .gguf file or a Hugging Face directory (converted once, beside it)")
    model.add_argument("--random-weights", metavar="SHAPE",
                       help="no checkpoint: random weights of a published shape (model.SHAPES: llama-2-7b, "
                            "smollm2, ...), a random prompt, no tokenizer")
    p.add_argument("--prompt-tokens", default="1024,4096,8192",
                   help="comma list of context lengths (0 = the first token; near the model's context the "
                        "timed steps start early enough to end at it)")
    p.add_argument("--batch-size", default="1,4,8", help="comma list")
    p.add_argument("--dtype", default="float32", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--sparq-r", default=None, help="comma list: one SparQ policy per r, each beside dense (default 16)")
    p.add_argument("--compression", default=None,
                   help="comma list of targets (1/8,1/4), instead of --sparq-r: r solved for each at the longest "
                        "context, as generate.py --compression solves it (in the bytes of the first --cache-format "
                        "and --dtype)")
    p.add_argument("--adaptive", action="store_true",
                   help="also time sparq-adaptive at each --compression target (its own split per layer and step)")
    p.add_argument("--sparq-k", type=int, default=128)
    p.add_argument("--sparq-local", type=int, default=None, help="default k // 4")
    p.add_argument("--sparq-mean-v", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--kernel", default="auto", choices=("auto", "cpu", "torch"), help="decode kernels (as generate.py)")
    p.add_argument("--quantized-kernel", default="auto",
                   help="a quantized checkpoint's linears (as generate.py: quantize.BACKENDS, checked at load)")
    p.add_argument("--cache-format", default="auto",
                   help="comma list of KV cache formats KV[/KT[/SCALE]] (generate.py's --kv-dtype, --kt-dtype and "
                        "--kt-scale-dtype), e.g. auto,int8,int8/int4: every policy runs on each, with its own "
                        "caches; speedups are over dense on the first")
    p.add_argument("--llamacpp", default=None, metavar="GGUF",
                   help="also time llama.cpp (bench/llamacpp.py, built on first use) after the same contexts on this GGUF "
                        "(the checkpoint's source), in each --dtype's format, and print it beside our rows")
    p.add_argument("--llamacpp-format", default=None,
                   help="llama.cpp's format for every --dtype (bench/llamacpp.py's formats; default: the dtype's own), "
                        "e.g. q8_0 beside an int8 checkpoint")
    p.add_argument("--llamacpp-kv", default=None, metavar="TYPE",
                   help="llama.cpp's KV cache type (llama-bench -ctk/-ctv TYPE -fa 1), e.g. q8_0 beside "
                        "--cache-format int8")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the timing this many times, ours and llama.cpp taking turns; cells are medians")
    p.add_argument("--ragged", default=None,
                   help="also time one batch of rows at these different contexts (comma list), e.g. 1024,4096,8192")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (dynamic shapes)")
    p.add_argument("--compile-backend", choices=("aot", "inductor"), default=None,  # decoding.COMPILE_BACKENDS (torch
                   # is imported after the flags are read: THP_MEM_ALLOC_ENABLE, bench/__main__.py)
                   help="with --compile: the step built ahead of time by AOTInductor (aot: the CPU's default, as "
                        "generate.py --compile) or torch.compile's inductor")
    p.add_argument("--prefill", action="store_true",
                   help="also time our prefill of each context (N tokens into an empty cache, B = 1), printed "
                        "with the rows and beside llama.cpp's prefill with --llamacpp")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--plot", default=None, help="write a PNG: tokens/s vs context")
    p.set_defaults(func=run)


def _cache_evictor() -> Callable[[], None]:
    """A call that writes twice the last-level cache's size: whatever an untimed step before it left
    in the CPU's caches (a cache rewind reads the whole live V) is gone when the timed step starts,
    as it is in generation, where every layer's weights and KV pass through between two reads."""
    import torch

    scratch = torch.zeros(2 * last_level_cache_bytes() // 4, dtype=torch.float32)
    return lambda: scratch.add_(1.0)


def _time_decode(step: dict[tuple[int, str], Callable], model, policies: dict[str, list], cases: list[list[int]], steps: int,
                 warmup: int, progress=None, evict: Optional[Callable[[], None]] = None,
                 caches: Optional[dict[str, list]] = None) -> list[dict[str, float]]:
    """Seconds per decode step (median, after warm-up) of each policy in each case, step[case index,
    policy] its step function; a case is the first decode position of each of its rows (rows alike, or ragged:
    each row at its own live length). Step i of a case times the step at its positions + i + 1.

    Cases and policies take turns step by step (case 1 dense step i, case 1 SparQ step i, case 2 dense
    step i, ..., then step i + 1), each policy from the same live positions, so a slow spell of the
    machine (here its speed drifts by up to 2x within an hour) lands on every row of the table alike
    rather than on whichever ran during it. One prefill of the longest prompt serves every case: a
    step rewinds the caches to its own live positions first, then evict() (if given) clears the CPU's
    caches of what the rewind read, then an untimed step of the same policy (the lead-in) leaves in
    them what a step leaves for the next in generation: the timed step that follows it starts as
    generation's steps do (warm where weights and the KV it reads fit the caches, as llama-bench's
    steps are), neither colder (the eviction alone) nor warmer (the rewind's reads). caches: each
    policy's own KV caches (one per layer; a cache format of its own), installed before its steps."""
    import torch

    times = [{name: [] for name in policies} for _ in cases]
    label = progress.postfix if progress is not None else None  # the caller's, back after the first round
    with torch.no_grad():
        for i in range(warmup + steps):
            for c, (starts, case_times) in enumerate(zip(cases, times)):
                B, top = len(starts), max(starts)
                token = torch.zeros(B, 1, dtype=torch.long)
                ragged = len(set(starts)) > 1
                for name, layers in policies.items():
                    if caches is not None:
                        _install_caches(model, caches[name])
                    for cache in model.caches:
                        cache.rewind(top + i)  # positions [0, top + i) live, whatever the last step wrote
                    if ragged:  # every row holds the same essay: row b's live prefix is its first starts[b] + i tokens
                        model.set_live_lengths(torch.tensor(starts) + i)
                    positions = (torch.tensor(starts).view(B, 1) if ragged else torch.tensor([top])) + i
                    model.set_decode_attention(lambda layer, layers=layers: layers[layer])
                    if evict is not None:
                        evict()
                    if i == 0 and progress is not None:  # a compiled step builds on its first call: minutes
                        progress.set_postfix_str(f"first step of {name}, case {c + 1} of {len(cases)}")
                    step[c, name](model, token, positions, top + i + 1)  # the lead-in, untimed
                    t0 = time.perf_counter()
                    step[c, name](model, token, positions + 1, top + i + 2)
                    case_times[name].append(time.perf_counter() - t0)
            if progress is not None:
                if i == 0:
                    progress.set_postfix_str(label or "", refresh=False)
                progress.update(1)
    return [{name: statistics.median(t[warmup:]) for name, t in case_times.items()} for case_times in times]


def _install_caches(model, caches: list) -> None:
    for layer, cache in zip(model.layers, caches):
        layer.attention.kv_cache = cache


def _first_decode_positions(contexts: list[int], max_context: int, steps: int) -> dict[int, int]:
    """Context -> position of its first decode step: the context itself, or earlier if the
    warm-up and timed steps would run past the model's context (then the last step ends there)."""
    starts = {c: min(c, max_context - steps) for c in contexts}
    if min(starts.values()) < 0:
        raise UserError(f"--warmup plus --steps ({steps}) exceeds the model's context of {max_context} tokens")
    return starts


def _time_prefills(model, prompt, contexts: list[int], progress) -> dict[int, float]:
    """Our prefill tokens/s of a prompt of N tokens into an empty cache (llama-bench's pp N), for
    each context N > 0: the first N tokens of `prompt`, one timed prefill each after a warm-up one
    (generate.py's chunked prefill, dense, B = 1)."""
    import torch

    from decoding import prefill

    tok_s = {}
    with torch.no_grad():
        prefill(model, prompt[:, :64])  # warm-up: thread pools, allocator, kernel loading
        for n in sorted(c for c in set(contexts) if c > 0):
            progress.set_postfix_str(f"timing prefill of {n} tokens")
            start = time.perf_counter()
            prefill(model, prompt[:, :n])
            tok_s[n] = n / (time.perf_counter() - start)
    return tok_s


def run(args) -> int:
    from dataclasses import replace

    import torch
    from tqdm import tqdm

    import data
    import quantize
    from decoding import compiled_decode_step, decode_step, own_step, prefill
    from assemble import kernels_for, load_checkpoint, load_tokenizer
    from model import ModelArgs, checkpoint_paths, random_model
    from budgets import Storage, solve_target
    from policies import AttentionSettings, parse_compression, policy_factory

    contexts = cli.int_list(args.prompt_tokens, "--prompt-tokens", minimum=0)
    batches = cli.int_list(args.batch_size, "--batch-size")
    dtypes = cli.name_list(args.dtype, "dtype", DTYPES)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    if args.rounds < 1:
        raise UserError("--rounds must be at least 1")
    if args.compile_backend is not None and not args.compile:
        raise UserError(f"--compile-backend {args.compile_backend} builds the compiled step: give --compile")
    if args.compile and args.compile_backend is None:
        from decoding import default_compile_backend

        args.compile_backend = default_compile_backend("cpu")
    quantize.check_backend(args.quantized_kernel)
    if (args.llamacpp_format or args.llamacpp_kv) and not args.llamacpp:
        raise UserError("--llamacpp-format and --llamacpp-kv need --llamacpp GGUF")
    if args.llamacpp and args.random_weights:
        raise UserError("--llamacpp times the checkpoint's GGUF: not with --random-weights")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_weights:
        model_args = ModelArgs.from_shape(args.random_weights)
    else:
        from convert_hf_checkpoint import resolve_checkpoint

        args.checkpoint = resolve_checkpoint(args.checkpoint)  # a .gguf file or an HF directory: converted once
        tok = load_tokenizer(args.checkpoint)
        model_args = ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json")
    starts = _first_decode_positions(contexts, model_args.max_context, args.warmup + args.steps + 1)  # + the lead-in
    formats = cache_formats(args.cache_format)
    kernels = kernels_for(args.kernel, "cpu", model_args, kv_formats=[f for _, f in formats])  # one kernel family
    if args.compression and args.sparq_r:
        raise UserError("--compression solves --sparq-r: give one or the other")
    if args.adaptive and not args.compression:
        raise UserError("--adaptive times sparq-adaptive at the --compression targets: give --compression")
    # (label, first decode position of each row): every context at every batch size, then the ragged case
    cases = [(str(context), [starts[context]] * B) for context in contexts for B in batches]
    if args.ragged:
        ragged = cli.int_list(args.ragged, "--ragged", minimum=1)
        if max(ragged) + args.warmup + args.steps > model_args.max_context:
            raise UserError(f"--ragged contexts plus --warmup and --steps exceed the model's context of "
                            f"{model_args.max_context} tokens")
        cases.append(("/".join(map(str, ragged)), ragged))
    longest = max(max(rows_) for _, rows_ in cases)
    max_rows = max(len(rows_) for _, rows_ in cases)
    sparq = AttentionSettings("sparq", sparq_k=args.sparq_k, sparq_local=args.sparq_local, sparq_mean_v=args.sparq_mean_v)
    if args.compression:
        targets = [parse_compression(t) for t in args.compression.split(",") if t.strip()]
        storage = Storage(formats[0][1], torch_dtype(dtypes[0]))
        budgets = [solve_target(replace(sparq, compression=t), longest, model_args, storage) for t in targets if t < 1]
        for budget in budgets:
            print(f"budget: {budget.describe()}", file=sys.stderr)
        r_values = list(dict.fromkeys(b.r for b in budgets))
    else:
        r_values = cli.int_list(args.sparq_r or "16", "--sparq-r")
    settings = {"dense": AttentionSettings("dense")}
    for r in r_values:  # one SparQ policy per r: "sparq", or "sparq-r16", "sparq-r32", ...
        settings["sparq" if len(r_values) == 1 else f"sparq-r{r}"] = replace(sparq, sparq_r=r)
    adaptive_targets = [b.target for b in budgets] if args.adaptive else []
    for t in adaptive_targets:  # "sparq-adaptive", or "sparq-adaptive-1/8", ...
        settings["sparq-adaptive" if len(adaptive_targets) == 1 else f"sparq-adaptive-{t}"] = AttentionSettings(
            "sparq-adaptive", compression=t, sparq_k=args.sparq_k, sparq_mean_v=args.sparq_mean_v)
    try:
        factories = {name: policy_factory(s, model_args, kernels) for name, s in settings.items()}
    except ValueError as e:
        raise UserError(str(e)) from None
    if len(settings) == 1:
        raise UserError("--compression: every target is 1 (dense); give one below 1")
    config = factories[list(settings)[1]](0).config  # k, local, mean-V: shared by the SparQ policies
    if args.random_weights:
        prompt = torch.randint(model_args.vocab_size, (1, max(1, longest)), generator=torch.Generator().manual_seed(0))
    else:
        prompt = torch.tensor([data.essay_tokens(tok, max(1, longest))])
    cache_length = longest + args.warmup + args.steps + 1  # + each timed step's lead-in

    llama = _LlamaCpp(args, contexts) if args.llamacpp else None  # checked and built before any output
    source = f"random weights of the {args.random_weights} shape" if args.random_weights else args.checkpoint
    print(f"# decode, {source}, threads={torch.get_num_threads()}, kernels={kernels.name}, "
          f"{'compiled (' + args.compile_backend + ')' if args.compile else 'eager'}, SparQ r={','.join(map(str, r_values))} k={config.k_top} local={config.local} "
          f"mean_v={config.mean_v}, median of {args.steps} steps after {args.warmup}, cases and policies taking turns step by step, "
          f"each timed step after an untimed one of its own")
    print(_DECODE_HEADER, flush=True)
    rows, theirs = [], {}
    progress = tqdm(total=len(dtypes) * args.rounds * (args.warmup + args.steps), desc="decode bench", unit="step",
                    file=sys.stderr)
    for dtype_name in dtypes:
        model = (random_model(model_args, "cpu", torch_dtype(dtype_name), kernels) if args.random_weights
                 else load_checkpoint(args.checkpoint, "cpu", torch_dtype(dtype_name), kernels, args.quantized_kernel))
        policies, caches, format_of = {}, {}, {}
        for f, (label, kv_format) in enumerate(formats):
            try:
                kv_format.kv_storage(model.cache_dtype)
            except ValueError as e:
                raise UserError(f"--cache-format {label}: {e}") from None
            model.setup_caches(max_rows, cache_length, kv_format)
            if f == 0:  # prefill speed on the first format's caches
                prefill_tok_s = _time_prefills(model, prompt, contexts, progress) if args.prefill else {}
            # one dense prefill of the longest prompt serves every shorter context (causal); --prefill's
            # timed prefill of that whole prompt, when it was one of the contexts, already wrote it
            if f or prompt.shape[1] not in prefill_tok_s:
                with torch.no_grad():
                    progress.set_postfix_str(f"prefill {prompt.shape[1]} tokens, {dtype_name}, cache {label}")
                    prefill(model, prompt, progress=True)
            for cache in model.caches:
                cache.broadcast_row(max_rows)
            for name, make in factories.items():  # the first format's policies keep their names
                key = name if f == 0 else f"{name} {label}"
                policies[key] = [make(i) for i in range(model_args.n_layer)]
                caches[key], format_of[key], settings[key] = model.caches, label, settings[name]
        weights = model.weight_bytes()
        step_fns = {(c, name): decode_step for c in range(len(cases)) for name in policies}
        if args.compile:
            # each (case, policy) its own step (decoding.own_step): a graph per step and dtype, more
            # than dynamo's default of 8 recompiles in one process
            torch._dynamo.config.recompile_limit = 64
            step_fns = {(c, name): compiled_decode_step(own_step(decode_step, f"{name}_{c}"), "cpu",
                                                       args.compile_backend)
                        for c in range(len(cases)) for name in policies}
        progress.set_postfix_str(f"{dtype_name}: {len(cases)} cases x {len(policies)} policies taking turns")
        # rounds: ours (every case and policy in turns), then llama.cpp, then ours again, ...: a slow
        # spell of the machine lands on both; each cell is the median over the rounds
        evict, per_round, their_rounds = _cache_evictor(), [], []
        for round_ in range(args.rounds):
            per_round.append(_time_decode(step_fns, model, policies, [starts_ for _, starts_ in cases], args.steps,
                                          args.warmup, progress, evict=evict, caches=caches))
            if llama is not None:
                progress.clear()
                their_rounds.append(llama.time(dtype_name, prefill=args.prefill and round_ == 0))
        case_seconds = [{name: statistics.median(r[c][name] for r in per_round) for name in policies}
                        for c in range(len(cases))]
        if llama is not None:
            theirs.update(_median_rounds(their_rounds, dtype_name))
        for (label, row_starts), seconds in zip(cases, case_seconds):
            B = len(row_starts)
            live = [start + args.warmup + args.steps // 2 + 1 for start in row_starts]  # at the median step
            kv = {}
            for name, layers in policies.items():
                _install_caches(model, caches[name])
                model.set_decode_attention(lambda i, layers=layers: layers[i])
                kv[name] = sum(model.decode_kv_bytes(S, 1) for S in live)  # every row at its own length
            for name in policies:
                rows.append({
                    "prompt_tokens": label if "/" in label else int(label), "live_length": max(live),
                    "batch_size": B, "dtype": dtype_name,
                    "attention": name, "cache_format": format_of[name], "sparq_r": settings[name].sparq_r, "kernel": kernels.name, "compiled": args.compile,
                    "compile_backend": args.compile_backend if args.compile else None,
                    "adaptive_compression": (float(settings[name].compression)
                                             if settings[name].policy == "sparq-adaptive" else None),
                    "threads": torch.get_num_threads(),
                    "prefill_tokens_per_s": prefill_tok_s.get(label if "/" in label else int(label)),
                    "decode_tokens_per_s": 1 / seconds[name], "total_tokens_per_s": B / seconds[name],
                    "weight_bytes": weights, "kv_bytes_read_per_step": kv[name],
                    "kv_gb_s": kv[name] / seconds[name] / 1e9, "gb_s": (weights + kv[name]) / seconds[name] / 1e9,
                    "speedup_vs_dense": seconds["dense"] / seconds[name],
                    "theoretical_speedup": (weights + kv["dense"]) / (weights + kv[name]),
                    "theoretical_kv_speedup": kv["dense"] / kv[name],
                })
            case_rows = rows[-len(policies):]  # dense first
            for sparq in case_rows[1:]:
                progress.write(_decode_row_line(case_rows[0], sparq))
    progress.close()
    _print_decode_table(rows, config, kernels.name, args.compile)
    if llama is not None:
        _beside_llamacpp(rows, theirs, llama, contexts, dtypes)
    if args.json:
        cli.write_json(args.json, {"rows": rows, "llamacpp": list(theirs.values())})
    if args.plot:
        _plot_decode(rows, args.plot)
    return 0


LLAMACPP_FORMATS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # our dtype -> llama.cpp's format


class _LlamaCpp:
    """llama.cpp (bench/llamacpp.py: built from llama-cpp-python's sdist, an optional extra) on the GGUF of
    --llamacpp, requantized into each dtype's format (--llamacpp-format: one format for every dtype,
    e.g. q8_0 beside an int8 checkpoint), timed after the same contexts as ours."""

    def __init__(self, args, contexts: list[int]):
        from bench import llamacpp

        if args.llamacpp_format and args.llamacpp_format not in llamacpp.FORMATS:
            raise UserError(f"unknown --llamacpp-format {args.llamacpp_format!r} (choose from {', '.join(llamacpp.FORMATS)})")
        if not Path(args.llamacpp).is_file():
            raise UserError(f"GGUF file not found: {args.llamacpp}")
        self.build = llamacpp.build()
        self.args, self.contexts = args, [max(c, 1) for c in contexts]
        self.ggufs: dict[str, Path] = {}

    def format(self, dtype: str) -> str:
        return self.args.llamacpp_format or LLAMACPP_FORMATS[dtype]

    def time(self, dtype: str, prefill: bool) -> list[dict]:
        """One llama-bench round in the dtype's format: decode after each context (and prefill)."""
        from bench import llamacpp

        fmt = self.format(dtype)
        if fmt not in self.ggufs:
            self.ggufs[fmt] = llamacpp.requantize(Path(self.args.llamacpp), fmt, build_=self.build)
        return llamacpp.time_decode(self.ggufs[fmt], self.contexts, self.args.steps, self.args.threads or 2,
                                    label=fmt, build_=self.build, prefill=prefill, kv_type=self.args.llamacpp_kv)


def _median_rounds(rounds: list[list[dict]], dtype: str) -> dict[tuple[str, int], dict]:
    """(dtype, context) -> llama.cpp's row of the first round, its decode tok/s the median over the
    rounds (each round's value kept in decode_tok_s_rounds); prefill is timed in the first round only."""
    merged = {}
    for i, row in enumerate(rounds[0]):
        values = [r[i]["decode_tok_s"] for r in rounds]
        merged[(dtype, row["context"])] = {**row, "decode_tok_s": statistics.median(values),
                                           "decode_tok_s_rounds": values}
    return merged


def _beside_llamacpp(rows: list[dict], theirs: dict, llama: _LlamaCpp, contexts: list[int],
                     dtypes: list[str]) -> None:
    """llama.cpp's rows (_LlamaCpp, timed in rounds between ours) printed beside our B = 1 rows."""
    from bench import llamacpp

    ours = {(r["dtype"], r["prompt_tokens"], r["sparq_r"]): r for r in rows  # r None: dense
            if r["batch_size"] == 1 and r.get("adaptive_compression") is None}
    rs = sorted({r for (_, _, r) in ours if r is not None})
    with_prefill = any(r.get("prefill_tokens_per_s") is not None for r in ours.values())  # bench --prefill
    rounds = len(next(iter(theirs.values()))["decode_tok_s_rounds"])
    print(f"\nbeside llama.cpp ({llama.build.version}; its decode after N tokens, llama-bench), B = 1, tok/s"
          + (f", medians of {rounds} rounds taking turns with ours" if rounds > 1 else ""))
    print(f"{'dtype':9} {'format':>6} {'context':>7} {'llama.cpp':>10} {'ours dense':>10} "
          + "".join(f"{f'SparQ r={r}':>11}" for r in rs) + f" {'dense/llama':>11}"
          + "".join(f"{f'r={r}/llama':>11}" for r in rs)
          + (f" {'llama prefill':>13} {'ours prefill':>12} {'ours/llama':>10}" if with_prefill else ""))
    for dtype in dtypes:
        for context in contexts:
            their_row = theirs[(dtype, max(context, 1))]
            them = their_row["decode_tok_s"]
            dense = ours[(dtype, context, None)]["decode_tokens_per_s"]
            sparq = [ours[(dtype, context, r)]["decode_tokens_per_s"] for r in rs]
            print(f"{dtype:9} {llama.format(dtype):>6} {context:7d} {them:10.1f} {dense:10.1f} " + "".join(f"{t:11.1f}" for t in sparq)
                  + f" {dense / them:10.2f}x" + "".join(f"{t / them:10.2f}x" for t in sparq)
                  + (_prefill_cells(ours[(dtype, context, None)], their_row) if with_prefill else ""))
    if note := llamacpp.busy_note(list(theirs.values())):
        print(note)


def _prefill_cells(ours: dict, theirs: dict) -> str:
    """llama.cpp's prefill tok/s, ours and their ratio ("-" where one was not timed, e.g. N = 0)."""
    them, us = theirs.get("prefill_tok_s"), ours.get("prefill_tokens_per_s")
    ratio = f"{us / them:9.2f}x" if them and us else f"{'-':>10}"
    return (f" {them:13.0f}" if them else f" {'-':>13}") + (f" {us:12.0f}" if us else f" {'-':>12}") + f" {ratio}"


_DECODE_HEADER = (f"{'dtype':9} {'context':>7} {'B':>3} {'r':>3} {'dense tok/s':>11} {'SparQ tok/s':>11} {'speedup':>7} "
                  f"{'theory':>6} {'KV theory':>9} {'dense GB/s':>10} {'SparQ GB/s':>10} {'dense KV GB/s':>13} "
                  f"{'SparQ KV GB/s':>13} policy")


def _decode_row_line(dense: dict, sparq: dict) -> str:
    r = "-" if sparq["sparq_r"] is None else sparq["sparq_r"]  # sparq-adaptive: r per layer and step
    return (f"{dense['dtype']:9} {str(dense['prompt_tokens']):>7} {dense['batch_size']:3d} {r:>3} "
            f"{dense['decode_tokens_per_s']:11.2f} {sparq['decode_tokens_per_s']:11.2f} "
            f"{sparq['speedup_vs_dense']:6.2f}x {sparq['theoretical_speedup']:5.2f}x "
            f"{sparq['theoretical_kv_speedup']:8.2f}x {dense['gb_s']:10.2f} {sparq['gb_s']:10.2f} "
            f"{dense['kv_gb_s']:13.2f} {sparq['kv_gb_s']:13.2f} {sparq['attention']}")


def _print_decode_table(rows: list[dict], config, kernel: str, compiled: bool) -> None:
    print(f"\ndecode, SparQ k={config.k_top} local={config.local} mean_v={config.mean_v} "
          f"kernel={kernel}{' compiled' if compiled else ' eager'}; tok/s per sequence; "
          f"GB/s = (weights + KV bytes read) / step time")
    print(_DECODE_HEADER)
    by_key = {(r["dtype"], r["prompt_tokens"], r["batch_size"], r["attention"]): r for r in rows}
    for (dtype, context, B, attention), sparq in by_key.items():
        if attention != "dense":
            print(_decode_row_line(by_key[(dtype, context, B, "dense")], sparq))
    prefills = {(r["dtype"], r["prompt_tokens"]): r["prefill_tokens_per_s"] for r in rows
                if r.get("prefill_tokens_per_s") is not None}
    for dtype in dict.fromkeys(d for d, _ in prefills):
        print(f"prefill, {dtype}, B = 1, tok/s of N tokens into an empty cache: "
              + ", ".join(f"N={n}: {t:.0f}" for (d, n), t in prefills.items() if d == dtype))


def _plot_decode(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        uniform = [r for r in rows if isinstance(r["prompt_tokens"], int)]  # the ragged case is in the table only
        for B in sorted({r["batch_size"] for r in uniform}):
            for attention in dict.fromkeys(r["attention"] for r in uniform):
                style = "--" if attention == "dense" else "-"
                pts = sorted((r["prompt_tokens"], r["total_tokens_per_s"]) for r in uniform
                             if r["dtype"] == dtype and r["batch_size"] == B and r["attention"] == attention)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{attention} B={B}")
        ax.set(title=f"decode throughput ({dtype})", xlabel="context (tokens)", ylabel="tokens/s (all rows)",
               xscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------
# linear: the decode-step GEMV, torch F.linear vs the fused CPU kernel, on a model's weight shapes
