"""Run by tests/test_kernels_cpu.py: a variant build of the GEMV, quantized linear (GEMV and GEMM), dense decode
and prefill attention sources alone, with some CPU features turned off, checked against fp64 (a subprocess: a
second build of the same ops cannot load beside the main one). -O1: these builds check each path's arithmetic,
not its speed, and build in about half the time of -O3.
    python tests/variant_check.py NAME FLAG...     (in the repo root; prints "ISA <path>", "INT8 <path>", "Q8 <path>",
                                                  "Q8 GEMM OK" and "OK")
"""

import math
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402  (the op schemas)
from qlinear import pack_int4_rows16, pack_int8_rows16  # noqa: E402

CSRC = Path(kernels.__file__).resolve().parent / "csrc"
SOURCES = [str(CSRC / "linear.cpp"), str(CSRC / "linear_quant.cpp"), str(CSRC / "dense_decode.cpp"),
           str(CSRC / "prefill_attention.cpp")]
name, flags = sys.argv[1], sys.argv[2:]
cpp_extension.load(name=name, sources=SOURCES, extra_cflags=["-O1", *flags, "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False)
print("ISA", torch.ops.sparq.linear_cpu_isa())
print("INT8", torch.ops.sparq.dense_int8_path())
print("Q8", torch.ops.sparq.linear_q8_path())
for M, N, K, xd, wd in [(1, 576, 576, "float32", "float32"), (1, 1000, 17, "float32", "bfloat16"),
                        (3, 5, 1536, "float32", "bfloat16"), (16, 961, 576, "bfloat16", "bfloat16"),
                        (2, 4099, 64, "bfloat16", "float32"), (5, 67, 45, "float16", "float16")]:
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(getattr(torch, xd))
    w = torch.randn(N, K, generator=g).to(getattr(torch, wd))
    ref = (x.double() @ w.double().T).to(x.dtype).double()
    tol = 1e-5 * math.sqrt(K) if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.ops.sparq.linear_cpu(x, w).double(), ref, atol=tol, rtol=tol)
for M, N, K, group in [(1, 100, 576, None), (4, 33, 100, None), (16, 70, 576, 64)]:
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, K // (group or K), generator=g).bfloat16() + 0.01
    s = s[:, 0] if group is None else s
    w = q.double() * (s.double()[:, None] if group is None else s.double().repeat_interleave(group, 1))
    torch.testing.assert_close(torch.ops.sparq.linear_int8_cpu(x, q, s).double(), x.double() @ w.T,
                               atol=1e-4 * float(w.abs().max()) * math.sqrt(K), rtol=1e-5)
    if K % 32 == 0:  # x quantized to int8 per group of 32 (x * 127 / max|x_g| rounded)
        xg = x.reshape(M, K // 32, 32)
        amax = xg.abs().amax(-1, keepdim=True)
        xq = (torch.round(xg * (127 / amax)).double() * (amax / 127).double()).reshape(M, K)
        torch.testing.assert_close(torch.ops.sparq.linear_int8_q8_cpu(x, *pack_int8_rows16(q, s), N).double(), xq @ w.T,
                                   atol=1e-4 * float(w.abs().max()) * math.sqrt(K), rtol=1e-5)
for M, N, K, group in [(1, 100, 576, 32), (9, 37, 256, 128)]:
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s = torch.rand(N, K // group, generator=g).bfloat16() + 0.01
    z = torch.randn(N, K // group, generator=g).bfloat16()
    w = (q.double() - 8) * s.double().repeat_interleave(group, 1) + z.double().repeat_interleave(group, 1)
    out = torch.ops.sparq.linear_int4_cpu(x, q[:, 0::2] | (q[:, 1::2] << 4), s, z)
    torch.testing.assert_close(out.double(), x.double() @ w.T, atol=1e-4 * float(w.abs().max()) * math.sqrt(K),
                               rtol=1e-5)
    # x quantized to int8 per group (x * 127 / max|x_g| rounded), the zero points' term on x itself
    xg = x.reshape(M, K // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = (torch.round(xg * (127 / amax)).double() * (amax / 127).double()).reshape(M, K)
    ref = xq @ ((q.double() - 8) * s.double().repeat_interleave(group, 1)).T + x.double() @ z.double().repeat_interleave(group, 1).T
    out = torch.ops.sparq.linear_int4_q8_cpu(x, *pack_int4_rows16(q[:, 0::2] | (q[:, 1::2] << 4), s, z), N)
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * float(w.abs().max()) * math.sqrt(K), rtol=1e-5)
for B, H, g, d, S, qd, kd in [(1, 2, 3, 64, 1000, "bfloat16", "bfloat16"), (2, 1, 4, 128, 300, "float32", "bfloat16"),
                              (1, 1, 2, 256, 70, "float32", "float32"), (1, 2, 5, 80, 33, "float16", "float16")]:
    g_ = torch.Generator().manual_seed(S + d)
    q = torch.randn(B, H, g, d, generator=g_).to(getattr(torch, qd))
    k, v = (torch.randn(B, H, S, d, generator=g_).to(getattr(torch, kd)) for _ in range(2))
    p = torch.softmax(q.double() @ k.double().transpose(2, 3) / math.sqrt(d), dim=-1)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.ops.sparq.dense_cpu(q, k, v, S).double(), (p @ v.double()).to(q.dtype).double(),
                               atol=tol, rtol=tol)
for B, H, g, d, S in [(1, 2, 3, 64, 700), (2, 1, 2, 128, 90)]:  # an int8 cache: the widening path
    g_ = torch.Generator().manual_seed(S + d)
    q = torch.randn(B, H, g, d, generator=g_)
    k, v = (torch.randint(-127, 128, (B, H, S, d), generator=g_, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = (torch.rand(B, H, S, generator=g_) / 127 for _ in range(2))
    chan = torch.rand(B, H, d, generator=g_) + 0.5
    keys = k.double() * k_scale.double()[..., None] * chan.double()[:, :, None]
    p = torch.softmax(q.double() @ keys.transpose(2, 3) / math.sqrt(d), dim=-1)
    out = torch.ops.sparq.dense_quant_cpu(q, k, v, S, None, 1, k_scale, v_scale, chan)
    torch.testing.assert_close(out.double(), p @ (v.double() * v_scale.double()[..., None]), atol=1e-5, rtol=1e-5)
for B, H, n_kv, T, S, d, dt in [(1, 6, 2, 70, 70, 64, "bfloat16"), (2, 4, 4, 9, 140, 24, "float32")]:  # prefill
    g_ = torch.Generator().manual_seed(T + S + d)
    q = torch.randn(B, H, T, d, generator=g_).to(getattr(torch, dt))
    k, v = (torch.randn(B, n_kv, S, d, generator=g_).to(getattr(torch, dt)) for _ in range(2))
    keys, values = (x.double().repeat_interleave(H // n_kv, 1) for x in (k, v))
    scores = (q.double() @ keys.transpose(2, 3) / math.sqrt(d)).masked_fill(
        torch.arange(S)[None, :] > torch.arange(S - T, S)[:, None], float("-inf"))
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.ops.sparq.prefill_cpu(q, k, v).double(),
                               (torch.softmax(scores, -1) @ values).to(q.dtype).double(), atol=tol, rtol=tol)
# The q8 GEMMs: each row their own build's GEMV bit for bit, and near fp64 over the rounded x.
torch.set_num_threads(2)
def rounded(x, group):  # x rounded to int8 per group as the kernels do (127 / max a true fp32 division), in fp64
    xg = x.float().reshape(x.shape[0], -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0)
    return (torch.round(xg * inv).double() * (amax / 127).double()).flatten(1)
for bits, M, N, K, group, dt in [(4, 37, 67, 576, 32, torch.float32), (4, 21, 35, 256, 128, torch.bfloat16),
                                 (4, 19, 48, 1536, 256, torch.float16), (8, 40, 20, 96, None, torch.float32),
                                 (8, 33, 70, 1536, 64, torch.bfloat16), (8, 18, 16, 576, None, torch.float32)]:
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(dt)
    x[1, :32] = 0
    if bits == 4:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        s, z = (torch.rand(N, K // group, generator=g) + 0.01).bfloat16(), torch.randn(N, K // group, generator=g).bfloat16()
        w = pack_int4_rows16(q[:, 0::2] | (q[:, 1::2] << 4), s, z)
        gemm, gemv = torch.ops.sparq.linear_int4_q8_gemm_cpu, torch.ops.sparq.linear_int4_q8_cpu
        rep = lambda t: t.double().repeat_interleave(group, 1)
        ref = rounded(x, group) @ ((q.double() - 8) * rep(s)).T + x.double() @ rep(z).T
    else:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = (torch.rand(N, K // (group or K), generator=g) + 0.01).bfloat16()
        s = s[:, 0] if group is None else s
        w = pack_int8_rows16(q, s)
        gemm, gemv = torch.ops.sparq.linear_int8_q8_gemm_cpu, torch.ops.sparq.linear_int8_q8_cpu
        ref = rounded(x, 32) @ (q.double() * (s.double()[:, None] if group is None else s.double().repeat_interleave(group, 1))).T
    out = gemm(x, *w, N)
    assert torch.equal(out, torch.cat([gemv(x[i:i + 16], *w, N) for i in range(0, M, 16)])), (bits, M, N, K)
    ref = ref.to(dt).double()
    tol = 1e-5 * math.sqrt(K) * float(ref.abs().max()) / 10 if dt == torch.float32 else 1e-2 * float(ref.abs().max())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-5 if dt == torch.float32 else 1e-2)
print("Q8 GEMM OK")
print("OK")
