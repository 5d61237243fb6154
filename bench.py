"""Benchmarks for sparq-fast.

  python bench.py attention --shape smollm2 --batch-size 1,4,16 --seq-len 2048,8192,32768 --sparq-r 16
  python bench.py decode --prompt-tokens 1024,4096,8192 --batch-size 1,4,8 --sparq-r 16 --sparq-k 128
  python bench.py linear --rows 1,8 --dtype float32,bfloat16

`linear`: the GEMVs of one SmolLM2 decode step, torch's F.linear against the fused CPU kernel.

`decode`: the whole model's decode step on a checkpoint, dense and SparQ from the same prefilled
cache in one process, every context and batch size taking turns step by step; tokens/s, KV GB/s
(bytes by the transfer formulas), measured speedup and the theoretical one: (weights + dense KV
bytes) / (weights + SparQ KV bytes) per step.
--prefill also times our prefill of each context (N tokens into an empty cache), and --llamacpp
GGUF times llama.cpp (llamacpp.py) after the same contexts in the same format (or --llamacpp-format's):
one run, side by side; with --rounds N, ours and llama.cpp take turns N times and cells are medians.

`attention`: one layer's decode-attention op (one query token per batch row), dense against every
SparQ variant, side by side in one process. Each configuration rotates among enough copies of
the cache (k, k_t, v, v_sum, q) that every call reads from DRAM, not from the last-level cache, and
reports the median over the iterations after warm-up. Bytes are the paper's transfer counts
(Appendix G): dense 2Sd + 2d, SparQ Sr + 2kd + 4d elements per KV head, times B * n_kv * element size.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import cli
from cli import UserError

# Shapes of one layer's attention: (KV heads, query heads, head dim).
SHAPES = {
    "smollm2": (3, 9, 64),  # SmolLM2-135M: GQA, 3 query heads per KV head
    "llama2-7b": (32, 32, 128),  # Llama 2 7B: MHA
}
DTYPES = ("float32", "bfloat16", "float16")
MEMORY_LIMIT = 8 * 2**30  # skip configurations whose cache copies would exceed this
LLC_BYTES = 36 * 2**20  # rotate copies until every method's working set is a few times the LLC
# The paper's Table 4 microbenchmark (A100): B=64, 32 heads, d=128, S=4096, r=32, k=128.
TABLE4 = dict(shape="llama2-7b", batch_size="64", seq_len="4096", sparq_r=32, sparq_k=128)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    kind: str  # "dense" | "sparq"
    fn: Callable  # fn(copy) -> Tensor
    layout: str = "twice"  # which K layouts the call reads


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _make_copy(B, n_kv, g, d, S, dtype, device, gen, with_kt: bool):
    """One independent cache (exactly S positions) and query, filled with N(0, 1) values."""
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    k = randn(B, n_kv, S, d)
    v = randn(B, n_kv, S, d)
    k_t = k.transpose(2, 3).contiguous() if with_kt else None
    v_sum = v.float().sum(dim=2)
    q = randn(B, n_kv, g, d)
    return dict(q=q, k=k, k_t=k_t, v=v, v_sum=v_sum)


def _methods(device: str, kernels_wanted: list[str], cfg, S: int) -> list[Method]:
    import torch.nn.functional as F

    import kernels
    from model import dense_attention_torch
    from sparq import sparq_attention_torch

    methods = [
        Method("dense-matmul", "dense", lambda c: dense_attention_torch(c["q"], c["k"], c["v"], S)),
        Method("dense-sdpa", "dense", lambda c: F.scaled_dot_product_attention(c["q"], c["k"], c["v"])),
    ]
    if device == "cpu" and "cpu" in kernels_wanted:
        methods.append(Method("dense-fused", "dense",
                              lambda c: kernels.dense_attention_cpu(c["q"], c["k"], c["v"], S)))

    def sparq_method(name: str, fn, layout: str) -> Method:
        def call(c):
            k_t = c["k_t"] if layout == "twice" else None
            return fn(c["q"], c["k"], k_t, c["v"], c["v_sum"], S, None, cfg.r, cfg.k, cfg.local, cfg.mean_v)
        return Method(name, "sparq", call, layout)

    if "torch" in kernels_wanted:
        methods.append(sparq_method("sparq-torch", sparq_attention_torch, "twice"))
    fused = kernels.sparq_attention_cpu if device == "cpu" else kernels.sparq_attention_triton
    if "cpu" in kernels_wanted or "triton" in kernels_wanted:
        methods.append(sparq_method("sparq-fused", fused, "twice"))
        methods.append(sparq_method("sparq-fused-1xk", fused, "once"))
        floor = _floor_config(cfg)
        methods.append(Method("sparq-floor", "floor", lambda c: fused(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None,
                                                                      floor.r, floor.k, floor.local, floor.mean_v)))
    return methods


def _floor_config(cfg):
    """SparQ at r = 1, k = 8: it reads almost nothing (one row of K^T, eight of K and V), so its time is the
    fused op's work that does not scale with what it reads: step 1's softmax over S, the selection,
    the phases. Set beside the time at the chosen r and k, it says whether a cell is bound by that
    work or by its bytes."""
    from sparq import SparQConfig

    return SparQConfig(r=1, k=min(8, cfg.k), local=1, mean_v=False)


def _time_call(fn, copy, device: str) -> float:
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(copy)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(copy)
    return time.perf_counter() - t0


def cmd_attention(args) -> int:
    import torch

    from model import DenseDecode
    from sparq import SparQConfig, SparQDecode

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but CUDA is not available")
    if device == "cuda":  # default to the paper's Table 4 setting
        for key, value in TABLE4.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    shapes = cli.name_list(args.shape or "smollm2", "shape", SHAPES)
    batch_sizes = cli.int_list(args.batch_size or "1,4,16", "--batch-size")
    seq_lens = cli.int_list(args.seq_len or "2048,8192,32768", "--seq-len")
    dtypes = cli.name_list(args.dtype or ("float16" if device == "cuda" else "float32"), "dtype", DTYPES)
    kernels_wanted = cli.name_list(args.kernel, "kernel", ("all", "torch", "cpu", "triton"))
    if "all" in kernels_wanted:
        kernels_wanted = ["torch", "cpu" if device == "cpu" else "triton"]
    if ("cpu" in kernels_wanted and device != "cpu") or ("triton" in kernels_wanted and device != "cuda"):
        raise UserError("--kernel cpu runs on --device cpu, --kernel triton on --device cuda")
    r = args.sparq_r if args.sparq_r is not None else 16
    k_top = args.sparq_k if args.sparq_k is not None else 128
    if args.iters < 1 or args.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    for shape in shapes:
        try:
            SparQConfig(r=r, k=k_top, local=args.sparq_local, mean_v=args.mean_v).validate(SHAPES[shape][2])
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    if device == "cpu" and "cpu" in kernels_wanted:
        import kernels

        error = kernels.cpu_kernel_error()  # builds before timing anything (first use only)
        if error is not None:
            raise UserError(f"the fused CPU kernels cannot be built ({error}); use --kernel torch")

    from tqdm import tqdm

    configs = [(s, dt, b, n) for s in shapes for dt in dtypes for b in batch_sizes for n in seq_lens]
    rows, notes = [], []
    gen = torch.Generator().manual_seed(args.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# attention op, device={device}, threads={torch.get_num_threads()}, r={r}, k={k_top}, "
          f"local={k_top // 4 if args.sparq_local is None else args.sparq_local}, mean_v={args.mean_v}, "
          f"median of {args.iters} iterations after {args.warmup} warm-up, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}, load average {load:.1f}", flush=True)
    if device == "cpu" and load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} exceeds the {os.cpu_count()} CPUs: other processes distort the timings",
              file=sys.stderr)
    bar = tqdm(configs, desc="attention", unit="config", file=sys.stderr, dynamic_ncols=True)
    for shape, dt_name, B, S in bar:
        n_kv, H, d = SHAPES[shape]
        g = H // n_kv
        dtype = _dtype(dt_name)
        es = torch.finfo(dtype).bits // 8
        cfg = SparQConfig(r=r, k=k_top, local=args.sparq_local, mean_v=args.mean_v)
        dense_bytes = DenseDecode().transfer_elements(S, d) * B * n_kv * es
        sparq_bytes = SparQDecode(cfg).transfer_elements(S, d) * B * n_kv * es
        copy_bytes = 3 * B * n_kv * S * d * es + B * n_kv * (g + 1) * d * 4
        # enough copies that even SparQ's working set (the smallest) spans a few LLCs
        n_copies = max(2, math.ceil(3 * LLC_BYTES / sparq_bytes)) if device == "cpu" else 2
        n_copies = min(n_copies, args.max_copies)
        scratch = B * n_kv * (r * es + 4 * 4 * g) * S  # sparq-torch temporaries, roughly
        if copy_bytes + scratch > MEMORY_LIMIT:
            note = f"skipped {shape} {dt_name} B={B} S={S}: needs {(copy_bytes + scratch) / 2**30:.1f} GiB > 8 GiB"
            notes.append(note)
            bar.write("note: " + note, file=sys.stderr)
            continue
        n_copies = max(1, min(n_copies, int((MEMORY_LIMIT - scratch) // copy_bytes)))
        if n_copies * copy_bytes < 3 * LLC_BYTES and device == "cpu":
            bar.write(f"note: {shape} {dt_name} B={B} S={S}: only {n_copies} cache copies fit", file=sys.stderr)
        bar.set_postfix_str(f"{shape} {dt_name} B={B} S={S} ({n_copies} copies)")
        copies = [_make_copy(B, n_kv, g, d, S, dtype, device, gen, with_kt=True) for _ in range(n_copies)]
        methods = _methods(device, kernels_wanted, cfg, S)
        times = {m.name: [] for m in methods}
        with torch.inference_mode():
            for i in range(args.warmup):
                for m in methods:
                    m.fn(copies[i % n_copies])
            start = time.perf_counter()
            for i in range(args.iters):  # interleaved: every method sees the same machine state
                for m in methods:
                    times[m.name].append(_time_call(m.fn, copies[(i + args.warmup) % n_copies], device))
                if i + 1 >= args.min_iters and time.perf_counter() - start > args.max_seconds:
                    break
        del copies
        median = {name: statistics.median(ts) for name, ts in times.items()}
        fastest = {name: min(ts) for name, ts in times.items()}
        dense_names = [m.name for m in methods if m.kind == "dense"]
        best_dense = min(dense_names, key=lambda n: median[n])
        floor_bytes = SparQDecode(_floor_config(cfg)).transfer_elements(S, d) * B * n_kv * es
        for m in methods:
            nbytes = {"dense": dense_bytes, "sparq": sparq_bytes, "floor": floor_bytes}[m.kind]
            row = dict(shape=shape, dtype=dt_name, batch_size=B, seq_len=S, method=m.name,
                       time_ms=median[m.name] * 1e3, time_ms_min=fastest[m.name] * 1e3,
                       gb_s=nbytes / median[m.name] / 1e9,
                       speedup_vs_dense=median[best_dense] / median[m.name],
                       theoretical_speedup=dense_bytes / nbytes, dense_baseline=best_dense,
                       iterations=len(times[m.name]), copies=n_copies)
            row["of_theory"] = row["speedup_vs_dense"] / row["theoretical_speedup"]
            if m.name == "sparq-fused" and "sparq-floor" in median:
                row["floor_share"] = median["sparq-floor"] / median[m.name]
            rows.append(row)
    bar.close()
    _print_table(rows)
    for note in notes:
        print("note: " + note)
    if args.json:
        cli.write_json(args.json, {"device": device, "threads": torch.get_num_threads(), "r": r, "k": k_top,
                                   "mean_v": args.mean_v, "notes": notes, "rows": rows})
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot, r, k_top)
        print(f"wrote {args.plot}")
    return 0


def _print_table(rows: list[dict]) -> None:
    header = (f"{'shape':<10} {'dtype':<9} {'B':>3} {'S':>6}  {'method':<16} {'time ms':>9} {'min ms':>9} {'GB/s':>6} "
              f"{'speedup':>8} {'theory':>7} {'of theory':>9} {'floor':>6}")
    print(header)
    print("-" * len(header))
    last = None
    for row in rows:
        key = (row["shape"], row["dtype"], row["batch_size"], row["seq_len"])
        if last is not None and key != last:
            print()
        last = key
        mark = "*" if row["method"] == row["dense_baseline"] else " "
        print(f"{row['shape']:<10} {row['dtype']:<9} {row['batch_size']:>3} {row['seq_len']:>6}  "
              f"{row['method'] + mark:<16} {row['time_ms']:>9.3f} {row['time_ms_min']:>9.3f} {row['gb_s']:>6.1f} "
              f"{row['speedup_vs_dense']:>7.2f}x {row['theoretical_speedup']:>6.2f}x {row['of_theory']:>8.0%} "
              + (f"{row['floor_share']:>6.0%}" if "floor_share" in row else f"{'':>6}"))
    print("(time = median, min = fastest call; * = the dense baseline, the fastest dense method by median;"
          " speedup = its median / the method's; GB/s = transfer bytes / median; theory = dense bytes / method bytes;"
          " of theory = speedup / theory; floor = sparq-floor's time (r = 1, k = 8: almost no bytes) / sparq-fused's:"
          " near 100%, the op is bound by its fixed and per-position work, not by what it reads)")


def _plot(rows: list[dict], path: str, r: int, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(row["shape"], row["dtype"]) for row in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (shape, dt) in zip(axes[0], panels):
        sub = [row for row in rows if row["shape"] == shape and row["dtype"] == dt]
        batches = sorted({row["batch_size"] for row in sub})
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ci, B in enumerate(batches):
            color = colors[ci % len(colors)]
            for name, style in (("sparq-fused", "-o"), ("sparq-fused-1xk", ":^"), ("sparq-torch", "-.s")):
                pts = sorted((row["seq_len"], row["speedup_vs_dense"]) for row in sub
                             if row["batch_size"] == B and row["method"] == name)
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"B={B} {name}", markersize=4)
            theory = sorted({(row["seq_len"], row["theoretical_speedup"]) for row in sub
                             if row["batch_size"] == B and row["method"] == "sparq-fused"})
            if theory:
                ax.plot(*zip(*theory), "--", color=color, alpha=0.5, label=f"B={B} theoretical")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("speedup vs best dense")
        ax.set_title(f"{shape} {dt}, r={r}, k={k}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------
# decode: dense vs SparQ end to end on a real checkpoint, side by side in one process
# ---------------------------------------------------------------------------------------------


def _own_decode_step(name: str) -> Callable:
    """generate.decode_step under a code object of its own. Dynamo keeps compiled graphs per code
    object and checks a call against them in turn, the one that last ran first: with one step shared
    by two policies, or by two contexts on either side of a specialisation (SparQ runs dense while a
    layer sees at most k positions: one graph below k, one above), each call would first evaluate,
    and fail, the other graph's guards, a cost generate.py, with one policy at one growing length,
    pays at most once."""
    from generate import decode_step

    code = decode_step.__code__.replace(co_name=f"decode_step_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}")
    return types.FunctionType(code, decode_step.__globals__, code.co_name)


def _last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux sysfs), or 64 MiB where it cannot be read."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=64 << 20)


def _cache_evictor() -> Callable[[], None]:
    """A call that writes twice the last-level cache's size: whatever an untimed step before it left
    in the CPU's caches (a cache rewind reads the whole live V) is gone when the timed step starts,
    as it is in generation, where every layer's weights and KV pass through between two reads."""
    import torch

    scratch = torch.zeros(2 * _last_level_cache_bytes() // 4, dtype=torch.float32)
    return lambda: scratch.add_(1.0)


def _time_decode(step: dict[tuple[int, str], Callable], model, policies: dict[str, list], cases: list[list[int]], steps: int,
                 warmup: int, progress=None, evict: Optional[Callable[[], None]] = None) -> list[dict[str, float]]:
    """Seconds per decode step (median, after warm-up) of each policy in each case, step[case index,
    policy] its step function; a case is the first decode position of each of its rows (rows alike, or ragged:
    each row at its own live length).

    Cases and policies take turns step by step (case 1 dense step i, case 1 SparQ step i, case 2 dense
    step i, ..., then step i + 1), each policy from the same live positions, so a slow spell of the
    machine (here its speed drifts by up to 2x within an hour) lands on every row of the table alike
    rather than on whichever ran during it. One prefill of the longest prompt serves every case: a
    step rewinds the caches to its own live positions first, then evict() (if given) clears the CPU's
    caches of what the rewind read."""
    import torch

    times = [{name: [] for name in policies} for _ in cases]
    with torch.no_grad():
        for i in range(warmup + steps):
            for c, (starts, case_times) in enumerate(zip(cases, times)):
                B, top = len(starts), max(starts)
                token = torch.zeros(B, 1, dtype=torch.long)
                ragged = len(set(starts)) > 1
                for name, layers in policies.items():
                    for cache in model.caches:
                        cache.rewind(top + i)  # positions [0, top + i) live, whatever the last step wrote
                    if ragged:  # every row holds the same essay: row b's live prefix is its first starts[b] + i tokens
                        model.set_live_lengths(torch.tensor(starts) + i)
                    positions = (torch.tensor(starts).view(B, 1) if ragged else torch.tensor([top])) + i
                    model.set_decode_attention(lambda layer, layers=layers: layers[layer])
                    if evict is not None:
                        evict()
                    t0 = time.perf_counter()
                    step[c, name](model, token, positions, top + i + 1)
                    case_times[name].append(time.perf_counter() - t0)
            if progress is not None:
                progress.update(1)
    return [{name: statistics.median(t[warmup:]) for name, t in case_times.items()} for case_times in times]


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

    from generate import prefill

    tok_s = {}
    with torch.no_grad():
        prefill(model, prompt[:, :64])  # warm-up: thread pools, allocator, kernel loading
        for n in sorted(c for c in set(contexts) if c > 0):
            progress.set_postfix_str(f"timing prefill of {n} tokens")
            start = time.perf_counter()
            prefill(model, prompt[:, :n])
            tok_s[n] = n / (time.perf_counter() - start)
    return tok_s


def cmd_decode(args) -> int:
    import torch
    from tqdm import tqdm

    import data
    from generate import compiled_decode_step, decode_step, kernels_for, load_checkpoint, load_tokenizer, prefill
    from model import ModelArgs, checkpoint_paths, random_model
    from sparq import AttentionSettings, policy_factory

    contexts = cli.int_list(args.prompt_tokens, "--prompt-tokens", minimum=0)
    batches = cli.int_list(args.batch_size, "--batch-size")
    dtypes = cli.name_list(args.dtype, "dtype", DTYPES)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    if args.rounds < 1:
        raise UserError("--rounds must be at least 1")
    if args.llamacpp_format and not args.llamacpp:
        raise UserError("--llamacpp-format needs --llamacpp GGUF")
    if args.llamacpp and args.random_weights:
        raise UserError("--llamacpp times the checkpoint's GGUF: not with --random-weights")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_weights:
        model_args = ModelArgs.from_shape(args.random_weights)
    else:
        tok = load_tokenizer(args.checkpoint)
        model_args = ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json")
    starts = _first_decode_positions(contexts, model_args.max_context, args.warmup + args.steps)
    kernels = kernels_for(args.kernel, "cpu", model_args)  # both policies share the kernel family and the linears
    r_values = cli.int_list(args.sparq_r, "--sparq-r")
    settings = {"dense": AttentionSettings("dense")}
    for r in r_values:  # one SparQ policy per r: "sparq", or "sparq-r16", "sparq-r32", ...
        settings["sparq" if len(r_values) == 1 else f"sparq-r{r}"] = AttentionSettings(
            "sparq", sparq_r=r, sparq_k=args.sparq_k, sparq_local=args.sparq_local, sparq_mean_v=args.sparq_mean_v)
    try:
        factories = {name: policy_factory(s, model_args, kernels) for name, s in settings.items()}
    except ValueError as e:
        raise UserError(str(e)) from None
    config = factories[list(settings)[1]](0).config  # k, local, mean-V: shared by the SparQ policies
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
    if args.random_weights:
        prompt = torch.randint(model_args.vocab_size, (1, max(1, longest)), generator=torch.Generator().manual_seed(0))
    else:
        prompt = torch.tensor([data.essay_tokens(tok, max(1, longest))])
    cache_length = longest + args.warmup + args.steps

    llama = _LlamaCpp(args, contexts) if args.llamacpp else None  # checked and built before any output
    source = f"random weights of the {args.random_weights} shape" if args.random_weights else args.checkpoint
    print(f"# decode, {source}, threads={torch.get_num_threads()}, kernels={kernels.name}, "
          f"{'compiled' if args.compile else 'eager'}, SparQ r={','.join(map(str, r_values))} k={config.k} local={config.local} "
          f"mean_v={config.mean_v}, median of {args.steps} steps after {args.warmup}, cases and policies taking turns step by step")
    print(_DECODE_HEADER, flush=True)
    rows, theirs = [], {}
    progress = tqdm(total=len(dtypes) * args.rounds * (args.warmup + args.steps), desc="decode bench", unit="step",
                    file=sys.stderr)
    for dtype_name in dtypes:
        model = (random_model(model_args, "cpu", _dtype(dtype_name), kernels) if args.random_weights
                 else load_checkpoint(args.checkpoint, "cpu", _dtype(dtype_name), kernels))
        policies = {name: [make(i) for i in range(model_args.n_layer)] for name, make in factories.items()}
        model.setup_caches(max_rows, cache_length)
        prefill_tok_s = _time_prefills(model, prompt, contexts, progress) if args.prefill else {}
        # one dense prefill of the longest prompt serves every shorter context (causal); --prefill's
        # timed prefill of that whole prompt, when it was one of the contexts, already wrote it
        if prompt.shape[1] not in prefill_tok_s:
            with torch.no_grad():
                progress.set_postfix_str(f"prefill {prompt.shape[1]} tokens, {dtype_name}")
                prefill(model, prompt, progress=True)
        for cache in model.caches:
            cache.broadcast_row(max_rows)
        weights = model.weight_bytes()
        step_fns = {(c, name): decode_step for c in range(len(cases)) for name in policies}
        if args.compile:
            # each (case, policy) its own step (_own_decode_step): a graph per step and dtype, more
            # than dynamo's default of 8 recompiles in one process
            torch._dynamo.config.recompile_limit = 64
            step_fns = {(c, name): compiled_decode_step(_own_decode_step(f"{name}_{c}"), "cpu")
                        for c in range(len(cases)) for name in policies}
        progress.set_postfix_str(f"{dtype_name}: {len(cases)} cases x {len(policies)} policies taking turns")
        # rounds: ours (every case and policy in turns), then llama.cpp, then ours again, ...: a slow
        # spell of the machine lands on both; each cell is the median over the rounds
        evict, per_round, their_rounds = _cache_evictor(), [], []
        for round_ in range(args.rounds):
            per_round.append(_time_decode(step_fns, model, policies, [starts_ for _, starts_ in cases], args.steps,
                                          args.warmup, progress, evict=evict))
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
                model.set_decode_attention(lambda i, layers=layers: layers[i])
                kv[name] = sum(model.decode_kv_bytes(S, 1) for S in live)  # every row at its own length
            for name in policies:
                rows.append({
                    "prompt_tokens": label if "/" in label else int(label), "live_length": max(live),
                    "batch_size": B, "dtype": dtype_name,
                    "attention": name, "sparq_r": settings[name].sparq_r, "kernel": kernels.name, "compiled": args.compile,
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
    """llama.cpp (llamacpp.py: built from llama-cpp-python's sdist, an optional extra) on the GGUF of
    --llamacpp, requantized into each dtype's format (--llamacpp-format: one format for every dtype,
    e.g. q8_0 beside an int8 checkpoint), timed after the same contexts as ours."""

    def __init__(self, args, contexts: list[int]):
        import llamacpp

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
        import llamacpp

        fmt = self.format(dtype)
        if fmt not in self.ggufs:
            self.ggufs[fmt] = llamacpp.requantize(Path(self.args.llamacpp), fmt, build_=self.build)
        return llamacpp.time_decode(self.ggufs[fmt], self.contexts, self.args.steps, self.args.threads or 2,
                                    label=fmt, build_=self.build, prefill=prefill)


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
    import llamacpp

    ours = {(r["dtype"], r["prompt_tokens"], r["sparq_r"]): r for r in rows if r["batch_size"] == 1}  # r None: dense
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
                  f"{'SparQ KV GB/s':>13}")


def _decode_row_line(dense: dict, sparq: dict) -> str:
    return (f"{dense['dtype']:9} {str(dense['prompt_tokens']):>7} {dense['batch_size']:3d} {sparq['sparq_r']:3d} "
            f"{dense['decode_tokens_per_s']:11.2f} {sparq['decode_tokens_per_s']:11.2f} "
            f"{sparq['speedup_vs_dense']:6.2f}x {sparq['theoretical_speedup']:5.2f}x "
            f"{sparq['theoretical_kv_speedup']:8.2f}x {dense['gb_s']:10.2f} {sparq['gb_s']:10.2f} "
            f"{dense['kv_gb_s']:13.2f} {sparq['kv_gb_s']:13.2f}")


def _print_decode_table(rows: list[dict], config, kernel: str, compiled: bool) -> None:
    print(f"\ndecode, SparQ k={config.k} local={config.local} mean_v={config.mean_v} "
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
# ---------------------------------------------------------------------------------------------

# SmolLM2-135M's linears as (name, out features, in features, count per decode step)
SMOLLM2_LINEARS = (("wqkv", 960, 576, 30), ("wo", 576, 576, 30), ("w1|w3", 1536, 576, 60), ("w2", 576, 1536, 30),
                   ("output", 49152, 576, 1))


def _linear_methods(mode: str, name: str, N: int, K: int, dtype):
    """{method: (make, call)} for one linear of a decode step and the bytes one call streams: make()
    builds an independent copy of the weight in the method's format, call(copy, x) runs it. mode
    "none": F.linear against the fused GEMV on a float weight of `dtype`; "int8" / "int4": the
    layer as quantize.py stores it (the head int8 in groups of 64 in both modes, as by default),
    torch's packed aten kernels (what quantize.py ran before the fused GEMVs) against the fused
    quantized GEMVs on the same stored tensors."""
    import torch
    import torch.nn.functional as F

    if mode == "none":
        make = lambda: torch.randn(N, K).to(dtype)  # noqa: E731
        return {"torch": (make, lambda w, x: F.linear(x, w)),
                "fused": (make, lambda w, x: torch.ops.sparq.linear_cpu(x, w))}, N * K * dtype.itemsize
    import quantize as Q

    int8 = mode == "int8" or name == "output"
    group = (Q.head_int8_group_size(K) if name == "output" else None) if int8 else Q.DEFAULT_GROUP_SIZE

    def layer(backend: str):
        def make():
            w = torch.randn(N, K)
            if int8:
                module = Q.Int8Linear(K, N, group)
                module.weight, module.scales = Q.quantize_int8(w, group)
            else:
                module = Q.Int4Linear(K, N, group)
                q, module.scales, module.zeros = Q.quantize_int4(w, group)
                module.weight = Q.pack_nibbles(q)
            module.finalize(backend)  # "int4x2": the int8 layers' aten choice; int4 layers take int4pack
            return module
        return make

    stored = N * K if int8 else N * K // 2 + 2 * 2 * N * (K // group)  # bytes, scales (and zeros) included
    if int8:
        stored += 2 * N * (1 if group is None else K // group)
    return {"torch": (layer("int4x2"), lambda m, x: m(x)), "fused": (layer("gemv"), lambda m, x: m(x))}, stored


def cmd_linear(args) -> int:
    import torch

    import kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = cli.int_list(args.rows, "--rows")
    if max(rows_list) > kernels.LINEAR_CPU_MAX_ROWS:
        raise UserError(f"--rows: the fused GEMV takes at most {kernels.LINEAR_CPU_MAX_ROWS} rows")
    dtypes = cli.name_list(args.dtype, "dtype", DTYPES)
    modes = cli.name_list(args.quantized, "--quantized", ("none", "int8", "int4")) if args.quantized else ["none"]
    error = kernels.cpu_kernel_error()
    if error is not None:
        raise UserError(f"the fused CPU kernels cannot be built ({error})")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# linear (GEMV of a decode step), SmolLM2-135M shapes, threads={torch.get_num_threads()}, GEMV path "
          f"{torch.ops.sparq.linear_cpu_isa()}, median of {args.iters} calls (torch and fused interleaved) over "
          f"weight copies spanning > 3x the LLC, load average {load:.1f}")
    print("# weights: dtype (float) or int8 / int4 as quantize.py stores them (x in dtype); torch = F.linear, "
          "or the aten packed kernels for quantized weights; GB/s = stored weight bytes / median")
    print(f"{'weights':8} {'x dtype':9} {'rows':>4} {'layer':7} {'N':>6} {'K':>5} {'torch ms':>9} {'fused ms':>9} "
          f"{'torch GB/s':>10} {'fused GB/s':>10} {'speedup':>7}")
    results = []
    for mode in modes:
        for dt_name in dtypes:
            dtype = _dtype(dt_name)
            for M in rows_list:
                step = {"torch": 0.0, "fused": 0.0}
                for name, N, K, count in SMOLLM2_LINEARS:
                    methods, nbytes = _linear_methods(mode, name, N, K, dtype)
                    n_copies = max(2, math.ceil(3 * LLC_BYTES / nbytes))
                    copies = {m: [make() for _ in range(n_copies)] for m, (make, _) in methods.items()}
                    x = torch.randn(M, K).to(dtype)
                    times = {m: [] for m in methods}
                    with torch.inference_mode():
                        for i in range(args.iters + 2):  # interleaved: both see the same machine state
                            for m, (_, call) in methods.items():
                                t0 = time.perf_counter()
                                call(copies[m][i % n_copies], x)
                                times[m].append(time.perf_counter() - t0)
                    del copies
                    ms = {m: statistics.median(ts[2:]) * 1e3 for m, ts in times.items()}
                    for m in step:
                        step[m] += ms[m] * count
                    weights = dt_name if mode == "none" else ("int8" if mode == "int8" or name == "output" else "int4")
                    print(f"{weights:8} {dt_name:9} {M:4d} {name:7} {N:6d} {K:5d} {ms['torch']:9.3f} {ms['fused']:9.3f} "
                          f"{nbytes / ms['torch'] / 1e6:10.1f} {nbytes / ms['fused'] / 1e6:10.1f} "
                          f"{ms['torch'] / ms['fused']:6.2f}x", flush=True)
                    results.append({"mode": mode, "dtype": dt_name, "rows": M, "layer": name, "N": N, "K": K,
                                    "bytes": nbytes, "torch_ms": ms["torch"], "fused_ms": ms["fused"]})
                label = dt_name if mode == "none" else mode
                print(f"{label:8} {dt_name:9} {M:4d} {'a step':7} {'':6} {'':5} {step['torch']:9.2f} {step['fused']:9.2f} "
                      f"{'':10} {'':10} {step['torch'] / step['fused']:6.2f}x  (all linears of one decode step)")
    if args.json:
        cli.write_json(args.json, {"threads": torch.get_num_threads(), "isa": torch.ops.sparq.linear_cpu_isa(),
                                   "rows": results})
    return 0


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="bench.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=cli.ArgumentParser)
    p = sub.add_parser("attention", help="decode-attention op: dense vs SparQ variants")
    p.add_argument("--shape", default=None, help=f"comma list of {', '.join(SHAPES)} (default smollm2)")
    p.add_argument("--batch-size", default=None, help="comma list (default 1,4,16; cuda: 64)")
    p.add_argument("--seq-len", default=None, help="comma list (default 2048,8192,32768; cuda: 4096)")
    p.add_argument("--sparq-r", type=int, default=None, help="default 16 (cuda: 32)")
    p.add_argument("--sparq-k", type=int, default=None, help="default 128")
    p.add_argument("--sparq-local", type=int, default=None, help="default k // 4")
    p.add_argument("--mean-v", action="store_true", help="SparQ mean-value reallocation")
    p.add_argument("--dtype", default=None, help=f"comma list of {', '.join(DTYPES)} (default float32; cuda: float16)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kernel", default="all", help="SparQ kernels: comma list of all, torch, cpu, triton")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per method (median reported)")
    p.add_argument("--min-iters", type=int, default=5, help="iterations before --max-seconds can stop")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time budget per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-copies", type=int, default=256, help="cap on rotated cache copies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-thp", dest="thp", action="store_false",
                   help="do not ask torch for transparent huge pages (THP_MEM_ALLOC_ENABLE=1)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--plot", default=None, help="write a PNG: speedup vs seq_len per batch size")
    p.set_defaults(func=cmd_attention)

    p = sub.add_parser("decode", help="end-to-end decode on a checkpoint: dense vs SparQ")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", default="checkpoints/SmolLM2-135M-Instruct", help="model.pth or its directory")
    model.add_argument("--random-weights", metavar="SHAPE",
                       help="no checkpoint: random weights of a published shape (model.SHAPES: llama-2-7b, "
                            "smollm2, ...), a random prompt, no tokenizer")
    p.add_argument("--prompt-tokens", default="1024,4096,8192",
                   help="comma list of context lengths (0 = the first token; near the model's context the "
                        "timed steps start early enough to end at it)")
    p.add_argument("--batch-size", default="1,4,8", help="comma list")
    p.add_argument("--dtype", default="float32", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--sparq-r", default="16", help="comma list: one SparQ policy per r, each beside dense")
    p.add_argument("--sparq-k", type=int, default=128)
    p.add_argument("--sparq-local", type=int, default=None, help="default k // 4")
    p.add_argument("--sparq-mean-v", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--kernel", default="auto", choices=("auto", "cpu", "torch"), help="decode kernels (as generate.py)")
    p.add_argument("--llamacpp", default=None, metavar="GGUF",
                   help="also time llama.cpp (llamacpp.py, built on first use) after the same contexts on this GGUF "
                        "(the checkpoint's source), in each --dtype's format, and print it beside our rows")
    p.add_argument("--llamacpp-format", default=None,
                   help="llama.cpp's format for every --dtype (llamacpp.py's formats; default: the dtype's own), "
                        "e.g. q8_0 beside an int8 checkpoint")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the timing this many times, ours and llama.cpp taking turns; cells are medians")
    p.add_argument("--ragged", default=None,
                   help="also time one batch of rows at these different contexts (comma list), e.g. 1024,4096,8192")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (dynamic shapes)")
    p.add_argument("--prefill", action="store_true",
                   help="also time our prefill of each context (N tokens into an empty cache, B = 1), printed "
                        "with the rows and beside llama.cpp's prefill with --llamacpp")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--plot", default=None, help="write a PNG: tokens/s vs context")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("linear", help="decode-step GEMV: torch vs the fused CPU kernels (float or quantized weights)")
    p.add_argument("--rows", default="1,8", help="comma list of input rows (the decode batch size)")
    p.add_argument("--dtype", default="float32,bfloat16", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--quantized", default=None,
                   help="comma list of none, int8, int4: quantized weights as quantize.py stores them, torch's "
                        "packed aten kernels vs the fused quantized GEMVs (default: none, float weights)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.set_defaults(func=cmd_linear)

    # Listed for --help; main() hands these to gpu_check.py's and llamacpp.py's own command lines.
    sub.add_parser("gpu-check", help="the H100 check (gpu_check.py; its flags follow): Triton tests, attention "
                                     "op, end to end")
    sub.add_parser("llamacpp", help="llama.cpp built from PyPI (llamacpp.py; its flags follow): build, bench")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu-check"]:
        import gpu_check

        return gpu_check.main(argv[1:])
    if argv[:1] == ["llamacpp"]:
        import llamacpp

        return llamacpp.main(argv[1:])

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "thp", False) and "torch" not in sys.modules:
            # torch's CPU allocator backs big tensors with transparent huge pages (madvise mode):
            # fewer TLB misses for every method (random row gathers gain the most)
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        return args.func(args)

    return cli.main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
