"""Could the server's prefix reuse keep a chat's earlier replies? Their positions were written by decode steps,
a cold prompt's by the prefill: the rounding of the two, measured (issue 88; docs/serving.md).

    python -m scripts.studies.reply_reuse_study --dtype float32 --examples 8
    python -m scripts.studies.reply_reuse_study --dtype bfloat16 --attention sparq-adaptive --compression 1/8

Per example (a chat turn of essay text, seed 0): the prompt P prefilled, a greedy reply R of --reply tokens
decoded step by step, then a follow-up user turn U prefilled after them and a greedy continuation of --new
tokens ("warm": what reuse keeping R would compute); against P + R + U prefilled cold from position 0 in the
server's pieces, then the same continuation ("cold": what the server computes now). Printed: the largest
difference of U's last logits (and its KL), whether the next token agrees, and how many continuation tokens
agree before the first difference. The server keeps prompt positions only (engine.Engine's cached ids), so a
warm request is its cold run bit for bit; this says what keeping the replies would cost.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cli  # noqa: E402
import data  # noqa: E402
from cache import KVFormat  # noqa: E402
from assemble import DTYPES, kernels_for, load_checkpoint, load_tokenizer  # noqa: E402
from decoding import decode_step, prefill  # noqa: E402
from engine import PREFILL_CHUNK  # noqa: E402
from model import ModelArgs, checkpoint_paths  # noqa: E402
from policies import AttentionSettings, parse_compression, policy_factory  # noqa: E402
from scripts.studies.long_output_study import agreement  # noqa: E402


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m scripts.studies.reply_reuse_study", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--attention", choices=("dense", "sparq-adaptive"), default="dense")
    p.add_argument("--compression", type=parse_compression, default="1/8")
    p.add_argument("--examples", type=cli.positive_int, default=8)
    p.add_argument("--turn-tokens", type=cli.positive_int, default=600, help="tokens of the first user turn")
    p.add_argument("--reply", type=cli.positive_int, default=128, help="tokens of the decoded reply")
    p.add_argument("--new", type=cli.positive_int, default=64, help="tokens of the continuation compared")
    return p


def greedy(model, logits: torch.Tensor, start: int, n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens from logits (1, vocab) at position start on: (the tokens, the first logits)."""
    first, out = logits.float(), []
    for i in range(n):
        token = logits.argmax(-1)
        out.append(int(token))
        logits = decode_step(model, token.view(1, 1), torch.tensor([start + i]), start + i + 1)
    return out, first


def run(args) -> None:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.checkpoint)
    config = ModelArgs.from_json(checkpoint_paths(args.checkpoint)[1] / "config.json")
    kernels = kernels_for("auto", "cpu", config)
    model = load_checkpoint(args.checkpoint, "cpu", DTYPES[args.dtype], kernels)
    knob = {"compression": args.compression} if args.attention != "dense" else {}
    settings = AttentionSettings(args.attention, **knob)
    # the server's cache: adaptive SparQ's K^T in int4 on the CPU (--kt-dtype auto), dense's none
    kv_format = KVFormat(kt_dtype="int4") if args.attention != "dense" else KVFormat()
    text = tokenizer.encode(data.essays_text())
    rng = random.Random(0)
    rows, start = [], time.time()
    with torch.no_grad():
        for _ in range(args.examples):
            at = rng.randrange(len(text) - 2 * args.turn_tokens)
            prompt = text[at:at + args.turn_tokens]
            follow = text[at + args.turn_tokens:at + args.turn_tokens + 64]
            total = len(prompt) + args.reply + len(follow) + args.new + 1
            model.setup_caches(1, total, kv_format)
            model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
            logits = prefill(model, torch.tensor([prompt]), PREFILL_CHUNK)
            reply, _ = greedy(model, logits, len(prompt), args.reply)
            # the reply's last token is decoded, not only sampled: the follow-up starts after it
            decode_step(model, torch.tensor([[reply[-1]]]), torch.tensor([len(prompt) + args.reply - 1]),
                        len(prompt) + args.reply)
            held = len(prompt) + args.reply
            logits = prefill(model, torch.tensor([follow]), PREFILL_CHUNK, start=held)
            warm, warm_first = greedy(model, logits, held + len(follow), args.new)
            model.setup_caches(1, total, kv_format)
            model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
            logits = prefill(model, torch.tensor([prompt + reply + follow]), PREFILL_CHUNK)
            cold, cold_first = greedy(model, logits, held + len(follow), args.new)
            agree = agreement(warm, cold)
            lp_w, lp_c = torch.log_softmax(warm_first, -1), torch.log_softmax(cold_first, -1)
            kl = float((lp_c.exp() * (lp_c - lp_w)).sum())
            rows.append((float((warm_first - cold_first).abs().max()), kl, warm[0] == cold[0], agree))
            print(f"example {len(rows)}: max |logit diff| {rows[-1][0]:.2e}, KL {kl:.2e}, next token "
                  f"{'same' if rows[-1][2] else 'differs'}, {agree} of {args.new} continuation tokens agree",
                  file=sys.stderr)
    n = len(rows)
    print(f"{args.checkpoint.name}, {args.dtype}, {args.attention}"
          f"{'' if args.attention == 'dense' else f' {args.compression}'}: {n} examples, a {args.turn_tokens}-token "
          f"turn, a {args.reply}-token reply, a 64-token follow-up; {time.time() - start:.0f} s")
    print(f"max |logit diff| mean {sum(r[0] for r in rows) / n:.2e} (largest {max(r[0] for r in rows):.2e}); "
          f"KL mean {sum(r[1] for r in rows) / n:.2e}; next token the same in {sum(r[2] for r in rows)} of {n}; "
          f"continuations whole-equal in {sum(r[3] == args.new for r in rows)} of {n}, agreeing for "
          f"{sum(r[3] for r in rows) / n:.1f} of {args.new} tokens on average")


if __name__ == "__main__":
    sys.exit(cli.main(build_parser(), run))
