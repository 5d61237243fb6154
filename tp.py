"""Tensor parallel decode on torch.distributed: shard a loaded model in place, by KV head.

    torchrun --nproc_per_node 2 generate.py --prompt "Hello" --sparq-r 16
    torchrun --nproc_per_node 2 -m bench decode --prompt-tokens 0,8000 --batch-size 1

Each rank owns whole KV heads (n_kv / N of them, the first n_kv % N ranks one more when N does not
divide n_kv: SmolLM2's 3 KV heads go 2 + 1 over two ranks) and the query heads that share them
(q/k/v projections column parallel: their rows), so every attention policy (dense, SparQ, the baselines, H2O's state)
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


def span(n: int, world: int, rank_: int) -> tuple[int, int]:
    """Rank rank_'s share [start, end) of n items over `world` ranks: n // world each, the first n % world
    ranks one more."""
    base, extra = divmod(n, world)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (rank_ < extra)


class RowParallelLinear(nn.Module):
    """The rank's input columns [start, end) of a linear layer: partial products summed over the ranks,
    then the bias (added once, after the sum)."""

    def __init__(self, linear: Linear, start: int, end: int):
        super().__init__()
        self.linear = Linear(end - start, linear.out_features, bias=False)
        self.linear.matmul = linear.matmul  # the run's kernel
        self.linear.weight = nn.Parameter(linear.weight.detach()[:, start:end].contiguous(), requires_grad=False)
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
    if getattr(model, "quantization", None) is not None:
        raise UserError("tensor parallel runs float checkpoints: this one is quantized (its packed weights do not shard)")
    if world > model.args.n_kv_head:
        raise UserError(f"tensor parallel over {world} ranks needs a KV head for each: this model has "
                        f"{model.args.n_kv_head} (use --nproc_per_node {model.args.n_kv_head} or fewer)")


def shard(model: Transformer, rank_: int, world: int) -> Transformer:
    """Keep this rank's share of every layer, in place (call before setup_caches)."""
    check_shardable(model, world)
    args = model.args
    d, g, H, n_kv = args.head_dim, args.group_size, args.n_head, args.n_kv_head
    k0, k1 = span(n_kv, world, rank_)  # this rank's KV heads, with their g query heads each
    f0, f1 = span(args.intermediate_size, world, rank_)
    for layer in model.layers:
        attention = layer.attention
        _rows(attention.wqkv, [(k0 * g * d, k1 * g * d), ((H + k0) * d, (H + k1) * d),
                               ((H + n_kv + k0) * d, (H + n_kv + k1) * d)])
        attention.n_head, attention.n_kv_head = (k1 - k0) * g, k1 - k0
        attention.wo = RowParallelLinear(attention.wo, k0 * g * d, k1 * g * d)
        mlp = layer.feed_forward
        if mlp.w13 is not None:  # [gate; up]: the rank's share of each half
            hidden = args.intermediate_size
            _rows(mlp.w13, [(f0, f1), (hidden + f0, hidden + f1)])
        else:
            _rows(mlp.w1, [(f0, f1)])
        mlp.w2 = RowParallelLinear(mlp.w2, f0, f1)
    model.args = replace(args, n_head=(k1 - k0) * g, n_kv_head=k1 - k0, intermediate_size=f1 - f0,  # this rank's
                         kv_head_start=k0, kv_head_total=n_kv)
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


# ---------------------------------------------------------------------------------------------
# A tensor-parallel server: rank 0's engine leads, the other ranks make the same calls
# ---------------------------------------------------------------------------------------------


def _send(call: tuple) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([call], src=0)


def _receive() -> tuple:
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's model as a tensor-parallel engine sees it (serve.py under torchrun): every call that steps the
    model or changes its caches (a prefill piece, a decode step, a row kept, truncated or reset, live lengths
    set) is first sent to the other ranks, which make the same call on their shards (follow), so the ranks'
    collectives meet in the same order with the same inputs; everything else (its args, caches, read_length)
    is the model's own. decode_step is the engine's step: the same call sent, then `step` run here."""

    STEPS = ("prefill", "reset_row", "keep_prefix", "truncate_row", "set_live_lengths", "rows_state")

    def __init__(self, model: Transformer, step):
        self.model, self.step = model, step

    def __getattr__(self, name: str):
        value = getattr(self.model, name)
        if name not in Leader.STEPS:
            return value

        def sent_then_made(*args, **kwargs):
            _send((name, args, kwargs))
            return value(*args, **kwargs)

        return sent_then_made

    def restore_rows_state(self, state: list) -> None:
        """Each rank puts back the rows' state it copied at the last rows_state (its own shard's)."""
        _send(("restore_rows_state", (), {}))
        self.model.restore_rows_state(state)

    def decode_step(self, model, token: Tensor, input_pos: Tensor, length: int) -> Tensor:
        _send(("decode", (token, input_pos, length), {}))
        return self.step(self.model, token, input_pos, length)

    def stop(self) -> None:
        """The other ranks' follow() returns."""
        _send(("stop", (), {}))


def follow(model: Transformer, step) -> None:
    """Ranks other than 0 in a tensor-parallel server: make each call rank 0's Leader sends, on this rank's
    shard (decode steps through `step`, this rank's own compiled or eager step), until it says stop."""
    aside = None  # the rows' state this rank copied at rank 0's last rows_state
    while True:
        name, args, kwargs = _receive()
        if name == "stop":
            return
        if name == "decode":
            step(model, *args)
        elif name == "rows_state":
            aside = model.rows_state(*args)
        elif name == "restore_rows_state":
            model.restore_rows_state(aside)
        else:
            getattr(model, name)(*args, **kwargs)
