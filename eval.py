"""Task accuracy of sparse decode attention against KV-transfer compression (the paper's Table 2):
the harness. The tasks themselves (examples, scoring) live in tasks.py; the policies, their
transfer formulas and budgets in sparq.py's registry.

    python eval.py --task needle,repetition,bpc,retrieval --attention dense,sparq,h2o,local \\
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
per step, exactly as generate.py and bench.py run it, with the same kernels (--kernel). The dense
prefill is identical for every policy (H2O observes it), so each batch is prefilled once and every
policy decodes from it: the cache positions past the prompt are never read before they are
rewritten, so restoring the cache's snapshot (KVCache.snapshot) and a copy of each policy's
post-prefill state is an exact rewind (tests/test_eval.py checks it against generate.py's
Generator run from scratch).

Long runs (a SQuAD length sweep is hours on a 2-core CPU): with --json, every finished batch's raw
results go to a journal beside it (FILE.journal.jsonl); the same command with --resume replays those
batches and runs only the rest, and the tables come out as from one uninterrupted run.
`--report FILE.json` prints the tables (and --plot) of the results so far, while the run goes on.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

import cli
import data
from cli import UserError
from generate import (DTYPES, decode_step, kernels_for, load_checkpoint, load_tokenizer, model_args, prefill,
                      sample)
from kernels import KERNEL_CHOICES
from model import DecodePolicy, ModelArgs, Transformer
from sparq import (POLICIES, AttentionSettings, model_compression, policy_factory, selection_agreement,
                   settings_for_compression)
from tasks import TASKS, Example, Outcome, Task, TaskOptions

DEFAULT_LENGTH = 2048
# 2048 tokens everywhere: it keeps the default run near 20 minutes on a shared 2-core CPU (a 4k batch
# costs ~3x a 2k one), lets SparQ's k = 128 reach 1/8 (at S = 1024, k alone costs 1/8 of dense), and
# repetition needs it for >= 6000 characters of Shakespeare. Longer needles: --lengths 2k,4k,8k.
DENSE = Fraction(1)


def mean_stderr(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error; the error is None (null in the JSON) for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)



# =============================================================================================
# Budgets: the policy setting whose transfers are closest to a target compression
# =============================================================================================


def fraction_label(c: Fraction) -> str:
    return str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def parse_compression(text: str) -> Fraction:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise UserError(f"bad --compression value {text!r} (expected e.g. 1/4 or 0.25)") from None
    if not 0 < value <= 1:
        raise UserError(f"--compression values must be in (0, 1], got {text!r}")
    return value.limit_denominator(1 << 16)



@dataclass(frozen=True)
class Budget:
    """A method's settings for one target compression at sequence length seq_len."""

    method: str
    target: Fraction
    seq_len: int
    settings: AttentionSettings
    achieved: float = 1.0  # transfers / dense at seq_len

    @property
    def r(self) -> Optional[int]:
        return self.settings.sparq_r

    @property
    def k(self) -> Optional[int]:
        uses_budget = self.method != "dense" and "kv_budget" in POLICIES[self.method].flags
        return self.settings.budget if uses_budget else self.settings.sparq_k

    def describe(self) -> str:
        if self.method == "dense":
            return "dense"
        setting = f"r={self.r}, k={self.k}" if self.r is not None else f"k={self.k}"
        return f"{self.method} {setting} ({self.achieved:.3f} of dense at S={self.seq_len})"


def solve_budget(method: str, target: Fraction, seq_len: int, args: ModelArgs,
                 base: AttentionSettings = AttentionSettings()) -> Budget:
    """Budget for `method` whose transfers at seq_len are closest to target x dense (Appendix G)."""
    flags = POLICIES[method].flags  # the base's sparq_r (fixed-r SparQ) only where the policy reads it
    start = replace(base, policy=method, sparq_r=base.sparq_r if "sparq_r" in flags else None, kv_budget=None)
    settings, achieved = settings_for_compression(start, float(target), seq_len, args)
    if settings.policy == "dense":
        return Budget("dense", DENSE, seq_len, settings)
    return Budget(method, target, seq_len, settings, achieved)


# =============================================================================================
# Running policies on shared prefills
# =============================================================================================


class FanOut(DecodePolicy):
    """Installed for the shared dense prefill: every policy that decodes from it observes it. They share
    one memo, so budget-independent work (H2O's received attention) is done once."""

    name = "fanout"

    def __init__(self, policies: list[DecodePolicy]):
        super().__init__()
        self._policies = policies  # a plain list: not submodules

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None,
                        lengths: Optional[Tensor] = None, window: Optional[int] = None) -> None:
        memo = {} if memo is None else memo
        for policy in self._policies:
            policy.observe_prefill(q, k, memo, lengths, window)

    def forward(self, q, cache, length):  # pragma: no cover - prefill only
        raise RuntimeError("FanOut is installed only for the prefill")


@dataclass
class Config:
    budget: Budget
    layers: list[DecodePolicy]  # per layer, in their post-prefill state once prefilled

    @property
    def method(self) -> str:
        return self.budget.method


class Runner:
    """Prefill a batch once (dense), then decode it with each configuration in turn."""

    def __init__(self, model: Transformer, base: AttentionSettings = AttentionSettings(), kv_layout: str = "twice"):
        self.model = model
        self.base = base  # sparq_k and mean-V for every budget
        self.kv_layout = kv_layout
        self.device = model.device
        self._cache_shape: Optional[tuple[int, int]] = None
        self._snapshots: list[dict] = []
        self.lengths: list[int] = []  # prompt length of each row (rows may differ: ragged batches)
        self.first_logits: Optional[Tensor] = None

    @property
    def T(self) -> int:
        """The longest prompt of the batch."""
        return max(self.lengths)

    def configs(self, methods: list[str], targets: list[Fraction], seq_len: int) -> list[Config]:
        """Dense first, then every method at every target below 1."""
        args = self.model.args
        budgets = [solve_budget("dense", DENSE, seq_len, args)]
        budgets += [solve_budget(m, t, seq_len, args, self.base)
                    for m in methods if m != "dense" for t in targets if t != DENSE]
        out = []
        for budget in budgets:
            make = policy_factory(budget.settings, args, self.model.kernels)
            out.append(Config(budget, [make(i) for i in range(args.n_layer)]))
        return out

    def ensure_cache(self, batch: int, max_len: int) -> None:
        if self._cache_shape != (batch, max_len):
            self.model.setup_caches(batch, max_len, kv_layout=self.kv_layout)
            self._cache_shape = (batch, max_len)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], configs: list[Config], extra_len: int) -> None:
        """Dense prefill of the prompts (rows of different lengths are right-padded and made ragged,
        as generate.py does); every config's policies observe it."""
        self.lengths = [len(p) for p in prompts]
        ragged = len(set(self.lengths)) > 1
        self.ensure_cache(len(prompts), self.T + extra_len)
        self.model.reset_caches()
        self.model.set_decode_attention(lambda i: FanOut([c.layers[i] for c in configs]))
        idx = torch.tensor([p + [0] * (self.T - len(p)) for p in prompts], device=self.device)
        lengths = torch.tensor(self.lengths, device=self.device)
        self.first_logits = prefill(self.model, idx, lengths=lengths if ragged else None)
        if ragged:
            self.model.set_live_lengths(lengths)
        self._snapshots = [cache.snapshot() for cache in self.model.caches]

    def positions(self, step: int) -> tuple[Tensor, int]:
        """The positions of decode step `step` after the prefill: (1,) shared or (B, 1) per row, and the
        positions attention reads (the longest row's live length)."""
        if len(set(self.lengths)) > 1:
            return torch.tensor(self.lengths, device=self.device).view(-1, 1) + step, self.T + step + 1
        return torch.tensor([self.T + step], device=self.device), self.T + step + 1

    def rewind(self) -> None:
        """Restore the cache state just after the prefill."""
        for cache, snapshot in zip(self.model.caches, self._snapshots):
            cache.restore(snapshot)

    def install(self, config: Config) -> list[DecodePolicy]:
        """Rewind to just after the prefill and decode with a fresh copy of config's post-prefill policies."""
        self.rewind()
        policies = [copy.deepcopy(p) for p in config.layers]
        self.model.set_decode_attention(lambda i: policies[i])
        return policies

    def achieved(self, config: Config, steps: int) -> float:
        """Transfers / dense over every layer, averaged over the rows and their decode steps at live
        lengths T_b + 1 .. T_b + steps."""
        ratios = [model_compression(self.model, T + 1 + j, config.layers)
                  for T in self.lengths for j in range(max(steps, 1))]
        return sum(ratios) / len(ratios)

    @torch.no_grad()
    def teacher_force(self, config: Config, targets: list[list[int]]) -> tuple[list[list[float]], list[list[int]], int]:
        """Log-probs (nats) of each row's target tokens, fed one per decode step, and the argmax at each.

        Rows of different lengths are padded by repeating their last token; padded steps are dropped.
        Returns (logprobs per row, argmax per row, decode steps run).
        """
        self.install(config)
        B = len(targets)
        n = max(len(t) for t in targets)
        padded = torch.tensor([t + [t[-1]] * (n - len(t)) for t in targets], device=self.device)
        logits = self.first_logits
        logprobs, argmax = [], []
        for j in range(n):
            logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, padded[:, j:j + 1]).squeeze(1))
            argmax.append(logits.argmax(dim=-1))
            if j == n - 1:
                break
            logits = decode_step(self.model, padded[:, j:j + 1], *self.positions(j))
        lp = torch.stack(logprobs, dim=1).tolist()
        am = torch.stack(argmax, dim=1).tolist()
        return [lp[b][:len(targets[b])] for b in range(B)], [am[b][:len(targets[b])] for b in range(B)], n - 1

    @torch.no_grad()
    def greedy(self, config: Config, max_new: int, stop_ids: set[int],
               finished: Callable[[int, list[int]], bool]) -> tuple[list[list[int]], int]:
        """Greedy decode from the shared prefill. finished(row, tokens) ends a row early (e.g. once it
        diverged); the batch stops when every row has stopped. Returns (tokens per row, decode steps)."""
        self.install(config)
        token = sample(self.first_logits, 0.0, None)
        B = token.shape[0]
        rows: list[list[int]] = [[t] for t in token.tolist()]
        done = [False] * B
        steps = 0
        for j in range(max_new):
            for b in range(B):
                if not done[b] and (rows[b][-1] in stop_ids or finished(b, rows[b]) or len(rows[b]) >= max_new):
                    done[b] = True
            if all(done):
                break
            logits = decode_step(self.model, token.view(B, 1), *self.positions(j))
            token = sample(logits, 0.0, None)
            steps += 1
            for b, t in enumerate(token.tolist()):
                if not done[b]:
                    rows[b].append(t)
        return [[t for t in row if t not in stop_ids] for row in rows], steps


# =============================================================================================
# Evaluating a batch
# =============================================================================================


class Cell(NamedTuple):
    """One task at one size (prompt tokens, or SQuAD's confusion contexts): results never pool sizes."""
    task: str
    size: int

    def label(self) -> str:
        return f"{self.task} {self.size} {TASKS[self.task].size}"


class Results:
    def __init__(self):
        self.values: dict[tuple, list[float]] = defaultdict(list)  # (cell, metric, method, target) -> per example
        self.achieved: dict[tuple, list[float]] = defaultdict(list)  # (cell, method, target) -> per batch
        self.per_layer: dict[tuple, list[list[float]]] = defaultdict(list)  # (cell, metric, method, target)
        self.prompt_tokens: dict[Cell, list[int]] = defaultdict(list)  # per example
        self.budgets: dict[tuple, Budget] = {}  # (task, method, target, size)

    def add(self, cell: Cell, config: Config, metric: str, values: list[float]) -> None:
        self.values[(cell, metric, config.method, config.budget.target)] += values

    def record(self) -> dict:
        """The raw values as JSON (one batch's, for the journal)."""
        label = fraction_label
        return {"values": [[c.task, c.size, metric, method, label(t), v] for (c, metric, method, t), v in self.values.items()],
                "achieved": [[c.task, c.size, method, label(t), v] for (c, method, t), v in self.achieved.items()],
                "per_layer": [[c.task, c.size, metric, method, label(t), v]
                              for (c, metric, method, t), v in self.per_layer.items()],
                "prompt_tokens": [[c.task, c.size, v] for c, v in self.prompt_tokens.items()]}

    def add_record(self, record: dict) -> None:
        """Append a record's values (record() of a batch run earlier) after those already held."""
        for task, size, metric, method, t, v in record["values"]:
            self.values[(Cell(task, size), metric, method, Fraction(t))] += v
        for task, size, method, t, v in record["achieved"]:
            self.achieved[(Cell(task, size), method, Fraction(t))] += v
        for task, size, metric, method, t, v in record["per_layer"]:
            self.per_layer[(Cell(task, size), metric, method, Fraction(t))] += v
        for task, size, v in record["prompt_tokens"]:
            self.prompt_tokens[Cell(task, size)] += v

    def rows(self) -> list[dict]:
        out = []
        for (cell, metric, method, target), values in self.values.items():
            score, stderr = mean_stderr(values)
            achieved = self.achieved.get((cell, method, target))
            prompts = self.prompt_tokens.get(cell)
            row = {"task": cell.task, "size": cell.size, "size_unit": TASKS[cell.task].size,
                   "prompt_tokens": sum(prompts) / len(prompts) if prompts else None, "metric": metric,
                   "higher_is_better": dict(TASKS[cell.task].metrics)[metric],
                   "attention": method, "compression": float(target), "compression_label": fraction_label(target),
                   "achieved_compression": sum(achieved) / len(achieved) if achieved else 1.0,
                   "score": score, "stderr": stderr, "n": len(values)}
            dense = self.values.get((cell, metric, "dense", DENSE))
            if method != "dense" and dense is not None and len(dense) == len(values):
                # Every example ran under every policy (same order): the paired difference is far
                # tighter than the per-cell standard errors when examples differ a lot (bpc).
                delta, delta_se = mean_stderr([v - d for v, d in zip(values, dense)])
                row["delta_vs_dense"], row["delta_stderr"] = delta, delta_se
            layers = self.per_layer.get((cell, metric, method, target))
            if layers:
                row["per_layer"] = [sum(col) / len(col) for col in zip(*layers)]
            out.append(row)
        return out


def row_cell(row: dict) -> Cell:
    return Cell(row["task"], row["size"])


def evaluate_batch(cell: Cell, runner: Runner, tokenizer, examples: list[Example], configs: list[Config],
                   results: Results, advance: Callable[[], None]) -> None:
    """Every config on one batch: teacher-force the answers, generate greedily, score with the task.
    advance() after each config (the progress bar)."""
    task = TASKS[cell.task]
    results.prompt_tokens[cell] += [len(e.prompt) for e in examples]
    if task.score is None:
        return diagnose_batch(cell, runner, examples, configs, results, advance)
    extra = max(max(len(e.answer), e.max_new) for e in examples) + 1
    runner.prefill([e.prompt for e in examples], configs, extra)
    # A config whose settings equal an earlier one's (FlexGen top-k at k = 1 for every target) would
    # decode exactly as that one did: it takes that one's scores and steps.
    decoded: dict[AttentionSettings, tuple[list[dict], int]] = {}
    for config in configs:
        if config.budget.settings not in decoded:
            decoded[config.budget.settings] = decode_and_score(task, runner, tokenizer, examples, config)
        scores, steps = decoded[config.budget.settings]
        for metric, _ in task.metrics:
            results.add(cell, config, metric, [s[metric] for s in scores])
        results.achieved[(cell, config.method, config.budget.target)].append(runner.achieved(config, steps))
        advance()


def decode_and_score(task: Task, runner: Runner, tokenizer, examples: list[Example],
                     config: Config) -> tuple[list[dict], int]:
    """One config from the batch's prefill: teacher-force the answers, generate greedily, and score.
    Returns (the task's metrics per example, decode steps run)."""
    steps = 0
    outcomes = [Outcome() for _ in examples]
    if examples[0].answer:
        logprobs, _, steps = runner.teacher_force(config, [e.answer for e in examples])
        for outcome, lp in zip(outcomes, logprobs):
            outcome.logprobs = lp
    if examples[0].max_new:
        def finished(b: int, tokens: list[int]) -> bool:
            return task.finished(examples[b], tokenizer.decode(tokens))

        tokens, greedy_steps = runner.greedy(config, max(e.max_new for e in examples), set(tokenizer.stop_ids),
                                             finished)
        steps = max(steps, greedy_steps)
        for outcome, row in zip(outcomes, tokens):
            outcome.text = tokenizer.decode(row)
    return [task.score(e, outcome) for e, outcome in zip(examples, outcomes)], steps


class Probe(DecodePolicy):
    """Diagnostics at one decode step: dense output, and each policy's output and SparQ's score
    approximation on the same q and cache. Returns the dense output (later layers see dense inputs)."""

    name = "probe"

    def __init__(self, dense: DecodePolicy, policies: list[tuple[int, DecodePolicy]], sparq: list[tuple[int, int]],
                 k: int):
        super().__init__()
        self.dense = dense  # the layer's dense policy (its soft-cap, its kernels)
        self._policies = policies  # (config index, policy)
        self._sparq = sparq  # (config index, r)
        self.k = k
        self.rel_l2: dict[int, Tensor] = {}  # config index -> (B,)
        self.agreement: dict[int, Tensor] = {}  # config index -> (B,)

    def forward(self, q: Tensor, cache, length: int) -> Tensor:
        y = self.dense(q, cache, length)
        B = q.shape[0]
        yf = y.float().reshape(B, -1)
        for index, policy in self._policies:
            diff = policy(q, cache, length).float().reshape(B, -1) - yf
            self.rel_l2[index] = diff.norm(dim=1) / yf.norm(dim=1)
        for index, r in self._sparq:
            self.agreement[index] = selection_agreement(q, cache, length, r, self.k)
        return y


def diagnose_batch(cell: Cell, runner: Runner, examples: list[Example], configs: list[Config],
                   results: Results, advance: Callable[[], None]) -> None:
    model = runner.model
    runner.prefill([e.prompt for e in examples], configs, len(examples[0].answer) + 1)
    # One probed decode step on the first continuation token, dense activations throughout.
    runner.rewind()
    probes = []
    for i in range(model.args.n_layer):
        policies = [(ci, copy.deepcopy(c.layers[i])) for ci, c in enumerate(configs)]
        sparq = [(ci, c.budget.r) for ci, c in enumerate(configs) if c.budget.r is not None]
        probes.append(Probe(configs[0].layers[i], policies, sparq, runner.base.sparq_k))  # configs[0] is dense
    model.set_decode_attention(lambda i: probes[i])
    with torch.no_grad():
        token = torch.tensor([[e.answer[0]] for e in examples], device=runner.device)
        decode_step(model, token, *runner.positions(0))
    # Top-1 agreement with dense over teacher-forced steps (the first prediction comes from the prefill).
    dense_argmax = None
    for ci, config in enumerate(configs):
        _, argmax, steps = runner.teacher_force(config, [e.answer for e in examples])
        if dense_argmax is None:
            dense_argmax = argmax  # configs[0] is dense
        results.add(cell, config, "top1_agreement",
                    [sum(a == b for a, b in zip(row[1:], ref[1:])) / max(len(row) - 1, 1)
                     for row, ref in zip(argmax, dense_argmax)])
        rel = torch.stack([p.rel_l2[ci] for p in probes], dim=1)  # (B, n_layer)
        results.add(cell, config, "attn_rel_l2", rel.mean(dim=1).tolist())
        results.per_layer[(cell, "attn_rel_l2", config.method, config.budget.target)] += rel.tolist()
        if config.method == "dense" or config.budget.r is not None:
            if config.method == "dense":
                agree = torch.ones(len(examples), model.args.n_layer)
            else:
                agree = torch.stack([p.agreement[ci] for p in probes], dim=1)
            results.add(cell, config, "topk_agreement", agree.mean(dim=1).tolist())
            results.per_layer[(cell, "topk_agreement", config.method, config.budget.target)] += agree.tolist()
        results.achieved[(cell, config.method, config.budget.target)].append(runner.achieved(config, steps))
        advance()


# =============================================================================================
# The journal: a run of hours continues where it stopped (--resume)
# =============================================================================================


def journal_path(json_path: Path) -> Path:
    return json_path.with_name(json_path.name + ".journal.jsonl")


class Journal:
    """Each finished batch's raw results (Results.record), one JSON line per batch after a header line
    naming the run, kept beside --json. With --resume the batches it holds are replayed and only the
    rest run; a line cut short by a kill is dropped, so at most the batch in flight is lost."""

    def __init__(self, path: Path, run: dict, resume: bool):
        self.path = path
        self.done: dict[int, dict] = {}  # batch number (1-based, in run order) -> its line
        lines = path.read_text().split("\n") if path.is_file() else []
        header = self._header(lines)
        if resume:
            self._read(run, lines, header)
        elif header == run and any(line.strip() for line in lines[1:]):
            raise UserError(f"{path} already holds batches of this run: add --resume to continue it, or delete "
                            f"it to start over")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(cli.json_text({"run": run}, indent=None) + "\n")

    @staticmethod
    def _header(lines: list[str]) -> Optional[dict]:
        try:
            return json.loads(lines[0])["run"]
        except (IndexError, ValueError, KeyError, TypeError):
            return None

    def _read(self, run: dict, lines: list[str], header: Optional[dict]) -> None:
        if not lines:
            raise UserError(f"--resume: no journal at {self.path} (a run with --json writes one there)")
        if header is None:
            raise UserError(f"--resume: {self.path} is not an eval.py journal")
        changed = [key for key in sorted(set(run) | set(header)) if run.get(key) != header.get(key)]
        if changed:
            raise UserError(f"--resume: {self.path} holds a different run ({', '.join(changed)} differ): "
                            f"rerun with its settings, or without --resume to start over")
        kept = [lines[0]]
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # the last line, cut short by a kill: that batch runs again
            self.done[entry["batch"]] = entry
            kept.append(line)
        self.path.write_text("\n".join(kept) + "\n")  # without the cut line

    def check(self, number: int, task: str, size: int, examples: int) -> Optional[dict]:
        """The journal's line for batch `number` if it holds it (checked to be the same batch)."""
        entry = self.done.get(number)
        if entry is not None and (entry["task"], entry["size"], entry["examples"]) != (task, size, examples):
            raise UserError(f"--resume: batch {number} of {self.path} is not this run's batch {number}")
        return entry

    def append(self, number: int, task: str, size: int, examples: int, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(cli.json_text({"batch": number, "task": task, "size": size, "examples": examples,
                                   "record": record}, indent=None) + "\n")


# =============================================================================================
# Reporting
# =============================================================================================


PERCENT_METRICS = ("exact_match", "f1")  # fractions in the rows, shown in percent


def format_cell(metric: str, score: float, stderr: Optional[float]) -> str:
    if stderr is None:
        stderr = math.nan
    if metric in PERCENT_METRICS:
        score, stderr = 100 * score, 100 * stderr
    if metric == "chars":
        text = f"{score:.1f}"
        err = f"{stderr:.1f}"
    elif metric in ("bpc", "answer_nll", "attn_rel_l2", "topk_agreement", "top1_agreement"):
        text, err = f"{score:.3f}", f"{stderr:.3f}"
    else:
        text, err = f"{score:.1f}", f"{stderr:.1f}"
    return text if math.isnan(stderr) else f"{text}±{err}"


def _index(rows: list[dict]) -> dict[tuple, dict]:
    """(cell, metric, method, target) -> row."""
    return {(row_cell(r), r["metric"], r["attention"], Fraction(r["compression"]).limit_denominator(1 << 16)): r
            for r in rows}


def _cell_heading(cell: Cell, rows: list[dict]) -> str:
    if TASKS[cell.task].size == "tokens":
        return cell.label()
    return f"{cell.label()}, {_mean_tokens(rows, cell):.0f} prompt tokens on average"


OFF_TARGET = 0.2  # a row whose achieved compression is further than this (relative) from its target


def off_target(row: dict) -> bool:
    """The policy could not get near the row's target compression (top-k below 1/2; SparQ at a fixed k
    on short sliding windows): its score is not a comparison at that compression."""
    return abs(row["achieved_compression"] / row["compression"] - 1) > OFF_TARGET


def budget_records(budgets: dict[tuple, Budget]) -> list[dict]:
    """Results.budgets as JSON (the --json's meta, read back by --report)."""
    return [{"task": task, "attention": method, "compression": fraction_label(target), "seq_len": size,
             "r": b.r, "k": b.k, "achieved": b.achieved} for (task, method, target, size), b in budgets.items()]


def no_selection(budgets: list[dict]) -> set[tuple]:
    """(task, size, method, compression label) whose budget (the last batch's of that size) leaves k = 1:
    the transfers went to reading (SparQ's step 1 with r fixed, top-k's all of K) and none are left to
    select with, so the cell scores attention to one position. On target, so ranked, but not a
    comparison of how well a method selects."""
    return {(b["task"], b["seq_len"], b["attention"], b["compression"]) for b in budgets
            if b["attention"] != "dense" and b["k"] is not None and b["k"] <= 1}


NO_SELECTION = "‡ = its budget leaves k = 1 (nothing left to select: see the budgets)"


def table(rows: list[dict], methods: list[str], targets: list[Fraction], empty: set[tuple] = frozenset()) -> str:
    """One block per task and size: rows = methods; columns = metric x compression, dense in the "1" column.
    empty (no_selection): the cells marked ‡."""
    index = _index(rows)
    shown = [m for m in methods if m != "dense"] or ["dense"]
    sparse_targets = [t for t in targets if t != DENSE]
    lines = []
    for cell in dict.fromkeys(map(row_cell, rows)):
        metrics = [(m, hib) for m, hib in TASKS[cell.task].metrics
                   if any(row_cell(r) == cell and r["metric"] == m for r in rows)]
        header = ["method"]
        columns = []
        for metric, hib in metrics:
            unit = " %" if metric in PERCENT_METRICS else ""
            arrow = "↑" if hib else "↓"
            for t in [DENSE] + sparse_targets:
                header.append(f"{metric}{unit}{arrow} {fraction_label(t)}")
                columns.append((metric, hib, t))
        body = []
        missed = starved = False
        for method in shown:
            cells = [method]
            for metric, hib, t in columns:
                r = index.get((cell, metric, "dense" if t == DENSE else method, t))
                text = format_cell(metric, r["score"], r["stderr"]) if r else "-"
                compressed = bool(r) and t != DENSE
                off = compressed and off_target(r)
                if off:
                    text += "†"
                    missed = True
                if compressed and (cell.task, cell.size, method, fraction_label(t)) in empty:
                    text += "‡"
                    starved = True
                if compressed and not off and len(shown) > 1:  # best among the methods that met the target
                    scores = [index[(cell, metric, m, t)]["score"] for m in shown
                              if (cell, metric, m, t) in index and not off_target(index[(cell, metric, m, t)])]
                    if r["score"] == (max(scores) if hib else min(scores)):
                        text += "*"
                cells.append(text)
            body.append(cells)
        n = {r["n"] for r in rows if row_cell(r) == cell}
        widths = [max(len(str(row[c])) for row in [header] + body) for c in range(len(header))]
        dagger = (f"; † = compression achieved more than {OFF_TARGET:.0%} from its target (the policy cannot "
                  f"reach it here: see the achieved table), not ranked") if missed else ""
        lines.append(f"\n{_cell_heading(cell, rows)} (n = {', '.join(map(str, sorted(n)))} per cell; "
                     f"± = standard error; * = best{dagger}{'; ' + NO_SELECTION if starved else ''})")
        for row in [header] + body:
            lines.append("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def sweeps(rows: list[dict]) -> dict[str, list[Cell]]:
    """The tasks run at more than one size (a length sweep, the paper's Figure 6): task -> its cells by size."""
    cells = sorted(set(map(row_cell, rows)), key=lambda c: c.size)
    by_task = {task: [c for c in cells if c.task == task] for task in dict.fromkeys(r["task"] for r in rows)}
    return {task: cs for task, cs in by_task.items() if len(cs) > 1}


def sweep_table(rows: list[dict], methods: list[str], targets: list[Fraction],
                empty: set[tuple] = frozenset()) -> str:
    """Score against size at each compression, one block per swept task and metric: rows = methods
    (dense first), columns = sizes with their mean prompt tokens; empty: as for table()."""
    index = _index(rows)
    lines = []
    for task, cells in sweeps(rows).items():
        unit = TASKS[task].size
        for metric, hib in TASKS[task].metrics:
            if not any(r["task"] == task and r["metric"] == metric for r in rows):
                continue
            header = ["compression", "method"] + [
                f"{c.size} {unit}" + ("" if unit == "tokens" else f" ({_mean_tokens(rows, c):.0f} tok)") for c in cells]
            body = []
            for t in targets:
                for method in ["dense"] if t == DENSE else [m for m in methods if m != "dense"]:
                    found = [index.get((c, metric, method, t)) for c in cells]
                    if any(found):
                        body.append([fraction_label(t), method] +
                                    [format_cell(metric, r["score"], r["stderr"]) + ("†" if off_target(r) else "")
                                     + ("‡" if (task, c.size, method, fraction_label(t)) in empty else "")
                                     if r else "-" for c, r in zip(cells, found)])
            widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
            pct = " (%)" if metric in PERCENT_METRICS else ""
            starved = any("‡" in x for row in body for x in row)
            lines.append(f"\n{task} {metric}{pct} against {unit} ({'higher' if hib else 'lower'} is better; "
                         f"† = off its target compression{'; ' + NO_SELECTION if starved else ''})")
            for row in [header] + body:
                lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _mean_tokens(rows: list[dict], cell: Cell) -> float:
    return next((r["prompt_tokens"] for r in rows if row_cell(r) == cell and r["prompt_tokens"]), float(cell.size))


def delta_table(rows: list[dict], methods: list[str], targets: list[Fraction]) -> str:
    """Paired differences from dense (same examples), per task and size, metric and compression."""
    sparse_targets = [t for t in targets if t != DENSE]
    shown = [m for m in methods if m != "dense"]
    if not sparse_targets or not shown:
        return ""
    index = _index(rows)
    header = ["task/metric", "method"] + [fraction_label(t) for t in sparse_targets]
    body = []
    for cell, metric in dict.fromkeys((row_cell(r), r["metric"]) for r in rows):
        for method in shown:
            cells = []
            for t in sparse_targets:
                r = index.get((cell, metric, method, t))
                if r is None or "delta_vs_dense" not in r:
                    cells.append("-")
                    continue
                scale = 100 if metric in PERCENT_METRICS else 1
                digits = 1 if metric in PERCENT_METRICS + ("chars",) else 3
                d, se = scale * r["delta_vs_dense"], r["delta_stderr"]
                cells.append(f"{d:+.{digits}f}" + ("" if se is None else f"±{scale * se:.{digits}f}"))
            body.append([f"{cell.label()}/{metric}", method] + cells)
    widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
    lines = ["\npaired difference from dense (same examples; exact_match and f1 in points)"]
    for row in [header] + body:
        lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def achieved_table(rows: list[dict], methods: list[str], targets: list[Fraction]) -> str:
    sparse_targets = [t for t in targets if t != DENSE]
    if not sparse_targets:
        return ""
    lines = ["\nachieved compression (KV transfers / dense, averaged over decode steps and tasks)"]
    width = max(len("method"), *(len(m) for m in methods))
    lines.append(f"{'method':<{width}}  " + "  ".join(f"{fraction_label(t):>7}" for t in sparse_targets))
    for method in methods:
        if method == "dense":
            continue
        cells = []
        for t in sparse_targets:
            vals = [r["achieved_compression"] for r in rows if r["attention"] == method
                    and abs(r["compression"] - float(t)) < 1e-12]
            cells.append(f"{sum(vals) / len(vals):7.3f}" if vals else "      -")
        lines.append(f"{method:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def budget_summary(budgets: dict[tuple, Budget]) -> str:
    """One line per (length, method): the setting chosen for each target and its compression."""
    lines = []
    by_key: dict[tuple[int, str], dict[Fraction, Budget]] = defaultdict(dict)
    for (_, method, target, seq_len), budget in budgets.items():
        if method != "dense":
            by_key[(seq_len, method)][target] = budget
    for (seq_len, method), chosen in sorted(by_key.items()):
        parts = []
        for target, b in sorted(chosen.items(), reverse=True):
            setting = f"r={b.r}" if POLICIES[method].knob == "sparq_r" else f"k={b.k}"
            parts.append(f"{fraction_label(target)}: {setting} ({b.achieved:.3f})")
        first = next(iter(chosen.values()))
        extra = {"sparq_r": f" (k={first.k}, local k/4)", "sparq_k": f" (r={first.r}, local k/4)"}.get(POLICIES[method].knob, "")
        lines.append(f"  S={seq_len} {method}{extra}: " + ", ".join(parts))
    return "budgets (setting: transfers / dense at the prompt length)\n" + "\n".join(lines) if lines else ""


def write_json(path: Path, rows: list[dict], meta: dict) -> None:
    cli.write_json(path, {"results": rows, "meta": meta})


def plot(rows: list[dict], path: Path, methods: list[str], model: str = "") -> None:
    """Score against compression per task and metric; for a task run at several sizes, score against
    prompt tokens at each compression instead (the paper's Figure 6); for a metric kept per layer
    (the diagnostics' top-k agreement and attention error), also its value at each layer (Figure 4e).
    Titled with the model and the examples per point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = sweeps(rows)
    panels = []
    for task, metric in dict.fromkeys((r["task"], r["metric"]) for r in rows):
        if task in swept:
            targets = sorted({r["compression"] for r in rows if r["task"] == task and r["compression"] < 1}, reverse=True)
            panels += [(task, metric, t) for t in targets]
        else:
            panels.append((task, metric, None))
            if any(r.get("per_layer") for r in rows if r["task"] == task and r["metric"] == metric):
                panels.append((task, metric, "layers"))
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (task, metric, target) in zip(axes.flat, panels):
        mine = [r for r in rows if r["task"] == task and r["metric"] == metric]
        if target is None:
            _plot_against_compression(ax, mine, methods)
        elif target == "layers":
            _plot_per_layer(ax, mine)
        else:
            _plot_against_length(ax, mine, methods, target)
        hib = dict(TASKS[task].metrics)[metric]
        at = ("" if target is None else " per layer" if target == "layers"
              else f" at {fraction_label(Fraction(target).limit_denominator(1 << 16))}")
        ax.set_title(f"{task}: {metric}{at} ({'higher' if hib else 'lower'} is better)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    n = sorted({r["n"] for r in rows})
    fig.suptitle(f"{model}{', ' if model else ''}n = {n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} per point", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_against_compression(ax, rows: list[dict], methods: list[str]) -> None:
    """rows: one task at one size, one metric."""
    dense = [r for r in rows if r["attention"] == "dense"]
    sparse = [m for m in methods if m != "dense"]
    for i, method in enumerate(sparse):
        pts = sorted(((r["achieved_compression"], r["score"], r["stderr"]) for r in rows if r["attention"] == method),
                     key=lambda p: p[:2])
        if dense:
            pts.append((1.0, dense[0]["score"], dense[0]["stderr"]))
        if not pts:
            continue
        x, y, e = zip(*pts)
        shift = 2 ** (0.06 * (i - (len(sparse) - 1) / 2))  # side by side, so error bars stay readable
        e = [v or 0 for v in e]  # no error bar for a single example
        ax.errorbar([v * shift for v in x], y, yerr=e, marker="o", capsize=3, label=method)
    if dense:
        ax.axhline(dense[0]["score"], color="gray", linestyle="--", linewidth=1, label="dense")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 1 / 2, 1 / 4, 1 / 8, 1 / 16], ["1", "1/2", "1/4", "1/8", "1/16"])
    ax.set_xlim(1 / 12, 1.3)
    ax.set_xlabel("compression (KV transfers / dense)")


def _plot_per_layer(ax, rows: list[dict]) -> None:
    """rows: one task at one size, one metric kept per layer; a line per method and compression."""
    for r in sorted((r for r in rows if r.get("per_layer") and r["attention"] != "dense"),
                    key=lambda r: (r["attention"], -r["compression"])):
        ax.plot(range(len(r["per_layer"])), r["per_layer"], marker=".", label=f"{r['attention']} {r['compression_label']}")
    ax.set_xlabel("layer")


def _plot_against_length(ax, rows: list[dict], methods: list[str], target: float) -> None:
    """rows: one task at several sizes, one metric; the methods at compression `target`, dense beside them."""
    shown = ["dense"] + [m for m in methods if m != "dense"]
    ticks = set()
    for i, method in enumerate(shown):
        want = 1.0 if method == "dense" else target
        pts = sorted(((r["prompt_tokens"] or r["size"], r["score"], r["stderr"]) for r in rows
                      if r["attention"] == method and abs(r["compression"] - want) < 1e-12), key=lambda p: p[:2])
        if not pts:
            continue
        x, y, e = zip(*pts)
        ticks.update(x)
        shift = 2 ** (0.03 * (i - (len(shown) - 1) / 2))
        e = [v or 0 for v in e]  # no error bar for a single example
        style = dict(color="gray", linestyle="--") if method == "dense" else {}
        ax.errorbar([v * shift for v in x], y, yerr=e, marker="o", capsize=3, label=method, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [f"{t / 1000:.1f}k" if t >= 1000 else f"{t:.0f}" for t in sorted(ticks)])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens (mean)")


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



def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="eval.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="needle,repetition,bpc,retrieval", help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--attention", default="dense,sparq,h2o,local",
                   help=f"comma list of {', '.join(POLICIES)} (dense is always run as the baseline)")
    p.add_argument("--compression", default="1/2,1/4,1/8", help="comma list of target compressions in (0, 1]")
    p.add_argument("--examples", type=int, default=8, help="examples per task and length")
    p.add_argument("--lengths", default=None,
                   help=f"prompt lengths in tokens for every task sized in tokens, e.g. 2k,4k (default {DEFAULT_LENGTH})")
    p.add_argument("--squad-contexts", default=None,
                   help="confusion paragraphs per SQuAD prompt, comma list (default 7; the paper's sweep: 7,15,31,63)")
    p.add_argument("--sparq-r", type=int, default=32,
                   help="r of the fixed-r SparQ variant (--attention sparq-fixed-r, budgeted by k)")
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="example generation seed")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--sparq-k", type=int, default=128, help="SparQ's k (its local window is k/4)")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="mean-value reallocation (auto: on for MHA, off for GQA)")
    p.add_argument("--kernel", choices=[k for k in KERNEL_CHOICES if k != "triton"], default="auto",
                   help="decode kernels, as in generate.py")
    p.add_argument("--kv-layout", choices=["twice", "once"], default="twice")
    p.add_argument("--bpc-tokens", type=int, default=64, help="continuation tokens scored by the bpc task")
    p.add_argument("--repetition-chars", type=int, default=256, help="continuation characters the repetition task checks")
    p.add_argument("--repetition-passage", type=int, default=256,
                   help="characters of the repeated passage (>= 128; the 135M model copies 256 far better than 128)")
    p.add_argument("--retrieval-keys", type=int, default=4, help="key-value pairs in each retrieval haystack")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine two OpenMP threads spin at every "
                        "barrier and decode ~10x slower; use 2 on an idle machine)")
    p.add_argument("--json", type=Path, help="write the results as JSON (after every batch), and a journal of the "
                                              "batches done beside it (FILE.journal.jsonl)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose journal is beside --json: its batches are replayed, the rest run")
    p.add_argument("--plot", type=Path, help="write a PNG of score vs compression per task (vs prompt length for a task at several sizes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="print the tables (and --plot) of an earlier run's --json, also of one still going; "
                        "nothing runs")
    return p


def run_identity(args: argparse.Namespace, tasks: list[str], methods: list[str], targets: list[Fraction],
                 lengths: dict[str, list[int]]) -> dict:
    """What decides a run's batches and results: a resumed run must match its journal in all of it."""
    run = {"checkpoint": str(args.checkpoint), "tasks": tasks, "attention": methods,
           "compression": [fraction_label(t) for t in targets], "lengths": lengths}
    for flag in ("examples", "batch_size", "seed", "dtype", "kernel", "kv_layout", "sparq_r", "sparq_k", "sparq_mean_v",
                 "bpc_tokens", "repetition_chars", "repetition_passage", "retrieval_keys"):
        run[flag] = getattr(args, flag)
    return json.loads(json.dumps(run))  # as the journal's header reads back


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def run_with_argv(args: argparse.Namespace) -> int:
        args.argv = argv
        return run(args)

    return cli.main(build_parser(), run_with_argv, argv)


def run(args: argparse.Namespace) -> int:
    if args.report:
        return report(args.report, args.plot)
    tasks = cli.name_list(args.task, "--task", list(TASKS))
    methods = cli.name_list(args.attention, "--attention", list(POLICIES))
    targets = list(dict.fromkeys([DENSE] + [parse_compression(c) for c in args.compression.split(",") if c.strip()]))
    contexts = cli.int_list(args.squad_contexts, "--squad-contexts") if args.squad_contexts else None
    lengths = {t: (parse_lengths(args.lengths) if args.lengths else list(TASKS[t].default_sizes))
               if TASKS[t].size == "tokens" else (contexts or list(TASKS[t].default_sizes)) for t in tasks}
    if args.repetition_passage < 128:
        raise UserError("--repetition-passage must be at least 128 characters")
    for flag in ("examples", "batch_size", "sparq_k", "bpc_tokens", "repetition_chars", "retrieval_keys"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.sparq_k < 4:
        raise UserError("--sparq-k must be at least 4")
    if args.threads < 1:
        raise UserError("--threads must be at least 1")
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

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
    options = TaskOptions(args.bpc_tokens, args.repetition_chars, args.repetition_passage, args.retrieval_keys)

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
    journal = Journal(journal_path(args.json), run_identity(args, tasks, methods, targets, lengths),
                      args.resume) if args.json else None
    from_journal = [journal.check(done, task, length, len(batch)) if journal else None  # before the model loads
                    for done, (task, length, batch) in enumerate(work, 1)]

    kernels = kernels_for(args.kernel, "cpu", model_config)
    model = load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels)
    runner = Runner(model, AttentionSettings(sparq_r=args.sparq_r, sparq_k=args.sparq_k, sparq_mean_v=args.sparq_mean_v),
                    args.kv_layout)
    results = Results()
    replayed = 0
    start = time.perf_counter()

    def meta() -> dict:
        return {"checkpoint": str(args.checkpoint), "tasks": tasks, "attention": methods,
                "compression": [fraction_label(t) for t in targets], "lengths": lengths,
                "examples": args.examples, "batch_size": args.batch_size, "seed": args.seed, "dtype": args.dtype,
                "kernels": kernels.name, "kv_layout": args.kv_layout, "sparq_k": args.sparq_k,
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
                                                       "batches_done": done, "batches": len(work)})
    elapsed = time.perf_counter() - start

    print(f"model {args.checkpoint}: {model.args.n_layer} layers, head dim {model.args.head_dim}, "
          f"{model.args.n_head} heads / {model.args.n_kv_head} KV heads, {args.dtype}, kernels {kernels.name}; "
          f"{args.examples} examples per task and length; {elapsed / 60:.1f} min"
          + (f" ({replayed} of {len(work)} batches from the journal)" if replayed else ""))
    print(budget_summary(results.budgets))
    print_results(results.rows(), methods, targets, args.plot, plot_title(args.checkpoint, args.dtype),
                  no_selection(budget_records(results.budgets)))
    return 0


def print_results(rows: list[dict], methods: list[str], targets: list[Fraction], plot_path: Optional[Path],
                  model: str, empty: set[tuple]) -> None:
    """The tables (and the plot) of a run's result rows: at its end, or from its --json by --report.
    model: how the plot's title names the run; empty: the cells with no selection (no_selection)."""
    print(table(rows, methods, targets, empty))
    if sweeps(rows):
        print(sweep_table(rows, methods, targets, empty))
    print(delta_table(rows, methods, targets))
    print(achieved_table(rows, methods, targets))
    if plot_path:
        plot(rows, plot_path, methods, model)


def report(path: Path, plot_path: Optional[Path]) -> int:
    """--report: the tables of a --json results file, also of a run still going (it is rewritten after
    every batch), without loading a model."""
    try:  # everything read from the file, so that a file of another shape is one line, not a traceback
        saved = json.loads(path.read_text())
        rows, meta = saved["results"], saved["meta"]
        methods, targets = meta["attention"], [parse_compression(c) for c in meta["compression"]]
        done = ("complete" if meta.get("complete", True) else
                f"in progress: {meta['batches_done']} of {meta['batches']} batches")
        heading = (f"{path}: model {meta['checkpoint']}, {meta['dtype']}, kernels {meta['kernels']}; "
                   f"{meta['examples']} examples per task and length; {done}; {meta['elapsed_s'] / 60:.1f} min")
        title = plot_title(Path(meta["checkpoint"]), meta["dtype"])
        empty = no_selection(meta["budgets"])
    except FileNotFoundError:
        raise UserError(f"--report {path}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--report {path}: not an eval.py --json results file ({type(e).__name__}: {e})") from None
    if not rows:
        raise UserError(f"--report {path}: no results yet (no batch has finished)")
    print(heading)
    print_results(rows, methods, targets, plot_path, title, empty)
    return 0


def plot_title(checkpoint: Path, dtype: str) -> str:
    """How a plot names its run (a run's end and --report alike)."""
    return f"{checkpoint.name} ({dtype})"


if __name__ == "__main__":
    sys.exit(main())
