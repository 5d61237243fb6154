"""Tensor parallel decode on torch.distributed: shard a loaded model in place, by KV head.

    torchrun --nproc_per_node 2 generate.py --prompt "Hello" --sparq-r 16
    torchrun --nproc_per_node 2 bench.py decode --prompt-tokens 0,8000 --batch-size 1

Each rank owns n_kv / N whole KV heads and the query heads that share them (q/k/v projections
column parallel: their rows), so every attention policy (dense, SparQ, the baselines, H2O's state)
runs on its own heads exactly as in one process, and a rank's KV cache holds only its heads. The
attention output projection and the MLP's down projection are row parallel (their input columns),
each followed by one all-reduce; the MLP's gate/up projections are column parallel. Norms,
embeddings and the output head are replicated: every rank then samples the same token from the
same logits with no gather, and at the sizes this repo runs the head is a small share of a step
(a vocabulary-parallel head would split its read N ways but add a gather of the logits per step).
Biases of row-parallel layers are added once, after the all-reduce.

The collectives are functional (torch.distributed._functional_collectives), so torch.compile
traces them into the decode graph. NCCL on GPUs, gloo on CPUs, where each rank runs cores / N
threads. Quantized checkpoints are refused (their packed layouts do not shard).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from cli import UserError
from model import Linear, Transformer


def world_size() -> int:
    """The number of ranks torchrun started (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init(device: str) -> None:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU); one-line errors."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise UserError(f"tensor parallel needs torch.distributed with the {backend} backend, which this torch lacks")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size()))
    dist.init_process_group(backend)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: Tensor) -> Tensor:
    """Sum over the ranks, traceable by torch.compile."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class RowParallelLinear(nn.Module):
    """The rank's input columns of a linear layer: partial products summed over the ranks, then the
    bias (added once, after the sum)."""

    def __init__(self, linear: Linear, rank_: int, world: int):
        super().__init__()
        K = linear.in_features // world
        self.linear = Linear(K, linear.out_features, bias=False)
        self.linear.matmul = linear.matmul  # the run's kernel
        self.linear.weight = nn.Parameter(linear.weight.detach()[:, rank_ * K:(rank_ + 1) * K].contiguous(),
                                          requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


def _rows(linear: Linear, spans: list[tuple[int, int]]) -> None:
    """Keep only the given output rows (column parallel), weight and bias alike."""
    index = torch.cat([torch.arange(a, b) for a, b in spans]).to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.detach().index_select(0, index).contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().index_select(0, index).contiguous(), requires_grad=False)
    linear.out_features = index.numel()


def check_shardable(model: Transformer, world: int) -> None:
    args = model.args
    if getattr(model, "quantization", None) is not None:
        raise UserError("tensor parallel runs float checkpoints: this one is quantized (its packed weights do not shard)")
    if args.n_kv_head % world:
        raise UserError(f"tensor parallel over {world} ranks needs the KV heads ({args.n_kv_head}) to divide among "
                        f"them: use --nproc_per_node {', '.join(str(n) for n in range(1, args.n_kv_head + 1) if args.n_kv_head % n == 0)}")
    if args.intermediate_size % world:
        raise UserError(f"tensor parallel over {world} ranks needs the MLP width ({args.intermediate_size}) to divide among them")


def shard(model: Transformer, rank_: int, world: int) -> Transformer:
    """Keep this rank's share of every layer, in place (call before setup_caches)."""
    check_shardable(model, world)
    args = model.args
    d, g = args.head_dim, args.group_size
    kv = args.n_kv_head // world  # KV heads per rank, with their g query heads each
    q0, k0 = rank_ * kv * g * d, rank_ * kv * d
    F_ = args.intermediate_size // world
    for layer in model.layers:
        attention = layer.attention
        H, n_kv = args.n_head, args.n_kv_head
        _rows(attention.wqkv, [(q0, q0 + kv * g * d), (H * d + k0, H * d + k0 + kv * d),
                               ((H + n_kv) * d + k0, (H + n_kv) * d + k0 + kv * d)])
        attention.n_head, attention.n_kv_head = kv * g, kv
        attention.wo = RowParallelLinear(attention.wo, rank_, world)
        mlp = layer.feed_forward
        for column in (mlp.w1, mlp.w3):
            if column is not None:
                _rows(column, [(rank_ * F_, (rank_ + 1) * F_)])
        mlp.w2 = RowParallelLinear(mlp.w2, rank_, world)
    model.args = replace(args, n_head=kv * g, n_kv_head=kv, intermediate_size=F_)  # this rank's shapes
    model.tp_world = world
    return model


def quiet_unless_rank0() -> None:
    """Ranks other than 0 print nothing (rank 0 speaks for the run)."""
    if rank() != 0:
        devnull = open(os.devnull, "w")
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)


def maybe_shard(model: Transformer, device: str) -> Optional[int]:
    """Under torchrun (WORLD_SIZE > 1): join the group, shard the model; returns the world size."""
    world = world_size()
    if world == 1:
        return None
    init(device)
    quiet_unless_rank0()
    shard(model, rank(), world)
    return world
