"""How adaptive SparQ should split a step's budget between positions (k) and step 1's components (r)
(docs/NOTES.md, "Adaptive SparQ's split"; sparq_adaptive.position_share is what it chose).

    python -m scripts.studies.adaptive_split_study --checkpoint checkpoints/SmolLM2-135M-Instruct \\
        --compression 1/4,1/8,1/16 --shares 1/16,1/8,1/4,1/2 --examples 60

Per SQuAD example (1-shot, --contexts confusion paragraphs, evals/tasks.py's prompts): a dense prefill, dense's
greedy answer to the end of its line (at most 12 tokens), then for each (compression, share) adaptive
SparQ on the torch path, every layer at adaptive_split(..., share=share), teacher-forced on dense's
answer. Printed per variant: the share of steps whose argmax is dense's, the answers reproduced whole
(what the paired exact-match difference tracks) and the mean KL(dense || variant) of the next token.
Plain PyTorch (nothing here is the product path); one thread.
"""
from __future__ import annotations

import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
from decoding import decode_step, prefill  # noqa: E402
from evals.tasks import squad_examples  # noqa: E402
from assemble import DTYPES, kt_scale_for, load_checkpoint, load_tokenizer  # noqa: E402
from kernels import TORCH_KERNELS  # noqa: E402
from attention import DenseDecode  # noqa: E402
from cache import KVFormat  # noqa: E402
from sparq_adaptive import (SparQAdaptiveDecode, StepCosts, adaptive_split, position_share,  # noqa: E402
                            select_components, select_positions, sparq_adaptive_torch)

MAX_ANSWER = 12


class SplitAt(SparQAdaptiveDecode):
    """sparq-adaptive (torch path, float cache) with positions given `share` of each step's budget, k at
    most k_cap (None: no cap, the policy's default), dense up to the policy's k_max (128) positions."""

    def __init__(self, compression: float, share: float, k_cap: Optional[int] = None):
        super().__init__(compression, kernels=TORCH_KERNELS, k_cap=k_cap)
        self.share = share

    def forward(self, q, cache, length):
        if cache.visible_length(length) <= self.k_max:
            return super().forward(q, cache, length)
        B, d = q.shape[0], q.shape[-1]
        view = cache.view(length, B)  # dequantized copies of a quantized cache; the split in its stored bytes
        costs = StepCosts.of(cache.format, cache.dtype, d)
        r, k = adaptive_split(view.length, d, self.compression, self.k_cap, costs=costs, share=self.share)
        return sparq_adaptive_torch(q, view.k, view.v, view.v_sum, self.spread(view, B), view.length,
                                    view.live_length, r, k, max(1, k // 4), False, None, view.k_t)


class SplitByCoverage(SparQAdaptiveDecode):
    """sparq-adaptive (torch path) whose split follows each row's step-1 coverage in this layer: alpha, the share
    of the approximate scores' mass (s_hat, over the row's KV and query heads) on the positions the step attends.
    After each step the row's position share moves by `rate` (target - alpha), within [1/8, 3/4], starting
    from position_share's: where a layer's attention is spread (alpha below target) its steps buy positions,
    where it is sharp, components (the question issue 89's screens left: SQuAD wanted components, essay
    perplexity positions). Rows are independent; the state resets whenever the row count changes (a new
    batch)."""

    def __init__(self, compression: float, target: float, rate: float = 0.05):
        super().__init__(compression, kernels=TORCH_KERNELS)
        self.target, self.rate = target, rate
        self.shares: Optional[torch.Tensor] = None  # (B,) each row's current share

    def forward(self, q, cache, length):
        if cache.visible_length(length) <= self.k_max:
            return super().forward(q, cache, length)
        B, d = q.shape[0], q.shape[-1]
        view = cache.view(length, B)
        costs = StepCosts.of(cache.format, cache.dtype, d)
        if self.shares is None or self.shares.shape[0] != B:
            self.shares = torch.full((B,), position_share(self.compression, d, costs, view.length))
        splits = [adaptive_split(view.length, d, self.compression, None, costs=costs, share=float(f))
                  for f in self.shares]
        r, k = (torch.tensor(column) for column in zip(*splits))  # (B,) each
        local = (k // 4).clamp(min=1)
        spread = self.spread(view, B)
        alpha = step1_coverage(q, view, spread, r, k, local)  # (B,)
        self.shares = (self.shares + self.rate * (self.target - alpha)).clamp(1 / 8, 3 / 4)
        return sparq_adaptive_torch(q, view.k, view.v, view.v_sum, spread, view.length, view.live_length, r, k,
                                    local, False, None, view.k_t)


def step1_coverage(q, view, spread, r, k, local) -> torch.Tensor:
    """Each row's mean over its KV and query heads of s_hat's mass on the positions step 2 takes (sparq_adaptive
    _torch's step 1 and selection, repeated: a float cache, no live lengths, no soft-cap) -> (B,)."""
    B, d, S = q.shape[0], q.shape[-1], view.length
    qf = q.float()
    chosen = select_components(q, r, spread)  # (B, n_kv, 1, d)
    weight = qf.abs() * spread[:, :, None, :]
    tau = torch.sqrt(d * (weight * chosen).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True))
    keys_t = view.k[:B, :, :S].float().transpose(-1, -2) if view.k_t is None else view.k_t[:B, :, :, :S].float()
    s_hat = torch.softmax((qf * chosen) @ keys_t / tau, dim=-1)  # (B, n_kv, g, S)
    selected = select_positions(s_hat, S, k, local, None)  # (B, n_kv, 1, S)
    return (s_hat * selected).sum(-1).mean((1, 2))


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.studies.adaptive_split_study", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--compression", type=fractions, default="1/8,1/16", help="targets, e.g. 1/8,1/16")
    p.add_argument("--shares", type=fractions, default="1/8,1/4,1/2", help="positions' shares of the budget")
    p.add_argument("--coverage", default="", help="also SplitByCoverage toward these step-1 coverage targets "
                                                  "(comma list, e.g. 0.9,0.95) at each compression")
    p.add_argument("--kt-dtype", choices=("same", "int8", "int4", "int3"), default="same",
                   help="SparQ's copy of K^T as the cache stores it (generate.py's --kt-dtype, its scales as "
                        "--kt-scale-dtype auto gives them: none for int3): the split counts its bytes")
    p.add_argument("--examples", type=cli.positive_int, default=40)
    p.add_argument("--contexts", type=cli.positive_int, default=7, help="SQuAD confusion paragraphs (7: ~1.4k tokens)")
    p.add_argument("--k-cap", type=cli.positive_int, default=None,
                   help="a cap on k (default none, as the policy's --adaptive-k-cap; layers run dense up to 128 "
                        "positions either way)")
    return p


def fractions(text: str) -> list[Fraction]:
    try:
        out = [Fraction(x) for x in text.split(",")]
    except (ValueError, ZeroDivisionError):
        raise cli.UserError(f"expected fractions such as 1/8,1/4, got {text!r}") from None
    if not all(0 < x <= 1 for x in out):
        raise cli.UserError(f"fractions must be in (0, 1], got {text!r}")
    return out


def dense_answer(model, logits: torch.Tensor, T: int, max_new: int, ended) -> tuple[list[int], list[torch.Tensor]]:
    """Dense's greedy answer from the prefill's logits (prompt of T tokens, caches at its end, dense installed),
    at most max_new tokens, until ended(answer) says so: the tokens and each step's log-probabilities."""
    answer, logprobs = [], []
    for j in range(max_new):
        logprobs.append(torch.log_softmax(logits.float().view(-1), -1))
        answer.append(int(logits.view(-1).argmax()))
        if ended(answer):
            break
        logits = decode_step(model, torch.tensor([[answer[-1]]]), torch.tensor([T + j]), T + j + 1)
    return answer, logprobs


def squad_answer_ended(tokenizer):
    """SQuAD's answers end with their line (or a stop token): the rule for dense_answer."""
    newline = set(tokenizer.encode("\n"))
    return lambda answer: (answer[-1] in newline or answer[-1] in tokenizer.stop_ids
                           or "\n" in tokenizer.decode(answer).lstrip())


def score_teacher_forced(model, answer: list[int], dense_logprobs: list[torch.Tensor], T: int, stats: dict) -> None:
    """Decode dense's answer (prompt of T tokens, caches at its end) with the model's installed policies, adding to
    stats: steps, those whose argmax is dense's next token ("agree"), the summed KL(dense || policy) and whether the
    whole answer agreed. The first token comes from the (dense) prefill: steps 1.. are scored."""
    whole = True
    for j in range(len(answer) - 1):
        lp = torch.log_softmax(decode_step(model, torch.tensor([[answer[j]]]), torch.tensor([T + j]),
                                           T + j + 1).float().view(-1), -1)
        agree = int(lp.argmax()) == answer[j + 1]
        ref = dense_logprobs[j + 1].view(-1)
        stats["steps"] += 1
        stats["agree"] += agree
        stats["kl"] += float((ref.exp() * (ref - lp)).sum())
        whole &= agree
    stats["whole"] += whole


def run(args) -> None:
    torch.set_num_threads(1)
    model = load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], TORCH_KERNELS)
    tokenizer = load_tokenizer(args.checkpoint)
    n_layer = model.args.n_layer
    variants = [(c, f) for c in args.compression for f in args.shares]
    variants += [(c, f"coverage {a}") for c in args.compression for a in args.coverage.split(",") if a.strip()]
    kv_format = KVFormat(kt_dtype=args.kt_dtype, kt_scale_dtype=kt_scale_for("auto", args.kt_dtype))
    stats = {v: {"agree": 0, "steps": 0, "kl": 0.0, "whole": 0} for v in variants}
    ended = squad_answer_ended(tokenizer)
    start = time.time()
    with torch.no_grad():
        for ex in tqdm(squad_examples(tokenizer, args.contexts, args.examples, 0), desc="examples"):
            T = len(ex.prompt)
            model.setup_caches(1, T + MAX_ANSWER + 1, kv_format)
            model.set_decode_attention(lambda i: DenseDecode(TORCH_KERNELS))
            logits = prefill(model, torch.tensor([ex.prompt]))
            snapshots = model.save_caches()
            answer, dense_logprobs = dense_answer(model, logits, T, MAX_ANSWER, ended)  # to the end of its line
            for v in variants:
                model.restore_caches(snapshots)
                policies = [SplitAt(float(v[0]), float(v[1]), args.k_cap) if isinstance(v[1], Fraction)
                            else SplitByCoverage(float(v[0]), float(v[1].split()[1])) for _ in range(n_layer)]
                model.set_decode_attention(lambda i: policies[i])
                score_teacher_forced(model, answer, dense_logprobs, T, stats[v])
    print(f"{args.checkpoint.name}, {args.examples} SQuAD examples, K^T {args.kt_dtype}, {time.time() - start:.0f} s")
    print(f"{'compression':>11} {'share':>14} {'argmax = dense':>15} {'whole answers':>14} {'KL':>8}")
    for (c, f), st in stats.items():
        steps = max(st["steps"], 1)
        print(f"{str(c):>11} {str(f):>14} {st['agree'] / steps:>15.4f} {st['whole']:>8}/{args.examples:<5} "
              f"{st['kl'] / steps:>8.4f}")


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
