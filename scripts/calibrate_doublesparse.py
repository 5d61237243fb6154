"""DoubleSparse's offline calibration (`--attention doublesparse`): each layer's and KV head's channels,
ranked by how much they contribute to the attention logits on calibration text.

    python -m scripts.calibrate_doublesparse --checkpoint checkpoints/Qwen2.5-Coder-0.5B-Instruct

Prefills --tokens tokens of the Paul Graham essays (the haystack text of the needle and RULER tasks, never
their needles or questions; nothing of SQuAD) and ranks channel i of KV head h by sum_t |q_t,i k_t,i|
over every calibration token t and the group's query heads: each token's query against its own key,
after RoPE, as the authors' offline calibration scores its "qk" outlier channels (per query head there;
per KV head here, since a group shares its channels as SparQ's step 1 does). Writes the ranking, every
channel most important first, to doublesparse_channels.pt beside the checkpoint (--out elsewhere):
any r reads its first r.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

import cli
import data
from attention import DecodePolicy
from cache import KVCache
from decoding import PREFILL_CHUNK, prefill
from baselines import CHANNELS_FILE, default_channels_file


class ChannelStatistics(DecodePolicy):
    """A prefill observer: per KV head and channel i, sum_t |q_t,i k_t,i| over the tokens and the group's
    query heads."""

    name = "channel-statistics"
    observes_prefill = True

    def __init__(self, n_kv: int, head_dim: int):
        super().__init__()
        self.importance = torch.zeros(n_kv, head_dim, dtype=torch.float64)

    def observe_prefill(self, q: Tensor, k: Tensor, memo: Optional[dict] = None,
                        lengths: Optional[Tensor] = None, window: Optional[int] = None) -> None:
        B, H, T, d = q.shape  # q (1, H, T, d): this chunk's queries; k (1, n_kv, S, d): every key so far
        n_kv, S = k.shape[1], k.shape[2]
        own = k[0, :, S - T:, None].double().transpose(1, 2)  # (n_kv, 1, T, d): the chunk's keys, its queries' own
        self.importance += (q[0].double().view(n_kv, H // n_kv, T, d) * own).abs().sum(dim=(1, 2))

    def forward(self, q: Tensor, cache: KVCache, length: int) -> Tensor:
        raise RuntimeError("the calibration only prefills")

    def transfer_elements(self, seq_len: int, head_dim: int) -> int:
        return 0

    def ranking(self) -> Tensor:
        """(n_kv, d) channels by importance, most important first (ties: the lower channel)."""
        return torch.sort(self.importance, dim=-1, descending=True, stable=True).indices


def calibrate(model, tokens: list[int], chunk: int = PREFILL_CHUNK) -> Tensor:
    """The ranking (n_layer, n_kv, d) of every layer's channels on a prefill of `tokens` (in chunks of `chunk`)."""
    args = model.args
    observers = [ChannelStatistics(args.n_kv_head, args.head_dim) for _ in range(args.n_layer)]
    model.setup_caches(1, len(tokens))
    model.set_decode_attention(lambda layer: observers[layer])
    with torch.no_grad():
        prefill(model, torch.tensor([tokens]), chunk, progress=True)
    return torch.stack([o.ranking() for o in observers])


def run(args: argparse.Namespace) -> int:
    from assemble import load_checkpoint, load_tokenizer
    from kernels import TORCH_KERNELS

    out = args.out or default_channels_file(args.checkpoint)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint, "cpu", torch.float32, TORCH_KERNELS)
    if args.tokens > model.args.max_context:
        raise cli.UserError(f"--tokens {args.tokens} exceeds the model's context of {model.args.max_context}")
    tokens = data.essay_tokens(load_tokenizer(args.checkpoint), args.tokens)
    ranking = calibrate(model, tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # nothing half-written under the final name
    torch.save({"ranking": ranking.to(torch.int16), "tokens": len(tokens), "text": "Paul Graham essays",
                "score": "sum_t |q_t,i k_t,i| per layer and KV head (query heads of the group summed)"}, partial)
    partial.replace(out)
    print(f"wrote {out}: channel ranking of {ranking.shape[0]} layers x {ranking.shape[1]} KV heads x "
          f"{ranking.shape[2]} channels from {len(tokens)} essay tokens")
    return 0


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=data.DEFAULT_CHECKPOINT, help="model.pth or its directory")
    p.add_argument("--tokens", type=cli.positive_int, default=4096, help="calibration tokens (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help=f"default: {CHANNELS_FILE} beside the checkpoint")
    p.add_argument("--threads", type=cli.positive_int, default=2)
    return cli.main(p, run)


if __name__ == "__main__":
    raise SystemExit(main())
