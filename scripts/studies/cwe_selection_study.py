"""Why adaptive SparQ loses common-word extraction (ruler-cwe) where fixed SparQ does not: its selection's
variants, teacher-forced on dense's greedy answer (docs/accuracy.md, the 4k n = 32 table; docs/NOTES.md).

    python -m scripts.studies.cwe_selection_study --checkpoint checkpoints/Qwen2.5-Coder-0.5B-Instruct --examples 12
    python -m scripts.studies.cwe_selection_study --task squad --checkpoint checkpoints/SmolLM2-135M-Instruct \
        --dtype float32 --examples 60

Per ruler-cwe example (evals/tasks.py's, seed 0: the RULER runs' first examples): a dense prefill, dense's greedy
answer (the task's 60 new tokens), then for each variant every layer on sparq_adaptive_torch at adaptive's split
for an int4 K^T (sparq_adaptive.adaptive_split; r = 32, k = 189 at 4k and 1/8; step 1 reads the float K here),
teacher-forced on dense's answer: the share of steps whose argmax is dense's, the answers reproduced whole and
the mean KL(dense || variant) of the next token. Variants: the KV heads pooling their components and positions (the
policy's default until this study, now --adaptive-heads pooled) or each head its own (per_head, the default since),
ranking components by |q_i| times the keys' spread (the policy's) or by |q_i| alone; and fixed SparQ's split (r = 40,
k = 128) per head by |q|. At another --compression: the policy beside exact step-1 scores at its k, twice its k, and
the same bytes split with 1/4 or 1/8 of them to the positions (more components), and the split a bf16 scale per
position leaves (2 bytes, not fp32's 4: more positions; --kt-scale-dtype bfloat16 stores it so). --task squad: the same on SQuAD's
prompts (adaptive_split_study's, 1-shot with 7 confusion paragraphs, ~1.4k tokens; dense's answer to the end of its
line), where pooling was the design before per-head selection was measured against it. The split is the int4 K^T's
beside K and V in --dtype. One thread; ~3 min an example at 4k.

--formats KV/KT/SCALE[/BASIS],...: the policy itself (SparQAdaptiveDecode, the run's kernels) on a cache of each
format (bench's --cache-format spelling, e.g. auto/int4/float32,auto/int4/bfloat16), each prefilled on its own.

--ranking (any RULER-style --task, e.g. ruler-mq at --length 16384, where adaptive on the int3 K^T lost 10 points of
recall; docs/accuracy.md has the screen): step 1 at the int3 K^T's split on the K^T as stored, on the float keys,
ranked by |q| x spread or |q| alone, with exact scores at its k, and SparQ's k = 128 split on the int4 K^T. Dense's
answer ends as the harness's greedy rows do (a stop token, or the task's own end: mq's four numbers found).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
from assemble import DTYPES, kernels_for, load_checkpoint, load_tokenizer  # noqa: E402
from attention import DenseDecode  # noqa: E402
from cache import QMAX, KVFormat, quantize_symmetric  # noqa: E402
from decoding import PREFILL_CHUNK, prefill  # noqa: E402
from evals.tasks import TASKS, TaskOptions, squad_examples  # noqa: E402
from model import ModelArgs, checkpoint_paths  # noqa: E402
from policies import parse_compression  # noqa: E402
from scripts.studies.adaptive_split_study import (MAX_ANSWER, dense_answer, score_teacher_forced,  # noqa: E402
                                                  squad_answer_ended)
from sparq_adaptive import SparQAdaptiveDecode, StepCosts, adaptive_split, sparq_adaptive_torch  # noqa: E402

INT4_KT = StepCosts(kt=0.25, kt_scale=2.0)  # an int4 K^T beside bf16 K and V: the CPU's default split on a bf16 model
INT4_KT_NO_POSITION_SCALE = StepCosts(kt=0.25)  # an int4 K^T with a scale per dimension only (fixed by the prompt)
INT4_KT_BF16_SCALE = StepCosts(kt=0.25, kt_scale=1.0)  # the same with a bf16 scale per position (--kt-scale-dtype)
COMPRESSION = 0.125
EVERY_COMPONENT = -1  # a variant's r: all d (step 1's scores exact: the selection at k is dense's top k)
TWICE_K = -2  # a variant's k: twice the split's (over budget: do more positions help?)


class Variant(SparQAdaptiveDecode):
    """sparq-adaptive on the torch path at the int4 K^T's split (or a given r, k, or the split at another share of
    the budget for the positions), its selection varied."""

    def __init__(self, kernels, per_head: bool, spread: bool, r: Optional[int] = None, k: Optional[int] = None,
                 costs: StepCosts = INT4_KT, compression: float = COMPRESSION, share: Optional[float] = None,
                 k_cap: Optional[int] = None):
        super().__init__(compression, kernels=kernels)
        self.per_head, self.use_spread, self.r, self.k, self.costs = per_head, spread, r, k, costs
        self.share = share  # None: the policy's position_share
        self.split_k_cap = k_cap  # k at most this in the split (128: fixed SparQ's split of the same bytes)

    def forward(self, q, cache, length):
        if cache.visible_length(length) <= self.k_max:
            return super().forward(q, cache, length)
        B, d = q.shape[0], q.shape[-1]
        view = cache.view(length, B)
        r, k = adaptive_split(view.length, d, self.compression, self.split_k_cap, self.costs, self.share)
        r = d if self.r == EVERY_COMPONENT else self.r or r
        k = 2 * k if self.k == TWICE_K else self.k or k
        self.last_split = (r, k)
        spread = self.spread(view, B) if self.use_spread else torch.ones(B, q.shape[1], d)
        return sparq_adaptive_torch(q, view.k, view.v, view.v_sum, spread, view.length, view.live_length, r, k,
                                    max(1, k // 4), False, per_head=self.per_head)


class StoredVariant(Variant):
    """Step 1 on an int4 K^T as the cache would store it (one bf16 scale per position, quantize_symmetric),
    optionally in another basis: `centre` subtracts the prefill keys' mean per dimension before quantizing
    (a constant offset per head shifts every position's q . k alike, so step 1's softmax is unchanged by it,
    while the offset's absmax takes int4's range from the dimensions that rank); `rotate` stores the keys in
    the eigenbasis of the prefill keys' covariance per KV head (principal components; q rotated alike, so
    q . k is unchanged and step 2 stays exact), where the top r components of |q_i| x spread_i hold more of
    the scores' variance than r of the raw dimensions. The basis and mean come from the keys the prefill
    wrote, fixed for the rest of the answer. `quantize` False: the float keys in that basis. `whiten`: each
    dimension divided by its spread before quantizing (q multiplied by it: q . k unchanged), so a position's
    scale (its absmax) no longer sits on the widest dimensions while the narrow ones round to zero."""

    def __init__(self, kernels, centre: bool, rotate: bool, quantize: bool = True, whiten: bool = False,
                 position_scale: bool = True, first_write: Optional[int] = None, bits: int = 4,
                 range_sigmas: Optional[float] = None, spread: bool = True, **kw):
        costs = INT4_KT_BF16_SCALE if position_scale else StepCosts(kt=bits / 16)  # bits of a bf16 K element's 16
        super().__init__(kernels, per_head=True, spread=spread, costs=costs, **kw)
        self.centre, self.rotate, self.quantize, self.whiten = centre, rotate, quantize, whiten
        assert position_scale or bits >= 2
        self.qmax = QMAX["int4"] if position_scale else 2 ** (bits - 1) - 1  # int2: -1, 0, 1
        self.range_sigmas = range_sigmas  # no position scale: each dimension's range this many of its spreads
        # (clamped beyond) rather than its absmax, which an outlier sets; None: the absmax
        self.position_scale = position_scale  # False: a scale per dimension alone (the prefill's absmax), no
        # scale per position: its 2 bytes of the 16 a position gets at 1/16 go to the split
        self.first_write = first_write  # the statistics from the first this many positions alone (a cache fixing
        # them at a row's first write, the prefill's first chunk), not the whole prompt: RoPE moves the later keys
        self.basis = self.mean = self.sigma = self.absmax = None  # (B, n_kv, d, d), (B, n_kv, 1, d) x 3, at the
        # first sparse step

    def forward(self, q, cache, length):
        if cache.visible_length(length) <= self.k_max:
            return super().forward(q, cache, length)
        B, d = q.shape[0], q.shape[-1]
        view = cache.view(length, B)
        S = view.length
        keys = view.k[:B, :, :S].float()  # (B, n_kv, S, d)
        seen = slice(0, self.first_write)  # the positions the statistics come from
        if self.basis is None:
            first = keys[:, :, seen]
            self.mean = first.mean(2, keepdim=True) if self.centre or self.rotate else torch.zeros_like(keys[:, :, :1])
            centred = first - self.mean
            if self.rotate:
                covariance = centred.transpose(-1, -2) @ centred / first.shape[2]
                self.basis = torch.linalg.eigh(covariance).eigenvectors.flip(-1)
            else:
                self.basis = torch.eye(d).expand(B, keys.shape[1], d, d)
        U = self.basis
        q_b, k_b = q.float() @ U, keys @ U  # (B, n_kv, g, d), (B, n_kv, S, d): q . k unchanged
        step1 = (keys - self.mean) @ U  # what K^T would store
        if self.whiten and self.sigma is None:
            self.sigma = (step1[:, :, seen].var(2, unbiased=False, keepdim=True) + 1e-12).sqrt()  # (B, n_kv, 1, d)
        sigma = self.sigma if self.whiten else torch.ones(())
        if self.quantize and not self.position_scale:  # each dimension's prefill range is its integer range (clamped)
            if self.absmax is None:
                first = step1[:, :, seen]
                self.absmax = (first.abs().amax(2, keepdim=True) if self.range_sigmas is None else
                               self.range_sigmas * first.std(2, unbiased=False, keepdim=True)).clamp(min=1e-12)
                # (B, n_kv, 1, d)
            qn = torch.round(step1 / self.absmax * self.qmax).clamp(-self.qmax, self.qmax)
            step1 = qn * self.absmax / self.qmax
        elif self.quantize:  # quantized in the whitened coordinates, then scaled back (the same as q scaled up)
            q4, scale = quantize_symmetric(step1 / sigma, QMAX["int4"], torch.bfloat16)
            step1 = q4.float() * scale[..., None].float() * sigma
        spread = ((step1.var(2, unbiased=False) + 1e-12).sqrt() if self.use_spread else
                  torch.ones(B, q.shape[1], d))  # (B, n_kv, d)
        r, k = adaptive_split(S, d, self.compression, costs=self.costs)
        self.last_split = (r, k)
        y = sparq_adaptive_torch(q_b.to(q.dtype), k_b, view.v[:B, :, :S], view.v_sum, spread, S, view.live_length,
                                 r, k, max(1, k // 4), False, k_t=step1.transpose(-1, -2), per_head=True)
        return y  # a sum of V rows: V was never rotated


STORED_VARIANTS = {  # name: (centre, rotate, quantize, whiten[, position_scale]), each head its own, |q| x spread,
    # a bf16-scaled int4 K^T's split. Measured (6 cwe examples at 4k, 1/16, r = 11, k = 101; KL): as stored 0.581,
    # centred 0.612, principal basis 0.556, the float keys in that basis 0.441 (docs/NOTES.md)
    "int4 K^T as stored (bf16 scales)": (False, False, True, False),
    "int4 K^T, each dimension whitened": (True, False, True, True),
    "int4 K^T in the principal basis, whitened": (True, True, True, True),
    # no scale per position: the prefill's absmax per dimension alone, centred (its split, r = 15 at 4k and 1/16)
    "int4 K^T centred, a scale per dimension only": (True, False, True, False, False),
    # the same two with their statistics from the prefill's first chunk, as a cache fixing them at the first write
    "int4 K^T in the principal basis, whitened, by the first 2048": (True, True, True, True, True, PREFILL_CHUNK),
    "int4 K^T centred, a scale per dimension only, by the first 2048": (True, False, True, False, False, PREFILL_CHUNK),
}
FEWER_BITS_VARIANTS = {  # --fewer-bits: the K^T without position scales (the cache's --kt-scale-dtype none) at
    # fewer bits per element, which buy step 1 more components for the same bytes; name: (centre, rotate,
    # quantize, whiten, position_scale, first_write, bits, range_sigmas)
    "int4, each dimension's absmax (--kt-scale-dtype none)": (True, False, True, False, False, PREFILL_CHUNK, 4, None),
    "int4, each dimension's range 3 spreads, clamped": (True, False, True, False, False, PREFILL_CHUNK, 4, 3.0),
    "int3, each dimension's absmax": (True, False, True, False, False, PREFILL_CHUNK, 3, None),
    "int3, each dimension's range 2 spreads, clamped": (True, False, True, False, False, PREFILL_CHUNK, 3, 2.0),
    "int2 (-1, 0, 1), each dimension's absmax": (True, False, True, False, False, PREFILL_CHUNK, 2, None),
    "int2 (-1, 0, 1), each dimension's range 1 spread, clamped": (True, False, True, False, False, PREFILL_CHUNK, 2, 1.0),
}

INT3_KT = StepCosts(kt=3 / 16)  # --kt-dtype int3 (no position scales) beside bf16 K and V
RANKING_STORED = {  # --ranking, step 1 on the int3 K^T as the cache stores it: StoredVariant's keywords
    "int3 K^T, |q| x spread (the policy on --kt-dtype int3)": dict(),
    "int3 K^T, |q| alone": dict(spread=False),
    "int3 K^T, its ranges from the whole prompt": dict(first_write=None),
}
RANKING_VARIANTS = {  # --ranking, step 1 on the float keys: (per_head, spread, r, k, share, costs, k_cap)
    "float K at int3's split, |q| x spread": (True, True, None, None, None, INT3_KT, None),
    "float K at int3's split, |q| alone": (True, False, None, None, None, INT3_KT, None),
    "exact step 1 (r = d) at int3's k": (True, True, EVERY_COMPONENT, None, None, INT3_KT, None),
    # fixed SparQ's trade of the same bytes (k = 128, the rest to components) on the default int4 K^T, as the
    # 16k table's SparQ column (r = 20, k = 128 at 1/16; mq -4.7 there against adaptive's -12.5)
    "k = 128, the int4 K^T's r (SparQ's split), |q| alone": (True, False, None, None, None, INT4_KT, 128),
}


def ranking_policies(kernels, compression: float, name: str, n_layer: int) -> list:
    """--ranking's variant `name` for every layer (RANKING_STORED's or RANKING_VARIANTS')."""
    if name in RANKING_STORED:  # centred, each dimension's absmax from the first chunk, 3 bits, no position scale
        kw = {"first_write": PREFILL_CHUNK, **RANKING_STORED[name]}
        return [StoredVariant(kernels, centre=True, rotate=False, position_scale=False, bits=3,
                              compression=compression, **kw) for _ in range(n_layer)]
    per_head, spread, r, k, share, costs, k_cap = RANKING_VARIANTS[name]
    return [Variant(kernels, per_head, spread, r, k, costs, compression, share, k_cap) for _ in range(n_layer)]


VARIANTS = {  # name: (per_head, spread, r, k, share, costs); None: the split's (share: the policy's
    # position_share; costs: the int4 K^T's as stored, INT4_KT)
    "pooled, |q| x spread": (False, True, None, None, None, None),
    "per head, |q| x spread (the policy)": (True, True, None, None, None, None),
    "pooled, |q|": (False, False, None, None, None, None),
    "per head, |q|": (True, False, None, None, None, None),
    "SparQ r = 40, k = 128 (per head, |q|)": (True, False, 40, 128, None, None),  # SparQ's r at 4k and 1/8 (the RULER runs')
}
BUDGET_VARIANTS = {  # at any other target: what limits the policy there, step 1's ranking or the positions
    "pooled, |q| x spread": (False, True, None, None, None, None),
    "per head, |q| x spread (the policy)": (True, True, None, None, None, None),
    "per head, exact step 1 (r = d), the split's k": (True, True, EVERY_COMPONENT, None, None, None),
    "per head, the split's r, twice its k": (True, True, None, TWICE_K, None, None),
    "per head, 1/4 of the budget to positions": (True, True, None, None, 1 / 4, None),  # more components, same bytes
    "per head, 1/8 of the budget to positions": (True, True, None, None, 1 / 8, None),
    # the scale's 4 bytes per position are a quarter of 1/16's budget at d = 64: what a bf16 scale's 2 would buy
    "per head, the split of a bf16-scaled int4 K^T": (True, True, None, None, None, INT4_KT_BF16_SCALE),
}


def run_formats(args, model, kernels, tokenizer) -> None:
    """--formats: the policy on each format's cache, teacher-forced on dense's answer from that cache's own prefill."""
    from bench.common import cache_formats

    compression = float(args.compression)
    formats = cache_formats(args.formats)
    stats = {label: {"agree": 0, "steps": 0, "kl": 0.0, "whole": 0} for label, _ in formats}
    splits = {}
    start = time.time()
    with torch.no_grad():
        for ex, max_new, ended in tqdm(examples_and_answers(args.task, tokenizer, args.length, args.examples),
                                       desc="examples"):
            T = len(ex.prompt)
            for label, fmt in formats:
                model.setup_caches(1, T + max_new + 1, fmt)
                model.set_decode_attention(lambda i: DenseDecode(kernels))
                logits = prefill(model, torch.tensor([ex.prompt]))
                snapshots = model.save_caches()
                answer, dense_logprobs = dense_answer(model, logits, T, max_new, ended)
                model.restore_caches(snapshots)
                policies = [SparQAdaptiveDecode(compression, kernels=kernels) for _ in range(model.args.n_layer)]
                model.set_decode_attention(lambda i: policies[i])
                splits[label] = adaptive_split(T, model.args.head_dim, compression, None,
                                               StepCosts.of(fmt, model.cache_dtype, model.args.head_dim))
                score_teacher_forced(model, answer, dense_logprobs, T, stats[label])
    print(f"{args.checkpoint.name}, {args.dtype}, {args.examples} {args.task} examples, {args.compression}, "
          f"{time.time() - start:.0f} s")
    print(f"{'format':44} {'r, k':>10} {'argmax = dense':>15} {'whole answers':>14} {'KL':>8}")
    for name, st in stats.items():
        steps = max(st["steps"], 1)
        split = f"{splits[name][0]}, {splits[name][1]}"
        print(f"{name:44} {split:>10} {st['agree'] / steps:>15.4f} {st['whole']:>8}/{args.examples:<5} "
              f"{st['kl'] / steps:>8.4f}")


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.studies.cwe_selection_study", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--task", choices=("ruler-cwe", "ruler-mq", "ruler-mv", "ruler-vt", "ruler-mk", "squad"),
                   default="ruler-cwe")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--compression", type=parse_compression, default="1/8",
                   help="the target (default 1/8: the five variants; another: the policy beside exact step-1 scores, "
                        "twice the positions, and splits giving the positions 1/4 or 1/8 of the budget)")
    p.add_argument("--stored", action="store_true",
                   help="step 1 on an int4 K^T as stored (bf16 scales), raw, centred, or in the keys' principal basis")
    p.add_argument("--fewer-bits", action="store_true",
                   help="step 1 on a K^T without position scales at 4, 3 and 2 bits, each dimension's range its "
                        "absmax or a few spreads (clamped)")
    p.add_argument("--ranking", action="store_true",
                   help="step 1's ranking at the int3 K^T's split: the K^T as stored against the float keys, |q| x "
                        "spread against |q| alone, exact scores, and fixed SparQ's split of the same bytes")
    p.add_argument("--formats", help="the policy itself on caches of these formats (KV/KT/SCALE[/BASIS],...; the "
                                     "module docstring)")
    p.add_argument("--examples", type=cli.positive_int, default=12)
    p.add_argument("--length", type=cli.positive_int, default=4096, help="a RULER-style task's prompt tokens")
    return p


def examples_and_answers(task: str, tokenizer, length: int, n: int):
    """The task's examples (seed 0, the eval runs' first ones), each with the most tokens of dense's answer and
    the rule that ends it: a RULER-style task's max_new (its stop tokens, or the task's own end, as the harness's
    greedy rows), SQuAD's line."""
    if task == "squad":
        ended = squad_answer_ended(tokenizer)
        return [(ex, MAX_ANSWER, ended) for ex in squad_examples(tokenizer, 7, n, 0)]
    spec = TASKS[task]

    def ended_rule(ex):
        return lambda answer: answer[-1] in tokenizer.stop_ids or spec.finished(ex, tokenizer.decode(answer))
    return [(ex, ex.max_new, ended_rule(ex)) for ex in spec.build(tokenizer, length, n, 0, TaskOptions())]


def run(args) -> None:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.checkpoint)
    kernels = kernels_for("auto", "cpu", ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json"))
    dtype = DTYPES[args.dtype]
    model = load_checkpoint(args.checkpoint, "cpu", dtype, kernels)
    if args.formats:
        return run_formats(args, model, kernels, tokenizer)
    costs = StepCosts.of(KVFormat(kt_dtype="int4"), dtype, model.args.head_dim)  # the CPU default's split
    compression = float(args.compression)
    variants = ({**RANKING_STORED, **RANKING_VARIANTS} if args.ranking else FEWER_BITS_VARIANTS if args.fewer_bits else STORED_VARIANTS if args.stored else
                VARIANTS if compression == COMPRESSION else BUDGET_VARIANTS)
    stats = {name: {"agree": 0, "steps": 0, "kl": 0.0, "whole": 0} for name in variants}
    splits = {}  # name: its (r, k) at the last example's length
    start = time.time()
    with torch.no_grad():
        for ex, max_new, ended in tqdm(examples_and_answers(args.task, tokenizer, args.length, args.examples),
                                       desc="examples"):
            T = len(ex.prompt)
            model.setup_caches(1, T + max_new + 1)
            model.set_decode_attention(lambda i: DenseDecode(kernels))
            logits = prefill(model, torch.tensor([ex.prompt]))
            snapshots = model.save_caches()
            answer, dense_logprobs = dense_answer(model, logits, T, max_new, ended)
            for name, spec in variants.items():
                model.restore_caches(snapshots)
                if args.ranking:
                    policies = ranking_policies(kernels, compression, name, model.args.n_layer)
                elif args.stored or args.fewer_bits:
                    policies = [StoredVariant(kernels, *spec, compression=compression)
                                for _ in range(model.args.n_layer)]
                else:
                    per_head, spread, r, k, share, split_costs = spec
                    policies = [Variant(kernels, per_head, spread, r, k, split_costs or costs, compression, share)
                                for _ in range(model.args.n_layer)]
                model.set_decode_attention(lambda i: policies[i])
                score_teacher_forced(model, answer, dense_logprobs, T, stats[name])
                if args.stored or args.fewer_bits:  # the split at the prompt's length
                    splits[name] = "%d, %d" % adaptive_split(T, model.args.head_dim, compression,
                                                             costs=policies[0].costs)
                elif args.ranking:  # the split its first layer took at the last step (a variant may set r or k)
                    splits[name] = "%d, %d" % policies[0].last_split
    where = "(7 contexts)" if args.task == "squad" else f"at {args.length} tokens"
    split = adaptive_split(T, model.args.head_dim, compression, costs=costs)
    print(f"{args.checkpoint.name}, {args.dtype}, {args.examples} {args.task} examples {where}, {args.compression} "
          f"on an int4 K^T (r, k = {split} at the last one's {T}), {time.time() - start:.0f} s")
    print(f"{'variant':58} {'r, k':>10} {'argmax = dense':>15} {'whole answers':>14} {'KL':>8}")
    for name, st in stats.items():
        steps = max(st["steps"], 1)
        print(f"{name:58} {splits.get(name, ''):>10} {st['agree'] / steps:>15.4f} {st['whole']:>8}/{args.examples:<5} "
              f"{st['kl'] / steps:>8.4f}")


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
