"""The evaluation runner: every policy at every budget decodes from one shared prefill per batch.

Everything after the prompt goes through the model's decode path with the chosen policy, one token
per step, exactly as generate.py and bench run it, with the same kernels (--kernel). The dense
prefill is identical for every policy (H2O observes it), so each batch is prefilled once and every
policy decodes from it: the cache positions past the prompt are never read before they are
rewritten, so restoring the cache's snapshot (KVCache.snapshot) and a copy of each policy's
post-prefill state is an exact rewind (tests/test_eval.py checks it against generate.py's
Generator run from scratch).
"""
from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from evals.tasks import TASKS, Example, Outcome, Task
from attention import DecodePolicy
from cache import KVFormat
from decoding import decode_step, prefill
from sampling import sample
from model import Transformer
from baselines import selection_agreement
from budgets import Budget, model_compression, Storage, solve_budget
from policies import DENSE, AttentionSettings, fraction_label, policy_factory


def mean_stderr(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error; the error is None (null in the JSON) for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def paired_difference(values: list[float], base: list[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error of values - base, example by example (the same examples in the same
    order): far tighter than the two cells' own standard errors when the examples differ a lot."""
    return mean_stderr([v - b for v, b in zip(values, base)])


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
        self.observes_prefill = any(policy.observes_prefill for policy in policies)  # else the cache is not read

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

    def __init__(self, model: Transformer, base: AttentionSettings = AttentionSettings(),
                 kv_format: KVFormat = KVFormat()):
        self.model = model
        self.base = base  # sparq_k and mean-V for every budget
        self.kv_format = kv_format
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
        storage = Storage(self.kv_format, self.model.cache_dtype)  # budgets in the bytes this cache stores
        budgets += [solve_budget(m, t, seq_len, args, self.base, storage)
                    for m in methods if m != "dense" for t in targets if t != DENSE]
        out = []
        for budget in budgets:
            make = policy_factory(budget.settings, args, self.model.kernels)
            out.append(Config(budget, [make(i) for i in range(args.n_layer)]))
        return out

    def ensure_cache(self, batch: int, max_len: int) -> None:
        if self._cache_shape != (batch, max_len):
            self.model.setup_caches(batch, max_len, self.kv_format)
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
        self._snapshots = self.model.save_caches()

    def positions(self, step: int) -> tuple[Tensor, int]:
        """The positions of decode step `step` after the prefill: (1,) shared or (B, 1) per row, and the
        positions attention reads (the longest row's live length)."""
        if len(set(self.lengths)) > 1:
            return torch.tensor(self.lengths, device=self.device).view(-1, 1) + step, self.T + step + 1
        return torch.tensor([self.T + step], device=self.device), self.T + step + 1

    def rewind(self) -> None:
        """Restore the cache state just after the prefill."""
        self.model.restore_caches(self._snapshots)

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
        token = sample(self.first_logits)
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
            token = sample(logits)
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
        # per example, in the order of every key's values, for the needle map (--depths): the depth in percent
        self.depths: dict[Cell, list[float]] = defaultdict(list)
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
                "prompt_tokens": [[c.task, c.size, v] for c, v in self.prompt_tokens.items()],
                # only in a run with --depths: the records (journals) of other runs are as they were
                **({"depths": [[c.task, c.size, v] for c, v in self.depths.items()]} if self.depths else {})}

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
        for task, size, v in record.get("depths", []):
            self.depths[Cell(task, size)] += v

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
                # Every example ran under every policy (same order): pair them (bpc's examples differ a lot).
                delta, delta_se = paired_difference(values, dense)
                row["delta_vs_dense"], row["delta_stderr"] = delta, delta_se
            layers = self.per_layer.get((cell, metric, method, target))
            if layers:
                row["per_layer"] = [sum(col) / len(col) for col in zip(*layers)]
            out.append(row)
        return out

    def needle_map(self) -> list[dict]:
        """The needle map (a run with --depths): one row per (length, depth, method, target) with the
        fraction of its examples that found the needle (exact_match), their count n, the mean answer_nll,
        and missed_vs_dense: how many of them dense found and this one missed (the same examples: every
        policy decodes every example of a batch, in one order). Dense first, then the methods as run;
        empty without depths."""
        out = []
        for (cell, metric, method, target), values in self.values.items():
            depths = self.depths.get(cell)
            if cell.task != "needle" or metric != "exact_match" or not depths or len(depths) != len(values):
                continue
            dense = self.values.get((cell, metric, "dense", DENSE))
            nll = self.values.get((cell, "answer_nll", method, target))
            by_depth: dict[float, list[int]] = defaultdict(list)  # depth -> example indices
            for i, depth in enumerate(depths):
                by_depth[depth].append(i)
            for depth, at in by_depth.items():
                row = {"length": cell.size, "depth": depth, "attention": method, "compression": float(target),
                       "compression_label": fraction_label(target),
                       "exact_match": sum(values[i] for i in at) / len(at), "n": len(at)}
                if nll is not None and len(nll) == len(values):
                    row["answer_nll"] = sum(nll[i] for i in at) / len(at)
                if dense is not None and len(dense) == len(values):
                    row["missed_vs_dense"] = sum(1 for i in at if dense[i] > 0.5 > values[i])
                out.append(row)
        order = {m: i for i, m in enumerate(dict.fromkeys(["dense"] + [r["attention"] for r in out]))}
        return sorted(out, key=lambda r: (order[r["attention"]], -r["compression"], r["length"], r["depth"]))


def row_cell(row: dict) -> Cell:
    return Cell(row["task"], row["size"])


def evaluate_batch(cell: Cell, runner: Runner, tokenizer, examples: list[Example], configs: list[Config],
                   results: Results, advance: Callable[[], None]) -> None:
    """Every config on one batch: teacher-force the answers, generate greedily, score with the task.
    advance() after each config (the progress bar)."""
    task = TASKS[cell.task]
    results.prompt_tokens[cell] += [len(e.prompt) for e in examples]
    depths = [e.meta.get("depth_percent") for e in examples]
    if all(d is not None for d in depths):  # the needle map's (--depths)
        results.depths[cell] += depths
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
        self.k_top = k
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
            self.agreement[index] = selection_agreement(q, cache, length, r, self.k_top)
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
