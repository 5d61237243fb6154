"""Fused decode kernels: C++ for CPU (csrc/), Triton for CUDA (kernels_triton.py), and the record of
the ones a run uses.

A leaf module: tensors and ints in, tensors out; it imports nothing from this repo but cli (for one line of progress) and its Triton
sibling. The readable
plain-PyTorch paths live beside the policies they implement (attention.dense_attention_torch,
sparq.sparq_attention_torch); every kernel here computes what its reference computes (the tests
check each against it).

One run resolves its kernels once (`resolve_kernels`, from --kernel and the device) into a
`Kernels` record and hands it to the model; layers and policies call what the record holds. A
field left None means "the reference path beside the policy". A fallback (no compiler, a device or
a cache layout a kernel does not take) is decided and announced there, once, never per call.

Kernel signatures (q (B, n_kv, g, d): the g query heads sharing each KV head; the cache tensors
are the static buffers, or views of them from a window layer's first visible position: rows [:B]
and positions [:length] are read):
  dense_attention(q, k, v, length, live_length) -> (B, n_kv, g, d)
  dense_verify(q (B, n_kv, g, T, d), k, v, length, live_length (B,)) -> (B, n_kv, g, T, d): T query
      tokens per row at its last T live positions, query t attending to the positions up to its own
      (speculative verification; attention.DenseDecode.verify is the reference)
  sparq_attention(q, k, k_t, v, v_sum, length, live_length, r, k_top, local, mean_v) -> (B, n_kv, g, d)
  sparq_adaptive(q, k, k_t, v, v_sum, spread, length, live_length, compression, k_max, k_cap, mean_v, per_head)
      -> (B, n_kv, g, d): adaptive SparQ, each row at its own split of the budget, dense up to k_max
      positions, at most k_cap positions kept (None: no cap), each KV head selecting its own (per_head) or
      a row's heads pooling their selection (spread (B, n_kv, d) fp32,
      the keys' per-dimension spread; sparq_adaptive.sparq_adaptive_attention_torch is the reference); on a
      quantized cache also scales= and costs= (sparq_adaptive.StepCosts)
  linear(x (..., K), weight (N, K), bias (N,) or None) -> (..., N)
  prefill_attention(q (B, H, T, d), k, v (B, n_kv, S_k, d)) -> (B, H, T, d): causal attention of a
      prefill chunk's T queries, the last T of the S_k key positions (attention.prefill_attention, with no
      window and no soft-cap, is the reference; the model calls it only then)
`length` is the number of positions read (the longest row's). `live_length` says which are live:
  None          every row's positions [0, length) are live (exact reads: the CPU default);
  a 0-dim int   every row's positions [0, live_length) are live, the rest up to `length` masked
  tensor        (bucketed reads: one CUDA graph per bucket, the length a device tensor);
  a (B,) int    row b's positions [0, live_length[b]) are live (ragged batches: rows of different
  tensor        lengths; a kernel should read only those, so a short row costs what it reads).
k, v (B_max, n_kv, S_max, d) are d-contiguous, k_t (B_max, n_kv, d, S_max) S-contiguous or None (the
1xK layout: step 1 gathers r columns of k), v_sum (B_max, n_kv, d) fp32 the running sum of V over
the live positions; 1 <= r <= d, 0 <= local <= k_top; results in q.dtype, softmax and accumulation
in fp32; ties in the top-r / top-k go to the lower index. Every kernel computes what its reference
computes: attention.dense_attention_torch, sparq.sparq_reference (the batched torch path
sparq.sparq_attention_torch shares this signature, plus a soft-cap). The kernels take no attention
soft-cap (Gemma 2): resolve_kernels leaves attention to the torch paths for soft-capped models, and
says so; the policies bind the cap to those paths.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels_triton import HAS_TRITON, dense_attention_triton, dense_verify_triton, sparq_attention_triton


@dataclass(frozen=True)
class KVScales:
    """An int8 KV cache's scales (cache.KVCache, --kv-dtype int8), beside its int8 k and v:
    K[p] = k[p] k_scale[p] chan, V[p] = v[p] v_scale[p]; k_scale, v_scale (B_max, n_kv, S_max) and
    chan (B_max, n_kv, d), fp32."""

    k_scale: Optional[Tensor]  # None: K and V stored as floats (only K^T quantized)
    v_scale: Optional[Tensor]
    chan: Tensor
    kt_scale: Optional[Tensor] = None  # a quantized K^T's per-position scales, fp32 or bf16 (K's fp32 ones when it is K's int8 transposed)
    kt_bits: int = 4  # a packed (uint8) K^T's bits per position: 4 (int4, two a byte) or 3 (int3, cache.unpack_int3)

    @property
    def own_kt_scale(self) -> Optional[Tensor]:
        """K^T's scales where they are its own, None where K^T is K's int8 transposed (the kernels then read K's)."""
        return None if self.kt_scale is self.k_scale else self.kt_scale


@dataclass(frozen=True)
class Kernels:
    """The decode kernels of one run (see the module docstring for their signatures)."""

    name: str  # "torch", "cpu" or "triton": what the run announces
    dense_attention: Optional[Callable] = None  # None: attention.dense_attention_torch
    dense_verify: Optional[Callable] = None  # None: attention.DenseDecode.verify's torch path
    sparq_attention: Optional[Callable] = None  # None: sparq.sparq_attention_torch
    sparq_adaptive: Optional[Callable] = None  # None: sparq_adaptive.sparq_adaptive_attention_torch
    linear: Optional[Callable] = None  # None: F.linear
    prefill_attention: Optional[Callable] = None  # None: attention.prefill_attention (SDPA)
    packed_quantized: bool = False  # quantized linears: packed int4/int8 kernels, else dequantize + F.linear
    reads_int8_kv: bool = False  # dense_attention and dense_verify take an int8 cache as stored (scales=KVScales)
    sparq_reads_quantized: bool = False  # sparq_attention and sparq_adaptive take int8 K/V and an int8/int4 K^T as
    # stored (scales=; sparq_adaptive also costs=, its split in stored bytes)
    prepare_sparq: Optional[Callable[[], None]] = None  # loads what sparq_attention and sparq_adaptive call, when a
    # policy binds them (the CPU's second build: a dense run never waits for it)
    describe: str = "plain PyTorch"


TORCH_KERNELS = Kernels("torch")
KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")


# =============================================================================================
# CPU: fused C++ kernels (csrc/), built on first use, registered as torch.library ops
# =============================================================================================

# Every op of _CPU_OPS is defined here at import (schema + fake impl, no compiler needed), so
# torch.compile(fullgraph=True) can trace calls to them before anything is built. Their kernels:
#   CPU                        the C++ kernel, registered by the extension when it loads;
#   CompositeExplicitAutograd  reached only while the C++ kernel is not registered yet: loads the
#                              extension (resolve_kernels has built it) and re-dispatches to it.
# So eager calls go straight from the dispatcher to C++ (no Python in between).

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_CPU_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_CPU_LDFLAGS = ("-fopenmp",)  # tuples: cpp_extension.load appends its own flags to the lists it is given
# Two builds, each its own library of the one op namespace: what every run calls (the linears, prefill and
# dense attention) and SparQ's two kernels, built when a SparQ policy first binds them. The SparQ sources are
# two thirds of the compiler's time (each instantiates 4 K x 3 K^T x 3 query types; docs/NOTES.md, "The first
# ten minutes"), which a dense run (make run) need not wait for.
CPU_BUILDS = {"core": ("dense_decode.cpp", "linear.cpp", "linear_quant.cpp", "prefill_attention.cpp"),
              "sparq": ("sparq_adaptive.cpp", "sparq_decode.cpp")}
ALL_CPU_BUILDS = tuple(CPU_BUILDS)
_SPARQ_BUILD_OPS = ("decode_cpu", "decode_quant_cpu", "adaptive_cpu", "adaptive_quant_cpu")
# tried: build -> None (loaded) or one line saying why it cannot be; gemv_isa: linear_cpu_isa() of the core build
_cpu_ext: dict = {"tried": {}, "gemv_isa": None}
_cpu_ext_lock = threading.Lock()


def _csrc_files(suffixes: tuple[str, ...] = (".cpp", ".h")) -> list[str]:
    """Every source and header of csrc/, sorted: the builds compile the .cpp files, the tags hash them."""
    return sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC) if f.endswith(suffixes))


def _build_sources(build: str) -> list[str]:
    return [os.path.join(_CSRC, f) for f in CPU_BUILDS[build]]


def _cpu_build_tag(build: Optional[str] = None) -> str:
    """Hash of a build's sources and every header (None: every file of csrc/), the flags, torch version and CPU:
    a -march=native build never crosses machines."""
    h = hashlib.sha1()
    sources = _csrc_files() if build is None else sorted(_build_sources(build) + _csrc_files((".h",)))
    for path in sources:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(_CPU_CFLAGS + _CPU_LDFLAGS).encode())  # the flags as written, never as the build extended them
    h.update(torch.__version__.encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update("".join(line for line in f if line.startswith(("model name", "flags"))).encode())
    except OSError:
        pass
    return h.hexdigest()[:12]


def _build_paths(build: str) -> tuple[str, str, str]:
    """(the extension's name, its build directory, its .so) for this machine's build of `build`."""
    from torch.utils import cpp_extension

    name = f"sparq_cpu_{build}_{_cpu_build_tag(build)}"  # the tag covers sources, flags, torch and CPU
    build_dir = cpp_extension._get_build_directory(name, False)
    return name, build_dir, os.path.join(build_dir, name + ".so")


def cpu_kernels_built(builds: tuple[str, ...] = ALL_CPU_BUILDS) -> bool:
    """These fused CPU kernel builds are loaded, or were built on this machine before (loading them takes a
    moment); False: their first use builds them (a minute or more on two cores). Builds nothing."""
    return all(os.path.exists(_build_paths(build)[2]) for build in builds)  # the link writes it last


def _build_and_load(build: str) -> None:
    from torch.utils import cpp_extension

    name, build_dir, so_path = _build_paths(build)
    if os.path.exists(so_path):  # built before: load it directly (no ninja, no build lock)
        try:
            torch.ops.load_library(so_path)
            return
        except OSError:  # e.g. truncated by a killed build: rebuild below
            pass
    lock = os.path.join(build_dir, "lock")
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > 600:
        os.remove(lock)  # left by a build that was killed: torch would wait on it forever
    from cli import OneTimeWork

    what = "the fused CPU kernels" if build == "core" else "SparQ's fused CPU kernels"
    with OneTimeWork(f"building {what} (once per machine: {len(CPU_BUILDS[build])} files of csrc/, cached in "
                     f"{build_dir})"):
        cpp_extension.load(name=name, sources=_build_sources(build), extra_cflags=list(_CPU_CFLAGS),
                           extra_ldflags=list(_CPU_LDFLAGS), is_python_module=False, verbose=False)


def cpu_kernel_error(builds: tuple[str, ...] = ("core",)) -> Optional[str]:
    """Build (first use only; cached in torch's extensions dir) and load these C++ kernel builds: "core", what
    every run calls, by default; "sparq" SparQ's kernels, which the SparQ policies load as they bind them.

    Returns None once they are loaded, else one line saying why one cannot be (no compiler, no ninja, a build
    error). Never raises; tries each build once per process."""
    with _cpu_ext_lock:
        for build in builds:
            if build not in _cpu_ext["tried"]:
                try:
                    _build_and_load(build)
                    _cpu_ext["tried"][build] = None
                    if build == "core":
                        _cpu_ext["gemv_isa"] = torch.ops.sparq.linear_cpu_isa()
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    _cpu_ext["tried"][build] = f"{type(e).__name__}: {msg[0] if msg else ''}"
            if _cpu_ext["tried"][build] is not None:
                return _cpu_ext["tried"][build]
    return None


def load_sparq_cpu_kernels() -> None:
    """The CPU kernels' prepare_sparq: SparQ's build, loaded before a policy binds its kernels, so that it
    builds before any step is timed or compiled. A RuntimeError where it cannot be (the core build, which
    resolve_kernels took, came from the same compiler: a failure here is the SparQ sources' own)."""
    error = cpu_kernel_error(("sparq",))
    if error is not None:
        raise RuntimeError(f"SparQ's fused CPU kernels cannot be built ({error}); --kernel torch runs without them")


def _load_for_first_call(op: str, build: str) -> None:
    error = cpu_kernel_error((build,))
    if error is not None:
        raise RuntimeError(f"sparq::{op}: the fused CPU kernels are unavailable ({error})")


def _like_q(q: Tensor, *rest) -> Tensor:
    return q.new_empty(q.shape)


def _rows_by_weight(x: Tensor, w: Tensor, *rest) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _rows_by_n(x: Tensor, *rest) -> Tensor:  # a repacked weight's rows are not its output's: N comes last
    return x.new_empty((x.shape[0], rest[-1]))


# Every CPU op: (name, schema, its output's shape from the inputs: the fake impl torch.compile traces with;
# None for an op that only reports on the build, which the extension alone implements). `length` is a
# SymInt; lengths None, or the (B,) per-row live lengths of a ragged batch (kernels read only those).
# A quantized cache's ops are apart from the float ones (csrc/dense_decode.cpp says why): every argument given.
_CPU_OPS = (
    ("decode_cpu", "(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length, int r, int k_top, "
                   "int local, bool mean_v, Tensor? lengths=None) -> Tensor", _like_q),
    ("decode_quant_cpu", "(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, SymInt length, int r, "
                         "int k_top, int local, bool mean_v, Tensor? lengths, Tensor? k_scale, Tensor? v_scale, "
                         "Tensor chan, Tensor? kt_scale, int kt_bits) -> Tensor", _like_q),
    ("dense_cpu", "(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? lengths=None, int queries=1) -> Tensor",
     _like_q),
    ("dense_quant_cpu", "(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? lengths, int queries, "
                        "Tensor k_scale, Tensor v_scale, Tensor chan) -> Tensor", _like_q),
    ("adaptive_cpu", "(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, Tensor spread, SymInt length, "
                     "float compression, int k_max, int? k_cap, bool mean_v, bool per_head, Tensor? lengths=None) "
                     "-> Tensor", _like_q),
    ("adaptive_quant_cpu", "(Tensor q, Tensor k, Tensor? k_t, Tensor v, Tensor v_sum, Tensor spread, SymInt length, "
                           "float compression, int k_max, int? k_cap, bool mean_v, bool per_head, Tensor? lengths, "
                           "Tensor? k_scale, Tensor? v_scale, Tensor chan, Tensor? kt_scale, float kt_cost, "
                           "float kt_scale_cost, int kt_bits) -> Tensor", _like_q),
    ("prefill_cpu", "(Tensor q, Tensor k, Tensor v) -> Tensor", _like_q),  # causal, csrc/prefill_attention.cpp
    ("linear_cpu", "(Tensor x, Tensor w) -> Tensor", _rows_by_weight),
    # weight-only quantized GEMVs (quantize.py's stored formats; see csrc/linear_quant.cpp)
    ("linear_int8_cpu", "(Tensor x, Tensor w, Tensor scales) -> Tensor", _rows_by_weight),
    ("linear_int4_cpu", "(Tensor x, Tensor w, Tensor scales, Tensor zeros) -> Tensor", _rows_by_weight),
    # the same with x quantized to int8 per group, integer dot products (quantize.py's "gemv-q8")
    ("linear_int4_q8_cpu", "(Tensor x, Tensor w, Tensor scales, Tensor zeros, int N) -> Tensor", _rows_by_n),
    ("linear_int8_q8_cpu", "(Tensor x, Tensor w, Tensor scales, int N) -> Tensor", _rows_by_n),
    # their prefill GEMMs: any number of rows, each row the GEMV's bit for bit (quantize.py's "gemv-q8" prefill)
    ("linear_int4_q8_gemm_cpu", "(Tensor x, Tensor w, Tensor scales, Tensor zeros, int N) -> Tensor", _rows_by_n),
    ("linear_int8_q8_gemm_cpu", "(Tensor x, Tensor w, Tensor scales, int N) -> Tensor", _rows_by_n),
    ("linear_cpu_isa", "() -> str", None),  # the GEMV's instruction set in this build
    ("dense_int8_path", "() -> str", None),  # "vnni" or "float" (csrc/dense_decode.cpp)
    ("linear_q8_path", "() -> str", None),  # "vnni", "avx2" or "portable" in this build
)


def _first_call(name: str) -> Callable:
    """The CompositeExplicitAutograd kernel of op `name`, reached only while the C++ one is not registered
    yet: loads the build holding it (resolve_kernels has built the core, a SparQ policy's binding SparQ's) and
    re-dispatches to it."""
    build = "sparq" if name in _SPARQ_BUILD_OPS else "core"

    def load_and_call(*args, **kwargs):
        _load_for_first_call(name, build)
        return getattr(torch.ops.sparq, name).default(*args, **kwargs)

    return load_and_call


def _define_cpu_ops() -> None:
    for name, schema, fake in _CPU_OPS:
        torch.library.define(f"sparq::{name}", schema)
        if fake is not None:
            torch.library.impl(f"sparq::{name}", "CompositeExplicitAutograd")(_first_call(name))
            torch.library.register_fake(f"sparq::{name}")(fake)


if not hasattr(torch.ops.sparq, "decode_cpu"):  # a reimported kernels.py must not redefine the ops
    _define_cpu_ops()


LINEAR_CPU_MAX_ROWS = 16  # the fused GEMV serves decode steps; prefill-sized inputs go to F.linear
VERIFY_MAX_TOKENS = 16  # tokens per row up to which x (B, T, K) is a verify pass, not a prefill chunk


def bf16_gemm_widens() -> bool:
    """Whether a bf16 GEMM (a prefill's linears) runs faster widened to fp32: where torch's best CPU code is
    AVX2 or less (no AVX-512), its bf16 GEMM is several times slower than its fp32 GEMM, widening the weight
    on every call included (docs/NOTES.md, 'Figures behind the code's choices'). AVX-512 CPUs keep torch's
    bf16 GEMM (not measured widened there)."""
    return torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2")


_BF16_GEMM_WIDENS = bf16_gemm_widens()  # the CPU does not change under a process


def linear_cpu_pays(rows: int, weight_dtype: torch.dtype) -> bool:
    """Whether the fused GEMV beats F.linear for `rows` input rows (python -m bench linear; docs/NOTES.md):
    fp32 weights up to 16 rows; bf16 up to 16 where the build takes them straight into vdpbf16ps
    (linear_cpu_isa "avx512-bf16") or where torch's own bf16 GEMM is slow (bf16_gemm_widens), else up to 4
    (widened to fp32, it lost to torch's bf16 GEMM from 8 rows on Intel with AVX-512); the figures:
    docs/NOTES.md, 'Figures behind the code's choices'."""
    if "core" not in _cpu_ext["tried"]:  # the ISA is known once the kernels load: decide the same before and after
        cpu_kernel_error()
    up_to_max = weight_dtype == torch.float32 or (weight_dtype == torch.bfloat16 and (
        _cpu_ext["gemv_isa"] == "avx512-bf16" or _BF16_GEMM_WIDENS))
    return rows <= (LINEAR_CPU_MAX_ROWS if up_to_max else 4)


def linear_cpu(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, every_decode_row: bool = False) -> Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias): the fused C++ GEMV for decode-sized x, F.linear otherwise.

    The GEMV takes the few rows of a decode step (where linear_cpu_pays); a prefill's many rows are
    a GEMM, torch's own. fp32 accumulation, result in x.dtype; weight fp32/bf16/fp16, contiguous
    along K. It streams the weights, most of a decode step's bytes, near the memory bandwidth where
    torch's GEMV does not (python -m bench linear; docs/NOTES.md). every_decode_row (a server's
    steps, batch_invariant_kernels): every decode-sized call takes the GEMV, which computes each row
    alone (the same bits for any row count up to LINEAR_CPU_MAX_ROWS), so that a row's result never
    depends on how many rows step beside it, even where torch's GEMM would be faster at that count.
    """
    rows = x.numel() // x.shape[-1]
    # A few tokens per row (x (B, T, K), T <= VERIFY_MAX_TOKENS: speculative verification) take the
    # kernel a one-token step of B rows takes: the GEMV computes each row on its own, so every
    # position's output is the one-token step's, bit for bit (16 rows per call).
    step_rows = x.shape[0] if x.dim() == 3 and x.shape[1] <= VERIFY_MAX_TOKENS else rows
    # The C++ op has no backward: where autograd would need one (fine-tuning a fork), F.linear.
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    gemv = step_rows <= LINEAR_CPU_MAX_ROWS if every_decode_row else linear_cpu_pays(step_rows, weight.dtype)
    if needs_grad or not gemv:
        if weight.dtype == torch.bfloat16 and not needs_grad and _BF16_GEMM_WIDENS:
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    y = torch.cat([torch.ops.sparq.linear_cpu.default(flat[i:i + LINEAR_CPU_MAX_ROWS], weight)
                   for i in range(0, rows, LINEAR_CPU_MAX_ROWS)]) if rows > LINEAR_CPU_MAX_ROWS else \
        torch.ops.sparq.linear_cpu.default(flat, weight)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def batch_invariant_kernels(kernels: Kernels) -> Kernels:
    """The kernels for steps whose rows come and go (serve.py's row buckets): a row's result must not
    depend on the rows beside it. The fused decode GEMV computes each row alone at any row count; where
    linear_cpu_pays would hand a larger step to torch's GEMM (bf16 without AVX512_BF16, from 8 rows),
    the GEMV keeps it. The fused attention kernels split each row's positions by its own length
    (csrc/parallel.h) and quantized linears always take their GEMVs for decode steps: nothing else changes."""
    if kernels.linear is not linear_cpu:
        return kernels
    return replace(kernels, linear=partial(linear_cpu, every_decode_row=True),
                   describe=kernels.describe + " (every decode step's rows on the GEMV)")


def prefill_attention_cpu(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """prefill_attention (the module docstring) with the fused C++ kernel: flash-style, in fp32, each
    block of keys read once for the g query heads that share it. torch's CPU SDPA ran this at an eighth
    of the prefill GEMMs' rate in bf16 (docs/NOTES.md)."""
    return torch.ops.sparq.prefill_cpu.default(q, k, v)


def dense_attention_cpu(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Optional[Tensor] = None,
                        scales: Optional[KVScales] = None) -> Tensor:
    """dense_attention (the module docstring) with the fused C++ kernel, flash-decoding: each K/V row
    is read once for the g heads that share it. Exact lengths only: live_length None or (B,). An int8
    cache is read as stored, its scales applied in the kernel."""
    _check_exact_lengths(live_length)
    if scales is None:  # a float K and V
        return torch.ops.sparq.dense_cpu.default(q, k, v, length, live_length)
    return torch.ops.sparq.dense_quant_cpu.default(q, k, v, length, live_length, 1, scales.k_scale, scales.v_scale,
                                                   scales.chan)


def dense_verify_cpu(q: Tensor, k: Tensor, v: Tensor, length: int, live_length: Tensor,
                     scales: Optional[KVScales] = None) -> Tensor:
    """dense_verify (the module docstring) with the fused C++ kernel: the T queries of a row fold into
    its query heads (head-major), each K/V row read once for all of them."""
    B, n_kv, g, T, d = q.shape
    qs = q.reshape(B, n_kv, g * T, d)
    if scales is None:
        out = torch.ops.sparq.dense_cpu.default(qs, k, v, length, live_length, T)
    else:
        out = torch.ops.sparq.dense_quant_cpu.default(qs, k, v, length, live_length, T, scales.k_scale, scales.v_scale,
                                                      scales.chan)
    return out.view(B, n_kv, g, T, d)


def sparq_attention_cpu(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, length: int,
                        live_length: Optional[Tensor], r: int, k_top: int, local: int, mean_v: bool,
                        scales: Optional[KVScales] = None) -> Tensor:
    """sparq_attention (the module docstring) with the fused C++ kernel; bad settings are a
    RuntimeError. Exact lengths only: live_length None or (B,). Threads: torch.get_num_threads().
    A quantized cache is read as stored, its scales applied in the kernel."""
    _check_exact_lengths(live_length)
    if scales is None:
        return torch.ops.sparq.decode_cpu.default(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v, live_length)
    return torch.ops.sparq.decode_quant_cpu.default(q, k, k_t, v, v_sum, length, r, k_top, local, mean_v, live_length,
                                                    scales.k_scale, scales.v_scale, scales.chan, scales.own_kt_scale,
                                                    scales.kt_bits)


def sparq_adaptive_cpu(q: Tensor, k: Tensor, k_t: Optional[Tensor], v: Tensor, v_sum: Tensor, spread: Tensor,
                       length: int, live_length: Optional[Tensor], compression: float, k_max: int,
                       k_cap: Optional[int], mean_v: bool, per_head: bool = True, scales: Optional[KVScales] = None,
                       costs=None) -> Tensor:
    """sparq_adaptive (the module docstring) with the fused C++ kernel: each row splits the budget at its
    own live length inside the kernel, so nothing reaches the host. Exact lengths only. A quantized
    cache is read as stored, its scales applied in the kernel, the budget split at `costs` (sparq_adaptive.StepCosts:
    step 1's reads in K/V elements as the cache stores them)."""
    _check_exact_lengths(live_length)
    if scales is None:
        return torch.ops.sparq.adaptive_cpu.default(q, k, k_t, v, v_sum, spread, length, compression, k_max, k_cap,
                                                    mean_v, per_head, live_length)
    return torch.ops.sparq.adaptive_quant_cpu.default(q, k, k_t, v, v_sum, spread, length, compression, k_max, k_cap,
                                                      mean_v, per_head, live_length, scales.k_scale, scales.v_scale,
                                                      scales.chan, scales.own_kt_scale, costs.kt, costs.kt_scale,
                                                      scales.kt_bits)


def _check_exact_lengths(live_length: Optional[Tensor]) -> None:
    """The fused CPU kernels read exact lengths: None or per-row (B,) ones, never a bucket (resolve_kernels
    never pairs them with one)."""
    if live_length is not None and live_length.dim() != 1:
        raise ValueError("the fused CPU kernels read exact lengths (no --length-bucket): "
                         "live_length must be None or a (B,) tensor of per-row lengths")


# =============================================================================================
# Choosing the kernels of a run: once, here
# =============================================================================================

CPU_KERNELS = Kernels("cpu", dense_attention=dense_attention_cpu, dense_verify=dense_verify_cpu,
                      sparq_attention=sparq_attention_cpu, sparq_adaptive=sparq_adaptive_cpu,
                      linear=linear_cpu, prefill_attention=prefill_attention_cpu, packed_quantized=True,
                      reads_int8_kv=True, sparq_reads_quantized=True, prepare_sparq=load_sparq_cpu_kernels,
                      describe="fused C++ (csrc/): dense, SparQ and adaptive SparQ attention, prefill attention, "
                               "decode linears")
TRITON_KERNELS = Kernels("triton", dense_attention=dense_attention_triton, dense_verify=dense_verify_triton,
                         sparq_attention=sparq_attention_triton, packed_quantized=True, reads_int8_kv=True,
                         sparq_reads_quantized=True,
                         describe="Triton dense and SparQ decode attention, the verify pass; linears from PyTorch")


def resolve_kernels(choice: str, device: str | torch.device, length_bucket: int = 1, softcap: bool = False,
                    announce: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                    int8_kv: bool = False, quantized_kt: bool = False) -> Kernels:
    """The kernels for --kernel `choice` on `device`, decided once per run.

    "auto": the fused kernels of the device (cpu: C++, cuda: Triton), or the torch path with one
    announced line where they cannot run (no compiler, bucketed lengths on CPU). An explicit choice
    that cannot run is a ValueError (one line). "torch": plain PyTorch everywhere, including
    dequantize-then-matmul for quantized linears. softcap: the model soft-caps attention logits,
    which the fused attention kernels do not: attention then takes the torch path (announced), the
    fused linears stay. int8_kv, quantized_kt: the KV cache stores K and V in int8 (--kv-dtype), K^T
    in int8 or int4 (--kt-dtype). Kernels that do not read such a cache leave attention to the torch
    path (announced), which dequantizes the positions it reads: the fused SparQ kernels with either,
    every attention kernel without reads_int8_kv with int8 K and V.
    """
    kernels = _resolve(choice, device, length_bucket, announce)
    if softcap and (kernels.dense_attention or kernels.sparq_attention):
        announce(f"note: the model soft-caps attention logits: attention runs on the torch path "
                 f"({kernels.name} kernels for the rest)")
        kernels = replace(kernels, dense_attention=None, dense_verify=None, sparq_attention=None, sparq_adaptive=None,
                          describe=kernels.describe + "; attention on the torch path (soft-capped logits)")
    if int8_kv or quantized_kt:
        dropped = {"sparq_adaptive": kernels.sparq_adaptive is not None and not kernels.sparq_reads_quantized,
                   "sparq_attention": kernels.sparq_attention is not None and not kernels.sparq_reads_quantized,
                   "dense_attention": int8_kv and kernels.dense_attention is not None and not kernels.reads_int8_kv}
        if dropped["dense_attention"]:
            dropped["dense_verify"] = kernels.dense_verify is not None
        names = {"sparq_adaptive": "adaptive SparQ", "sparq_attention": "SparQ", "dense_attention": "dense attention"}
        said = [names[n] for n in names if dropped[n]]
        if said:
            # adaptive SparQ only in the startup line's kernels (a note for every quantized run would mostly
            # speak of a policy it does not run); SparQ and dense also in a note of their own
            loud = [name for name in said if name != "adaptive SparQ"]
            if loud:
                announce(f"note: the {kernels.name} kernels of {' and '.join(loud)} do not read a quantized KV cache "
                         f"yet: they run on the torch path, dequantizing the positions they read")
            kernels = replace(kernels, **{n: None for n, d in dropped.items() if d},
                              describe=kernels.describe + f"; {', '.join(said)} on the torch path (quantized KV cache)")
    return kernels


def _resolve(choice: str, device: str | torch.device, length_bucket: int, announce: Callable[[str], None]) -> Kernels:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel {choice!r} (choose from {', '.join(KERNEL_CHOICES)})")
    device_type = torch.device(device).type
    explicit = choice != "auto"
    if choice == "auto":
        choice = "triton" if device_type == "cuda" else "cpu"
    if choice == "torch":
        return TORCH_KERNELS
    if choice == "triton":
        if device_type != "cuda":
            raise ValueError("--kernel triton needs --device cuda (set TRITON_INTERPRET=1 only for tests)")
        if not HAS_TRITON:
            if explicit:
                raise ValueError("--kernel triton needs the `triton` package")
            announce("note: triton is not installed: using the torch path for SparQ")
            return TORCH_KERNELS
        return TRITON_KERNELS
    if device_type != "cpu":
        raise ValueError("--kernel cpu needs --device cpu")
    if length_bucket > 1:
        if explicit:
            raise ValueError("--kernel cpu reads exact lengths: drop --length-bucket (or use --kernel torch)")
        announce(f"note: --length-bucket {length_bucket}: the fused CPU kernels read exact lengths only; using the torch path")
        return TORCH_KERNELS
    error = cpu_kernel_error()
    if error is not None:
        if explicit:
            raise ValueError(f"--kernel cpu: the fused CPU kernels cannot be built ({error})")
        announce(f"note: the fused CPU kernels cannot be built ({error}); using the torch path")
        return TORCH_KERNELS
    return CPU_KERNELS
