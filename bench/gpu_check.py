"""The GPU check: one command per section that proves the CUDA path on a bare GPU machine and leaves a
report even when something breaks.

    python -m bench.gpu_check --sections tests --json results/gpu/tests.json      # one section per command:
    python -m bench.gpu_check --sections attention --json results/gpu/attention.json   # each ends within
    python -m bench.gpu_check --sections e2e --json results/gpu/e2e.json          # --budget-s (8 min)
    python -m bench.gpu_check --sections quant --json results/gpu/quant.json
    python -m bench.gpu_check --sections e2e --weights int4 --batches 1 --contexts 32768 --json int4.json
    python -m bench.gpu_check --sections e2e --models llama-3.1-8b --batches 16,8 --contexts 32768 --speculate-k 2
    python -m bench.gpu_check --sections e2e --fixed-linears --batches 1   # one rest-of-step for both graphs
    python -m bench.gpu_check --quick                  # fewer shapes and steps (a first look)

Needs only torch and triton (no network, no checkpoint, no gguf, no tqdm): models are the published
shapes of model.SHAPES with random weights (model.random_model) on the GPU. The JSON report is
rewritten after every row, so a kill at the machine's 10-minute limit loses the row in flight at
most; a section that fails is recorded with its error and the next one runs. Sections:

  tests      tests/test_kernels_triton.py under pytest (the kernels against their references on
             this GPU; skipped, with the reason, where pytest is missing)
  attention  one layer's decode attention: the paper's Table 4 shape and B = 1 at 8k / 32k / 128k in
             Llama-2-7B (32/32 heads) and Llama-3-8B (32/8) shapes; dense (the best of SDPA, our
             Triton flash-decoding kernel and FlexAttention) against SparQ (Triton). Each kernel is
             first compared with its reference on this shape (a wrong kernel's time is never
             reported); then time per call from CUDA graphs over rotating cache copies larger than
             L2, % of the transfer theory (bytes / measured read bandwidth), kernels per call, the
             plan's launch choices against their alternatives; then both on a quantized cache (int8
             K and V, an int4 K^T) at 32k, bytes as stored
  e2e        Llama-2-7B and Llama-3.1-8B shapes, decode with generate.py's Generator compiled as
             `generate.py --compile` compiles it (CUDA graphs per length bucket, every bucket warmed
             up before the timing): B = 1 and 8 at 4k, 16k, 32k (--batches, --contexts), dense
             against SparQ (r = 32, k = 128); --weights bf16,int8,int4 the weight modes (below);
             --speculate-k N adds self-speculation (SparQ drafts, dense verifies), --kv-dtype int8
             --kt-dtype int4 a quantized cache, --fixed-linears the fair rest-of-step (below)
  quant      the e2e rows with --weights int8,int4 by default, Llama-2-7B shape, B = 1, 16k

Weight modes (--weights, random weights quantized on the device by quantize.py, as a quantized file
loads): bf16; int8 per output channel as gpt-fast runs it on CUDA (Int8Linear "dequant": F.linear of
the int8 weight cast to bf16, times the scales, which inductor fuses into its GEMV under the
compile); int4 in groups of 32 through the tinygemm kernel gpt-fast uses (Int4Linear "int4pack":
aten._weight_int4pack_mm). The head stays int8 (groups of 64) in both, the embedding int8. Each row
says which kernel its linears took (linear_kernels: a failed self-check falls back to "dequant").

Every e2e row is profiled over a few steps after its timed ones (device us per step): the attention
kernels (kernels_triton's), the linears (kernels with a matmul in them: inductor's fused GEMV
reductions, cuBLAS / CUTLASS GEMMs, tinygemm) and the rest of the step (everything but attention,
the linears included). It reports the linears' read rate (their weight bytes over their device time
per step; the goal for int4 is >= 60% of the measured read rate) and the rest of the step; a SparQ
row also its rest over dense's (rest_vs_dense) and its speedup at dense's rest.

The rest of the step, one for both policies (--fixed-linears). Each compiled graph tunes its own
GEMV kernels (coordinate descent, noisy benchmarks), and the dense and SparQ graphs of one model
have run the same fused GEMV at 39 and 62 us a call: the end-to-end ratio then measures inductor's
draw as much as attention ("the lottery", issue 72). Sharing the compiled kernels across the two
graphs is not possible while each policy is one fullgraph CUDA-graph step (the attention sits in the
middle of every layer), so --fixed-linears takes the other way: no on-device tuning at all
(inductor's coordinate_descent_tuning off, and its deterministic mode, which picks every reduction's
config by a heuristic of its shape instead of benchmarking a few), so that two graphs holding the same
fused kernel run it with the same config. Fixed configs can be slower than tuned ones; the rows say
which they ran (linears: tuned / fixed), and rest_vs_dense shows how equal the two rests came out.

Batches of long contexts: each batch size's KV cache is checked against the device's free memory
before it is allocated (Llama-3.1-8B at 32k: B = 8 ~52 GB, B = 16 ~104 GB, plus 16 GB of weights: B = 16
needs an H200's 140 GB); a row that does not fit is recorded as skipped with the numbers, and every
row carries its cache's GiB.

Goals (issue 72), marked PASS / MISS in the report: Table 4 SparQ >= 70% of its transfer theory; B =
1, S >= 16k SparQ faster than the best dense; end to end, SparQ / dense tokens/s (E2E_GOALS):
Llama-2-7B B = 1 bf16 >= 1.35x at 16k and >= 1.6x at 32k with the rest of the step within 2%
between the two graphs, int4 >= 2.0x at 32k; Llama-3.1-8B B = 1 32k bf16 >= 1.15x, int4 >= 1.4x;
Llama-3.1-8B 32k B = 8 >= 2.0x, B = 16 >= 2.5x, self-speculation at B = 16 >= 1.3x; int4 linears
>= 60% of the read rate. Without a GPU every section is skipped with its reason; --device cpu runs a
tiny smoke of the harness with the Triton kernels in the interpreter (tests/test_gpu_check.py): the
tiny shape for every model, each context / 64 (at least 64), the batches, weights and flags as given.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

import cli
from cache import KT_DTYPES, KV_DTYPES, KVFormat
from bench.gpu_attention import (ATTENTION_SHAPES, CPU_ATTENTION, CPU_QUANT_ATTENTION, QUANT_ATTENTION, QUICK_ATTENTION,
                                 TABLE4, attention_row, quantized_attention_row, memory_bandwidth, short_kernel_name)

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("tests", "attention", "e2e", "quant")
E2E_MODELS = ("llama-2-7b", "llama-3.1-8b")
E2E_CONTEXTS = (4096, 16384, 32768)
QUANT_CONTEXTS = (16384,)  # one context: each weight format compiles its own graphs (~60 s each on an H200)
E2E_BATCHES = (1, 8)
WEIGHT_MODES = ("bf16", "int8", "int4")  # --weights: bf16 = the float model (fp32 in the CPU smoke)
QUANT_WEIGHTS = ("int8", "int4")
CACHE_HEADROOM = 4 * 2**30  # device memory left beside a batch's KV cache: activations, CUDA graph pools, logits


# ---------------------------------------------------------------------------------------------
# Goals
# ---------------------------------------------------------------------------------------------


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
                      t4 and t4.get("sparq_theory_pct"), None if t4 is None or "sparq_theory_pct" not in t4
                      else t4["sparq_theory_pct"] >= 70))
    for r in rows:
        if r["B"] == 1 and r["S"] >= 16384 and "sparq_us" in r and "dense_us" in r:
            speedup = r["dense_us"] / r["sparq_us"]
            goals.append(Goal(f"{r['name']}: SparQ vs best dense ({r['dense_best']})", "> 1.00x", speedup, speedup > 1))
    return goals


# Issue 72's end-to-end goals: (model, weights, B, context, row, SparQ's or self-speculation's tokens/s
# over dense's at least), on the activations' own cache (bf16).
E2E_GOALS = (
    ("llama-2-7b", "bf16", 1, 16384, "sparq", 1.35),
    ("llama-2-7b", "bf16", 1, 32768, "sparq", 1.6),
    ("llama-3.1-8b", "bf16", 1, 32768, "sparq", 1.15),
    ("llama-2-7b", "int4", 1, 32768, "sparq", 2.0),
    ("llama-3.1-8b", "int4", 1, 32768, "sparq", 1.4),
    ("llama-3.1-8b", "bf16", 8, 32768, "sparq", 2.0),
    ("llama-3.1-8b", "bf16", 16, 32768, "sparq", 2.5),
    ("llama-3.1-8b", "bf16", 16, 32768, "speculate", 1.3),
)
REST_GOAL_PCT = 2.0  # bf16 Llama-2-7B B = 1: SparQ's rest of the step within 2% of dense's
LINEAR_READ_GOAL_PCT = 60.0  # int4 linears: at least 60% of the measured read rate


def e2e_goals(rows: list[dict]) -> list[Goal]:
    """E2E_GOALS for every (model, weights, B) the rows measured (missing contexts: n/a), then the rest of
    the step's goal for bf16 Llama-2-7B at B = 1 and the int4 linears' read rate."""
    goals = []
    bf16_cache = [r for r in rows if r.get("kv", "bfloat16") == "bfloat16"]
    measured = {(r["model"], r.get("weights", "bf16"), r["B"]) for r in bf16_cache}

    def row(model, weights, B, context, policy) -> Optional[dict]:
        return next((r for r in bf16_cache if (r["model"], r.get("weights", "bf16"), r["B"], r["context"], r["policy"])
                     == (model, weights, B, context, policy) and "tokens_per_s" in r), None)

    for model, weights, B, context, policy, target in E2E_GOALS:
        if (model, weights, B) not in measured:
            continue
        dense, other = row(model, weights, B, context, "dense"), row(model, weights, B, context, policy)
        value = other["tokens_per_s"] / dense["tokens_per_s"] if dense and other else None
        what = "SparQ" if policy == "sparq" else "self-speculation (random model's acceptance)"
        goals.append(Goal(f"end to end {model} B={B} {weights} {context // 1024}k: {what} / dense tokens/s",
                          f">= {target}x", value, None if value is None else value >= target))
    for context in (16384, 32768):
        if ("llama-2-7b", "bf16", 1) in measured:
            sparq = row("llama-2-7b", "bf16", 1, context, "sparq")
            value = None if sparq is None or "rest_vs_dense" not in sparq else 100 * (sparq["rest_vs_dense"] - 1)
            goals.append(Goal(f"llama-2-7b B=1 bf16 {context // 1024}k: SparQ's rest of the step vs dense's, %"
                              + (" (fixed linears)" if sparq and sparq.get("linears") == "fixed" else ""),
                              f"within {REST_GOAL_PCT:.0f}%", value,
                              None if value is None else abs(value) <= REST_GOAL_PCT))
    for r in bf16_cache:
        if r.get("weights") == "int4" and r["policy"] == "dense" and "linear_read_pct" in r:
            goals.append(Goal(f"{r['model']} int4 B={r['B']} {r['context'] // 1024}k: the linears' read rate, % of "
                              f"the device's", f">= {LINEAR_READ_GOAL_PCT:.0f}%", r["linear_read_pct"],
                              r["linear_read_pct"] >= LINEAR_READ_GOAL_PCT))
    return goals


# ---------------------------------------------------------------------------------------------
# Report: written after every row
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    path: Optional[Path] = None
    environment: dict = field(default_factory=dict)
    sections: dict = field(default_factory=dict)  # name -> {"status", rows..., "error"}
    goals: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)

    def save(self) -> None:
        """The report so far, whole or not at all (cli.write_json): a kill loses only the row in flight."""
        if self.path is not None:
            cli.write_json(self.path, dict(environment=self.environment, sections=self.sections,
                                           goals=[asdict(g) for g in self.goals], skipped=self.skipped), default=str)

    def section(self, name: str) -> dict:
        self.sections[name] = {"status": "running", "rows": []}
        self.save()
        return self.sections[name]

    def add_row(self, name: str, row: dict) -> None:
        self.sections[name]["rows"].append({"device": self.environment.get("device"), **row})
        self.save()


def run_section(report: Report, name: str, body: Callable[[dict], Optional[str]]) -> None:
    """Run one section: its rows land in the report as they come; its failure is recorded (error and
    the traceback's last lines) and the check goes on. body returns a status other than "done"
    (e.g. "skipped: why") or None."""
    entry = report.section(name)
    try:
        entry["status"] = body(entry) or "done"
    except Exception as e:  # any failure of a section is a finding for the report, not the end of the check
        entry["status"] = "failed"
        entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        entry["traceback"] = traceback.format_exc().splitlines()[-12:]
        print(f"  section {name} failed: {entry['error']}", flush=True)
    report.save()


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


def kernel_table(rows: list[dict]) -> str:
    """One line per shape: SparQ's time per kernel (device us) and their sum, beside its graph time."""
    out = []
    for r in rows:
        if "sparq_kernel_us" not in r:
            continue
        parts = r["sparq_kernel_us"]
        out.append([r["name"], fmt(r.get("sparq_us")), fmt(sum(parts.values())),
                    "  ".join(f"{k}={fmt(v)}" for k, v in parts.items())])
    return table(["shape", "graph us", "kernels' sum us", "per kernel us"], out)


def quantized_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["name"], "error: " + r["error"]] + [""] * 5)
            continue
        out.append([r["name"], fmt(r["dense_us"]), fmt(r["sparq_us"]), fmt(r["dense_us"] / r["sparq_us"], ".2f") + "x",
                    fmt(r.get("dense_theory_pct"), ".0f") + "%", fmt(r.get("sparq_theory_pct"), ".0f") + "%",
                    f"{r['dense_bytes'] / r['bf16_dense_bytes']:.2f} / {r['sparq_bytes'] / r['bf16_dense_bytes']:.3f}"])
    return table(["shape", "dense us", "SparQ us", "speedup", "dense %th", "SparQ %th",
                  "bytes vs bf16 dense (dense / SparQ)"], out)


def variants_table(rows: list[dict]) -> str:
    """One line per shape: SparQ's graph time per call at each step-1 blocks-per-program tried and at
    each top-k bits-per-pass (the plan's choices marked *)."""
    out = []
    for r in rows:
        if "sparq_us_by_bpp" in r:
            out.append([r["name"]] + [fmt(us) + ("*" if int(bpp) == r.get("sparq_bpp") else "")
                                      for bpp, us in r["sparq_us_by_bpp"].items()]
                       + [fmt(us) + ("*" if int(bits) == r.get("sparq_select_bits") else "")
                          for bits, us in r["sparq_us_by_select_bits"].items()])
    first = next(r for r in rows if "sparq_us_by_bpp" in r)
    return table(["shape"] + [f"BPP={b}" for b in first["sparq_us_by_bpp"]]
                 + [f"select {b} bit/pass" for b in first["sparq_us_by_select_bits"]], out)


def e2e_table(rows: list[dict]) -> str:
    """One line per e2e row: its speed, its speedup over dense (and at dense's rest of the step), its rest
    of the step (device us: everything but attention) and that over dense's, the linears' read rate."""
    out = []
    for r in rows:
        policy = f"speculate n={r['n']}" if "n" in r else r["policy"]
        head = [r["model"], r.get("weights", "bf16"), r.get("linears", "tuned"), r.get("kv", "bfloat16"), r["B"],
                r["context"], policy]
        if "error" in r:
            out.append(head + ["error: " + r["error"]] + [""] * 8)
            continue
        read = (fmt(r["linear_read_gbs"], ".0f") + (f" ({r['linear_read_pct']:.0f}%)" if "linear_read_pct" in r else "")
                if "linear_read_gbs" in r else "-")
        out.append(head + [fmt(r["ms_per_step"], ".2f"), fmt(r["tokens_per_s"]), fmt(r["gb_per_s"], ".0f"),
                           fmt(r.get("speedup"), ".2f") + "x" if r.get("speedup") else "-",
                           fmt(r.get("speedup_at_dense_rest"), ".2f") + "x" if r.get("speedup_at_dense_rest") else "-",
                           fmt(r.get("step_rest_us"), ".0f"),
                           fmt(r.get("rest_vs_dense"), ".3f") if r.get("rest_vs_dense") else "-",
                           read, fmt(r.get("warm_up_s"), ".0f")])
    return table(["model", "weights", "linears", "cache", "B", "context", "attention", "ms/step", "tokens/s", "GB/s",
                  "vs dense", "at dense's rest", "rest us", "rest / dense's", "linears GB/s (% read)", "warm-up s"],
                 out)


def speculation_lines(rows: list[dict]) -> str:
    """Per self-speculation row: what the random model accepted, the measured draft step and verify
    pass, and the speedup over dense they predict at the acceptances real models reach."""
    out = []
    for r in rows:
        if "draft_step_ms" in r:
            predicted = ", ".join(f"{a}: {v:.2f}x" for a, v in r.get("predicted_speedup", {}).items())
            out.append(f"  {r['model']} {r.get('weights', 'bf16')} B={r['B']} ctx={r['context']} n={r['n']}: "
                       f"acceptance {r['acceptance']:.2f} (random weights), draft step {r['draft_step_ms']:.2f} ms, "
                       f"verify pass {r['verify_pass_ms']:.2f} ms; predicted vs dense at acceptance {predicted or '-'}")
    return "\n".join(out)


def goals_text(goals: list[Goal]) -> str:
    lines = []
    for g in goals:
        mark = "n/a " if g.passed is None else "PASS" if g.passed else "MISS"
        lines.append(f"  [{mark}] {g.name}: {fmt(g.value, '.2f')} (goal {g.target})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# End to end: generate.py's Generator on a random model of a published shape
# ---------------------------------------------------------------------------------------------


def quantized_model(model, kernels, mode: str, device: str, dtype=torch.bfloat16):
    """`model`'s weights through quantize.quantize_state_dict, loaded as model.load_model loads a
    quantized file (prepare, load_state_dict(assign), finalize) without the round trip through disk."""
    import quantize
    from model import Transformer

    args = model.args
    qstate = quantize.quantize_state_dict(dict(model.state_dict()), args, mode, None, "int8", source="random",
                                          progress=False)
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
    qmodel.activation_dtype = dtype
    quantize.finalize_model(qmodel, kernels)
    return qmodel.eval()


def fill_cache(model, B: int, context: int, seed: int = 0) -> None:
    """Every layer's cache holds `context` random positions (through KVCache.update, as a prefill writes them)."""
    args = model.args
    device, dtype = model.device, model.cache_dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    chunk = 4096
    for cache in model.caches:
        for start in range(0, context, chunk):
            end = min(start + chunk, context)
            shape = (B, args.n_kv_head, end - start, args.head_dim)
            cache.update(torch.arange(start, end, device=device),
                         torch.randn(shape, generator=gen, device=device, dtype=dtype),
                         torch.randn(shape, generator=gen, device=device, dtype=dtype))


def build_policies(model, r: int = 32, k: int = 128) -> dict[str, list]:
    """Per-layer policy instances for dense and SparQ (r, k; mean-V by the paper's rule), built once
    per model and swapped in, so that a compiled step sees the same modules again (no recompile)."""
    from policies import AttentionSettings, policy_factory

    policies = {}
    for name, settings in (("dense", AttentionSettings(policy="dense")),
                           ("sparq", AttentionSettings(policy="sparq", sparq_r=min(r, model.args.head_dim), sparq_k=k))):
        make = policy_factory(settings, model.args, model.kernels)
        policies[name] = [make(i) for i in range(model.args.n_layer)]
    return policies


def decode_row(generator, B: int, context: int, steps: int) -> dict:
    """Time `steps` decode steps (generate.py's Generator.decode) after `context` cached positions,
    every read length compiled and captured first (Generator.warm_up_decode, reported apart)."""
    model = generator.model
    lengths = [context] * B
    warm_up_s = generator.warm_up_decode(lengths, steps + 1)
    token = torch.zeros(B, dtype=torch.long, device=model.device)
    with model.preserved_caches():
        _, stats = generator.decode(token, lengths, steps + 1)
    kv, seconds = stats.kv_bytes_read / stats.steps, stats.decode_s
    ms = 1e3 * seconds / stats.steps
    row = dict(ms_per_step=ms, tokens_per_s=B * stats.steps / seconds, steps_per_s=stats.steps / seconds,
               gb_per_s=(model.weight_bytes() + kv) / (ms * 1e-3) / 1e9, kv_bytes_per_step=kv,
               weight_bytes=model.weight_bytes(), warm_up_s=warm_up_s)
    try:  # a diagnostic: its failure must not cost the row
        with model.preserved_caches():
            row.update(profile_decode(generator, token, lengths, min(steps, 8)))
        if row["step_linear_us"] > 0:
            row["linear_bytes"] = linear_weight_bytes(model)
            row["linear_read_gbs"] = row["linear_bytes"] / row["step_linear_us"] / 1e3
    except Exception as e:
        row["profile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
    return row


def profile_decode(generator, token, lengths: list[int], steps: int) -> dict:
    """Where a decode step's device time goes, and whether the host waits on the device inside it: the
    profiler over `steps` steps (after the timed ones; CUDA-graph replays show their kernels) ->
    device us per step of each kernel (the 12 costliest; kernel_us_sum counts all) and the host's
    synchronizations per step (the Generator looks at the tokens every check_every steps)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_attention import kernel_events, kernel_times
    from decoding import synchronize

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        _, stats = generator.decode(token, lengths, steps + 1)
        synchronize(token.device)
    events = list(prof.events())
    per_step = {name: us / stats.steps for name, us in kernel_times(events).items()}
    launches = Counter(short_kernel_name(e.name) for e in kernel_events(events))
    syncs = sum(1 for e in events if "synchronize" in e.name.lower() and e.name.lower().startswith("cuda"))
    top = sorted(per_step, key=lambda name: -per_step[name])[:12]
    attention = attention_kernel_names()
    linears = [e for e in kernel_events(events) if is_linear_kernel(e.name)]  # full names: tinygemm's is templated
    attention_us = sum(us for name, us in per_step.items() if name in attention)
    total_us = sum(per_step.values())
    return dict(step_kernel_us={name: per_step[name] for name in top},
                step_kernel_launches={name: launches[name] / stats.steps for name in top},
                step_kernel_us_sum=total_us, host_syncs_per_step=syncs / stats.steps,
                step_attention_us=attention_us, step_rest_us=total_us - attention_us,
                step_linear_us=sum(e.time_range.elapsed_us() for e in linears) / stats.steps,
                step_linear_launches=len(linears) / stats.steps)


LINEAR_KERNEL_WORDS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "tinygemm", "int4pack", "splitkreduce")


def is_linear_kernel(name: str) -> bool:
    """A kernel that does a linear layer's matmul: inductor's reductions (and templates) with a matmul
    among the ops they fuse (`triton_red_fused_..._mm_...`: at a few rows inductor writes the GEMV as a
    reduction, with the norm or the SiLU before it and the int8 dequantization in its loads), or a
    library's: cuBLAS (gemv / gemm / nvjet), CUTLASS, the tinygemm int4 kernel. Inductor's pointwise
    kernels named after a matmul only take its output (the qkv split, RoPE, the cache write): not counted."""
    lower = name.lower()
    if lower.startswith("triton_"):
        parts = lower.split("_")
        return len(parts) > 1 and parts[1] in ("red", "per", "tem") and bool({"mm", "addmm", "bmm"} & set(parts))
    return any(word in lower for word in LINEAR_KERNEL_WORDS)


def linear_weight_bytes(model) -> int:
    """Bytes of the weights the linear layers read in a decode step (the blocks' and the head's: float
    weights, or the packed quantized ones and their scales), biases included; the embedding is not one
    (a step reads B of its rows)."""
    from qlinear import Int4Linear, Int8Linear

    tensors = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Int8Linear, Int4Linear)):
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                if t is not None:
                    tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def linear_kernel_counts(model) -> dict[str, int]:
    """How many linear layers run each kernel: "F.linear" (float), or a quantized layer's kernel
    (Int8Linear / Int4Linear.kernel: "int4pack", "dequant", ...)."""
    from qlinear import Int4Linear, Int8Linear

    counts = Counter("F.linear" if isinstance(m, torch.nn.Linear) else m.kernel for m in model.modules()
                     if isinstance(m, (torch.nn.Linear, Int8Linear, Int4Linear)))
    return dict(counts)


def attention_kernel_names() -> set[str]:
    """The profiler's short names of our attention kernels (kernels_triton's `_*_kernel`s): the rest of
    a step is the weights' GEMVs and the pointwise kernels inductor writes, which differ between two
    compiled graphs of one model (an H200 ran one fused MLP kernel at 39 and at 62 us per call in the
    dense and the SparQ graph), so the report splits a step's device time in two."""
    import kernels_triton

    return {short_kernel_name(name) for name in vars(kernels_triton) if name.startswith("_") and name.endswith("_kernel")}


def kernel_lines(rows: list[dict]) -> str:
    """Per e2e row: the device time per step its kernels add up to, and the costliest kernels."""
    out = []
    for r in rows:
        if "step_kernel_us" in r:
            cache = f" {r['kv']}" if r.get("kv", "bfloat16") != "bfloat16" else ""
            out.append(f"  {r['model']} {r.get('weights', 'bf16')}{cache} B={r['B']} ctx={r['context']} {r['policy']}: "
                       f"kernels {r['step_kernel_us_sum']:.0f} us/step of {1e3 * r['ms_per_step']:.0f} "
                       f"(attention {r.get('step_attention_us', float('nan')):.0f}, "
                       f"the rest {r['step_kernel_us_sum'] - r.get('step_attention_us', float('nan')):.0f}), "
                       + (f"linears {r['step_linear_us']:.0f} us/step ({r['step_linear_launches']:.0f} launches"
                          + (f", {r['linear_read_gbs']:.0f} GB/s" if "linear_read_gbs" in r else "") + "), "
                          if "step_linear_us" in r else "")
                       + f"host syncs/step {r['host_syncs_per_step']:.2f}; "
                       + (f"at dense's rest {r['speedup_at_dense_rest']:.2f}x; " if "speedup_at_dense_rest" in r else "")
                       + ", ".join(f"{k}={v:.0f} (x{r['step_kernel_launches'][k]:.0f})"
                                   for k, v in r["step_kernel_us"].items()))
    return "\n".join(out)


def speculate_row(spec, B: int, context: int, steps: int) -> dict:
    """Self-speculation from the filled cache (speculation.Speculator, greedy): SparQ drafts n tokens a
    round and dense verifies them in one pass, as generate.py --speculate-k n --draft-attention sparq.
    spec: a speculation.Speculator built once per model (its compiled steps kept across rows). A
    first run compiles and captures both steps; the same run again (random weights and the same
    start: the same tokens, rounds and read lengths) is timed. A random model's acceptance says
    nothing of a real one's, so the row also carries the draft step and the verify pass that, with
    an acceptance measured on real models, predict the speedup (speculative_predictions)."""
    from speculation import speculation_summary

    model, n = spec.model, spec.n
    lengths = [context] * B
    token = torch.zeros(B, dtype=torch.long, device=model.device)

    def run():
        with model.preserved_caches():
            return spec.decode(token, lengths, steps + 1)[1]

    start = time.perf_counter()
    run()
    warm_up_s = time.perf_counter() - start
    stats = run()
    summary = speculation_summary(stats, n)
    seconds = stats.decode_s
    return dict(n=n, ms_per_step=1e3 * seconds / stats.steps, tokens_per_s=B * stats.steps / seconds,
                steps_per_s=stats.steps / seconds,
                gb_per_s=(stats.weight_bytes_read + stats.kv_bytes_read) / seconds / 1e9,
                kv_bytes_per_step=stats.kv_bytes_read / stats.steps, weight_bytes=model.weight_bytes(),
                warm_up_s=warm_up_s, acceptance=summary["acceptance_rate"],
                tokens_per_round=summary["tokens_per_round"], draft_step_ms=1e3 * summary["draft_step_s"],
                verify_pass_ms=1e3 * summary["verify_pass_s"])


SPECULATION_ACCEPTANCES = (0.8, 0.9, 0.95, 1.0)  # measured on real models: 0.86-1.00 (README, on the CPU)


def speculative_predictions(row: dict, dense_ms: float) -> dict[str, float]:
    """Acceptance -> the speedup over dense's one-token step that this row's measured draft step and
    verify pass give (speculation.speculative_speedup, rescaled from verify passes to dense's step)."""
    from speculation import speculative_speedup

    draft, verify = row["draft_step_ms"], row["verify_pass_ms"]
    return {f"{a:.2f}": speculative_speedup(a, row["n"], draft, verify) * dense_ms / verify
            for a in SPECULATION_ACCEPTANCES}


def speedup_at_dense_rest(dense: dict, row: dict) -> dict:
    """The speedup this row's attention kernels give with dense's other kernels (the linears, norms and
    pointwise work): dense's kernel time per step over dense's rest + this row's attention. Each
    compiled graph tunes its own GEMV kernels, and two graphs of one model have differed by up to a
    tenth of a step (README, fourth and fifth contacts): this ratio sets that lottery aside. Beside it,
    the two rests themselves: dense_rest_us and rest_vs_dense (this row's rest over dense's: 1.0 when
    both graphs ran the same kernels for everything but attention)."""
    if "step_attention_us" not in dense or "step_attention_us" not in row or dense["step_kernel_us_sum"] <= 0:
        return {}  # no profile, or no device kernels (the CPU smoke)
    dense_rest = dense["step_kernel_us_sum"] - dense["step_attention_us"]
    out = {"speedup_at_dense_rest": dense["step_kernel_us_sum"] / (dense_rest + row["step_attention_us"]),
           "dense_rest_us": dense_rest}
    if dense_rest > 0 and "step_kernel_us_sum" in row:
        out["rest_vs_dense"] = (row["step_kernel_us_sum"] - row["step_attention_us"]) / dense_rest
    return out


def cache_label(kv_format, dtype: torch.dtype) -> str:
    """A cache format in a row: "bfloat16", or "int8, K^T int4" where K^T is stored otherwise."""
    kv, kt = kv_format.kv_storage(dtype), kv_format.kt_storage(dtype)
    return kv if kt in (None, kv) else f"{kv}, K^T {kt}"


def fix_linear_configs() -> dict:
    """--fixed-linears: no on-device tuning of the kernels inductor writes from here on (read when a graph
    compiles): coordinate descent off (compiled_decode_step turns it on, as gpt-fast does, each time a
    Generator is built: call this after), and inductor's deterministic mode where this torch has it
    (every reduction's config picked by a heuristic of its shape, none benchmarked), so that the same
    fused GEMV gets the same config in every graph. Returns what was set (for the report)."""
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = False
    done = {"coordinate_descent_tuning": False}
    if hasattr(inductor_config.triton, "autotune_pointwise"):  # pointwise kernels: the first heuristic config
        inductor_config.triton.autotune_pointwise = False
        done["autotune_pointwise"] = False
    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True
        done["deterministic"] = True
    return done


def leave_deterministic_mode(error: Exception) -> Optional[str]:
    """If `error` is inductor's deterministic mode refusing a benchmark it has not vetted (a torch whose
    compile of our step needs one), turn that mode off (coordinate descent stays off) and say so;
    None if the error is another one or the mode is already off."""
    import torch._inductor.config as inductor_config

    if "deterministic mode" not in str(error) or not getattr(inductor_config, "deterministic", False):
        return None
    inductor_config.deterministic = False
    return f"off after: {str(error).splitlines()[0][:160]}"


def device_free_bytes(device: torch.device) -> Optional[int]:
    """Device memory free for new allocations (CUDA; None elsewhere: the CPU smoke's tiny caches always fit)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def cache_fit(model, B: int, max_len: int, kv_format, free: Optional[int]) -> tuple[dict, Optional[str]]:
    """(the memory fields of a batch size's rows, the reason it cannot run or None): its KV cache's bytes
    (model.Transformer.cache_bytes: K, V, K^T and their scales at max_len positions) beside the device's
    free memory, CACHE_HEADROOM kept for activations and CUDA graph pools. A row needing more than an
    H100's 80 GB says so: those rows are the H200's."""
    need = type(model).cache_bytes(model.args, B, max_len, kv_format, model.cache_dtype)
    device_need = need + model.weight_bytes() + CACHE_HEADROOM
    fields = dict(cache_gib=need / 2**30, device_need_gb=device_need / 1e9)
    if device_need > 80e9:
        fields["memory_note"] = f"needs {device_need / 1e9:.0f} GB of device memory: an H200's 140 GB, not an H100's 80"
    if free is not None:
        fields["free_gib"] = free / 2**30
        if need + CACHE_HEADROOM > free:
            return fields, (f"skipped: the KV cache needs {need / 2**30:.1f} GiB (B = {B} x {max_len} positions) and "
                            f"{CACHE_HEADROOM / 2**30:.0f} GiB beside it, {free / 2**30:.1f} GiB are free"
                            + (f"; it {fields['memory_note']}" if "memory_note" in fields else ""))
    return fields, None


def e2e_rows(report: Report, section: str, model, name: str, weights: str, batches, contexts, steps: int,
             backend: Optional[str], over_budget: Callable[[], bool], kv_format=None,
             speculate_k: Optional[int] = None, fixed_linears: bool = False, extra: Optional[dict] = None) -> None:
    """Dense and SparQ (then self-speculation, with speculate_k) at every (B, context) on one model,
    each row into the report as it is measured; caches stored as kv_format says (default: the
    activations' dtype), sized for the largest context, each batch size's checked against the free
    memory first (cache_fit). backend: compiled_decode_step's (None: eager). fixed_linears:
    fix_linear_configs before anything compiles. extra: fields every row carries (the weights' kernels)."""
    from decoding import Generator
    from speculation import Speculator

    kv_format = kv_format or KVFormat()
    kv = cache_label(kv_format, model.cache_dtype)
    policies = build_policies(model)
    generator = Generator(model, compile_decode=backend is not None, compile_backend=backend or "inductor")
    spec = Speculator(model, speculate_k, verify_policies=policies["dense"], draft_policies=policies["sparq"],
                      compile=backend is not None, compile_backend=backend or "inductor") if speculate_k else None
    if fixed_linears:  # after the Generator and the Speculator: building them turns coordinate descent on
        report.environment["fixed_linears"] = fix_linear_configs()
    cuda = model.device.type == "cuda"
    bucket = 256 if cuda else 1
    rows_of = list(policies) + (["speculate"] if speculate_k else [])
    read_bandwidth = report.environment.get("read_bandwidth")
    common = dict(linears="fixed" if fixed_linears else "tuned", **(extra or {}))
    for B in batches:
        max_len = -(-(max(contexts) + steps + 8 + (speculate_k or 0)) // bucket) * bucket
        memory, refusal = cache_fit(model, B, max_len, kv_format, device_free_bytes(model.device))
        if refusal is None:
            try:
                model.setup_caches(B, max_len, kv_format, length_bucket=bucket)
            except torch.cuda.OutOfMemoryError:
                refusal = "out of memory (KV cache)"
        if refusal is not None:
            for c in contexts:
                for p in rows_of:
                    report.add_row(section, dict(model=name, weights=weights, kv=kv, B=B, context=c, policy=p,
                                                 **common, **memory, error=refusal))
            print(f"    {name} {weights} {kv} B={B}: {refusal}", flush=True)
            continue
        for context in contexts:
            done = {}
            fill_cache(model, B, context)
            for policy in rows_of:
                row = dict(model=name, weights=weights, kv=kv, B=B, context=context, policy=policy, **common, **memory)
                if over_budget():
                    report.skipped[f"{section} {name} {weights} {kv} B={B} ctx={context} {policy}"] = "time budget"
                    continue

                def measure() -> None:
                    if policy == "speculate":
                        row.update(speculate_row(spec, B, context, steps))
                        if "dense" in done:
                            row["predicted_speedup"] = speculative_predictions(row, done["dense"]["ms_per_step"])
                    else:
                        model.set_decode_attention(lambda i, p=policy: policies[p][i])
                        row.update(decode_row(generator, B, context, steps))
                    done[policy] = row

                try:
                    try:
                        measure()
                    except Exception as e:
                        left = leave_deterministic_mode(e) if fixed_linears else None
                        if left is None:
                            raise
                        report.environment["fixed_linears"]["deterministic"] = left
                        print(f"    --fixed-linears: inductor's deterministic mode {left}; measuring again", flush=True)
                        measure()
                except Exception as e:  # recorded; the other rows still run
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
                    traceback.print_exc()
                if read_bandwidth and "linear_read_gbs" in row:
                    row["linear_read_pct"] = 100 * row["linear_read_gbs"] * 1e9 / read_bandwidth
                if policy != "dense" and policy in done and "dense" in done:
                    row["speedup"] = row["tokens_per_s"] / done["dense"]["tokens_per_s"]
                    row.update(speedup_at_dense_rest(done["dense"], row))
                report.add_row(section, row)
                print(f"    {name} {weights} {kv} B={B} ctx={context} {policy}: "
                      + (f"{row['tokens_per_s']:.1f} tokens/s (warm-up {row['warm_up_s']:.0f} s)"
                         if "tokens_per_s" in row else row["error"]), flush=True)
        for cache in model.caches:  # free the caches before the next batch size
            cache.to("meta")
        if cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Section: tests
# ---------------------------------------------------------------------------------------------


def run_pytest(timeout: int) -> tuple[Optional[bool], str]:
    """tests/test_kernels_triton.py under pytest on this machine: (passed, summary); None if no pytest.
    A run past `timeout` is killed and reported as such."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return None, "pytest is not installed here: the kernel tests did not run"
    # the kernels compile for real here: the sm_90 cross-compile and the no-triton import cases are CI's
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
               "not compile_for_h100 and not imports_without_triton", "tests/test_kernels_triton.py"]
    try:  # Triton compiles each kernel variant on first use: on a cold cache that is most of the time
        import xdist  # noqa: F401

        command += ["-n", str(min(8, os.cpu_count() or 1))]
    except ImportError:
        pass
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, f"timed out after {timeout} s; output so far:\n{out[-2000:]}"
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else "\n".join(proc.stderr.strip().splitlines()[-3:])
    if proc.returncode != 0:
        summary = summary + "\n" + proc.stdout[-3000:]
    return proc.returncode == 0, summary


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list of {', '.join(SECTIONS)} (default: all; on a machine with a 10-minute limit "
                        f"per command, one section per command)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, contexts and steps")
    p.add_argument("--steps", type=cli.positive_int, default=None, help="decode steps timed per end-to-end run "
                   "(default 32; --quick 16)")
    p.add_argument("--compile", choices=("inductor", "cudagraphs", "eager"), default="inductor",
                   help="end to end: generate.py --compile's torch.compile (default: inductor with CUDA graphs), "
                        "cudagraphs = the eager ops captured in CUDA graphs (no inductor: faster to build), "
                        "eager = plain calls")
    p.add_argument("--models", default=None, help=f"e2e and quant: comma list of {', '.join(E2E_MODELS)} "
                   f"(default: e2e both, quant llama-2-7b)")
    p.add_argument("--contexts", default=None, help="e2e and quant: comma list of context lengths (e2e's default "
                   "4096,16384,32768, --quick 4096,16384; quant's 16384)")
    p.add_argument("--batches", default=None, help="e2e and quant: comma list of batch sizes (default 1,8; quant 1)")
    p.add_argument("--weights", default=None,
                   help=f"e2e and quant: comma list of weight modes, {', '.join(WEIGHT_MODES)} (default: e2e bf16, "
                        f"quant int8,int4): random weights quantized on the device, int4 through tinygemm "
                        f"(aten._weight_int4pack_mm), int8 dequantized inside inductor's GEMV")
    p.add_argument("--fixed-linears", action="store_true",
                   help="e2e and quant: no on-device tuning of inductor's kernels (coordinate descent off, "
                        "deterministic configs), so that the dense and SparQ graphs run the same configs for "
                        "everything but attention (the rows then say linears=fixed)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="e2e and quant: K and V as the cache stores them (generate.py's flag; default: the activations')")
    p.add_argument("--kt-dtype", choices=KT_DTYPES, default="same", help="e2e and quant: SparQ's copy of K^T as stored")
    p.add_argument("--speculate-k", type=cli.positive_int, default=None, metavar="N",
                   help="e2e and quant: a third row per shape, self-speculation (SparQ drafts N tokens a round, "
                        "dense verifies them in one pass; generate.py --speculate-k N --draft-attention sparq)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no new row after this many seconds (default 480: a section ends inside 10 minutes)")
    p.add_argument("--json", type=Path, help="write the report as JSON, rewritten after every row")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the smoke run (Triton interpreter, tiny shapes; TRITON_INTERPRET=1 must be set)")
    return p


def parse_sections(text: str) -> list[str]:
    return cli.name_list(text, "--sections", SECTIONS)


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    sections = parse_sections(args.sections)
    args.models = cli.name_list(args.models, "--models", E2E_MODELS) if args.models else None
    args.contexts = cli.int_list(args.contexts, "--contexts") if args.contexts else None
    args.batches = cli.int_list(args.batches, "--batches") if args.batches else None
    args.weights = cli.name_list(args.weights, "--weights", WEIGHT_MODES) if args.weights else None
    try:
        args.kv_format = KVFormat("twice", args.kv_dtype, args.kt_dtype)
        args.kv_format.kv_storage(activation_dtype(args.device))  # a float cache in another dtype: refused
    except ValueError as e:
        raise cli.UserError(str(e)) from None
    started = time.perf_counter()
    over_budget = lambda: time.perf_counter() - started > args.budget_s  # noqa: E731
    report = Report(args.json)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: every section skipped (run it on the GPU machine)")
        for s in sections:
            report.skipped[s] = "no CUDA device"
        report.save()
        return 0
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise cli.UserError("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")

    report.environment = environment(device)
    print("gpu_check: " + report.environment["text"])
    if device == "cuda":
        rates = memory_bandwidth(device)
        report.environment["copy_bandwidth"], report.environment["read_bandwidth"] = rates["copy"], rates["read"]
        print(f"device memory: read {rates['read'] / 1e12:.2f} TB/s (a 4 GiB sum: the transfer theory's rate), "
              f"copy {rates['copy'] / 1e12:.2f} TB/s (4 GiB, read + write)")
    report.save()

    if "tests" in sections:
        print("\n== tests: the Triton kernels on this device ==", flush=True)

        def tests(entry: dict) -> Optional[str]:
            if device != "cuda":
                return "skipped: on the CPU the suite runs the kernel tests itself"
            passed, summary = run_pytest(timeout=max(60, int(args.budget_s - (time.perf_counter() - started))))
            entry["pytest"] = dict(passed=passed, summary=summary)
            print(f"  pytest tests/test_kernels_triton.py: {summary}")
            return {None: "skipped: no pytest", True: "passed", False: "failed"}[passed]

        run_section(report, "tests", tests)

    if "attention" in sections:
        print("\n== attention: one layer's decode attention op, bf16 ==", flush=True)
        shapes = (QUICK_ATTENTION if args.quick else ATTENTION_SHAPES) if device == "cuda" else CPU_ATTENTION

        def measured(shapes, measure: Callable) -> Iterator[dict]:
            """Each shape's row, measure(shape, device, bandwidth=, replays=): past the time budget
            skipped, a failure recorded as its row (the other shapes still run)."""
            for shape in shapes:
                if over_budget():
                    report.skipped[f"attention {shape[0]}"] = "time budget"
                    continue
                try:
                    row = measure(shape, device, bandwidth=report.environment.get("read_bandwidth"),
                                  replays=20 if device == "cuda" else 1)
                except Exception as e:
                    row = dict(name=shape[0], B=shape[1], S=shape[5], error=f"{type(e).__name__}: {str(e)[:160]}")
                if device == "cuda":
                    torch.cuda.empty_cache()
                yield row

        def attention(entry: dict) -> None:
            for row in measured(shapes, attention_row):
                report.add_row("attention", row)
                print(f"  {row['name']}: " + (row["error"] if "error" in row else
                                              f"dense {fmt(row.get('dense_us'))} us, SparQ {fmt(row.get('sparq_us'))} us")
                      + (f" (kernels off their reference: {row['reference_errors']})" if row.get("reference_errors")
                         else ""), flush=True)
            print(attention_table(entry["rows"]))
            if any("sparq_kernel_us" in r for r in entry["rows"]):
                print("\nSparQ's kernels, device us per call (profiled launches, not graph-replayed; the gap to "
                      "the graph's time is launch gaps and tails):")
                print(kernel_table(entry["rows"]))
            if any("sparq_us_by_bpp" in r for r in entry["rows"]):
                print("\nSparQ us per call by step 1's blocks per program and the top-k's bits per counting pass "
                      "(the plan's choices marked *):")
                print(variants_table(entry["rows"]))
            report.goals += attention_goals(entry["rows"])
            entry["quantized_rows"] = []
            for row in measured(QUANT_ATTENTION if device == "cuda" else CPU_QUANT_ATTENTION, quantized_attention_row):
                entry["quantized_rows"].append({"device": report.environment.get("device"), **row})
                report.save()
            if entry["quantized_rows"]:
                print("\nOn a quantized cache (bytes as stored; dense int8 checked against the torch path first):")
                print(quantized_table(entry["quantized_rows"]))
                if any("sparq_kernel_us" in r for r in entry["quantized_rows"]):
                    print("\nSparQ's kernels on the quantized cache, device us per call:")
                    print(kernel_table(entry["quantized_rows"]))

        run_section(report, "attention", attention)

    for section in ("e2e", "quant"):
        if section in sections:
            run_section(report, section, lambda entry, s=section: end_to_end(report, s, args, device, over_budget))
            report.goals += e2e_goals(report.sections[section]["rows"])

    print("\n== goals ==")
    print(goals_text(report.goals) or "  (none measured)")
    for what, why in report.skipped.items():
        print(f"  skipped {what}: {why}")
    print(f"gpu_check: {time.perf_counter() - started:.0f} s; sections: "
          + ", ".join(f"{name} {entry['status']}" for name, entry in report.sections.items()))
    report.save()
    failed = [name for name, entry in report.sections.items() if entry["status"] == "failed"]
    return 1 if failed else 0


def activation_dtype(device: str) -> torch.dtype:
    """The end-to-end models' activations: bf16 on the GPU, fp32 in the CPU smoke (the interpreter)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def e2e_plan(section: str, args: argparse.Namespace, cuda: bool) -> tuple[tuple, tuple, tuple, tuple]:
    """(models, weight modes, batch sizes, contexts) of the e2e or quant section. e2e: both models, bf16,
    B = 1 and 8 at 4k, 16k, 32k; quant: Llama-2-7B, int8 and int4, B = 1 at 16k; the flags override
    each. The CPU smoke (not cuda) runs the tiny shape for every model, each context / 64 (at least 64;
    without --contexts 64 and 200, quant 64) and the batch sizes as given (default 1 and 2, quant 1)."""
    if section == "e2e":
        models, weights = args.models or E2E_MODELS, args.weights or ("bf16",)
        batches = args.batches or (E2E_BATCHES if cuda else (1, 2))
        contexts = args.contexts or ((4096, 16384) if args.quick else E2E_CONTEXTS)
        cpu_contexts = (64, 200)
    else:
        models, weights = args.models or E2E_MODELS[:1], args.weights or QUANT_WEIGHTS
        batches, contexts, cpu_contexts = args.batches or (1,), args.contexts or QUANT_CONTEXTS, (64,)
    if not cuda:
        models = ("tiny",)
        contexts = tuple(dict.fromkeys(max(64, c // 64) for c in args.contexts)) if args.contexts else cpu_contexts
    return tuple(models), tuple(weights), tuple(batches), tuple(contexts)


def end_to_end(report: Report, section: str, args: argparse.Namespace, device: str,
               over_budget: Callable[[], bool]) -> None:
    """The e2e or the quant section (e2e_plan): per model, its random bf16 weights, then each weight mode
    (int8 / int4: quantized from them on the device, quantized_model) through e2e_rows."""
    import kernels
    from model import ModelArgs, random_model

    for knob, value in (("cache_size_limit", 64), ("accumulated_cache_size_limit", 1024)):
        if hasattr(torch._dynamo.config, knob):  # dense/SparQ x batch sizes x models: many graphs
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), value))
    kern = kernels.resolve_kernels("triton" if device == "cuda" else "torch", device, 256, announce=print)
    cuda = device == "cuda"
    steps = args.steps or (16 if args.quick or not cuda else 32)
    backend = None if args.compile == "eager" else args.compile
    dtype = activation_dtype(device)
    models, weights, batches, contexts = e2e_plan(section, args, cuda)
    for name in models:  # the goals' rows first: Llama-2-7B
        if over_budget():
            report.skipped[f"{section} {name}"] = "time budget"
            continue
        print(f"\n== {section}: {name} shape, random weights, {', '.join(weights)}, {args.compile}"
              + (", fixed linears" if args.fixed_linears else "") + " ==", flush=True)
        model = random_model(ModelArgs.from_shape(name), device, dtype, kern)
        for mode in weights:
            label = mode if mode != "bf16" or cuda else "fp32"  # the CPU smoke's float model is fp32
            if over_budget():
                report.skipped[f"{section} {name} {label}"] = "time budget"
                continue
            target, extra = model, {}
            if mode != "bf16":
                start = time.perf_counter()
                try:
                    target = quantized_model(model, kern, mode, device, dtype)
                except Exception as e:  # recorded; the other modes still run
                    report.add_row(section, dict(model=name, weights=mode, B=batches[0], context=contexts[0],
                                                 policy="-", error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                    traceback.print_exc()
                    continue
                extra = dict(quantize_s=time.perf_counter() - start, linear_kernels=linear_kernel_counts(target))
                print(f"  {mode}: quantized in {extra['quantize_s']:.1f} s; linears' kernels: "
                      + ", ".join(f"{k} x{n}" for k, n in extra["linear_kernels"].items())
                      + (" (the head is int8: dequant)" if mode == "int4" else ""), flush=True)
                if cuda and mode == "int4" and extra["linear_kernels"].get("int4pack", 0) == 0:
                    print("  int4: no layer took tinygemm (aten._weight_int4pack_mm failed its self-check: the "
                          "warning above): these rows measure the dequantize-then-matmul fallback", flush=True)
            e2e_rows(report, section, target, name, label, batches, contexts, steps, backend, over_budget,
                     args.kv_format, args.speculate_k, fixed_linears=args.fixed_linears, extra=extra)
            del target
            if cuda:
                torch.cuda.empty_cache()
        del model
        if cuda:
            torch.cuda.empty_cache()
    rows = report.sections[section]["rows"]
    if rows:
        print(e2e_table(rows))
        if any("step_kernel_us" in r for r in rows):
            print("\nDevice time per decode step (profiled after the timed steps; us):")
            print(kernel_lines(rows))
        if any("draft_step_ms" in r for r in rows):
            print("\nSelf-speculation (SparQ drafts, dense verifies; the acceptance is the random model's):")
            print(speculation_lines(rows))
        for B in sorted({r["B"] for r in rows if "memory_note" in r}):  # the rows an H100 could not run
            print(f"  B = {B}: " + next(r["memory_note"] for r in rows if r["B"] == B and "memory_note" in r))


def environment(device: str) -> dict:
    import kernels_triton

    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if kernels_triton.HAS_TRITON:
        import triton

        parts.append(f"triton {triton.__version__}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = props.name
        parts.append(f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
    else:
        name = "cpu (Triton interpreter smoke)"
        parts.append(name)
    return dict(text=", ".join(parts), device=name, date=time.strftime("%Y-%m-%d"))


if __name__ == "__main__":
    sys.exit(main())
