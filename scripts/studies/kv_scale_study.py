"""How to scale a quantized K (docs/NOTES.md, "The quantized KV cache"): on a real model's keys, the
attention mass SparQ's step 1 keeps with K^T quantized several ways (relative to a bf16 K^T), and
how far dense attention's rows move with int8 K.

    python -m scripts.studies.kv_scale_study [CHECKPOINT_DIR] [--tokens 4096]

Prefills an essay prefix, records each layer's q and K at the next decode step, and compares the
scalings in plain PyTorch (nothing here is the product path)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data  # noqa: E402
from attention import DecodePolicy, DenseDecode  # noqa: E402
from model import load_model  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


class Recorder(DecodePolicy):
    """Dense attention that keeps each call's q and K (fp32)."""

    name = "recorder"

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def forward(self, q, cache, length):
        view = cache.view(length, q.shape[0])
        self.log.append((q[0].float().clone(), view.k[0, :, :length].float().clone()))
        return DenseDecode()(q, cache, length)

    def transfer_elements(self, seq_len, head_dim):
        return 0


def quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric absmax quantization along dim, returned dequantized."""
    qmax = 2 ** (bits - 1) - 1
    s = x.abs().amax(dim, keepdim=True).clamp(min=1e-8) / qmax
    return (x / s).round().clamp(-qmax, qmax) * s


def channel_first(K: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-channel absmax over the positions, then a per-position scale (the cache's scheme)."""
    c = K.abs().amax(1, keepdim=True).clamp(min=1e-6)
    return quantize(K / c, bits, -1) * c


def blocks(K: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Per (channel, block of n positions) scales (KIVI's for keys)."""
    return quantize(K.view(K.shape[0], -1, n, K.shape[2]), bits, 2).view(K.shape)


SCHEMES = {
    "int8, per-position scale": lambda K: quantize(K, 8, -1),
    "int8, per-channel prompt scale + per-position": lambda K: channel_first(K, 8),
    "int8, per (channel, 64 positions)": lambda K: blocks(K, 8, 64),
    "int4, per-position scale": lambda K: quantize(K, 4, -1),
    "int4, per-channel prompt scale + per-position": lambda K: channel_first(K, 4),
    "int4, per (channel, 64 positions)": lambda K: blocks(K, 4, 64),
    "int2, per (channel, 64 positions)": lambda K: blocks(K, 2, 64),
}


def step1_selection(q: torch.Tensor, K: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """SparQ step 1's top-k positions (n_kv, k) for q (n_kv, g, d) over K (n_kv, S, d)."""
    i1 = q.abs().sum(1).topk(r, -1).indices
    q_hat = torch.gather(q, 2, i1[:, None].expand(-1, q.shape[1], -1))
    cols = torch.gather(K, 2, i1[:, None].expand(-1, K.shape[1], -1))
    tau = torch.sqrt(q.shape[-1] * q_hat.abs().sum(-1, keepdim=True) / q.abs().sum(-1, keepdim=True))
    return torch.softmax(q_hat @ cols.transpose(-1, -2) / tau, -1).sum(1).topk(k, -1).indices


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default="checkpoints/Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    model = load_model(args.checkpoint, dtype=torch.bfloat16)
    ids = data.essay_tokens(load_tokenizer(Path(args.checkpoint)), args.tokens)
    S = len(ids)
    log: list = []
    model.setup_caches(1, S + 8)
    with torch.no_grad():
        model.prefill(torch.tensor([ids[:-1]]), torch.arange(S - 1), S - 1)
        model.set_decode_attention(lambda layer: Recorder(log))
        model.decode(torch.tensor([[ids[-1]]]), torch.tensor([S - 1]), S)
    d = log[0][0].shape[-1]
    records = [(q, K[:, :K.shape[1] // 128 * 128]) for q, K in log]  # whole blocks of positions
    for r in (8, 16, 32):
        k = S // 8
        print(f"{Path(args.checkpoint).name}, S = {S}, d = {d}, r = {r}, k = {k}: attention mass of step 1's "
              f"selection / a bf16 K^T's, mean over layers (worst layer)")
        for name, scheme in SCHEMES.items():
            ratios = []
            for q, K in records:
                mass = torch.softmax(q @ K.transpose(-1, -2) / d ** 0.5, -1).sum(1)  # (n_kv, S)
                base, sel = step1_selection(q, K, r, k), step1_selection(q, scheme(K), r, k)
                ratios.append((torch.gather(mass, 1, sel).sum() / torch.gather(mass, 1, base).sum()).item())
            print(f"   {name:48s} {sum(ratios) / len(ratios):.3f} ({min(ratios):.3f})")
    print("dense attention with int8 K (V exact): total-variation distance of the attention rows, mean (worst)")
    for name in [n for n in SCHEMES if n.startswith("int8")]:
        tv = []
        for q, K in records:
            exact = torch.softmax(q @ K.transpose(-1, -2) / d ** 0.5, -1)
            approx = torch.softmax(q @ SCHEMES[name](K).transpose(-1, -2) / d ** 0.5, -1)
            tv.append(((exact - approx).abs().sum(-1) / 2).max().item())
        print(f"   {name:48s} {sum(tv) / len(tv):.4f} ({max(tv):.4f})")


if __name__ == "__main__":
    main()
