"""The GPU check's attention op timing (bench/gpu_check.py's attention section): one layer's decode
attention on a shape, each kernel compared with its reference first, then timed from CUDA graphs
over rotating cache copies larger than L2, against the transfer theory of the policies' formulas.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

L2_BYTES = 50 * 2**20  # H100: rotate copies until every call reads from DRAM
ROTATE_BYTES = 4 * L2_BYTES  # bytes a method must touch per graph replay before a copy comes back
COPY_MEMORY = 24 * 2**30  # at most this much for an attention configuration's cache copies
REFERENCE_ROWS = 2  # batch rows of a shape compared with the reference before it is timed

# Attention shapes: (name, B, n_kv, g, d, S, r, k)
TABLE4 = ("table4 (llama2-7b, B=64)", 64, 32, 1, 128, 4096, 32, 128)
ATTENTION_SHAPES = [TABLE4] + [
    (f"{model} B=1 S={S // 1024}k", 1, n_kv, g, 128, S, 32, 128)
    for model, n_kv, g in (("llama2-7b", 32, 1), ("llama3-8b", 8, 4)) for S in (8192, 32768, 131072)
]
QUICK_ATTENTION = [TABLE4, ("llama2-7b B=1 S=32k", 1, 32, 1, 128, 32768, 32, 128),
                   ("llama3-8b B=1 S=32k", 1, 8, 4, 128, 32768, 32, 128)]
CPU_ATTENTION = [("tiny MHA", 2, 2, 1, 64, 256, 8, 32), ("tiny GQA", 1, 1, 4, 64, 256, 8, 32)]
# The quantized cache (int8 K and V, an int4 K^T), read as stored by the same kernels
QUANT_ATTENTION = [(f"{model} B=1 S=32k int8 K/V, int4 K^T", 1, n_kv, g, 128, 32768, 32, 128)
                   for model, n_kv, g in (("llama2-7b", 32, 1), ("llama3-8b", 8, 4))]
CPU_QUANT_ATTENTION = [("tiny GQA int8 K/V, int4 K^T", 1, 2, 4, 64, 300, 8, 32)]


def transfer_bytes(policy, B: int, n_kv: int, d: int, S: int, elem: int = 2) -> int:
    """Bytes one decode-attention call of `policy` moves: its transfer_elements per KV head."""
    return B * n_kv * policy.transfer_elements(S, d) * elem


def attention_theory(B: int, n_kv: int, d: int, S: int, r: int, k: int, elem: int = 2) -> tuple[int, int]:
    """(dense bytes, SparQ bytes) of one call: 2Sd + 2d and Sr + 2kd + 4d per KV head (k capped at S)."""
    from attention import DenseDecode
    from sparq import SparQConfig, SparQDecode

    sparq = SparQDecode(SparQConfig(r=r, k_top=k), dense_when_short=False)
    return transfer_bytes(DenseDecode(), B, n_kv, d, S, elem), transfer_bytes(sparq, B, n_kv, d, S, elem)


def sparq_extra_bytes(B: int, n_kv: int, g: int, S: int) -> int:
    """Bytes our kernels move beyond the paper's count: step 1's fp32 logits, written once and read once."""
    return B * n_kv * g * S * 4 * 2


# ---------------------------------------------------------------------------------------------
# Timing the attention op
# ---------------------------------------------------------------------------------------------


def time_cuda_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Seconds per call: every call captured once into one CUDA graph (each call on its own cache
    copy), the graph replayed `replays` times between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(calls))


def time_host(calls: list[Callable[[], object]], replays: int = 2) -> float:
    """The CPU smoke's stand-in for time_cuda_graph: wall-clock seconds per call."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(replays):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (replays * len(calls))


def short_kernel_name(name: str) -> str:
    """A profiler kernel name shortened for the report: Triton's '_sparq_step1_kernel' -> 'sparq_step1',
    ATen's 'void at::native::(anonymous namespace)::tinygemm_m16n8k16_chunk_kernel<...>(...)' ->
    'void at::native::tinygemm_m16n8k16_chunk' (the anonymous namespace's parenthesis is not the arguments')."""
    name = name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].strip()
    return name.strip("_").removesuffix("_kernel") or name


def kernel_events(events) -> list:
    """The GPU kernel launches among profiler `events` (memcpy and memset left out)."""
    return [e for e in events if str(getattr(e, "device_type", "")).split(".")[-1].lower() in ("cuda", "kernel")
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


def kernel_times(events) -> dict[str, float]:
    """name -> total device microseconds of the GPU kernels among profiler `events` (kernel_events), in
    first-launch order."""
    times: dict[str, float] = {}
    for e in kernel_events(events):
        name = short_kernel_name(e.name)
        times[name] = times.get(name, 0.0) + e.time_range.elapsed_us()
    return times


def kernels_per_call(calls: list[Callable[[], object]]) -> Optional[tuple[int, dict[str, float]]]:
    """(GPU kernels one call launches, name -> device microseconds per call) from torch.profiler over
    `calls` (each on its own cache copy, after a warm-up), launched eagerly: the sum of a call's kernel
    times, set beside its time in a CUDA graph, shows how much of the call is gaps between kernels.
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls:
            call()
        torch.cuda.synchronize()
    events = list(prof.events())
    per_call = {name: us / len(calls) for name, us in kernel_times(events).items()}
    return len(kernel_events(events)) // len(calls), per_call


def memory_bandwidth(device: str, gib: int = 4) -> dict[str, float]:
    """The device's memory rates, bytes/s, each from CUDA graphs over `gib` GiB: "copy" (a device-to-device
    copy, bytes read + written) and "read" (a sum over the tensor: bytes read). Decode attention only
    reads, and a read streams faster than a copy (no read/write turnaround), so the transfer theory
    uses the read rate: a kernel at 100% reads as fast as this device was seen reading."""
    n = gib * 2**30 // 4
    a = torch.empty(n, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 4 / time_cuda_graph([lambda: b.copy_(a)], replays=5)
    read = a.numel() * 4 / time_cuda_graph([lambda: a.sum()], replays=5)
    return dict(copy=copy, read=read)  # a and b are freed on return


def _attention_copies(B, n_kv, g, d, S, dtype, device, n_copies, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    copies = []
    for _ in range(n_copies):
        k = torch.randn(B, n_kv, S, d, generator=gen, device=device, dtype=dtype)
        v = torch.randn(B, n_kv, S, d, generator=gen, device=device, dtype=dtype)
        copies.append(dict(q=torch.randn(B, n_kv, g, d, generator=gen, device=device, dtype=dtype), k=k, v=v,
                           k_t=k.transpose(2, 3).contiguous(), v_sum=v.sum(2, dtype=torch.float32)))
    return copies


def dense_candidates(device: str) -> dict[str, Callable]:
    """name -> fn(copy, S): every dense decode attention available here, each reading positions [0, S)."""
    import torch.nn.functional as F

    import kernels_triton

    def sdpa(c, S):
        B, n_kv, g, d = c["q"].shape
        return F.scaled_dot_product_attention(c["q"].reshape(B, n_kv * g, 1, d), c["k"][:, :, :S], c["v"][:, :, :S],
                                              enable_gqa=g > 1).view(B, n_kv, g, d)

    candidates = {"sdpa": sdpa,
                  "triton": lambda c, S: kernels_triton.dense_attention_triton(c["q"], c["k"], c["v"], S, None)}
    if device == "cuda":
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)

            def flex_decode(c, S):
                B, n_kv, g, d = c["q"].shape
                return flex(c["q"].reshape(B, n_kv * g, 1, d), c["k"][:, :, :S], c["v"][:, :, :S],
                            enable_gqa=g > 1).view(B, n_kv, g, d)

            candidates["flex"] = flex_decode
        except Exception:  # FlexAttention missing in this torch: the others stand
            pass
    return candidates


def reference_error(out, expected, rows_ok: Optional[list[bool]] = None, atol: float = 2e-2) -> Optional[str]:
    """None when out matches expected (B, n_kv, g, d) within bf16 rounding on the (row, KV head) pairs
    rows_ok marks (a selection tie leaves the others ambiguous), else a one-line description."""
    diff = (out.float() - expected.float()).abs()
    if rows_ok is not None:
        diff = diff.flatten(0, 1)[torch.tensor(rows_ok, device=diff.device)]
        if diff.numel() == 0:
            return "every (row, head) compared has a selection tie: nothing checked"
    worst = float(diff.max())
    return None if worst <= atol + atol * float(expected.abs().max()) else f"max abs error {worst:.3g} > {atol}"


def check_against_reference(shape, copy: dict, sparq: Callable, dense: dict[str, Callable]) -> dict[str, str]:
    """Every kernel about to be timed against its reference on the shape's first rows (SparQ: where
    the selection has no tie, sparq.selection_has_ties): name -> error; empty when all agree."""
    from attention import dense_attention_torch
    from sparq import SparQConfig, selection_has_ties, sparq_reference

    name, B, n_kv, g, d, S, r, k_top = shape
    n = min(B, REFERENCE_ROWS)
    config = SparQConfig(r=r, k_top=k_top, mean_v=g == 1)
    rows = {key: copy[key][:n] for key in ("q", "k", "v", "k_t", "v_sum")}
    errors = {}
    tie_free = [not selection_has_ties(rows["q"][b, h], rows["k"][b, h], S, config) for b in range(n)
                for h in range(n_kv)]
    expected = sparq_reference(rows["q"], rows["k"], rows["v"], rows["v_sum"], S, config)
    if (error := reference_error(sparq(rows), expected, tie_free)) is not None:
        errors["sparq"] = error
    expected = dense_attention_torch(rows["q"], rows["k"], rows["v"], S)
    for cname, fn in dense.items():
        if (error := reference_error(fn(rows, S), expected)) is not None:
            errors[cname] = error
    return errors


def time_plan_variants(shape, copies: list[dict], config, timer: Callable, replays: int,
                       bpp_choices=(1, 2, 4, 8, 16)) -> dict:
    """SparQ's time per call with the plan's choices forced, side by side in one run: step 1's blocks
    per program at each of `bpp_choices` (the plan's own choice: sparq_bpp), and the top-k's bits per
    counting pass, 1 and 2 (at the plan's blocks per program; the plan's choice: sparq_select_bits)."""
    import kernels_triton

    name, B, n_kv, g, d, S, r, k_top = shape
    q = copies[0]["q"]
    plan = kernels_triton.sparq_plan(B, n_kv, g, d, S, min(k_top, S), kernels_triton._native_dot(q, copies[0]["k_t"]),
                                     kernels_triton._device_sms(q.device), r)

    def time(**overrides) -> float:
        def call(c):
            return kernels_triton._sparq_triton_impl(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None, r, k_top,
                                                     config.local, config.mean_v, None, None, None, None, **overrides)
        return 1e6 * timer([lambda c=c: call(c) for c in copies], replays)

    return dict(sparq_bpp=plan["BPP"], sparq_us_by_bpp={bpp: time(blocks_per_program=bpp) for bpp in bpp_choices},
                sparq_select_bits=plan["select"]["PASS_BITS"],
                sparq_us_by_select_bits={bits: time(select_bits=bits) for bits in (1, 2)})


def attention_row(shape, device: str, dtype=torch.bfloat16, bandwidth: Optional[float] = None,
                  replays: int = 20) -> dict:
    """Check, then time dense (every candidate) and SparQ on one shape; theory from the transfer formulas."""
    import kernels_triton
    from sparq import SparQConfig

    name, B, n_kv, g, d, S, r, k_top = shape
    elem = torch.tensor([], dtype=dtype).element_size()
    dense_b, sparq_b = attention_theory(B, n_kv, d, S, r, k_top, elem)
    row = dict(name=name, B=B, n_kv=n_kv, g=g, d=d, S=S, r=r, k=k_top, dense_bytes=dense_b, sparq_bytes=sparq_b,
               sparq_extra_bytes=sparq_extra_bytes(B, n_kv, g, S), theory_speedup=dense_b / sparq_b)
    cache_bytes = 3 * B * n_kv * S * d * elem
    n_copies = max(1, min(math.ceil(ROTATE_BYTES / min(sparq_b, dense_b)), COPY_MEMORY // cache_bytes, 32))
    copies = _attention_copies(B, n_kv, g, d, S, dtype, device, n_copies if device == "cuda" else 1)
    config = SparQConfig(r=r, k_top=k_top, mean_v=g == 1)
    timer = time_cuda_graph if device == "cuda" else time_host

    def sparq(c):
        return kernels_triton.sparq_attention_triton(c["q"], c["k"], c["k_t"], c["v"], c["v_sum"], S, None, r, k_top,
                                                     config.local, config.mean_v)

    candidates = dense_candidates(device)
    row["reference_errors"] = check_against_reference(shape, copies[0], sparq, candidates)
    row["copies"] = len(copies)
    if "sparq" in row["reference_errors"]:
        row["error"] = "SparQ differs from the reference: " + row["reference_errors"]["sparq"]
    else:
        row["sparq_us"] = 1e6 * timer([lambda c=c: sparq(c) for c in copies], replays)
        profiled = kernels_per_call([lambda c=c: sparq(c) for c in copies[:8]])
        if profiled is not None:
            row["sparq_kernels"], row["sparq_kernel_us"] = profiled
        row["sparq_gbs"] = row["sparq_bytes"] / (row["sparq_us"] * 1e-6) / 1e9
        try:  # a comparison: its failure must not cost the row
            row.update(time_plan_variants(shape, copies, config, timer, replays,
                                          (1, 2, 4, 8, 16) if device == "cuda" else (1, 2)))
        except Exception as e:
                row["bpp_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    row["dense_all"] = {}
    for cname, fn in candidates.items():
        if cname in row["reference_errors"]:
            continue
        try:
            row["dense_all"][cname] = 1e6 * timer([lambda c=c, fn=fn: fn(c, S) for c in copies], replays)
        except Exception as e:  # one candidate failing must not hide the others
            row.setdefault("dense_errors", {})[cname] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if row["dense_all"]:
        best = min(row["dense_all"], key=row["dense_all"].get)
        row["dense_best"], row["dense_us"] = best, row["dense_all"][best]
        profiled = kernels_per_call([lambda c=c: candidates[best](c, S) for c in copies[:8]])
        if profiled is not None:
            row["dense_kernels"], row["dense_kernel_us"] = profiled
    if bandwidth:
        if "sparq_us" in row:
            row["sparq_theory_pct"] = 100 * row["sparq_bytes"] / bandwidth / (row["sparq_us"] * 1e-6)
        if "dense_us" in row:
            row["dense_theory_pct"] = 100 * row["dense_bytes"] / bandwidth / (row["dense_us"] * 1e-6)
    del copies
    return row


def quantized_attention_row(shape, device: str, bandwidth: Optional[float] = None, replays: int = 20,
                            kv_dtype: str = "int8", kt_dtype: str = "int4") -> dict:
    """SparQ and dense on a quantized cache (cache.KVCache's stored buffers and scales), bf16
    activations: dense int8 first checked against the torch path on the cache's dequantized view (the
    SparQ kernel's check on quantized caches is the tests section's), then both timed from CUDA graphs
    over rotating caches; bytes as stored (policy.transfer_bytes), beside dense's on a bf16 cache."""
    import kernels_triton
    from attention import DenseDecode, dense_attention_torch
    from cache import KVCache, KVFormat
    from sparq import SparQConfig, SparQDecode

    name, B, n_kv, g, d, S, r, k_top = shape
    act = torch.bfloat16
    fmt = KVFormat("twice", kv_dtype, kt_dtype)
    config = SparQConfig(r=r, k_top=k_top, mean_v=g == 1)
    heads = B * n_kv
    sparq_b = heads * SparQDecode(config, dense_when_short=False).transfer_bytes(S, d, fmt, act)
    dense_b = heads * DenseDecode().transfer_bytes(S, d, fmt, act)
    bf16_dense_b = heads * DenseDecode().transfer_bytes(S, d, KVFormat("twice", "auto", "same"), act)
    row = dict(name=name, B=B, n_kv=n_kv, g=g, d=d, S=S, r=r, k=k_top, kv_dtype=kv_dtype, kt_dtype=kt_dtype,
               sparq_bytes=sparq_b, dense_bytes=dense_b, bf16_dense_bytes=bf16_dense_b)
    cuda = device == "cuda"
    n_copies = max(1, min(math.ceil(ROTATE_BYTES / sparq_b), 16)) if cuda else 1
    gen = torch.Generator(device=device).manual_seed(0)
    views = []
    for _ in range(n_copies):
        cache = KVCache(B, S, n_kv, d, act, kv_dtype=kv_dtype, kt_dtype=kt_dtype).to(device)
        for start in range(0, S, 4096):
            shape_kv = (B, n_kv, min(S, start + 4096) - start, d)
            cache.update(torch.arange(start, start + shape_kv[2], device=device),
                         torch.randn(shape_kv, generator=gen, device=device, dtype=act),
                         torch.randn(shape_kv, generator=gen, device=device, dtype=act))
        views.append((torch.randn(B, n_kv, g, d, generator=gen, device=device, dtype=act), cache))
    q, cache = views[0]
    plain = cache.view(S, B)  # dequantized copies, the torch path's
    stored = cache.view(S, B, stored=True)
    error = reference_error(kernels_triton.dense_attention_triton(q, stored.k, stored.v, S, None, scales=stored.scales),
                            dense_attention_torch(q, plain.k, plain.v, S))
    if error is not None:
        row["error"] = "dense on the int8 cache differs from the torch path: " + error
        return row
    timer = time_cuda_graph if cuda else time_host

    def sparq(q, cache):
        s = cache.view(S, B, stored=True)
        return kernels_triton.sparq_attention_triton(q, s.k, s.k_t, s.v, s.v_sum, S, None, r, k_top, config.local,
                                                     config.mean_v, scales=s.scales)

    def dense(q, cache):
        s = cache.view(S, B, stored=True)
        return kernels_triton.dense_attention_triton(q, s.k, s.v, S, None, scales=s.scales)

    row["sparq_us"] = 1e6 * timer([lambda q=q, c=c: sparq(q, c) for q, c in views], replays)
    # Per kernel, as for a bf16 cache: the fifth contact's SparQ took 118 us here against 62 on bf16
    # with no way to tell which step the quantized formats cost.
    profiled = kernels_per_call([lambda q=q, c=c: sparq(q, c) for q, c in views[:8]])
    if profiled is not None:
        row["sparq_kernels"], row["sparq_kernel_us"] = profiled
    row["dense_us"] = 1e6 * timer([lambda q=q, c=c: dense(q, c) for q, c in views], replays)
    if bandwidth:
        row["sparq_theory_pct"] = 100 * sparq_b / bandwidth / (row["sparq_us"] * 1e-6)
        row["dense_theory_pct"] = 100 * dense_b / bandwidth / (row["dense_us"] * 1e-6)
    return row
