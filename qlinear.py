"""The quantized weight formats quantize.py writes: their numerics, the packed layouts of the CPU kernels,
and the modules that run them (Int8Linear, Int4Linear and the embeddings of a tied head).

Schemes (w: a weight (N out, K in); every scale and zero is a bfloat16 value, stored as such):
  int8  symmetric:               w ~ q * s,            q in [-127, 127], s = amax / 127
        per output channel for the block linears; per group of 64 inputs for the head (below)
  int4  affine per group of K:   w ~ (q - 8) * s + z,  q in [0, 15], one (s, z) per group
        (group 32 by default: 64 or more loses much more on SmolLM2, docs/NOTES.md)
The (q - 8) * s + z form is the one PyTorch's int4 kernels use. Scales and zeros are picked as
bf16 values (s rounded up so the grid still covers the group) and q is computed against those
rounded values, so the packed kernels (which read bf16 scales) and the plain fallback dequantize to
exactly the same weights, and |w - dq(w)| <= s / 2 holds exactly.

Kernels (CPU, torch 2.13).
  both          "gemv"      the fused CPU GEMVs of csrc/linear_quant.cpp (sparq::linear_int8_cpu /
                            sparq::linear_int4_cpu) for the <= 16 rows of a decode step: they read
                            the stored tensors as they are (nothing packed at load), dequantize in
                            registers to exactly the weights below and multiply in fp32; more rows
                            (prefill) dequantize the weight and run F.linear, as fast as the packed
                            aten kernels there. python -m bench linear --quantized compares them with the
                            aten kernels below at decode sizes.
  both          "gemv-q8"   the same GEMVs with x rounded to int8 per group first (llama.cpp's Q8_0
                            activations; int4: per weight group, int8: per 32 inputs), then integer dot
                            products (sparq::linear_int4_q8_cpu / linear_int8_q8_cpu, vpdpbusd) on the
                            weights repacked at load in rows of 16 (pack_int4_rows16 / pack_int8_rows16;
                            a tied embedding gathers its rows from the head's copy): "auto"'s choice where
                            the build has AVX512_VNNI (gemv_kernel), the only path here whose
                            numerics are not those of the dequantized weights: the rounding of x costs
                            SmolLM2 less than llama.cpp's formats lose (docs/NOTES.md). A prefill's
                            many rows take the integer GEMMs on the same repacked weights
                            (sparq::linear_int4_q8_gemm_cpu / linear_int8_q8_gemm_cpu, where q8_gemm_pays), each
                            row the GEMV's bit for bit, where torch's F.linear needed the whole weight
                            dequantized first.
aten._weight_int8pack_mm and aten._weight_int4pack_mm_for_cpu are only vectorized for bf16
activations; with fp32 activations they run a scalar loop, many times slower. So the packed paths cast
the activations to bf16, run the kernel (fp32 accumulation) and cast back:
  int4 layers   "int4pack"  aten._weight_int4pack_mm_for_cpu (CUDA: aten._weight_int4pack_mm)
  int8 layers   "int4x2"    the same int4 kernel on q split into two nibbles (see Int8Linear): the
                            int8 kernel is compute-bound here, this is faster, same weights
                "int8pack"  aten._weight_int8pack_mm (per-channel only; used if int4x2 cannot be)
  both          "dequant"   the plain fallback: dequantize, then F.linear in the activation dtype
                            (used where no packed kernel applies, e.g. int8 on CUDA)
finalize_model picks the fastest that applies after checking it once against the fallback on the
running machine, when the run's kernels allow packed ones (kernels.Kernels.packed_quantized: every
kernel choice but --kernel torch, which runs the plain dequantize-then-matmul path). All of them
trace into torch.compile(fullgraph=True) graphs.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import cli
import kernels

KERNEL_DTYPE = torch.bfloat16  # the activation dtype the packed kernels are vectorized for


class QuantizationError(cli.UserError):
    """A user mistake: unknown mode, bad group size, already-quantized input... (one line)."""


# =============================================================================================
# Numerics: quantize / dequantize (pure functions; the tests use them as the reference)
# =============================================================================================


def round_up_bf16(x: Tensor) -> Tensor:
    """Smallest bfloat16 value >= x (x > 0, fp32), returned as fp32."""
    x = x.float()
    b = x.to(torch.bfloat16)
    low = b.float() < x
    if bool(low.any()):  # round-to-nearest went down: step one bf16 ulp up (positive values)
        bumped = (b.view(torch.int16) + 1).view(torch.bfloat16)
        b = torch.where(low, bumped, b)
    return b.float()


def quantize_int8(w: Tensor, group_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8. w (N, K) -> q int8 (N, K), scales bf16: (N,) per output channel (group_size
    None), or (N, K / group_size) per group of inputs (the head and embedding, see the docstring).

    s = amax / 127 rounded up to bf16, so |w| <= 127 s and nothing clips: |w - q s| <= s / 2.
    """
    N, K = w.shape
    gs = K if group_size is None else group_size
    if K % gs:
        raise QuantizationError(f"group size {gs} does not divide the input dimension {K}")
    g = w.float().reshape(N, K // gs, gs)
    scales = round_up_bf16(torch.clamp(g.abs().amax(dim=-1) / 127.0, min=1e-12))  # (N, G)
    q = torch.clamp(torch.round(g / scales[..., None]), -127, 127).to(torch.int8).reshape(N, K)
    scales = scales.to(torch.bfloat16)
    return q, (scales[:, 0] if group_size is None else scales)


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    """q (..., K) int8, scales (..., ) per row or (..., G) per group -> fp32 (..., K)."""
    s = scales.float()
    if s.dim() < q.dim():
        return q.float() * s.unsqueeze(-1)
    return (q.float().unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped affine int4. w (N, K) -> q uint8 (N, K) in [0, 15], scales, zeros (N, K / gs) bf16.

    Dequantization: (q - 8) * s + z. z = bf16(midpoint of the group's [min, max]); s is the smallest
    bf16 step for which the 16-level grid around that z still covers [min, max], so no value clips
    and |w - dq(w)| <= s / 2.
    """
    N, K = w.shape
    if K % group_size:
        raise QuantizationError(f"group size {group_size} does not divide the input dimension {K}")
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    zeros = (lo + 8.0 / 15.0 * (hi - lo)).to(torch.bfloat16).float()  # level 8 sits 8/15 up the range
    step = torch.maximum((zeros - lo) / 8.0, (hi - zeros) / 7.0)
    scales = round_up_bf16(torch.clamp(step, min=1e-12))
    q = torch.clamp(torch.round((g - zeros[..., None]) / scales[..., None]) + 8, 0, 15)
    return q.reshape(N, K).to(torch.uint8), scales.to(torch.bfloat16), zeros.to(torch.bfloat16)


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """q (N, K) values in [0, 15], scales / zeros (N, K / gs) -> fp32 (N, K)."""
    N, K = q.shape
    groups = scales.shape[-1]
    g = (q.float().reshape(N, groups, K // groups) - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return g.reshape(N, K)


def pack_nibbles(q: Tensor) -> Tensor:
    """(N, K) uint8 values in [0, 15] -> (N, K / 2) uint8: low nibble = even column, high = odd."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: Tensor) -> Tensor:
    """Inverse of pack_nibbles, on any leading shape: (..., K / 2) uint8 -> (..., K) uint8."""
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


# =============================================================================================
# Modules
# =============================================================================================


def _as_2d_bf16(x: Tensor, K: int) -> Tensor:
    return x.reshape(-1, K).to(KERNEL_DTYPE).contiguous()


def _int4_scales_and_zeros(scales: Tensor, zeros: Tensor) -> Tensor:
    """(N, G) scales and zeros -> the kernels' (G, N, 2) bf16 layout."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)


def _gemv_rows(x: Tensor, in_features: int) -> Optional[Tensor]:
    """x as the (rows, K) input of a fused decode GEMV, or None when it has too many rows (prefill)."""
    rows = x.numel() // in_features
    return x.reshape(rows, in_features) if rows <= kernels.LINEAR_CPU_MAX_ROWS else None


def _gemv_available(device: torch.device) -> bool:
    """The fused quantized GEMVs run on CPU once the C++ kernels are built (resolve_kernels built them)."""
    return device.type == "cpu" and kernels.cpu_kernel_error() is None


def gemv_kernel(device: torch.device) -> str:
    """The decode GEMV "auto" picks for int8 and int4 layers: "gemv-q8" (x rounded to int8 per group,
    as llama.cpp's Q8_0, then integer dot products) where this build has its vpdpbusd or AVX2
    (vpmaddubsw) path, which is faster there; else "gemv" (fp32 activations), where the portable
    integer path would be slower.
    The rounding costs less than llama.cpp's own formats do (python -m scripts.quant_bpc; docs/NOTES.md)."""
    if _gemv_available(device) and torch.ops.sparq.linear_q8_path() in ("vnni", "avx2"):
        return "gemv-q8"
    return "gemv"


def q8_gemm_built() -> bool:
    """Whether this build's gemv-q8 has integer GEMM tiles for a prefill (vpdpbusd or vpmaddubsw: a quarter of
    F.linear's fp32 work per multiply-add on the 1-byte x, each weight tile reused across rows); the portable
    path's scalar loops would lose to torch's vectorised GEMM at any size."""
    return torch.ops.sparq.linear_q8_path() in ("vnni", "avx2")


AMX_BF16_GEMM_FROM_ROWS = 512  # bf16 rows from which torch's AMX GEMM beats the integer one (docs/NOTES.md)


@functools.cache
def _bf16_gemm_on_amx() -> bool:
    return torch.cpu._is_amx_tile_supported()


def q8_gemm_pays(rows: int, dtype: torch.dtype) -> bool:
    """Whether a gemv-q8 prefill of `rows` rows of x in `dtype` takes the integer GEMM rather than dequantizing the
    whole weight for F.linear. It does for fp32 x, and for bf16 x where torch's bf16 GEMM runs on AVX-512 or AVX2;
    where it runs on AMX tiles (Sapphire Rapids on), the dequantization's fixed cost still loses to the integer
    GEMM below AMX_BF16_GEMM_FROM_ROWS rows (the engine's 256-token pieces) but AMX wins above (generate's)."""
    return dtype != torch.bfloat16 or rows < AMX_BF16_GEMM_FROM_ROWS or not _bf16_gemm_on_amx()


def _int4pack_mm(x2: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    if packed.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, scales_and_zeros)


def pack_int4_for_kernel(q: Tensor) -> Tensor:
    """(N, K) values in [0, 15] (any integer dtype) -> the layout of this device's int4 kernel."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    K = q.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if K % (t * 16) == 0)
    q = q.to(torch.uint8)
    cuda_nibbles = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()  # CUDA: high nibble = even column
    return torch.ops.aten._convert_weight_to_int4pack(cuda_nibbles, inner_k_tiles)


def _to_rows16(t: Tensor, chunk: int = 1) -> Tensor:
    """(N, X) -> rows in blocks of 16, the last padded with zero rows, each block's columns in chunks:
    out[b, c, r, j] = t[16 b + r, chunk c + j] (NB, X / chunk, 16, chunk); chunk 1: (NB, X, 16)."""
    padded = torch.cat([t, t.new_zeros(-t.shape[0] % 16, t.shape[1])])
    blocks = padded.view(-1, 16, t.shape[1] // chunk, chunk).transpose(1, 2).contiguous()
    return blocks if chunk > 1 else blocks.squeeze(-1)


def _from_rows16(t: Tensor, N: int) -> Tensor:
    """Inverse of _to_rows16: the N rows, (N, X)."""
    return t.transpose(1, 2).reshape(t.shape[0] * 16, -1)[:N]


def pack_int4_rows16(weight: Tensor, scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The stored nibbles (N, K/2) and scales / zeros (N, G) -> the "rows16" layout sparq::linear_int4_q8_cpu
    reads (csrc/linear_quant.cpp): rows in blocks of 16, the last padded with zero rows;
    w16[b, c, r, j] = weight[16 b + r, 4 c + j] (NB, K/8, 16, 4), s16[b, g, r] = scales[16 b + r, g] (NB, G, 16)."""
    return _to_rows16(weight, 4), _to_rows16(scales), _to_rows16(zeros)


def unpack_int4_rows16(w16: Tensor, s16: Tensor, z16: Tensor, N: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of pack_int4_rows16: the N rows' nibbles (N, K/2), scales and zeros (N, G)."""
    return _from_rows16(w16, N), _from_rows16(s16, N), _from_rows16(z16, N)


def pack_int8_rows16(weight: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """The stored int8 weight (N, K) and scales ((N,) per channel or (N, G)) -> the "rows16" layout
    sparq::linear_int8_q8_cpu reads (csrc/linear_quant.cpp): codes stored unsigned (q + 128), rows in
    blocks of 16, the last padded with zero rows; w16[b, c, r, j] = weight[16 b + r, 4 c + j] + 128
    (NB, K/4, 16, 4), s16[b, g, r] = scales[16 b + r, g] (NB, G, 16), G = 1 per channel."""
    unsigned = weight.view(torch.uint8) ^ 0x80  # two's complement q + 128
    return _to_rows16(unsigned, 4), _to_rows16(scales.reshape(weight.shape[0], -1))


def unpack_int8_rows16(w16: Tensor, s16: Tensor, N: int, per_channel: bool) -> tuple[Tensor, Tensor]:
    """Inverse of pack_int8_rows16: the N rows' int8 weight (N, K) and scales ((N,) when per_channel)."""
    weight = (_from_rows16(w16, N) ^ 0x80).view(torch.int8)
    scales = _from_rows16(s16, N)
    return weight, (scales[:, 0] if per_channel else scales)


class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear share: one kernel chosen by finalize (the first of kernel_choices
    that this layer supports and that passes the machine's self-check), forward's dispatch to it, and
    the float bias added after. A subclass says which kernels it has (supports, use_kernel,
    kernel_choices), what it drops once packed (release_portable) and how each kernel multiplies
    (gemv: the fused decode GEMVs; packed_mm: an aten packed kernel on bf16 rows; forward_dequant)."""

    BITS: int
    in_features: int
    out_features: int
    group_size: Optional[int]
    kernel: str

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")

    def finalize(self, backend: Optional[str] = None, keep_weight: bool = False) -> None:
        """Pick the kernel for `backend` (None / "auto": the fastest that applies); unless keep_weight,
        drop the stored tensors the chosen kernel no longer reads."""
        if self.kernel != "dequant":
            return
        for kernel in self.kernel_choices(backend or "auto"):
            if self.supports(kernel) and _kernel_ok(kernel, self.device, self.group_size or 0, bits=self.BITS):
                self.use_kernel(kernel)
                break
        if not keep_weight:
            self.release_portable()

    @property
    def device(self) -> torch.device:
        return next(b for b in self.buffers() if b is not None).device

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel in ("gemv", "gemv-q8"):
            x2 = _gemv_rows(x, self.in_features)
            if x2 is not None:
                y = self.gemv(x2).reshape(*x.shape[:-1], self.out_features)
            elif self.prefill_gemm and q8_gemm_pays(x[..., 0].numel(), x.dtype):  # x rounded once, integer dot products
                y = self.gemm(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
            else:  # a prefill: a GEMM's work, torch's own (forward_dequant, the reference)
                y = self.forward_dequant(x)
        elif self.kernel == "dequant":
            y = self.forward_dequant(x)
        else:  # an aten packed kernel, on bf16 rows
            y = self.packed_mm(_as_2d_bf16(x, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def kernel_choices(self, backend: str) -> tuple[str, ...]:
        raise NotImplementedError

    def supports(self, kernel: str) -> bool:
        raise NotImplementedError

    def use_kernel(self, kernel: str) -> None:
        raise NotImplementedError

    def release_portable(self) -> None:
        """Drop the stored tensors a packed kernel replaced (weight_bytes then counts each weight once)."""

    def gemv(self, x2: Tensor) -> Tensor:
        raise NotImplementedError

    def packed_mm(self, x2: Tensor) -> Tensor:
        raise NotImplementedError

    def gemm(self, x2: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_dequant(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """y = x W^T, W = q * s stored int8: buffers weight (N, K) int8 and scales bf16, (N,) per output
    channel or (N, K / group_size) per group of inputs (group_size set: the head).

    Kernels (self.kernel, chosen by finalize):
      "gemv"     sparq::linear_int8_cpu on the stored weight and scales for decode-sized inputs,
                 dequantize + F.linear for more rows (see the module docstring).
      "gemv-q8"  sparq::linear_int8_q8_cpu (x rounded to int8 per 32 inputs): finalize repacks weight and
                 scales into rows16 / rows16_scales (pack_int8_rows16) and drops them unless keep_weight;
                 prefill runs sparq::linear_int8_q8_gemm_cpu on them where q8_gemm_pays, else
                 dequantizes from them.
      "int4x2"   q = 16 hi + lo with hi in [-8, 7], lo in [0, 15]: both halves go through the int4
                 kernel as one (N, 2K) matrix -- [hi | lo] with scales 16 s / s and zeros 0 / 8 s --
                 against [x | x]. Exactly the same weights; the int4 kernel is faster than the int8
                 one, which is compute-bound on CPUs without int8 dot products (docs/NOTES.md).
      "int8pack" aten._weight_int8pack_mm (per-channel scales only).
      "dequant"  F.linear(x, q.to(x.dtype)) * s (the plain fallback; CUDA's path, fused by inductor).
    """

    BITS = 8

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None, device=None,
                 bias: bool = False):
        super().__init__()
        if group_size is not None and in_features % group_size:
            raise QuantizationError(f"group size {group_size} does not divide the input dimension {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(scale_shape, dtype=torch.bfloat16, device=device))
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.register_buffer("rows16", None, persistent=False)
        self.register_buffer("rows16_scales", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None  # float, added after
        self.split_group_size = 0
        self.prefill_gemm = False  # gemv-q8's prefill on the integer GEMM (use_kernel: q8_gemm_built; forward: q8_gemm_pays)
        self.kernel = "dequant"  # finalize() picks a packed kernel where one applies

    def _split_group_size(self) -> Optional[int]:
        """The int4 kernel's group for int4x2: divides the int8 group (K when per channel)."""
        group = self.group_size or self.in_features
        return next((g for g in (256, 128, 64, 32) if group % g == 0), None)

    def supports(self, kernel: str) -> bool:
        cpu = self.scales.device.type == "cpu"
        if kernel == "gemv":  # groups of whole 16-wide vectors
            return _gemv_available(self.scales.device) and (self.group_size is None or self.group_size % 16 == 0)
        if kernel == "gemv-q8":  # whole groups of 32 inputs (x's groups)
            return (_gemv_available(self.scales.device) and self.in_features % 32 == 0
                    and (self.group_size or self.in_features) % 32 == 0)
        if kernel == "int4x2":  # int4 kernel: N in blocks of 16; groups must not straddle hi | lo
            return cpu and self.out_features % 16 == 0 and self._split_group_size() is not None
        if kernel == "int8pack":  # the CPU kernel walks K in steps of 16 (AVX512) with no tail
            return cpu and self.in_features % 32 == 0 and self.group_size is None
        return kernel == "dequant"

    def use_kernel(self, kernel: str) -> None:
        """Build what `kernel` reads (from the int8 weight) and switch to it."""
        if kernel == "int4x2":
            N, K = self.weight.shape
            gs = self._split_group_size()
            u = self.weight.view(torch.uint8)  # two's complement: q = 16 * hi + lo, hi = q >> 4 in [-8, 7]
            lo = u & 0x0F  # [0, 15]
            hi_plus_8 = (u >> 4) ^ 0x08  # the high nibble is hi in 4-bit two's complement; ^ 8 adds 8
            self.packed = pack_int4_for_kernel(torch.cat([hi_plus_8, lo], dim=1))
            s = self.scales.float().reshape(N, -1)  # (N, G): one column per int8 group
            s = s.repeat_interleave(K // gs // s.shape[1], dim=1)  # (N, K / gs): per kernel group
            scales = torch.cat([16 * s, s], dim=1)  # exact in bf16: powers of two times a bf16 value
            zeros = torch.cat([torch.zeros_like(s), 8 * s], dim=1)
            self.scales_and_zeros = _int4_scales_and_zeros(scales, zeros)
            self.split_group_size = gs
        elif kernel == "gemv-q8":
            self.rows16, self.rows16_scales = pack_int8_rows16(self.weight, self.scales)
            self.prefill_gemm = q8_gemm_built()
        elif kernel == "int8pack":
            if self.weight.data_ptr() % 64:  # the kernel uses aligned loads: own, aligned memory
                self.weight = self.weight.clone()
        elif kernel not in ("gemv", "dequant"):  # gemv reads the stored tensors as they are
            raise ValueError(f"unknown int8 kernel {kernel!r}")
        self.kernel = kernel

    def kernel_choices(self, backend: str) -> tuple[str, ...]:
        """"auto": the machine's GEMV (gemv_kernel), then gemv, int4x2, int8pack; else the one named."""
        if backend == "auto":
            return tuple(dict.fromkeys((gemv_kernel(self.device), "gemv", "int4x2", "int8pack")))
        return {"dequant": ()}.get(backend, (backend,))

    def release_portable(self) -> None:
        if self.kernel in ("int4x2", "gemv-q8"):  # the packed copies replace them
            self.weight = None
            if self.kernel == "gemv-q8":  # rows16_scales holds them (int4x2 keeps its small original)
                self.scales = None

    def gemv(self, x2: Tensor) -> Tensor:
        if self.kernel == "gemv-q8":
            return torch.ops.sparq.linear_int8_q8_cpu(x2, self.rows16, self.rows16_scales, self.out_features)
        return torch.ops.sparq.linear_int8_cpu(x2, self.weight, self.scales)

    def gemm(self, x2: Tensor) -> Tensor:  # gemv-q8's prefill
        return torch.ops.sparq.linear_int8_q8_gemm_cpu(x2, self.rows16, self.rows16_scales, self.out_features)

    def packed_mm(self, x2: Tensor) -> Tensor:
        if self.kernel == "int4x2":
            return _int4pack_mm(torch.cat([x2, x2], dim=1), self.packed, self.split_group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)  # int8pack

    def forward_dequant(self, x: Tensor) -> Tensor:
        if self.group_size is None and self.weight is not None:
            return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def dequantized_weight(self) -> Tensor:
        if self.weight is None and self.rows16 is not None:
            return dequantize_int8(*unpack_int8_rows16(self.rows16, self.rows16_scales, self.out_features,
                                                       per_channel=self.group_size is None))
        if self.weight is None:
            raise RuntimeError("the int8 weight was released after packing (finalize keep_weight=False)")
        return dequantize_int8(self.weight, self.scales)


def register_int4_rows(module: nn.Module, rows: int, columns: int, group_size: int, device=None) -> None:
    """The buffers of `rows` int4 rows of `columns` (Int4Linear's output channels, Int4Embedding's entries):
    the portable format, persistent (weight (rows, columns / 2) uint8 nibbles, scales and zeros
    (rows, columns / group_size) bf16), and the empty slots of gemv-q8's repacked copies (rows16*)."""
    groups = columns // group_size
    module.register_buffer("weight", torch.empty(rows, columns // 2, dtype=torch.uint8, device=device))
    module.register_buffer("scales", torch.empty(rows, groups, dtype=torch.bfloat16, device=device))
    module.register_buffer("zeros", torch.empty(rows, groups, dtype=torch.bfloat16, device=device))
    for name in ("rows16", "rows16_scales", "rows16_zeros"):
        module.register_buffer(name, None, persistent=False)


class Int4Linear(QuantizedLinear):
    """y = x W^T, W int4 affine per group of `group_size` inputs: w = (q - 8) * s + z.

    Stored (persistent): weight (N, K/2) uint8 portable nibbles, scales and zeros (N, K/gs) bf16.
    Kernels: "gemv" (sparq::linear_int4_cpu on the stored tensors for decode-sized inputs, dequantize
    + F.linear for more rows), "gemv-q8" (sparq::linear_int4_q8_cpu: finalize repacks the three into
    rows16 / rows16_scales / rows16_zeros, pack_int4_rows16, and drops the portable tensors unless
    keep_weight; prefill runs sparq::linear_int4_q8_gemm_cpu on them where q8_gemm_pays, else dequantizes
    from them), "int4pack" (aten int4 kernel; finalize
    packs the weight for this machine into `packed` / `scales_and_zeros` and drops the portable tensors
    unless keep_weight) or "dequant".
    """

    BITS = 4

    def __init__(self, in_features: int, out_features: int, group_size: int, device=None, bias: bool = False):
        super().__init__()
        if in_features % group_size:
            raise QuantizationError(f"group size {group_size} does not divide the input dimension {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        register_int4_rows(self, out_features, in_features, group_size, device)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None  # float, added after
        self.prefill_gemm = False  # gemv-q8's prefill on the integer GEMM (use_kernel: q8_gemm_built; forward: q8_gemm_pays)
        self.kernel = "dequant"

    def supports(self, kernel: str) -> bool:
        device = self.scales.device.type
        if kernel in ("gemv", "gemv-q8"):  # groups of whole 32-column steps (every GROUP_SIZES entry)
            return _gemv_available(self.scales.device) and self.group_size % 32 == 0
        if kernel == "int4pack":
            if device == "cpu":  # the kernel's N blocks are 16, 32, 48 or 64 wide
                return self.out_features % 16 == 0
            return device == "cuda" and self.out_features % 8 == 0 and self.in_features % 32 == 0
        return kernel == "dequant"

    def use_kernel(self, kernel: str) -> None:
        if kernel == "int4pack":
            self.packed = pack_int4_for_kernel(unpack_nibbles(self.weight))
            self.scales_and_zeros = _int4_scales_and_zeros(self.scales, self.zeros)
        elif kernel == "gemv-q8":
            self.rows16, self.rows16_scales, self.rows16_zeros = pack_int4_rows16(self.weight, self.scales, self.zeros)
            self.prefill_gemm = q8_gemm_built()
        elif kernel not in ("gemv", "dequant"):  # the GEMV reads the stored tensors as they are
            raise ValueError(f"unknown int4 kernel {kernel!r}")
        self.kernel = kernel

    def kernel_choices(self, backend: str) -> tuple[str, ...]:
        """"auto": gemv_kernel's GEMV, else "gemv", else "int4pack"; "gemv" / "gemv-q8" / "int4pack" force
        one (falling back to dequant); "int4x2" and "int8pack" are int8 kernels: int4 layers then take int4pack."""
        if backend in ("gemv", "gemv-q8", "int4pack"):
            return (backend,)
        if backend in ("int4x2", "int8pack"):
            return ("int4pack",)
        if backend == "dequant":
            return ()
        return tuple(dict.fromkeys((gemv_kernel(self.device), "gemv", "int4pack")))

    def release_portable(self) -> None:
        if self.kernel in ("int4pack", "gemv-q8"):  # the packed copies replace them
            self.weight = self.scales = self.zeros = None

    def gemv(self, x2: Tensor) -> Tensor:
        if self.kernel == "gemv-q8":
            return torch.ops.sparq.linear_int4_q8_cpu(x2, self.rows16, self.rows16_scales, self.rows16_zeros,
                                                      self.out_features)
        return torch.ops.sparq.linear_int4_cpu(x2, self.weight, self.scales, self.zeros)

    def gemm(self, x2: Tensor) -> Tensor:  # gemv-q8's prefill
        return torch.ops.sparq.linear_int4_q8_gemm_cpu(x2, self.rows16, self.rows16_scales, self.rows16_zeros,
                                                       self.out_features)

    def packed_mm(self, x2: Tensor) -> Tensor:  # int4pack
        return _int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)

    def forward_dequant(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def dequantized_weight(self) -> Tensor:
        if self.weight is None and self.rows16 is not None:
            weight, scales, zeros = unpack_int4_rows16(self.rows16, self.rows16_scales, self.rows16_zeros, self.out_features)
            return dequantize_int4(unpack_nibbles(weight), scales, zeros)
        if self.weight is None:
            raise RuntimeError("the portable int4 weight was dropped after packing (finalize keep_weight=False)")
        return dequantize_int4(unpack_nibbles(self.weight), self.scales, self.zeros)


def _rows16_rows(t: Tensor, idx: Tensor) -> Tensor:
    """Rows idx of a rows16 tensor: (NB, X, 16, ...) -> (*idx.shape, X * ...)."""
    return t[idx // 16, :, idx % 16].flatten(idx.dim())


class Int8Embedding(nn.Module):
    """Embedding rows stored int8 with bf16 scales per row or per group of the row (when tied: the
    head's own tensors, a row of the embedding being an output channel of the head). A tied head
    repacked for gemv-q8 lends its rows16 tensors instead (read_head_rows16): a lookup gathers its B
    rows from them, so the step holds and counts the head's bytes once."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group_size: Optional[int] = None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group_size = num_embeddings, embedding_dim, group_size
        scale_shape = (num_embeddings,) if group_size is None else (num_embeddings, embedding_dim // group_size)
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(scale_shape, dtype=torch.bfloat16, device=device))
        self.register_buffer("rows16", None, persistent=False)
        self.register_buffer("rows16_scales", None, persistent=False)

    def read_head_rows16(self, head: "Int8Linear") -> None:
        self.rows16, self.rows16_scales = head.rows16, head.rows16_scales
        self.weight = self.scales = None

    def forward(self, idx: Tensor) -> Tensor:
        if self.rows16 is not None:
            q = (_rows16_rows(self.rows16, idx) ^ 0x80).view(torch.int8)  # stored as q + 128
            scales = _rows16_rows(self.rows16_scales, idx)
            return dequantize_int8(q, scales if self.group_size else scales[..., 0])
        return dequantize_int8(self.weight[idx], self.scales[idx])


class Int4Embedding(nn.Module):
    """Embedding rows in the Int4Linear portable format (used when an int4 head is tied; a head
    repacked for gemv-q8 lends its rows16 tensors, as Int8Embedding's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group_size: int, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group_size = num_embeddings, embedding_dim, group_size
        register_int4_rows(self, num_embeddings, embedding_dim, group_size, device)

    def read_head_rows16(self, head: "Int4Linear") -> None:
        self.rows16, self.rows16_scales, self.rows16_zeros = head.rows16, head.rows16_scales, head.rows16_zeros
        self.weight = self.scales = self.zeros = None

    def forward(self, idx: Tensor) -> Tensor:
        if self.rows16 is not None:
            nibbles, scales, zeros = (_rows16_rows(t, idx) for t in (self.rows16, self.rows16_scales, self.rows16_zeros))
        else:
            nibbles, scales, zeros = self.weight[idx], self.scales[idx], self.zeros[idx]
        q = unpack_nibbles(nibbles).float()  # (..., D)
        shape = (*q.shape[:-1], self.embedding_dim // self.group_size, self.group_size)
        return ((q.reshape(shape) - 8.0) * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).flatten(-2)




# Self-check of each packed kernel on the running machine, once per (kernel, device, group size).
_KERNEL_CHECKS: dict[tuple[str, str, int, int], bool] = {}


def _kernel_ok(kernel: str, device: torch.device, group_size: int = 0, bits: Optional[int] = None) -> bool:
    """Whether `kernel` passes its self-check for an int{bits} layer (group_size 0: int8 per channel);
    bits defaults to the kernel's own (int4pack: 4, int4x2 / int8pack: 8)."""
    bits = bits or (4 if kernel == "int4pack" else 8)
    key = (kernel, str(device), group_size, bits)
    if key not in _KERNEL_CHECKS:
        _KERNEL_CHECKS[key] = _check_kernel(kernel, device, group_size, bits)
    return _KERNEL_CHECKS[key]


def _check_kernel(kernel: str, device: torch.device, group_size: int, bits: int = 8) -> bool:
    """Run `kernel` on a small random int{bits} layer and compare it with the dequantized matmul, at a decode
    step's 5 rows and a prefill's 21 (gemv-q8's GEMM)."""
    gen = torch.Generator().manual_seed(0)
    N, K = 64, max(2 * group_size, 128)
    w = torch.randn(N, K, generator=gen)
    prefill = kernels.LINEAR_CPU_MAX_ROWS + 5  # rows past a decode step's
    x = torch.randn(prefill, K, generator=gen).to(KERNEL_DTYPE).float()  # bf16 values: the kernels' input
    try:
        if bits == 4:
            layer = Int4Linear(K, N, group_size)
            q, layer.scales, layer.zeros = quantize_int4(w, group_size)
            layer.weight = pack_nibbles(q)
        else:
            layer = Int8Linear(K, N, group_size or None)
            layer.weight, layer.scales = quantize_int8(w, group_size or None)
        expected = x @ layer.dequantized_weight().T  # on the CPU, before the layer moves to `device`
        layer = layer.to(device)
        layer.use_kernel(kernel)
        # The same weights on both sides; the kernel rounds its output to bf16 (8 bits of mantissa).
        ok = all(torch.allclose(layer(x[:rows].to(device)).cpu(), expected[:rows], rtol=1e-2,
                                atol=1e-2 * float(expected.abs().max())) for rows in (5, prefill))
    except (RuntimeError, NotImplementedError, AttributeError, StopIteration) as e:
        warnings.warn(f"{kernel} kernel unavailable on {device} ({str(e).splitlines()[0]}); "
                      f"using another kernel or the dequantize-then-matmul fallback")
        return False
    if not ok:
        warnings.warn(f"{kernel} kernel disagrees with the reference on {device}; "
                      f"using another kernel or the dequantize-then-matmul fallback")
    return ok
