"""The one sampler: logits -> the next token, for generate.py (decoding.Generator), speculation and the
server's engine alike.

    logits -> penalties (presence / frequency on the tokens generated so far, repetition on the prompt's and
              the generated ones) -> greedy argmax when temperature is 0, else
              / temperature -> top-k -> top-p (nucleus) -> min-p -> softmax -> one draw

The draw is the exponential race (draw): on a GPU it stays on the device where torch.multinomial syncs
with the host, and with a torch.Generator of its own (a server request's `seed`) a row's draws depend
on that generator alone. Penalties follow vLLM's and OpenAI's definitions: presence subtracts its value
once from every token generated so far, frequency its value times the token's count; repetition (HF,
vLLM, llama.cpp) divides a positive logit of a token seen in the prompt or the output by its value and
multiplies a negative one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How a row's next token is chosen; the defaults are greedy decoding with nothing changed."""

    temperature: float = 0.0  # 0: greedy (the argmax, after any penalties)
    top_k: Optional[int] = None  # keep the k most likely tokens
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # times a token's count among the generated ones, subtracted
    repetition_penalty: float = 1.0  # a token in the prompt or generated: logit / p where positive, x p where not

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (a TokenHistory is needed)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def problem(self, vocab_size: int) -> Optional[tuple[str, str]]:
        """(the field, what is wrong with it) for a setting no sampler takes, else None; the field is named
        as here (the server's request fields), generate.py words it as its flag."""
        ranges = (("temperature", self.temperature >= 0, "must be >= 0 (0 is greedy)"),
                  ("top_k", self.top_k is None or 1 <= self.top_k <= vocab_size,
                   f"must be in [1, {vocab_size}] (the vocabulary)"),
                  ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
                  ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "must be > 0 (1 changes nothing)"))
        for name, fine, rule in ranges:
            if not fine:
                return name, f"{rule}, got {getattr(self, name)}"
        return None


GREEDY = Sampling()


@dataclass
class TokenHistory:
    """What the penalties read, per row: how often each token was generated, and which tokens the prompt and
    the output hold. counts (B, vocab) fp32; seen (B, vocab) bool."""

    counts: Tensor
    seen: Tensor

    @classmethod
    def of_prompts(cls, prompts: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> TokenHistory:
        seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
        for b, prompt in enumerate(prompts):
            seen[b, torch.tensor(prompt, dtype=torch.long, device=device)] = True
        return cls(torch.zeros(len(prompts), vocab_size, device=device), seen)

    def add(self, tokens: Tensor) -> None:
        """One generated token per row: tokens (B,)."""
        index = tokens.view(-1, 1).long()
        self.counts.scatter_add_(1, index, torch.ones_like(index, dtype=self.counts.dtype))
        self.seen.scatter_(1, index, True)


def penalize(logits: Tensor, params: Sampling, history: TokenHistory) -> Tensor:
    """logits (B, vocab) fp32 with the penalties of `params` applied for the rows' histories."""
    if params.repetition_penalty != 1:
        p = params.repetition_penalty
        logits = torch.where(history.seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if params.frequency_penalty != 0:
        logits = logits - params.frequency_penalty * history.counts
    if params.presence_penalty != 0:
        logits = logits - params.presence_penalty * (history.counts > 0).to(logits.dtype)
    return logits


def probabilities(logits: Tensor, params: Sampling) -> Tensor:
    """(..., vocab) logits -> the distribution a temperature > 0 draws from: softmax(logits / temperature)
    over the tokens top-k, top-p and min-p keep (the most likely token always stays)."""
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the more likely tokens
        drop = (before >= params.top_p).scatter(-1, order, before >= params.top_p)  # back in vocabulary order
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if params.top_p < 1 or params.min_p > 0:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """One token per row of probs (..., vocab), as the argmax of p / E with E ~ Exp(1) per token (the
    exponential race: P(argmax = i) = p_i), which stays on the device where torch.multinomial syncs
    with the host (gpt-fast samples this way); `generator`: the draws' own random stream."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(dim=-1)


def sample(logits: Tensor, params: Sampling = GREEDY, history: Optional[TokenHistory] = None,
           generator: Optional[torch.Generator] = None) -> Tensor:
    """logits (B, vocab) -> next tokens (B,): the whole chain of the module docstring. history: the rows'
    tokens so far, needed where params.penalized."""
    logits = logits.float()
    if params.penalized:
        if history is None:
            raise ValueError("penalties read the tokens so far: pass the rows' TokenHistory")
        logits = penalize(logits, params, history)
    if params.greedy:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, params), generator)


def add_sampling_flags(p) -> None:
    """generate.py's sampling flags (sampling_from_flags reads them); the server takes the same as request fields."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of most likely tokens holding this much probability")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token generated so far (OpenAI's, in [-2, 2])")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="times each token's count among the generated ones, subtracted (OpenAI's, in [-2, 2])")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="tokens in the prompt or generated: positive logits divided by it, negative multiplied (1: off)")


def sampling_from_flags(args, vocab_size: int) -> Sampling:
    """The Sampling of add_sampling_flags' flags, checked: ValueError in one line naming the flag."""
    params = Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.presence_penalty,
                      args.frequency_penalty, args.repetition_penalty)
    problem = params.problem(vocab_size)
    if problem is not None:
        name, what = problem
        raise ValueError(f"--{name.replace('_', '-')} {what}")
    return params
