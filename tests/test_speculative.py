"""Speculative decoding (speculation.Speculator, generate.py --speculate-k): greedy output equals the
verifier's own, single and ragged, self-speculative and with a draft model; rejected positions leave
the caches as a run that never drafted would; sampled output is distributed as the verifier's
(exactly, by the rejection rule: checked on a vocabulary of 8 against the verifier's probabilities);
the one verify pass equals one-token steps; and the command line's refusals."""
from __future__ import annotations


import pytest
import torch

import kernels
from assemble import check_same_tokenizer
from cli import UserError
import generate
from conftest import assert_one_line_error, read_json, run_main, run_python
from decoding import Generator, prefill
from sampling import Sampling, probabilities
from speculation import Speculator
from model import Transformer
from policies import AttentionSettings, policy_factory
from test_ragged import tiny_model

DENSE = AttentionSettings("dense")
DRAFT = AttentionSettings("sparq", sparq_r=4, sparq_k=16)  # reads a fraction of the cache: it disagrees sometimes


def policies(model, settings):
    make = policy_factory(settings, model.args, model.kernels)
    return [make(i) for i in range(model.args.n_layer)]


def prompts(lengths, seed=1, vocab=101):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def verifier_alone(model, rows, new_tokens):
    model.setup_caches(len(rows), max(map(len, rows)) + new_tokens)
    model.set_decode_attention(policy_factory(DENSE, model.args, model.kernels))
    return Generator(model).generate(rows, new_tokens)[0]


def with_kernels(model: Transformer, name: str) -> Transformer:
    """The same weights running `name`'s kernels (the fused CPU ones, or the Triton ones in Triton's
    interpreter: one-token steps and the verify pass)."""
    if name == "torch":
        return model
    fused = Transformer(model.args, {"cpu": kernels.CPU_KERNELS, "triton": kernels.TRITON_KERNELS}[name])
    fused.load_state_dict(model.state_dict())
    return fused.eval()


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("lengths", [(60,), (50, 70, 33)])
@pytest.mark.parametrize("n", [1, 4])
def test_self_speculation_gives_the_verifiers_greedy_tokens(lengths, n, kernel):
    model = with_kernels(tiny_model(), kernel)
    rows = prompts(lengths)
    reference = verifier_alone(model, rows, 30)
    model.setup_caches(len(rows), max(lengths) + 30 + n + 1)
    out, stats = Speculator(model, n, policies(model, DENSE), policies(model, DRAFT)).generate(rows, 30)
    assert out == reference
    assert stats.rounds < 29 and 0 < stats.accepted < stats.proposed  # it drafted, and the verifier disagreed too


def test_a_draft_model_gives_the_verifiers_greedy_tokens_whatever_it_proposes():
    model, other = tiny_model(), tiny_model(seed=1)
    rows = prompts((40, 25))
    reference = verifier_alone(model, rows, 20)
    for draft, expect_all in ((other, False), (tiny_model(), True)):  # another model; the verifier's own weights
        model.setup_caches(2, 40 + 20 + 4)
        draft.setup_caches(2, 40 + 20 + 4)
        draft.set_decode_attention(policy_factory(DENSE, draft.args))
        out, stats = Speculator(model, 3, policies(model, DENSE), draft_model=draft).generate(rows, 20)
        assert out == reference
        assert (stats.accepted == stats.proposed) == expect_all


def test_compiled_speculation_gives_the_verifiers_greedy_tokens():
    """generate.py --compile: the draft step and the verify pass compiled (fused CPU kernels, ragged rows)."""
    model = with_kernels(tiny_model(), "cpu")
    rows = prompts((50, 70))
    reference = verifier_alone(model, rows, 16)
    model.setup_caches(2, 70 + 16 + 4)
    speculator = Speculator(model, 3, policies(model, DENSE), policies(model, DRAFT), compile=True)
    speculator.warm_up(rows)
    out, stats = speculator.generate(rows, 16)
    assert out == reference
    assert 0 < stats.accepted < stats.proposed


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="no triton")
def test_the_triton_verify_pass_gives_the_verifiers_greedy_tokens():
    """The Triton kernels (in Triton's interpreter without a GPU): the verifier's one-token steps and its
    verify pass (dense_verify_triton) on ragged rows, a draft model of other weights proposing."""
    model, draft = with_kernels(tiny_model(), "triton"), tiny_model(seed=1)
    rows = prompts((40, 25))
    reference = verifier_alone(model, rows, 12)
    model.setup_caches(2, 40 + 12 + 4)
    draft.setup_caches(2, 40 + 12 + 4)
    draft.set_decode_attention(policy_factory(DENSE, draft.args))
    out, stats = Speculator(model, 3, policies(model, DENSE), draft_model=draft).generate(rows, 12)
    assert out == reference
    assert 0 < stats.proposed and stats.accepted < stats.proposed


def test_rejected_positions_leave_the_cache_as_a_run_that_never_drafted():
    """After speculation, each row's cache (K, V, live length, running V sum) equals the verifier's
    prefill of the same tokens: the draft's keys and values are gone, the V sums follow exactly (within
    fp32 rounding: the prefill and the verify pass order their sums differently)."""
    model = tiny_model()
    rows = prompts((45, 30))
    model.setup_caches(2, 45 + 24 + 6)
    out, stats = Speculator(model, 5, policies(model, DENSE), policies(model, DRAFT)).generate(rows, 24)
    assert stats.accepted < stats.proposed
    spec = [(c.k.clone(), c.v.clone(), c.v_sum.clone(), c.live_length.clone()) for c in model.caches]
    for b, (prompt, new) in enumerate(zip(rows, out)):
        live = int(spec[0][3][b])
        assert len(prompt) + len(new) - 1 <= live  # every emitted token but the last is cached
        tokens = (prompt + new)[:live]
        model.setup_caches(1, live + 1)
        with torch.no_grad():
            prefill(model, torch.tensor([tokens]))
        for (k, v, v_sum, _), cache in zip(spec, model.caches):
            torch.testing.assert_close(k[b, :, :live], cache.k[0, :, :live], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v[b, :, :live], cache.v[0, :, :live], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v_sum[b], cache.v_sum[0], rtol=1e-4, atol=1e-4)


def test_the_verify_pass_equals_one_token_steps():
    model = tiny_model()
    rows = prompts((20, 31))
    tokens = prompts((5, 5), seed=2)
    model.setup_caches(2, 40)
    model.set_decode_attention(policy_factory(DENSE, model.args))
    with torch.no_grad():
        generate_logits = []
        for b, row in enumerate(rows):  # one token at a time, each row alone
            model.setup_caches(1, 40)
            prefill(model, torch.tensor([row]))
            generate_logits.append(torch.stack([model.decode(torch.tensor([[t]]), torch.tensor([len(row) + j]), len(row) + j + 1)[0]
                                                for j, t in enumerate(tokens[b])]))
        model.setup_caches(2, 40)
        from decoding import prefill_rows
        prefill_rows(model, rows)
        positions = torch.tensor([[len(r)] for r in rows]) + torch.arange(5)
        verified = model.verify(torch.tensor(tokens), positions, 36)  # (2, 5, vocab)
    for b in range(2):
        torch.testing.assert_close(verified[b], generate_logits[b], rtol=1e-4, atol=1e-4)


def small_vocab_model(seed: int) -> Transformer:
    return tiny_model(seed, scale=1.0, vocab_size=8, dim=32, n_head=2, n_kv_head=1, head_dim=16, intermediate_size=48,
                      max_context=64)


def test_sampled_tokens_follow_the_verifiers_distribution():
    """4000 rows of one prompt, two new tokens each at temperature 1 drafted by another model: the
    joint frequencies of (t1, t2) match the verifier's own p(t1) p(t2 | t1) (Pearson's chi-square over
    the 64 cells, 63 degrees of freedom, below 110: p ~ 2e-4), and the draft is rejected often enough
    for the residual distribution to matter."""
    torch.manual_seed(0)
    model, draft = small_vocab_model(0), small_vocab_model(1)
    prompt = prompts((12,), seed=3, vocab=8)[0]
    B = 4000
    model.setup_caches(B, 12 + 2 + 3)
    draft.setup_caches(B, 12 + 2 + 3)
    draft.set_decode_attention(policy_factory(DENSE, draft.args))
    out, stats = Speculator(model, 2, policies(model, DENSE), draft_model=draft, sampling=Sampling(temperature=1.0)).generate([prompt] * B, 2)
    assert 0.2 < stats.accepted / stats.proposed < 0.9
    # the verifier's exact joint distribution of the first two tokens
    model.setup_caches(1, 16)
    with torch.no_grad():
        p1 = probabilities(prefill(model, torch.tensor([prompt])), Sampling(temperature=1.0))[0]  # (8,)
        joint = torch.stack([p1[t] * probabilities(prefill(model, torch.tensor([prompt + [t]])), Sampling(temperature=1.0))[0]
                             for t in range(8)])  # (8, 8)
    counts = torch.zeros(8, 8)
    for row in out:
        counts[row[0], row[1]] += 1
    expected = joint * B
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 110, chi2


def run_generate(*args):
    return run_python("generate.py", *args)


@pytest.mark.parametrize("args, fragment", [
    (("--speculate-k", "4"), "needs a draft"),
    (("--draft-attention", "sparq", "--sparq-r", "8"), "needs --speculate-k"),
    (("--speculate-k", "4", "--draft-attention", "sparq", "--sparq-r", "8", "--attention", "sparq"), "verifier runs dense"),
    (("--speculate-k", "4", "--draft-attention", "sparq", "--sparq-r", "8", "--interactive"), "--interactive"),
    (("--speculate-k", "4", "--draft-attention", "h2o", "--kv-budget", "64"), "h2o cannot draft"),
    (("--speculate-k", "4", "--draft-checkpoint", "x", "--random-weights", "smollm2"), "tokenizer"),
])
def test_speculation_refusals(smollm2_checkpoint, args, fragment):
    checkpoint = () if "--random-weights" in args else ("--checkpoint", str(smollm2_checkpoint))
    assert_one_line_error(run_main(generate.main, *checkpoint, "--prompt-tokens", "200", "--max-new-tokens", "4", *args),
                          fragment)


def test_a_draft_with_another_tokenizer_is_refused():
    class Tok:
        stop_ids = {0}

        def __init__(self, shift):
            self.shift = shift

        def encode(self, text):
            return [ord(c) + self.shift for c in text]

    args = tiny_model().args
    check_same_tokenizer(Tok(0), Tok(0), args, args)
    with pytest.raises(UserError, match="tokenizer differs"):
        check_same_tokenizer(Tok(0), Tok(1), args, args)


def test_generate_cli_self_speculation_matches_dense(tmp_path, smollm2_checkpoint):
    """The embedded model: the same greedy tokens as dense alone, two rows of 300 tokens (SparQ drafts beyond its
    k = 64), with the acceptance in the JSON."""
    base = ("--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "300", "--max-new-tokens", "24",
            "--batch-size", "2")
    assert run_generate(*base, "--json", str(tmp_path / "dense.json")).returncode == 0
    result = run_generate(*base, "--speculate-k", "4", "--draft-attention", "sparq", "--sparq-r", "8", "--sparq-k", "64",
                          "--json", str(tmp_path / "spec.json"))
    assert result.returncode == 0, result.stderr
    dense, spec = read_json(tmp_path / "dense.json"), read_json(tmp_path / "spec.json")
    assert [s["tokens"] for s in spec["samples"]] == [s["tokens"] for s in dense["samples"]]
    assert 0 < spec["acceptance_rate"] <= 1 and 1 < spec["tokens_per_round"] <= 5 and spec["speculate_k"] == 4
    assert "speculation: " in result.stderr


def test_acceptance_needed_inverts_the_theory():
    from speculation import acceptance_needed, expected_tokens_per_round

    a = acceptance_needed(1.15, 2, draft_step=0.5, verify_pass=1.2, step=1.0)
    assert expected_tokens_per_round(a, 2) * 1.0 / (2 * 0.5 + 1.2) == pytest.approx(1.15, rel=1e-6)
    assert acceptance_needed(1.5, 2, draft_step=0.5, verify_pass=1.2, step=1.0) is None  # 3 / 2.2 < 1.5 at a = 1


def test_tokens_per_round_theory():
    from speculation import expected_tokens_per_round, speculative_speedup

    assert expected_tokens_per_round(0.0, 4) == 1 and expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # a free draft and a verify pass that costs a step: the speedup is the tokens per round
    assert speculative_speedup(0.5, 2, 0.0, 1.0) == pytest.approx(1.75)
    assert speculative_speedup(1.0, 4, 0.25, 1.0) == pytest.approx(5 / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_verify_pass_is_the_one_token_step_bit_for_bit(dtype):
    """On the fused CPU kernels the verify pass computes each position as the one-token step does: the
    GEMV's rows are independent, the attention kernel's queries too (one chunk per row here), so greedy
    speculation is the verifier's own output even in bf16, where a different GEMM would flip near-ties."""
    # wide enough for a GEMM's and the GEMV's sums to round apart in bf16
    model = tiny_model(scale=1.0, kernels=kernels.CPU_KERNELS, dim=768, n_head=12, n_kv_head=4, head_dim=64,
                       intermediate_size=2048, max_context=128).to(dtype)
    row, new = prompts((40,))[0], prompts((5,), seed=2)[0]
    model.setup_caches(1, 64)
    model.set_decode_attention(policy_factory(DENSE, model.args, model.kernels))
    with torch.no_grad():
        prefill(model, torch.tensor([row]))
        steps = torch.stack([model.decode(torch.tensor([[t]]), torch.tensor([40 + j]), 40 + j + 1)[0] for j, t in enumerate(new)])
        model.reset_caches()
        prefill(model, torch.tensor([row]))
        verified = model.verify(torch.tensor([new]), torch.tensor([[40]]) + torch.arange(5), 45)[0]
    assert torch.equal(verified, steps)
