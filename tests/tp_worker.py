"""Run under `torchrun --nproc_per_node N tests/tp_worker.py OUT.json [--compile]` by tests/test_tp.py.

Every rank builds the same tiny random model (MHA-free GQA, 4 KV heads; 3 KV heads for the uneven
split), greedy-decodes it unsharded (the single-process reference), then shards it (tp.shard) and
decodes again with dense, SparQ and H2O (with --compile: the uneven split, dense and SparQ); rank 0
writes both token lists and the per-rank shapes.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tp  # noqa: E402
from decoding import Generator  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from policies import AttentionSettings, policy_factory  # noqa: E402

POLICIES = {"dense": AttentionSettings("dense"), "sparq": AttentionSettings("sparq", sparq_r=6, sparq_k=12),
            "h2o": AttentionSettings("h2o", kv_budget=16)}


def tiny(n_kv: int) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=97, dim=96, n_layer=2, n_head=2 * n_kv, n_kv_head=n_kv, head_dim=16,
                     intermediate_size=100, max_context=256, qkv_bias=True, out_bias=True, mlp_bias=True)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * (1.5 / math.sqrt(p.shape[-1])) if p.dim() > 1 else 0.1 * torch.randn(p.shape))
    return model.eval()


def greedy(model: Transformer, prompts: torch.Tensor, settings: AttentionSettings, compile_decode: bool) -> list:
    model.setup_caches(prompts.shape[0], prompts.shape[1] + 12)
    model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
    tokens, _ = Generator(model, compile_decode=compile_decode).generate(prompts, 12)
    return tokens


def main() -> None:
    out, compile_decode = Path(sys.argv[1]), "--compile" in sys.argv
    torch._dynamo.config.recompile_limit = 64  # a graph per model, policy and split: more than the default 8
    tp.init("cpu")
    result = {}
    # eager: even and uneven splits over 2 ranks, every policy; compiled (a cold compile per model and
    # policy, about 20 s each): the uneven split, dense and SparQ (the collectives trace the same way)
    splits, policies = ((3,), ("dense", "sparq")) if compile_decode else ((4, 3), tuple(POLICIES))
    for n_kv in splits:
        prompts = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(n_kv))
        single = {name: greedy(tiny(n_kv), prompts, POLICIES[name], compile_decode) for name in policies}
        model = tp.shard(tiny(n_kv), tp.rank(), tp.world_size())
        sharded = {name: greedy(model, prompts, POLICIES[name], compile_decode) for name in policies}
        shapes = [None] * tp.world_size()
        torch.distributed.all_gather_object(shapes, {
            "wqkv": list(model.layers[0].attention.wqkv.weight.shape),
            "w13": list(model.layers[0].feed_forward.w13.weight.shape),
            "wo": list(model.layers[0].attention.wo.linear.weight.shape),
            "cache_k": list(model.layers[0].attention.kv_cache.k.shape)})
        result[n_kv] = {"single": single, "sharded": sharded, "shapes": shapes}
    if tp.rank() == 0:
        out.write_text(json.dumps(result))
    tp.shutdown()


if __name__ == "__main__":
    main()
