"""The interactive chat of generate.py --interactive: a conversation on the chat template that stays
in the KV cache between turns. Each turn prefills only what it adds to the cached tokens (an edited
or dropped turn truncates the cache to the prefix it shares), and when the context is full the
oldest turns are dropped, which is said.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, TextIO

import torch

from assemble import allocate_caches, cache_format
from decoding import Generator, TextStream, prefill
from sampling import sample, sampling_from_flags
from model import Transformer
from policies import AttentionSettings, install_policy


def chat_loop(args: argparse.Namespace, model: Transformer, tokenizer, settings: AttentionSettings,
              length_bucket: int, input_fn: Callable[[str], str] = input, out: TextIO = sys.stdout) -> int:
    """A chat at the terminal on the chat template. The conversation stays in the cache between turns:
    each turn prefills only what it adds (when the re-rendered conversation extends the tokens in
    the cache), and when the context is full the oldest turns are dropped, which is said."""
    max_seq_length = args.max_seq_length or model.args.max_context
    allocate_caches(model, cache_format(args, args.device, [settings.policy]), 1, max_seq_length, length_bucket)
    install_policy(model, settings)
    generator = Generator(model, stop_ids=tokenizer.stop_ids, sampling=sampling_from_flags(args, model.args.vocab_size),
                          compile_decode=args.compile, compile_backend=args.compile_backend)
    messages: list[dict] = []
    cached: list[int] = []  # the token ids whose keys and values the cache holds, from position 0
    print(f"chat with {args.checkpoint} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            text = input_fn("> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        while True:
            ids = tokenizer.encode_chat(messages)
            if len(ids) + 2 <= max_seq_length or len(messages) <= 1:
                break
            messages = messages[2:]  # drop the oldest exchange
            print("note: the conversation no longer fits the context: dropped the oldest turn", file=sys.stderr)
        if len(ids) + 2 > max_seq_length:
            print(f"note: this message alone ({len(ids)} tokens) does not fit the context of {max_seq_length}",
                  file=sys.stderr)
            messages.pop()
            continue
        budget = min(args.max_new_tokens, max_seq_length - len(ids))
        reply, cached = chat_turn(generator, tokenizer, cached, ids, budget, out)
        messages.append({"role": "assistant", "content": tokenizer.decode([t for t in reply if t not in tokenizer.stop_ids])})
    return 0


def reuse_cache(model: Transformer, cached: list[int], ids: list[int]) -> int:
    """Positions of the cache (holding `cached`) that the conversation `ids` keeps: the prefix they share,
    all but one token of ids at most (its logits come from a prefill). The rest is truncated away (an
    edited or dropped turn); a policy that cannot truncate rows (H2O) starts from an empty cache."""
    shared = 0
    for a, b in zip(cached, ids[:-1]):
        if a != b:
            break
        shared += 1
    if shared < len(cached):
        try:
            model.truncate_row(0, shared)
        except ValueError:
            model.reset_caches()
            return 0
    return shared


@torch.no_grad()
def chat_turn(generator: Generator, tokenizer, cached: list[int], ids: list[int], max_new: int,
              out: TextIO) -> tuple[list[int], list[int]]:
    """One assistant reply to the conversation `ids`, streamed to `out`. Keeps what the cache shares with
    `cached` (reuse_cache) and prefills the rest; returns (reply tokens, the ids now in the cache)."""
    model = generator.model
    reuse = reuse_cache(model, cached, ids)
    new = torch.tensor([ids[reuse:]], device=model.device)
    logits = prefill(model, new, generator.prefill_chunk, start=reuse)
    stream = TextStream(tokenizer, out)
    history = generator.history([ids])  # the penalties' view of the conversation, where they apply
    token = sample(logits, generator.sampling, history)
    if history is not None:
        history.add(token)
    reply = [int(token)]
    position = len(ids)
    while reply[-1] not in generator.stop_ids and len(reply) < max_new:
        stream.add(reply[-1])
        logits = generator._decode(model, token.view(1, 1), torch.tensor([position], device=model.device),
                                   model.read_length(position + 1))
        token = sample(logits, generator.sampling, history)
        if history is not None:
            history.add(token)
        reply.append(int(token))
        position += 1
    if reply[-1] not in generator.stop_ids:
        stream.add(reply[-1])
    stream.finish()
    # The cache now holds ids and the reply but its last token (sampled, never fed back).
    return reply, ids + reply[:-1]
