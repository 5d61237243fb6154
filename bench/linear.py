"""`python -m bench linear`: the GEMVs of one SmolLM2 decode step, torch's F.linear against the fused
CPU kernel (float or quantized weights)."""
from __future__ import annotations

import math
import os
import statistics
import time

import cli
from bench.common import DTYPES, last_level_cache_bytes, torch_dtype
from cli import UserError


def add_parser(sub) -> None:
    """The `linear` subcommand's flags."""
    p = sub.add_parser("linear", help="decode-step GEMV: torch vs the fused CPU kernels (float or quantized weights)")
    p.add_argument("--rows", default="1,8", help="comma list of input rows (the decode batch size)")
    p.add_argument("--dtype", default="float32,bfloat16", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--quantized", default=None,
                   help="comma list of none, int8, int4: quantized weights as quantize.py stores them, torch's "
                        "packed aten kernels vs the fused quantized GEMVs (default: none, float weights)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.set_defaults(func=run)


# SmolLM2-135M's linears as (name, out features, in features, count per decode step)
SMOLLM2_LINEARS = (("wqkv", 960, 576, 30), ("wo", 576, 576, 30), ("w13", 3072, 576, 30), ("w2", 576, 1536, 30),
                   ("output", 49152, 576, 1))


def _linear_methods(mode: str, name: str, N: int, K: int, dtype):
    """{method: (make, call)} for one linear of a decode step and the bytes one call streams: make()
    builds an independent copy of the weight in the method's format, call(copy, x) runs it. mode
    "none": F.linear against the fused GEMV on a float weight of `dtype`; "int8" / "int4": the
    layer as quantize.py stores it (the head int8 in groups of 64 in both modes, as by default),
    torch's packed aten kernels (what quantize.py ran before the fused GEMVs) against the fused
    quantized GEMV that "auto" runs (on the weights repacked in rows of 16 where it is gemv-q8)."""
    import torch
    import torch.nn.functional as F

    if mode == "none":
        make = lambda: torch.randn(N, K).to(dtype)  # noqa: E731
        return {"torch": (make, lambda w, x: F.linear(x, w)),
                "fused": (make, lambda w, x: torch.ops.sparq.linear_cpu(x, w))}, N * K * dtype.itemsize
    import qlinear as QL
    import quantize as Q

    int8 = mode == "int8" or name == "output"
    group = (Q.head_int8_group_size(K) if name == "output" else None) if int8 else Q.DEFAULT_GROUP_SIZE

    def layer(backend: str):
        def make():
            w = torch.randn(N, K)
            if int8:
                module = QL.Int8Linear(K, N, group)
                module.weight, module.scales = QL.quantize_int8(w, group)
            else:
                module = QL.Int4Linear(K, N, group)
                q, module.scales, module.zeros = QL.quantize_int4(w, group)
                module.weight = QL.pack_nibbles(q)
            module.finalize(backend)  # "int4x2": the int8 layers' aten choice; int4 layers take int4pack
            return module
        return make

    stored = N * K if int8 else N * K // 2 + 2 * 2 * N * (K // group)  # bytes, scales (and zeros) included
    if int8:
        stored += 2 * N * (1 if group is None else K // group)
    # fused: the GEMV "auto" runs (gemv-q8 where the build has VNNI, else gemv)
    fused = QL.gemv_kernel(torch.device("cpu"))
    return {"torch": (layer("int4x2"), lambda m, x: m(x)), "fused": (layer(fused), lambda m, x: m(x))}, stored


def run(args) -> int:
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
            dtype = torch_dtype(dt_name)
            for M in rows_list:
                step = {"torch": 0.0, "fused": 0.0}
                for name, N, K, count in SMOLLM2_LINEARS:
                    methods, nbytes = _linear_methods(mode, name, N, K, dtype)
                    n_copies = max(2, math.ceil(3 * last_level_cache_bytes() / nbytes))
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
