"""The fused CPU kernels (csrc/: SparQ via kernels.sparq_attention_cpu, dense, the GEMV) against the
oracle `sparq.sparq_reference`, on random caches.

Tolerances: fp32 atol = rtol = 1e-5. bf16 caches are compared with the reference computed from
the same bf16 values: with an fp32 query (fp32 output) at 1e-5; with a bf16 query the output is
rounded to bf16 by both, so they may differ by one bf16 ulp: atol = rtol = 1e-2.

Ties: which of two tied candidates is taken is unspecified (the kernel prefers the lower index,
torch.topk does not say), so the random data is redrawn until |q| summed over the group has no tie
at the top-r boundary and the selection scores none at the top-k boundary (low r on bf16 caches
gives equal logits).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import platform
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from cache import KVCache  # noqa: E402
from qlinear import pack_int4_rows16, pack_int8_rows16, unpack_int4_rows16, unpack_int8_rows16  # noqa: E402
from sparq import SparQConfig, selection_has_ties, sparq_reference  # noqa: E402


pytestmark = pytest.mark.usefixtures("fused_cpu_kernels")


def _query(gen, B, n_kv, g, d, r, dtype) -> torch.Tensor:
    """Random q whose |q| summed over each group has no tie at the top-r boundary."""
    for _ in range(100):
        q = torch.randn(B, n_kv, g, d, generator=gen).to(dtype)
        if r == d:
            return q
        top = q.float().abs().sum(2).sort(dim=-1, descending=True).values  # (B, n_kv, d)
        if bool((top[..., r - 1] > top[..., r]).all()):
            return q
    raise AssertionError("could not draw a tie-free query")


def _cache(gen, B_max, n_kv, S_max, d, S, dtype, layout):
    """k, k_t (or None), v, v_sum with positions >= S zero, as a KVCache holds them."""
    k = torch.zeros(B_max, n_kv, S_max, d)
    v = torch.zeros(B_max, n_kv, S_max, d)
    k[:, :, :S] = torch.randn(B_max, n_kv, S, d, generator=gen)
    v[:, :, :S] = torch.randn(B_max, n_kv, S, d, generator=gen)
    k, v = k.to(dtype), v.to(dtype)
    k_t = k.transpose(2, 3).contiguous() if layout == "twice" else None
    v_sum = v[:, :, :S].float().sum(2)
    return k, k_t, v, v_sum


def _untie(gen, q, k, v, S, cfg) -> None:
    """Redraw (in place) the live K rows of every (row, KV head) whose selection has a tie."""
    B, n_kv = q.shape[:2]
    for b in range(B):
        for h in range(n_kv):
            for _ in range(500):
                if not selection_has_ties(q[b, h], k[b, h], S, cfg):
                    break
                k[b, h, :S] = torch.randn(S, k.shape[-1], generator=gen).to(k.dtype)
            else:
                raise AssertionError("could not draw K rows without ties at the top-k boundary")


def _fused(q, k, k_t, v, v_sum, S, cfg):
    return kernels.sparq_attention_cpu(q, k, k_t, v, v_sum, S, None, cfg.r, cfg.k_top, cfg.local, cfg.mean_v)


def _check(out, ref, atol, rtol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# A sampled grid (not the full product): every value of every axis appears.
G = (1, 3, 4, 8)
D = (64, 80, 128)
BATCH = (1, 3)
SEQ = (1, 7, 100, 129, 1000, 4097)
R = ("1", "8", "d")
MEAN_V = (False, True)
LAYOUT = ("twice", "once")
DTYPE = ("float32", "bfloat16")
THREADS = (1, 2)
_ALL = list(itertools.product(G, D, BATCH, SEQ, R, MEAN_V, LAYOUT, DTYPE, THREADS))
CASES = random.Random(4).sample(_ALL, 44)
# head dims that are not a multiple of 16: the kernels' unblocked logits / softmax / P @ V paths
UNBLOCKED = [(3, 72, 2, 700, "8", True, "twice", "float32", 2), (1, 40, 1, 129, "d", False, "once", "bfloat16", 1)]
# Gemma's head dim 256 (the largest register-blocked case)
HEAD_256 = [(4, 256, 2, 3000, "8", True, "twice", "bfloat16", 2), (1, 256, 1, 700, "d", False, "once", "float32", 1)]


def test_grid_covers_every_value():
    for axis, values in enumerate((G, D, BATCH, SEQ, R, MEAN_V, LAYOUT, DTYPE, THREADS)):
        assert {case[axis] for case in CASES} == set(values)


@pytest.mark.parametrize("g,d,B,S,r,mean_v,layout,dtype,n_threads", CASES + UNBLOCKED + HEAD_256)
def test_matches_reference(g, d, B, S, r, mean_v, layout, dtype, n_threads, threads):
    threads(n_threads)
    dtype = getattr(torch, dtype)
    r = d if r == "d" else int(r)
    n_kv = 3 if g < 8 else 2
    gen = torch.Generator().manual_seed(zlib.crc32(repr((g, d, B, S, r, mean_v, layout)).encode()))
    cfg = SparQConfig(r=r, k_top=128, mean_v=mean_v)
    q = _query(gen, B, n_kv, g, d, r, dtype)
    k, k_t, v, v_sum = _cache(gen, B + 1, n_kv, S + 9, d, S, dtype, layout)
    _untie(gen, q, k, v, S, cfg)
    if k_t is not None:
        k_t = k.transpose(2, 3).contiguous()
    ref = sparq_reference(q, k, v, v_sum, S, cfg)
    if dtype == torch.float32:
        _check(_fused(q, k, k_t, v, v_sum, S, cfg), ref, 1e-5, 1e-5)
    else:
        _check(_fused(q, k, k_t, v, v_sum, S, cfg), ref, 1e-2, 1e-2)
        qf = q.float()  # bf16 cache read in fp32: as tight as fp32
        _check(_fused(qf, k, k_t, v, v_sum, S, cfg), sparq_reference(qf, k, v, v_sum, S, cfg), 1e-5, 1e-5)


@pytest.mark.parametrize("n_threads", [2, 3, 5])
def test_chunked_stages_match_reference(n_threads, threads):
    """Fewer (row, KV head) pairs than threads: each splits into chunks of positions, whose three
    stages run as one list of tasks (parallel.h run_tasks), later stages of one KV head while pass A
    of the next streams; with 5 threads on SmolLM2's 3 KV heads a stage waits more than one head
    behind (lag 2 with 3 and 5 threads). Checked against the loop reference to fp32 rounding: thread
    counts split the positions into different chunks, so they are not compared bit for bit."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(11 + n_threads)
    B, n_kv, g, d, S = 1, 3, 3, 64, 6000
    cfg = SparQConfig(r=16, k_top=128, mean_v=True)
    q = _query(gen, B, n_kv, g, d, cfg.r, torch.float32)
    k, k_t, v, v_sum = _cache(gen, B + 1, n_kv, S + 9, d, S, torch.float32, "twice")
    _untie(gen, q, k, v, S, cfg)
    k_t = k.transpose(2, 3).contiguous()
    _check(_fused(q, k, k_t, v, v_sum, S, cfg), sparq_reference(q, k, v, v_sum, S, cfg), 1e-5, 1e-5)


@pytest.mark.parametrize("S,k_top,local", [(64, 128, 32), (128, 128, 32), (500, 16, 16), (500, 16, 0), (3000, 40, 10)])
@pytest.mark.parametrize("extreme", ["local_best", "local_worst"])
@pytest.mark.parametrize("layout", ["twice", "once"])
def test_local_window_and_top_k(S, k_top, local, extreme, layout, threads):
    """The last `local` positions are always attended, and the other k - local come from the rest:
    with the window scoring highest (a kernel ranking it again would pick duplicates and miss
    positions) and lowest (a kernel not forcing it in would drop it)."""
    threads(2)
    B, n_kv, g, d = 1, 2, 3, 64
    gen = torch.Generator().manual_seed(S + k_top + local)
    q = _query(gen, B, n_kv, g, d, 8, torch.float32)
    k, k_t, v, v_sum = _cache(gen, B, n_kv, S, d, S, torch.float32, layout)
    direction = q.sum(2, keepdim=True)  # (B, n_kv, 1, d): raises every head's logits
    sign = 1.0 if extreme == "local_best" else -1.0
    k[:, :, S - local:] += sign * 0.5 * direction
    if k_t is not None:
        k_t = k.transpose(2, 3).contiguous()
    for mean_v in (False, True):
        cfg = SparQConfig(r=8, k_top=k_top, local=local, mean_v=mean_v)
        _check(_fused(q, k, k_t, v, v_sum, S, cfg), sparq_reference(q, k, v, v_sum, S, cfg), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["twice", "once"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("S", [33, 2500])
def test_dead_positions_and_rows_are_never_read(dtype, layout, n_threads, S, threads):
    """NaN / inf / huge values beyond the live length and in batch rows >= B change nothing."""
    threads(n_threads)
    dtype = getattr(torch, dtype)
    B, B_max, n_kv, g, d, S_max = 2, 4, 3, 3, 64, S + 77
    gen = torch.Generator().manual_seed(S)
    cfg = SparQConfig(r=16, k_top=128, local=32, mean_v=True)
    q = _query(gen, B, n_kv, g, d, cfg.r, dtype)
    k, k_t, v, v_sum = _cache(gen, B_max, n_kv, S_max, d, S, dtype, layout)
    clean = _fused(q, k, k_t, v, v_sum, S, cfg)
    _check(clean, sparq_reference(q, k, v, v_sum, S, cfg), *((1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)))
    for garbage in (float("nan"), float("inf"), 1e30):
        k2, v2, v_sum2 = k.clone(), v.clone(), v_sum.clone()
        k2[:, :, S:] = garbage
        v2[:, :, S:] = garbage
        k2[B:], v2[B:], v_sum2[B:] = garbage, garbage, garbage
        k_t2 = None
        if k_t is not None:
            k_t2 = k_t.clone()
            k_t2[:, :, :, S:] = garbage
            k_t2[B:] = garbage
        out = _fused(q, k2, k_t2, v2, v_sum2, S, cfg)
        assert torch.equal(out, clean), f"garbage {garbage} beyond the live data changed the output"


def test_kv_cache_dispatch(threads):
    """SparQDecode with the CPU kernels, on a KVCache filled by update(), step by step."""
    from sparq import SparQDecode

    threads(2)
    B, n_kv, g, d, S_max = 2, 3, 3, 64, 3000
    gen = torch.Generator().manual_seed(7)
    cache = KVCache(B + 1, S_max, n_kv, d, torch.float32)
    prefill = 2040
    cache.update(torch.arange(prefill), torch.randn(B, n_kv, prefill, d, generator=gen),
                 torch.randn(B, n_kv, prefill, d, generator=gen))
    cfg = SparQConfig(r=16, k_top=64, mean_v=True)
    for pos in range(prefill, prefill + 3):
        cache.update(torch.tensor([pos]), torch.randn(B, n_kv, 1, d, generator=gen), torch.randn(B, n_kv, 1, d, generator=gen))
        q = _query(gen, B, n_kv, g, d, cfg.r, torch.float32)
        out = SparQDecode(cfg, kernels.CPU_KERNELS)(q, cache, pos + 1)
        _check(out, sparq_reference(q, cache.k, cache.v, cache.v_sum, pos + 1, cfg), 1e-5, 1e-5)


def test_noncontiguous_query_and_fp16():
    """A non-contiguous q and an fp16 cache."""
    B, n_kv, g, d, S = 2, 3, 3, 64, 700
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(g, B, n_kv, d, generator=gen).permute(1, 2, 0, 3)  # strides in every order
    assert not q.is_contiguous()
    cfg = SparQConfig(r=8, k_top=64, mean_v=True)
    k, k_t, v, v_sum = _cache(gen, B, n_kv, S, d, S, torch.float16, "twice")
    _check(_fused(q, k, k_t, v, v_sum, S, cfg), sparq_reference(q, k, v, v_sum, S, cfg), 1e-5, 1e-5)


def test_rejects_bad_arguments():
    q = torch.randn(1, 2, 1, 64)
    k = torch.randn(1, 2, 16, 64)
    v_sum = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="length"):
        kernels.sparq_attention_cpu(q, k, None, k, v_sum, 17, None, 8, 8, 2, False)
    with pytest.raises(RuntimeError, match="r must"):
        kernels.sparq_attention_cpu(q, k, None, k, v_sum, 16, None, 65, 8, 2, False)
    with pytest.raises(RuntimeError, match="local"):
        kernels.sparq_attention_cpu(q, k, None, k, v_sum, 16, None, 8, 8, 9, False)
    with pytest.raises(ValueError, match="exact lengths"):  # a bucketed (0-dim) length
        kernels.sparq_attention_cpu(q, k, None, k, v_sum, 16, torch.tensor(9), 8, 8, 2, False)


def test_kernel_choice_is_resolved_once_and_fallbacks_are_announced(monkeypatch):
    """resolve_kernels: auto falls back to the torch path with one announced line; an explicit choice
    that cannot run is a one-line ValueError; nothing falls back per call."""
    said = []
    assert kernels.resolve_kernels("auto", "cpu", announce=said.append) is kernels.CPU_KERNELS and not said
    assert kernels.resolve_kernels("torch", "cpu") is kernels.TORCH_KERNELS
    assert kernels.resolve_kernels("auto", "cpu", length_bucket=64, announce=said.append) is kernels.TORCH_KERNELS
    assert len(said) == 1 and "exact lengths" in said[0]
    with pytest.raises(ValueError, match="exact lengths"):
        kernels.resolve_kernels("cpu", "cpu", length_bucket=64)
    with pytest.raises(ValueError, match="--device cuda"):
        kernels.resolve_kernels("triton", "cpu")
    with pytest.raises(ValueError, match="--device cpu"):
        kernels.resolve_kernels("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.resolve_kernels("fast", "cpu")
    monkeypatch.setattr(kernels, "cpu_kernel_error", lambda: "OSError: no compiler")
    said.clear()
    assert kernels.resolve_kernels("auto", "cpu", announce=said.append) is kernels.TORCH_KERNELS
    assert len(said) == 1 and "no compiler" in said[0]
    with pytest.raises(ValueError, match="no compiler"):
        kernels.resolve_kernels("cpu", "cpu")


def test_torch_compile_fullgraph_matches_eager():
    """The ops are opaque to torch.compile: no graph break, and `length` may be a SymInt."""
    torch._dynamo.reset()
    B, n_kv, g, d, S_max = 1, 3, 3, 64, 2048
    gen = torch.Generator().manual_seed(3)
    k, k_t, v, v_sum = _cache(gen, B, n_kv, S_max, d, S_max, torch.float32, "twice")

    def step(q, length: int):
        y = kernels.sparq_attention_cpu(q, k, k_t, v, v_sum, length, None, 16, 64, 16, True)
        return y * 2.0 + kernels.dense_attention_cpu(q, k, v, length)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for length in (1500, 1700, 2048):
        q = _query(gen, B, n_kv, g, d, 16, torch.float32)
        torch.testing.assert_close(compiled(q, length), step(q, length), atol=0, rtol=0)


def test_softmax_extremes_do_not_overflow():
    """Large logits (a running max that keeps rising) stay finite and match the reference."""
    B, n_kv, g, d, S = 1, 1, 2, 64, 3000
    gen = torch.Generator().manual_seed(9)
    q = _query(gen, B, n_kv, g, d, 8, torch.float32) * 4
    k, k_t, v, v_sum = _cache(gen, B, n_kv, S, d, S, torch.float32, "twice")
    ramp = torch.linspace(0, 6, S)[None, None, :, None]  # logits grow along the sequence
    k = k * (1 + ramp)
    k_t = k.transpose(2, 3).contiguous()
    cfg = SparQConfig(r=8, k_top=128, mean_v=True)
    out = _fused(q, k, k_t, v, v_sum, S, cfg)
    assert torch.isfinite(out).all()
    _check(out, sparq_reference(q, k, v, v_sum, S, cfg), 1e-5, 1e-5)
    assert math.isfinite(float(out.abs().max()))


@pytest.mark.parametrize("g,d,B,S,dtype,n_threads", [
    (3, 64, 1, 1, "float32", 2), (1, 128, 3, 1000, "float32", 1), (4, 80, 1, 4097, "float32", 2),
    (8, 64, 3, 129, "float32", 2), (3, 64, 1, 3000, "bfloat16", 2), (1, 128, 2, 700, "bfloat16", 1),
    (3, 72, 2, 700, "float32", 2),  # d % 16 != 0: the unblocked path
    (4, 256, 2, 2100, "float32", 2), (4, 256, 1, 500, "bfloat16", 1)])  # Gemma's head dim
def test_fused_dense_matches_model(g, d, B, S, dtype, n_threads, threads):
    """kernels.dense_attention_cpu: exact attention over [0, S), against attention.dense_attention_torch in fp32."""
    from attention import dense_attention_torch

    threads(n_threads)
    dtype = getattr(torch, dtype)
    n_kv = 2
    gen = torch.Generator().manual_seed(S + g)
    q = torch.randn(B, n_kv, g, d, generator=gen).to(dtype)
    k, _, v, _ = _cache(gen, B + 1, n_kv, S + 5, d, S, dtype, "once")
    ref = dense_attention_torch(q.float(), k.float(), v.float(), S).to(dtype)
    out = kernels.dense_attention_cpu(q, k, v, S)
    _check(out, ref, *((1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, S:], v2[:, :, S:], k2[B:], v2[B:] = float("nan"), float("nan"), float("nan"), float("nan")
    assert torch.equal(kernels.dense_attention_cpu(q, k2, v2, S), out)



@pytest.mark.parametrize("B,H,n_kv,T,S,d,dtype,n_threads", [
    (1, 9, 3, 100, 100, 64, "float32", 2),  # a whole prompt: SmolLM2's heads
    (2, 8, 2, 37, 170, 80, "float32", 1),  # a later chunk (keys before it); d % 16 != 0
    (1, 14, 2, 130, 200, 64, "bfloat16", 2),  # Qwen's 7 query heads per KV head; 3 blocks of queries
    (1, 4, 4, 1, 1, 16, "float32", 2),  # one token
    (1, 4, 1, 5, 9, 7, "float16", 2),
    (2, 6, 3, 65, 129, 33, "bfloat16", 2),  # odd d in bf16 pairs; a last block of one key (and a query block of one)
    (1, 8, 4, 70, 300, 256, "bfloat16", 1)])  # Gemma's head dim
def test_prefill_attention_matches_fp64(B, H, n_kv, T, S, d, dtype, n_threads, threads):
    """kernels.prefill_attention_cpu: the T queries of a chunk, the last T of S positions, each attending
    causally; against attention.prefill_attention (SDPA) in fp64, on cache views (keys strided by S_max).
    bf16 takes the vdpbf16ps unit where the build has AVX512_BF16 (P rounded to bf16 for P V)."""
    from attention import prefill_attention

    threads(n_threads)
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(T * S + d)
    q = torch.randn(B, T, H, d, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, d), as Attention makes it
    k = torch.randn(B + 1, n_kv, S + 7, d, generator=gen).to(dtype)[:B, :, :S]
    v = torch.randn(B + 1, n_kv, S + 7, d, generator=gen).to(dtype)[:B, :, :S]
    ref = prefill_attention(q.double(), k.double(), v.double(), S - T, None, None)
    out = kernels.prefill_attention_cpu(q, k, v)
    assert out.dtype == dtype and out.shape == (B, H, T, d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # a 16-bit output: one rounding
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=tol, rtol=tol)


def test_prefill_kernel_in_the_model_matches_sdpa():
    """A chunked prefill with the CPU kernels (the prefill attention kernel, F.linear) gives the torch
    kernels' logits (SDPA); with autograd on, the model leaves attention to SDPA (the kernel has no backward)."""
    from decoding import prefill
    from cache import KVFormat
    from model import ModelArgs, random_model

    args = ModelArgs.from_shape("tiny")
    prompt = torch.randint(args.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kern in (kernels.TORCH_KERNELS, kernels.CPU_KERNELS):
        model = random_model(args, kernels=kern, seed=1)
        model.setup_caches(2, 160, KVFormat())
        with torch.no_grad():
            logits[kern.name] = prefill(model, prompt, chunk=64)  # chunks of 22, 64, 64 tokens
    torch.testing.assert_close(logits["cpu"], logits["torch"], atol=1e-5, rtol=1e-5)
    attention = model.layers[0].attention
    q = torch.randn(1, 4, 3, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    attention.prefill(q, k, v, 0).sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("q_dtype,d,g", [("float32", 64, 3), ("float16", 128, 8), ("float32", 96, 2), ("float32", 80, 5)])
def test_fused_dense_bf16_cache_with_wider_query(q_dtype, d, g, threads):
    """A bf16 cache with an fp32 / fp16 q (quantized models, a bf16 cache asked for): q keeps its
    precision (on the bf16 dot-product path as hi + lo bf16 planes), so the kernel matches the fp32
    reference on the cache's values to fp32 accuracy; d = 96 has an odd number of 16-lane vectors
    and d = 80 is off the bf16 path's 32-wide vectors."""
    from attention import dense_attention_torch

    threads(2)
    B, n_kv, S = 2, 2, 1500
    gen = torch.Generator().manual_seed(d + g)
    q = (torch.randn(B, n_kv, g, d, generator=gen) * 3).to(getattr(torch, q_dtype))
    k, _, v, _ = _cache(gen, B, n_kv, S, d, S, torch.bfloat16, "once")
    ref = dense_attention_torch(q.double(), k.double(), v.double(), S).to(q.dtype)
    _check(kernels.dense_attention_cpu(q, k, v, S), ref, *((1e-5, 1e-4) if q_dtype == "float32" else (1e-3, 1e-3)))

# Ragged batches: per-row live lengths (B,). (kind, d, layout, dtype, threads, lengths): both
# kernels, head dims 64 / 128 / 256 (Gemma), both layouts, fp32 / bf16, one and two threads; rows
# shorter than k, than the local window, of one position, and long enough to be split into chunks.
RAGGED = [
    ("sparq", 64, "twice", "float32", 2, (3000, 700, 1, 4500)),
    ("sparq", 64, "once", "bfloat16", 1, (129, 2600, 40)),
    ("sparq", 128, "once", "float32", 2, (5000, 90)),
    ("sparq", 128, "twice", "bfloat16", 2, (17, 2300, 2300)),
    ("sparq", 256, "twice", "float32", 2, (2100, 300, 4)),
    ("sparq", 256, "once", "bfloat16", 1, (1000, 3000)),
    ("dense", 64, "once", "float32", 2, (3000, 700, 1, 4500)),
    ("dense", 128, "once", "bfloat16", 1, (129, 2600, 40)),
    ("dense", 256, "once", "float32", 2, (5000, 90, 2047)),
    ("dense", 256, "once", "bfloat16", 2, (33, 1200)),
]


def _ragged_cache(gen, lengths, n_kv, g, d, dtype, layout, cfg):
    """q and a cache of B = len(lengths) rows (+ one spare) holding random values at each row's
    live positions and zeros elsewhere, with v_sum summed over each row's own positions."""
    B, S = len(lengths), max(lengths)
    k, k_t, v, _ = _cache(gen, B + 1, n_kv, S + 7, d, S, dtype, layout)
    q = _query(gen, B, n_kv, g, d, cfg.r, dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:], v[b, :, n:] = 0, 0
        _untie(gen, q[b:b + 1], k[b:b + 1], v[b:b + 1], n, cfg)
    k_t = k.transpose(2, 3).contiguous() if layout == "twice" else None
    v_sum = torch.stack([v[b, :, :n].float().sum(1) for b, n in enumerate(lengths)] + [v[B, :, :S].float().sum(1)])
    return q, k, k_t, v, v_sum


def _poisoned(k, k_t, v, v_sum, lengths):
    """Copies with NaN at every position beyond each row's live length and in the spare rows."""
    B = len(lengths)
    k2, v2, v_sum2 = k.clone(), v.clone(), v_sum.clone()
    k_t2 = None if k_t is None else k_t.clone()
    for b, n in enumerate(lengths):
        k2[b, :, n:], v2[b, :, n:] = float("nan"), float("nan")
        if k_t2 is not None:
            k_t2[b, :, :, n:] = float("nan")
    k2[B:], v2[B:], v_sum2[B:] = float("nan"), float("nan"), float("nan")
    if k_t2 is not None:
        k_t2[B:] = float("nan")
    return k2, k_t2, v2, v_sum2


@pytest.mark.parametrize("kind,d,layout,dtype,n_threads,lengths", RAGGED)
def test_ragged_rows_match_each_row_alone(kind, d, layout, dtype, n_threads, lengths, threads):
    """live_length (B,): each row equals that row run alone with its own length, and the torch path
    with per-row lengths; nothing beyond a row's length (NaN there) nor in rows >= B is read."""
    from attention import dense_attention_torch
    from sparq import sparq_attention_torch

    threads(n_threads)
    dtype = getattr(torch, dtype)
    n_kv, g = (2, 3) if d < 256 else (1, 4)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, d, layout, lengths)).encode()))
    cfg = SparQConfig(r=8, k_top=128, local=32, mean_v=True)
    q, k, k_t, v, v_sum = _ragged_cache(gen, lengths, n_kv, g, d, dtype, layout, cfg)
    live, S = torch.tensor(lengths), max(lengths)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)

    def fused(q, k, k_t, v, v_sum, length, live_length):
        if kind == "dense":
            return kernels.dense_attention_cpu(q, k, v, length, live_length)
        return kernels.sparq_attention_cpu(q, k, k_t, v, v_sum, length, live_length, cfg.r, cfg.k_top, cfg.local, cfg.mean_v)

    out = fused(q, *_poisoned(k, k_t, v, v_sum, lengths), S, live)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):  # the row alone, at its own length
        alone = fused(q[b:b + 1], k[b:b + 1], None if k_t is None else k_t[b:b + 1], v[b:b + 1], v_sum[b:b + 1], n, None)
        _check(out[b:b + 1], alone, *tol)
    if kind == "dense":
        ref = dense_attention_torch(q.float(), k.float(), v.float(), S, live).to(dtype)
    else:
        ref = sparq_attention_torch(q, k, k_t, v, v_sum, S, live, cfg.r, cfg.k_top, cfg.local, cfg.mean_v)
    _check(out, ref, *tol)


def test_ragged_lengths_are_checked():
    q = torch.randn(2, 1, 1, 64)
    k = torch.randn(3, 1, 16, 64)
    v_sum = torch.zeros(3, 1, 64)
    for bad in (torch.tensor([16, 0]), torch.tensor([17, 3]), torch.tensor([4]), torch.tensor([[4, 4]])):
        with pytest.raises((RuntimeError, ValueError)):
            kernels.sparq_attention_cpu(q, k, None, k, v_sum, 16, bad, 8, 8, 2, False)
        with pytest.raises((RuntimeError, ValueError)):
            kernels.dense_attention_cpu(q, k, k, 16, bad)


def test_ragged_torch_compile_fullgraph():
    """A (B,) live-length tensor through torch.compile(fullgraph=True): no graph break, same values."""
    torch._dynamo.reset()
    B, n_kv, g, d, S_max = 3, 3, 3, 64, 2048
    gen = torch.Generator().manual_seed(5)
    k, k_t, v, v_sum = _cache(gen, B, n_kv, S_max, d, S_max, torch.float32, "twice")

    def step(q, length: int, live):
        y = kernels.sparq_attention_cpu(q, k, k_t, v, v_sum, length, live, 16, 64, 16, True)
        return y * 2.0 + kernels.dense_attention_cpu(q, k, v, length, live)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lengths in ((1500, 200, 1400), (1700, 1700, 90), (2048, 1, 2000)):
        q = _query(gen, B, n_kv, g, d, 16, torch.float32)
        live = torch.tensor(lengths)
        torch.testing.assert_close(compiled(q, max(lengths), live), step(q, max(lengths), live), atol=0, rtol=0)


@pytest.mark.parametrize("M,N,K,x_dtype,w_dtype,n_threads", [
    (1, 576, 576, "float32", "float32", 2), (1, 1000, 17, "float32", "float32", 1),
    (3, 5, 1536, "float32", "bfloat16", 2), (16, 961, 576, "bfloat16", "bfloat16", 2),
    (2, 4099, 64, "bfloat16", "float32", 2), (1, 3, 1, "float32", "float16", 1),
    (5, 200, 96, "float16", "bfloat16", 2)])
def test_fused_linear_matches_fp64(M, N, K, x_dtype, w_dtype, n_threads, threads):
    """The fused GEMV (sparq::linear_cpu) against an fp64 matmul of the same values; N and K off every block size."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(getattr(torch, x_dtype))
    w = torch.randn(N, K, generator=gen).to(getattr(torch, w_dtype))
    ref = (x.double() @ w.double().T)
    out = torch.ops.sparq.linear_cpu(x, w)
    assert out.dtype == x.dtype and out.shape == (M, N)
    tol = 1e-5 * math.sqrt(K) if x.dtype == torch.float32 else 1e-2  # bf16 output: one rounding
    torch.testing.assert_close(out.double(), ref.to(x.dtype).double(), atol=tol, rtol=tol)


def test_fused_linear_in_the_model_matches_f_linear():
    """model.Linear with the CPU kernels: decode-sized inputs take the GEMV, prefill-sized ones F.linear;
    a bias is added either way."""
    import model

    gen = torch.Generator().manual_seed(0)
    layer = model.Linear(96, 40, bias=True, kernels=kernels.CPU_KERNELS)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        layer.bias.copy_(torch.randn(40, generator=gen))
    with torch.no_grad():  # as every decode path runs
        for shape in ((2, 1, 96), (1, 33, 96)):  # a decode step of 2 rows; a 33-token prefill
            x = torch.randn(*shape, generator=gen)
            expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        compiled = torch.compile(layer, fullgraph=True)
        x = torch.randn(3, 1, 96, generator=gen)
        torch.testing.assert_close(compiled(x), layer(x), atol=0, rtol=0)


def test_fused_linear_leaves_gradients_to_f_linear():
    """The C++ GEMV has no backward: with autograd on, model.Linear must give F.linear's gradients."""
    import model

    gen = torch.Generator().manual_seed(0)
    layer = model.Linear(96, 40, kernels=kernels.CPU_KERNELS)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
    x = torch.randn(2, 1, 96, generator=gen, requires_grad=True)  # decode-sized: the GEMV's shape
    layer(x).square().sum().backward()
    expected_w, expected_x = torch.autograd.grad(
        torch.nn.functional.linear(x, layer.weight).square().sum(), (layer.weight, x))
    torch.testing.assert_close(layer.weight.grad, expected_w)
    torch.testing.assert_close(x.grad, expected_x)


# ---------------------------------------------------------------------------------------------
# The quantized GEMVs (csrc/linear_quant.cpp) and the instruction-set variants of the GEMVs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K,group,x_dtype,scale_dtype,n_threads", [
    (1, 576, 576, None, "float32", "bfloat16", 2), (3, 5, 100, None, "float32", "float32", 1),  # K % 16 != 0
    (16, 961, 576, 64, "bfloat16", "bfloat16", 2), (2, 4099, 64, 32, "float32", "bfloat16", 2),
    (5, 67, 1536, 16, "float16", "float32", 1)])
def test_fused_int8_linear_matches_fp64(M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """sparq::linear_int8_cpu: per-channel and grouped scales, against fp64 over the dequantized weights."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(getattr(torch, x_dtype))
    q = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    s = (torch.rand(N, K // (group or K), generator=gen) + 0.01).to(getattr(torch, scale_dtype))
    if group is None:
        s = s[:, 0]
    w = q.double() * (s.double()[:, None] if group is None else s.double().repeat_interleave(group, 1))
    out = torch.ops.sparq.linear_int8_cpu(x, q, s)
    assert out.dtype == x.dtype and out.shape == (M, N)
    ref = (x.double() @ w.T).to(x.dtype).double()
    tol = 1e-5 * math.sqrt(K) * float(ref.abs().max()) / 10 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-2 if x.dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("M,N,K,group,x_dtype,scale_dtype,n_threads", [
    (1, 576, 576, 32, "float32", "bfloat16", 2), (3, 5, 64, 32, "float32", "float32", 1),
    (16, 961, 576, 64, "bfloat16", "bfloat16", 2), (2, 1027, 1536, 256, "float32", "bfloat16", 2),
    (7, 67, 768, 128, "float16", "float32", 1)])
def test_fused_int4_linear_matches_fp64(M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """sparq::linear_int4_cpu on quantize.py's portable nibbles (low nibble = even column):
    W = (q - 8) * s + z per group, against fp64."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(getattr(torch, x_dtype))
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    s = (torch.rand(N, K // group, generator=gen) + 0.01).to(getattr(torch, scale_dtype))
    z = torch.randn(N, K // group, generator=gen).to(getattr(torch, scale_dtype))
    w = (q.double() - 8) * s.double().repeat_interleave(group, 1) + z.double().repeat_interleave(group, 1)
    out = torch.ops.sparq.linear_int4_cpu(x, packed, s, z)
    assert out.dtype == x.dtype and out.shape == (M, N)
    ref = (x.double() @ w.T).to(x.dtype).double()
    tol = 1e-5 * math.sqrt(K) * float(ref.abs().max()) / 10 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-2 if x.dtype != torch.float32 else 1e-5)


def int4_q8_reference(x, q, s, z, group):
    """fp64 over x quantized as llama.cpp's Q8_0 does, per group of the weight: xq = round(x * 127 /
    max|x_g|) (in fp32, ties to even), x ~ xq * max|x_g| / 127; the weights W = (q - 8) s + z, with the
    zero points' term on x itself (what sparq::linear_int4_q8_cpu documents)."""
    M, K = x.shape
    xg = x.float().reshape(M, K // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.round(xg * torch.where(amax > 0, 127 / amax, 0)).double() * (amax / 127).double()
    rep = lambda t: t.double().repeat_interleave(group, 1)  # noqa: E731
    return xq.reshape(M, K) @ ((q.double() - 8) * rep(s)).T + x.double() @ rep(z).T


@pytest.mark.parametrize("M,N,K,group,x_dtype,scale_dtype,n_threads", [
    (1, 576, 576, 32, "float32", "bfloat16", 2), (3, 5, 64, 32, "float32", "float32", 1),
    (16, 961, 576, 64, "bfloat16", "bfloat16", 2), (2, 1027, 1536, 256, "float32", "bfloat16", 2),
    (7, 67, 768, 128, "float16", "float32", 1), (1, 130, 4160, 32, "float32", "bfloat16", 2)])
def test_int4_with_int8_activations_matches_fp64(M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """sparq::linear_int4_q8_cpu: linear_int4_cpu's weights in rows of 16 (quantize.pack_int4_rows16),
    x quantized to int8 per group (the integer dot products are exact, so only fp32 rounding separates
    it from the fp64 reference). N = 5, 67, 130, 961, 1027: a last block of fewer than 16 rows, odd
    pairs of blocks, units of threads. Some rows of x hold a zero group (scale 0)."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen)
    x[0, :group] = 0
    x = x.to(getattr(torch, x_dtype))
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    s = (torch.rand(N, K // group, generator=gen) + 0.01).to(getattr(torch, scale_dtype))
    z = torch.randn(N, K // group, generator=gen).to(getattr(torch, scale_dtype))
    rows16 = pack_int4_rows16(q[:, 0::2] | (q[:, 1::2] << 4), s, z)
    out = torch.ops.sparq.linear_int4_q8_cpu(x, *rows16, N)
    assert out.dtype == x.dtype and out.shape == (M, N)
    ref = int4_q8_reference(x, q, s, z, group).to(x.dtype).double()
    tol = 1e-5 * math.sqrt(K) * float(ref.abs().max()) / 10 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-2 if x.dtype != torch.float32 else 1e-5)
    # and it is an approximation of the fp32 GEMV, not something else: within the rounding of x to 8 bits
    w = (q.double() - 8) * s.double().repeat_interleave(group, 1) + z.double().repeat_interleave(group, 1)
    exact = x.double() @ w.T
    assert float((out.double() - exact).norm() / exact.norm()) < 0.02


def test_int4_rows16_layout_round_trips():
    """pack_int4_rows16: rows in blocks of 16 (zero rows appended), 4 bytes of a row per 64-byte chunk."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (37, 72), generator=gen, dtype=torch.uint8)
    s, z = torch.rand(37, 9, generator=gen), torch.randn(37, 9, generator=gen)
    w16, s16, z16 = pack_int4_rows16(w, s, z)
    assert w16.shape == (3, 18, 16, 4) and s16.shape == z16.shape == (3, 9, 16)
    assert torch.equal(w16[1, 5, 7], w[16 + 7, 20:24]) and s16[2, 4, 4] == s[36, 4]
    assert not w16[2, :, 5:].any() and not s16[2, :, 5:].any()  # the padding rows
    for a, b in zip(unpack_int4_rows16(w16, s16, z16, 37), (w, s, z)):
        assert torch.equal(a, b)


def q8_activations(x, group=32):
    """x rounded as llama.cpp's Q8_0 does, per group of 32 columns: round(x * 127 / max|x_g|) (fp32, ties
    to even) times max|x_g| / 127, in fp64."""
    M, K = x.shape
    xg = x.float().reshape(M, K // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    return (torch.round(xg * torch.where(amax > 0, 127 / amax, 0)).double() * (amax / 127).double()).reshape(M, K)


@pytest.mark.parametrize("M,N,K,group,x_dtype,scale_dtype,n_threads", [
    (1, 576, 576, None, "float32", "bfloat16", 2), (3, 5, 64, None, "float32", "float32", 1),
    (16, 961, 576, 64, "bfloat16", "bfloat16", 2), (2, 1027, 1536, None, "float32", "bfloat16", 2),
    (7, 67, 768, 128, "float16", "float32", 1), (1, 49157, 576, 64, "bfloat16", "bfloat16", 2)])
def test_int8_with_int8_activations_matches_fp64(M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """sparq::linear_int8_q8_cpu: linear_int8_cpu's weights in rows of 16 (quantize.pack_int8_rows16, codes
    stored as q + 128), x quantized to int8 per group of 32 (the integer dot products are exact, so only
    fp32 rounding separates it from the fp64 reference over the rounded x). Per channel and grouped
    scales; N = 5, 67, 961, 1027, 49157: a last block of fewer than 16 rows, odd pairs of blocks, the
    head's size. Codes at both ends (-127, 127); a zero group of x (scale 0)."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen)
    x[0, :32] = 0
    x = x.to(getattr(torch, x_dtype))
    q = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    q[0, :8], q[-1, -8:] = -127, 127
    s = (torch.rand(N, K // (group or K), generator=gen) + 0.01).to(getattr(torch, scale_dtype))
    s = s[:, 0] if group is None else s
    w = q.double() * (s.double()[:, None] if group is None else s.double().repeat_interleave(group, 1))
    out = torch.ops.sparq.linear_int8_q8_cpu(x, *pack_int8_rows16(q, s), N)
    assert out.dtype == x.dtype and out.shape == (M, N)
    ref = (q8_activations(x) @ w.T).to(x.dtype).double()
    tol = (1e-5 * math.sqrt(K) / 10 if x.dtype == torch.float32 else 8e-3) * float(ref.abs().max())  # 16 bits: ulps
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-2 if x.dtype != torch.float32 else 1e-5)
    exact = x.double() @ w.T  # an approximation of the GEMV, within the rounding of x to 8 bits
    assert float((out.double() - exact).norm() / exact.norm()) < 0.02


def test_int8_rows16_layout_round_trips():
    """pack_int8_rows16: codes + 128, rows in blocks of 16 (zero rows appended), 4 columns of a row per
    64-byte chunk; per-channel scales become (NB, 1, 16)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-128, 128, (37, 64), generator=gen, dtype=torch.int8)
    for s in (torch.rand(37, generator=gen), torch.rand(37, 2, generator=gen)):
        w16, s16 = pack_int8_rows16(w, s)
        assert w16.shape == (3, 16, 16, 4) and s16.shape == (3, s.numel() // 37, 16)
        assert torch.equal(w16[1, 5, 7].view(torch.int8) ^ -128, w[16 + 7, 20:24]) and s16[2, 0, 4] == s.reshape(37, -1)[36, 0]
        assert not w16[2, :, 5:].any() and not s16[2, :, 5:].any()  # the padding rows
        for a, b in zip(unpack_int8_rows16(w16, s16, 37, per_channel=s.dim() == 1), (w, s)):
            assert torch.equal(a, b)


def test_int4_q8_path_matches_the_cpu():
    """The int8-activation GEMVs use vpdpbusd where the build targets AVX512_VNNI (-march=native), else
    vpmaddubsw where it has AVX2 and FMA, else the portable path."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
        assert torch.ops.sparq.linear_q8_path() == "vnni"
    elif {"avx2", "fma"} <= flags:
        assert torch.ops.sparq.linear_q8_path() == "avx2"
    else:
        assert torch.ops.sparq.linear_q8_path() == "portable"


# ---------------------------------------------------------------------------------------------
# The prefill GEMMs on the rows16 weights (sparq::linear_int4_q8_gemm_cpu / linear_int8_q8_gemm_cpu)
# ---------------------------------------------------------------------------------------------


def q8_layer(bits, N, K, group, scale_dtype, gen):
    """A random gemv-q8 weight: (its rows16 tensors, q, s, z, W = the dequantized weight in fp64). int4: nibbles
    in [0, 15], scales and zeros per group; int8: codes in [-127, 127] with both ends present, scales per channel
    (group None) or per group."""
    if bits == 4:
        q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
        s = (torch.rand(N, K // group, generator=gen) + 0.01).to(scale_dtype)
        z = torch.randn(N, K // group, generator=gen).to(scale_dtype)
        w = (q.double() - 8) * s.double().repeat_interleave(group, 1) + z.double().repeat_interleave(group, 1)
        return pack_int4_rows16(q[:, 0::2] | (q[:, 1::2] << 4), s, z), q, s, z, w
    q = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    q[0, :8], q[-1, -8:] = -127, 127
    s = (torch.rand(N, K // (group or K), generator=gen) + 0.01).to(scale_dtype)
    s = s[:, 0] if group is None else s
    w = q.double() * (s.double()[:, None] if group is None else s.double().repeat_interleave(group, 1))
    return pack_int8_rows16(q, s), q, s, None, w


def q8_gemm(bits, x, rows16, N):
    op = torch.ops.sparq.linear_int4_q8_gemm_cpu if bits == 4 else torch.ops.sparq.linear_int8_q8_gemm_cpu
    return op(x, *rows16, N)


def q8_gemv(bits, x, rows16, N):
    """The decode GEMV on any number of rows, 16 at a time."""
    op = torch.ops.sparq.linear_int4_q8_cpu if bits == 4 else torch.ops.sparq.linear_int8_q8_cpu
    return torch.cat([op(x[i:i + 16], *rows16, N) for i in range(0, x.shape[0], 16)])


def q8_input(M, K, x_dtype, gen):
    """x (M, K) with a zero group in row 1 (scale 0) and a last row far larger than the others."""
    x = torch.randn(M, K, generator=gen)
    x[1, :32] = 0
    x[-1] *= 1000 if x_dtype != torch.float16 else 4  # fp16 outputs stay finite
    return x.to(x_dtype)


# bits, M, N, K, weight group (int8: None = per channel), x dtype, scale dtype, threads. M: one row past a
# decode step's 16, past one m-chunk of 256 rows, not a multiple of the tiles' 4 rows; N: a last block of
# 5 or 3 live rows, a single block, odd numbers of blocks; every int4 group size of quantize.GROUP_SIZES and
# the int8 groups gemv-q8 takes (per channel, the head's 64 and 32, 128).
Q8_GEMM_CASES = [
    (4, 17, 67, 576, 32, "float32", "bfloat16", 2), (4, 259, 961, 576, 64, "bfloat16", "bfloat16", 2),
    (4, 45, 131, 1536, 128, "float16", "float32", 1), (4, 33, 1027, 768, 256, "float32", "bfloat16", 2),
    (4, 130, 16, 64, 32, "float32", "float32", 2), (4, 300, 3072, 576, 32, "float32", "bfloat16", 2),
    (8, 17, 67, 576, None, "float32", "bfloat16", 2), (8, 259, 961, 576, 64, "bfloat16", "bfloat16", 2),
    (8, 45, 131, 1536, None, "float16", "float32", 1), (8, 33, 1027, 768, 128, "float32", "bfloat16", 2),
    (8, 130, 5, 32, 32, "float32", "float32", 2), (8, 300, 576, 1536, None, "float32", "bfloat16", 2),
]


@pytest.mark.parametrize("bits,M,N,K,group,x_dtype,scale_dtype,n_threads", Q8_GEMM_CASES)
def test_q8_gemm_rows_are_the_gemvs_bit_for_bit(bits, M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """Each row of the prefill GEMM is the decode GEMV's output for that row, bit for bit: the integer dot
    products are exact and the float epilogue is the GEMV's, in its order (csrc/linear_quant.cpp). So a
    prompt's positions get what one-token steps would, whatever the chunking, tiles or threads."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K + bits)
    x = q8_input(M, K, getattr(torch, x_dtype), gen)
    rows16 = q8_layer(bits, N, K, group, getattr(torch, scale_dtype), gen)[0]
    out = q8_gemm(bits, x, rows16, N)
    assert out.dtype == x.dtype and out.shape == (M, N)
    assert torch.equal(out, q8_gemv(bits, x, rows16, N))
    for m in (0, M // 2, M - 1):  # and each row alone
        assert torch.equal(out[m:m + 1], q8_gemv(bits, x[m:m + 1], rows16, N)), m


def kernel_rounded_x(x, group):
    """x rounded to int8 per group of `group` columns as the kernels round it (quantize_group): xq =
    round_half_even(x * fp32(127 / max|x_g|)), times fp32(max|x_g| / 127), in fp64. The 127 / max is a true
    fp32 division, as the kernel's: torch's `127 / tensor` is 127 * reciprocal(tensor), one rounding more,
    which moves an x at a half step (x = max / 2, say) to the other side."""
    M, K = x.shape
    xg = x.float().reshape(M, K // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0)
    return (torch.round(xg * inv).double() * (amax / 127).double()).reshape(M, K)


def activation_rounding_bound(x, w_rounded, group):
    """The most rounding x to int8 per group of `group` columns (|error| <= max|x_g| / 254 per element) can move
    each output, against the weights it meets (w_rounded (N, K), fp64): sum_g max|x_g| / 254 sum_{k in g}
    |w[n, k]|, (M, N)."""
    M, K = x.shape
    half_step = x.double().reshape(M, K // group, group).abs().amax(-1) / 254
    return half_step @ w_rounded.abs().reshape(w_rounded.shape[0], K // group, group).sum(-1).T


@pytest.mark.parametrize("bits,M,N,K,group,x_dtype,scale_dtype,n_threads", Q8_GEMM_CASES)
def test_q8_gemm_matches_fp64(bits, M, N, K, group, x_dtype, scale_dtype, n_threads, threads):
    """The GEMM against two independent fp64 references: over x rounded as the kernel documents it
    (kernel_rounded_x, llama.cpp's Q8_0 rounding: exact but for fp32 rounding), and over x itself (the dequantized weights' F.linear), within the most the rounding of x
    can move each output (activation_rounding_bound): int4 rounds x per weight group and its zero points' term
    sees x exactly, int8 rounds x per 32 columns."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(M * N + K + bits)
    x = q8_input(M, K, getattr(torch, x_dtype), gen)
    rows16, q, s, z, w = q8_layer(bits, N, K, group, getattr(torch, scale_dtype), gen)
    out = q8_gemm(bits, x, rows16, N).double()
    if bits == 4:  # W = (q - 8) s + z, the zero points' term on x itself
        scaled = (q.double() - 8) * s.double().repeat_interleave(group, 1)
        ref = kernel_rounded_x(x, group) @ scaled.T + x.double() @ z.double().repeat_interleave(group, 1).T
        bound = activation_rounding_bound(x, scaled, group)
    else:
        ref = kernel_rounded_x(x, 32) @ w.T
        bound = activation_rounding_bound(x, w, 32)
    # fp32 sums of K products against fp64, and the output's own rounding to x's dtype (bf16 2^-8, fp16 2^-11)
    ulp = {"float32": 2 ** -23, "bfloat16": 2 ** -8, "float16": 2 ** -11}[x_dtype]
    magnitude = x.double().abs() @ w.abs().T  # sum_k |x_k w_k| bounds every partial sum
    fp_tol = 1e-6 * math.sqrt(K) * magnitude + ulp * ref.abs()
    assert ((out - ref).abs() <= fp_tol).all(), float(((out - ref).abs() / fp_tol).max())
    exact = x.double() @ w.T
    assert ((out - exact).abs() <= bound * (1 + 1e-4) + fp_tol + ulp * exact.abs()).all()
    assert float((out - exact).norm() / exact.norm()) < 0.02  # the rounding is small beside the outputs


def test_q8_gemm_checks_its_arguments():
    """Any number of rows, none included (the GEMVs take at most 16); a weight of another N or K is a
    one-line error."""
    gen = torch.Generator().manual_seed(0)
    rows16 = q8_layer(4, 20, 64, 32, torch.bfloat16, gen)[0]
    assert q8_gemm(4, torch.randn(0, 64), rows16, 20).shape == (0, 20)
    with pytest.raises(RuntimeError, match="N = 40 is not a weight of 2 blocks"):
        q8_gemm(4, torch.randn(40, 64), rows16, 40)
    with pytest.raises(RuntimeError, match="K = x's"):
        q8_gemm(4, torch.randn(40, 96), rows16, 20)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        torch.ops.sparq.linear_int4_q8_cpu(torch.randn(17, 64), *rows16, 20)


def test_q8_gemm_variants_without_cpu_features_are_their_gemvs(kernel_variants):
    """The GEMMs' other paths in the variant builds (AVX-512 without VNNI and AVX2 only: the vpmaddubsw tiles;
    SSE2 only: the portable loops), each row their own build's GEMV bit for bit (each path's epilogue is its
    GEMV's) and near fp64 over the rounded x (tests/variant_check.py)."""
    for flags, (isa, q8, out) in kernel_variants.items():
        assert "Q8 GEMM OK" in out, f"{flags}:\n{out[-3000:]}"
        assert f"Q8 {q8}" in out, f"{flags} built the wrong path:\n{out[-3000:]}"


def test_gemv_isa_matches_the_cpu():
    """The GEMV's instruction set is fixed at build time (-march=native): bf16 dot products where
    the CPU has them."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    isa = torch.ops.sparq.linear_cpu_isa()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert isa == ("avx512-bf16" if "avx512_bf16" in flags else "avx512")
    elif {"avx2", "fma", "f16c"} <= flags:
        assert isa == "avx2"


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_are_each_row_alone_bit_for_bit(w_dtype):
    """Each row of an M-row GEMV call is that row's one-row call bit for bit, whichever block of rows it
    falls in (M = 1..16, N not a multiple of 4): what makes a verify pass its one-token steps."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 576).bfloat16(), torch.randn(963, 576).to(w_dtype)
    alone = torch.cat([torch.ops.sparq.linear_cpu.default(x[m:m + 1], w) for m in range(16)])
    for M in range(1, 17):
        assert torch.equal(torch.ops.sparq.linear_cpu.default(x[:M], w), alone[:M]), M


@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_bf16_decode_rows_take_the_gemv_where_it_pays(rows, monkeypatch):
    """kernels.linear_cpu sends a decode step's bf16 rows to the fused GEMV up to 16 rows where the build
    has vdpbf16ps (1.5-1.7x F.linear at 8-16 rows) or torch's bf16 GEMM is slow (AVX2 CPUs), up to 4
    elsewhere: its output is then the GEMV's bit
    for bit, else F.linear's. Which one ran is watched on F.linear itself (on some CPUs, AMD Zen 3 with
    AVX2, torch's bf16 GEMM and the GEMV round these rows alike, so the outputs cannot tell). With
    every_decode_row (a server's steps) every row count up to 16 takes the GEMV."""
    torch.manual_seed(0)
    x, w = torch.randn(rows, 1, 576).bfloat16(), torch.randn(960, 576).bfloat16()
    calls = []
    original = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    with torch.no_grad():
        y = kernels.linear_cpu(x, w)
        gemv = torch.ops.sparq.linear_cpu.default(x.reshape(rows, 576), w).reshape(rows, 1, 960)
        takes_gemv = rows <= 4 or torch.ops.sparq.linear_cpu_isa() == "avx512-bf16" or kernels.bf16_gemm_widens()
        assert bool(calls) == (not takes_gemv)
        assert torch.equal(y, gemv if takes_gemv else torch_gemm(original, x, w))
        calls.clear()
        assert torch.equal(kernels.linear_cpu(x, w, every_decode_row=True), gemv) and not calls


def torch_gemm(linear, x, w):
    """What linear_cpu's torch side gives a bf16 input: torch's bf16 GEMM, or where it is slow (AVX2 CPUs:
    kernels.bf16_gemm_widens) the same product widened to fp32 and rounded back."""
    if kernels.bf16_gemm_widens():
        return linear(x.float(), w.float()).bfloat16()
    return linear(x, w)


@pytest.mark.parametrize("rows", [17, 128])
def test_bf16_prefill_rows_take_torchs_gemm_widened_where_it_is_slow(rows):
    """A prefill's bf16 rows (more than a decode step's 16) go to torch's GEMM, widened to fp32 on CPUs whose
    torch has no AVX-512 (its bf16 GEMM 6-8x slower there, docs/NOTES.md): either way within bf16's rounding
    of the fp64 product, and exactly the chosen side's result."""
    torch.manual_seed(0)
    x, w = torch.randn(2, rows, 576).bfloat16(), torch.randn(960, 576).bfloat16()
    with torch.no_grad():
        y = kernels.linear_cpu(x, w)
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch_gemm(torch.nn.functional.linear, x, w))
    exact = (x.double() @ w.double().T)
    torch.testing.assert_close(y.double(), exact, atol=0.05, rtol=2 ** -7)


@pytest.fixture(scope="module")
def kernel_variants() -> dict:
    """The GEMV, quantized linear, dense decode and prefill attention sources built with CPU features turned
    off (AVX-512 without its bf16 and VNNI dot products; AVX2 only, x86-64-v3; SSE2 only, the portable vectors),
    each checked by tests/variant_check.py in its own subprocess (a second build of these ops cannot load beside
    the main one), built in parallel and cached in torch's extension dir like the main build. One build per
    variant serves both tests below. {flags: (the GEMV's path, the q8 GEMVs' path, the check's output)}."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86-64 -march flags")
    cpu = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    variants = [(("-march=x86-64",), "portable", "portable")]  # flags, the GEMV's path, the q8 GEMVs' path
    if {"avx2", "fma", "f16c"} <= cpu:
        variants.append((("-march=x86-64-v3",), "avx2", "avx2"))
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu:
        variants.append((("-march=native", "-mno-avx512bf16", "-mno-avx512vnni"), "avx512", "avx2"))
    csrc = Path(kernels.__file__).resolve().parent / "csrc"
    check = csrc.parent / "tests" / "variant_check.py"
    tag = hashlib.sha1(torch.__version__.encode() + check.read_bytes())
    for path in sorted(csrc.iterdir()):
        tag.update(path.name.encode() + path.read_bytes())
    procs = []
    for flags, isa, q8 in variants:  # built in parallel, one subprocess each
        name = "sparq_variant_" + "_".join(f.strip("-").replace("=", "").replace("-", "") for f in flags)
        name += "_" + tag.hexdigest()[:10]
        procs.append((flags, isa, q8, subprocess.Popen([sys.executable, str(check), name, *flags], cwd=csrc.parent,
                                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    results = {}
    for flags, isa, q8, proc in procs:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0 and out.rstrip().endswith("OK"), f"{flags}:\n{out[-3000:]}"
        results[flags] = (isa, q8, out)
    return results


def test_kernel_variants_without_cpu_features_match_fp64(kernel_variants):
    """The variant builds' GEMVs, dense attention (an int8 cache read by widening) and prefill attention
    against fp64: the paths other CPUs take stay correct."""
    for flags, (isa, q8, out) in kernel_variants.items():
        assert f"ISA {isa}" in out and "INT8 float" in out and f"Q8 {q8}" in out, \
            f"{flags} built the wrong path:\n{out[-3000:]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(900,), (900, 517, 64), (3000, 1700, 40), (16000,)])
def test_dense_verify_equals_one_token_steps(dtype, lengths, threads):
    """Speculative verification (kernels.dense_verify_cpu): T = 5 queries per row, query t at position
    n - T + t of a row of n live positions, attend as the one-token kernel does at that position: bit
    for bit where both read one chunk per row. Each row splits by its own length alone (csrc/parallel.h),
    and with as many KV heads as threads every row here is one chunk, the verifying row and its steps
    alike, whatever the other rows (at 16k positions because the logits buffer's bound counts one
    token's heads). Where a row and a step split differently they agree within fp32 rounding only."""
    threads(2)
    gen = torch.Generator().manual_seed(5)
    B, H, g, T, d, S = len(lengths), 2, 4, 5, 64, max(lengths)
    k = torch.randn(B, H, S + 64, d, generator=gen).to(dtype)
    v = torch.randn(B, H, S + 64, d, generator=gen).to(dtype)
    q = torch.randn(B, H, g, T, d, generator=gen).to(dtype)
    live = torch.tensor(lengths)
    out = kernels.dense_verify_cpu(q, k, v, S, live)
    for b, n in enumerate(lengths):
        for t in range(T):
            one = kernels.dense_attention_cpu(q[b:b + 1, :, :, t].contiguous(), k[b:b + 1], v[b:b + 1], n - T + 1 + t)
            assert torch.equal(out[b:b + 1, :, :, t], one), (b, n, t)


# Batch invariance (csrc/parallel.h): each row splits its positions into chunks of the length it takes
# alone, so a row of any ragged batch is that row alone bit for bit, whatever its neighbours (a server
# steps changing sets of busy rows). 3 KV heads on 2 threads: alone, a row of 5000 or 9000 positions
# splits in 2 chunks (3 units leave a thread idle); the former rule, one chunk length for the whole
# batch, kept them whole beside their neighbours (12 or 6 units keep both threads busy), so their sums
# ran in another order. The short rows, one chunk either way, check that a row of one chunk among split
# rows (the chunked path) is that row alone (the path without chunks): of 100 and 300 positions SparQ
# keeps them all, of 1500 it selects.
INVARIANT_LENGTHS = [(100, 5000, 9000, 300), (9000, 2100, 1500)]


def invariant_cache(lengths, n_kv, d, dtype, layout="twice", kv_dtype="auto", kt_dtype="same", seed=0):
    """A KVCache of len(lengths) rows (+ one spare), row b written alone with lengths[b] random positions
    (keys with an outlier channel, as a quantized K's channel scale expects), and its stored view."""
    B, S = len(lengths), max(lengths)
    cache = KVCache(B + 1, -(-S // 32) * 32 + 32, n_kv, d, dtype, layout=layout, kv_dtype=kv_dtype, kt_dtype=kt_dtype)
    gen = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lengths):
        k = torch.randn(1, n_kv, n, d, generator=gen) * (1 + 4 * (torch.arange(d) == 1))
        cache.update(torch.arange(n), k.to(dtype), torch.randn(1, n_kv, n, d, generator=gen).to(dtype), row=b)
    view = cache.view(S, B, stored=True)
    assert torch.equal(view.live_length, torch.tensor(lengths))
    return cache, view


def stored_row(view, b):
    """Row b of a stored cache view as a batch of one: k, k_t, v, v_sum and the scales, each [b:b + 1]."""
    def one(t):
        return None if t is None else t[b:b + 1]

    scales = view.scales
    if scales is not None:  # K^T sharing K's scales keeps sharing them (the kernels see that it does)
        k_scale = one(scales.k_scale)
        kt_scale = k_scale if scales.kt_scale is scales.k_scale else one(scales.kt_scale)
        scales = kernels.KVScales(k_scale, one(scales.v_scale), one(scales.chan), kt_scale)
    return one(view.k), one(view.k_t), one(view.v), one(view.v_sum), scales


@pytest.mark.parametrize("lengths", INVARIANT_LENGTHS)
@pytest.mark.parametrize("kv_dtype,dtype", [("auto", torch.float32), ("auto", torch.bfloat16), ("int8", torch.float32)])
def test_dense_rows_are_each_row_alone_bit_for_bit(lengths, kv_dtype, dtype, threads):
    """kernels.dense_attention_cpu on a ragged batch (float or int8 cache): each row is its B = 1 call
    at its own length, bit for bit."""
    threads(2)
    n_kv, g, d = 3, 3, 64
    _, view = invariant_cache(lengths, n_kv, d, dtype, "once", kv_dtype)
    q = torch.randn(len(lengths), n_kv, g, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernels.dense_attention_cpu(q, view.k, view.v, view.length, view.live_length, scales=view.scales)
    for b, n in enumerate(lengths):
        k, _, v, _, scales = stored_row(view, b)
        assert torch.equal(out[b:b + 1], kernels.dense_attention_cpu(q[b:b + 1], k, v, n, scales=scales)), (b, n)


@pytest.mark.parametrize("lengths", INVARIANT_LENGTHS)
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_dense_verify_rows_are_each_row_alone_bit_for_bit(lengths, kv_dtype, threads):
    """kernels.dense_verify_cpu (T = 4 queries per row) on a ragged batch: each row is its B = 1
    verification at its own length, bit for bit (the T queries split the row as its one-token step does)."""
    threads(2)
    n_kv, g, d, T = 3, 3, 64, 4
    _, view = invariant_cache(lengths, n_kv, d, torch.float32, "once", kv_dtype)
    q = torch.randn(len(lengths), n_kv, g, T, d, generator=torch.Generator().manual_seed(2))
    out = kernels.dense_verify_cpu(q, view.k, view.v, view.length, view.live_length, scales=view.scales)
    for b, n in enumerate(lengths):
        k, _, v, _, scales = stored_row(view, b)
        alone = kernels.dense_verify_cpu(q[b:b + 1], k, v, n, torch.tensor([n]), scales=scales)
        assert torch.equal(out[b:b + 1], alone), (b, n)


@pytest.mark.parametrize("lengths", INVARIANT_LENGTHS)
@pytest.mark.parametrize("layout,kv_dtype,kt_dtype,dtype", [
    ("twice", "auto", "same", torch.float32), ("once", "auto", "same", torch.float32),
    ("twice", "int8", "same", torch.float32),  # int8 K/V, K^T K's int8 transposed
    ("twice", "auto", "int8", torch.float32), ("twice", "int8", "int4", torch.float32)])
def test_sparq_rows_are_each_row_alone_bit_for_bit(lengths, layout, kv_dtype, kt_dtype, dtype, threads):
    """kernels.sparq_attention_cpu (mean-V: the softmax weights of step 1 reach the output) on a ragged
    batch, float and quantized caches: each row is its B = 1 call at its own length, bit for bit."""
    threads(2)
    n_kv, g, d = 3, 3, 64
    _, view = invariant_cache(lengths, n_kv, d, dtype, layout, kv_dtype, kt_dtype)
    q = torch.randn(len(lengths), n_kv, g, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    settings = (8, 128, 32, True)  # r, k_top, local, mean_v
    out = kernels.sparq_attention_cpu(q, view.k, view.k_t, view.v, view.v_sum, view.length, view.live_length,
                                      *settings, scales=view.scales)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        k, k_t, v, v_sum, scales = stored_row(view, b)
        alone = kernels.sparq_attention_cpu(q[b:b + 1], k, k_t, v, v_sum, n, None, *settings, scales=scales)
        assert torch.equal(out[b:b + 1], alone), (b, n)


def test_each_op_registers_one_fake():
    """Every sparq:: op has one fake (meta) implementation: torch 2.11 (the GPU machine's) refuses a second
    registration at import, which torch 2.13 lets pass, so a stacked decorator broke every GPU import
    unseen by this suite. The CPU ops are registered from one table (each name once, each with its fake
    where it returns a tensor); the Triton ops' registrations are read from the source."""
    import re
    from collections import Counter

    from conftest import REPO

    cpu = Counter(name for name, _, _ in kernels._CPU_OPS)
    assert cpu and all(count == 1 for count in cpu.values()), cpu
    for name, schema, fake in kernels._CPU_OPS:
        assert (fake is None) == schema.endswith("-> str"), name  # a tensor op traces through its fake
        if fake is not None:
            q = torch.empty(2, 3, 4, 8, device="meta")
            shape = fake(q, torch.empty(5, 8, device="meta"), None, None, 7).shape
            assert shape in (q.shape, (2, 5), (2, 7)), (name, shape)
    triton = Counter(re.findall(r"@(\w+)\.register_fake", (REPO / "kernels_triton.py").read_text()))
    assert triton and all(count == 1 for count in triton.values()), triton


def test_a_build_leaves_the_build_tag_as_a_later_load_reads_it(monkeypatch, tmp_path):
    """The tag names the build's folder and keys the AOT programs (aot._aot_machine): a first run, which builds,
    must read the same tag as every later run, which only loads the build, or no later run finds the first run's
    programs. torch's cpp_extension.load appends its library flags to the lists it is given (_prepare_ldflags,
    run here as the build runs it)."""
    from torch.utils import cpp_extension

    before = kernels._cpu_build_tag("core")
    builds = []

    def load(**kwargs):
        builds.append(kwargs["name"])
        cpp_extension._prepare_ldflags(kwargs["extra_ldflags"], False, False, False, False)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))  # nothing built
    kernels._build_and_load("core")
    assert builds == [f"sparq_cpu_core_{before}"] and kernels._cpu_build_tag("core") == before


def test_the_two_builds_split_csrc_and_the_ops(monkeypatch, tmp_path):
    """csrc/'s sources are two builds (kernels.CPU_BUILDS): every .cpp in exactly one, each op registered by the
    build that _first_call loads for it (read from the sources: an op's TORCH_LIBRARY_IMPL line names it), and
    the core build, which a dense run loads alone, registers no SparQ op. Each build's tag changes with its own
    sources and every header, not with the other build's sources."""
    import re

    csrc = Path(kernels._CSRC)
    cpp = sorted(f.name for f in csrc.glob("*.cpp"))
    assert sorted(f for files in kernels.CPU_BUILDS.values() for f in files) == cpp
    registered = {}
    for build, files in kernels.CPU_BUILDS.items():
        for f in files:
            text = (csrc / f).read_text()
            for op in re.findall(r'm\.impl\("(\w+)"', text):
                registered[op] = build
    for name, _, _ in kernels._CPU_OPS:
        assert registered.get(name) == ("sparq" if name in kernels._SPARQ_BUILD_OPS else "core"), name
    assert set(kernels._SPARQ_BUILD_OPS) <= set(registered)

    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in csrc.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(kernels, "_CSRC", str(copy))
    tags = lambda: (kernels._cpu_build_tag("core"), kernels._cpu_build_tag("sparq"))  # noqa: E731
    before = tags()
    with open(copy / "sparq_decode.cpp", "a") as f:
        f.write("// a change\n")
    after_source = tags()
    assert after_source[0] == before[0] and after_source[1] != before[1]
    with open(copy / "simd.h", "a") as f:
        f.write("// a change\n")
    after_header = tags()
    assert after_header[0] != after_source[0] and after_header[1] != after_source[1]


def test_a_dense_run_loads_the_core_build_alone_and_a_sparq_policy_its_own(fused_cpu_kernels, monkeypatch):
    """resolve_kernels builds and loads the core build alone (what a dense run calls: make run waits for no
    SparQ source); a SparQ or adaptive SparQ policy on the CPU kernels loads SparQ's build as it binds its
    kernel (before any step is compiled or timed); dense attention and a policy on the torch kernels never do.
    Builds recorded, not run (both are loaded already, by the fixture)."""
    from attention import DenseDecode
    from sparq import SparQDecode
    from sparq_adaptive import SparQAdaptiveDecode

    built = []
    monkeypatch.setattr(kernels, "_cpu_ext", {"tried": {}, "gemv_isa": None})
    monkeypatch.setattr(kernels, "_build_and_load", built.append)
    assert kernels.resolve_kernels("auto", "cpu", announce=lambda line: None) is kernels.CPU_KERNELS
    DenseDecode(kernels.CPU_KERNELS)
    SparQDecode(SparQConfig(r=8, k_top=32), kernels.TORCH_KERNELS)
    assert built == ["core"]
    SparQDecode(SparQConfig(r=8, k_top=32), kernels.CPU_KERNELS)
    SparQAdaptiveDecode(1 / 8, kernels=kernels.CPU_KERNELS)
    assert built == ["core", "sparq"]  # each build once per process
    monkeypatch.setattr(kernels, "_cpu_ext", {"tried": {}, "gemv_isa": None})

    def no_compiler(build):
        raise OSError("no compiler")

    monkeypatch.setattr(kernels, "_build_and_load", no_compiler)
    with pytest.raises(RuntimeError, match="SparQ's fused CPU kernels cannot be built .*no compiler"):
        SparQAdaptiveDecode(1 / 8, kernels=kernels.CPU_KERNELS)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instruction sets")
def test_int3_unpack_on_every_instruction_set(tmp_path):
    """csrc/simd.h's int3_minus4 (step 1's read of an int3 K^T) in its AVX-512, AVX2 and portable forms against
    the scalar formula: the main build compiles one of them (this machine's), CI's runner perhaps another."""
    from torch.utils import cpp_extension

    source = Path(__file__).resolve().parent / "int3_check.cpp"
    lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{Path(kernels._CSRC)}"]
    for march in ("x86-64", "x86-64-v3", "native"):
        exe = tmp_path / f"int3_{march}"
        subprocess.run(["g++", "-std=c++17", "-O2", f"-march={march}", *includes, str(source), "-o", str(exe),
                        f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"], check=True, capture_output=True)
        done = subprocess.run([str(exe)], capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.strip() == "bad 0", (march, done.stdout)
