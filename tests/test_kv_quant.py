"""The quantized KV cache (--kv-dtype int8, --kt-dtype int8/int4): what it stores against the values
written (each element within half a quantization step of its row's scale), writes that never revise
an earlier position (one position at a time stores what one prefill stores; truncate or restore then
rewrite stores what writing directly stores), the running sums of exactly the stored values, every
policy on the quantized cache equal to the same policy on a float cache holding its dequantized
values, the bytes it allocates and moves, and the command line."""
from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import pytest
import torch

import generate
from conftest import assert_one_line_error, channels_file, run_main
from cache import QMAX, KVCache, KVFormat, quantize_symmetric, unpack_int4
from decoding import Generator
from model import ModelArgs, Transformer
from policies import POLICIES, AttentionSettings, policy_factory
from sparq_adaptive import StepCosts
from test_generate import run_generate
from test_ragged import alone, run_rows, tiny_model

N_KV, D = 2, 16
# (--kv-dtype, --kt-dtype, --kt-scale-dtype): every quantized layout, and a K^T's own scales in bf16
FORMATS = [("int8", "same", "float32"), ("int8", "int4", "float32"), ("auto", "int8", "float32"),
           ("auto", "int4", "float32"), ("int8", "int8", "float32"), ("int8", "int4", "bfloat16"),
           ("auto", "int8", "bfloat16"), ("auto", "int4", "bfloat16")]


def kv(B: int, T: int, seed: int, outlier: float = 8.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V (B, n_kv, T, d); K's channel 3 is an outlier channel, as real keys have."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, N_KV, T, D, generator=gen), torch.randn(B, N_KV, T, D, generator=gen)
    k[..., 3] *= outlier
    return k, v


def filled(kv_dtype: str, kt_dtype: str, kt_scale_dtype: str = "float32", B: int = 2, T: int = 37, steps: int = 6,
           seed: int = 0) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A cache written by a prefill of T positions then `steps` one-position writes; and what was written."""
    cache = KVCache(B, 64, N_KV, D, torch.float32, kv_dtype=kv_dtype, kt_dtype=kt_dtype, kt_scale_dtype=kt_scale_dtype)
    k, v = kv(B, T + steps, seed)
    cache.update(torch.arange(T), k[:, :, :T], v[:, :, :T])
    for t in range(T, T + steps):
        cache.update(torch.tensor([t]), k[:, :, t:t + 1], v[:, :, t:t + 1])
    return cache, k, v


def test_quantize_symmetric_is_within_half_a_step():
    x = torch.randn(5, 7, 33) * torch.logspace(-3, 3, 33)
    for qmax in QMAX.values():
        q, scale = quantize_symmetric(x, qmax)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= qmax
        assert torch.all((q.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 * (1 + 1e-5))
    assert torch.equal(quantize_symmetric(torch.zeros(2, 4), 7)[0], torch.zeros(2, 4, dtype=torch.int8))


def test_unpack_int4_reads_low_then_high_nibbles():
    packed = torch.tensor([[0x1F, 0x88, 0x07]], dtype=torch.uint8)
    assert unpack_int4(packed, 5).tolist() == [[7, -7, 0, 0, -1]]


@pytest.mark.parametrize("kv_dtype, kt_dtype, kt_scale_dtype", FORMATS)
def test_stored_values_within_half_a_step_and_sums_of_what_is_stored(kv_dtype, kt_dtype, kt_scale_dtype):
    cache, k, v = filled(kv_dtype, kt_dtype, kt_scale_dtype)
    n = k.shape[2]
    chan = k[:, :, :37].abs().amax(2)  # the prefill's per-channel absmax (no channel is near zero here)
    torch.testing.assert_close(cache.chan[:2], chan)
    kn = k / chan[:, :, None]
    rk, rv = cache.read(slice(0, 2), 0, n)
    if kv_dtype == "int8":
        step_k = kn.abs().amax(-1, keepdim=True) / 127 * chan[:, :, None]  # per element: its row's step x its channel's scale
        assert torch.all((rk - k).abs() <= step_k / 2 * (1 + 1e-5) + 1e-6)
        assert torch.all((rv - v).abs() <= v.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5) + 1e-6)
    else:
        assert torch.equal(rk, k) and torch.equal(rv, v)
    kt = cache.read_k_t(slice(0, 2), 0, n)
    qmax = QMAX[cache.kt_storage]
    step_t = (kn.abs().amax(-1, keepdim=True) / qmax * chan[:, :, None]).transpose(-1, -2)
    rounding = 2.0 ** -8 if kt_scale_dtype == "bfloat16" else 1e-5  # the step as stored: bf16 rounds it by <= 2^-8
    assert torch.all((kt - k.transpose(-1, -2)).abs() <= step_t / 2 * (1 + rounding) + 1e-6)
    if cache.kt_scale is not None:
        assert cache.kt_scale.dtype == getattr(torch, kt_scale_dtype)
    if kv_dtype == "int8" and cache.kt_storage == "int8":  # K^T is K's int8 transposed, sharing its scales
        assert cache.kt_scale is None and torch.equal(kt, rk.transpose(-1, -2))
    # the running sums are fp32 sums of exactly the values stored
    torch.testing.assert_close(cache.sums[:2, :, 0], rv.sum(2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.sums[:2, :, 1], rk.sum(2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.sums[:2, :, 2], (rk * rk).sum(2), rtol=1e-5, atol=1e-4)


def buffers(cache: KVCache, n: int) -> dict[str, torch.Tensor]:
    """Every position-indexed buffer's first n positions (K^T int4: the bytes holding them)."""
    out = {"k": cache.k[:, :, :n], "v": cache.v[:, :, :n], "chan": cache.chan}
    for name in ("k_scale", "v_scale", "kt_scale"):
        if getattr(cache, name) is not None:
            out[name] = getattr(cache, name)[:, :, :n]
    out["k_t"] = cache.k_t[..., :(n + 1) // 2] if cache.kt_storage == "int4" else cache.k_t[..., :n]
    return out


def assert_same(a: KVCache, b: KVCache, n: int) -> None:
    assert torch.equal(a.live_length, b.live_length)
    ba, bb = buffers(a, n), buffers(b, n)
    for name in ba:
        if name == "k_t" and n % 2:  # the byte of an odd length's last position holds it in its low nibble only
            assert torch.equal(ba[name][..., :-1], bb[name][..., :-1]), name
            assert torch.equal(ba[name][..., -1] & 0xF, bb[name][..., -1] & 0xF), name
        else:
            assert torch.equal(ba[name], bb[name]), name
    torch.testing.assert_close(a.sums, b.sums, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kv_dtype, kt_dtype, kt_scale_dtype", FORMATS)
@pytest.mark.parametrize("start", [0, 1])
def test_writes_one_at_a_time_store_what_one_write_stores(kv_dtype, kt_dtype, kt_scale_dtype, start):
    """A position's bytes depend on it alone (and on the row's channel scale, fixed by its first write):
    the int4 K^T's shared bytes are read, modified and written, never clobbered."""
    k, v = kv(2, 29, 5)
    whole, split = (KVCache(2, 64, N_KV, D, torch.float32, kv_dtype=kv_dtype, kt_dtype=kt_dtype,
                            kt_scale_dtype=kt_scale_dtype) for _ in range(2))
    whole.update(torch.arange(10), k[:, :, :10], v[:, :, :10])
    split.update(torch.arange(10), k[:, :, :10], v[:, :, :10])
    whole.update(torch.arange(10 + start, 29), k[:, :, 10 + start:], v[:, :, 10 + start:]) if start == 0 else None
    if start:  # an odd first position: one write, then a write that begins inside a byte
        whole.update(torch.tensor([10]), k[:, :, 10:11], v[:, :, 10:11])
        whole.update(torch.arange(11, 29), k[:, :, 11:], v[:, :, 11:])
    for t in range(10, 29):
        split.update(torch.tensor([t]), k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert_same(whole, split, 29)


@pytest.mark.parametrize("kv_dtype, kt_dtype, kt_scale_dtype", FORMATS)
def test_truncate_and_restore_then_rewrite_store_what_writing_directly_stores(kv_dtype, kt_dtype, kt_scale_dtype):
    k, v = kv(1, 40, 7)
    k2, v2 = kv(1, 40, 8)
    fmt = dict(kv_dtype=kv_dtype, kt_dtype=kt_dtype, kt_scale_dtype=kt_scale_dtype)
    direct = KVCache(1, 64, N_KV, D, torch.float32, **fmt)
    direct.update(torch.arange(21), k[:, :, :21], v[:, :, :21])
    direct.update(torch.arange(21, 40), k2[:, :, 21:], v2[:, :, 21:])
    rolled = KVCache(1, 64, N_KV, D, torch.float32, **fmt)
    rolled.update(torch.arange(21), k[:, :, :21], v[:, :, :21])
    state = rolled.snapshot()
    rolled.update(torch.arange(21, 40), k[:, :, 21:], v[:, :, 21:])
    rolled.restore(state)
    rolled.update(torch.arange(21, 40), k2[:, :, 21:], v2[:, :, 21:])
    assert_same(rolled, direct, 40)
    rolled.update(torch.arange(40, 45), k2[:, :, :5], v2[:, :, :5])
    rolled.truncate(0, 40)
    assert_same(rolled, direct, 40)
    # emptied, a row's next first write fixes a new channel scale
    rolled.truncate(0, 0)
    fresh = KVCache(1, 64, N_KV, D, torch.float32, **fmt)
    for cache in (rolled, fresh):
        cache.update(torch.arange(40), k2, v2)
    assert_same(rolled, fresh, 40)


def dequantized_copy(cache: KVCache, n: int) -> KVCache:
    """A float cache (layout twice) holding exactly the quantized cache's values, K^T's own included."""
    B = cache.max_batch
    copy = KVCache(B, cache.max_seq_length, N_KV, D, torch.float32)
    copy.k[:, :, :n], copy.v[:, :, :n] = cache.read(slice(0, B), 0, n)
    copy.k_t[..., :n] = cache.read_k_t(slice(0, B), 0, n)
    copy.sums.copy_(cache.sums)
    copy.live_length.copy_(cache.live_length)
    return copy


STATELESS = [p for p in POLICIES if p != "h2o"]  # H2O's state comes from observing the prefill: below, on a model


@pytest.mark.parametrize("kv_dtype, kt_dtype, kt_scale_dtype", FORMATS)
@pytest.mark.parametrize("policy", STATELESS)
def test_each_policy_on_the_quantized_cache_equals_it_on_a_dequantized_copy(policy, kv_dtype, kt_dtype, kt_scale_dtype):
    cache, _, _ = filled(kv_dtype, kt_dtype, kt_scale_dtype, T=50, steps=3)
    n = 53
    copy = dequantized_copy(cache, n)
    args = tiny_model().args
    settings = AttentionSettings(policy, sparq_r=5 if "sparq_r" in POLICIES[policy].flags else None, sparq_k=16,
                                 kv_budget=24 if POLICIES[policy].knob == "kv_budget" else None,
                                 compression=0.25 if policy == "sparq-adaptive" else None)
    args = args.__class__(**{**vars(args), "head_dim": D, "n_kv_head": N_KV})
    make = policy_factory(replace(settings, channels=channels_file(args)), args)
    q = torch.randn(2, N_KV, 2, D, generator=torch.Generator().manual_seed(3))
    on_copy = make(0)
    if policy == "sparq-adaptive":  # its split follows the bytes a cache stores: on the copy, the quantized one's
        on_copy.attend = partial(on_copy.attend_torch, costs=StepCosts.of(cache.format, cache.dtype, D))
    assert torch.equal(make(0)(q, cache, n), on_copy(q, copy, n))


@pytest.mark.parametrize("kv_dtype, kt_dtype", [("int8", "int4"), ("auto", "int4")])
@pytest.mark.parametrize("policy", ["dense", "sparq", "h2o", "quest"])
def test_rows_of_a_ragged_batch_on_a_quantized_cache_equal_each_row_alone(policy, kv_dtype, kt_dtype, monkeypatch):
    """The padding of a ragged prefill does not reach a row's channel scale: each row stores, and
    generates, what its prompt alone does."""
    model = tiny_model()
    fmt = KVFormat("twice", kv_dtype, kt_dtype)
    setup = Transformer.setup_caches
    monkeypatch.setattr(Transformer, "setup_caches", lambda self, b, n, kv_format=fmt, **kw: setup(self, b, n, fmt, **kw))
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 70, 33)]
    settings = AttentionSettings(policy, sparq_r=6 if policy == "sparq" else None, sparq_k=24,
                                 kv_budget=24 if POLICIES[policy].knob == "kv_budget" else None)
    assert run_rows(model, rows, 12, settings) == alone(model, rows, 12, settings)
    assert model.caches[0].kv_storage == ("int8" if kv_dtype == "int8" else "float32")


def test_an_int8_cache_keeps_the_float_caches_next_token_distribution():
    """Dense decode over an int8 K/V cache: next-token distributions within a small total-variation
    distance of the fp32 cache's, on a model whose keys have an outlier channel."""
    model = tiny_model(scale=1.0)
    prompt = torch.randint(0, 101, (1, 60), generator=torch.Generator().manual_seed(2))
    probs = {}
    for kv_dtype in ("auto", "int8"):
        model.setup_caches(1, 80, KVFormat(kv_dtype=kv_dtype))
        with torch.no_grad():
            model.prefill(prompt, torch.arange(60), 60)
            logits = model.decode(torch.tensor([[7]]), torch.tensor([60]), 61)
        probs[kv_dtype] = torch.softmax(logits.reshape(-1, logits.shape[-1])[-1].float(), -1)
    assert 0 < (probs["auto"] - probs["int8"]).abs().sum() / 2 < 0.01


def allocation_formula(n_layer: int, n_kv: int, d: int, B: int, S: int, fmt: KVFormat) -> int:
    """The bytes of an fp32-activation cache by hand: per position K and V (4 bytes, or 1 + a 4-byte scale
    when int8), K^T (4, 1 or 1/2 bytes, + its own 4-byte scale, 2 in bf16, unless it shares int8 K's); per row and
    head three fp32 sums of d, a channel scale of d when anything is quantized, and an int4 K^T's padding: each
    of its d rows holds S / 2 bytes, a spare byte column and up to 15 more, to a multiple of 16 bytes."""
    int8_kv, kt = fmt.kv_dtype == "int8", fmt.kt_dtype if fmt.kt_dtype != "same" else fmt.kv_dtype
    per_position = 2 * (d * (1 if int8_kv else 4) + (4 if int8_kv else 0))
    if fmt.layout == "twice":
        shared = kt == "int8" and int8_kv
        own_scale = {"float32": 4, "bfloat16": 2}[fmt.kt_scale_dtype]
        per_position += d * {"int8": 1, "int4": 0.5}.get(kt, 4) + (own_scale if kt in ("int8", "int4") and not shared else 0)
    quantized = int8_kv or (fmt.layout == "twice" and kt in ("int8", "int4"))
    int4_padding = 16 * (S // 32 + 1) - S // 2  # S / 2 + 1 bytes rounded up to 16 (S a multiple of 32, as here)
    per_row = (S * per_position + 3 * d * 4 + (d * 4 if quantized else 0)
               + (d * int4_padding if fmt.layout == "twice" and kt == "int4" else 0))
    return round(B * n_kv * per_row) * n_layer


def test_bytes_allocated_and_moved():
    """cache_bytes is what setup_caches allocates, and both are the allocation formula; decode_kv_bytes
    counts stored bytes: int8 rows of d plus a 4-byte scale, step 1's int4 K^T elements at half a byte
    plus a 4-byte scale per position."""
    model = tiny_model(head_dim=16, n_kv_head=2, n_layer=2)
    args, d, S = model.args, 16, 300
    for kv_dtype, kt_dtype, layout, scale in itertools.product(("auto", "float32", "int8"), ("same", "int8", "int4"),
                                                               ("twice", "once"), ("float32", "bfloat16")):
        own_scale = layout == "twice" and kt_dtype in ("int8", "int4") and (kv_dtype, kt_dtype) != ("int8", "int8")
        if (layout == "once" and kt_dtype != "same") or (scale == "bfloat16" and not own_scale):
            continue
        fmt = KVFormat(layout, kv_dtype, kt_dtype, scale)
        model.setup_caches(3, 256, fmt)
        expected = allocation_formula(2, 2, d, 3, 256, fmt)
        assert model.kv_cache_bytes() == expected == Transformer.cache_bytes(args, 3, 256, fmt, torch.float32), fmt
    model.setup_caches(1, 512, KVFormat("twice", "int8", "int4"))
    dense = policy_factory(AttentionSettings("dense"), args)
    sparq = policy_factory(AttentionSettings("sparq", sparq_r=4, sparq_k=32), args)
    per_layer_head = args.n_layer * args.n_kv_head
    assert model.decode_kv_bytes(S, 1, [dense(i) for i in range(2)]) == per_layer_head * (2 * S + 2) * (d + 4)
    sparq_bytes = S * (4 * 0.5 + 4) + (2 * 32 + 4) * (d + 4)
    assert model.decode_kv_bytes(S, 1, [sparq(i) for i in range(2)]) == round(per_layer_head * sparq_bytes)
    model.setup_caches(1, 512, KVFormat("twice", "int8", "int4", "bfloat16"))  # step 1 reads 2 bytes of scale
    sparq_bytes = S * (4 * 0.5 + 2) + (2 * 32 + 4) * (d + 4)
    assert model.decode_kv_bytes(S, 1, [sparq(i) for i in range(2)]) == round(per_layer_head * sparq_bytes)


def test_int8_kv_with_int4_kt_is_under_seven_tenths_of_a_bf16_cache_with_one_k():
    """The issue's memory goal, from cache_bytes (what setup_caches allocates, test_bytes_allocated_and_moved):
    K, V int8 and K^T int4 with every scale, against dense's bf16 K and V (layout once)."""
    args = tiny_model(head_dim=64, n_kv_head=8, n_head=8).args
    quantized = Transformer.cache_bytes(args, 4, 32768, KVFormat("twice", "int8", "int4"), torch.bfloat16)
    bf16_once = Transformer.cache_bytes(args, 4, 32768, KVFormat("once"), torch.bfloat16)
    assert quantized <= 0.7 * bf16_once


def test_a_compression_target_is_solved_in_the_bytes_the_cache_stores():
    """--compression on a quantized cache counts stored bytes (scales included) against dense on the same
    cache: an int4 K^T affords more components than a float one at the same target, the r solved is
    the closest, and its compression is what the model's own byte count gives with that cache."""
    from fractions import Fraction

    from budgets import Storage, model_compression, settings_for_compression, solve_target

    from policies import AttentionSettings

    model = tiny_model(head_dim=64, n_layer=2, max_context=2048)
    S, fmt = 1500, KVFormat("twice", "int8", "int4")
    storage = Storage(fmt, torch.float32)
    target = AttentionSettings("sparq", sparq_k=64, compression=Fraction(1, 4))
    on_floats, on_int4 = solve_target(target, S, model.args), solve_target(target, S, model.args, storage)
    assert on_int4.r > on_floats.r
    model.setup_caches(1, S + 8, fmt)

    def achieved(r: int) -> float:
        settings = replace(on_int4.settings, sparq_r=r)
        return model_compression(model, S, [policy_factory(settings, model.args)(i) for i in range(2)])

    assert achieved(on_int4.r) == pytest.approx(on_int4.achieved, rel=1e-6)
    assert all(abs(achieved(r) - 0.25) >= abs(on_int4.achieved - 0.25) for r in (on_int4.r - 1, on_int4.r + 1))
    assert settings_for_compression(target, 0.25, S, model.args, Storage(KVFormat(), torch.bfloat16))[0] == \
        on_floats.settings  # a float cache: the paper's element ratio, whatever its dtype


def test_generate_runs_on_a_quantized_cache_and_refuses_kt_dtype_with_one_k():
    tiny = ["--random-weights", "tiny", "--prompt-tokens", "40", "--max-new-tokens", "6"]
    out = run_generate(*tiny, "--kv-dtype", "int8", "--kt-dtype", "int4", "--sparq-r", "4", "--sparq-k", "8")
    assert out.returncode == 0, out.stderr
    assert "K/V int8, K^T int4" in out.stderr
    assert_one_line_error(run_main(generate.main, *tiny, "--kv-layout", "once", "--kt-dtype", "int4"), "--kv-layout once")
    assert_one_line_error(run_main(generate.main, *tiny, "--dtype", "float32", "--kv-dtype", "bfloat16"),
                          "--kv-dtype bfloat16")
    out = run_generate(*tiny, "--kt-dtype", "int4", "--kt-scale-dtype", "bfloat16", "--sparq-r", "4", "--sparq-k", "8")
    assert out.returncode == 0, out.stderr
    assert "K^T int4 with bfloat16 scales" in out.stderr
    assert_one_line_error(run_main(generate.main, *tiny, "--kv-dtype", "int8", "--kt-dtype", "int8", "--kt-scale-dtype",
                                       "bfloat16"), "--kt-scale-dtype")  # K^T is K's int8: K's scales, none of its own


def int8_dense_vnni_reference(q: torch.Tensor, cache: KVCache, b: int, n: int) -> torch.Tensor:
    """Dense attention over positions [0, n) of an int8 cache, rounded as the C++ kernel's VNNI path
    rounds (csrc/dense_decode.cpp), for rows of one chunk (n <= 1024): q * chan to int8 with one
    scale per (head, lane of 4 channels, shared by the 64-channel blocks), and each head's softmax
    weights (times V's scales) to int16 with its largest at 32767. Row b: q (1, n_kv, g, d) -> (1, n_kv, g, d)."""
    _, n_kv, g, d = q.shape
    k, v = cache.k[b:b + 1, :, :n].double(), cache.v[b:b + 1, :, :n].double()
    k_scale, v_scale = cache.k_scale[b:b + 1, :, None, :n].double(), cache.v_scale[b:b + 1, :, None, :n].double()
    qf = q.float() * cache.chan[b:b + 1, :, None, :]
    lanes = qf.view(1, n_kv, g, d // 64, 16, 4)
    m = lanes.abs().amax(dim=(3, 5), keepdim=True)
    q8 = torch.round(lanes * torch.where(m > 0, 127.0 / m, torch.zeros_like(m)))  # fp32, as the kernel
    q_hat = (q8 * (m / 127.0)).double().view(1, n_kv, g, d)
    logits = (q_hat @ k.transpose(2, 3)) * (1.0 / d ** 0.5) * k_scale
    e = torch.exp(logits - logits.amax(-1, keepdim=True))  # (1, n_kv, g, n)
    w = (e * v_scale).float()
    w_max = w.amax(-1, keepdim=True)
    w16 = torch.round(w * (32767.0 / w_max)).double()
    return ((w16 @ v) * (w_max.double() / 32767.0) / e.sum(-1, keepdim=True)).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 40, 128])
def test_fused_dense_kernel_reads_an_int8_cache_as_its_dequantized_copy(fused_cpu_kernels, dtype, d):
    """The C++ dense kernel on the int8 buffers and their scales against the torch path on the
    dequantized values: one query per row, ragged rows, and T queries per row (verification). Where
    the build quantizes q and the weights (VNNI, d a multiple of 64), against a reference that
    rounds alike, and within the rounding's bound of the torch path."""
    from kernels import dense_attention_cpu, dense_verify_cpu
    from attention import dense_attention_torch

    B, n_kv, g, S = 3, 2, 3, 300
    cache = KVCache(B + 1, 320, n_kv, d, dtype, kv_dtype="int8")
    gen = torch.Generator().manual_seed(d)
    k = torch.randn(B, n_kv, S, d, generator=gen) * (1 + 4 * (torch.arange(d) == 1))
    cache.update(torch.arange(S), k.to(dtype), torch.randn(B, n_kv, S, d, generator=gen).to(dtype))
    q = torch.randn(B, n_kv, g, d, generator=gen).to(dtype)
    stored, readable = cache.view(S, B, stored=True), cache.view(S, B)
    assert stored.k.dtype == torch.int8 and stored.scales is not None
    vnni = d % 64 == 0 and torch.ops.sparq.dense_int8_path() == "vnni"
    # the VNNI path against its own rounding: 1e-4, where an int16 weight's rounding can flip
    tol = dict(rtol=1e-4 if vnni else 1e-5, atol=1e-4 if vnni else 1e-5) if dtype == torch.float32 \
        else dict(rtol=2e-2, atol=2e-2)

    def reference(q: torch.Tensor, b: int, n: int) -> torch.Tensor:  # row b: q (1, n_kv, g, d)
        if vnni:
            return int8_dense_vnni_reference(q, cache, b, n)
        return dense_attention_torch(q, readable.k[b:b + 1], readable.v[b:b + 1], n)

    fused = dense_attention_cpu(q, stored.k, stored.v, S, scales=stored.scales)
    for b in range(B):
        torch.testing.assert_close(fused[b:b + 1], reference(q[b:b + 1], b, S), **tol)
    if vnni:  # what quantizing q and the weights costs against the fp32 arithmetic: a small share of |V|
        exact = dense_attention_torch(q, readable.k, readable.v, S)
        assert (fused.float() - exact.float()).abs().max() <= 5e-3 * readable.v.abs().max()
    lengths = torch.tensor([S, 17, 150])
    ragged = dense_attention_cpu(q, stored.k, stored.v, S, lengths, scales=stored.scales)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(ragged[b:b + 1], reference(q[b:b + 1], b, n), **tol)
    T = 4
    qv = torch.randn(B, n_kv, g, T, d, generator=gen).to(dtype)
    verified = dense_verify_cpu(qv, stored.k, stored.v, S, lengths, scales=stored.scales)
    for b, n in enumerate(lengths.tolist()):
        for t in range(T):
            torch.testing.assert_close(verified[b:b + 1, :, :, t], reference(qv[b:b + 1, :, :, t], b, n - T + 1 + t),
                                       **tol)


def dequantized_fp32(cache: KVCache, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V (B, n_kv, n, d) and K^T (B, n_kv, d, n) of a quantized cache in fp32, from its buffers."""
    chan = cache.chan[:, :, None]
    k, v = cache.k[:, :, :n].float(), cache.v[:, :, :n].float()
    if cache.kv_storage == "int8":
        k, v = k * cache.k_scale[:, :, :n, None] * chan, v * cache.v_scale[:, :, :n, None]
    if cache.k_t is None:
        return k, v, None
    q = unpack_int4(cache.k_t, 2 * cache.k_t.shape[-1])[..., :n] if cache.kt_storage == "int4" else cache.k_t[..., :n]
    return k, v, q.float() * cache.k_t_scale[:, :, None, :n].float() * chan.transpose(-1, -2)


SPARQ_FORMATS = [("once", "int8", "same", "float32")] + [("twice", *fmt) for fmt in FORMATS]


def quantized_cases(layout: str, kv_dtype: str, kt_dtype: str, kt_scale_dtype: str, dtype: torch.dtype, d: int):
    """The fused SparQ kernels' cases on a quantized cache, n_kv = 3, g = 2: three ragged rows of odd
    lengths (an int4 byte half used), then one long row split over the threads in chunks. Yields
    (cache, q, the stored view, K, V, K^T dequantized to fp32, the length read, the rows' live lengths)."""
    n_kv, g = 3, 2
    for S, lengths in ((301, torch.tensor([301, 17, 150])), (4097, None)):
        rows = 3 if lengths is not None else 1
        cache = KVCache(rows, S + 63, n_kv, d, dtype, layout=layout, kv_dtype=kv_dtype, kt_dtype=kt_dtype,
                        kt_scale_dtype=kt_scale_dtype)
        gen = torch.Generator().manual_seed(S + d)
        k = torch.randn(rows, n_kv, S, d, generator=gen) * (1 + 4 * (torch.arange(d) == 1))
        cache.update(torch.arange(S), k.to(dtype), torch.randn(rows, n_kv, S, d, generator=gen).to(dtype))
        if lengths is not None:
            cache.set_live_lengths(lengths)
        q = torch.randn(rows, n_kv, g, d, generator=gen).to(dtype)
        k, v, k_t = dequantized_fp32(cache, S)  # bf16 copies would round the values the kernel reads exactly
        live = None if lengths is None else cache.live_length[:rows]
        yield cache, q, cache.view(S, rows, stored=True), k, v, k_t, S, live


@pytest.mark.parametrize("layout, kv_dtype, kt_dtype, kt_scale_dtype", SPARQ_FORMATS)
@pytest.mark.parametrize("dtype, d, mean_v", [(torch.float32, 16, True), (torch.float32, 64, False),
                                              (torch.bfloat16, 64, True), (torch.float32, 40, False)])
def test_fused_sparq_kernel_reads_a_quantized_cache_as_its_dequantized_copy(fused_cpu_kernels, threads, layout,
                                                                            kv_dtype, kt_dtype, kt_scale_dtype, dtype,
                                                                            d, mean_v):
    """The C++ SparQ kernel on the stored buffers (int8 K/V, int8 or int4 K^T, their scales) against the
    torch path on the dequantized values: ragged rows of odd lengths (an int4 byte half used), and one
    long row split over the threads in chunks."""
    from kernels import sparq_attention_cpu
    from sparq import sparq_attention_torch

    torch.set_num_threads(2)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for _, q, stored, k, v, k_t, S, live in quantized_cases(layout, kv_dtype, kt_dtype, kt_scale_dtype, dtype, d):
        for r in (5, min(12, d)):  # one group of K^T rows, and two (partial sums kept between them)
            args = (S, live, r, 48, 12, mean_v)
            fused = sparq_attention_cpu(q, stored.k, stored.k_t, stored.v, stored.v_sum, *args, scales=stored.scales)
            expected = sparq_attention_torch(q.float(), k, k_t, v, stored.v_sum, *args).to(dtype)
            torch.testing.assert_close(fused, expected, **tol)


@pytest.mark.parametrize("layout, kv_dtype, kt_dtype, kt_scale_dtype", SPARQ_FORMATS)
@pytest.mark.parametrize("dtype, d, mean_v", [(torch.float32, 16, True), (torch.bfloat16, 64, False),
                                              (torch.float32, 40, False)])
def test_fused_adaptive_kernel_reads_a_quantized_cache_as_its_dequantized_copy(fused_cpu_kernels, threads, layout,
                                                                               kv_dtype, kt_dtype, kt_scale_dtype,
                                                                               dtype, d, mean_v):
    """The C++ adaptive SparQ kernel on the stored buffers against the torch path on the dequantized
    values, both splitting the budget at the cache's costs (more components on a smaller K^T): ragged
    rows of odd lengths, and one long row split over the threads in chunks."""
    from kernels import sparq_adaptive_cpu
    from sparq_adaptive import key_spread, sparq_adaptive_attention_torch

    torch.set_num_threads(2)
    for cache, q, stored, k, v, k_t, S, live in quantized_cases(layout, kv_dtype, kt_dtype, kt_scale_dtype, dtype, d):
        spread = key_spread(stored.k_moments[:q.shape[0]], S if live is None else live)
        costs = StepCosts.of(cache.format, dtype, d)
        args = (S, live, 1 / 4, 32, 48, mean_v)  # dense up to 32 positions, k at most 48
        fused = sparq_adaptive_cpu(q, stored.k, stored.k_t, stored.v, stored.v_sum, spread, *args,
                                   scales=stored.scales, costs=costs)
        expected = sparq_adaptive_attention_torch(q.float(), k, k_t, v, stored.v_sum, spread, *args,
                                                  costs=costs).to(dtype)
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused, expected, **tol)


@pytest.mark.parametrize("fmt, settings, prompt_length, new_tokens", [
    (KVFormat("twice", "int8", "same"), AttentionSettings("dense"), 40, 20),
    (KVFormat("twice", "int8", "int4"), AttentionSettings("sparq", sparq_r=6, sparq_k=32), 90, 30),
    (KVFormat("twice", "auto", "int4"), AttentionSettings("sparq-adaptive", sparq_k=32, compression=1 / 4), 90, 30),
    (KVFormat("twice", "auto", "int4", "bfloat16"), AttentionSettings("sparq-adaptive", sparq_k=32, compression=1 / 4),
     90, 30),
])
def test_a_model_on_a_quantized_cache_generates_alike_with_the_fused_and_the_torch_paths(
        fused_cpu_kernels, fmt, settings, prompt_length, new_tokens):
    """Greedy tokens of a model whose decode reads the quantized cache in the C++ kernels (dense on int8
    K/V; SparQ on int8 K/V and an int4 K^T) equal those of the torch path on its dequantized copy (fp32:
    the two differ by rounding only)."""
    import kernels

    prompt = torch.randint(0, 101, (2, prompt_length), generator=torch.Generator().manual_seed(prompt_length)).tolist()
    out = {}
    for name, kern in (("torch", kernels.TORCH_KERNELS), ("cpu", kernels.CPU_KERNELS)):
        model = tiny_model(kernels=kern)
        model.setup_caches(2, prompt_length + new_tokens + 10, fmt)
        model.set_decode_attention(policy_factory(settings, model.args, kern))
        out[name] = Generator(model).generate(prompt, new_tokens)[0]
    assert out["cpu"] == out["torch"]


@pytest.mark.parametrize("policy", ["dense", "sparq", "sparq-adaptive"])
def test_the_compiled_decode_step_reads_a_quantized_cache_as_the_eager_one(fused_cpu_kernels, policy):
    """torch.compile (inductor's C++ wrapper) around the quantized cache's kernels: the eager tokens."""
    import kernels

    model = tiny_model(kernels=kernels.CPU_KERNELS)
    rows = torch.randint(0, 101, (2, 70), generator=torch.Generator().manual_seed(9)).tolist()
    settings = AttentionSettings(policy, sparq_r=6 if policy == "sparq" else None, sparq_k=24,
                                 compression=1 / 4 if policy == "sparq-adaptive" else None)
    out = []
    for compile_decode in (False, True):
        model.setup_caches(2, 100, KVFormat("twice", "int8", "int4"))
        model.set_decode_attention(policy_factory(settings, model.args, kernels.CPU_KERNELS))
        out.append(Generator(model, compile_decode=compile_decode).generate(rows, 12)[0])
    assert out[0] == out[1]


def test_resolve_kernels_keeps_what_reads_a_quantized_cache_and_says_what_falls_back(fused_cpu_kernels):
    from kernels import resolve_kernels

    said = []
    cpu = resolve_kernels("cpu", "cpu", int8_kv=True, quantized_kt=True, announce=said.append)
    assert cpu.dense_attention is not None and cpu.dense_verify is not None and cpu.sparq_attention is not None
    assert cpu.sparq_adaptive is not None and said == []
    import kernels_triton
    if kernels_triton.HAS_TRITON:  # the Triton kernels read it too (tests/test_kernels_triton.py)
        triton = resolve_kernels("triton", "cuda", int8_kv=True, quantized_kt=True, announce=said.append)
        assert triton.dense_attention and triton.dense_verify and triton.sparq_attention and said == []


# ---------------------------------------------------------------------------------------------
# --kt-dtype auto: the K^T storage a run gets by default
# ---------------------------------------------------------------------------------------------


def test_kt_auto_is_int4_on_the_cpu_for_the_policies_that_scan_it():
    from assemble import kt_storage_for

    for policy in ("sparq", "sparq-fixed-r", "sparq-adaptive", "doublesparse"):
        assert kt_storage_for("auto", "twice", "cpu", [policy]) == "int4"
        assert kt_storage_for("auto", "twice", "cpu", ["dense", policy]) == "int4"  # one cache for the run
    for policy in ("dense", "quest", "h2o", "local", "rocketkv-hybrid"):
        assert kt_storage_for("auto", "twice", "cpu", [policy]) == "same"  # K^T is never read: as before
    assert kt_storage_for("auto", "twice", "cuda", ["sparq"]) == "same"  # not yet timed on a GPU
    assert kt_storage_for("auto", "once", "cpu", ["sparq"]) == "same"  # no K^T kept
    assert kt_storage_for("same", "twice", "cpu", ["sparq"]) == "same"
    assert kt_storage_for("int8", "twice", "cuda", ["dense"]) == "int8"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["smollm2", "llama-3.1-8b"])
def test_the_default_sparq_cache_is_at_most_1_15x_dense(shape, dtype):
    """The whole cache as allocated (K, V, the int4 K^T and its scales, the running sums) against K and V
    alone, at 8k positions: a K^T in the activations' dtype made it 1.5x."""
    args = ModelArgs.from_shape(shape)
    dense = Transformer.cache_bytes(args, 1, 8192, KVFormat("once"), dtype)
    default = Transformer.cache_bytes(args, 1, 8192, KVFormat("twice", "auto", "int4"), dtype)
    same = Transformer.cache_bytes(args, 1, 8192, KVFormat("twice"), dtype)
    assert default / dense <= 1.15 and same / dense >= 1.49
