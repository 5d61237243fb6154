"""Speculative decoding: a draft proposes n tokens per row, the verifier scores the n + 1 positions in one
pass (Transformer.verify) and each row keeps what it agrees with; and the arithmetic of its speedup.

The draft is the verifier's own model reading a fraction of the same cache (self-speculation: SparQ as
the draft policy), or a draft model with caches of its own. Greedy output is the verifier's own tokens;
sampled output follows the rejection rule, so it is distributed as the verifier's own samples.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attention import DenseDecode
from decoding import (PREFILL_CHUNK, DecodeStats, compiled_decode_step, cut_at_stop, decode_step, own_step,
                      prefill_rows, synchronize)
from model import Transformer
from sampling import GREEDY, Sampling, draw, probabilities


def verify_step(model: Transformer, tokens: Tensor, input_pos: Tensor, length: int) -> Tensor:
    """tokens (B, T) at per-row positions input_pos (B, T), scored in one pass (speculative
    verification); length = the positions attention reads -> logits (B, T, vocab)."""
    return model.verify(tokens, input_pos, length)


def expected_tokens_per_round(acceptance: float, n: int) -> float:
    """(1 - a^(n+1)) / (1 - a): a row's tokens per round when each proposal is accepted with probability a."""
    a = acceptance
    return n + 1 if a >= 1 else (1 - a ** (n + 1)) / (1 - a)


def speculative_speedup(acceptance: float, n: int, draft_step: float, verify_pass: float) -> float:
    """Expected tokens per round over the round's cost in verifier steps (a verify pass taken as one
    step: both read the weights and the cache once)."""
    return expected_tokens_per_round(acceptance, n) * verify_pass / (n * draft_step + verify_pass)


def acceptance_needed(speedup: float, n: int, draft_step: float, verify_pass: float, step: float) -> Optional[float]:
    """The acceptance at which n proposals per round, at these draft-step and verify-pass costs, reach
    `speedup` over a one-token step of cost `step`; None where even acceptance 1 falls short."""
    def predicted(a: float) -> float:  # speculative_speedup counts in verify passes: rescaled to `step`
        return speculative_speedup(a, n, draft_step, verify_pass) * step / verify_pass

    if predicted(1.0) < speedup:
        return None
    lo, hi = 0.0, 1.0  # predicted() grows with a
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < speedup else (lo, mid)
    return hi


def speculation_summary(stats: DecodeStats, n: int) -> dict:
    """acceptance_rate: accepted over proposed draft tokens; tokens_per_round: tokens a row gains per round
    (its accepted proposals and the verifier's own token); the measured step costs and the speedup they
    and the acceptance predict (speculative_speedup)."""
    if not stats.rounds:
        return {"acceptance_rate": None, "tokens_per_round": None}
    row_rounds = stats.proposed // n  # rounds x rows
    a = stats.accepted / stats.proposed
    draft_step, verify_pass = stats.draft_s / (stats.rounds * n), stats.verify_s / stats.rounds
    return {"acceptance_rate": a, "tokens_per_round": 1 + stats.accepted / row_rounds,
            "draft_step_s": draft_step, "verify_pass_s": verify_pass,
            "theory_speedup": speculative_speedup(a, n, draft_step, verify_pass)}


@dataclass
class Speculator:
    """Each round the draft proposes n tokens per row; the verifier scores the n + 1 positions in one
    pass (Transformer.forward over per-row positions, every_position) and each row keeps the longest
    prefix it agrees with plus one token of its own; the caches drop the rest (truncate_rows), so rows
    accept different counts in the same round. Greedy: the verifier's own tokens (its one pass is its
    one-token steps bit for bit on the fused CPU kernels, up to fp32 rounding elsewhere:
    DenseDecode.verify, kernels.linear_cpu). Sampling: the rejection rule (accept
    d with min(1, p(d) / q(d)), else draw from max(0, p - q) renormalized), which leaves the output
    distributed exactly as the verifier's own samples.

    Self-speculation (draft_model None): the verifier's model and caches, running draft_policies to
    propose (SparQ reading a fraction of the cache) and verify_policies to verify; the verify pass
    rewrites the drafted positions with the verifier's keys and values. A draft model: its own caches
    and installed policies, fed one token more than it proposes so that its cache holds every
    position a round can accept."""

    model: Transformer
    n: int  # tokens proposed per round
    verify_policies: list
    draft_policies: Optional[list] = None  # self-speculation
    draft_model: Optional[Transformer] = None
    stop_ids: set[int] = field(default_factory=set)
    sampling: Sampling = GREEDY  # no penalties: the rejection rule compares the draft's and the verifier's
    # distributions at each position, which a penalty's history would make depend on the tokens accepted
    prefill_chunk: int = PREFILL_CHUNK
    compile: bool = False  # the draft step and the verify pass, each compiled as Generator's step
    compile_name: str = "speculate"  # their code's own name (own_step), apart from a Generator's step
    compile_backend: str = "inductor"  # compiled_decode_step's backend

    def __post_init__(self):
        if self.sampling.penalized:
            raise ValueError("speculative decoding samples without penalties (presence, frequency, repetition)")
        self._draft_step, self._verify_step = decode_step, verify_step
        if self.compile:
            device = self.model.device.type
            # two compiled functions of their own code, each meeting the same policies at every call
            # (self-speculation swaps the layers' policies between them)
            self._draft_step = compiled_decode_step(own_step(decode_step, f"draft_{self.compile_name}"), device,
                                                    self.compile_backend)
            self._verify_step = compiled_decode_step(own_step(verify_step, self.compile_name), device,
                                                     self.compile_backend)

    @torch.no_grad()
    def warm_up(self, prompts: list[list[int]]) -> float:
        """Compile the draft step and the verify pass (their dynamic graphs, and SparQ's second branch
        past k positions, which a long prompt reaches at once) with two rounds outside the timed runs;
        the next generate() resets the caches. Returns the seconds it took."""
        start = time.perf_counter()
        self.generate(prompts, 2 * (self.n + 1))
        return time.perf_counter() - start

    def _install(self, policies: list) -> None:
        self.model.set_decode_attention(lambda layer: policies[layer])

    def _sample(self, logits: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """(tokens, the distribution they were drawn from, or None when greedy): sampling.sample's chain,
        the distribution kept for the rejection rule."""
        if self.sampling.greedy:
            return logits.argmax(dim=-1), None
        probs = probabilities(logits, self.sampling)
        return draw(probs), probs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        rows = [list(p) for p in prompts]
        device = self.model.device
        start = time.perf_counter()
        if self.draft_policies is not None:
            self._install(self.verify_policies)
        token, _ = self._sample(prefill_rows(self.model, rows, self.prefill_chunk))
        if self.draft_model is not None:
            prefill_rows(self.draft_model, rows, self.prefill_chunk)
        synchronize(device)
        prefill_s = time.perf_counter() - start
        out, stats = self.decode(token, [len(p) for p in rows], max_new_tokens)
        stats.prefill_tokens, stats.prefill_s = sum(len(p) for p in rows), prefill_s
        return out, stats

    @torch.no_grad()
    def decode(self, token: Tensor, lengths: list[int], max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        """Speculate from caches that hold each row's first lengths[b] positions (the draft model's too),
        token (B,) being the token at position lengths[b] -> the new tokens of each row (cut after a stop
        token and at max_new_tokens) and timings (prefill fields zero)."""
        device = self.model.device
        lengths_at_start = list(lengths)
        out = [[t] for t in token.tolist()]
        stats = DecodeStats(0, 0.0, 0.0, 0, 0, weight_bytes_read=0)
        # weights a round reads: the verify pass's, and the draft's once per step it runs
        round_weights = self.model.weight_bytes() + (self.n * self.model.weight_bytes() if self.draft_model is None
                                                     else (self.n + 1) * self.draft_model.weight_bytes())
        start = time.perf_counter()
        while True:
            # a row done (its tokens, or a stop token) stays where it is while the others go on
            active = [len(o) < max_new_tokens and not self._stopped(o) for o in out]
            if not any(active):
                break
            phase = time.perf_counter()
            proposals, q, draft_bytes = self._propose(token, lengths)  # (B, n), (B, n, vocab) or None
            synchronize(device)
            stats.draft_s += time.perf_counter() - phase
            phase = time.perf_counter()
            logits, verify_bytes = self._verify(token, proposals, lengths)  # (B, n + 1, vocab)
            synchronize(device)
            stats.verify_s += time.perf_counter() - phase
            accepted, next_token = self._accept(logits, proposals, q)  # (B,), (B,)
            accepted_list = [m if live else -1 for m, live in zip(accepted.tolist(), active)]
            proposal_rows = proposals.tolist()
            for b, (m, t) in enumerate(zip(accepted_list, next_token.tolist())):
                if m >= 0:
                    out[b] += proposal_rows[b][:m] + [t]
            token = torch.where(torch.tensor(active, device=device), next_token, token)
            lengths = [n + m + 1 for n, m in zip(lengths, accepted_list)]  # a done row: m + 1 = 0
            keep = torch.tensor(lengths, device=device)
            for model in (self.model, self.draft_model):
                if model is not None:
                    for cache in model.caches:
                        cache.truncate_rows(keep)
            stats.rounds += 1
            stats.proposed += self.n * sum(active)
            stats.accepted += sum(m for m in accepted_list if m > 0)
            stats.kv_bytes_read += draft_bytes + verify_bytes
            stats.weight_bytes_read += round_weights
        synchronize(device)
        stats.decode_s = time.perf_counter() - start
        out = [cut_at_stop(row, self.stop_ids, max_new_tokens) for row in out]
        stats.steps = max(0, max(len(row) for row in out) - 1)  # tokens after the first, as Generator counts
        dense = [DenseDecode()] * len(self.model.layers)
        stats.dense_kv_bytes_read = sum(self.model.decode_kv_bytes(n + i + 1, 1, dense)
                                        for n, row in zip(lengths_at_start, out) for i in range(len(row) - 1))
        return out, stats

    def _propose(self, token: Tensor, lengths: list[int]) -> tuple[Tensor, Optional[Tensor], int]:
        """n draft tokens per row after `token` (at each row's position lengths[b]), the distributions
        they were drawn from, and the KV bytes the draft read."""
        B, longest = len(lengths), max(lengths)
        draft = self.draft_model or self.model
        if self.draft_policies is not None:
            self._install(self.draft_policies)
        steps = self.n if self.draft_model is None else self.n + 1  # a draft model also caches its last proposal
        position = torch.tensor(lengths, device=token.device).view(B, 1)
        current, proposals, dists, kv_bytes = token, [], [], 0
        for i in range(steps):
            logits = self._draft_step(draft, current.view(B, 1), position + i, draft.read_length(longest + i + 1))
            kv_bytes += sum(draft.decode_kv_bytes(n + i + 1, 1) for n in lengths)
            if i == self.n:
                break
            current, probs = self._sample(logits)
            proposals.append(current)
            dists.append(probs)
        if self.draft_model is None:  # the verify pass writes these positions again, the verifier's way
            for cache in self.model.caches:
                cache.truncate_rows(torch.tensor(lengths, device=token.device))
        q = None if dists[0] is None else torch.stack(dists, dim=1)
        return torch.stack(proposals, dim=1), q, kv_bytes

    def _verify(self, token: Tensor, proposals: Tensor, lengths: list[int]) -> tuple[Tensor, int]:
        """The verifier's logits (B, n + 1, vocab) at `token` and the n proposals after it, in one pass."""
        B, T = len(lengths), self.n + 1
        self._install(self.verify_policies)
        tokens = torch.cat([token.view(B, 1), proposals], dim=1)  # (B, n + 1)
        positions = torch.tensor(lengths, device=token.device).view(B, 1) + torch.arange(T, device=token.device)
        logits = self._verify_step(self.model, tokens, positions, self.model.read_length(max(lengths) + T))
        return logits, sum(self.model.decode_kv_bytes(n + T, 1) for n in lengths)

    def _accept(self, logits: Tensor, proposals: Tensor, q: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(accepted count (B,), each row's next token (B,)): greedy, the proposals the verifier's argmax
        repeats and then its own; sampling, the rejection rule."""
        n = self.n
        if q is None:
            best = logits.argmax(dim=-1)  # (B, n + 1)
            accepted = (best[:, :n] == proposals).long().cumprod(dim=1).sum(dim=1)
            return accepted, best.gather(1, accepted[:, None]).squeeze(1)
        p = probabilities(logits, self.sampling)  # (B, n + 1, vocab)
        index = proposals[..., None]
        ratio = p[:, :n].gather(2, index).squeeze(2) / q.gather(2, index).squeeze(2)  # (B, n)
        accepted = (torch.rand_like(ratio) < ratio).long().cumprod(dim=1).sum(dim=1)
        # the next token: from max(0, p - q) at the first rejection, from p after the last proposal
        at = accepted.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
        p_next = p.gather(1, at).squeeze(1)
        q_next = F.pad(q, (0, 0, 0, 1)).gather(1, at).squeeze(1)  # zeros after the last proposal
        residual = (p_next - q_next).clamp(min=0)
        return accepted, draw(residual / residual.sum(dim=-1, keepdim=True))

    def _stopped(self, row: list[int]) -> bool:
        return any(t in self.stop_ids for t in row)
