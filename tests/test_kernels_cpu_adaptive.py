"""The fused CPU kernel of adaptive SparQ (csrc/sparq_adaptive.cpp, kernels.sparq_adaptive_cpu) against
its reference, sparq_adaptive.sparq_adaptive_attention_torch (the loop reference sparq_adaptive_reference at each
row's split: tests/test_sparq_adaptive.py checks that pair), on random caches whose key dimensions are
scaled 1 to 30x apart so the keys' spread changes which components step 1 reads.

Tolerances as tests/test_kernels_cpu.py's: fp32 1e-5; a bf16 cache with an fp32 query 1e-4 (the kernel
and the reference sum the bf16 values in different orders); ties are improbable on this data."""
from __future__ import annotations

import pytest
import torch

import kernels
from cache import KVCache
from sparq_adaptive import SparQAdaptiveDecode, StepCosts, key_spread, sparq_adaptive_attention_torch
from test_kernels_cpu import INVARIANT_LENGTHS, stored_row
from test_sparq import random_query

pytestmark = pytest.mark.usefixtures("fused_cpu_kernels")


def scaled_cache(lengths: list[int], n_kv: int, d: int, S_max: int, layout: str = "twice",
                 dtype: torch.dtype = torch.float32, seed: int = 0, kv_dtype: str = "auto",
                 kt_dtype: str = "same") -> KVCache:
    """Row b holds lengths[b] positions of random K (dimensions scaled 1-30x apart, per head) and V;
    NaN beyond them and in the spare last row, which must never be read (where stored as floats)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    cache = KVCache(B + 1, S_max, n_kv, d, dtype, layout, kv_dtype=kv_dtype, kt_dtype=kt_dtype)
    for t in (cache.k, cache.v) + ((cache.k_t,) if cache.k_t is not None else ()):
        if t.is_floating_point():
            t.fill_(float("nan"))
    scale = torch.logspace(0, 1.5, d)[torch.stack([torch.randperm(d, generator=gen) for _ in range(n_kv)])]
    for b, n in enumerate(lengths):
        k = torch.randn(1, n_kv, n, d, generator=gen) * scale[None, :, None, :]
        cache.update(torch.arange(n), k.to(dtype), torch.randn(1, n_kv, n, d, generator=gen).to(dtype), row=b)
    return cache


def both(q, cache, lengths, compression, k_max, mean_v, k_cap=None, per_head=True):
    """The fused kernel's and the reference's outputs on the cache's first len(lengths) rows."""
    B, length = len(lengths), max(lengths)
    live = None if len(set(lengths)) == 1 else torch.tensor(lengths)
    spread = key_spread(cache.k_moments[:B], length if live is None else live)
    args = (q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, length, live, compression, k_max, k_cap, mean_v,
            per_head)
    return kernels.sparq_adaptive_cpu(*args), sparq_adaptive_attention_torch(*args)


@pytest.mark.parametrize("per_head", [True, False])
def test_a_budget_too_small_for_a_position_per_head_still_attends_to_the_last(per_head):
    """k = 1 (shared by 3 KV heads where pooled): each head still keeps its last position (local is at
    least 1), so no head is left to a softmax over nothing (NaN); with nothing else to choose, each head's
    output is its last position's V."""
    S, n_kv = 300, 3
    cache = scaled_cache([S], n_kv, 16, S + 4)
    q = random_query(1, n_kv, 2, 16, seed=3)
    fused, reference = both(q, cache, [S], 0.01, 8, False, per_head=per_head)
    last_v = cache.v[:1, :, S - 1:S].expand(1, n_kv, 2, 16)
    torch.testing.assert_close(reference, last_v)
    torch.testing.assert_close(fused, reference)


@pytest.mark.parametrize("B,n_kv,g,d,S,compression,mean_v,layout,n_threads", [
    (1, 3, 3, 64, 1400, 1 / 8, False, "twice", 2),  # SmolLM2 at SQuAD's length
    (1, 3, 3, 64, 2400, 1 / 8, True, "twice", 2),  # 3 heads on 2 threads: each S split into 2 chunks
    (1, 1, 4, 256, 4000, 1 / 4, True, "twice", 2),  # a Gemma 3 global layer, chunked
    (2, 3, 3, 64, 3000, 1 / 16, True, "twice", 2),
    (1, 2, 7, 64, 2500, 1 / 8, True, "once", 2),  # Qwen 0.5B's grouping, no K^T
    (2, 1, 4, 256, 700, 1 / 4, False, "twice", 1),  # Gemma 3: one KV head, d = 256
    (3, 4, 1, 32, 300, 1 / 2, True, "twice", 2),  # MHA
    (1, 2, 2, 48, 200, 1 / 8, False, "once", 1),  # d not a multiple of 16
])
@pytest.mark.parametrize("per_head", [True, False])
def test_matches_reference(B, n_kv, g, d, S, compression, mean_v, layout, n_threads, per_head, threads):
    threads(n_threads)
    cache = scaled_cache([S] * B, n_kv, d, S + 7, layout)
    q = random_query(B, n_kv, g, d, seed=S)
    fused, reference = both(q, cache, [S] * B, compression, 128, mean_v, per_head=per_head)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_each_head_its_own_selection_is_each_head_run_alone(n_threads, threads):
    """per_head (the default): a row's KV heads select independently, so each head's output is the kernel
    run on that head alone (bit for bit), and pooling them (per_head=False) gives another output; with one
    KV head the two are the same selection."""
    threads(n_threads)
    S, n_kv = 2000, 3
    cache = scaled_cache([S], n_kv, 64, S)
    q = random_query(1, n_kv, 3, 64, seed=8)
    spread = key_spread(cache.k_moments[:1], S)
    settings = (1 / 8, 128, None, False)  # compression, k_max, k_cap, mean_v
    each = kernels.sparq_adaptive_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, S, None, *settings, True)
    pooled = kernels.sparq_adaptive_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, S, None, *settings,
                                        False)
    for h in range(n_kv):
        one = slice(h, h + 1)
        alone = [kernels.sparq_adaptive_cpu(q[:, one], cache.k[:, one], cache.k_t[:, one], cache.v[:, one],
                                            cache.v_sum[:, one], spread[:, one], S, None, *settings, per_head)
                 for per_head in (True, False)]
        assert torch.equal(each[:, one], alone[0]) and torch.equal(alone[0], alone[1])
    assert (each - pooled).abs().max() > 1e-3


@pytest.mark.parametrize("n_threads", [1, 2])
def test_ragged_rows_each_at_its_own_split(n_threads, threads):
    """Rows of different lengths, two short enough (<= k_max) to take every position and component, one
    of them a single position (its keys' spread is 0: the floor keeps its scores finite)."""
    threads(n_threads)
    lengths = [90, 2100, 700, 1]
    cache = scaled_cache(lengths, 2, 64, 2200)
    q = random_query(4, 2, 3, 64, seed=4)
    fused, reference = both(q, cache, lengths, 1 / 8, 128, True)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[3], cache.v[3, :, :1].expand(2, 3, 64))  # one position: its V
    for b, n in enumerate(lengths):  # and each row alone
        alone = kernels.sparq_adaptive_cpu(q[b:b + 1], cache.k[b:b + 1], cache.k_t[b:b + 1], cache.v[b:b + 1],
                                           cache.v_sum[b:b + 1], key_spread(cache.k_moments[b:b + 1], n), n, None,
                                           1 / 8, 128, None, True, True)
        torch.testing.assert_close(fused[b:b + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", INVARIANT_LENGTHS)
@pytest.mark.parametrize("kv_dtype,kt_dtype,per_head", [("auto", "same", True), ("int8", "int4", True),
                                                        ("int8", "int4", False)])
def test_rows_are_each_row_alone_bit_for_bit(lengths, kv_dtype, kt_dtype, per_head, threads):
    """Batch invariance (tests/test_kernels_cpu.py, INVARIANT_LENGTHS: rows the former whole-batch chunk
    length split otherwise than alone): on a ragged batch, float or quantized cache, mean-V, each row is
    its B = 1 call at its own length bit for bit."""
    threads(2)
    n_kv, g, d, S = 3, 3, 64, max(lengths)
    cache = scaled_cache(list(lengths), n_kv, d, -(-S // 32) * 32 + 32, kv_dtype=kv_dtype, kt_dtype=kt_dtype)
    view, live = cache.view(S, len(lengths), stored=True), torch.tensor(lengths)
    costs = StepCosts.of(cache.format, torch.float32, d)
    spread = key_spread(view.k_moments[:len(lengths)], live)
    q = random_query(len(lengths), n_kv, g, d, seed=6)
    settings = (1 / 8, 128, None, True, per_head)  # compression, k_max, k_cap, mean_v, per_head
    out = kernels.sparq_adaptive_cpu(q, view.k, view.k_t, view.v, view.v_sum, spread, S, live, *settings,
                                     scales=view.scales, costs=costs)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        k, k_t, v, v_sum, scales = stored_row(view, b)
        alone = kernels.sparq_adaptive_cpu(q[b:b + 1], k, k_t, v, v_sum, spread[b:b + 1], n, None, *settings,
                                           scales=scales, costs=costs)
        assert torch.equal(out[b:b + 1], alone), (b, n)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_cap_on_k_binds_in_the_kernel_as_in_the_reference(n_threads, threads):
    """At 1/4 and 3000 positions the budget's share gives k ~ 375: a cap of 64 must change the output
    (the cap reaches the kernel) and match the reference at the same cap (the cap and k_max are apart:
    a row of 100 positions, above the cap but within k_max, stays dense)."""
    threads(n_threads)
    lengths = [3000, 100]
    cache = scaled_cache(lengths, 2, 64, 3000)
    q = random_query(2, 2, 3, 64, seed=5)
    capped, reference = both(q, cache, lengths, 1 / 4, 128, False, k_cap=64)
    torch.testing.assert_close(capped, reference, atol=1e-5, rtol=1e-5)
    uncapped, _ = both(q, cache, lengths, 1 / 4, 128, False)
    assert (capped[0] - uncapped[0]).abs().max() > 1e-3
    torch.testing.assert_close(capped[1], uncapped[1])  # dense either way


def test_bf16_cache(threads):
    threads(2)
    cache = scaled_cache([1800, 1800], 3, 64, 1800, dtype=torch.bfloat16)
    q = random_query(2, 3, 3, 64, seed=9)
    fused, reference = both(q, cache, [1800, 1800], 1 / 4, 128, False)
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


def test_the_policy_on_the_fused_kernel_and_compiled():
    """SparQAdaptiveDecode with the CPU kernels equals it on the torch path, eager and compiled (fullgraph:
    the split is made inside the kernel, nothing reaches the host)."""
    cache = scaled_cache([1000, 1000], 3, 64, 1100)
    fused = SparQAdaptiveDecode(1 / 8, kernels=kernels.CPU_KERNELS)
    reference = SparQAdaptiveDecode(1 / 8)
    q = random_query(2, 3, 3, 64, seed=2)
    torch.testing.assert_close(fused(q, cache, 1000), reference(q, cache, 1000), atol=1e-5, rtol=1e-5)
    compiled = torch.compile(fused, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, cache, 1000), reference(q, cache, 1000), atol=1e-5, rtol=1e-5)


def test_opcheck():
    cache = scaled_cache([400, 400], 2, 32, 420)
    q = random_query(2, 2, 2, 32)
    spread = key_spread(cache.k_moments[:2], 400)
    torch.library.opcheck(torch.ops.sparq.adaptive_cpu.default,
                          (q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, 400, 0.125, 64, 40, True, True, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_rejects_bad_arguments():
    cache = scaled_cache([100], 2, 32, 120)
    q = random_query(1, 2, 2, 32)
    spread = key_spread(cache.k_moments[:1], 100)
    with pytest.raises(RuntimeError, match="compression"):
        kernels.sparq_adaptive_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, 100, None, 0.0, 64, None, False)
    with pytest.raises(RuntimeError, match="k_cap"):
        kernels.sparq_adaptive_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, spread, 100, None, 0.5, 64, 0, False)
    with pytest.raises(RuntimeError, match="spread"):
        kernels.sparq_adaptive_cpu(q, cache.k, cache.k_t, cache.v, cache.v_sum, spread.double(), 100, None, 0.5, 64,
                                   None, False)
