"""A K^T in the keys' principal basis (--kt-basis principal, cache.principal_basis): what the cache stores
against the keys rotated directly, the policy against the loop reference (sparq_adaptive_reference on the
rotated query and K^T) and against dense attention where it keeps every position, the fused CPU kernel against
the torch path, the basis read in the budget, and the flags' refusals."""
from __future__ import annotations

import pytest
import torch

import generate
import kernels
from attention import DenseDecode, dense_attention_torch
from cache import KVCache, KVFormat, principal_basis
from conftest import assert_one_line_error, run_main
from sparq import SparQConfig
from sparq_adaptive import (SparQAdaptiveDecode, StepCosts, adaptive_split, sparq_adaptive_attention_torch,
                            sparq_adaptive_reference, sparq_adaptive_torch)
from test_sparq import random_query


def correlated_keys(B: int, n_kv: int, S: int, d: int, seed: int = 0) -> torch.Tensor:
    """Keys with a mean and a covariance far from diagonal: a few random directions 1 to 30x wider than the rest,
    so the principal basis differs from the raw dimensions."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.linalg.qr(torch.randn(n_kv, d, d, generator=gen)).Q  # (n_kv, d, d) orthonormal
    widths = torch.logspace(1.5, 0, d)  # (d,)
    z = torch.randn(B, n_kv, S, d, generator=gen) * widths
    return z @ mix.transpose(-1, -2)[None] + torch.randn(1, n_kv, 1, d, generator=gen)


def principal_cache(B: int, n_kv: int, d: int, S: int, S_max: int, kt_dtype: str = "int4",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    cache = KVCache(B, S_max, n_kv, d, dtype, kt_dtype=kt_dtype, kt_scale_dtype="bfloat16", kt_basis="principal")
    k = correlated_keys(B, n_kv, S, d, seed)
    v = torch.randn(B, n_kv, S, d, generator=torch.Generator().manual_seed(seed + 1))
    cache.update(torch.arange(S), k.to(dtype), v.to(dtype))
    return cache, k


def test_the_cache_stores_the_centred_keys_in_their_principal_basis():
    """K^T (int8 here: small rounding) is (K - mean) U, U the eigenvectors of the first write's covariance, widest
    first (its spread per component descending), orthonormal to bf16's rounding; K itself is stored as given."""
    B, n_kv, d, S = 2, 2, 32, 300
    cache, k = principal_cache(B, n_kv, d, S, S + 8, kt_dtype="int8")
    mean = k.mean(2, keepdim=True)
    U = cache.kt_basis.float()
    torch.testing.assert_close(U.transpose(-1, -2) @ U, torch.eye(d).expand(B, n_kv, d, d), atol=2e-2, rtol=0)
    expected = (k - mean) @ U  # (B, n_kv, S, d)
    stored = cache.read_k_t(slice(0, B), 0, S).transpose(-1, -2)
    assert (stored - expected).abs().max() <= 0.6 * expected.abs().amax((2, 3), keepdim=True).max() / 127 * 2
    assert torch.equal(cache.read(slice(0, B), 0, S)[0], k)
    spread = cache.kt_spread
    torch.testing.assert_close(spread, expected.std(2, unbiased=False), atol=1e-4, rtol=1e-4)
    assert (spread[..., :-1] >= spread[..., 1:] - 1e-4).all()  # the widest component first
    cov = (k - mean).transpose(-1, -2) @ (k - mean) / S
    assert torch.allclose(spread.square().sum(-1), torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1), rtol=1e-2)


def test_the_basis_is_fixed_at_a_rows_first_write_and_snapshots_keep_it():
    """Later writes (a prefill's next chunk, decode steps) keep the row's basis, mean, spread and channel scale; a
    restored snapshot of the empty cache takes them back, and the next first write fixes them anew."""
    B, n_kv, d, S = 1, 2, 32, 200
    cache = KVCache(B, 2 * S + 8, n_kv, d, torch.float32, kt_dtype="int4", kt_basis="principal")
    empty = cache.snapshot()
    first, second = correlated_keys(B, n_kv, S, d, 0), correlated_keys(B, n_kv, S, d, 7) * 3
    v = torch.randn(B, n_kv, S, d)
    cache.update(torch.arange(S), first, v)
    fixed = {name: getattr(cache, name).clone() for name in ("kt_mean", "kt_basis", "kt_spread", "chan")}
    cache.update(torch.arange(S, 2 * S), second, v)
    cache.update(torch.tensor([2 * S]), second[:, :, :1], v[:, :, :1])
    for name, value in fixed.items():
        assert torch.equal(getattr(cache, name), value), name
    cache.restore(empty)
    assert not cache.kt_basis.any()
    cache.update(torch.arange(S), second, v)
    assert not torch.equal(cache.kt_basis, fixed["kt_basis"])
    mean, basis, _ = principal_basis(second)
    assert torch.equal(cache.kt_basis, basis) and torch.allclose(cache.kt_mean, mean)


def test_a_padded_prefill_counts_only_its_prompts_positions():
    """A right-padded batch: each row's basis is its own prompt's, the padding not counted (as a row alone)."""
    n_kv, d = 2, 16
    k = correlated_keys(2, n_kv, 120, d)
    v = torch.randn(2, n_kv, 120, d)
    padded = KVCache(2, 128, n_kv, d, torch.float32, kt_dtype="int4", kt_basis="principal")
    padded.update(torch.arange(120), k, v, lengths=torch.tensor([120, 70]))
    alone = KVCache(1, 128, n_kv, d, torch.float32, kt_dtype="int4", kt_basis="principal")
    alone.update(torch.arange(70), k[1:, :, :70], v[1:, :, :70])
    torch.testing.assert_close(padded.kt_mean[1:], alone.kt_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded.kt_spread[1:], alone.kt_spread, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_head", [True, False])
def test_the_policy_is_the_loop_reference_on_the_rotated_query(per_head):
    """The policy on a principal-basis cache (torch path) is sparq_adaptive_reference at the split the cache's
    costs give (the basis read counted), step 1 on the rotated query q U and the stored K^T ranked by the
    stored spread, step 2 on q and K."""
    B, n_kv, g, d, S = 2, 2, 3, 64, 900
    cache, _ = principal_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g, d, seed=3)
    policy = SparQAdaptiveDecode(compression=1 / 8, k_max=64, per_head=per_head)
    costs = StepCosts.of(cache.format, torch.float32, d)
    assert costs.fixed == d * d / 2  # a bf16 d x d basis in fp32 K elements
    r, k_top = adaptive_split(S, d, 1 / 8, None, costs)
    view = cache.view(S, B)
    config = SparQConfig(r=r, k_top=k_top, local=max(1, k_top // 4))
    q1 = (q @ cache.kt_basis.float()).to(q.dtype)
    expected = sparq_adaptive_reference(q, view.k, view.v, view.v_sum, S, config, spread=cache.kt_spread,
                                        k_t=view.k_t, per_head=per_head, q_step1=q1)
    torch.testing.assert_close(policy(q, cache, S), expected, atol=1e-5, rtol=1e-5)


def test_every_component_and_position_is_dense_attention():
    """r = d and k = S on the rotated query and K^T (the torch path the policy runs): dense attention, whatever
    step 1 ranked."""
    B, n_kv, g, d, S = 1, 2, 4, 32, 300
    cache, _ = principal_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g, d, seed=4)
    view = cache.view(S, B)
    y = sparq_adaptive_torch(q, view.k, view.v, view.v_sum, cache.kt_spread, S, None, d, S, S // 4, True,
                             k_t=view.k_t, q_step1=cache.step1_query(q))
    torch.testing.assert_close(y, dense_attention_torch(q, view.k, view.v, S, None), atol=1e-5, rtol=1e-5)


def test_the_basis_read_is_in_the_budget():
    """The policy's stored bytes on a principal-basis K^T include the basis (d x d bf16 per KV head and step) and
    stay within the target; the split buys fewer components or positions than the raw basis's at the same
    target, by what the basis costs."""
    d, c, act = 64, 1 / 16, torch.bfloat16
    raw, rotated = KVFormat(kt_dtype="int4", kt_scale_dtype="bfloat16"), KVFormat(
        kt_dtype="int4", kt_scale_dtype="bfloat16", kt_basis="principal")
    assert rotated.basis_bytes(d) == 2 * d * d and raw.basis_bytes(d) == 0
    policy = SparQAdaptiveDecode(compression=c, k_max=128)
    for S in (4096, 16384):
        dense = DenseDecode().transfer_bytes(S, d, rotated, act)
        stored = policy.transfer_bytes(S, d, rotated, act)
        assert c * dense - 2 * 2 * d - 1 <= stored <= c * dense + 1e-6, S  # within one position's K and V
        (r_raw, k_raw), (r, k) = (adaptive_split(S, d, c, None, StepCosts.of(f, act, d)) for f in (raw, rotated))
        assert (r, k) != (r_raw, k_raw) and r <= r_raw and k <= k_raw
        spent = policy.transfer_bytes(S, d, raw, act) - (S * (r_raw - r) / 2 + (k_raw - k) * 4 * d)
        assert stored == pytest.approx(spent + 2 * d * d, abs=4 * d), S  # the difference is the basis


@pytest.mark.usefixtures("fused_cpu_kernels")
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_takes_the_rotated_query(per_head, dtype, threads):
    """kernels.sparq_adaptive_cpu with q_step1 and the basis's cost, on ragged rows, is the torch path (which
    the test above ties to the loop reference); without q_step1 it ranks otherwise (the test can fail)."""
    threads(2)
    n_kv, g, d, lengths = 2, 7, 64, [1000, 700]
    B, S = len(lengths), max(lengths)
    cache, k = principal_cache(B, n_kv, d, S, S + 32, dtype=dtype)
    live = torch.tensor(lengths)
    cache.set_live_lengths(live)
    q = random_query(B, n_kv, g, d, seed=5, dtype=dtype)
    q1 = cache.step1_query(q)
    view = cache.view(S, B, stored=True)
    costs = StepCosts.of(cache.format, dtype, d)
    settings = (S, live, 1 / 16, 128, None, True, per_head)  # length, live, compression, k_max, k_cap, mean_v, per_head
    fused = kernels.sparq_adaptive_cpu(q, view.k, view.k_t, view.v, view.v_sum, cache.kt_spread, *settings,
                                       scales=view.scales, costs=costs, q_step1=q1)
    torch_view = cache.view(S, B)
    reference = sparq_adaptive_attention_torch(q, torch_view.k, torch_view.k_t, torch_view.v, torch_view.v_sum,
                                               cache.kt_spread, *settings, costs=costs, q_step1=q1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, reference, atol=tol, rtol=tol)
    unrotated = kernels.sparq_adaptive_cpu(q, view.k, view.k_t, view.v, view.v_sum, cache.kt_spread, *settings,
                                           scales=view.scales, costs=costs)
    assert (unrotated.float() - reference.float()).abs().max() > 10 * tol


@pytest.mark.parametrize("args,fragment", [
    (["--attention", "sparq", "--sparq-r", "8", "--kt-basis", "principal"], "applies to sparq-adaptive"),
    (["--attention", "sparq-adaptive", "--kt-basis", "principal", "--kv-dtype", "int8"], "--kt-basis principal"),
    (["--attention", "sparq-adaptive", "--kt-basis", "principal", "--kt-dtype", "same"], "--kt-basis principal"),
    (["--attention", "sparq-adaptive", "--kt-basis", "skewed"], "--kt-basis"),
])
def test_bad_basis_flags_are_one_line_errors(args, fragment, smollm2_checkpoint):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2", *args),
                          fragment)


def test_the_studys_basis_free_variant_is_the_policy_at_the_split_without_the_basis():
    """scripts/studies/cwe_selection_study.py --formats: BasisFree is the loop reference at the split the cache's
    costs give with the basis left out (more components or positions than the policy's, which counts it)."""
    from scripts.studies.cwe_selection_study import BasisFree

    B, n_kv, g, d, S = 1, 2, 3, 64, 900
    cache, _ = principal_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g, d, seed=8)
    costs = StepCosts.of(cache.format, torch.float32, d)
    free = StepCosts(costs.kt, costs.kt_scale)
    r, k_top = adaptive_split(S, d, 1 / 16, None, free)
    assert (r, k_top) != adaptive_split(S, d, 1 / 16, None, costs)
    view = cache.view(S, B)
    expected = sparq_adaptive_reference(q, view.k, view.v, view.v_sum, S,
                                        SparQConfig(r=r, k_top=k_top, local=max(1, k_top // 4)),
                                        spread=cache.kt_spread, k_t=view.k_t, q_step1=cache.step1_query(q))
    torch.testing.assert_close(BasisFree(1 / 16, k_max=64)(q, cache, S), expected, atol=1e-5, rtol=1e-5)
