"""A K^T without position scales (--kt-scale-dtype none, cache.KVCache._write_unscaled_kt): what the cache stores
against the keys quantized directly, the fused CPU kernels against the torch paths on it, the split it buys, and
its refusals."""
from __future__ import annotations

import pytest
import torch

import generate
import kernels
from cache import KVCache, KVFormat, channel_scale
from conftest import assert_one_line_error, run_main
from sparq_adaptive import StepCosts, adaptive_split, key_spread, sparq_adaptive_attention_torch
from sparq import sparq_attention_torch
from test_sparq import random_query


def keys_and_values(B, n_kv, S, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, 1.5, d)[torch.randperm(d, generator=gen)]
    k = torch.randn(B, n_kv, S, d, generator=gen) * scale + torch.randn(1, n_kv, 1, d, generator=gen) * 5
    return k, torch.randn(B, n_kv, S, d, generator=gen)


def unscaled_cache(B, n_kv, d, S, S_max, kt_dtype="int4", dtype=torch.float32, first=None):
    """A cache of S positions written as a prefill of `first` positions (default all) then the rest."""
    cache = KVCache(B, S_max, n_kv, d, dtype, kt_dtype=kt_dtype, kt_scale_dtype="none")
    k, v = keys_and_values(B, n_kv, S, d)
    first = S if first is None else first
    cache.update(torch.arange(first), k[:, :, :first].to(dtype), v[:, :, :first].to(dtype))
    if first < S:
        cache.update(torch.arange(first, S), k[:, :, first:].to(dtype), v[:, :, first:].to(dtype))
    return cache, k


@pytest.mark.parametrize("kt_dtype", ["int4", "int8"])
def test_the_cache_stores_the_centred_keys_in_steps_of_their_first_writes_range(kt_dtype):
    """K^T = round((K - mean) / step) clamped, mean and step (each dimension's absmax / qmax) those of the first
    write; a later, wider key is clamped to that range; K itself is stored as given; no position scales."""
    B, n_kv, d, S, first = 2, 2, 32, 300, 200
    cache, k = unscaled_cache(B, n_kv, d, S, S + 12, kt_dtype, first=first)
    qmax = 7 if kt_dtype == "int4" else 127
    mean = k[:, :, :first].mean(2)
    step = channel_scale(k[:, :, :first] - mean[:, :, None]) / qmax
    torch.testing.assert_close(cache.kt_mean, mean)
    torch.testing.assert_close(cache.chan, step)
    expected = torch.round((k - mean[:, :, None]) / step[:, :, None]).clamp(-qmax, qmax) * step[:, :, None]
    torch.testing.assert_close(cache.read_k_t(slice(0, B), 0, S).transpose(-1, -2), expected)
    assert cache.kt_scale is None and torch.equal(cache.read(slice(0, B), 0, S)[0], k)
    assert StepCosts.of(cache.format, torch.float32, d).kt_scale == 0


def test_a_snapshot_of_the_empty_cache_takes_the_mean_back():
    cache = KVCache(1, 64, 2, 16, torch.float32, kt_dtype="int4", kt_scale_dtype="none")
    empty = cache.snapshot()
    k, v = keys_and_values(1, 2, 40, 16)
    cache.update(torch.arange(40), k, v)
    assert cache.kt_mean.abs().sum() > 0
    cache.restore(empty)
    assert not cache.kt_mean.any() and torch.equal(cache.chan, torch.ones_like(cache.chan))


def test_no_position_scale_buys_components():
    """At 1/16 and 1/32 the bytes a position's scale took go to step 1's components."""
    d, act = 64, torch.bfloat16
    for c in (1 / 16, 1 / 32):
        for S in (4096, 16384):
            scaled, unscaled = (adaptive_split(S, d, c, None, StepCosts.of(KVFormat(kt_dtype="int4", kt_scale_dtype=x),
                                                                            act, d)) for x in ("bfloat16", "none"))
            assert unscaled[0] > scaled[0] and unscaled[1] >= scaled[1], (c, S, scaled, unscaled)


@pytest.mark.usefixtures("fused_cpu_kernels")
@pytest.mark.parametrize("kt_dtype", ["int4", "int8"])
@pytest.mark.parametrize("per_head", [True, False])
def test_the_fused_kernels_read_it_as_the_torch_paths_do(kt_dtype, per_head, threads):
    """Adaptive and fixed SparQ's C++ kernels on a K^T without position scales (ragged rows) are the torch paths
    on its dequantized values."""
    threads(2)
    n_kv, g, d, lengths = 2, 7, 64, [900, 650]
    B, S = len(lengths), max(lengths)
    cache, _ = unscaled_cache(B, n_kv, d, S, S + 32, kt_dtype)
    live = torch.tensor(lengths)
    cache.set_live_lengths(live)
    q = random_query(B, n_kv, g, d, seed=5)
    stored, deq = cache.view(S, B, stored=True), cache.view(S, B)
    assert stored.scales.own_kt_scale is None
    costs = StepCosts.of(cache.format, torch.float32, d)
    spread = key_spread(deq.k_moments[:B], live)
    settings = (S, live, 1 / 16, 128, None, True, per_head)
    fused = kernels.sparq_adaptive_cpu(q, stored.k, stored.k_t, stored.v, stored.v_sum, spread, *settings,
                                       scales=stored.scales, costs=costs)
    reference = sparq_adaptive_attention_torch(q, deq.k, deq.k_t, deq.v, deq.v_sum, spread, *settings, costs=costs)
    torch.testing.assert_close(fused, reference, atol=3e-5, rtol=1e-4)  # fp32 sums in another order
    if per_head:
        fixed = kernels.sparq_attention_cpu(q, stored.k, stored.k_t, stored.v, stored.v_sum, S, live, 12, 96, 24,
                                            True, scales=stored.scales)
        expected = sparq_attention_torch(q, deq.k, deq.k_t, deq.v, deq.v_sum, S, live, 12, 96, 24, True)
        torch.testing.assert_close(fixed, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args,fragment", [
    (["--kt-scale-dtype", "none", "--kv-dtype", "int8", "--kt-dtype", "int4"], "float K"),
    (["--kt-scale-dtype", "none", "--kt-dtype", "same"], "--kt-scale-dtype"),
])
def test_bad_flags_are_one_line_errors(args, fragment, smollm2_checkpoint):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2",
                                   "--attention", "sparq-adaptive", *args), fragment)


def test_a_compiled_decode_write_is_the_eager_one():
    """The decode step's write (one position per row, compiled whole as the decode step is) stores what the eager
    write stores: no host sync, the first write's mean and steps kept."""
    n_kv, d, S = 2, 32, 100
    eager, _ = unscaled_cache(2, n_kv, d, S, S + 28)
    compiled, _ = unscaled_cache(2, n_kv, d, S, S + 28)
    k, v = keys_and_values(2, n_kv, 1, d, seed=9)
    write = torch.compile(compiled.update, fullgraph=True)
    eager.update(torch.tensor([S]), k, v)
    write(torch.tensor([S]), k, v)
    for name in ("k_t", "chan", "kt_mean", "k", "sums", "live_length"):
        assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
