"""Rows that come and go: KVCache.truncate / reset(row) / update(row=...) and the model's truncate_row,
reset_row and prefill into one row. After any sequence of them every row equals a row built directly
to the same state: the cache's K, K^T, V and live length bit for bit, its running sums (V, K, K^2) within fp32
rounding (it is a running sum: subtracting removed positions is not adding the kept ones again), and
on a model, each row's next tokens those of its tokens run alone."""
from __future__ import annotations

import pytest
import torch

from conftest import channels_file
from cache import KVCache, KVFormat
from decoding import prefill
from policies import POLICIES, AttentionSettings, policy_factory
from test_ragged import tiny_model

N_KV, D = 2, 8
SUM_TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # fp32 running sums of O(100) unit-scale values


def kv(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, N_KV, T, D, generator=gen), torch.randn(1, N_KV, T, D, generator=gen)


def direct(contents: list[tuple[torch.Tensor, torch.Tensor]], max_len: int, window=None) -> KVCache:
    """A cache whose row b is written once, from position 0, with contents[b] (k, v (1, n_kv, T, d))."""
    cache = KVCache(len(contents), max_len, N_KV, D, torch.float32, window=window)
    for b, (k, v) in enumerate(contents):
        cache.update(torch.arange(k.shape[2]), k, v, row=b)
    return cache


def assert_rows_equal(cache: KVCache, reference: KVCache) -> None:
    assert torch.equal(cache.live_length, reference.live_length)
    for b, n in enumerate(reference.live_length.tolist()):
        assert torch.equal(cache.k[b, :, :n], reference.k[b, :, :n])
        assert torch.equal(cache.k_t[b, :, :, :n], reference.k_t[b, :, :, :n])
        assert torch.equal(cache.v[b, :, :n], reference.v[b, :, :n])
        torch.testing.assert_close(cache.sums[b], reference.sums[b], **SUM_TOLERANCE)


def test_truncate_reset_and_refill_rows_equal_rows_built_directly():
    cache = KVCache(3, 64, N_KV, D, torch.float32)
    rows = [kv(20, 0), kv(35, 1), kv(9, 2)]  # what each row holds, kept up to date below
    for b, (k, v) in enumerate(rows):
        cache.update(torch.arange(k.shape[2]), k, v, row=b)
    assert_rows_equal(cache, direct(rows, 64))

    # a decode step of every row at its own position (a ragged step)
    step_k, step_v = torch.randn(3, N_KV, 1, D), torch.randn(3, N_KV, 1, D)
    cache.update(torch.tensor([[20], [35], [9]]), step_k, step_v)
    rows = [(torch.cat([k, step_k[b:b + 1]], 2), torch.cat([v, step_v[b:b + 1]], 2)) for b, (k, v) in enumerate(rows)]
    assert_rows_equal(cache, direct(rows, 64))

    cache.truncate(1, 30)  # rejected positions: fewer than the kept ones, subtracted from the V sum
    rows[1] = (rows[1][0][:, :, :30], rows[1][1][:, :, :30])
    cache.reset(2)  # a finished request
    new_k, new_v = kv(17, 3)
    cache.update(torch.arange(17), new_k, new_v, row=2)  # the next request in its row
    rows[2] = (new_k, new_v)
    cache.truncate(0, 21)  # a no-op truncate, then an accepted continuation
    more_k, more_v = kv(5, 4)
    cache.update(torch.arange(21, 26), more_k, more_v, row=0)
    rows[0] = (torch.cat([rows[0][0], more_k], 2), torch.cat([rows[0][1], more_v], 2))
    assert_rows_equal(cache, direct(rows, 64))
    cache.truncate(0, 5)  # more positions removed than kept: the V sum is summed again over the kept ones
    rows[0] = (rows[0][0][:, :, :5], rows[0][1][:, :, :5])
    assert_rows_equal(cache, direct(rows, 64))
    cache.truncate(0, 0)
    assert cache.live_length[0] == 0 and torch.count_nonzero(cache.sums[0]) == 0


def test_truncating_a_window_layer_restores_what_the_window_dropped():
    W = 8
    cache = KVCache(1, 64, N_KV, D, torch.float32, window=W)
    k, v = kv(30, 5)
    cache.update(torch.arange(30), k, v)
    cache.truncate(0, 13)  # the window now ends at 13 again: positions [5, 13), which had slid out
    assert_rows_equal(cache, direct([(k[:, :, :13], v[:, :, :13])], 64, window=W))
    torch.testing.assert_close(cache.v_sum[0], v[0, :, 5:13].sum(1), **SUM_TOLERANCE)
    window_k = k[0, :, 5:13]  # (n_kv, W, d)
    torch.testing.assert_close(cache.k_moments[0], torch.stack([window_k.sum(1), (window_k ** 2).sum(1)], 1),
                               **SUM_TOLERANCE)


def test_row_operations_refuse_what_they_cannot_do():
    window_batch = KVCache(2, 64, N_KV, D, torch.float32, window=8)
    with pytest.raises(ValueError, match="batch of one"):
        window_batch.truncate(0, 0)
    cache = direct([kv(10, 0)], 64)
    with pytest.raises(ValueError, match="holds 10"):
        cache.truncate(0, 11)
    model = tiny_model()
    model.setup_caches(2, 64)
    model.set_decode_attention(policy_factory(AttentionSettings("h2o", kv_budget=8), model.args))
    with pytest.raises(ValueError, match="h2o"):
        model.truncate_row(0, 0)
    with pytest.raises(ValueError, match="h2o"):
        prefill(model, torch.tensor([[1, 2, 3]]), row=1)


def greedy_alone(model, settings, tokens: list[int], n: int) -> list[int]:
    """The next n greedy tokens of `tokens` prefilled alone in a fresh one-row cache."""
    model.setup_caches(1, 128)
    model.set_decode_attention(policy_factory(settings, model.args))
    prefill(model, torch.tensor([tokens[:-1]]))
    return continue_rows(model, [tokens], n)[0]


def continue_rows(model, rows: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per row from caches that hold every token of rows[b] but the last, which each
    step feeds (every row at its own position)."""
    out = [[] for _ in rows]
    last = torch.tensor([[r[-1]] for r in rows])
    pos = torch.tensor([[len(r) - 1] for r in rows])
    for _ in range(n):
        logits = model.decode(last, pos, model.read_length(int(pos.max()) + 1))
        last = logits.argmax(-1, keepdim=True)
        for b in range(len(rows)):
            out[b].append(int(last[b]))
        pos = pos + 1
    return out


# The reference prefills each row's tokens densely, so the positions decoded before the row operations
# must come out as dense's would: SparQ's r = 6, k = 24 move ~0.8 of dense's transfers at these ~40
# positions. sparq-adaptive gives half of any budget to positions (3/4 keeps 14 of 39 here), so the
# dense reference is not its own; test_ragged checks its ragged rows against each row alone. H2O
# refuses row operations.
@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("h2o", "sparq-adaptive")])
def test_model_rows_after_truncate_reset_and_refill_continue_as_alone(policy):
    """Three rows prefilled one by one into their rows, decoded together, then one truncated, one reset
    and refilled with a new prompt, one extended by a prefill into its row: each row's next tokens are
    those of its tokens alone."""
    model = tiny_model()
    entry = POLICIES[policy]
    settings = AttentionSettings(policy, sparq_r=6 if "sparq_r" in entry.flags else None, sparq_k=24,
                                 kv_budget=24 if entry.knob == "kv_budget" else None,
                                 sparq_mean_v="on",  # SparQ and the oracle read the running V sums
                                 channels=channels_file(model.args))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (40, 9, 26)]
    model.setup_caches(3, 128)
    model.set_decode_attention(policy_factory(settings, model.args))
    with torch.no_grad():
        for b, p in enumerate(prompts):
            prefill(model, torch.tensor([p[:-1]]), row=b)  # the last token is fed by the decode steps
        rows = [p + t for p, t in zip(prompts, continue_rows(model, prompts, 6))]  # tokens, last one not in the cache
        # row 0: roll back 10 positions; row 1: a new request; row 2: a prefill into its row continues it
        rows[0] = rows[0][:len(rows[0]) - 10]
        model.truncate_row(0, len(rows[0]) - 1)
        rows[1] = torch.randint(0, 101, (31,), generator=gen).tolist()
        model.reset_row(1)
        prefill(model, torch.tensor([rows[1][:-1]]), row=1)
        extra = torch.randint(0, 101, (7,), generator=gen).tolist()
        prefill(model, torch.tensor([rows[2][-1:] + extra[:-1]]), start=len(rows[2]) - 1, row=2)
        rows[2] += extra
        together = continue_rows(model, rows, 5)
        assert together == [greedy_alone(model, settings, r, 5) for r in rows]


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_chat_keeps_the_prefix_it_shares_and_truncates_the_rest(policy):
    """generate.py --interactive: an edited or dropped turn keeps the cached prefix the new conversation
    shares (H2O, which cannot truncate a row, starts over); the next token's logits equal a fresh prefill's."""
    from chat import reuse_cache

    model = tiny_model()
    settings = AttentionSettings(policy, kv_budget=16 if policy == "h2o" else None)
    gen = torch.Generator().manual_seed(4)
    cached = torch.randint(0, 101, (30,), generator=gen).tolist()
    ids = cached[:20] + [(cached[20] + 1) % 101] + torch.randint(0, 101, (9,), generator=gen).tolist()
    model.setup_caches(1, 64)
    model.set_decode_attention(policy_factory(settings, model.args))
    with torch.no_grad():
        prefill(model, torch.tensor([cached]))
        reuse = reuse_cache(model, cached, ids)
        assert reuse == (20 if policy == "dense" else 0)
        logits = prefill(model, torch.tensor([ids[reuse:]]), start=reuse)
        model.reset_caches()
        torch.testing.assert_close(logits, prefill(model, torch.tensor([ids])), rtol=1e-4, atol=1e-4)
        if policy == "dense":
            assert reuse_cache(model, ids, ids) == len(ids) - 1  # one token left for the logits


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_preserved_caches_leave_every_cache_as_found_even_when_the_block_raises(kv_dtype):
    """Benchmarks time decodes inside model.preserved_caches(): afterwards the next tokens are those of
    the same prefill never followed by the block, and every cache's live lengths and sums are as before."""
    model = tiny_model()
    model.set_decode_attention(policy_factory(AttentionSettings("dense"), model.args))
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (17, 30)]

    def prefilled():
        model.setup_caches(2, 128, KVFormat(kv_dtype=kv_dtype))
        for b, p in enumerate(rows):
            prefill(model, torch.tensor([p[:-1]]), row=b)

    with torch.no_grad():
        prefilled()
        untouched = continue_rows(model, rows, 5)
        prefilled()
        before = [(c.live_length.clone(), c.sums.clone()) for c in model.caches]
        with model.preserved_caches():
            continue_rows(model, rows, 4)
        with pytest.raises(RuntimeError, match="inside"):
            with model.preserved_caches():
                continue_rows(model, [r + [7, 8] for r in rows], 3)
                raise RuntimeError("inside the block")
        for cache, (live, sums) in zip(model.caches, before):
            assert torch.equal(cache.live_length, live) and torch.equal(cache.sums, sums)
        assert continue_rows(model, rows, 5) == untouched


def test_a_prefill_in_pieces_writes_each_position_once():
    """decoding.prefill cuts a prompt at the multiples of its chunk (decoding.chunk_ends: the last piece short)
    and feeds each position once: the running sums are those of the positions stored, whatever the chunk."""
    from cache import position_sums
    from decoding import chunk_ends
    from test_ragged import tiny_model

    assert chunk_ends(0, 90, 16) == [16, 32, 48, 64, 80, 90] and chunk_ends(20, 40, 16) == [32, 40]
    model = tiny_model()
    prompt = torch.randint(0, 101, (1, 90), generator=torch.Generator().manual_seed(1))
    for chunk in (16, 37, 90):
        model.setup_caches(1, 128)
        with torch.no_grad():
            prefill(model, prompt, chunk)
        for cache in model.caches:
            stored = position_sums(cache.k[:1, :, :90], cache.v[:1, :, :90])
            torch.testing.assert_close(cache.sums[:1], stored, rtol=1e-5, atol=1e-4)
            assert int(cache.live_length[0]) == 90
