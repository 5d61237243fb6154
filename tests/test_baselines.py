"""The paper's baselines and Quest as decode policies: hand-checked selections, loop references and
dense equivalence."""
import math

import torch

from conftest import channels_file
from attention import dense_attention_torch
from cache import KVCache
from baselines import H2ODecode, LocalDecode, OracleDecode, QuestDecode, TopKDecode
from budgets import compression_ratio
from sparq import SparQConfig


def dense_attention(q, k, v):
    """Exact attention over all of k, v (B, n_kv, S, d)."""
    return dense_attention_torch(q, k, v, k.shape[2])


def cache_with(k, v, S_max=None):
    B, n_kv, S, d = k.shape
    cache = KVCache(B, S_max or S, n_kv, d, k.dtype)
    cache.update(torch.arange(S), k, v)
    return cache


def test_oracle_and_topk_with_full_budget_equal_dense():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 90, 32), torch.randn(2, 3, 90, 32)
    q = torch.randn(2, 3, 3, 32)
    cache = cache_with(k, v, 100)
    dense = dense_attention(q, k, v)
    for mean_v in (False, True):
        out = OracleDecode(SparQConfig(r=32, k_top=128, mean_v=mean_v))(q, cache, 90)
        torch.testing.assert_close(out, dense, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(TopKDecode(128)(q, cache, 90), dense, atol=2e-6, rtol=1e-5)


def test_topk_attends_the_exact_best_positions():
    d = 4
    k = torch.zeros(1, 1, 10, d)
    k[0, 0, [2, 7], 0] = 5.0  # the two keys that match q
    v = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 1, 10, d).contiguous()
    q = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, d)
    out = TopKDecode(2)(q, cache_with(k, v), 10)
    torch.testing.assert_close(out[0, 0, 0], torch.full((d,), 4.5))  # equal weight on values 2 and 7


def test_local_keeps_exactly_the_sinks_and_the_window():
    policy = LocalDecode(k=20, sinks=16)
    assert policy.positions(100, torch.device("cpu")).tolist() == list(range(16)) + [96, 97, 98, 99]
    assert policy.positions(12, torch.device("cpu")).tolist() == list(range(12))
    # Attending: only those positions contribute.
    d = 2
    v = torch.arange(100.0).view(1, 1, 100, 1).expand(1, 1, 100, d).contiguous()
    out = policy(torch.zeros(1, 1, 1, d), cache_with(torch.zeros(1, 1, 100, d), v), 100)  # uniform weights
    expected = (sum(range(16)) + 96 + 97 + 98 + 99) / 20
    torch.testing.assert_close(out[0, 0, 0], torch.full((d,), expected))


def test_h2o_eviction_order_by_hand():
    """k = 3, one recent slot. Prefill of 4 tokens with hand-made scores, then two decode steps."""
    d = 2
    policy = H2ODecode(k=3, local=1)
    # Prefill: make key 0 and key 2 receive most attention. Keys are 1-d 'strength' along dim 0.
    strengths = torch.tensor([4.0, 0.0, 3.0, 0.0, 0.0, 0.0])
    k = torch.zeros(1, 1, 6, d)
    k[0, 0, :, 0] = strengths
    v = torch.randn(1, 1, 6, d)
    q_prefill = torch.zeros(1, 1, 4, d)
    q_prefill[..., 0] = 1.0
    cache = cache_with(k, v, 6)
    policy.observe_prefill(q_prefill, k[:, :, :4])
    # Received attention: query i attends causally over keys 0..i with logits strengths/sqrt(2).
    received = torch.zeros(4)
    for i in range(4):
        received[: i + 1] += torch.softmax(strengths[: i + 1] / math.sqrt(d), 0)
    # Keep: recent position 3, then the two heaviest of 0..2, i.e. 0 and 2 (1 is evicted).
    assert sorted(policy.kept[0, 0].tolist()) == [0, 2, 3]
    assert received[1] < received[2] < received[0]

    # Decode position 4: candidates 0, 2, 3, 4; 4 is recent; position 3 has lost its recency and has the
    # lowest cumulative score, so it is evicted.
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 1.0
    out = policy(q, cache, 5)
    assert sorted(policy.kept[0, 0].tolist()) == [0, 2, 4]
    candidates = [0, 2, 3, 4]
    probs = torch.softmax(strengths[candidates] / math.sqrt(d), 0)
    torch.testing.assert_close(out[0, 0, 0], probs @ v[0, 0, candidates])

    # Decode position 5: an evicted position never returns even though 1 and 3 are in the cache.
    policy(q, cache, 6)
    assert 1 not in policy.kept[0, 0].tolist() and 3 not in policy.kept[0, 0].tolist()
    assert sorted(policy.kept[0, 0].tolist()) == [0, 2, 5]


def test_h2o_with_full_budget_equals_dense_over_steps():
    torch.manual_seed(1)
    B, n_kv, g, d, T, steps = 2, 2, 3, 16, 20, 5
    k, v = torch.randn(B, n_kv, T + steps, d), torch.randn(B, n_kv, T + steps, d)
    cache = cache_with(k, v)
    policy = H2ODecode(k=64)
    policy.observe_prefill(torch.randn(B, n_kv * g, T, d), k[:, :, :T])
    for length in range(T + 1, T + steps + 1):
        q = torch.randn(B, n_kv, g, d)
        torch.testing.assert_close(policy(q, cache, length), dense_attention(q, k[:, :, :length], v[:, :, :length]),
                                   atol=2e-6, rtol=1e-5)


def window_cache_with(k, v, window):
    B, n_kv, S, d = k.shape
    cache = KVCache(B, S, n_kv, d, k.dtype, window=window)
    cache.update(torch.arange(S), k, v)
    return cache


def test_h2o_on_a_window_layer_with_the_whole_window_equals_dense_windowed_attention():
    """A budget of the whole window keeps every visible position: exact windowed attention, step after step."""
    torch.manual_seed(2)
    B, n_kv, g, d, T, steps, W = 2, 2, 3, 16, 40, 6, 12
    k, v = torch.randn(B, n_kv, T + steps, d), torch.randn(B, n_kv, T + steps, d)
    cache = window_cache_with(k, v, W)
    policy = H2ODecode(k=W)
    policy.observe_prefill(torch.randn(B, n_kv * g, T, d), k[:, :, :T], window=W)
    for length in range(T + 1, T + steps + 1):
        q = torch.randn(B, n_kv, g, d)
        expected = dense_attention(q, k[:, :, length - W:length], v[:, :, length - W:length])
        torch.testing.assert_close(policy(q, cache, length), expected, atol=2e-6, rtol=1e-5)


def test_h2o_on_a_window_layer_never_keeps_a_position_that_left_the_window():
    """A small budget on a window layer: after the prefill and every step, each kept position is inside
    the window the next step sees, and each step's output is attention over exactly its kept positions
    and the current one."""
    torch.manual_seed(4)
    B, n_kv, g, d, T, steps, W, budget = 1, 2, 2, 8, 30, 12, 10, 6
    k, v = 3 * torch.randn(B, n_kv, T + steps, d), torch.randn(B, n_kv, T + steps, d)
    cache = window_cache_with(k, v, W)
    policy = H2ODecode(k=budget, local=2)
    policy.observe_prefill(torch.randn(B, n_kv * g, T, d), k[:, :, :T], window=W)
    assert ((policy.kept >= T - W) & (policy.kept < T)).all()  # the prefill's last query sees [T - W, T)
    for length in range(T + 1, T + steps + 1):
        kept = policy.kept.clone()
        q = torch.randn(B, n_kv, g, d)
        out = policy(q, cache, length)
        for h in range(n_kv):
            seen = [p for p in kept[0, h].tolist() if p >= length - W] + [length - 1]
            torch.testing.assert_close(out[0, h], dense_attention(q[:, h:h + 1], k[:, h:h + 1, seen],
                                                                  v[:, h:h + 1, seen])[0, 0], atol=2e-6, rtol=1e-5)
        live = policy.kept[policy.kept >= 0]
        assert (live >= length + 1 - W).all() or (live >= length - W).all()
        assert len(set(policy.kept[0, 0].tolist())) == budget  # the budget stays full


def test_compression_ratios_follow_appendix_g():
    S, d, k = 4096, 128, 128
    assert compression_ratio(H2ODecode(k), S, d) == (2 * k * d + 2 * d + 2 * S) / (2 * S * d + 2 * d)
    assert compression_ratio(LocalDecode(k), S, d) == (2 * k * d + 2 * d) / (2 * S * d + 2 * d)
    assert compression_ratio(TopKDecode(k), S, d) == (S * d + k * d + 2 * d) / (2 * S * d + 2 * d)
    # Quest: 2d per page of 16 (its min and max), then k / 16 whole pages of K and V
    assert compression_ratio(QuestDecode(k), S, d) == (2 * d * S // 16 + 2 * k * d + 2 * d) / (2 * S * d + 2 * d)


def test_registry_builds_every_policy_and_checks_flags():
    """Every registered policy builds from settings; flag misuse is a one-line ValueError."""
    import pytest

    from model import ModelArgs
    from budgets import settings_for_compression
    from policies import POLICIES, AttentionSettings, policy_factory

    args = ModelArgs(vocab_size=10, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=8)
    for name in POLICIES:
        settings = AttentionSettings(name, sparq_r=8 if "sparq_r" in POLICIES[name].flags else None, sparq_k=32,
                                     kv_budget=40 if POLICIES[name].knob == "kv_budget" else None,
                                     channels=channels_file(args))
        make = policy_factory(settings, args)
        assert make(0) is not make(1)  # one instance per layer (H2O keeps per-layer state)
        solved, achieved = settings_for_compression(settings, 0.25, 2048, args)
        assert solved.policy == ("dense" if POLICIES[name].knob is None else name)
        floor = 0.5 if name == "topk" else 0.25  # top-k reads all of K: it cannot go below about 1/2
        assert achieved == pytest.approx(1.0 if solved.policy == "dense" else floor, abs=0.02)
    for settings, message in [(AttentionSettings("sparq"), "needs --sparq-r"),
                              (AttentionSettings("topk", sparq_r=8), "--sparq-r applies"),
                              (AttentionSettings("sparq", sparq_r=8, kv_budget=64), "--kv-budget applies"),
                              (AttentionSettings("local", kv_budget=16), "sink"),
                              (AttentionSettings("sparq", sparq_r=17), "--sparq-r must be"),
                              (AttentionSettings("nope"), "unknown attention policy")]:
        with pytest.raises(ValueError, match=message):
            policy_factory(settings, args)


def test_budgets_count_window_layers_as_the_model_reads_them():
    """On a model with sliding-window layers (Gemma 3: 5 of 6), the solved budget's compression is the
    whole model's, as the installed policies read it (model_compression), and it meets the target where
    the policy can: a window layer reads only min(S, window) positions, so the global layers' ratio is
    not the model's."""
    import pytest

    from model import ModelArgs, Transformer
    from dataclasses import replace

    from budgets import model_compression, settings_for_compression

    from policies import AttentionSettings, policy_factory

    args = ModelArgs(vocab_size=10, dim=64, n_layer=6, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=8,
                     max_context=4096, sliding_window=256, layer_types=["window"] * 5 + ["global"])
    model = Transformer(args)
    model.setup_caches(1, 4096)
    S = 2048
    for settings, target in [(AttentionSettings("local"), 0.25), (AttentionSettings("h2o"), 0.5),
                             (AttentionSettings("sparq", sparq_k=32), 0.25)]:
        solved, achieved = settings_for_compression(settings, target, S, args)
        model.set_decode_attention(policy_factory(solved, args))
        assert achieved == pytest.approx(model_compression(model, S))
        assert achieved == pytest.approx(target, abs=0.03)
        if settings.policy != "sparq":  # a budget k solved over global layers alone (as the solver once did)
            as_if_global, _ = settings_for_compression(settings, target, S, replace(args, layer_types=None))
            model.set_decode_attention(policy_factory(as_if_global, args))  # k > window: windows stay whole
            assert model_compression(model, S) > target + 0.1


def quest_loop_reference(q, k, v, length, budget, page=16, r=None):
    """Quest written out per (row, KV head): page bounds from the min and max of each page's keys,
    summed over the query heads; the newest position's page first, then the highest bounds; exact
    attention over the live positions of the chosen pages. r: the RocketKV hybrid, whose bounds sum
    over only the r components of q largest in magnitude (summed over the query heads)."""
    B, n_kv, g, d = q.shape
    out = torch.zeros(B, n_kv, g, d)
    n_pages = -(-length // page)
    for b in range(B):
        for h in range(n_kv):
            magnitude = [sum(abs(float(q[b, h, j, i])) for j in range(g)) for i in range(d)]
            used = sorted(range(d), key=lambda i: -magnitude[i])[:d if r is None else r]
            bounds = []
            for p in range(n_pages):
                keys = k[b, h, p * page:min(length, (p + 1) * page)][:, used]
                lo, hi = keys.min(0).values, keys.max(0).values
                bounds.append(sum(float(torch.maximum(q[b, h, j, used] * lo, q[b, h, j, used] * hi).sum())
                                  for j in range(g)))
            order = [n_pages - 1] + sorted(range(n_pages - 1), key=lambda p: -bounds[p])
            chosen = order[:min(-(-budget // page), n_pages)]
            positions = [i for p in chosen for i in range(p * page, min(length, (p + 1) * page))]
            for j in range(g):
                w = torch.softmax(torch.stack([q[b, h, j] @ k[b, h, i] for i in positions]) / math.sqrt(d), 0)
                out[b, h, j] = sum(w[t] * v[b, h, i] for t, i in enumerate(positions))
    return out


def test_quest_matches_its_loop_reference_and_equals_dense_with_every_page():
    torch.manual_seed(3)
    k, v = torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    q = torch.randn(2, 2, 3, 8)
    cache = cache_with(k, v, 64)
    for budget in (16, 32, 40):  # 1, 2 and 3 of the 4 pages (the last one holds positions 48, 49)
        torch.testing.assert_close(QuestDecode(budget)(q, cache, 50), quest_loop_reference(q, k, v, 50, budget),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(QuestDecode(64)(q, cache, 50), dense_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_quest_ragged_rows_each_as_alone():
    """Rows at live lengths 37 and 50 in one batch: each row's output is the row's own Quest."""
    torch.manual_seed(4)
    k, v = torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    q = torch.randn(2, 2, 2, 8)
    cache = cache_with(k, v, 64)
    cache.set_live_lengths(torch.tensor([37, 50]))
    out = QuestDecode(32)(q, cache, 50)
    torch.testing.assert_close(out[:1], QuestDecode(32)(q[:1], cache_with(k[:1, :, :37], v[:1, :, :37], 64), 37),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], quest_loop_reference(q[1:], k[1:], v[1:], 50, 32), atol=1e-5, rtol=1e-5)


def test_quest_and_the_rocketkv_hybrid_at_each_page_size_match_the_loop_reference():
    """Quest's pages of 16, 32 and 64 positions, and the hybrid's bounds on r of d components, against
    the loop reference; the hybrid with r = d is Quest."""
    from baselines import RocketKVHybridDecode

    torch.manual_seed(5)
    k, v = torch.randn(2, 2, 150, 8), torch.randn(2, 2, 150, 8)
    q = torch.randn(2, 2, 3, 8)
    cache = cache_with(k, v, 160)
    for page, budget in ((16, 40), (32, 64), (64, 64)):
        torch.testing.assert_close(QuestDecode(budget, page)(q, cache, 150),
                                   quest_loop_reference(q, k, v, 150, budget, page), atol=1e-5, rtol=1e-5)
        for r in (1, 3):
            torch.testing.assert_close(RocketKVHybridDecode(budget, r, page)(q, cache, 150),
                                       quest_loop_reference(q, k, v, 150, budget, page, r), atol=1e-5, rtol=1e-5)
        hybrid_all = RocketKVHybridDecode(budget, 8, page)(q, cache, 150)  # r = d
        assert torch.equal(hybrid_all, QuestDecode(budget, page)(q, cache, 150))


def test_quest_and_hybrid_transfers_count_their_page_summaries():
    from baselines import RocketKVHybridDecode

    S, d, k = 4096, 128, 256
    dense = 2 * S * d + 2 * d
    for page in (16, 32, 64):
        assert compression_ratio(QuestDecode(k, page), S, d) == (2 * d * S // page + 2 * k * d + 2 * d) / dense
        # the hybrid reads r of the d rows of the summaries
        hybrid = (2 * 32 * S // page + 2 * k * d + 2 * d) / dense
        assert compression_ratio(RocketKVHybridDecode(k, 32, page), S, d) == hybrid


def doublesparse_loop_reference(q, k, v, length, channels, k_top, local, k_step1=None):
    """DoubleSparse written out per (row, KV head): approximate logits from the fixed channels of K
    (of k_step1 if given: K as the copy step 1 reads stores it), at SparQ's temperature, softmax per
    query head and summed over the group; the `local` newest positions and then the best; exact
    attention over them (mean-V off)."""
    B, n_kv, g, d = q.shape
    k_step1 = k if k_step1 is None else k_step1
    out = torch.zeros(B, n_kv, g, d)
    for b in range(B):
        for h in range(n_kv):
            c = channels[h]
            score = torch.zeros(length)
            for j in range(g):
                q_hat = q[b, h, j, c]
                tau = math.sqrt(d * float(q_hat.abs().sum()) / float(q[b, h, j].abs().sum()))
                score += torch.softmax(k_step1[b, h, :length][:, c] @ q_hat / tau, 0)
            recent = list(range(length - local, length))
            rest = [int(i) for i in torch.argsort(score[:length - local], descending=True, stable=True)]
            positions = recent + rest[:k_top - local]
            for j in range(g):
                w = torch.softmax(torch.stack([q[b, h, j] @ k[b, h, i] for i in positions]) / math.sqrt(d), 0)
                out[b, h, j] = sum(w[t] * v[b, h, i] for t, i in enumerate(positions))
    return out


def test_doublesparse_reads_its_channels_and_matches_the_loop_reference():
    """Fixed channels per KV head (not the query's): against the loop reference; with the channels q's
    own top r it is SparQ."""
    from baselines import DoubleSparseDecode
    from sparq import SparQDecode

    torch.manual_seed(6)
    k, v = torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16)
    q = torch.randn(1, 2, 3, 16)
    cache = cache_with(k, v, 96)
    config = SparQConfig(r=4, k_top=24, local=6, mean_v=False)
    channels = torch.tensor([[15, 2, 7, 9], [0, 1, 2, 3]])
    torch.testing.assert_close(DoubleSparseDecode(config, channels)(q, cache, 90),
                               doublesparse_loop_reference(q, k, v, 90, channels, 24, 6), atol=1e-5, rtol=1e-5)
    own = torch.topk(q.abs().sum(2), 4, dim=-1).indices[0]  # (n_kv, r): what SparQ reads for this q
    assert torch.equal(DoubleSparseDecode(config, own)(q, cache, 90), SparQDecode(config)(q, cache, 90))


def test_doublesparse_reads_a_quantized_k_t_as_the_dense_copy_would():
    """On an int8 or int4 K^T, DoubleSparse dequantizes only its channels' rows: step 1 sees the same
    values as in the whole dequantized K^T (the loop reference's step 1 reads that), with a sliding
    window starting on an odd position too (inside an int4 byte); layout "once" reads K's columns."""
    from baselines import DoubleSparseDecode

    torch.manual_seed(7)
    B, n_kv, S, d = 2, 2, 90, 16
    k, v = torch.randn(B, n_kv, S, d), torch.randn(B, n_kv, S, d)
    q = torch.randn(B, n_kv, 3, d)
    config = SparQConfig(r=4, k_top=24, local=6, mean_v=False)
    channels = torch.tensor([[15, 2, 7, 9], [0, 1, 2, 3]])
    for layout, kt_dtype, window in [("twice", "int8", None), ("twice", "int4", None), ("twice", "int4", 41),
                                     ("once", "same", None)]:
        cache = KVCache(B, 96, n_kv, d, torch.float32, layout=layout, window=window, kt_dtype=kt_dtype)
        cache.update(torch.arange(S), k, v)
        start = cache.visible_start(S)
        whole = cache.read_k_t(slice(0, B), start, S)  # (B, n_kv, d, S - start): every row dequantized
        k_step1 = k[:, :, start:] if whole is None else whole.transpose(-1, -2)
        expected = doublesparse_loop_reference(q, k[:, :, start:], v[:, :, start:], S - start, channels, 24, 6,
                                               k_step1=k_step1)
        torch.testing.assert_close(DoubleSparseDecode(config, channels)(q, cache, S), expected,
                                   atol=1e-5, rtol=1e-5, msg=f"{layout} {kt_dtype} window {window}")


def test_doublesparse_needs_a_calibration_of_its_model(tmp_path):
    import pytest

    from model import ModelArgs
    from policies import AttentionSettings, policy_factory

    args = ModelArgs(vocab_size=10, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=8)
    for channels, message in [(None, "calibrate_doublesparse"), (tmp_path / "none.pt", "does not exist"),
                              (channels_file(ModelArgs(**{**vars(args), "n_layer": 3})), "not this one's")]:
        with pytest.raises(ValueError, match=message):
            policy_factory(AttentionSettings("doublesparse", sparq_r=4, channels=channels), args)
    make = policy_factory(AttentionSettings("doublesparse", sparq_r=4, channels=channels_file(args)), args)
    ranking = torch.load(channels_file(args))["ranking"]
    assert torch.equal(make(1).channels, ranking[1, :, :4].long())  # each layer its own first r channels


def test_doublesparse_under_tensor_parallel_takes_its_ranks_heads():
    """A rank of tp.shard holds some of the model's KV heads: its DoubleSparse reads those heads' rows of
    the whole model's calibration (the file's shape is checked against the whole model's)."""
    import tp
    from model import ModelArgs, Transformer
    from policies import AttentionSettings, policy_factory

    args = ModelArgs(vocab_size=10, dim=48, n_layer=2, n_head=3, n_kv_head=3, head_dim=16, intermediate_size=8)
    ranking = torch.load(channels_file(args))["ranking"].long()
    settings = AttentionSettings("doublesparse", sparq_r=4, channels=channels_file(args))
    for rank, heads in ((0, slice(0, 2)), (1, slice(2, 3))):  # 3 KV heads over 2 ranks: 2 + 1
        shard_args = tp.shard(Transformer(args), rank, 2).args
        assert (shard_args.kv_head_start, shard_args.n_kv_head, shard_args.kv_head_total) == \
            (heads.start, heads.stop - heads.start, 3)
        make = policy_factory(settings, shard_args)
        assert torch.equal(make(1).channels, ranking[1, heads, :4])


def test_calibration_ranks_channels_by_q_and_k_magnitude_over_every_chunk():
    """The calibration's ranking, accumulated over prefill chunks, against sum_t |q_t k_t| per channel
    written out over one prefill of the same tokens that keeps q and K whole."""
    from attention import DecodePolicy
    from scripts.calibrate_doublesparse import calibrate
    from test_ragged import tiny_model

    class Keep(DecodePolicy):
        observes_prefill = True

        def __init__(self):
            super().__init__()
            self.q = self.k = None

        def observe_prefill(self, q, k, memo=None, lengths=None, window=None):
            self.q, self.k = q, k

    model = tiny_model()
    tokens = torch.randint(0, 101, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ranking = calibrate(model, tokens, chunk=16)  # 5 chunks
    kept = [Keep() for _ in model.layers]
    model.setup_caches(1, 70)
    model.set_decode_attention(lambda layer: kept[layer])
    from decoding import prefill
    with torch.no_grad():
        prefill(model, torch.tensor([tokens]), chunk=70)
    n_kv, d = model.args.n_kv_head, model.args.head_dim
    g = model.args.n_head // n_kv
    for layer, keep in enumerate(kept):
        importance = torch.zeros(n_kv, d, dtype=torch.float64)  # each token's query against its own key
        for h in range(n_kv):
            for j in range(g):
                importance[h] += (keep.q[0, h * g + j].double() * keep.k[0, h].double()).abs().sum(0)
        expected = torch.sort(importance, dim=-1, descending=True, stable=True).indices
        assert torch.equal(ranking[layer], expected)


def test_generate_names_the_calibration_command_and_runs_the_new_selectors(tmp_path):
    """doublesparse without its calibration: one line naming the command that makes it; with one (and
    Quest at pages of 32, the hybrid), generate.py runs."""
    from conftest import assert_one_line_error
    from model import ModelArgs
    from test_generate import run_generate

    common = ["--random-weights", "tiny", "--prompt-tokens", "120", "--max-new-tokens", "4"]
    assert_one_line_error(run_generate(*common, "--attention", "doublesparse", "--sparq-r", "4"),
                          "python -m scripts.calibrate_doublesparse")
    for flags in (["--attention", "doublesparse", "--sparq-r", "4", "--sparq-k", "32",
                   "--doublesparse-channels", str(channels_file(ModelArgs.from_shape("tiny")))],
                  ["--attention", "quest", "--kv-budget", "64", "--page-size", "32"],
                  ["--attention", "rocketkv-hybrid", "--kv-budget", "48", "--hybrid-r", "4"]):
        result = run_generate(*common, *flags)
        assert result.returncode == 0, result.stderr
        assert f"attention: {flags[1]}" in result.stdout + result.stderr
