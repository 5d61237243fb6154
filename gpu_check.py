"""The GPU check (#14): one command that proves the CUDA path on a bare GPU machine and prints one report.

    python gpu_check.py                          # everything, ~10 minutes on one H100
    python gpu_check.py --sections tests,attention --json gpu_check.json
    python gpu_check.py --quick                  # fewer shapes and steps (a first look)

Needs only torch and triton (no network, no checkpoint, no gguf): models are built from
model.ModelArgs with random bf16 weights on the GPU. Sections, each reported as it finishes:

  tests      the Triton kernels on the GPU: tests/test_kernels_triton.py under pytest when pytest is
             installed, and always the built-in checks below (kernels vs the references, ragged
             rows, one CUDA graph replayed at changing live lengths, one torch.compile for them all)
  attention  one layer's decode attention: the paper's Table 4 shape and B = 1 at 8k / 32k / 128k in
             Llama-2-7B (32/32 heads) and Llama-3-8B (32/8) shapes; dense (the best of SDPA, our
             Triton flash-decoding kernel and FlexAttention) against SparQ (Triton); time per call
             from CUDA graphs over rotating cache copies larger than L2, % of the transfer theory
             (bytes / measured copy bandwidth), kernels launched per call (torch.profiler)
  e2e        Llama-2-7B and Llama-3.1-8B shapes, bf16, random weights, decode compiled with CUDA
             graphs (torch.compile mode="reduce-overhead"): B = 1 and 8 at 4k, 16k, 32k, dense
             against SparQ: tokens/s and (weights + KV bytes read) GB/s
  quant      int8 and int4 weight-only (quantize.py) end to end, Llama-2-7B shape, B = 1, one context

Goals (issue 14), marked PASS / MISS in the report: Table 4 SparQ >= 70% of its transfer theory;
B = 1, S >= 16k SparQ faster than the best dense; end to end Llama-2-7B B = 1 bf16 >= 1.3x dense at
16k and >= 1.8x at 32k. Without a GPU every section is skipped with its reason (tests/test_gpu_check.py
runs the CPU-side parts: arguments, theory, formatting, and a tiny smoke of the harness).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import cli

REPO = Path(__file__).resolve().parent
SECTIONS = ("tests", "attention", "e2e", "quant")
L2_BYTES = 50 * 2**20  # H100: rotate copies until every call reads from DRAM
ROTATE_BYTES = 4 * L2_BYTES  # bytes a method must touch per graph replay before a copy comes back
COPY_MEMORY = 24 * 2**30  # at most this much for an attention configuration's cache copies

# Attention shapes: (name, B, n_kv, g, d, S, r, k)
TABLE4 = ("table4 (llama2-7b, B=64)", 64, 32, 1, 128, 4096, 32, 128)
ATTENTION_SHAPES = [TABLE4] + [
    (f"{model} B=1 S={S // 1024}k", 1, n_kv, g, 128, S, 32, 128)
    for model, n_kv, g in (("llama2-7b", 32, 1), ("llama3-8b", 8, 4)) for S in (8192, 32768, 131072)
]
QUICK_ATTENTION = [TABLE4, ("llama2-7b B=1 S=32k", 1, 32, 1, 128, 32768, 32, 128),
                   ("llama3-8b B=1 S=32k", 1, 8, 4, 128, 32768, 32, 128)]


def llama_args(name: str):
    """ModelArgs of the Llama-2-7B / Llama-3.1-8B shapes (random weights: only the shapes matter)."""
    from model import ModelArgs

    if name == "llama2-7b":
        return ModelArgs(vocab_size=32000, dim=4096, n_layer=32, n_head=32, n_kv_head=32, head_dim=128,
                         intermediate_size=11008, rope_base=10000.0, norm_eps=1e-5, max_context=131072)
    if name == "llama3.1-8b":
        return ModelArgs(vocab_size=128256, dim=4096, n_layer=32, n_head=32, n_kv_head=8, head_dim=128,
                         intermediate_size=14336, rope_base=500000.0, norm_eps=1e-5, max_context=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    raise ValueError(name)


E2E_MODELS = ("llama2-7b", "llama3.1-8b")
E2E_CONTEXTS = (4096, 16384, 32768)
E2E_BATCHES = (1, 8)


# ---------------------------------------------------------------------------------------------
# Theory (paper, Appendix G) and goals
# ---------------------------------------------------------------------------------------------


def dense_bytes(B: int, n_kv: int, d: int, S: int, elem: int = 2) -> int:
    """Dense decode attention's transfers: 2Sd + 2d elements per KV head."""
    return B * n_kv * (2 * S * d + 2 * d) * elem


def sparq_bytes(B: int, n_kv: int, d: int, S: int, r: int, k: int, elem: int = 2) -> int:
    """SparQ's transfers: Sr + 2kd + 4d elements per KV head (k capped at S)."""
    return B * n_kv * (S * r + 2 * min(k, S) * d + 4 * d) * elem


def sparq_extra_bytes(B: int, n_kv: int, g: int, S: int) -> int:
    """Bytes our kernels move beyond the paper's count: step 1's fp32 logits, written once and read once."""
    return B * n_kv * g * S * 4 * 2


@dataclass
class Goal:
    name: str
    target: str
    value: Optional[float]  # measured, None if not measured
    passed: Optional[bool]


def attention_goals(rows: list[dict]) -> list[Goal]:
    goals = []
    t4 = next((r for r in rows if r["name"] == TABLE4[0] and "sparq_us" in r), None)
    goals.append(Goal("Table 4 shape: SparQ % of its transfer theory", ">= 70%",
                      t4 and t4["sparq_theory_pct"], None if t4 is None else t4["sparq_theory_pct"] >= 70))
    for r in rows:
        if r["B"] == 1 and r["S"] >= 16384 and "sparq_us" in r and "dense_us" in r:
            speedup = r["dense_us"] / r["sparq_us"]
            goals.append(Goal(f"{r['name']}: SparQ vs best dense ({r['dense_best']})", "> 1.00x", speedup, speedup > 1))
    return goals


def e2e_goals(rows: list[dict]) -> list[Goal]:
    goals = []
    for ctx, target in ((16384, 1.3), (32768, 1.8)):
        pair = {r["policy"]: r for r in rows if r["model"] == "llama2-7b" and r["B"] == 1 and r["context"] == ctx
                and r.get("weights", "bf16") == "bf16" and "tokens_per_s" in r}
        value = pair["sparq"]["tokens_per_s"] / pair["dense"]["tokens_per_s"] if len(pair) == 2 else None
        goals.append(Goal(f"end to end llama2-7b B=1 bf16 {ctx // 1024}k: SparQ / dense tokens/s", f">= {target}x",
                          value, None if value is None else value >= target))
    return goals


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def attention_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["name"], "error: " + r["error"]] + [""] * 8)
            continue
        dense = r.get("dense_us")
        out.append([r["name"], f"{fmt(dense)} ({r.get('dense_best', '-')})", fmt(r.get("sparq_us")),
                    fmt(dense / r["sparq_us"], ".2f") + "x" if dense and r.get("sparq_us") else "-",
                    fmt(r["theory_speedup"], ".2f") + "x", fmt(r.get("dense_theory_pct"), ".0f") + "%",
                    fmt(r.get("sparq_theory_pct"), ".0f") + "%", fmt(r.get("sparq_gbs"), ".0f"),
                    f"{r.get('dense_kernels', '-')}/{r.get('sparq_kernels', '-')}",
                    " ".join(f"{k}={fmt(v)}" for k, v in r.get("dense_all", {}).items())])
    return table(["shape", "dense us (best)", "SparQ us", "speedup", "theory", "dense %th", "SparQ %th",
                  "SparQ GB/s", "kernels d/s", "dense candidates us"], out)


def e2e_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["model"], r.get("weights", "bf16"), r["B"], r["context"], r["policy"], "error: " + r["error"],
                        "", "", ""])
            continue
        out.append([r["model"], r.get("weights", "bf16"), r["B"], r["context"], r["policy"], fmt(r["ms_per_step"], ".2f"),
                    fmt(r["tokens_per_s"]), fmt(r["gb_per_s"], ".0f"), fmt(r.get("speedup"), ".2f") + "x"
                    if r.get("speedup") else "-"])
    return table(["model", "weights", "B", "context", "attention", "ms/step", "tokens/s", "GB/s", "vs dense"], out)


def goals_text(goals: list[Goal]) -> str:
    lines = []
    for g in goals:
        mark = "n/a " if g.passed is None else "PASS" if g.passed else "MISS"
        lines.append(f"  [{mark}] {g.name}: {fmt(g.value, '.2f')} (goal {g.target})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_cuda_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Seconds per call: every call captured once into one CUDA graph (each call on its own cache
    copy), the graph replayed `replays` times between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(calls))


def time_host(calls: list[Callable[[], object]], replays: int = 2) -> float:
    """The CPU smoke's stand-in for time_cuda_graph: wall-clock seconds per call."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(replays):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (replays * len(calls))


def kernels_per_call(call: Callable[[], object]) -> Optional[int]:
    """GPU kernels one call launches (torch.profiler, after a warm-up call); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kinds = {"cuda", "kernel"}
    return sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).split(".")[-1].lower() in kinds
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write), from a 1 GiB copy in a CUDA graph."""
    n = 2**30 // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    seconds = time_cuda_graph([lambda: b.copy_(a)], replays=10)
    del a, b
    return 2 * 2**30 / seconds


# ---------------------------------------------------------------------------------------------
# Section: attention
# ---------------------------------------------------------------------------------------------


def _attention_copies(B, n_kv, g, d, S, dtype, device, n_copies, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    copies = []
    for _ in range(n_copies):
        k = torch.randn(B, n_kv, S, d, generator=gen, device=device, dtype=dtype)
        v = torch.randn(B, n_kv, S, d, generator=gen, device=device, dtype=dtype)
        copies.append(dict(q=torch.randn(B, n_kv, g, d, generator=gen, device=device, dtype=dtype), k=k, v=v,
                           k_t=k.transpose(2, 3).contiguous(), v_sum=v.float().sum(2)))
    return copies


def dense_candidates(device: str) -> dict[str, Callable]:
    """name -> fn(copy, S): every dense decode attention available here, each reading positions [0, S)."""
    import torch.nn.functional as F

    import kernels_triton

    def sdpa(c, S):
        B, n_kv, g, d = c["q"].shape
        return F.scaled_dot_product_attention(c["q"].reshape(B, n_kv * g, 1, d), c["k"][:, :, :S], c["v"][:, :, :S],
                                              enable_gqa=g > 1)

    candidates = {"sdpa": sdpa,
                  "triton": lambda c, S: kernels_triton.dense_attention_triton(c["q"], c["k"], c["v"], S, None)}
    if device == "cuda":
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)

            def flex_decode(c, S):
                B, n_kv, g, d = c["q"].shape
                return flex(c["q"].reshape(B, n_kv * g, 1, d), c["k"][:, :, :S], c["v"][:, :, :S], enable_gqa=g > 1)

            candidates["flex"] = flex_decode
        except Exception:  # FlexAttention missing in this torch: the others stand
            pass
    return candidates


def attention_row(shape, device: str, dtype=torch.bfloat16, bandwidth: Optional[float] = None,
                  replays: int = 20) -> dict:
    """Time dense (every candidate) and SparQ on one shape; theory from the paper's transfer counts."""
    import kernels_triton
    from sparq import SparQConfig

    name, B, n_kv, g, d, S, r, k_top = shape
    elem = torch.tensor([], dtype=dtype).element_size()
    row = dict(name=name, B=B, n_kv=n_kv, g=g, d=d, S=S, r=r, k=k_top,
               dense_bytes=dense_bytes(B, n_kv, d, S, elem), sparq_bytes=sparq_bytes(B, n_kv, d, S, r, k_top, elem),
               sparq_extra_bytes=sparq_extra_bytes(B, n_kv, g, S))
    row["theory_speedup"] = row["dense_bytes"] / row["sparq_bytes"]
    cache_bytes = 3 * B * n_kv * S * d * elem
    touched = min(row["sparq_bytes"], row["dense_bytes"])
    n_copies = max(1, min(math.ceil(ROTATE_BYTES / touched), COPY_MEMORY // cache_bytes, 32))
    if device != "cuda":
        n_copies = 1
    copies = _attention_copies(B, n_kv, g, d, S, dtype, device, n_copies)
    config = SparQConfig(r=r, k=k_top, mean_v=g == 1)
    timer = time_cuda_graph if device == "cuda" else time_host

    def sparq(c):
        return kernels_triton.sparq_attention_triton(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None, r, k_top,
                                                     config.local, config.mean_v)

    row["copies"] = n_copies
    row["sparq_us"] = 1e6 * timer([lambda c=c: sparq(c) for c in copies], replays)
    row["sparq_kernels"] = kernels_per_call(lambda: sparq(copies[0]))
    row["dense_all"] = {}
    candidates = dense_candidates(device)
    for cname, fn in candidates.items():
        try:
            row["dense_all"][cname] = 1e6 * timer([lambda c=c, fn=fn: fn(c, S) for c in copies], replays)
        except Exception as e:  # one candidate failing must not hide the others
            row.setdefault("dense_errors", {})[cname] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if row["dense_all"]:
        best = min(row["dense_all"], key=row["dense_all"].get)
        row["dense_best"], row["dense_us"] = best, row["dense_all"][best]
        row["dense_kernels"] = kernels_per_call(lambda: candidates[best](copies[0], S))
    row["sparq_gbs"] = row["sparq_bytes"] / (row["sparq_us"] * 1e-6) / 1e9
    if bandwidth:
        row["sparq_theory_pct"] = 100 * row["sparq_bytes"] / bandwidth / (row["sparq_us"] * 1e-6)
        if "dense_us" in row:
            row["dense_theory_pct"] = 100 * row["dense_bytes"] / bandwidth / (row["dense_us"] * 1e-6)
    del copies
    return row


# ---------------------------------------------------------------------------------------------
# Section: end to end
# ---------------------------------------------------------------------------------------------


def random_model(args, kernels, device: str, dtype=torch.bfloat16):
    """The Transformer of `args` with random weights (N(0, 0.02), norms 1) directly in `dtype` on `device`."""
    from model import Transformer

    with torch.device("meta"):
        model = Transformer(args, kernels)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    return model.eval()


def quantized_model(model, args, kernels, mode: str, device: str, dtype=torch.bfloat16):
    """`model`'s weights through quantize.quantize_state_dict, loaded as model.load_model loads a
    quantized file (prepare, load_state_dict(assign), finalize) without the round trip through disk."""
    import quantize
    from model import Transformer

    state = {k: v for k, v in model.state_dict().items()}
    qstate = quantize.quantize_state_dict(state, args, mode, None, "int8", source="random", progress=False)
    del state
    meta = qstate.pop("__quantization__")
    with torch.device("meta"):
        qmodel = Transformer(args, kernels)
    quantize.prepare_model(qmodel, meta)
    qmodel.load_state_dict(qstate, assign=True, strict=True)
    qmodel.rope = qmodel.rope_local = torch.empty(0)
    qmodel = qmodel.to(device=device)
    for p in qmodel.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    quantize.finalize_model(qmodel, kernels)
    return qmodel.eval()


def fill_cache(model, B: int, context: int, seed: int = 0) -> None:
    """Every layer's cache holds `context` random positions (through KVCache.update, as a prefill writes them)."""
    args = model.args
    device, dtype = model.device, model.caches[0].k.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    chunk = 4096
    for cache in model.caches:
        for start in range(0, context, chunk):
            end = min(start + chunk, context)
            shape = (B, args.n_kv_head, end - start, args.head_dim)
            cache.update(torch.arange(start, end, device=device),
                         torch.randn(shape, generator=gen, device=device, dtype=dtype),
                         torch.randn(shape, generator=gen, device=device, dtype=dtype))


def decode_run(model, B: int, context: int, steps: int, compile_mode: str, warmup: int = 3) -> dict:
    """Time `steps` greedy decode steps after `context` cached positions. compile_mode "inductor":
    the step under torch.compile(mode="reduce-overhead", fullgraph) as generate.py compiles it;
    "graphs": the eager step captured into one CUDA graph per read length (no inductor: quick to
    build); "eager": plain calls (the CPU smoke). input_pos stays on the device and advances in
    place: no host sync per step."""
    device = model.device
    cuda = device.type == "cuda"
    token = torch.zeros((B, 1), dtype=torch.long, device=device)
    input_pos = torch.tensor([context], device=device)

    def step(model, token, input_pos, length):
        return model(token, input_pos, length)

    if compile_mode == "inductor":
        import torch._dynamo.config as dynamo_config

        compiled = torch.compile(step, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=True)

        def step(model, token, input_pos, length):  # floats compiled in as constants, as generate.compiled_decode_step
            with dynamo_config.patch(specialize_float=True):
                return compiled(model, token, input_pos, length)

    graphs: dict[int, tuple] = {}

    def forward(length: int):
        if compile_mode != "graphs" or not cuda:
            return step(model, token, input_pos, length)
        if length not in graphs:  # capture once per read length (the cache's length bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(model, token, input_pos, length)  # writes position input_pos again: harmless, rewritten
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step(model, token, input_pos, length)
            graphs[length] = (graph, logits)
        graph, logits = graphs[length]
        graph.replay()
        return logits

    def run(n: int) -> None:
        for i in range(n):
            logits = forward(model.read_length(context + i + 1))
            token.copy_(logits.argmax(dim=-1, keepdim=True))
            input_pos.add_(1)

    with torch.no_grad():
        run(warmup)  # compile, record the graphs
        for cache in model.caches:
            cache.rewind(context)
        input_pos.fill_(context)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(steps)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        for cache in model.caches:
            cache.rewind(context)
    kv = sum(model.decode_kv_bytes(context + i + 1, B) for i in range(steps)) / steps
    ms = 1e3 * seconds / steps
    return dict(ms_per_step=ms, tokens_per_s=B * steps / seconds, steps_per_s=steps / seconds,
                gb_per_s=(model.weight_bytes() + kv) / (ms * 1e-3) / 1e9, kv_bytes_per_step=kv,
                weight_bytes=model.weight_bytes(), mode=compile_mode)


def build_policies(model, r: int = 32, k: int = 128) -> dict[str, list]:
    """Per-layer policy instances for dense and SparQ (r, k; mean-V by the paper's rule), built once
    per model and swapped in, so that a compiled step sees the same modules again (no recompile)."""
    from sparq import AttentionSettings, policy_factory

    policies = {}
    for name, settings in (("dense", AttentionSettings(policy="dense")),
                           ("sparq", AttentionSettings(policy="sparq", sparq_r=min(r, model.args.head_dim), sparq_k=k))):
        make = policy_factory(settings, model.args, model.kernels)
        policies[name] = [make(i) for i in range(model.args.n_layer)]
    return policies


def e2e_rows(model, name: str, weights: str, batches, contexts, steps: int, compile_mode: str,
             kv_layout: str = "twice", length_bucket: int = 256) -> list[dict]:
    """dense and SparQ at every (B, context) on one model; caches sized for the largest context. A
    failed torch.compile is retried once as eager steps captured in CUDA graphs (and says so)."""
    rows = []
    policies = build_policies(model)
    for B in batches:
        max_len = max(contexts) + steps + 8
        max_len = -(-max_len // length_bucket) * length_bucket
        try:
            model.setup_caches(B, max_len, kv_layout=kv_layout, length_bucket=length_bucket)
        except torch.cuda.OutOfMemoryError:
            rows += [dict(model=name, weights=weights, B=B, context=c, policy=p, error="out of memory (KV cache)")
                     for c in contexts for p in ("dense", "sparq")]
            continue
        for context in contexts:
            fill_cache(model, B, context)
            pair = {}
            for policy in ("dense", "sparq"):
                row = dict(model=name, weights=weights, B=B, context=context, policy=policy)
                model.set_decode_attention(lambda i, p=policy: policies[p][i])
                try:
                    row.update(decode_run(model, B, context, steps, compile_mode))
                    pair[policy] = row
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
                    if compile_mode == "inductor" and model.device.type == "cuda":
                        traceback.print_exc()
                        try:
                            for cache in model.caches:
                                cache.rewind(context)
                            row.update(decode_run(model, B, context, steps, "graphs"))
                            row["note"] = "torch.compile failed; eager step in CUDA graphs: " + row.pop("error")
                            pair[policy] = row
                        except Exception as e2:
                            row["error"] += f"; graphs: {type(e2).__name__}: {str(e2).splitlines()[0][:120]}"
                rows.append(row)
                print(f"    {name} {weights} B={B} ctx={context} {policy}: "
                      + (f"{row['tokens_per_s']:.1f} tokens/s" if "tokens_per_s" in row else row["error"]), flush=True)
            if len(pair) == 2:
                pair["sparq"]["speedup"] = pair["sparq"]["tokens_per_s"] / pair["dense"]["tokens_per_s"]
        for cache in model.caches:  # free the caches before the next batch size
            cache.to("meta")
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Section: tests
# ---------------------------------------------------------------------------------------------


def builtin_checks(device: str) -> list[tuple[str, bool, str]]:
    """The Triton kernels against the references on `device` (CUDA, or CPU under TRITON_INTERPRET=1):
    (name, passed, detail) per check. Needs no pytest."""
    import kernels_triton
    from model import dense_attention_torch
    from sparq import SparQConfig, sparq_reference

    results = []

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            results.append((name, True, ""))
        except Exception as e:
            results.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))

    def cache(B, n_kv, g, d, S_max, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(B, n_kv, g, d, generator=gen).to(dtype)
        k = torch.randn(B, n_kv, S_max, d, generator=gen).to(dtype)
        v = torch.randn(B, n_kv, S_max, d, generator=gen).to(dtype)
        return q, k, v

    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

    def against_reference(B, n_kv, g, d, S, dtype, r, k_top, lives=None):
        def run():
            q, k, v = cache(B, n_kv, g, d, S, dtype, seed=S + g)
            config = SparQConfig(r=r, k=k_top, mean_v=True)
            lives_ = lives or [S] * B
            v_sum = torch.stack([v[b, :, :n].float().sum(1) for b, n in enumerate(lives_)])
            live = None if lives is None else torch.tensor(lives, device=device)
            qd, kd, vd = q.to(device), k.to(device), v.to(device)
            out = kernels_triton.sparq_attention_triton(qd, kd, kd.transpose(2, 3).contiguous(), vd,
                                                        v_sum.to(device), S, live, r, k_top, config.local, True).cpu()
            dense = kernels_triton.dense_attention_triton(qd, kd, vd, S, live).cpu()
            for b, n in enumerate(lives_):
                ref = sparq_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], v_sum[b:b + 1], n, config)
                # ties at the top-k boundary may pick different (equally valid) positions: compare
                # where the selection is unambiguous, i.e. at fp32 or with r = d
                if dtype == torch.float32 or r == d:
                    torch.testing.assert_close(out[b:b + 1], ref, atol=tol[dtype], rtol=tol[dtype])
                torch.testing.assert_close(dense[b:b + 1], dense_attention_torch(q[b:b + 1], k[b:b + 1], v[b:b + 1], n),
                                           atol=tol[dtype], rtol=tol[dtype])
        return run

    small = device != "cuda"
    check("sparq+dense vs reference, MHA fp32", against_reference(2, 2, 1, 64, 300 if small else 5000, torch.float32, 8, 32))
    check("sparq+dense vs reference, GQA g=4 bf16 r=d", against_reference(1, 2, 4, 64, 200 if small else 20000,
                                                                          torch.bfloat16, 64, 64))
    check("ragged (B,) live lengths", against_reference(3, 2, 4, 64, 300 if small else 9000, torch.float32, 16, 32,
                                                        lives=[7, 300, 120] if small else [7, 9000, 3000]))
    if device == "cuda":
        def graph_replay():
            B, n_kv, g, d, S_max = 2, 8, 4, 128, 8192
            q, k, v = (t.to(device) for t in cache(B, n_kv, g, d, S_max, torch.float32, seed=1))
            k_t, sums = k.transpose(2, 3).contiguous(), v.float().cumsum(2)
            live = torch.tensor(S_max, device=device)
            v_sum = sums[:, :, -1].clone()
            config = SparQConfig(r=16, k=64, mean_v=True)

            def call():
                return (kernels_triton.sparq_attention_triton(q, k, k_t, v, v_sum, S_max, live, 16, 64, config.local, True),
                        kernels_triton.dense_attention_triton(q, k, v, S_max, live))

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.cuda.graph(graph):
                    out, dense = call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for S in (1, 77, 4000, S_max):
                live.fill_(S)
                v_sum.copy_(sums[:, :, S - 1])
                graph.replay()
                ref = sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), S, config)
                torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(dense.cpu(), dense_attention_torch(q.cpu(), k.cpu(), v.cpu(), S),
                                           atol=1e-4, rtol=1e-4)

        check("one CUDA graph replayed at live lengths 1..8192 (no host sync in capture)", graph_replay)

    def compile_once():
        from torch._dynamo.testing import CompileCounter

        counter = CompileCounter()
        torch._dynamo.reset()
        q, k, v = (t.to(device) for t in cache(1, 2, 4, 64, 64, torch.float32, seed=2))
        k_t, v_sum = k.transpose(2, 3).contiguous(), v.float().sum(2)

        @torch.compile(backend=counter, fullgraph=True)
        def step(live):
            return (kernels_triton.sparq_attention_triton(q, k, k_t, v, v_sum, 64, live, 8, 16, 4, False)
                    + kernels_triton.dense_attention_triton(q, k, v, 64, live))

        live = torch.zeros((), dtype=torch.long, device=device)
        for S in (5, 40, 64):
            live.fill_(S)
            step(live)
        assert counter.frame_count == 1, f"compiled {counter.frame_count} times"

    check("torch.compile(fullgraph) traces the ops once for every live length", compile_once)
    return results


def run_pytest(timeout: int) -> tuple[Optional[bool], str]:
    """tests/test_kernels_triton.py under pytest on this machine: (passed, summary line); None if no pytest."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return None, "pytest is not installed here: only the built-in checks ran"
    # the kernels compile for real here: the sm_90 cross-compile and the no-triton import cases are CI's
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k",
                           "not compile_for_h100 and not imports_without_triton", "tests/test_kernels_triton.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr.strip().splitlines()[-1:]
    if proc.returncode != 0:
        summary = str(summary) + "\n" + proc.stdout[-3000:]
    return proc.returncode == 0, str(summary)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    sections: dict = field(default_factory=dict)
    goals: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, contexts and steps")
    p.add_argument("--steps", type=cli.positive_int, default=None, help="decode steps timed per end-to-end run "
                   "(default 32; --quick 16)")
    p.add_argument("--compile", choices=("inductor", "graphs", "eager"), default="inductor",
                   help="end to end: torch.compile with CUDA graphs (default, as generate.py --compile), "
                        "graphs = the eager step captured in CUDA graphs (no inductor: faster to build), "
                        "eager = plain calls")
    p.add_argument("--budget-s", type=float, default=570.0,
                   help="stop starting new work after this many seconds (default 570: the whole check in 10 min)")
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the smoke run (Triton interpreter, tiny shapes; TRITON_INTERPRET=1 must be set)")
    return p


def parse_sections(text: str) -> list[str]:
    return cli.name_list(text, "--sections", SECTIONS)


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    sections = parse_sections(args.sections)
    started = time.perf_counter()
    over_budget = lambda: time.perf_counter() - started > args.budget_s  # noqa: E731
    report = Report()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: every section skipped (run it on the GPU machine)")
        for s in sections:
            report.skipped[s] = "no CUDA device"
        write_json(args.json, report)
        return 0
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise cli.UserError("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")

    print(environment(device))
    bandwidth = None
    if device == "cuda":
        bandwidth = copy_bandwidth(device)
        print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (1 GiB copy, read + write)")
    report.sections["environment"] = dict(text=environment(device), copy_bandwidth=bandwidth)

    if "tests" in sections:
        print("\n== tests: the Triton kernels on this device ==", flush=True)
        results = builtin_checks(device)
        for name, ok, detail in results:
            print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))
        passed, summary = (None, "skipped on cpu (the suite runs there itself)") if device != "cuda" else \
            run_pytest(timeout=max(60, int(args.budget_s - (time.perf_counter() - started)) // 3))
        print(f"  pytest tests/test_kernels_triton.py: {summary}")
        report.sections["tests"] = dict(builtin=[dict(name=n, passed=ok, detail=d) for n, ok, d in results],
                                        pytest=dict(passed=passed, summary=summary))

    if "attention" in sections:
        print("\n== attention: one layer's decode attention op, bf16 ==", flush=True)
        shapes = (QUICK_ATTENTION if args.quick else ATTENTION_SHAPES) if device == "cuda" else [
            ("tiny MHA", 2, 2, 1, 64, 256, 8, 32), ("tiny GQA", 1, 1, 4, 64, 256, 8, 32)]
        rows = []
        for shape in shapes:
            if over_budget():
                report.skipped[f"attention {shape[0]}"] = "time budget"
                continue
            try:
                rows.append(attention_row(shape, device, bandwidth=bandwidth, replays=20 if device == "cuda" else 1))
            except Exception as e:
                rows.append(dict(name=shape[0], B=shape[1], S=shape[5], error=f"{type(e).__name__}: {str(e)[:160]}"))
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"  {rows[-1]['name']}: " + (f"dense {fmt(rows[-1].get('dense_us'))} us, SparQ {fmt(rows[-1].get('sparq_us'))} us"
                                               if "error" not in rows[-1] else rows[-1]["error"]), flush=True)
        print(attention_table(rows))
        report.sections["attention"] = rows
        report.goals += attention_goals(rows)

    e2e_all = []
    if "e2e" in sections or "quant" in sections:
        import kernels

        for knob, value in (("cache_size_limit", 64), ("accumulated_cache_size_limit", 1024)):
            if hasattr(torch._dynamo.config, knob):  # dense/SparQ x batch sizes x models: many graphs
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), value))
        kern = kernels.resolve_kernels("triton" if device == "cuda" else "torch", device, 256, announce=print)
        steps = args.steps or (16 if args.quick or device != "cuda" else 32)
        contexts = ((4096, 16384) if args.quick else E2E_CONTEXTS) if device == "cuda" else (64, 200)
        batches = E2E_BATCHES if device == "cuda" else (1, 2)
        quant_context = 16384 if device == "cuda" else 64
        # The goals' runs first (llama2-7b B=1), then quantized, then the rest, while time lasts.
        models = E2E_MODELS if device == "cuda" else ("tiny",)
        for name in models:
            jobs = [("e2e", B) for B in batches[:1]] + [("quant", mode) for mode in ("int8", "int4")] + \
                [("e2e", B) for B in batches[1:]]
            jobs = [j for j in jobs if j[0] in sections and (j[0] == "e2e" or name == models[0])]
            if not jobs:
                continue
            if over_budget():
                report.skipped[f"e2e {name}"] = "time budget"
                continue
            args_m = llama_args(name) if name != "tiny" else tiny_args()
            model = random_model(args_m, kern, device, torch.bfloat16 if device == "cuda" else torch.float32)
            print(f"\n== e2e: {name} shape, random weights, decode "
                  f"{'compiled with CUDA graphs' if args.compile == 'inductor' else args.compile} ==", flush=True)
            for kind, what in jobs:
                if over_budget():
                    report.skipped[f"{kind} {name} {what}"] = "time budget"
                    continue
                if kind == "e2e":
                    e2e_all += e2e_rows(model, name, "bf16" if device == "cuda" else "fp32", [what], contexts, steps,
                                        args.compile)
                    continue
                try:
                    qmodel = quantized_model(model, args_m, kern, what, device)
                    e2e_all += e2e_rows(qmodel, name, what, [1], [quant_context], steps, args.compile)
                    del qmodel
                except Exception as e:
                    e2e_all.append(dict(model=name, weights=what, B=1, context=quant_context, policy="-",
                                        error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                    traceback.print_exc()
                if device == "cuda":
                    torch.cuda.empty_cache()
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        if e2e_all:
            print(e2e_table(e2e_all))
        report.sections["e2e"] = e2e_all
        report.goals += e2e_goals(e2e_all)

    print("\n== goals (issue 14) ==")
    print(goals_text(report.goals) or "  (none measured)")
    for what, why in report.skipped.items():
        print(f"  skipped {what}: {why}")
    print(f"gpu_check: {time.perf_counter() - started:.0f} s")
    write_json(args.json, report)
    failed = [r for r in report.sections.get("tests", {}).get("builtin", []) if not r["passed"]]
    return 1 if failed or report.sections.get("tests", {}).get("pytest", {}).get("passed") is False else 0


def tiny_args():
    from model import ModelArgs

    return ModelArgs(vocab_size=256, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=128,
                     max_context=4096)


def environment(device: str) -> str:
    import kernels_triton

    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if kernels_triton.HAS_TRITON:
        parts.append(f"triton {kernels_triton.triton.__version__}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        parts.append(f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
    else:
        parts.append("cpu (Triton interpreter smoke)")
    return "gpu_check: " + ", ".join(parts)


def write_json(path: Optional[Path], report: Report) -> None:
    if path is None:
        return
    cli.write_json(path, dict(sections=report.sections, goals=[asdict(g) for g in report.goals],
                              skipped=report.skipped), default=str)


if __name__ == "__main__":
    sys.exit(main())
