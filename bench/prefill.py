"""`python -m bench prefill`: one layer's prefill attention, torch's SDPA (attention.prefill_attention, the
readable path) against the fused C++ kernel (kernels.prefill_attention_cpu), taking turns in one process.
A case is a chunk of T queries, the last T of S key positions: a long prompt's later chunk sees the
chunks before it (generate.py prefills in chunks), so S = T is a whole short prompt. GFLOP/s counts the
causal part only: 4 d flops per query head and allowed (query, key) pair. Beside the times, each output's
largest difference from an fp64 computation of the chunk's last rows (the ones that see the most keys):
a fast kernel that were wrong would show it there.
"""
from __future__ import annotations

import os

import cli
from bench.common import DTYPES, alternating_medians, torch_dtype
from cli import UserError

CHECKED_ROWS = 64  # the chunk's last queries, compared with fp64


def add_parser(sub) -> None:
    """The `prefill` subcommand's flags."""
    p = sub.add_parser("prefill", help="prefill attention of one layer: torch's SDPA vs the fused CPU kernel")
    p.add_argument("--heads", default="14/2/64",
                   help="comma list of H/n_kv/d: query heads, KV heads, head dim of one layer (default 14/2/64, "
                        "Qwen2.5-0.5B's; SmolLM2-135M's is 9/3/64)")
    p.add_argument("--chunk", default="2048", help="comma list of T, the chunk's queries (default 2048)")
    p.add_argument("--keys", default="2048,8192,16384",
                   help="comma list of S, the keys a chunk sees (its own T and those before it; each >= T)")
    p.add_argument("--dtype", default="bfloat16,float32", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of turns (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.set_defaults(func=run)


def causal_flops(T: int, S: int, heads: int, d: int) -> int:
    """Flops of the scores and P V over the allowed pairs: query i of the chunk (at position S - T + i)
    sees S - T + i + 1 keys."""
    pairs = T * (S - T) + T * (T + 1) // 2
    return 4 * d * heads * pairs


def head_shapes(text: str) -> list[tuple[int, int, int]]:
    """--heads: [(H, n_kv, d)], each H a multiple of n_kv."""
    shapes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split("/")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(f"--heads: {item!r} is not H/n_kv/d (three positive integers, e.g. 14/2/64)")
        H, n_kv, d = map(int, parts)
        if H % n_kv:
            raise UserError(f"--heads {item}: the query heads ({H}) must be a multiple of the KV heads ({n_kv})")
        shapes.append((H, n_kv, d))
    if not shapes:
        raise UserError("--heads: give at least one H/n_kv/d")
    return shapes


def _inputs(T: int, S: int, n_kv: int, H: int, d: int, dtype, gen):
    """q (1, H, T, d) carrying the score scale 1/sqrt(d) (as Attention passes it), k, v (1, n_kv, S, d)."""
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return randn(1, H, T, d) * d ** -0.5, randn(1, n_kv, S, d), randn(1, n_kv, S, d)


def _largest_error(out, q, k, v) -> float:
    """The largest difference of `out`'s last CHECKED_ROWS rows from fp64 attention of those rows."""
    from attention import prefill_attention

    T, S = q.shape[2], k.shape[2]
    m = min(CHECKED_ROWS, T)
    exact = prefill_attention(q[:, :, -m:].double(), k.double(), v.double(), q_start=S - m, window=None, cap=None)
    return float((out[:, :, -m:].double() - exact).abs().max())


def run(args) -> int:
    import torch

    import kernels
    from attention import prefill_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = head_shapes(args.heads)
    dtypes = cli.name_list(args.dtype, "--dtype", DTYPES)
    chunks, keys = cli.int_list(args.chunk, "--chunk"), cli.int_list(args.keys, "--keys")
    if args.rounds < 1:
        raise UserError(f"--rounds must be at least 1, got {args.rounds}")
    cases = [(T, S) for T in chunks for S in keys if S >= T]
    if not cases:
        raise UserError(f"--keys: every S is below every --chunk T ({args.keys} < {args.chunk}); a chunk sees itself")
    error = kernels.cpu_kernel_error()  # builds before timing anything (first use only)
    if error is not None:
        raise UserError(f"the fused CPU kernels cannot be built ({error})")
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(args.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# prefill attention of one layer, threads={torch.get_num_threads()}, median of {args.rounds} rounds "
          f"(sdpa and fused taking turns), load average {load:.1f}")
    print("# a chunk of T queries, the last of S keys; GFLOP/s over the causal pairs; err = largest |out - fp64| "
          f"over the chunk's last {CHECKED_ROWS} rows")
    header = (f"{'H/n_kv/d':9} {'dtype':9} {'T':>6} {'S':>6} {'sdpa ms':>9} {'fused ms':>9} {'sdpa GF/s':>9} "
              f"{'fused GF/s':>10} {'speedup':>7} {'sdpa err':>9} {'fused err':>9}")
    print(header)
    rows = []
    configs = [(s, dt, T, S) for s in shapes for dt in dtypes for T, S in cases]
    with torch.inference_mode():
        for (H, n_kv, d), dt_name, T, S in tqdm(configs, desc="prefill attention", unit="case", leave=False):
            q, k, v = _inputs(T, S, n_kv, H, d, torch_dtype(dt_name), gen)
            calls = {"sdpa": lambda: prefill_attention(q, k, v, S - T, None, None),
                     "fused": lambda: kernels.prefill_attention_cpu(q, k, v)}
            errors = {name: _largest_error(call(), q, k, v) for name, call in calls.items()}
            seconds = alternating_medians(calls, rounds=args.rounds, reps=1, warm=1)
            flops = causal_flops(T, S, H, d)
            row = {"dtype": dt_name, "T": T, "S": S, "n_kv": n_kv, "heads": H, "head_dim": d,
                   "flops": flops, **{f"{m}_ms": s * 1e3 for m, s in seconds.items()},
                   **{f"{m}_error": e for m, e in errors.items()}, "speedup": seconds["sdpa"] / seconds["fused"]}
            rows.append(row)
            tqdm.write(f"{f'{H}/{n_kv}/{d}':9} {dt_name:9} {T:6d} {S:6d} {row['sdpa_ms']:9.2f} {row['fused_ms']:9.2f} "
                       f"{flops / seconds['sdpa'] / 1e9:9.1f} {flops / seconds['fused'] / 1e9:10.1f} "
                       f"{row['speedup']:6.2f}x {errors['sdpa']:9.2e} {errors['fused']:9.2e}")
    if args.json:
        cli.write_json(args.json, {"threads": torch.get_num_threads(), "rounds": args.rounds,
                                   "checked_rows": CHECKED_ROWS, "rows": rows})
    return 0
