"""SparQ decode attention: the batched torch path against the paper's algorithm (sparq_reference),
and the reference against exact dense attention where the two must coincide."""
import math

import pytest
import torch

from attention import dense_attention_torch
from cache import KVCache
from sparq import SparQConfig, SparQDecode, sparq_reference


def sparq_torch(q, cache, length, config):
    """The batched torch path, through the policy as the model calls it (no fused kernel), always sparse."""
    return SparQDecode(config, dense_when_short=False)(q, cache, length)


def dense_attention(q, k, v):
    """Exact attention over all of k, v (B, n_kv, S, d)."""
    return dense_attention_torch(q, k, v, k.shape[2])


def filled_cache(B, n_kv, d, S, S_max, layout="twice", dtype=torch.float32, seed=0, garbage=True):
    """A cache with S live positions of random K/V; the unused slots hold NaN garbage."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(B + 1, S_max, n_kv, d, dtype, layout)
    if garbage:  # never-live positions and batch rows must never be read
        for t in (cache.k, cache.v) + ((cache.k_t,) if cache.k_t is not None else ()):
            t.fill_(float("nan"))
    k = torch.randn(B, n_kv, S, d, generator=g).to(dtype)
    v = torch.randn(B, n_kv, S, d, generator=g).to(dtype)
    cache.update(torch.arange(S), k, v)
    return cache, k, v


def random_query(B, n_kv, g_, d, seed=1, dtype=torch.float32):
    return torch.randn(B, n_kv, g_, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = [
    # (B, n_kv, g, d, S, S_max, r, k, mean_v, layout)
    (2, 4, 1, 64, 300, 301, 16, 64, True, "twice"),  # MHA
    (2, 3, 3, 64, 517, 600, 8, 128, False, "twice"),  # SmolLM2-like GQA
    (3, 2, 4, 80, 1000, 1003, 8, 128, True, "once"),
    (1, 2, 8, 128, 257, 300, 32, 64, False, "once"),
    (2, 1, 8, 128, 100, 130, 1, 128, True, "twice"),  # S < k: everything selected
    (2, 3, 3, 80, 7, 9, 80, 128, False, "twice"),
]


@pytest.mark.parametrize("B,n_kv,g_,d,S,S_max,r,k,mean_v,layout", CASES)
def test_torch_path_matches_reference(B, n_kv, g_, d, S, S_max, r, k, mean_v, layout):
    cache, _, _ = filled_cache(B, n_kv, d, S, S_max, layout)
    q = random_query(B, n_kv, g_, d)
    config = SparQConfig(r=r, k_top=k, mean_v=mean_v)
    expected = sparq_reference(q, cache.k, cache.v, cache.v_sum, S, config)
    actual = sparq_torch(q, cache, S, config)
    assert actual.shape == (B, n_kv, g_, d)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_bf16_torch_path_matches_reference():
    cache, _, _ = filled_cache(2, 3, 64, 700, 800, dtype=torch.bfloat16)
    q = random_query(2, 3, 3, 64, dtype=torch.bfloat16)
    config = SparQConfig(r=16, k_top=64, mean_v=True)
    expected = sparq_reference(q, cache.k, cache.v, cache.v_sum, 700, config)
    actual = sparq_torch(q, cache, 700, config)
    # Both compute in fp32 from the same bf16 values; the output is rounded to bf16 (8 bits of mantissa).
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["twice", "once"])
@pytest.mark.parametrize("g_", [1, 3])
def test_full_r_and_k_equal_dense(layout, g_):
    """r = d and k >= S: SparQ attends over everything with exact scores, i.e. it is dense attention."""
    B, n_kv, d, S = 2, 3, 64, 200
    cache, k, v = filled_cache(B, n_kv, d, S, 256, layout)
    q = random_query(B, n_kv, g_, d)
    dense = dense_attention(q, k, v)
    for mean_v in (False, True):  # alpha = 1 when every position is selected
        config = SparQConfig(r=d, k_top=256, local=0, mean_v=mean_v)
        torch.testing.assert_close(sparq_torch(q, cache, S, config), dense, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(sparq_reference(q, cache.k, cache.v, cache.v_sum, S, config), dense,
                                   atol=2e-6, rtol=1e-5)


def test_sparse_attention_differs_from_dense_when_k_is_small():
    """Guard against a test that cannot fail: with k << S the output is not dense attention."""
    cache, k, v = filled_cache(1, 2, 64, 500, 500)
    q = random_query(1, 2, 2, 64) * 3
    sparse = sparq_torch(q, cache, 500, SparQConfig(r=8, k_top=16))
    assert (sparse - dense_attention(q, k, v)).abs().max() > 1e-3


def test_local_window_is_always_selected():
    """Positions in the local window are attended even when their keys score worst."""
    B, n_kv, d, S, local = 1, 1, 16, 64, 4
    cache, k, v = filled_cache(B, n_kv, d, S, S, garbage=False)
    q = torch.ones(B, n_kv, 1, d)
    cache.k[:, :, S - local:] = -10.0  # the recent keys get the lowest scores
    cache.k_t[:, :, :, S - local:] = -10.0
    config = SparQConfig(r=d, k_top=8, local=local)
    out = sparq_reference(q, cache.k, cache.v, cache.v_sum, S, config)
    expected_positions = list(range(S - local, S)) + torch.topk(
        (q[0, 0, 0] @ cache.k[0, 0, : S - local].T), 8 - local).indices.tolist()
    idx = torch.tensor(expected_positions)
    keys, values = cache.k[0, 0, idx], cache.v[0, 0, idx]
    manual = torch.softmax(q[0, 0] @ keys.T / math.sqrt(d), -1) @ values
    torch.testing.assert_close(out[0, 0], manual)
    torch.testing.assert_close(sparq_torch(q, cache, S, config), out)


def test_running_v_sum_tracks_live_positions():
    B, n_kv, d, S_max = 2, 3, 8, 32
    cache = KVCache(B, S_max, n_kv, d, torch.bfloat16)
    prefill_v = torch.randn(B, n_kv, 10, d).bfloat16()
    cache.update(torch.arange(10), torch.randn(B, n_kv, 10, d).bfloat16(), prefill_v)
    torch.testing.assert_close(cache.v_sum, cache.v[:, :, :10].float().sum(2))
    for pos in range(10, 20):
        cache.update(torch.tensor([pos]), torch.randn(B, n_kv, 1, d).bfloat16(), torch.randn(B, n_kv, 1, d).bfloat16())
        torch.testing.assert_close(cache.v_sum, cache.v[:, :, : pos + 1].float().sum(2))
        assert cache.live_length.tolist() == [pos + 1] * B
    assert cache.v[:, :, 20:].abs().sum() == 0
    cache.reset()
    assert cache.v_sum.abs().sum() == 0


def test_config_validation_messages():
    with pytest.raises(ValueError, match="--sparq-r"):
        SparQConfig(r=0).validate(64)
    with pytest.raises(ValueError, match="--sparq-r"):
        SparQConfig(r=65).validate(64)
    with pytest.raises(ValueError, match="--sparq-k"):
        SparQConfig(r=8, k_top=0).validate(64)
    with pytest.raises(ValueError, match="--sparq-local"):
        SparQConfig(r=8, k_top=16, local=17).validate(64)
    assert SparQConfig(r=8, k_top=128).local == 32


def test_transfer_accounting_matches_paper_formulas():
    from attention import DenseDecode
    from model import ModelArgs, Transformer

    args = ModelArgs(vocab_size=10, dim=576, n_layer=30, n_head=9, n_kv_head=3, head_dim=64, intermediate_size=10)
    S, B = 8192, 4
    sparq = SparQDecode(SparQConfig(r=16, k_top=128))
    assert sparq.transfer_elements(S, 64) == S * 16 + 2 * 128 * 64 + 4 * 64
    assert DenseDecode().transfer_elements(S, 64) == 2 * S * 64 + 2 * 64
    assert SparQDecode(SparQConfig(r=16, k_top=128), dense_when_short=False).transfer_elements(50, 64) == \
        50 * 16 + 2 * 50 * 64 + 4 * 64  # k capped at the live length
    assert sparq.transfer_elements(128, 64) == DenseDecode().transfer_elements(128, 64)  # S <= k: the dense path
    with torch.device("meta"):
        model = Transformer(args).to(torch.bfloat16)
        model.setup_caches(B, S + 1)
    model.set_decode_attention(lambda layer: sparq)
    assert model.decode_kv_bytes(S, B) == (S * 16 + 2 * 128 * 64 + 4 * 64) * 3 * 30 * B * 2
    model.set_decode_attention(lambda layer: DenseDecode())
    assert model.decode_kv_bytes(S, B) == (2 * S * 64 + 2 * 64) * 3 * 30 * B * 2


def test_compiled_sparq_equals_eager():
    B, n_kv, g_, d = 2, 3, 3, 64
    cache, _, _ = filled_cache(B, n_kv, d, 400, 512, garbage=False)
    config = SparQConfig(r=16, k_top=64, mean_v=True)
    policy = SparQDecode(config)
    compiled = torch.compile(policy, fullgraph=True, dynamic=True)
    for S in (300, 301, 400):
        q = random_query(B, n_kv, g_, d, seed=S)
        torch.testing.assert_close(compiled(q, cache, S), policy(q, cache, S), atol=1e-5, rtol=1e-5)


def test_bucketed_lengths_equal_exact_lengths():
    """Reading past the live length (CUDA-graph buckets) with masking gives the exact-length result."""
    from attention import DenseDecode

    B, n_kv, g_, d, S, bucket = 2, 3, 3, 64, 300, 128
    exact, _, _ = filled_cache(B, n_kv, d, S, 512, garbage=False)
    bucketed = KVCache(B + 1, 512, n_kv, d, torch.float32, length_bucket=bucket)
    for name in ("k", "k_t", "v", "sums"):
        getattr(bucketed, name).copy_(getattr(exact, name))
    for cache in (exact, bucketed):  # finite garbage beyond the live length (NaN would poison 0 * v)
        cache.k[:, :, S:] = 100.0
        cache.k_t[:, :, :, S:] = 100.0
        cache.v[:, :, S:] = 1e4
    bucketed.live_length.fill_(S)
    read = 384  # S rounded up to the bucket
    q = random_query(B, n_kv, g_, d)
    torch.testing.assert_close(DenseDecode()(q, bucketed, read), DenseDecode()(q, exact, S))
    for config in (SparQConfig(r=16, k_top=64, mean_v=True), SparQConfig(r=8, k_top=512, local=0)):
        torch.testing.assert_close(sparq_torch(q, bucketed, read, config),
                                   sparq_torch(q, exact, S, config), atol=1e-5, rtol=1e-5)


def test_cache_snapshot_restore_and_rewind():
    """snapshot/restore and rewind bring back exactly the state after the first S positions."""
    B, n_kv, d = 2, 3, 8
    cache, _, _ = filled_cache(B, n_kv, d, 10, 32, garbage=False)
    saved, v_sum = cache.snapshot(), cache.v_sum.clone()
    for pos in range(10, 14):
        cache.update(torch.tensor([pos]), torch.randn(B, n_kv, 1, d), torch.randn(B, n_kv, 1, d))
    assert cache.live_length[:B].tolist() == [14] * B and not torch.equal(cache.v_sum, v_sum)
    cache.restore(saved)
    assert cache.live_length[:B].tolist() == [10] * B and torch.equal(cache.v_sum, v_sum)
    cache.rewind(12)
    assert cache.live_length[:B].tolist() == [12] * B
    torch.testing.assert_close(cache.v_sum, cache.v[:, :, :12].float().sum(2))


def test_cache_broadcast_row_and_read_length():
    cache, _, _ = filled_cache(2, 3, 8, 10, 32, garbage=False)  # 3 rows: the last one never written
    cache.broadcast_row(3)
    for name in ("k", "k_t", "v", "sums"):
        buffer = getattr(cache, name)
        assert torch.equal(buffer[2], buffer[0]) and torch.equal(buffer[1], buffer[0])
    assert cache.read_length(10) == 10 and cache.view(10, 3).live_length is None
    bucketed = KVCache(1, 300, 1, 8, torch.float32, length_bucket=128)
    assert [bucketed.read_length(n) for n in (1, 128, 129, 290)] == [128, 128, 256, 300]
    view = bucketed.view(128, 1).live_length
    assert view.dim() == 0 and view.data_ptr() == bucketed.live_length.data_ptr()


def test_window_cache_views_and_running_sum():
    """A sliding-window cache shows a decode step only its last `window` positions, and its running
    V sum covers exactly those, through prefill chunks, decode steps, snapshots and rewinds."""
    B, n_kv, d, W = 2, 3, 8, 5
    cache = KVCache(B, 40, n_kv, d, torch.float32, window=W)
    gen = torch.Generator().manual_seed(3)
    cache.update(torch.arange(7), torch.randn(B, n_kv, 7, d, generator=gen), torch.randn(B, n_kv, 7, d, generator=gen))
    torch.testing.assert_close(cache.v_sum, cache.v[:, :, 2:7].sum(2))
    for pos in range(7, 12):
        cache.update(torch.tensor([pos]), torch.randn(B, n_kv, 1, d, generator=gen),
                     torch.randn(B, n_kv, 1, d, generator=gen))
        view = cache.view(pos + 1, B)
        assert view.start == pos + 1 - W and view.length == W
        assert torch.equal(view.k[:, :, :W], cache.k[:, :, pos + 1 - W:pos + 1])
        assert torch.equal(view.k_t[:, :, :, :W], cache.k_t[:, :, :, pos + 1 - W:pos + 1])
        torch.testing.assert_close(view.v_sum, cache.v[:, :, pos + 1 - W:pos + 1].sum(2))
        keys = cache.k[:, :, pos + 1 - W:pos + 1]
        torch.testing.assert_close(view.k_moments, torch.stack([keys.sum(2), (keys ** 2).sum(2)], 2))
    cache.rewind(9)
    torch.testing.assert_close(cache.v_sum, cache.v[:, :, 4:9].sum(2))
    keys = cache.k[:, :, 4:9]
    torch.testing.assert_close(cache.k_moments, torch.stack([keys.sum(2), (keys ** 2).sum(2)], 2))
    short = KVCache(1, 8, 1, d, torch.float32, window=W)
    short.update(torch.arange(3), torch.randn(1, 1, 3, d), torch.randn(1, 1, 3, d))
    assert short.view(3, 1).start == 0 and short.visible_length(3) == 3
    with pytest.raises(ValueError, match="exact lengths"):
        KVCache(1, 8, 1, d, torch.float32, length_bucket=4, window=W)


def test_window_policies_attend_exactly_their_window():
    """Dense and SparQ (r = d, k >= W) on a window cache equal dense attention over the last W positions."""
    from attention import DenseDecode

    B, n_kv, g_, d, S, W = 2, 2, 3, 16, 50, 12
    cache = KVCache(B, 64, n_kv, d, torch.float32, window=W)
    gen = torch.Generator().manual_seed(8)
    k, v = torch.randn(B, n_kv, S, d, generator=gen), torch.randn(B, n_kv, S, d, generator=gen)
    cache.update(torch.arange(S), k, v)
    q = random_query(B, n_kv, g_, d)
    expected = dense_attention(q, k[:, :, S - W:], v[:, :, S - W:])
    torch.testing.assert_close(DenseDecode()(q, cache, S), expected, atol=2e-6, rtol=1e-5)
    for mean_v in (False, True):
        full = SparQDecode(SparQConfig(r=d, k_top=64, local=0, mean_v=mean_v), dense_when_short=False)(q, cache, S)
        torch.testing.assert_close(full, expected, atol=2e-6, rtol=1e-5)


def test_per_row_live_lengths_equal_each_row_run_alone():
    """A (B,) live length (ragged batches): every row of dense and SparQ attention equals that row
    computed alone at its own exact length."""
    from attention import dense_attention_torch
    from sparq import sparq_attention_torch

    B, n_kv, g_, d, S_max = 3, 2, 3, 32, 300
    lengths = [40, 300, 171]
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(B, n_kv, S_max, d, generator=gen), torch.randn(B, n_kv, S_max, d, generator=gen)
    k_t = k.transpose(2, 3).contiguous()
    v_sum = torch.stack([v[b, :, :n].sum(1) for b, n in enumerate(lengths)])
    q = random_query(B, n_kv, g_, d)
    live = torch.tensor(lengths)
    dense = dense_attention_torch(q, k, v, S_max, live)
    sparq = sparq_attention_torch(q, k, k_t, v, v_sum, S_max, live, 8, 32, 8, True)
    for b, n in enumerate(lengths):
        alone = dense_attention_torch(q[b:b + 1], k[b:b + 1], v[b:b + 1], n)
        torch.testing.assert_close(dense[b:b + 1], alone, atol=2e-6, rtol=1e-5)
        alone = sparq_attention_torch(q[b:b + 1], k[b:b + 1], k_t[b:b + 1], v[b:b + 1], v_sum[b:b + 1], n, None,
                                      8, 32, 8, True)
        torch.testing.assert_close(sparq[b:b + 1], alone, atol=2e-6, rtol=1e-5)


def test_short_contexts_take_the_dense_path_with_the_same_result():
    """S <= k: SparQ would select every position; the policy runs dense attention instead (same
    output, fewer transfers), and switches to the sparse path once S exceeds k."""
    from attention import DenseDecode

    B, n_kv, g_, d = 2, 3, 3, 64
    cache, _, _ = filled_cache(B, n_kv, d, 200, 256, garbage=False)
    q = random_query(B, n_kv, g_, d)
    config = SparQConfig(r=8, k_top=128, mean_v=True)
    short, forced = SparQDecode(config), SparQDecode(config, dense_when_short=False)
    torch.testing.assert_close(short(q, cache, 100), DenseDecode()(q, cache, 100))
    torch.testing.assert_close(short(q, cache, 100), forced(q, cache, 100), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short(q, cache, 200), forced(q, cache, 200))  # S > k: sparse, identical
    assert short.transfer_elements(100, d) == DenseDecode().transfer_elements(100, d) < \
        forced.transfer_elements(100, d)
