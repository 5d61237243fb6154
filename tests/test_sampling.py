"""sampling.py, the one sampler: each knob against its definition written out here (frequencies over many
draws within 5 standard errors; penalties against the formula per token), greedy stays the argmax, and a
draw with its own generator depends on that generator alone."""
from __future__ import annotations

import pytest
import torch

from sampling import Sampling, TokenHistory, penalize, probabilities, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])


def frequencies(params: Sampling, draws: int = 40000) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = sample(LOGITS.repeat(draws, 1), params)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / draws


def assert_draws_follow(params: Sampling, expected: torch.Tensor) -> None:
    counts = frequencies(params)
    stderr = (expected * (1 - expected) / 40000).sqrt()
    assert ((counts - expected).abs() <= 5 * stderr + 1e-12).all(), (params, counts, expected)


def reference(temperature: float, keep) -> torch.Tensor:
    """softmax(logits / T) over the tokens `keep` says, renormalised: the definition."""
    p = torch.softmax(LOGITS.double() / temperature, dim=-1)
    p = torch.where(keep(p), p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_set_holding_p(top_p):
    def nucleus(p):
        order = p.argsort(descending=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[mass_before < top_p]] = True
        return keep

    assert_draws_follow(Sampling(temperature=0.9, top_p=top_p), reference(0.9, nucleus))


@pytest.mark.parametrize("min_p", [0.1, 0.3])
def test_min_p_drops_tokens_below_a_share_of_the_best(min_p):
    assert_draws_follow(Sampling(temperature=1.2, min_p=min_p), reference(1.2, lambda p: p >= min_p * p.max()))


def test_top_k_top_p_and_min_p_together():
    """top-k first, then the nucleus of what is left, then min-p (vLLM's order)."""
    def chain(p):
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[p.argsort(descending=True)[:4]] = True
        q = torch.where(keep, p, torch.zeros_like(p))
        q = q / q.sum()
        order = q.argsort(descending=True)
        nucleus = torch.zeros_like(keep)
        nucleus[order[(torch.cumsum(q[order], 0) - q[order]) < 0.9]] = True
        return keep & nucleus & (q >= 0.15 * q.max())

    assert_draws_follow(Sampling(temperature=1.0, top_k=4, top_p=0.9, min_p=0.15), reference(1.0, chain))


def test_penalties_follow_their_definitions():
    """presence: -p for each generated token; frequency: -f x its count; repetition: a token of the prompt or
    the output has its positive logit divided by r and its negative one multiplied (HF, vLLM)."""
    history = TokenHistory.of_prompts([[4]], len(LOGITS))
    for token in (0, 0, 2):
        history.add(torch.tensor([token]))
    params = Sampling(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    got = penalize(LOGITS[None].clone(), params, history)[0]
    counts = {0: 2, 2: 1}
    for token, logit in enumerate(LOGITS.tolist()):
        seen = token in counts or token == 4
        want = (logit / 2.0 if logit > 0 else logit * 2.0) if seen else logit
        want -= 0.25 * counts.get(token, 0) + (0.5 if token in counts else 0.0)
        assert got[token].item() == pytest.approx(want), token
    assert sample(LOGITS[None], Sampling(repetition_penalty=2.0), history).item() == 1  # greedy, penalised
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(LOGITS[None], params)


def test_greedy_and_the_generators_own_stream():
    assert sample(LOGITS[None]).item() == 0 and sample(LOGITS[None], Sampling(top_p=0.5)).item() == 0
    draws = [sample(LOGITS.repeat(8, 1), Sampling(temperature=1.0), generator=torch.Generator().manual_seed(s))
             for s in (3, 3, 4)]
    torch.manual_seed(123)  # the global stream changes nothing
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert probabilities(LOGITS, Sampling(temperature=0.5, top_p=0.01)).tolist() == [1.0] + [0.0] * 5


@pytest.mark.parametrize("params, field", [(Sampling(top_p=0), "top_p"), (Sampling(min_p=2), "min_p"),
                                           (Sampling(top_k=0), "top_k"), (Sampling(temperature=-1), "temperature"),
                                           (Sampling(presence_penalty=3), "presence_penalty"),
                                           (Sampling(repetition_penalty=0), "repetition_penalty")])
def test_settings_no_sampler_takes_are_named(params, field):
    assert params.problem(100)[0] == field and Sampling().problem(100) is None
