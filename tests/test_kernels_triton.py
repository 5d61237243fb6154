"""Triton decode kernels against their references: kernels_triton.sparq_attention_triton against the
oracle `sparq.sparq_reference`, kernels_triton.dense_attention_triton against `attention.dense_attention_torch`.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton); on a CUDA machine they compile and run for real.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
pytest.importorskip("triton")

import kernels  # noqa: E402
import kernels_triton  # noqa: E402
from attention import dense_attention_torch  # noqa: E402
from cache import KVCache  # noqa: E402
from sparq import SparQConfig, selection_has_ties, sparq_reference  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
REPO = Path(__file__).resolve().parent.parent

# fp32: the kernels compute in fp32 (the interpreter's dots are exact fp32; on GPU tf32x3 is ~fp32).
# bf16: inputs are identical for both sides and both compute in fp32, so the outputs differ by the
# final rounding to bf16 (one ulp = 2^-8 relative) plus fp32 noise: atol = rtol = 1e-2.
# fp16: the kernels' native 16-bit dots (the GPU's bf16 paths; the interpreter evaluates fp16 dots
# right, not bf16 ones): probabilities cast to V's dtype before the PV dot, as the torch path does.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


def untie(gen, q, k, lengths, config) -> None:
    """Redraw (in place) q and the live K rows of every (row, KV head) whose selection has a tie."""
    B, n_kv, g, d = q.shape
    for b in range(B):
        S = lengths[b]
        for h in range(n_kv):
            for _ in range(500):
                if not selection_has_ties(q[b, h], k[b, h], S, config):
                    break
                q[b, h] = torch.randn(g, d, generator=gen).to(q.dtype)
                k[b, h, :S] = torch.randn(S, d, generator=gen).to(k.dtype)
            else:
                raise AssertionError("could not draw a selection without ties")


def make_cache(B, n_kv, g, d, S, S_max, dtype, seed, layout="twice", config=None, lengths=None):
    """q and a static cache whose dead positions (>= S, or >= lengths[b] per row) and unused batch
    rows hold NaN garbage; with a SparQ config, redrawn until its selections have no ties."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [S] * B if lengths is None else list(lengths)
    q = torch.randn(B, n_kv, g, d, generator=gen).to(dtype)
    k = torch.randn(B + 1, n_kv, S_max, d, generator=gen).to(dtype)
    v = torch.randn(B + 1, n_kv, S_max, d, generator=gen).to(dtype)
    if config is not None:
        untie(gen, q, k, lengths, config)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    k[B:] = float("nan")
    v[B:] = float("nan")
    v_sum = torch.full((B + 1, n_kv, d), float("nan"))
    v_sum[:B] = torch.stack([v[b, :, :n].float().sum(1) for b, n in enumerate(lengths)])
    k_t = k.transpose(2, 3).contiguous() if layout == "twice" else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(q), to(k), to(k_t), to(v), to(v_sum)


def triton_sparq(q, k, k_t, v, v_sum, length, config, max_length=None):
    """kernels_triton.sparq_attention_triton with an int length (exact reads), or a device-tensor live length
    and a static bound on the positions read (max_length, default S_max): the CUDA-graph form."""
    if isinstance(length, torch.Tensor):
        return kernels_triton.sparq_attention_triton(q, k, k_t, v, v_sum, max_length or k.shape[2], length, config.r,
                                              config.k_top, config.local, config.mean_v)
    return kernels_triton.sparq_attention_triton(q, k, k_t, v, v_sum, length, None, config.r, config.k_top, config.local,
                                          config.mean_v)


def as_length(S, kind):
    if kind == "int":
        return S
    dtype = torch.int32 if kind.endswith("int32") else torch.int64
    shape = (1,) if kind.startswith("vec") else ()
    return torch.full(shape, S, dtype=dtype, device=DEVICE)


# A sample of the grid (B, n_kv, g, d, S, S_max, r, k, local, mean_v, layout, dtype, length), covering
# MHA and GQA (g = 1, 3, 4, 8), d = 64 / 80 / 128, B = 1 / 3, S = 1 / 7 / 129 / 1000 (S < k
# included), r = 1 / 8 / d, mean-V on and off, both K layouts, fp32 and bf16, int and tensor lengths.
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    (1, 2, 1, 64, 1, 16, 8, 4, None, True, "twice", f32, "int"),
    (3, 2, 1, 128, 129, 160, 1, 16, None, False, "twice", f32, "scalar_int64"),
    (1, 2, 3, 80, 7, 40, 80, 16, None, True, "once", f32, "vec_int32"),
    (3, 2, 4, 64, 1000, 1024, 8, 64, None, True, "twice", f32, "int"),
    (1, 2, 8, 128, 1000, 1000, 128, 128, None, False, "once", bf16, "scalar_int64"),
    (3, 2, 4, 80, 129, 130, 8, 32, None, True, "twice", bf16, "int"),
    (1, 3, 8, 64, 129, 200, 1, 8, 0, False, "once", f32, "int"),
    (3, 2, 1, 80, 1000, 1100, 80, 128, None, True, "once", f32, "scalar_int32"),
    (3, 2, 3, 128, 7, 8, 8, 128, None, True, "twice", bf16, "vec_int64"),
    (1, 2, 1, 64, 1000, 1050, 64, 32, None, True, "twice", bf16, "scalar_int64"),
    (3, 1, 8, 80, 1, 33, 1, 8, None, False, "twice", f32, "scalar_int64"),
    (1, 2, 4, 128, 7, 7, 128, 4, 4, False, "once", f32, "int"),
    (3, 2, 3, 64, 1000, 1000, 1, 128, None, True, "once", bf16, "int"),
    (1, 2, 1, 128, 129, 256, 8, 128, None, False, "once", bf16, "scalar_int32"),
    (1, 1, 4, 80, 1000, 1200, 8, 128, 0, True, "twice", f32, "scalar_int64"),
    (3, 2, 8, 128, 129, 129, 32, 64, 16, True, "twice", f32, "int"),
    # several select chunks and a merge (S > 1024 at few rows), step 2 split over the selection
    (1, 1, 4, 64, 3000, 3100, 16, 64, None, True, "twice", f32, "scalar_int64"),
    (1, 1, 1, 64, 2500, 2500, 8, 32, 4, False, "once", bf16, "int"),
    # fp16: the native 16-bit dots of steps 1 and 2 (MHA's step 2 on tensor cores too)
    (3, 2, 1, 128, 1000, 1024, 32, 128, None, True, "twice", f16, "scalar_int64"),
    (1, 2, 4, 64, 3000, 3100, 16, 64, None, True, "twice", f16, "int"),
    (3, 2, 3, 80, 129, 130, 8, 32, None, False, "once", f16, "vec_int32"),
]


def case_id(c):
    B, n_kv, g, d, S, S_max, r, k, local, mean_v, layout, dtype, length = c
    return (f"B{B}-kv{n_kv}-g{g}-d{d}-S{S}-r{r}-k{k}-l{local}-{'meanv' if mean_v else 'nomv'}-{layout}"
            f"-{str(dtype).removeprefix('torch.')}-{length}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case):
    B, n_kv, g, d, S, S_max, r, k_top, local, mean_v, layout, dtype, length_kind = case
    config = SparQConfig(r=r, k_top=k_top, local=local, mean_v=mean_v)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S, S_max, dtype, seed=zlib.crc32(case_id(case).encode()),
                                     layout=layout, config=config)
    out = triton_sparq(q, k, k_t, v, v_sum, as_length(S, length_kind), config)
    expected = sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), S, config)
    assert out.shape == (B, n_kv, g, d) and out.dtype == dtype
    assert torch.isfinite(out).all(), "garbage past the live length leaked into the output"
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("g", [1, 2])
def test_the_gpu_plan_branches_of_many_rows_match_the_reference(g, monkeypatch):
    """The branches an H100 takes at the paper's Table 4 shape (B = 64, 32 heads, S = 4096: rows x
    cdiv(S, 256) >= 2 x 132 SMs), reached at a small shape by planning for a 4-SM device: step 1's
    256-position blocks, and the select kernel's single chunk of up to 4096 positions (rows >= SMs)."""
    monkeypatch.setattr(kernels_triton, "_device_sms", lambda device: 4)
    B, n_kv, d, S, r, k_top = 2, 2, 16, 2000, 4, 16
    plan = kernels_triton.sparq_plan(B, n_kv, g, d, S, k_top, False, sms=4)
    assert plan["step1"]["BLOCK_S"] == 256 and plan["n_chunks"] == 1 and plan["select"]["CHUNK"] == 2048
    config = SparQConfig(r=r, k_top=k_top, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S, S + 48, torch.float32, seed=40 + g, config=config)
    for length in (S, as_length(S, "scalar_int64")):
        out = triton_sparq(q, k, k_t, v, v_sum, length, config, max_length=S)
        torch.testing.assert_close(out.cpu(), sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), S, config),
                                   **TOLERANCE[torch.float32])


@pytest.mark.parametrize("g", [1, 4])
def test_step0_ties_rank_the_lower_index_first(g):
    """Step 0 with tied |q| components (every component of the upper half repeats one of the lower):
    the top r taken by the lower index first, as the reference's stable ranking does."""
    config = SparQConfig(r=8, k_top=16, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(1, 2, g, 64, 100, 128, torch.float32, seed=11, config=config)
    q[:, :, :, 40:] = q[:, :, :, :24]
    out = triton_sparq(q, k, k_t, v, v_sum, 100, config)
    torch.testing.assert_close(out.cpu(), sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), 100, config),
                               **TOLERANCE[torch.float32])


def test_static_bound_below_cache_size():
    """A tensor length with max_length < S_max: the logits and the grid are sized by the bound."""
    B, n_kv, g, d, S = 2, 2, 4, 64, 150
    config = SparQConfig(r=16, k_top=32, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S, 512, torch.float32, seed=1)
    out = triton_sparq(q, k, k_t, v, v_sum, as_length(S, "scalar_int64"), config, max_length=200)
    torch.testing.assert_close(out.cpu(), sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), S, config),
                               **TOLERANCE[torch.float32])


if kernels_triton.HAS_TRITON:
    import triton
    import triton.language as tl

    import kernels_triton_jit

    @triton.jit
    def _topk_probe(key_ptr, chosen_ptr, slot_ptr, KT, N: tl.constexpr, PASS_BITS: tl.constexpr):
        offs = tl.arange(0, N)
        chosen, slot = kernels_triton_jit._topk_select(tl.load(key_ptr + offs), KT, PASS_BITS)
        tl.store(chosen_ptr + offs, chosen.to(tl.int32))
        tl.store(slot_ptr + offs, slot, mask=chosen)


@pytest.mark.parametrize("pass_bits", [1, 2])
def test_topk_select_is_the_stable_top_k(pass_bits):
    """The select and merge kernels' top-k of int32 keys, one and two bits per counting pass: the KT
    largest keys >= 0, ties to the lower index, -1 never (fewer than KT: all the others), slots in
    index order; against a stable sort. Keys span every bit (the local window's INF_KEY included),
    or crowd a few values (ties at the threshold)."""
    gen = torch.Generator().manual_seed(pass_bits)
    for N, KT, spread in ((256, 1, 2**31 - 1), (256, 64, 2**31 - 1), (256, 64, 5), (256, 200, 3),
                          (256, 256, 2**20), (4096, 700, 2**31 - 1), (4096, 128, 9)):
        key = torch.randint(0, spread, (N,), generator=gen, dtype=torch.int32)
        key[torch.randperm(N, generator=gen)[: N // 5]] = -1
        key[torch.randperm(N, generator=gen)[:3]] = kernels_triton.INF_KEY
        chosen = torch.full((N,), -7, dtype=torch.int32)
        slot = torch.full((N,), -7, dtype=torch.int32)
        to = lambda t: t.to(DEVICE)  # noqa: E731
        key_d, chosen_d, slot_d = to(key), to(chosen), to(slot)
        _topk_probe[(1,)](key_d, chosen_d, slot_d, KT, N=N, PASS_BITS=pass_bits)
        order = sorted((i for i in range(N) if key[i] >= 0), key=lambda i: (-int(key[i]), i))[:KT]
        expected = torch.zeros(N, dtype=torch.int32)
        expected[order] = 1
        assert torch.equal(chosen_d.cpu(), expected), (N, KT, spread)
        picked = sorted(order)
        assert slot_d.cpu()[picked].tolist() == list(range(len(picked)))


@pytest.mark.parametrize("length_kind", ["int", "scalar_int64"])
def test_underflowed_scores_rank_above_dead_positions(length_kind):
    """S < k: every live position is attended, even those whose approximate score underflows to 0."""
    B, n_kv, g, d, S, S_max = 1, 1, 1, 64, 20, 200
    config = SparQConfig(r=1, k_top=64, local=0)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S, S_max, torch.float32, seed=6)
    q.fill_(1.0)
    q[..., 0] = 5.0  # the r = 1 component
    k[:, :, 3, 0] = 100.0  # position 3 takes all the approximate mass: the others' s_hat underflow to 0...
    k[:, :, 3, 1:] = -20.0  # ...but it gets ~none of the exact mass, so missing a live position shows
    k_t = k.transpose(2, 3).contiguous()
    out = triton_sparq(q, k, k_t, v, v_sum, as_length(S, length_kind), config)
    expected = sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum.cpu(), S, config)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])


def test_dispatch_through_kv_cache():
    """SparQDecode with the Triton kernels on a KVCache filled by update (v_sum kept by the cache)."""
    from sparq import SparQDecode

    B, n_kv, g, d, S_max = 2, 2, 3, 64, 96
    config = SparQConfig(r=8, k_top=16, mean_v=True)
    gen = torch.Generator().manual_seed(2)
    for layout in ("twice", "once"):
        cache = KVCache(B + 1, S_max, n_kv, d, torch.float32, layout).to(DEVICE)
        cache.update(torch.arange(40, device=DEVICE), torch.randn(B, n_kv, 40, d, generator=gen).to(DEVICE),
                     torch.randn(B, n_kv, 40, d, generator=gen).to(DEVICE))
        cache.update(torch.tensor([40], device=DEVICE), torch.randn(B, n_kv, 1, d, generator=gen).to(DEVICE),
                     torch.randn(B, n_kv, 1, d, generator=gen).to(DEVICE))
        q = torch.randn(B, n_kv, g, d, generator=gen).to(DEVICE)
        policy = SparQDecode(config, kernels.TRITON_KERNELS)
        out = policy(q, cache, 41)
        expected = sparq_reference(q.cpu(), cache.k.cpu(), cache.v.cpu(), cache.v_sum.cpu(), 41, config)
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])
        # Bucketed lengths (CUDA graphs): read 64 positions, the live length comes from cache.live_length.
        cache.length_bucket = 32
        bucketed = policy(q, cache, 64)
        torch.testing.assert_close(bucketed.cpu(), expected, **TOLERANCE[torch.float32])


def test_compiles_once_for_a_changing_tensor_length():
    """Under torch.compile(fullgraph) the op is traced once (fake impl) and reused as the length grows."""
    from torch._dynamo.testing import CompileCounter

    B, n_kv, g, d, S_max = 1, 2, 4, 64, 64
    config = SparQConfig(r=8, k_top=16, mean_v=True)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, k_t, v, v_sum, length):
        return triton_sparq(q, k, k_t, v, v_sum, length, config) * 2

    torch._dynamo.reset()
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, 40, S_max, torch.float32, seed=3)
    length = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for S in (9, 40):
        length.fill_(S)
        v_sum_S = v[:B + 1, :, :S].float().sum(2)  # as the cache would hold at length S
        out = step(q, k, k_t, v, v_sum_S, length)
        expected = sparq_reference(q.cpu(), k.cpu(), v.cpu(), v_sum_S.cpu(), S, config) * 2
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])
    assert counter.frame_count == 1


def row_reference(q, k, k_t, v, length, config, live):
    """Each row of a ragged batch run alone at its own live length through the reference."""
    rows = []
    for b, S in enumerate(live.tolist()):
        qb, kb, vb = q[b:b + 1].cpu(), k[b:b + 1].cpu(), v[b:b + 1].cpu()
        if config is None:
            rows.append(dense_attention_torch(qb, kb, vb, S))
        else:
            rows.append(sparq_reference(qb, kb, vb, vb[:, :, :S].float().sum(2), S, config))
    return torch.cat(rows)


# (B, n_kv, g, d, S_bound, per-row live lengths, r, k, layout, dtype): rows shorter than k, rows of
# one position, rows past several select chunks, MHA and GQA.
RAGGED = [
    (3, 2, 4, 64, 300, (300, 7, 120), 16, 32, "twice", f32),
    (4, 1, 1, 128, 1200, (1, 1100, 64, 1200), 8, 64, "once", bf16),
    (2, 2, 3, 80, 40, (40, 3), 80, 16, "twice", f32),
]


@pytest.mark.parametrize("case", RAGGED, ids=lambda c: f"B{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-S{c[4]}-{c[8]}-{c[9]}")
def test_ragged_rows_match_each_row_alone(case):
    """(B,) live lengths: every row reads only its own positions (garbage past them is NaN), for SparQ
    (local window, top-k and mean-V per row) and dense."""
    B, n_kv, g, d, S_bound, lives, r, k_top, layout, dtype = case
    config = SparQConfig(r=r, k_top=k_top, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S_bound, S_bound + 8, dtype, seed=sum(lives), layout=layout,
                                     config=config, lengths=lives)
    live = torch.tensor(lives, device=DEVICE)
    out = kernels_triton.sparq_attention_triton(q, k, k_t, v, v_sum, S_bound, live, r, k_top, config.local, True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), row_reference(q, k, k_t, v, S_bound, config, live), **TOLERANCE[dtype])
    dense = kernels_triton.dense_attention_triton(q, k, v, S_bound, live)
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(dense.cpu(), row_reference(q, k, k_t, v, S_bound, None, live), **TOLERANCE[dtype])


# Step 1 with several consecutive 128-position blocks per program (BPP): live ends at the first block
# of a program, in its middle (600 with BPP 3: block 4 of 3..5) and past its last; programs wholly past
# a row's end (5); MHA and GQA, both K layouts.
BLOCKS = [(3, 2, 4, 64, 1200, (1200, 600, 5), 16, 32, "twice", f32),
          (2, 2, 1, 128, 1000, (1000, 333), 8, 64, "once", bf16)]


@pytest.mark.parametrize("bpp", [2, 3, 8])
@pytest.mark.parametrize("case", BLOCKS, ids=lambda c: f"g{c[2]}-{c[8]}")
def test_step1_blocks_per_program_match_each_row_alone(case, bpp):
    """The plan's several blocks per step-1 program (a large GPU's launch shape), forced on small
    shapes: every row against its own reference, whatever block of a program its live end falls in."""
    B, n_kv, g, d, S_bound, lives, r, k_top, layout, dtype = case
    config = SparQConfig(r=r, k_top=k_top, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S_bound, S_bound + 8, dtype, seed=bpp + sum(lives),
                                     layout=layout, config=config, lengths=lives)
    live = torch.tensor(lives, device=DEVICE)
    plan = kernels_triton.sparq_plan(B, n_kv, g, d, S_bound, k_top, False, r=r, blocks_per_program=bpp)
    assert plan["step1"]["BLOCK_S"] == 128 and plan["BPP"] == bpp and plan["n_step1"] * bpp >= plan["NB"]
    out = kernels_triton._sparq_triton_impl(q, k, k_t, v, v_sum, S_bound, live, r, k_top, config.local, True,
                                            None, None, None, None, blocks_per_program=bpp)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), row_reference(q, k, k_t, v, S_bound, config, live), **TOLERANCE[dtype])


# (B, n_kv, g, d, S, S_max, dtype, length kind): MHA (CUDA-core path) and GQA (dots), one split and
# several (combine), head dims off the power-of-two set.
DENSE = [
    (1, 2, 1, 64, 1, 16, f32, "int"),
    (3, 2, 4, 64, 1000, 1024, f32, "scalar_int64"),
    (1, 2, 8, 128, 700, 800, bf16, "int"),
    (2, 1, 3, 80, 129, 200, bf16, "scalar_int32"),
    (1, 4, 1, 128, 1500, 1600, bf16, "vec_int64"),
    (3, 2, 2, 80, 33, 33, f32, "int"),
    (1, 4, 1, 128, 1500, 1600, f16, "vec_int64"),
    (2, 2, 4, 64, 700, 800, f16, "int"),
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"B{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-S{c[4]}-{c[6]}-{c[7]}"
                         .replace("torch.", ""))
def test_dense_matches_torch(case):
    B, n_kv, g, d, S, S_max, dtype, length_kind = case
    q, k, _, v, _ = make_cache(B, n_kv, g, d, S, S_max, dtype, seed=S * d + g, layout="once")
    length = as_length(S, length_kind)
    if isinstance(length, torch.Tensor):
        out = kernels_triton.dense_attention_triton(q, k, v, S_max, length)
    else:
        out = kernels_triton.dense_attention_triton(q, k, v, S, None)
    assert out.shape == (B, n_kv, g, d) and out.dtype == dtype
    assert torch.isfinite(out).all(), "garbage past the live length leaked into the output"
    expected = dense_attention_torch(q.cpu(), k.cpu(), v.cpu(), S)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("g,T,dtype", [(3, 3, torch.float32), (1, 5, torch.float32), (4, 2, torch.bfloat16)])
def test_dense_verify_is_each_querys_one_token_step(g, T, dtype):
    """dense_verify_triton (speculative verification): query t of a row of live length n attends to
    positions [0, n - T + 1 + t), as the one-token step there would; ragged rows, NaN past each row's
    length, a long row split over several programs."""
    lengths = [40, 3000, 517]
    B, n_kv, d, S_max = len(lengths), 2, 64, 3008
    _, k, _, v, _ = make_cache(B, n_kv, g, d, max(lengths), S_max, dtype, seed=g * T, layout="once", lengths=lengths)
    q = torch.randn(B, n_kv, g, T, d, generator=torch.Generator().manual_seed(T)).to(dtype).to(DEVICE)
    live = torch.tensor(lengths, device=DEVICE)
    out = kernels_triton.dense_verify_triton(q, k, v, max(lengths), live)
    assert out.shape == (B, n_kv, g, T, d) and out.dtype == dtype and torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        for t in range(T):
            step = dense_attention_torch(q[b:b + 1, :, :, t].cpu(), k[b:b + 1].cpu(), v[b:b + 1].cpu(), n - T + 1 + t)
            torch.testing.assert_close(out[b:b + 1, :, :, t].cpu(), step, **TOLERANCE[dtype])


def test_launch_plans():
    """Launches per call: Table 4 (B=64 MHA) needs no merge and no combine; B = 1 at long S splits
    both the selection (chunks + merge) and step 2 (combine), and dense splits over S."""
    table4 = kernels_triton.sparq_plan(64, 32, 1, 128, 4096, 128, True)
    assert (table4["n_chunks"], table4["n_split"]) == (1, 1)
    assert kernels_triton.sparq_launches(table4) == 4
    long = kernels_triton.sparq_plan(1, 8, 4, 128, 131072, 128, True)
    assert long["n_chunks"] > 1 and long["n_split"] > 1 and kernels_triton.sparq_launches(long) == 6
    assert long["n_chunks"] * 128 <= 4096  # the merge's candidates stay in one program's registers
    # generation's bucketed bound just past 32k selects in the chunks an exact 32k gets (not twice as long)
    assert (kernels_triton.sparq_plan(1, 32, 1, 128, 33024, 128, True)["select"]["CHUNK"]
            == kernels_triton.sparq_plan(1, 32, 1, 128, 32768, 128, True)["select"]["CHUNK"] == 2048)
    assert 1 * 8 * long["n_chunks"] >= 132 and 1 * 8 * long["n_split"] >= 32  # B = 1 spreads over the GPU
    dense = kernels_triton.dense_plan(1, 8, 4, 128, 131072, True)
    assert dense["n_split"] * 8 >= 2 * 132 and kernels_triton.dense_launches(dense) == 2
    assert kernels_triton.dense_launches(kernels_triton.dense_plan(64, 32, 1, 128, 4096, True)) == 1
    for S in (1, 7, 129, 1000, 4096, 5000, 32768, 131072, 300000):  # every plan covers S exactly once
        for rows, KT in ((1, 128), (8, 128), (2048, 128), (1, 512), (3, min(16, S))):
            KT = min(KT, S)
            p = kernels_triton.sparq_plan(rows, 1, 4, 128, S, KT, True)
            assert p["select"]["CHUNK"] * p["n_chunks"] >= S > p["select"]["CHUNK"] * (p["n_chunks"] - 1)
            assert p["select"]["CHUNK"] >= KT and p["KS"] * p["n_split"] >= KT > p["KS"] * (p["n_split"] - 1)
            d = kernels_triton.dense_plan(rows, 1, 4, 128, S, True)
            assert d["SPLIT"] * d["n_split"] >= S > d["SPLIT"] * (d["n_split"] - 1)


def test_compiles_once_for_a_changing_dense_length():
    """The dense op under torch.compile(fullgraph): traced once, reused as the device length grows."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, length):
        return kernels_triton.dense_attention_triton(q, k, v, k.shape[2], length) + 1

    torch._dynamo.reset()
    q, k, _, v, _ = make_cache(2, 2, 4, 64, 64, 64, torch.float32, seed=8, layout="once")
    length = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for S in (5, 64):
        length.fill_(S)
        expected = dense_attention_torch(q.cpu(), k.cpu(), v.cpu(), S) + 1
        torch.testing.assert_close(step(q, k, v, length).cpu(), expected, **TOLERANCE[torch.float32])
    assert counter.frame_count == 1


def test_opcheck():
    """torch.library.opcheck: schema, fake impl and dispatch of sparq::sparq_triton, sparq::dense_triton and
    sparq::dense_verify_triton, on a float cache and on a quantized one (int8 K/V, int4 K^T, their scales)."""
    q, k, k_t, v, v_sum = make_cache(2, 1, 3, 64, 7, 16, torch.float32, seed=4)
    length = torch.tensor(7, device=DEVICE)
    rows = torch.tensor([7, 3], device=DEVICE)
    sparq_op, dense_op = torch.ops.sparq.sparq_triton.default, torch.ops.sparq.dense_triton.default
    no3, no4 = (None,) * 3, (None,) * 4  # a float cache: no scales
    torch.library.opcheck(sparq_op, (q, k, k_t, v, v_sum, 16, length, 8, 4, 1, True, *no4))
    torch.library.opcheck(sparq_op, (q, k, None, v, v_sum, 7, None, 8, 4, 1, False, *no4))
    torch.library.opcheck(sparq_op, (q, k, k_t, v, v_sum, 7, rows, 8, 4, 1, True, *no4))
    torch.library.opcheck(dense_op, (q, k, v, 7, None, *no3))
    torch.library.opcheck(dense_op, (q, k, v, 16, length, *no3))
    torch.library.opcheck(dense_op, (q, k, v, 7, rows, *no3))
    verify_op = torch.ops.sparq.dense_verify_triton.default
    torch.library.opcheck(verify_op, (q, k, v, 7, rows, 3, *no3))  # g 3 = 1 head x 3 queries
    cache = KVCache(2, 16, 1, 64, torch.float32, kv_dtype="int8", kt_dtype="int4").to(DEVICE)
    cache.update(torch.arange(7, device=DEVICE), k[:2, :, :7].float(), v[:2, :, :7].float())
    s = cache.view(7, 2, stored=True)
    kv_scales = (s.scales.k_scale, s.scales.v_scale, s.scales.chan)
    torch.library.opcheck(sparq_op, (q, s.k, s.k_t, s.v, s.v_sum, 7, rows, 8, 4, 1, True, *kv_scales,
                                     s.scales.kt_scale))
    torch.library.opcheck(dense_op, (q, s.k, s.v, 7, rows, *kv_scales))
    torch.library.opcheck(verify_op, (q, s.k, s.v, 7, rows, 3, *kv_scales))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_changing_length():
    """With a device-tensor length, one captured graph serves every live length (no host sync), for
    SparQ and dense, one length for every row and one per row."""
    B, n_kv, g, d, S_max = 2, 4, 4, 128, 2048
    config = SparQConfig(r=16, k_top=64, mean_v=True)
    q, k, k_t, v, v_sum = make_cache(B, n_kv, g, d, S_max, S_max, torch.bfloat16, seed=5)
    sums = v[:B + 1].float().cumsum(2)  # v_sum at each live length
    for per_row in (False, True):
        length = torch.full((B,) if per_row else (), S_max, device=DEVICE)
        v_sum_buf = sums[:, :, -1].clone()

        def step():
            return (triton_sparq(q, k, k_t, v, v_sum_buf, length, config),
                    kernels_triton.dense_attention_triton(q, k, v, S_max, length))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                out, dense = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for S in (1, 100, 1500, S_max):
            lives = [S, max(1, S // 3)] if per_row else [S, S]
            gen = torch.Generator().manual_seed(S)
            k_cpu = k.cpu()
            untie(gen, q_cpu := q.cpu(), k_cpu, lives, config)  # redraw tied selections (see sparq.selection_has_ties)
            q.copy_(q_cpu)
            k.copy_(k_cpu)
            k_t.copy_(k.transpose(2, 3))
            length.copy_(torch.tensor(lives if per_row else S, device=DEVICE))
            for b, n in enumerate(lives):
                v_sum_buf[b] = sums[b, :, n - 1]
            graph.replay()
            for b, n in enumerate(lives):
                expected = sparq_reference(q[b:b + 1].cpu(), k[b:b + 1].cpu(), v[b:b + 1].cpu(),
                                           v_sum_buf[b:b + 1].cpu(), n, config)
                torch.testing.assert_close(out[b:b + 1].cpu(), expected, **TOLERANCE[torch.bfloat16])
                expected = dense_attention_torch(q[b:b + 1].cpu(), k[b:b + 1].cpu(), v[b:b + 1].cpu(), n)
                torch.testing.assert_close(dense[b:b + 1].cpu(), expected, **TOLERANCE[torch.bfloat16])


def test_kernels_compile_for_h100():
    """Without a GPU: the real Triton compiler (not the interpreter) lowers every kernel of the launch
    plans (SparQ step 1, select, merge, step 2, combine; dense) to sm_90 cubin with the parameters the
    wrappers pick, and ptxas reports no large spills. (The GPU machine's Triton 3.6 passed it too.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "compile_for_h100.py")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_kernels_imports_without_triton():
    """kernels.py imports where triton is missing; the Triton entry point then fails with one clear line."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kernels, kernels_triton\n"
            "assert not kernels_triton.HAS_TRITON\n"
            "q = torch.zeros(1, 1, 1, 8); k = torch.zeros(1, 1, 4, 8)\n"
            "try:\n"
            "    kernels_triton.sparq_attention_triton(q, k, None, k, torch.zeros(1, 1, 8), 4, None, 2, 2, 0, False)\n"
            "except RuntimeError as e:\n"
            "    assert 'triton' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no error without triton')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


QUANTIZED_FORMATS = [("twice", "int8", "same"), ("twice", "int8", "int4"), ("twice", "auto", "int4"),
                     ("twice", "auto", "int8"), ("once", "int8", "same"), ("twice", "auto", "int4/bfloat16")]


def filled_quantized_cache(layout, kv_dtype, kt_dtype, S, lengths, gen, k_scale=1.0, n_kv=2, g=4, d=64):
    """A quantized cache (fp32 activations) holding S random positions per row, live to `lengths`, and a
    query: (q, the stored view, the fp32 dequantized K, V and K^T from its buffers, the live lengths).
    k_scale (scalar or per channel) multiplies the keys before they are written. kt_dtype "int4/bfloat16":
    an int4 K^T whose own scales are stored in bf16 (--kt-scale-dtype)."""
    from test_kv_quant import dequantized_fp32

    rows = len(lengths)
    kt_dtype, _, kt_scale_dtype = kt_dtype.partition("/")
    cache = KVCache(rows, S + 63, n_kv, d, torch.float32, layout=layout, kv_dtype=kv_dtype, kt_dtype=kt_dtype,
                    kt_scale_dtype=kt_scale_dtype or "float32")
    k = torch.randn(rows, n_kv, S, d, generator=gen) * k_scale
    cache.update(torch.arange(S), k, torch.randn(rows, n_kv, S, d, generator=gen))
    cache.set_live_lengths(torch.tensor(lengths))
    q = torch.randn(rows, n_kv, g, d, generator=gen)
    return q, cache.view(S, rows, stored=True), dequantized_fp32(cache, S), cache.live_length[:rows]


@pytest.mark.parametrize("layout, kv_dtype, kt_dtype", QUANTIZED_FORMATS)
def test_a_quantized_cache_is_read_as_its_dequantized_copy(layout, kv_dtype, kt_dtype):
    """SparQ, dense and the verify pass on the stored buffers of a quantized cache (int8 K/V, an int8 or
    int4 K^T, their scales) against the torch paths on the dequantized values (fp32 from the buffers):
    ragged rows of odd lengths (an int4 byte half used), and one long row (several select chunks)."""
    from sparq import sparq_attention_torch

    n_kv, g, d = 2, 4, 64
    for S, lengths in ((301, [301, 17, 150]), (3001, [3001])):
        rows = len(lengths)
        gen = torch.Generator().manual_seed(S + len(kv_dtype + kt_dtype + layout))
        q, stored, (k, v, k_t), live = filled_quantized_cache(layout, kv_dtype, kt_dtype, S, lengths, gen,
                                                              k_scale=1 + 4 * (torch.arange(d) == 1))
        to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
        scales = stored.scales
        if DEVICE != "cpu":
            scales = type(scales)(*(to(getattr(scales, f)) for f in ("k_scale", "v_scale", "chan", "kt_scale")))
        tol = dict(rtol=1e-4, atol=1e-5)
        args = (S, to(live), 8, 48, 12, True)
        out = kernels_triton.sparq_attention_triton(to(q), to(stored.k), to(stored.k_t), to(stored.v),
                                                    to(stored.v_sum), *args, scales=scales)
        expected = sparq_attention_torch(q, k, k_t, v, stored.v_sum, S, live, 8, 48, 12, True)
        torch.testing.assert_close(out.cpu(), expected, **tol)
        int8_scales = scales if kv_dtype == "int8" else None  # dense reads K and V, not K^T
        dense = kernels_triton.dense_attention_triton(to(q), to(stored.k), to(stored.v), S, to(live), scales=int8_scales)
        torch.testing.assert_close(dense.cpu(), dense_attention_torch(q, k, v, S, live), **tol)
        if S < 1000:
            T = 3
            qv = torch.randn(rows, n_kv, g, T, d, generator=gen)
            verified = kernels_triton.dense_verify_triton(to(qv), to(stored.k), to(stored.v), S, to(live),
                                                          scales=int8_scales)
            for b, n in enumerate(lengths):
                for t in range(T):
                    one = dense_attention_torch(qv[b:b + 1, :, :, t], k[b:b + 1], v[b:b + 1], n - T + 1 + t)
                    torch.testing.assert_close(verified[b:b + 1, :, :, t].cpu(), one, **tol)


@pytest.mark.parametrize("layout, kt_dtype", [("twice", "int4"), ("once", "same")])
@pytest.mark.parametrize("g", [1, 4])
def test_an_int8_cache_under_16_bit_queries_takes_the_native_dots(layout, kt_dtype, g):
    """A 16-bit q on an int8 K/V: dense's and step 2's dots run in q's dtype (int8 converts exactly; q
    chan and the weights or V rounded once), MHA included, against the torch paths in fp32 on the
    dequantized values and the same q. fp16 (the interpreter's dots are right for fp16, not bf16)."""
    from sparq import sparq_attention_torch

    n_kv, d, S, lengths = 2, 64, 700, [700, 333]
    gen = torch.Generator().manual_seed(41 + g)
    q, stored, (k, v, k_t), live = filled_quantized_cache(layout, "int8", kt_dtype, S, lengths, gen, g=g,
                                                          k_scale=1 + 4 * (torch.arange(d) == 1))
    q16 = q.to(torch.float16)
    assert kernels_triton._native_kv_dot(q16.to(DEVICE), stored.k.to(DEVICE), stored.v.to(DEVICE))
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    scales = stored.scales
    if DEVICE != "cpu":
        scales = type(scales)(*(to(getattr(scales, f)) for f in ("k_scale", "v_scale", "chan", "kt_scale")))
    tol = dict(rtol=2e-3, atol=5e-4)  # outputs ~0.1: fp16's rounding of q chan and the weights, ~1e-4
    dense = kernels_triton.dense_attention_triton(to(q16), to(stored.k), to(stored.v), S, to(live), scales=scales)
    assert dense.dtype == torch.float16
    torch.testing.assert_close(dense.cpu().float(), dense_attention_torch(q16.float(), k, v, S, live), **tol)
    out = kernels_triton.sparq_attention_triton(to(q16), to(stored.k), to(stored.k_t), to(stored.v),
                                                to(stored.v_sum), S, to(live), 8, 48, 12, True, scales=scales)
    expected = sparq_attention_torch(q16.float(), k, k_t, v, stored.v_sum, S, live, 8, 48, 12, True)
    torch.testing.assert_close(out.cpu().float(), expected, **tol)


@pytest.mark.parametrize("layout, kt_dtype", [("twice", "int4"), ("once", "same")])
def test_a_quantized_step1_source_over_several_blocks_per_program(layout, kt_dtype):
    """Step 1 on a quantized source (an int4 K^T: bytes of two positions; int8 K, layout once) with 3
    blocks of 128 positions per program and ragged rows whose live ends fall inside a program (odd
    ones: an int4 byte half used), against the torch path on the dequantized values."""
    from sparq import sparq_attention_torch

    S = 1201
    q, stored, (k, v, k_t), live = filled_quantized_cache(layout, "int8", kt_dtype, S, [1201, 517, 9],
                                                          torch.Generator().manual_seed(len(layout)))
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    s = stored.scales
    out = kernels_triton._sparq_triton_impl(to(q), to(stored.k), to(stored.k_t), to(stored.v), to(stored.v_sum), S,
                                            to(live), 8, 48, 12, True, to(s.k_scale), to(s.v_scale), to(s.chan),
                                            to(s.kt_scale), blocks_per_program=3)
    expected = sparq_attention_torch(q, k, k_t, v, stored.v_sum, S, live, 8, 48, 12, True)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype, kt_dtype, policy", [("int8", "same", "dense"), ("int8", "int4", "sparq"),
                                                         ("auto", "int4", "sparq")])
def test_a_model_on_a_quantized_cache_generates_alike_with_triton_and_torch(kv_dtype, kt_dtype, policy):
    """Greedy tokens of a model whose decode reads a quantized cache in the Triton kernels equal those of the
    torch path on its dequantized copy (fp32: the two differ by rounding only); ragged rows."""
    from decoding import Generator
    from cache import KVFormat
    from policies import AttentionSettings, policy_factory
    from test_ragged import tiny_model

    settings = AttentionSettings(policy, sparq_r=6 if policy == "sparq" else None, sparq_k=24)
    prompts = [torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (50, 33)]
    out = {}
    for name, kern in (("torch", kernels.TORCH_KERNELS), ("triton", kernels.TRITON_KERNELS)):
        model = tiny_model(kernels=kern).to(DEVICE)
        model.setup_caches(2, 100, KVFormat("twice", kv_dtype, kt_dtype))
        model.set_decode_attention(policy_factory(settings, model.args, kern))
        out[name] = Generator(model).generate(prompts, 12)[0]
    assert out["triton"] == out["torch"]
