"""Fused SparQ decode-attention kernels: Triton for CUDA, a fused C++ kernel for CPU.

Every kernel computes exactly what `sparq.sparq_reference` computes (the oracle in the tests):
  q (B, n_kv, g, d), the static cache (k, k_t, v, v_sum) and the live length S
  -> (B, n_kv, g, d) in q.dtype.

Dispatch: kernel "auto" = Triton on CUDA, the fused CPU kernel on CPU; "torch" = sparq.py's path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model import KVCache
from sparq import SparQConfig, sparq_attention_torch

KERNELS = ("auto", "triton", "cpu", "torch")


# =============================================================================================
# CPU: fused C++ kernel (csrc/sparq_cpu.cpp), built on first use, registered as a torch.library op
# =============================================================================================

# (CPU section: owned by the CPU-kernel work)


# =============================================================================================
# CUDA: Triton kernels
# =============================================================================================

# (Triton section: owned by the Triton work)


# =============================================================================================
# Dispatch
# =============================================================================================


def resolve_kernel(kernel: str, device: torch.device | str) -> str:
    """The concrete kernel for `kernel` on `device`; ValueError (one line) if it cannot run there."""
    device_type = torch.device(device).type
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (choose from {', '.join(KERNELS)})")
    if kernel == "auto":
        return "triton" if device_type == "cuda" else "cpu"
    if kernel == "triton" and device_type != "cuda":
        raise ValueError("--kernel triton needs --device cuda (set TRITON_INTERPRET=1 only for tests)")
    if kernel == "cpu" and device_type != "cpu":
        raise ValueError("--kernel cpu needs --device cpu")
    return kernel


def sparq_attention(q: Tensor, cache: KVCache, length: int, config: SparQConfig, kernel: str) -> Tensor:
    """SparQ decode attention with the chosen (already resolved) kernel."""
    if kernel == "torch":
        return sparq_attention_torch(q, cache, length, config)
    raise NotImplementedError(f"kernel {kernel!r} is not implemented yet")
