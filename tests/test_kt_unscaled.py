"""A K^T without position scales (--kt-scale-dtype none, cache.KVCache._write_unscaled_kt): what the cache stores
against the keys quantized directly (int8, int4 and int3), the fused CPU kernels against the torch paths on it, the
split it buys, and its refusals."""
from __future__ import annotations

import pytest
import torch

import cli
import generate
import kernels
from cache import KVCache, KVFormat, channel_scale, unpack_int3
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


@pytest.mark.parametrize("kt_dtype", ["int4", "int8", "int3"])
def test_the_cache_stores_the_centred_keys_in_steps_of_their_first_writes_range(kt_dtype):
    """K^T = round((K - mean) / step) clamped, mean and step (each dimension's absmax / qmax) those of the first
    write; a later, wider key is clamped to that range; K itself is stored as given; no position scales."""
    B, n_kv, d, S, first = 2, 2, 32, 300, 200
    cache, k = unscaled_cache(B, n_kv, d, S, S + 12, kt_dtype, first=first)
    qmax = {"int4": 7, "int8": 127, "int3": 3}[kt_dtype]
    mean = k[:, :, :first].mean(2)
    step = channel_scale(k[:, :, :first] - mean[:, :, None]) / qmax
    torch.testing.assert_close(cache.kt_mean, mean)
    torch.testing.assert_close(cache.chan, step)
    expected = torch.round((k - mean[:, :, None]) / step[:, :, None]).clamp(-qmax, qmax) * step[:, :, None]
    torch.testing.assert_close(cache.read_k_t(slice(0, B), 0, S).transpose(-1, -2), expected)
    for start, end in ((37, 291), (64, 65), (0, 1), (255, 300)):  # windows inside and across bytes and blocks
        torch.testing.assert_close(cache.read_k_t(slice(0, B), start, end).transpose(-1, -2), expected[:, :, start:end])
    channels = torch.tensor([[3, 0, 7], [31, 5, 5]])  # (n_kv, r): those rows of each head alone
    picked = cache.read_k_t(slice(0, B), 10, 250, channels)
    torch.testing.assert_close(picked, expected[:, :, 10:250].transpose(-1, -2)[:, torch.arange(n_kv)[:, None], channels])
    assert cache.kt_scale is None and torch.equal(cache.read(slice(0, B), 0, S)[0], k)
    assert StepCosts.of(cache.format, torch.float32, d).kt_scale == 0


def test_int3_packs_32_positions_in_12_bytes():
    """unpack_int3 reads position j of a block from bits 2 (j % 4) of byte j // 4 (its low two bits) and bit j % 8
    of byte 8 + j // 8 (its high one), each stored as q + 4; the cache's writes of one position at a time (decode
    steps) leave the other positions' bits of their bytes alone; 3/8 of a byte a position, scale free."""
    block = torch.zeros(12, dtype=torch.uint8)
    block[0] = 0b11_00_10_01  # positions 0-3: low bits 1, 2, 0, 3
    block[8] = 0b0000_1001  # positions 0 and 3 set their high bit
    assert unpack_int3(block, 4).tolist() == [1 + 4 - 4, 2 - 4, 0 - 4, 3 + 4 - 4]
    B, n_kv, d, S = 1, 2, 8, 70
    one_by_one, two_writes = (KVCache(B, 96, n_kv, d, torch.float32, kt_dtype="int3", kt_scale_dtype="none")
                              for _ in range(2))
    k, v = keys_and_values(B, n_kv, S, d, seed=4)
    for cache in (one_by_one, two_writes):  # the same first write: the same mean and steps
        cache.update(torch.arange(40), k[:, :, :40], v[:, :, :40])
    two_writes.update(torch.arange(40, S), k[:, :, 40:], v[:, :, 40:])
    for p in range(40, S):
        one_by_one.update(torch.tensor([p]), k[:, :, p:p + 1], v[:, :, p:p + 1])
    rows = slice(0, B)
    deq = one_by_one.read_k_t(rows, 0, S)
    assert torch.equal(deq, two_writes.read_k_t(rows, 0, S))
    step, mean = one_by_one.chan[:, :, None], one_by_one.kt_mean[:, :, None]
    torch.testing.assert_close(deq.transpose(-1, -2), torch.round((k - mean) / step).clamp(-3, 3) * step)
    assert one_by_one.k_t.shape[-1] == 48 and KVFormat(kt_dtype="int3", kt_scale_dtype="none").kt_bytes_per_element(
        torch.bfloat16) == 0.375


def test_int3_decode_writes_of_ragged_rows_are_each_rows_own():
    """A decode step writes one position per row, each row at its own (a ragged batch: input_pos (B, 1)): each
    row's K^T then holds what writing that row alone holds."""
    B, n_kv, d = 3, 2, 16
    k, v = keys_and_values(B, n_kv, 80, d, seed=6)
    together = KVCache(B, 96, n_kv, d, torch.float32, kt_dtype="int3", kt_scale_dtype="none")
    alone = KVCache(B, 96, n_kv, d, torch.float32, kt_dtype="int3", kt_scale_dtype="none")
    starts = [33, 40, 63]  # each row's prefill length: its decode writes begin inside different bytes and blocks
    for b, n in enumerate(starts):
        for cache in (together, alone):
            cache.update(torch.arange(n), k[b:b + 1, :, :n], v[b:b + 1, :, :n], row=b)
    for step in range(12):
        pos = torch.tensor(starts) + step
        picked = torch.arange(B)[:, None, None], torch.arange(n_kv)[None, :, None], pos[:, None, None]
        together.update(pos[:, None], k[picked], v[picked])  # (B, n_kv, 1, d)
        for b in range(B):
            alone.update(pos[b:b + 1], k[b:b + 1, :, pos[b]:pos[b] + 1], v[b:b + 1, :, pos[b]:pos[b] + 1], row=b)
    for b, n in enumerate(starts):
        rows = slice(b, b + 1)
        assert torch.equal(together.read_k_t(rows, 0, n + 12), alone.read_k_t(rows, 0, n + 12)), b


def test_a_snapshot_of_the_empty_cache_takes_the_mean_back():
    cache = KVCache(1, 64, 2, 16, torch.float32, kt_dtype="int4", kt_scale_dtype="none")
    empty = cache.snapshot()
    k, v = keys_and_values(1, 2, 40, 16)
    cache.update(torch.arange(40), k, v)
    assert cache.kt_mean.abs().sum() > 0
    cache.restore(empty)
    assert not cache.kt_mean.any() and torch.equal(cache.chan, torch.ones_like(cache.chan))


def test_no_position_scale_buys_components():
    """At 1/16 and 1/32 the bytes a position's scale took go to step 1's components, and int3's fewer bits to more
    components or positions."""
    d, act = 64, torch.bfloat16
    for c in (1 / 16, 1 / 32):
        for S in (4096, 16384):
            scaled, unscaled, int3 = (adaptive_split(S, d, c, None, StepCosts.of(KVFormat(kt_dtype=t, kt_scale_dtype=x),
                                                                                  act, d))
                                      for t, x in (("int4", "bfloat16"), ("int4", "none"), ("int3", "none")))
            assert unscaled[0] > scaled[0] and unscaled[1] >= scaled[1], (c, S, scaled, unscaled)
            assert int3[0] > unscaled[0] or int3[1] > unscaled[1], (c, S, unscaled, int3)


@pytest.mark.usefixtures("fused_cpu_kernels")
@pytest.mark.parametrize("kt_dtype", ["int4", "int8", "int3"])
@pytest.mark.parametrize("per_head", [True, False])
def test_the_fused_kernels_read_it_as_the_torch_paths_do(kt_dtype, per_head, threads):
    """Adaptive and fixed SparQ's C++ kernels on a K^T without position scales (ragged rows, lengths ending inside
    an int3 block) are the torch paths on its dequantized values."""
    threads(2)
    n_kv, g, d, lengths = 2, 7, 64, [900, 650]
    B, S = len(lengths), max(lengths)
    cache, _ = unscaled_cache(B, n_kv, d, S, S + 32, kt_dtype)
    live = torch.tensor(lengths)
    cache.set_live_lengths(live)
    q = random_query(B, n_kv, g, d, seed=5)
    stored, deq = cache.view(S, B, stored=True), cache.view(S, B)
    assert stored.scales.own_kt_scale is None and stored.k_t is not None and stored.k_t.dtype == cache.k_t.dtype
    assert stored.scales.kt_bits == (3 if kt_dtype == "int3" else 4)
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


def test_the_scale_dtype_auto_follows_the_k_t():
    """--kt-scale-dtype auto (the default): none for an int3 K^T, which has no position scales, fp32 for every other;
    an explicit one is taken as given (and refused where it cannot be)."""
    from argparse import Namespace

    from assemble import cache_format

    def fmt(kt, scale="auto", kv="auto"):
        return cache_format(Namespace(kv_layout="twice", kv_dtype=kv, kt_dtype=kt, kt_scale_dtype=scale), "cpu",
                            ("sparq-adaptive",))

    assert fmt("int3").kt_scale_dtype == "none" and not fmt("int3").position_scaled_kt
    assert fmt("int4").kt_scale_dtype == "float32" and fmt("int8").kt_scale_dtype == "float32"
    assert fmt("int4", "none").kt_scale_dtype == "none" and fmt("int4", "bfloat16").kt_scale_dtype == "bfloat16"
    assert fmt("same").kt_scale_dtype == "float32" and fmt("int8", kv="int8").kt_scale_dtype == "float32"
    with pytest.raises(cli.UserError, match="--kt-scale-dtype none"):
        fmt("int3", "bfloat16")


@pytest.mark.parametrize("args,fragment", [
    (["--kt-scale-dtype", "none", "--kv-dtype", "int8", "--kt-dtype", "int4"], "float K"),
    (["--kt-scale-dtype", "none", "--kt-dtype", "same"], "--kt-scale-dtype"),
    (["--kt-dtype", "int3", "--kt-scale-dtype", "float32"], "--kt-scale-dtype none"),
])
def test_bad_flags_are_one_line_errors(args, fragment, smollm2_checkpoint):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2",
                                   "--attention", "sparq-adaptive", *args), fragment)


@pytest.mark.parametrize("kt_dtype", ["int4", "int3"])
def test_a_compiled_decode_write_is_the_eager_one(kt_dtype):
    """The decode step's write (one position per row, compiled whole as the decode step is) stores what the eager
    write stores: no host sync, the first write's mean and steps kept."""
    n_kv, d, S = 2, 32, 100
    eager, _ = unscaled_cache(2, n_kv, d, S, S + 28, kt_dtype)
    compiled, _ = unscaled_cache(2, n_kv, d, S, S + 28, kt_dtype)
    k, v = keys_and_values(2, n_kv, 1, d, seed=9)
    write = torch.compile(compiled.update, fullgraph=True)
    eager.update(torch.tensor([S]), k, v)
    write(torch.tensor([S]), k, v)
    for name in ("k_t", "chan", "kt_mean", "k", "sums", "live_length"):
        assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
