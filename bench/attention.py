"""`python -m bench attention`: one layer's decode-attention op (one query token per batch row), dense
against every SparQ variant, side by side in one process. Each configuration rotates among enough
copies of the cache (k, k_t, v, v_sum, q) that every call reads from DRAM, not from the last-level
cache, and reports the median over the iterations after warm-up. Bytes are the paper's transfer
counts (Appendix G): dense 2Sd + 2d, SparQ Sr + 2kd + 4d elements per KV head, times B * n_kv *
element size. With --cache-format (CPU), the fused ops also run on quantized caches (int8 K and V, an
int8 or int4 K^T: cache.KVCache's layout, filled from the same K and V), their bytes counted as stored
(cache.stored_bytes) against dense on the float cache.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import cli
from bench.common import DTYPES, cache_formats, last_level_cache_bytes, torch_dtype
from cli import UserError

# Shapes of one layer's attention: (KV heads, query heads, head dim).
SHAPES = {
    "smollm2": (3, 9, 64),  # SmolLM2-135M: GQA, 3 query heads per KV head
    "llama2-7b": (32, 32, 128),  # Llama 2 7B: MHA
}
MEMORY_LIMIT = 8 * 2**30  # skip configurations whose cache copies would exceed this
# The paper's Table 4 microbenchmark (A100): B=64, 32 heads, d=128, S=4096, r=32, k=128.
TABLE4 = dict(shape="llama2-7b", batch_size="64", seq_len="4096", sparq_r=32, sparq_k=128)


def add_parser(sub) -> None:
    """The `attention` subcommand's flags."""
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
    p.add_argument("--cache-format", default="auto",
                   help="comma list of KV cache formats KV[/KT[/SCALE]] (generate.py's --kv-dtype, --kt-dtype, "
                        "--kt-scale-dtype), e.g. auto,int8,int8/int4,auto/int4/bfloat16: each quantized one adds the "
                        "fused dense (int8 K/V) and SparQ ops on that cache as stored, against dense on the float cache "
                        "(--device cpu, --kernel cpu)")
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
    p.set_defaults(func=run)


@dataclass
class Method:
    name: str
    kind: str  # "dense" | "sparq"
    fn: Callable  # fn(copy) -> Tensor
    layout: str = "twice"  # which K layouts the call reads
    cache: str = "auto"  # the --cache-format whose copy the call reads ("auto": the float cache)


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


def _stored_copy(copy: dict, fmt, dtype) -> dict:
    """A float copy's K and V written into a cache of format `fmt` (cache.KVCache quantizes them as a prefill
    does), as the fused kernels read it: the stored buffers, their scales, the sums over the stored values."""
    import torch

    from cache import KVCache

    B, n_kv, S, d = copy["k"].shape
    cache = KVCache(B, S, n_kv, d, dtype, kv_dtype=fmt.kv_dtype, kt_dtype=fmt.kt_dtype, kt_scale_dtype=fmt.kt_scale_dtype)
    cache.update(torch.arange(S), copy["k"], copy["v"])
    view = cache.view(S, B, stored=True)
    return dict(q=copy["q"], k=view.k, k_t=view.k_t, v=view.v, v_sum=view.v_sum, scales=view.scales)


def _stored_copy_bytes(fmt, dtype, B: int, n_kv: int, S: int, d: int) -> float:
    """Roughly what _stored_copy allocates: K, V, K^T and the per-position scales."""
    kv = 2 * B * n_kv * S * d * fmt.bytes_per_element(dtype)
    return kv + B * n_kv * S * (d * fmt.kt_bytes_per_element(dtype) + 3 * 4)


def _methods(device: str, kernels_wanted: list[str], cfg, S: int) -> list[Method]:
    import torch.nn.functional as F

    import kernels
    from attention import dense_attention_torch
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
            return fn(c["q"], c["k"], k_t, c["v"], c["v_sum"], S, None, cfg.r, cfg.k_top, cfg.local, cfg.mean_v)
        return Method(name, "sparq", call, layout)

    if "torch" in kernels_wanted:
        methods.append(sparq_method("sparq-torch", sparq_attention_torch, "twice"))
    fused = kernels.sparq_attention_cpu if device == "cpu" else kernels.sparq_attention_triton
    if "cpu" in kernels_wanted or "triton" in kernels_wanted:
        methods.append(sparq_method("sparq-fused", fused, "twice"))
        methods.append(sparq_method("sparq-fused-1xk", fused, "once"))
        floor = _floor_config(cfg)
        methods.append(Method("sparq-floor", "floor", lambda c: fused(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None,
                                                                      floor.r, floor.k_top, floor.local, floor.mean_v)))
    return methods


def _stored_methods(label: str, fmt, cfg, S: int, with_dense: bool) -> list[Method]:
    """The fused CPU ops on the copy of cache format `label` as stored: SparQ at the run's r and k, SparQ's
    floor, and with_dense, dense (for the first format with int8 K and V: dense reads no K^T)."""
    import kernels

    def sparq(c, conf):
        return kernels.sparq_attention_cpu(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None, conf.r, conf.k_top,
                                           conf.local, conf.mean_v, scales=c["scales"])

    floor = _floor_config(cfg)
    methods = [Method(f"sparq-fused {label}", "sparq", lambda c: sparq(c, cfg), cache=label),
               Method(f"sparq-floor {label}", "floor", lambda c: sparq(c, floor), cache=label)]
    if with_dense:
        methods.insert(0, Method(f"dense-fused {label}", "dense", cache=label, fn=lambda c: kernels.dense_attention_cpu(
            c["q"], c["k"], c["v"], S, scales=c["scales"])))
    return methods


def _floor_config(cfg):
    """SparQ at r = 1, k = 8: it reads almost nothing (one row of K^T, eight of K and V), so its time is the
    fused op's work that does not scale with what it reads: step 1's softmax over S, the selection,
    the phases. Set beside the time at the chosen r and k, it says whether a cell is bound by that
    work or by its bytes."""
    from sparq import SparQConfig

    return SparQConfig(r=1, k_top=min(8, cfg.k_top), local=1, mean_v=False)


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


def run(args) -> int:
    import torch

    from attention import DenseDecode
    from cache import KVFormat
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
    formats = cache_formats(args.cache_format)
    r = args.sparq_r if args.sparq_r is not None else 16
    k_top = args.sparq_k if args.sparq_k is not None else 128
    if args.iters < 1 or args.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    for shape in shapes:
        try:
            SparQConfig(r=r, k_top=k_top, local=args.sparq_local, mean_v=args.mean_v).validate(SHAPES[shape][2])
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    stored = [(label, fmt) for label, fmt in formats if fmt.int8_kv or fmt.quantized_kt]
    for label, fmt in formats:
        if (label, fmt) not in stored and (fmt.kv_dtype, fmt.kt_dtype) != ("auto", "same"):
            raise UserError(f"--cache-format {label}: the float rows read the cache in --dtype already; "
                            "give auto or quantized formats (int8, int8/int4, auto/int4)")
    if stored and (device != "cpu" or "cpu" not in kernels_wanted):
        raise UserError("--cache-format with a quantized format times the fused CPU ops: --device cpu, --kernel cpu")
    if device == "cpu" and "cpu" in kernels_wanted:
        import kernels

        error = kernels.cpu_kernel_error(kernels.ALL_CPU_BUILDS)  # builds before timing anything (first use only)
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
        dtype = torch_dtype(dt_name)
        es = torch.finfo(dtype).bits // 8
        cfg = SparQConfig(r=r, k_top=k_top, local=args.sparq_local, mean_v=args.mean_v)
        # bytes a call moves, per cache and method kind: the float cache's in --dtype, the others' as stored
        policies = (("dense", DenseDecode()), ("sparq", SparQDecode(cfg)), ("floor", SparQDecode(_floor_config(cfg))))
        transfer = {label: {kind: policy.transfer_bytes(S, d, fmt, dtype) * B * n_kv for kind, policy in policies}
                    for label, fmt in [("auto", KVFormat())] + stored}
        dense_bytes = transfer["auto"]["dense"]
        copy_bytes = 3 * B * n_kv * S * d * es + B * n_kv * (g + 1) * d * 4
        copy_bytes += sum(_stored_copy_bytes(fmt, dtype, B, n_kv, S, d) for _, fmt in stored)
        # enough copies that even SparQ's working set (the smallest) spans a few LLCs
        least = min(b["sparq"] for b in transfer.values())
        n_copies = max(2, math.ceil(3 * last_level_cache_bytes() / least)) if device == "cpu" else 2
        n_copies = min(n_copies, args.max_copies)
        scratch = B * n_kv * (r * es + 4 * 4 * g) * S  # sparq-torch temporaries, roughly
        if copy_bytes + scratch > MEMORY_LIMIT:
            note = f"skipped {shape} {dt_name} B={B} S={S}: needs {(copy_bytes + scratch) / 2**30:.1f} GiB > 8 GiB"
            notes.append(note)
            bar.write("note: " + note, file=sys.stderr)
            continue
        n_copies = max(1, min(n_copies, int((MEMORY_LIMIT - scratch) // copy_bytes)))
        if n_copies * copy_bytes < 3 * last_level_cache_bytes() and device == "cpu":
            bar.write(f"note: {shape} {dt_name} B={B} S={S}: only {n_copies} cache copies fit", file=sys.stderr)
        bar.set_postfix_str(f"{shape} {dt_name} B={B} S={S} ({n_copies} copies)")
        copies = []
        for _ in range(n_copies):
            copy = _make_copy(B, n_kv, g, d, S, dtype, device, gen, with_kt=True)
            copies.append({"auto": copy, **{label: _stored_copy(copy, fmt, dtype) for label, fmt in stored}})
        methods = _methods(device, kernels_wanted, cfg, S)
        first_int8 = next((label for label, fmt in stored if fmt.int8_kv), None)
        for label, fmt in stored:
            methods += _stored_methods(label, fmt, cfg, S, with_dense=label == first_int8)
        times = {m.name: [] for m in methods}
        with torch.inference_mode():
            for i in range(args.warmup):
                for m in methods:
                    m.fn(copies[i % n_copies][m.cache])
            start = time.perf_counter()
            for i in range(args.iters):  # interleaved: every method sees the same machine state
                for m in methods:
                    times[m.name].append(_time_call(m.fn, copies[(i + args.warmup) % n_copies][m.cache], device))
                if i + 1 >= args.min_iters and time.perf_counter() - start > args.max_seconds:
                    break
        del copies
        median = {name: statistics.median(ts) for name, ts in times.items()}
        fastest = {name: min(ts) for name, ts in times.items()}
        dense_names = [m.name for m in methods if m.kind == "dense" and m.cache == "auto"]  # the float cache's
        best_dense = min(dense_names, key=lambda n: median[n])
        for m in methods:
            nbytes = transfer[m.cache][m.kind]
            row = dict(shape=shape, dtype=dt_name, batch_size=B, seq_len=S, method=m.name, cache_format=m.cache,
                       time_ms=median[m.name] * 1e3, time_ms_min=fastest[m.name] * 1e3,
                       gb_s=nbytes / median[m.name] / 1e9,
                       speedup_vs_dense=median[best_dense] / median[m.name],
                       theoretical_speedup=dense_bytes / nbytes, dense_baseline=best_dense,
                       iterations=len(times[m.name]), copies=n_copies)
            row["of_theory"] = row["speedup_vs_dense"] / row["theoretical_speedup"]
            floor_name = m.name.replace("sparq-fused", "sparq-floor", 1)
            if m.kind == "sparq" and m.name.startswith("sparq-fused") and floor_name in median:
                row["floor_share"] = median[floor_name] / median[m.name]
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
    width = max([24] + [len(row["method"]) + 1 for row in rows])  # + the baseline's mark; long --cache-format labels
    header = (f"{'shape':<10} {'dtype':<9} {'B':>3} {'S':>6}  {'method':<{width}} {'time ms':>9} {'min ms':>9} "
              f"{'GB/s':>6} {'speedup':>8} {'theory':>7} {'of theory':>9} {'floor':>6}")
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
              f"{row['method'] + mark:<{width}} {row['time_ms']:>9.3f} {row['time_ms_min']:>9.3f} {row['gb_s']:>6.1f} "
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
