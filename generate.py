"""Generate text with dense or SparQ decode attention, and report speed honestly: the command line
of the decode engine in decoding.py.

    python generate.py --prompt "Tell me a story" --chat
    python generate.py --checkpoint checkpoints/SmolLM2-135M-Instruct --prompt-tokens 4096 --sparq-r 32
    python generate.py --prompt-file prompts.jsonl --sparq-r 16 --json out.json   # a batch of different prompts
    python generate.py --interactive                                               # chat at the terminal
    python generate.py --random-weights llama-2-7b --prompt-tokens 16384 --sparq-r 32 --compile  # a GPU, no checkpoint

"Bandwidth achieved" counts the weight bytes plus the KV-cache bytes each decode step reads
(by the transfer formulas of the attention policy in use), not the weights alone.

A prompt file ending in .jsonl holds one prompt per line, {"prompt": "...", "chat": true} ("chat"
optional, default --chat); they run as one batch of rows of different lengths, each at its own
positions (no left padding), and the JSON output keeps one sample per prompt, in input order.
Any other prompt file is one prompt: its whole text.

--random-weights SHAPE builds a published shape (model.SHAPES) with random weights and loads no
checkpoint and no tokenizer (a GPU machine that carries no files): --prompt-tokens N is then N random
token ids, and the output is token ids.

Defaults follow the device: CUDA when one is available, in bfloat16 there (gpt-fast's), else the CPU
in float32.
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

import cli
import data
import quantize
import tp
from assemble import (DTYPES, TokenIds, add_cache_flags, add_model_flags, allocate_caches, cache_format, cache_storage,
                      check_same_tokenizer, describe_format, kernels_for, load_checkpoint, load_tokenizer, model_args,
                      solve_compression)
from cli import UserError
from convert_hf_checkpoint import resolve_checkpoint
from chat import chat_loop
from decoding import COMPILE_BACKENDS, DecodeStats, Generator, TextStream, default_compile_backend
from kernels import KERNEL_CHOICES, Kernels
from cache import KVFormat
from model import ModelArgs, Transformer, random_model
from policies import (POLICIES, AttentionSettings, add_attention_flags, attention_settings, describe_layers,
                      install_policy, policy_factory)
from sampling import add_sampling_flags, sampling_from_flags
from speculation import Speculator, expected_tokens_per_round, speculation_summary


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, "no tokenizer either: give --prompt-tokens N, the output is token ids")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-file", type=Path,
                        help="a .jsonl file of prompts (one batch of rows of different lengths), or any other "
                             "file whose whole text is the prompt")
    prompt.add_argument("--prompt-tokens", type=cli.positive_int,
                        help="a synthetic prompt of exactly N tokens cut from the Paul Graham essays (with "
                             "--random-weights: N random token ids)")
    prompt.add_argument("--interactive", action="store_true",
                        help="chat at the terminal (the chat template; the conversation stays in the cache)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=200)
    p.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help="repeat the prompt in this many rows (default 1; a .jsonl prompt file sets the batch)")
    p.add_argument("--num-samples", type=cli.positive_int, default=1, help="repeat generation")
    add_sampling_flags(p)
    p.add_argument("--max-seq-length", type=cli.positive_int, default=None,
                   help="KV cache length (default: prompt + new tokens, capped at the model's context)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a CUDA device is available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights, activations and KV cache (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--threads", type=cli.positive_int, default=None,
                   help="torch threads (default: torch's, one per core; under torchrun each rank takes its share of the cores)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (a warm-up generation compiles it before the timed ones)")
    p.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=None,
                   help="with --compile: aot (the CPU's default) = the step built ahead of time by AOTInductor, "
                        "cached across runs, and run with no Python between its ops (faster at short "
                        "context than inductor: docs/cpu.md); inductor (CUDA's default, and the CPU's with "
                        "--speculate-k or torchrun) = torch.compile, dynamo checking its guards at every step")
    p.add_argument("--compile-prefill", action="store_true", help="torch.compile the prefill")
    p.add_argument("--length-bucket", type=cli.positive_int, default=None,
                   help="decode attention reads the live length rounded up to a multiple of this, masking "
                        "the rest (default: 1 on CPU = exact; 256 on CUDA = one CUDA graph per bucket)")
    p.add_argument("--no-stream", action="store_true", help="at batch size 1, print the text at the end, not as it comes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--profile", type=Path, default=None, metavar="PATH",
                   help=f"after the timed generation, trace {PROFILE_STEPS} decode steps with torch.profiler (CPU and, "
                        f"on CUDA, CUDA activities) into PATH, a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    add_cache_flags(p)
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto",
                   help="decode kernels: auto = the fused kernels of the device (cpu: C++ dense and SparQ attention "
                        "and linears; cuda: Triton SparQ), torch = plain PyTorch everywhere")
    p.add_argument("--quantized-kernel", choices=quantize.BACKENDS, default="auto",
                   help="a quantized checkpoint's linears (quantize.py): auto = the fastest that applies; gemv = the "
                        "fused GEMVs in fp32 (what auto takes on CPUs without AVX512_VNNI); "
                        "gemv-q8 = they round activations to int8 per group first (auto's choice with VNNI)")
    add_attention_flags(p)
    spec = p.add_argument_group("speculative decoding (greedy output is the verifier's own; sampled, distributed as its own)")
    spec.add_argument("--speculate-k", type=cli.positive_int, default=None, metavar="N",
                      help="tokens the draft proposes per round, verified in one pass")
    spec.add_argument("--draft-attention", choices=list(POLICIES), default=None,
                      help="the draft's decode attention: alone, self-speculation (the same model reading a fraction "
                           "of the same cache); the --sparq-*, --kv-budget and --compression flags then configure the "
                           "draft, and the verifier runs --attention (dense unless given)")
    spec.add_argument("--draft-checkpoint", type=Path, default=None,
                      help="a draft model (any checkpoint generate.py loads, sharing the tokenizer); with "
                           "--draft-attention it runs that policy, else dense")
    return p


DEFAULT_PROMPT = "Hello, my name is"
PROFILE_STEPS = 8  # decode steps --profile traces


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """The token ids of every row of the batch."""
    if isinstance(tokenizer, TokenIds):  # random weights: random ids, seeded
        generator = torch.Generator().manual_seed(args.seed)
        rows = [torch.randint(args.vocab_size, (args.prompt_tokens,), generator=generator).tolist()]
    elif args.prompt_tokens is not None:
        rows = [data.essay_tokens(tokenizer, args.prompt_tokens)]
    else:
        try:
            prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
            rows = [tokenizer.encode_prompt(p.text, chat=p.chat) for p in cli.read_prompts(prompt, args.prompt_file, args.chat)]
        except ValueError as e:
            raise UserError(str(e)) from None
    if len(rows) > 1 and args.batch_size not in (None, len(rows)):
        raise UserError(f"the prompt file holds {len(rows)} prompts: it sets the batch size (drop --batch-size)")
    if any(not ids for ids in rows):
        raise UserError("a prompt encodes to no tokens")
    return rows * (args.batch_size or 1) if len(rows) == 1 else rows


def speculation_settings(args: argparse.Namespace) -> tuple[AttentionSettings, Optional[AttentionSettings]]:
    """(the settings of the model that decodes, or verifies; the draft's, with --draft-attention). With
    --draft-attention the attention flags configure the draft and the verifier runs --attention (dense
    unless given); otherwise they are the model's, as without speculation."""
    if args.draft_attention is None:
        return attention_settings(args), None
    draft = attention_settings(argparse.Namespace(**{**vars(args), "attention": args.draft_attention}))
    return AttentionSettings(args.attention or "dense"), draft


def check_speculation(args: argparse.Namespace, settings: AttentionSettings, draft: Optional[AttentionSettings]) -> None:
    """The refusals of speculative decoding that depend on the flags alone."""
    drafting = args.draft_attention is not None or args.draft_checkpoint is not None
    if args.speculate_k is None:
        if drafting:
            raise UserError("a draft (--draft-attention, --draft-checkpoint) needs --speculate-k N, the tokens it "
                            "proposes per round")
        return
    if not drafting:
        raise UserError("--speculate-k needs a draft: --draft-attention POLICY (self-speculation) or "
                        "--draft-checkpoint PATH")
    if settings.policy != "dense":
        raise UserError(f"the verifier runs dense attention (its one pass over the proposals is dense "
                        f"attention's), not {settings.policy}")
    for flag, given in (("--interactive", args.interactive), ("--compile on CUDA", args.compile and args.device == "cuda"),
                        ("torchrun", tp.world_size() > 1)):
        if given:
            raise UserError(f"speculative decoding does not run with {flag} (yet): run without it")
    if args.draft_checkpoint is not None and args.random_weights:
        raise UserError("--draft-checkpoint must share the verifier's tokenizer; --random-weights has none")


def check_flags(args: argparse.Namespace) -> None:
    """The refusals that depend on the flags alone (before any file is read), and the device defaults."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.random_weights:
        text = [flag for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file),
                                         ("--interactive", args.interactive), ("--chat", args.chat)) if given]
        if text:
            raise UserError(f"--random-weights loads no tokenizer, so {text[0]} has no meaning: give --prompt-tokens N "
                            f"(N random token ids)")
        if args.prompt_tokens is None:
            raise UserError("--random-weights loads no tokenizer: give --prompt-tokens N (N random token ids)")
    if args.profile is not None and (args.interactive or not args.profile.parent.is_dir()):
        raise UserError(f"--profile {args.profile}: " + ("--interactive has no decode steps to trace" if args.interactive
                                                           else f"no directory {args.profile.parent}"))
    args.checkpoint = args.checkpoint or (None if args.random_weights else data.DEFAULT_CHECKPOINT)
    if args.checkpoint is not None:  # a .gguf file or an HF directory: converted once, beside it
        args.checkpoint = resolve_checkpoint(args.checkpoint)
    if args.compile_backend is None:  # aot where it runs: one process's CPU step, without speculation
        runs_aot = args.speculate_k is None and tp.world_size() == 1
        args.compile_backend = default_compile_backend(args.device) if runs_aot else "inductor"
    elif args.compile_backend == "aot":
        refused = [flag for flag, given in (("without --compile", not args.compile), ("on CUDA", args.device == "cuda"),
                                            ("with --speculate-k", args.speculate_k is not None),
                                            ("under torchrun", tp.world_size() > 1)) if given]
        if refused:
            raise UserError(f"--compile-backend aot does not run {refused[0]} (it builds the CPU decode step of "
                            f"one process ahead of time)")


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings, draft_settings = speculation_settings(args)
    check_speculation(args, settings, draft_settings)
    if args.interactive and settings.compression is not None:
        raise UserError("--compression is solved at the prompt's length, and --interactive has none up front: "
                        "give the policy's knob (--sparq-r, --kv-budget)")
    config = ModelArgs.from_shape(args.random_weights) if args.random_weights else model_args(args.checkpoint)
    args.vocab_size = config.vocab_size
    length_bucket = length_bucket_for(args, config, settings)
    torch.manual_seed(args.seed)
    try:
        args.sampling = sampling_from_flags(args, config.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.speculate_k is not None and args.sampling.penalized:
        raise UserError("speculative decoding samples without penalties: drop --presence-penalty, "
                        "--frequency-penalty and --repetition-penalty, or --speculate-k")
    policies = [settings.policy] + ([draft_settings.policy] if draft_settings is not None else [])
    kv_format = cache_format(args, args.device, policies)  # the K^T storage decided once (assemble.kt_storage_for)
    kernels = kernels_for(args.kernel, args.device, config, length_bucket, [kv_format])
    if args.random_weights:
        model, tokenizer = random_model(config, args.device, DTYPES[args.dtype], kernels), TokenIds()
    else:
        model = load_checkpoint(args.checkpoint, args.device, DTYPES[args.dtype], kernels, args.quantized_kernel)
        tokenizer = load_tokenizer(args.checkpoint)
    if args.quantized_kernel != "auto" and not quantize.is_quantized(model):
        raise UserError(f"--quantized-kernel {args.quantized_kernel} picks a quantized checkpoint's kernels; "
                        f"this model is not quantized (make one with quantize.py)")
    if args.interactive:
        if tp.world_size() > 1:
            raise UserError("--interactive runs in one process, not under torchrun")
        return chat_loop(args, model, tokenizer, settings, length_bucket)
    world = tp.maybe_shard(model, args.device)  # under torchrun: this rank's KV heads (tp.py)
    try:
        return generate_rows(args, model, tokenizer, settings, kernels, kv_format, length_bucket, world, config,
                             draft_settings)
    finally:
        tp.shutdown()


def length_bucket_for(args: argparse.Namespace, config: ModelArgs, settings: AttentionSettings) -> int:
    """The caches' length bucket (KVCache): --length-bucket, else 256 on CUDA (one CUDA graph per bucket)
    and 1 (exact reads) on the CPU and for sliding-window layers, which read exact lengths."""
    window = config.has_window_layers
    if args.device == "cuda" and args.compile and window:
        raise UserError("this model has sliding-window layers, which read exact lengths, and --compile on CUDA "
                        "captures a CUDA graph per length bucket: run it without --compile")
    length_bucket = args.length_bucket or (256 if args.device == "cuda" and not window else 1)
    if args.device == "cuda" and args.compile and length_bucket == 1:
        raise UserError("--length-bucket 1 with --compile on CUDA would capture a new CUDA graph every step: "
                        "use the default (256) or a larger bucket")
    if length_bucket > 1 and not POLICIES[settings.policy].reads_buckets:
        raise UserError(f"--length-bucket applies to dense and sparq attention, not {settings.policy}")
    return length_bucket


def generate_rows(args: argparse.Namespace, model: Transformer, tokenizer, settings: AttentionSettings,
                  kernels: Kernels, kv_format: KVFormat, length_bucket: int, world: Optional[int], config: ModelArgs,
                  draft_settings: Optional[AttentionSettings] = None) -> int:
    """The prompts of the command line, generated as one batch; reported and written as asked. `config` is the
    whole model's shape (under torchrun, model.args is this rank's share)."""
    rows = prompt_ids(args, tokenizer)
    longest, ragged = max(map(len, rows)), len({len(r) for r in rows}) > 1
    if ragged and model.args.has_window_layers:
        raise UserError("prompts of different lengths in one batch need every layer global; this model has "
                        "sliding-window layers: run the prompts one at a time")
    if args.speculate_k and len(rows) > 1 and model.args.has_window_layers:
        raise UserError("speculative rows accept different counts, and this model's sliding-window layers read "
                        "one window for every row: speculate with one row at a time")
    lookahead = args.speculate_k + 1 if args.speculate_k else 0  # a round writes up to this many positions past the last
    max_context = model.args.max_context
    max_seq_length = args.max_seq_length or min(longest + args.max_new_tokens + lookahead, max_context)
    if longest + 1 + lookahead > max_seq_length:
        raise UserError(f"the prompt has {longest} tokens; it does not fit --max-seq-length {max_seq_length}"
                        + (f" with the {lookahead} positions a speculative round writes" if lookahead else ""))
    if max_seq_length > max_context:
        raise UserError(f"--max-seq-length {max_seq_length} exceeds the model's context of {max_context} tokens")
    max_new_tokens = min(args.max_new_tokens, max_seq_length - longest - lookahead)
    if max_new_tokens < args.max_new_tokens:
        print(f"note: --max-new-tokens capped at {max_new_tokens}: the cache holds {max_seq_length} positions "
              f"and the longest prompt {longest}", file=sys.stderr)

    settings = solve_compression(settings, longest, config, cache_storage(kv_format, model))
    allocate_caches(model, kv_format, len(rows), max_seq_length, length_bucket)
    install_policy(model, settings)
    speculator = (make_speculator(args, model, tokenizer, settings, draft_settings, kv_format, len(rows), max_seq_length,
                                  longest) if args.speculate_k else None)
    source = f"random weights of the {args.random_weights} shape" if args.random_weights else str(args.checkpoint)
    print(f"model: {source}, {config.n_layer} layers, dim {config.dim}, {config.n_head} heads / "
          f"{config.n_kv_head} KV heads, {args.dtype} on {args.device}; "
          f"KV cache {model.kv_cache_bytes() / 2**20:.1f} MiB ({describe_format(kv_format, model.cache_dtype, args.kt_dtype)}, "
          f"batch {len(rows)} x {max_seq_length} positions); kernels: {kernels.name} ({kernels.describe})",
          file=sys.stderr)
    print(f"attention: {describe_layers(model)}", file=sys.stderr)
    if world:
        print(f"tensor parallel: {world} ranks, rank 0 holds {model.args.n_kv_head} of {config.n_kv_head} KV heads "
              f"({torch.get_num_threads()} threads per rank); the bytes below are rank 0's share (its weights and "
              f"KV heads)",
              file=sys.stderr)
    if args.device == "cuda" and quantize.has_int8(model) and not args.compile:
        print("note: int8 weights on CUDA are dequantized whole at every step unless --compile fuses the "
              "dequantization into the GEMV: without --compile int8 is no speed option here", file=sys.stderr)
    generator = Generator(model, stop_ids=tokenizer.stop_ids, sampling=args.sampling,
                          compile_decode=args.compile, compile_backend=args.compile_backend,
                          compile_prefill=args.compile_prefill, progress=sys.stderr.isatty())
    compile_s = None
    if args.compile and speculator is not None:  # its draft step and verify pass
        compile_s = speculator.warm_up(rows)
        print(f"warm-up: compilation of the draft step and the verify pass, {compile_s:.1f} s (not in the "
              f"tokens/s below)", file=sys.stderr)
    elif args.compile:  # compile (and capture) every step variant outside the timed runs
        compile_s = generator.warm_up(rows, max_new_tokens)
        built = f"; {generator.build_summary()}" if generator.build_summary() else ""
        print(f"warm-up: compilation{' and CUDA graph capture' if args.device == 'cuda' else ''} of every "
              f"decode length the run reads ({args.compile_backend}), {compile_s:.1f} s (not in the tokens/s "
              f"below){built}", file=sys.stderr)

    stream = len(rows) == 1 and not args.no_stream and speculator is None
    results = []
    for i in range(args.num_samples):
        header = f"--- sample {i + 1}"
        if stream:
            print(header, flush=True)
        if speculator is not None:
            samples, stats = speculator.generate(rows, max_new_tokens)
        else:
            samples, stats = generator.generate(rows, max_new_tokens, TextStream(tokenizer) if stream else None)
        if stream:
            print(flush=True)
        else:
            for b, row in enumerate(samples):
                print(header + (f", row {b + 1}" if len(rows) > 1 else ""))
                print(tokenizer.decode(row))
        report(stats, len(rows), model.weight_bytes(), first_call=i == 0 and not args.compile)
        if speculator is not None:
            report_speculation(stats, args.speculate_k)
        results.append((samples, stats))

    if args.profile is not None:
        write_profile(args.profile, speculator or generator, rows, max_new_tokens)
    samples, stats = results[-1]
    summary = stats.summary(len(rows), model.weight_bytes())
    if speculator is not None:
        summary.update(speculation_summary(stats, args.speculate_k), speculate_k=args.speculate_k)
    print(f"peak memory: {peak_memory_bytes(args.device) / 2**30:.2f} GiB", file=sys.stderr)
    if settings.policy != "dense" and stats.steps:
        ratio = summary["compression_achieved"]
        print(f"attention: {settings.policy}, KV transfers {ratio:.3f} of dense over the decode "
              f"(compression 1/{1 / ratio:.1f})", file=sys.stderr)
    if args.json and tp.rank() == 0:  # one writer: every rank holds the same tokens
        write_json(args, settings, model, tokenizer, rows, samples, {**summary, "compile_s": compile_s})
    return 0


def make_speculator(args: argparse.Namespace, model: Transformer, tokenizer, settings: AttentionSettings,
                    draft_settings: Optional[AttentionSettings], kv_format: KVFormat, batch: int, max_seq_length: int,
                    longest: int) -> Speculator:
    """The draft of --draft-attention (self-speculation) or --draft-checkpoint (a model of its own, loaded,
    its caches set up and its policy installed), said on stderr."""
    layers = range(model.args.n_layer)
    verify = [policy_factory(settings, model.args, model.kernels)(i) for i in layers]
    if draft_settings is not None:
        draft_settings = solve_compression(draft_settings, longest, model.args, cache_storage(kv_format, model))
    if draft_settings is not None:
        try:
            probe = policy_factory(draft_settings, model.args, model.kernels)(model.args.n_layer - 1)
        except ValueError as e:
            raise UserError(str(e)) from None
        if not probe.follows_rows:
            raise UserError(f"{draft_settings.policy} cannot draft: rejected positions are truncated from the cache, "
                            f"and it keeps per-row state it cannot roll back")
    if args.draft_checkpoint is None:
        make = policy_factory(draft_settings, model.args, model.kernels)
        print(f"speculation: {args.speculate_k} tokens per round drafted by the same model with "
              f"{draft_settings.policy} attention, verified by {settings.policy} in one pass", file=sys.stderr)
        return Speculator(model, args.speculate_k, verify, [make(i) for i in layers], stop_ids=tokenizer.stop_ids,
                          sampling=args.sampling, compile=args.compile)
    draft_config = model_args(args.draft_checkpoint)
    draft_kernels = kernels_for(args.kernel, args.device, draft_config, kv_formats=[kv_format])
    draft = load_checkpoint(args.draft_checkpoint, args.device, DTYPES[args.dtype], draft_kernels, args.quantized_kernel)
    check_same_tokenizer(tokenizer, load_tokenizer(args.draft_checkpoint), draft_config, model.args)
    if max_seq_length > draft_config.max_context:
        raise UserError(f"the draft's context of {draft_config.max_context} tokens is shorter than the "
                        f"{max_seq_length} positions of this run")
    allocate_caches(draft, kv_format, batch, max_seq_length, 1)
    install_policy(draft, draft_settings or AttentionSettings("dense"))
    print(f"speculation: {args.speculate_k} tokens per round drafted by {args.draft_checkpoint} "
          f"({describe_layers(draft)}), verified by {settings.policy} in one pass", file=sys.stderr)
    return Speculator(model, args.speculate_k, verify, draft_model=draft, stop_ids=tokenizer.stop_ids,
                      sampling=args.sampling, compile=args.compile)


def write_profile(path: Path, decoder, rows: list[list[int]], max_new_tokens: int) -> None:
    """--profile (gpt-fast's flag): the prompts prefilled again (not traced), then up to PROFILE_STEPS decode
    steps of `decoder` (the Generator, or the Speculator's rounds) under torch.profiler, CUDA activities
    included on CUDA, written as a Chrome trace at `path`; where it went, on stderr."""
    from torch.profiler import ProfilerActivity, profile

    first, _ = decoder.generate(rows, 1)  # the caches now hold the prompts; first: each row's next token
    token = torch.tensor([row[0] for row in first], device=decoder.model.device)
    cuda = decoder.model.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        _, stats = decoder.decode(token, [len(row) for row in rows], min(PROFILE_STEPS + 1, max_new_tokens))
    if tp.rank() == 0:  # every rank traced its own steps; one writes
        prof.export_chrome_trace(str(path))
        print(f"profile: {stats.steps} decode steps traced ({'CPU and CUDA' if cuda else 'CPU'} activities) to "
              f"{path}: open it in chrome://tracing or ui.perfetto.dev", file=sys.stderr)


def report_speculation(stats: DecodeStats, n: int) -> None:
    if not stats.rounds:
        return
    s = speculation_summary(stats, n)
    print(f"speculation: {stats.rounds} rounds, acceptance {s['acceptance_rate']:.2f} ({stats.accepted} of "
          f"{stats.proposed} proposed), {s['tokens_per_round']:.2f} tokens per round per row (expected from the "
          f"acceptance: {expected_tokens_per_round(s['acceptance_rate'], n):.2f}); a draft step "
          f"{1e3 * s['draft_step_s']:.1f} ms, a verify pass {1e3 * s['verify_pass_s']:.1f} ms: theory "
          f"{s['theory_speedup']:.2f}x the verifier alone, if its one-token step costs a verify pass", file=sys.stderr)


def report(stats: DecodeStats, batch_size: int, weights: int, first_call: bool = False) -> None:
    s = stats.summary(batch_size, weights)
    prefill_line = (f"prefill: {stats.prefill_tokens} tokens ({batch_size} row{'s' if batch_size > 1 else ''}) in "
                    f"{s['prefill_s']:.2f} s, {s['prefill_tokens_per_s']:.0f} tokens/s")
    if stats.steps == 0:
        print(f"{prefill_line}; decode: nothing was decoded (the first token already ended every row)", file=sys.stderr)
        return
    warm = (" (one step: it includes the first call's warm-up; use more --max-new-tokens or --num-samples 2)"
            if first_call and stats.steps < 2 else "")
    printing = f"; printing took {stats.print_s:.2f} s, excluded" if stats.print_s > 0.01 else ""
    print(f"{prefill_line}; decode: {stats.steps} steps, {s['decode_tokens_per_s']:.2f} tokens/s per sequence, "
          f"{s['total_tokens_per_s']:.2f} tokens/s total{warm}; bandwidth achieved {s['bandwidth_gb_s']:.2f} GB/s "
          f"(weights {weights / 1e6:.1f} MB + KV {s['kv_bytes_read_per_step'] / 1e6:.2f} MB per step){printing}",
          file=sys.stderr)


def write_json(args, settings, model, tokenizer, rows, samples, summary) -> None:
    out = {
        "prompt_tokens": max(len(ids) for ids in rows),  # the longest prompt (every row's, unless ragged)
        "batch_size": len(rows),
        "samples": [{"prompt_tokens": len(ids), "tokens": row,
                     "text": None if isinstance(tokenizer, TokenIds) else tokenizer.decode(row)}
                    for ids, row in zip(rows, samples)],
        **summary,
        "device": args.device,
        "dtype": args.dtype,
        "checkpoint": None if args.checkpoint is None else str(args.checkpoint),
        "random_weights": args.random_weights,
        "attention": settings.policy,
        "kernels": model.kernels.name,
        "compression_target": None if settings.compression is None else float(settings.compression),
    }
    if settings.policy in ("sparq", "sparq-fixed-r"):
        c = next(layer.attention.decode_attention.config for layer in model.layers
                 if layer.attention.decode_attention.name == "sparq")
        out["sparq"] = {"r": c.r, "k": c.k_top, "local": c.local, "mean_v": c.mean_v}
    elif settings.policy != "dense":
        out["kv_budget"] = settings.budget
    cli.write_json(args.json, out)


if __name__ == "__main__":
    sys.exit(main())
