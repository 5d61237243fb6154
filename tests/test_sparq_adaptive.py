"""Adaptive SparQ (sparq-adaptive): the batched torch path against its loop reference, the reference
against the paper's SparQ where they must coincide (one KV head: nothing to share) and against
dense attention (r = d, k >= S); the heads' shares; per-row live lengths; its budget."""
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from conftest import assert_one_line_error, read_json, run_python
from attention import DenseDecode, dense_attention_torch
from cache import KVCache, KVFormat
from model import SHAPES, ModelArgs
from budgets import layer_transfers, solve_target
from policies import AttentionSettings, policy_factory
from sparq import SparQConfig, sparq_reference
from sparq_adaptive import (ELEMENTS, SparQAdaptiveDecode, StepCosts, adaptive_split, key_spread, position_share,
                            select_components, select_positions, sparq_adaptive_reference, sparq_adaptive_torch)
from test_sparq import filled_cache, random_query


def adaptive(q, cache, S, config, per_head=True):
    """The torch path on a cache, the keys' spread from the cache's running sums."""
    return sparq_adaptive_torch(q, cache.k, cache.v, cache.v_sum, key_spread(cache.k_moments[:q.shape[0]], S), S,
                                None, config.r, config.k_top, config.local, config.mean_v, per_head=per_head)


def spread_of(k, lengths):
    """The keys' standard deviation per dimension over each row's positions, computed directly: (B, n_kv, d)."""
    return torch.stack([k[b, :, :n].float().std(1, unbiased=False) for b, n in enumerate(lengths)])


def scaled_cache(B, n_kv, d, S, S_max):
    """filled_cache with key dimensions scaled 1 to 30x apart (as Gemma 3's k_norm does): the ranking
    by |q| alone and by |q| x spread then differ."""
    cache, k, v = filled_cache(B, n_kv, d, S, S_max)
    scale = torch.logspace(0, 1.5, d)[torch.randperm(d, generator=torch.Generator().manual_seed(5))]
    scaled = KVCache(B + 1, S_max, n_kv, d, torch.float32)
    scaled.update(torch.arange(S), k[:, :, :S] * scale, v[:, :, :S])
    return scaled


@pytest.mark.parametrize("B,n_kv,g_,d,S,r,k,mean_v", [
    (2, 3, 3, 64, 517, 8, 128, False),  # SmolLM2-like GQA
    (2, 4, 1, 32, 300, 4, 64, True),  # MHA, mean-V
    (1, 2, 7, 64, 400, 3, 48, True),  # Qwen 0.5B-like grouping
])
@pytest.mark.parametrize("per_head", [True, False])
def test_torch_path_matches_loop_reference(B, n_kv, g_, d, S, r, k, mean_v, per_head):
    """The reference takes the keys' spread computed directly from K, the torch path the cache's running sums."""
    cache = scaled_cache(B, n_kv, d, S, S + 5)
    q = random_query(B, n_kv, g_, d)
    spread = spread_of(cache.k, [S] * B)
    config = SparQConfig(r=r, k_top=k, mean_v=mean_v)
    expected = sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, S, config, spread=spread, per_head=per_head)
    torch.testing.assert_close(adaptive(q, cache, S, config, per_head), expected, atol=1e-5, rtol=1e-5)
    # the policy itself, at its own split of a budget
    policy = SparQAdaptiveDecode(compression=1 / 8, k_max=k, mean_v=mean_v, per_head=per_head)
    r_policy, k_policy = adaptive_split(S, d, 1 / 8)  # dense up to k positions, k uncapped
    config = SparQConfig(r=r_policy, k_top=k_policy, mean_v=mean_v)
    expected = sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, S, config, spread=spread, per_head=per_head)
    torch.testing.assert_close(policy(q, cache, S), expected, atol=1e-5, rtol=1e-5)
    # and with a cap on k (--adaptive-k-cap) that binds at S: its own split
    cap = 1  # the positions give back all but one: step 1 gets more components
    capped = SparQAdaptiveDecode(compression=1 / 8, k_max=k, mean_v=mean_v, k_cap=cap, per_head=per_head)
    r_capped, k_capped = adaptive_split(S, d, 1 / 8, cap)
    assert r_capped > r_policy
    config = SparQConfig(r=r_capped, k_top=k_capped, local=max(1, k_capped // 4), mean_v=mean_v)  # the policy's
    expected = sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, S, config, spread=spread, per_head=per_head)
    torch.testing.assert_close(capped(q, cache, S), expected, atol=1e-5, rtol=1e-5)


def test_step_1_reads_k_t_where_given():
    """A quantized cache's K^T holds other values than its K: step 1 ranks positions by the K^T it is
    given, step 2 attends over K (the loop reference with the same K^T), and the result is not K's."""
    B, n_kv, g_, d, S = 2, 3, 2, 32, 300
    cache = scaled_cache(B, n_kv, d, S, S + 5)
    q = random_query(B, n_kv, g_, d)
    config = SparQConfig(r=6, k_top=40, mean_v=True)
    other = cache.k.roll(57, dims=2)  # the same keys at other positions
    k_t = other.transpose(-1, -2).contiguous()  # (B + 1, n_kv, d, S_max)
    spread = key_spread(cache.k_moments[:B], S)
    got = sparq_adaptive_torch(q, cache.k, cache.v, cache.v_sum, spread, S, None, config.r, config.k_top, config.local,
                               config.mean_v, k_t=k_t)
    expected = sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, S, config, spread=spread_of(cache.k, [S] * B),
                                        k_t=k_t)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, adaptive(q, cache, S, config), atol=1e-3)


def test_key_spread_from_the_running_sums():
    """key_spread on the cache's running sums is the keys' standard deviation over each row's live positions."""
    cache = scaled_cache(2, 3, 16, 90, 100)
    torch.testing.assert_close(key_spread(cache.k_moments[:2], 90), spread_of(cache.k, [90, 90]), atol=1e-4, rtol=1e-4)
    cache.truncate_rows(torch.tensor([40, 77]))
    torch.testing.assert_close(key_spread(cache.k_moments[:2], cache.live_length[:2]), spread_of(cache.k, [40, 77]),
                               atol=1e-4, rtol=1e-4)


def test_components_follow_the_keys_spread():
    """Equal |q| everywhere: the components chosen are the dimensions where the keys vary most, and the
    scores then rank positions as exact attention does (the paper's |q| ranking picks by index)."""
    d, S, r = 16, 300, 2
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(1, 1, S, d, generator=gen) * 0.01
    k[..., 5] *= 1000.0  # dimension 5 and 11 carry the logits' variation
    k[..., 11] *= 500.0
    q = torch.ones(1, 1, 1, d)
    chosen = select_components(q, r, spread_of(k, [S]))[0, 0, 0]
    assert chosen.nonzero().flatten().tolist() == [5, 11]
    cache = KVCache(1, S, 1, d, torch.float32)
    cache.update(torch.arange(S), k, torch.randn(1, 1, S, d, generator=gen))
    config = SparQConfig(r=r, k_top=10, local=0)
    exact = dense_attention_torch(q, cache.k, cache.v, S)
    weighted = adaptive(q, cache, S, config)
    by_q = sparq_reference(q, cache.k, cache.v, cache.v_sum, S, config)
    assert (weighted - exact).abs().max() < (by_q - exact).abs().max()


@pytest.mark.parametrize("n_kv,per_head", [(1, True), (1, False), (3, True)])
def test_each_head_alone_ranked_by_q_is_the_papers_sparq(n_kv, per_head):
    """Ranked by |q| alone (spread None), a KV head selecting alone is the paper's SparQ: each head its own
    (the default) at any n_kv, or one KV head (nothing to pool with) either way: sparq_reference's result."""
    cache, _, _ = filled_cache(2, n_kv, 64, 300, 300)
    q = random_query(2, n_kv, 4, 64)
    for mean_v in (False, True):
        config = SparQConfig(r=6, k_top=40, mean_v=mean_v)
        torch.testing.assert_close(sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, 300, config,
                                                            per_head=per_head),
                                   sparq_reference(q, cache.k, cache.v, cache.v_sum, 300, config), atol=1e-6, rtol=1e-5)


def test_pooled_heads_are_not_the_papers_sparq():
    """The check above can fail: three KV heads pooling their picks select otherwise than each alone."""
    cache, _, _ = filled_cache(2, 3, 64, 300, 300)
    q = random_query(2, 3, 4, 64)
    config = SparQConfig(r=6, k_top=40)
    assert not torch.allclose(sparq_adaptive_reference(q, cache.k, cache.v, cache.v_sum, 300, config, per_head=False),
                              sparq_reference(q, cache.k, cache.v, cache.v_sum, 300, config), atol=1e-3)


def test_full_r_and_k_are_dense():
    cache, k, v = filled_cache(2, 3, 32, 90, 100)
    q = random_query(2, 3, 2, 32)
    config = SparQConfig(r=32, k_top=90, mean_v=True)
    torch.testing.assert_close(adaptive(q, cache, 90, config), dense_attention_torch(q, k, v, 90), atol=1e-5, rtol=1e-5)


def test_pooled_heads_share_the_budget():
    """Pooled (per_head=False): a head whose query is one spike gives its components to a head whose query
    is flat; a head whose step-1 scores sit on a few positions gives positions to one whose scores are
    spread: the counts differ per head, their totals are the layer's n_kv r and n_kv k. Each head its own:
    r and k each."""
    d, S, r, k = 16, 200, 4, 20
    q = torch.zeros(1, 2, 1, d)
    q[0, 0, 0, 0] = 50.0  # head 0: one component
    q[0, 1, 0] = torch.linspace(1.0, 1.1, d)  # head 1: every component alike
    components = select_components(q, r, torch.ones(1, 2, d), per_head=False)[0, :, 0]  # (2, d)
    assert components.sum(-1).tolist() == [1, 2 * r - 1]
    assert select_components(q, r, torch.ones(1, 2, d))[0, :, 0].sum(-1).tolist() == [r, r]
    s_hat = torch.zeros(1, 2, 1, S)
    s_hat[0, 0, 0, :3] = torch.tensor([0.5, 0.3, 0.2])  # head 0: three positions hold everything
    s_hat[0, 1, 0] = torch.softmax(torch.randn(S, generator=torch.Generator().manual_seed(0)), -1)
    positions = select_positions(s_hat, S, k, 0, None, per_head=False)[0, :, 0]  # (2, S)
    assert positions.sum().item() == 2 * k and positions[0, :3].all() and positions[1].sum() > k
    assert positions.sum(-1)[1] == 2 * k - positions.sum(-1)[0]
    assert select_positions(s_hat, S, k, 0, None)[0, :, 0].sum(-1).tolist() == [k, k]
    # the local window is every head's, whatever the scores
    for per_head in (True, False):
        positions = select_positions(s_hat, S, k, 5, None, per_head=per_head)[0, :, 0]
        assert positions[:, S - 5:].all() and positions.sum().item() == 2 * k


@pytest.mark.parametrize("mean_v", [False, True])
def test_per_row_live_lengths_equal_each_row_run_alone(mean_v):
    B, n_kv, g_, d, S_max = 3, 2, 3, 32, 300
    lengths = [40, 300, 171]
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(B, n_kv, S_max, d, generator=gen), torch.randn(B, n_kv, S_max, d, generator=gen)
    v_sum = torch.stack([v[b, :, :n].sum(1) for b, n in enumerate(lengths)])
    q = random_query(B, n_kv, g_, d)
    spread = spread_of(k, lengths)
    batch = sparq_adaptive_torch(q, k, v, v_sum, spread, S_max, torch.tensor(lengths), 8, 32, 8, mean_v)
    for b, n in enumerate(lengths):
        alone = sparq_adaptive_torch(q[b:b + 1], k[b:b + 1], v[b:b + 1], v_sum[b:b + 1], spread[b:b + 1], n, None, 8,
                                     32, 8, mean_v)
        torch.testing.assert_close(batch[b:b + 1], alone, atol=2e-6, rtol=1e-5)


def test_per_head_selection_is_each_kv_head_run_alone():
    """per_head (the default): each KV head takes its own r components and k positions, so a row of n_kv heads
    computes what each head computes alone (one head pools with nobody); pooled selection does not."""
    B, n_kv, g_, d, S, lengths = 2, 2, 3, 32, 300, [300, 171]
    gen = torch.Generator().manual_seed(12)
    k, v = torch.randn(B, n_kv, S, d, generator=gen), torch.randn(B, n_kv, S, d, generator=gen)
    k[:, 1] *= 3.0  # one head's scores sharper than the other's: pooling then shifts the picks toward it
    v_sum = torch.stack([v[b, :, :n].sum(1) for b, n in enumerate(lengths)])
    q = random_query(B, n_kv, g_, d)
    spread = spread_of(k, lengths)
    live = torch.tensor(lengths)
    per_head = sparq_adaptive_torch(q, k, v, v_sum, spread, S, live, 6, 24, 6, False, per_head=True)
    pooled = sparq_adaptive_torch(q, k, v, v_sum, spread, S, live, 6, 24, 6, False, per_head=False)
    for h in range(n_kv):
        alone = sparq_adaptive_torch(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], v_sum[:, h:h + 1],
                                     spread[:, h:h + 1], S, live, 6, 24, 6, False)
        torch.testing.assert_close(per_head[:, h:h + 1], alone, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(per_head, pooled, atol=1e-3)


@pytest.mark.parametrize("k_cap", [None, 128])
@pytest.mark.parametrize("S,d,c", [(1400, 64, 1 / 8), (512, 256, 1 / 4), (1401, 256, 1 / 4), (30000, 128, 1 / 16),
                                   (200, 64, 1 / 8), (8000, 64, 1 / 4)])
def test_each_step_splits_the_target(S, d, c, k_cap):
    """adaptive_split: the step moves c of dense's transfers to within one position's K and V row (2d)
    unless r hits a bound, and never more; positions take about position_share of it, or the cap."""
    r, k = adaptive_split(S, d, c, k_cap)
    moved, dense = S * r + 2 * k * d + 6 * d, 2 * S * d + 2 * d
    assert 1 <= r <= d and 1 <= k <= S
    assert moved <= c * dense and (r in (1, d) or moved > c * dense - 2 * d)
    share = c * position_share(c, d) * S  # what the positions get before rounding r down gives some back
    if k_cap is not None:
        assert k <= k_cap + S // (2 * d) + 1  # the cap, and what rounding r down gave back
    if k_cap is None or share < k_cap:  # to within what rounding r down gave back (S of r's elements)
        assert share - 1 <= k <= share + S / (2 * d) + 1
    if k_cap is not None and share > k_cap + S / (2 * d) + 1:  # the cap binds: fewer positions, more components
        r_free, k_free = adaptive_split(S, d, c)
        assert k < k_free and r >= r_free


@pytest.mark.parametrize("kv_dtype, kt_dtype, kt_scale_dtype", [
    ("auto", "int4", "float32"), ("auto", "int8", "float32"), ("int8", "int4", "float32"), ("int8", "same", "float32"),
    ("auto", "int4", "bfloat16")])
def test_a_quantized_k_t_buys_components_at_the_same_bytes(kv_dtype, kt_dtype, kt_scale_dtype):
    """On a cache whose K^T is stored in fewer bytes (scales included), each step's split reads more
    components (never fewer) for the same target, and the policy's stored bytes are c of dense's on that
    cache to within one position's K and V rows, as adaptive_split promises in elements on a float cache.
    bf16 scales cost step 1 half the fp32 ones' bytes per position: the split keeps more positions."""
    d, c = 64, 1 / 8
    fmt, act = KVFormat("twice", kv_dtype, kt_dtype, kt_scale_dtype), torch.bfloat16
    costs = StepCosts.of(fmt, act, d)
    policy = SparQAdaptiveDecode(compression=c, k_max=128)
    for S in (1400, 8000, 32000):
        (r, k), (r_float, _) = adaptive_split(S, d, c, None, costs), adaptive_split(S, d, c)
        assert policy.step1_reads(S, d, costs) == (S, r)
        stored, dense = policy.transfer_bytes(S, d, fmt, act), DenseDecode().transfer_bytes(S, d, fmt, act)
        row = 2 * d * (fmt.bytes_per_element(act) + fmt.row_scale_bytes(act) / d)  # one position's K and V
        assert stored <= c * dense + 1e-6 and (r in (1, d) or stored > c * dense - row), (S, r, k)
        if kt_dtype != "same":  # K^T in fewer bytes than K: more components for the same bytes
            assert r >= r_float
        if kt_dtype == "int4" and kv_dtype == "auto":  # at 1/4 and 1/8 an int4 K^T affords half the components
            for target in (1 / 4, 1 / 8):  # (position_share): step 1 reads about d / 2, the positions the rest
                (r4, k4), (r4_float, k4_float) = (adaptive_split(S, d, target, None, x) for x in (costs, ELEMENTS))
                assert d // 2 - 2 <= r4 <= d // 2 and r4 > r4_float, (target, r4, r4_float)
                assert k4 > k4_float, (target, k4, k4_float)  # the cheaper components leave more to positions
        if kt_scale_dtype == "bfloat16":
            fp32_scales = StepCosts.of(replace(fmt, kt_scale_dtype="float32"), act, d)
            assert costs.kt_scale == fp32_scales.kt_scale / 2 and costs.kt == fp32_scales.kt
            assert adaptive_split(S, d, c, None, costs)[1] > adaptive_split(S, d, c, None, fp32_scales)[1]
    assert StepCosts.of(KVFormat(), act, d) == StepCosts.of(KVFormat("once"), torch.float32, d) == ELEMENTS


def test_the_policy_reads_its_split_from_the_cache_it_runs_on():
    """On an int4 K^T the policy runs the torch path at that cache's split and step 1 on its K^T: the loop
    reference on the dequantized values at the same (r, k)."""
    B, n_kv, g_, d, S = 1, 2, 3, 32, 400
    cache = KVCache(B, S + 4, n_kv, d, torch.float32, kt_dtype="int4")
    k, v = (torch.randn(B, n_kv, S, d, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    cache.update(torch.arange(S), k * torch.logspace(0, 1, d), v)
    q = random_query(B, n_kv, g_, d)
    policy = SparQAdaptiveDecode(compression=1 / 8, k_max=64)
    r, k_top = adaptive_split(S, d, 1 / 8, None, StepCosts.of(cache.format, torch.float32, d))
    assert r > adaptive_split(S, d, 1 / 8)[0]
    view = cache.view(S, B)  # the dequantized K, V and K^T
    config = SparQConfig(r=r, k_top=k_top, mean_v=False)
    expected = sparq_adaptive_reference(q, view.k, view.v, view.v_sum, S, config, spread=spread_of(view.k, [S]),
                                        k_t=view.k_t)
    torch.testing.assert_close(policy(q, cache, S), expected, atol=1e-5, rtol=1e-5)


def test_the_policy_takes_the_target_and_counts_its_transfers():
    """--compression is the policy's own setting: every layer (a window one too, at its own visible length)
    moves c of its dense transfers, so the model-wide ratio is c at every length, not only at the one a
    fixed r was solved at."""
    args = ModelArgs.from_shape("smollm2")
    budget = solve_target(AttentionSettings("sparq-adaptive", compression=Fraction(1, 8)), 1400, args)
    assert budget.achieved == pytest.approx(1 / 8, rel=0.02)
    r, k = adaptive_split(1400, args.head_dim, 1 / 8)  # what the budget reports is the policy's split
    assert budget.split == (r, k) and budget.k_top == k and f"r={r}, k={k}" in budget.describe()
    make = policy_factory(budget.settings, args)
    assert isinstance(make(0), SparQAdaptiveDecode) and make(0).compression == 1 / 8
    for S in (1400, 5000, 20000):
        ratio = layer_transfers(make, args, S) / layer_transfers(lambda i: DenseDecode(), args, S)
        assert ratio == pytest.approx(1 / 8, rel=0.02)
    gemma_like = ModelArgs(**{**SHAPES["smollm2"], "head_dim": 256, "sliding_window": 512,
                              "n_layer": 6, "layer_types": ["window"] * 5 + ["global"]})
    budget = solve_target(AttentionSettings("sparq-adaptive", compression=Fraction(1, 4)), 1400, gemma_like)
    assert budget.achieved == pytest.approx(1 / 4, rel=0.02)


def test_sparq_r_is_refused():
    with pytest.raises(ValueError, match="--sparq-r applies to"):
        policy_factory(AttentionSettings("sparq-adaptive", sparq_r=8), ModelArgs.from_shape("smollm2"))


def test_a_cap_on_k_reaches_the_policy_and_only_its_own():
    """--adaptive-k-cap: the policy's k at most the cap (its budget still met), refused for other policies."""
    args = ModelArgs.from_shape("smollm2")
    capped = policy_factory(AttentionSettings("sparq-adaptive", compression=Fraction(1, 4), adaptive_k_cap=64), args)(0)
    free = policy_factory(AttentionSettings("sparq-adaptive", compression=Fraction(1, 4)), args)(0)
    assert capped.k_cap == 64 and free.k_cap is None
    d, S = args.head_dim, 8000
    for policy in (capped, free):
        assert policy.transfer_elements(S, d) == pytest.approx(DenseDecode().transfer_elements(S, d) / 4, rel=0.01)
    assert capped.step1_reads(S, d)[1] > free.step1_reads(S, d)[1]  # fewer positions: more components
    with pytest.raises(ValueError, match="--adaptive-k-cap applies to"):
        policy_factory(AttentionSettings("sparq", sparq_r=8, adaptive_k_cap=64), args)


def test_the_heads_selection_reaches_the_policy_and_only_its_own():
    """--adaptive-heads: each KV head its own by default, pooled when asked; refused for other policies."""
    args = ModelArgs.from_shape("smollm2")
    assert policy_factory(AttentionSettings("sparq-adaptive"), args)(0).per_head
    assert not policy_factory(AttentionSettings("sparq-adaptive", adaptive_heads="pooled"), args)(0).per_head
    with pytest.raises(ValueError, match="--adaptive-heads applies to"):
        policy_factory(AttentionSettings("sparq", sparq_r=8, adaptive_heads="pooled"), args)


def test_generate_defaults_to_an_eighth(tmp_path, smollm2_checkpoint):
    """generate.py --attention sparq-adaptive without --compression or --sparq-r: 1/8 of dense's KV transfers."""
    out = tmp_path / "run.json"
    result = run_python("generate.py", "--checkpoint", str(smollm2_checkpoint), "--attention", "sparq-adaptive",
                        "--prompt-tokens", "1400", "--max-new-tokens", "4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert read_json(out)["compression_achieved"] == pytest.approx(1 / 8, rel=0.05)


def test_generate_takes_a_cap_on_k_for_the_adaptive_policy_only():
    """generate.py --adaptive-k-cap: the budget line names the capped split; beside another policy, one line."""
    # K^T in the activations' dtype, where adaptive_split's element counts are the bytes' proportions (the
    # CPU's default int4 K^T makes step 1's components cheaper: r reaches d at this tiny shape)
    common = ["--random-weights", "tiny", "--prompt-tokens", "300", "--max-new-tokens", "4", "--kt-dtype", "same"]
    result = run_python("generate.py", *common, "--attention", "sparq-adaptive", "--compression", "1/4",
                        "--adaptive-k-cap", "16")
    assert result.returncode == 0, result.stderr
    d = ModelArgs.from_shape("tiny").head_dim
    r, k = adaptive_split(300, d, 1 / 4, 16)
    assert f"k capped at 16 plus what rounding r down leaves): r={r}, k={k}" in result.stderr + result.stdout
    assert_one_line_error(run_python("generate.py", *common, "--sparq-r", "4", "--adaptive-k-cap", "16"),
                          "--adaptive-k-cap applies to --attention sparq-adaptive")


@pytest.mark.parametrize("c", [1 / 4, 1 / 8, 1 / 16])
def test_the_split_study_at_position_share_is_the_policy(c):
    """scripts/studies/adaptive_split_study.py's variants run the product's policy: at position_share(c, d) its
    output is SparQAdaptiveDecode's (torch path), and another share gives another split and output."""
    from scripts.studies.adaptive_split_study import SplitAt

    B, n_kv, g_, d, S = 1, 2, 3, 64, 700
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    expected = SparQAdaptiveDecode(compression=c)(q, cache, S)
    torch.testing.assert_close(SplitAt(c, position_share(c, d))(q, cache, S), expected)
    other = 1 / 2 if position_share(c, d) < 1 / 2 else 1 / 8
    assert adaptive_split(S, d, c, share=other) != adaptive_split(S, d, c)
    assert not torch.allclose(SplitAt(c, other)(q, cache, S), expected)


def test_the_split_study_on_an_int4_kt_counts_its_bytes():
    """On an int4 K^T the study's split is the policy's (torch path, the budget in stored bytes), which gives
    step 1 more components than a float K^T at the same target."""
    from scripts.studies.adaptive_split_study import SplitAt

    B, n_kv, g_, d, S, c = 1, 2, 3, 64, 700, 1 / 8
    cache = KVCache(B, S + 8, n_kv, d, torch.float32, kt_dtype="int4")
    gen = torch.Generator().manual_seed(0)
    cache.update(torch.arange(S), torch.randn(B, n_kv, S, d, generator=gen), torch.randn(B, n_kv, S, d, generator=gen))
    q = random_query(B, n_kv, g_, d)
    costs = StepCosts.of(cache.format, cache.dtype, d)
    expected = SparQAdaptiveDecode(compression=c)(q, cache, S)
    torch.testing.assert_close(SplitAt(c, position_share(c, d, costs, S))(q, cache, S), expected)
    assert adaptive_split(S, d, c, costs=costs)[0] > adaptive_split(S, d, c)[0]


def test_the_coverage_study_starts_at_the_policy_and_moves_its_share_by_coverage():
    """scripts/studies/adaptive_split_study.py's SplitByCoverage: its first step is the policy's (position_share's
    split), step1_coverage is 1 where step 2 takes every position and s_hat's mass on what it takes otherwise
    (checked against s_hat computed here), and each row's share then moves by rate x (target - coverage), so a
    target above the coverage buys positions and one below it components."""
    from scripts.studies.adaptive_split_study import SplitByCoverage, step1_coverage

    B, n_kv, g_, d, S, c = 2, 2, 3, 64, 700, 1 / 8
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    view = cache.view(S, B)
    spread = SparQAdaptiveDecode.spread(view, B)
    torch.testing.assert_close(step1_coverage(q, view, spread, torch.tensor([d, d]), torch.tensor([S, S]),
                                              torch.tensor([1, 1])), torch.ones(B))
    r, k = adaptive_split(S, d, c)
    alpha = step1_coverage(q, view, spread, torch.tensor([r, r]), torch.tensor([k, k]), torch.tensor([k // 4] * B))
    chosen = select_components(q, r, spread)
    weight = q.abs() * spread[:, :, None, :]
    tau = torch.sqrt(d * (weight * chosen).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True))
    s_hat = torch.softmax((q * chosen) @ view.k[:B, :, :S].transpose(-1, -2) / tau, dim=-1)
    top = select_positions(s_hat, S, k, k // 4, None)
    torch.testing.assert_close(alpha, (s_hat * top).sum(-1).mean((1, 2)))
    assert (alpha < 1).all()
    for target, moves in ((0.99, 1), (0.01, -1)):
        policy = SplitByCoverage(c, target, rate=0.05)
        torch.testing.assert_close(policy(q, cache, S), SparQAdaptiveDecode(compression=c)(q, cache, S))
        torch.testing.assert_close(policy.shares, (position_share(c, d, seq_len=S) + 0.05 * (target - alpha)))
        assert ((policy.shares - position_share(c, d, seq_len=S)) * moves > 0).all()


def test_the_cwe_study_runs_the_policy_at_the_cpu_default_split():
    """scripts/studies/cwe_selection_study.py: its split is the one the CPU's default int4 K^T beside bf16 K and V
    gives (StepCosts of that format), its pooled variant with the keys' spread is the torch path pooled at that
    split, and its per-head variant selects otherwise."""
    from kernels import TORCH_KERNELS
    from scripts.studies.cwe_selection_study import COMPRESSION, INT4_KT, Variant

    B, n_kv, g_, d, S = 1, 2, 3, 64, 700
    assert INT4_KT == StepCosts.of(KVFormat(kt_dtype="int4"), torch.bfloat16, d)
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    r, k = adaptive_split(S, d, COMPRESSION, costs=INT4_KT)
    view = cache.view(S, B)
    expected = sparq_adaptive_torch(q, view.k, view.v, view.v_sum, key_spread(view.k_moments[:B], S), S, None, r, k,
                                    k // 4, False, per_head=False)
    torch.testing.assert_close(Variant(TORCH_KERNELS, per_head=False, spread=True)(q, cache, S), expected)
    assert not torch.allclose(Variant(TORCH_KERNELS, per_head=True, spread=True)(q, cache, S), expected)


@pytest.mark.parametrize("compression", [1 / 8, 1 / 16])
def test_the_cwe_study_budget_variants(compression):
    """scripts/studies/cwe_selection_study.py's variants at another target: exact step 1 (r = d) at the split's
    k is the oracle's exact top-k per KV head (baselines.OracleDecode, its own scores and attention), twice the
    positions is the torch path at the split's r and 2k, and a smaller share for the positions is the torch path
    at that share's split (more components, fewer positions)."""
    from kernels import TORCH_KERNELS
    from baselines import OracleDecode
    from scripts.studies.cwe_selection_study import EVERY_COMPONENT, INT4_KT, INT4_KT_BF16_SCALE, TWICE_K, Variant

    B, n_kv, g_, d, S = 2, 2, 3, 64, 700
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    r, k = adaptive_split(S, d, compression, costs=INT4_KT)
    view = cache.view(S, B)

    def torch_path(r_, k_):  # each head its own, at (r_, k_)
        return sparq_adaptive_torch(q, view.k, view.v, view.v_sum, key_spread(view.k_moments[:B], S), S, None, r_, k_,
                                    max(1, k_ // 4), False, per_head=True)

    oracle = OracleDecode(SparQConfig(r=d, k_top=k, local=max(1, k // 4)))
    exact = Variant(TORCH_KERNELS, per_head=True, spread=True, r=EVERY_COMPONENT, compression=compression)(q, cache, S)
    torch.testing.assert_close(exact, oracle(q, cache, S))
    variant = Variant(TORCH_KERNELS, per_head=True, spread=True, k=TWICE_K, compression=compression)
    torch.testing.assert_close(variant(q, cache, S), torch_path(r, 2 * k))
    policy = Variant(TORCH_KERNELS, per_head=True, spread=True, compression=compression)  # step 1 at r < d
    assert not torch.allclose(exact, policy(q, cache, S))
    r_more, k_fewer = adaptive_split(S, d, compression, costs=INT4_KT, share=1 / 8)  # the same bytes, more components
    assert r_more > r and k_fewer < k
    shifted = Variant(TORCH_KERNELS, per_head=True, spread=True, compression=compression, share=1 / 8)
    torch.testing.assert_close(shifted(q, cache, S), torch_path(r_more, k_fewer))
    # a bf16 scale per position: half the stored scale's bytes, which the split gives to the positions
    assert INT4_KT_BF16_SCALE == StepCosts(kt=INT4_KT.kt, kt_scale=INT4_KT.kt_scale / 2) == StepCosts.of(
        KVFormat(kt_dtype="int4", kt_scale_dtype="bfloat16"), torch.bfloat16, d)
    r_same, k_more = adaptive_split(S, d, compression, costs=INT4_KT_BF16_SCALE)
    assert k_more > k
    bf16_scale = Variant(TORCH_KERNELS, per_head=True, spread=True, costs=INT4_KT_BF16_SCALE, compression=compression)
    torch.testing.assert_close(bf16_scale(q, cache, S), torch_path(r_same, k_more))


def test_the_cwe_studys_int4_kt_with_a_scale_per_dimension_only():
    """scripts/studies/cwe_selection_study.py --stored, "a scale per dimension only": step 1 on the centred keys
    quantized to int4 by each dimension's absmax alone (no scale per position), at the split that leaves (more
    components than the bf16-scaled K^T's: its 2 bytes a position go to step 1), is the torch path on those
    values."""
    from kernels import TORCH_KERNELS
    from scripts.studies.cwe_selection_study import (INT4_KT_BF16_SCALE, INT4_KT_NO_POSITION_SCALE, STORED_VARIANTS,
                                                     StoredVariant)

    B, n_kv, g_, d, S, c = 1, 2, 3, 64, 700, 1 / 16
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    variant = StoredVariant(TORCH_KERNELS, *STORED_VARIANTS["int4 K^T centred, a scale per dimension only"],
                            compression=c)
    r, k = adaptive_split(S, d, c, costs=INT4_KT_NO_POSITION_SCALE)
    assert r > adaptive_split(S, d, c, costs=INT4_KT_BF16_SCALE)[0]
    view = cache.view(S, B)
    keys = view.k[:B, :, :S].float()
    centred = keys - keys.mean(2, keepdim=True)
    absmax = centred.abs().amax(2, keepdim=True)
    step1 = torch.round(centred / absmax * 7).clamp(-7, 7) * absmax / 7
    spread = (step1.var(2, unbiased=False) + 1e-12).sqrt()
    expected = sparq_adaptive_torch(q, keys, view.v[:B, :, :S], view.v_sum, spread, S, None, r, k, max(1, k // 4),
                                    False, k_t=step1.transpose(-1, -2), per_head=True)
    torch.testing.assert_close(variant(q, cache, S), expected)
    assert torch.equal(variant.absmax, absmax)


def test_the_cwe_studys_statistics_from_a_first_write():
    """The study's stored variants with first_write: the mean and each dimension's absmax come from the first
    positions alone (what a cache fixing them at a row's first write holds), later keys clamped to that range."""
    from kernels import TORCH_KERNELS
    from scripts.studies.cwe_selection_study import StoredVariant

    B, n_kv, g_, d, S = 1, 2, 3, 64, 700
    _, k, v = filled_cache(B, n_kv, d, S, S + 8)
    keys = k[:, :, :S].float() * torch.linspace(0.5, 2.0, S)[:, None]  # later keys wider
    cache = KVCache(B, S + 8, n_kv, d, torch.float32)
    cache.update(torch.arange(S), keys, v[:, :, :S])
    q = random_query(B, n_kv, g_, d)
    first = StoredVariant(TORCH_KERNELS, True, False, True, False, False, first_write=300, compression=1 / 16)
    whole = StoredVariant(TORCH_KERNELS, True, False, True, False, False, compression=1 / 16)
    y_first, y_whole = first(q, cache, S), whole(q, cache, S)
    mean = keys[:, :, :300].mean(2, keepdim=True)
    torch.testing.assert_close(first.mean, mean)
    torch.testing.assert_close(first.absmax, (keys[:, :, :300] - mean).abs().amax(2, keepdim=True))
    assert (whole.absmax > first.absmax).all() and not torch.allclose(y_first, y_whole)


def test_the_cwe_studys_ranking_variants():
    """cwe_selection_study --ranking: "|q| alone" is the int3 K^T variant with every dimension's spread 1 (the
    torch path at int3's split on the same step-1 values, ranked by |q|), and "SparQ's split" is the int4 K^T's
    with k at most 128 (fixed SparQ's trade of the same bytes)."""
    from kernels import TORCH_KERNELS
    from scripts.studies.cwe_selection_study import INT3_KT, INT4_KT, ranking_policies

    B, n_kv, g_, d, S, c = 1, 2, 3, 64, 1800, 1 / 4  # S within the first write's 2048: its ranges are the prompt's
    assert INT3_KT == StepCosts.of(KVFormat(kt_dtype="int3", kt_scale_dtype="none"), torch.bfloat16, d)
    cache, _, _ = filled_cache(B, n_kv, d, S, S + 8)
    q = random_query(B, n_kv, g_, d)
    alone, = ranking_policies(TORCH_KERNELS, c, "int3 K^T, |q| alone", 1)
    policy, = ranking_policies(TORCH_KERNELS, c, "int3 K^T, |q| x spread (the policy on --kt-dtype int3)", 1)
    y_alone, y_policy = alone(q, cache, S), policy(q, cache, S)
    r, k = adaptive_split(S, d, c, costs=INT3_KT)
    assert alone.last_split == policy.last_split == (r, k)
    view = cache.view(S, B)
    keys = view.k[:B, :, :S].float()
    centred = keys - keys.mean(2, keepdim=True)
    absmax = centred.abs().amax(2, keepdim=True)
    step1 = torch.round(centred / absmax * 3).clamp(-3, 3) * absmax / 3
    expected = sparq_adaptive_torch(q, keys, view.v[:B, :, :S], view.v_sum, torch.ones(B, n_kv, d), S, None, r, k,
                                    max(1, k // 4), False, k_t=step1.transpose(-1, -2), per_head=True)
    torch.testing.assert_close(y_alone, expected)
    assert not torch.allclose(y_alone, y_policy)
    sparq, = ranking_policies(TORCH_KERNELS, c, "k = 128, the int4 K^T's r (SparQ's split), |q| alone", 1)
    sparq(q, cache, S)
    assert sparq.last_split == adaptive_split(S, d, c, 128, INT4_KT) != adaptive_split(S, d, c, costs=INT4_KT)
