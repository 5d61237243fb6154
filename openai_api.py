"""The OpenAI API as this server speaks it: the fields each endpoint reads, checked (a 400 naming the
field otherwise), the prompt a request encodes to, and the replies, whole or streamed as server-sent
events. No model, engine or web framework here: serve.py's handlers call these.

Fields: max_tokens (completions default 16, 0 with echo to score the prompt alone; chat: max_tokens or
max_completion_tokens, else to the end of the turn or the context), temperature, top_k, top_p, min_p,
presence_penalty, frequency_penalty, repetition_penalty (sampling.py), stop (a string or up to 4), seed
(a request's samples depend on its own seed alone), stream and stream_options.include_usage (a last
chunk with `choices: []` and the usage, OpenAI's), ignore_eos (vLLM's and llama-server's extension:
generate max_tokens whatever comes); completions: logprobs (0-20 alternatives, OpenAI's legacy format)
and echo (the prompt comes back first, with its own logprobs, the first one null: what
lm-evaluation-harness scores choices with), prompts as text or token ids; chat: logprobs and
top_logprobs (the chat format), message content as a string or a list of text parts. Every other field
is a 400 naming it, but for a few at the value that changes nothing (NEUTRAL), so that no field a client
relies on is silently ignored; n > 1 is refused.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine import TokenLogprob
from sampling import Sampling

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_LOGPROBS = 20  # alternatives per token (OpenAI: 5 on /v1/completions, 20 on chat)

# The OpenAI fields each endpoint acts on. Any other field is a 400 naming it (a client must not
# mistake a field we would ignore for one we honoured), except those in NEUTRAL at a value that
# changes nothing.
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "n", "stop", "stream", "stream_options", "ignore_eos", "logprobs",
                     "echo"} | SAMPLING_FIELDS
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "stream", "stream_options",
               "ignore_eos", "logprobs", "top_logprobs"} | SAMPLING_FIELDS
NEUTRAL = {  # field -> (whether a value changes nothing, what to say otherwise)
    "best_of": (lambda v: v is None or v == 1, "'best_of' > 1 is not supported"),
    "logit_bias": (lambda v: not v, "'logit_bias' is not supported"),
    "suffix": (lambda v: not v, "'suffix' is not supported"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "only the text 'response_format' is supported"),
    "user": (lambda v: True, ""),  # an end user's id: it changes no output
    "cache_prompt": (lambda v: True, ""),  # llama-server's prompt cache hint: no cache here, the output is the same
}


# ---------------------------------------------------------------------------------------------
# Requests: the OpenAI fields we read, checked
# ---------------------------------------------------------------------------------------------


class BadRequest(Exception):
    """A 400: the message and the offending field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _field(body: dict, name: str, kinds: tuple, default: Any = None, check=None, what: str = "") -> Any:
    """body[name] if present and of one of `kinds` (bool is not an int here), passing `check`; else BadRequest."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}", name)
    if check is not None and not check(value):
        raise BadRequest(f"'{name}' must be {what}, got {value!r}", name)
    return value


def check_fields(body: dict, chat: bool) -> None:
    """A 400 for a field this endpoint does not implement (NEUTRAL ones pass at a value that changes nothing)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            neutral, message = NEUTRAL[name]
            if not neutral(value):
                raise BadRequest(message, name)
            continue
        raise BadRequest(f"'{name}' is not supported by this server", name)


@dataclass
class Options:
    """What a request asks for beyond its prompt, checked."""

    max_tokens: Optional[int]  # None: to the end of the turn or the context (chat)
    sampling: Sampling
    stop: list[str]
    seed: Optional[int]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with no choices and the usage
    ignore_eos: bool  # vLLM's and llama-server's extension: run to max_tokens (load tests)
    logprobs: Optional[int]  # alternatives per token, None: no logprobs
    echo: bool  # completions: the prompt comes back first, with its logprobs when asked
    limit_field: str = "max_tokens"  # the field max_tokens came from (chat: or max_completion_tokens)


def read_sampling(body: dict, vocab_size: int) -> Sampling:
    """The request's sampling fields (sampling.Sampling's, OpenAI's names and defaults: temperature 1)."""
    number = (int, float)
    params = Sampling(
        temperature=float(_field(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_k=_field(body, "top_k", (int,), None, lambda v: v >= 1, "a positive integer"),
        top_p=float(_field(body, "top_p", number, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        min_p=float(_field(body, "min_p", number, 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        presence_penalty=float(_field(body, "presence_penalty", number, 0.0, lambda v: -2 <= v <= 2,
                                      "a number in [-2, 2]")),
        frequency_penalty=float(_field(body, "frequency_penalty", number, 0.0, lambda v: -2 <= v <= 2,
                                       "a number in [-2, 2]")),
        repetition_penalty=float(_field(body, "repetition_penalty", number, 1.0, lambda v: v > 0,
                                        "a number > 0 (1 changes nothing)")))
    problem = params.problem(vocab_size)  # what the fields' own ranges leave (top_k beyond the vocabulary)
    if problem is not None:
        raise BadRequest(f"'{problem[0]}' {problem[1]}", problem[0])
    return params


def read_stream(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage): the options only beside a stream, as OpenAI has them."""
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), None, what="an object")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise BadRequest(f"'stream_options.{unknown[0]}' is not supported by this server", "stream_options")
    return stream, _field(options, "include_usage", (bool,), False)


def read_options(body: dict, chat: bool, vocab_size: int) -> Options:
    check_fields(body, chat)
    n = _field(body, "n", (int,), 1, lambda v: v >= 1, "a positive integer")
    if n != 1:
        raise BadRequest("n > 1 is not supported: send the request n times (with different seeds)", "n")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    echo = not chat and _field(body, "echo", (bool,), False)
    if chat:
        if _field(body, "logprobs", (bool,), False):
            logprobs = _field(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= MAX_LOGPROBS,
                              f"an integer in [0, {MAX_LOGPROBS}]")
        elif body.get("top_logprobs") is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        else:
            logprobs = None
        limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, limit, (int,), None, lambda v: v > 0, "a positive integer")
    else:
        logprobs = _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS,
                          f"an integer in [0, {MAX_LOGPROBS}]")
        max_tokens = _field(body, "max_tokens", (int,), COMPLETIONS_MAX_TOKENS, lambda v: v > 0 or (v == 0 and echo),
                            "a positive integer (0 only with echo: the prompt scored)")
    stream, include_usage = read_stream(body)
    return Options(max_tokens=max_tokens, sampling=read_sampling(body, vocab_size), stop=stop,
                   seed=_field(body, "seed", (int,), None), stream=stream, include_usage=include_usage,
                   ignore_eos=_field(body, "ignore_eos", (bool,), False), logprobs=logprobs, echo=echo,
                   limit_field=limit if chat else "max_tokens")


def read_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """/v1/completions' prompt: a string, a one-string list, or a list of token ids (each in the vocabulary)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            return tokenizer.encode_prompt(prompt)
        except ValueError as e:  # random weights: no tokenizer
            raise BadRequest(str(e), "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"token ids must be in [0, {vocab_size})", "prompt")
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def message_text(content: Any) -> str:
    """A message's content as text: a string, or a list of text parts ({"type": "text", "text": ...}, what the
    OpenAI SDK's typed messages send), joined; any other part (an image, audio) is a 400."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise BadRequest('message content parts must be text parts ({"type": "text", "text": ...})'
                                 + (f"; this server reads no {kind!r} parts" if isinstance(kind, str) else ""),
                                 "messages")
        return "".join(part["text"] for part in content)
    raise BadRequest("each message's 'content' must be a string or a non-empty list of text parts", "messages")


def read_messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadRequest("each message must be an object with a string 'role' and a 'content'", "messages")
    turns = [{"role": m["role"], "content": message_text(m["content"])} for m in messages]
    try:
        return tokenizer.encode_chat(turns)
    except ValueError as e:  # no chat template (or no tokenizer)
        raise BadRequest(str(e), "messages") from None


def check_context(prompt: list[int], options: Options, max_seq_length: int, chat: bool) -> None:
    """A 400 naming the limit when the prompt and max_tokens do not fit the context (OpenAI's and vLLM's
    answer), rather than a row held until the context ends."""
    param = "messages" if chat else "prompt"
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", param)
    if len(prompt) >= max_seq_length:
        raise BadRequest(f"this server's context is {max_seq_length} tokens; the prompt has {len(prompt)}", param)
    if options.max_tokens is not None and len(prompt) + options.max_tokens > max_seq_length:
        raise BadRequest(f"this server's context is {max_seq_length} tokens: the prompt's {len(prompt)} and "
                         f"max_tokens {options.max_tokens} exceed it (at most {max_seq_length - len(prompt)})",
                         options.limit_field)


# ---------------------------------------------------------------------------------------------
# Text out: stop strings, held back while they may still be forming
# ---------------------------------------------------------------------------------------------


@dataclass
class TextOut:
    """The text of a growing list of tokens, released in pieces that can no longer turn into a stop
    string (or an unfinished UTF-8 character); `stopped` once a stop string appears (cut before it)."""

    tokenizer: Any
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters released
    stopped: bool = False

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        hits = [text.find(s, max(0, self.sent - len(s))) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped = True
            return self._release(text, min(hits))
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        end = len(text) - hold  # the longest tail that may still grow into a stop string stays back
        while end > self.sent and text[end - 1] == "\ufffd":  # a character still arriving
            end -= 1
        return self._release(text, end)

    def finish(self) -> str:
        """What is still held back, at the end (no stop string appeared)."""
        return "" if self.stopped else self._release(self.tokenizer.decode(self.tokens), None)

    def _release(self, text: str, end: Optional[int]) -> str:
        end = len(text) if end is None else end
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class Reply:
    """One request's answer in OpenAI's shapes, whole or as chunks: the text released so far (TextOut), the
    echoed prompt (completions' echo) and each token's logprobs when asked. step() takes the engine's
    events; pending() hands a stream what it has not sent yet."""

    chat: bool
    model: str
    prompt: list[int]
    text: TextOut
    tokenizer: Any
    echo: bool = False
    logprobs: Optional[int] = None  # alternatives per token; None: no logprobs
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    entries: list[tuple[int, Optional[TokenLogprob]]] = field(default_factory=list)  # (token, logprob) to report
    released: str = ""  # text released, the echoed prompt first
    sent: tuple[int, int] = (0, 0)  # (characters, entries) a stream has sent
    stop_token: bool = False  # the request ended at a stop token (reported in logprobs and usage)
    cached_tokens: int = 0  # prompt tokens its row's cache kept from an earlier request (prefix reuse)

    def __post_init__(self):
        if self.echo:  # the prompt's text; its logprobs come once it is prefilled (emit_prompt)
            self.released = self.tokenizer.decode(self.prompt)

    def step(self, token, finish: Optional[str], logprob) -> Optional[str]:
        """An engine event -> the finish reason, or None while the request goes on."""
        if token == "prompt":  # the prompt's logprobs (echo): reported before the generated tokens
            self.entries = [(t, lp) for t, lp in zip(self.prompt, logprob)] + self.entries
            return None
        if token == "admitted":  # in a row: `finish` is how many prompt tokens its cache kept
            self.cached_tokens = finish
            return None
        if token is not None:
            self.released += self.text.add(token)
            self.entries.append((token, logprob))
            return "stop" if self.text.stopped else None
        if logprob is not None:  # the stop token: in the logprobs (lm-eval scores it), not in the text
            self.entries.append((logprob.token, logprob))
            self.stop_token = True
        self.released += self.text.finish()
        return finish

    def usage(self) -> dict:
        """OpenAI's usage, the prompt tokens a kept prefix served in prompt_tokens_details.cached_tokens."""
        n = len(self.text.tokens) + self.stop_token
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def whole(self, reason: str) -> dict:
        end = len(self.released) if self.text.stopped else None  # a stop string cut the text: its tokens go too
        logprobs = self.logprobs_of(self.entries, 0, end) if self.logprobs is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.released}, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": self.released, "logprobs": logprobs, "finish_reason": reason}
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
                "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": self.usage()}

    def pending(self) -> Optional[dict]:
        """What a stream has not sent: {"text": ..., "logprobs": ...}, or None when nothing is new."""
        chars, done = self.sent
        if len(self.released) == chars and (self.logprobs is None or len(self.entries) == done):
            return None
        piece = {"text": self.released[chars:],
                 "logprobs": self.logprobs_of(self.entries[done:], chars) if self.logprobs is not None else None}
        self.sent = (len(self.released), len(self.entries))
        return piece

    @staticmethod
    def empty_piece() -> dict:
        return {"text": "", "logprobs": None}

    def logprobs_of(self, entries: list, offset: int, end: Optional[int] = None) -> dict:
        """Entries (token, TokenLogprob or None) in OpenAI's format: chat's {"content": [...]}, or the legacy
        {"tokens", "token_logprobs", "top_logprobs", "text_offset"} with offsets from `offset` characters;
        `end`: the text's length, past which tokens are left out (those a stop string cut away)."""
        words = [self.tokenizer.decode([t]) for t, _ in entries]
        if end is not None:
            starts = [offset + sum(len(w) for w in words[:i]) for i in range(len(words))]
            keep = sum(1 for p in starts if p < end) if len(words) else 0
            words, entries = words[:keep], entries[:keep]
        if self.chat:
            return {"content": [{"token": w, "logprob": lp.logprob, "bytes": list(w.encode()),
                                 "top_logprobs": [{"token": (a := self.tokenizer.decode([i])), "logprob": v,
                                                   "bytes": list(a.encode())} for i, v in lp.top]}
                                for w, (_, lp) in zip(words, entries) if lp is not None]}
        offsets = []
        for w in words:
            offsets.append(offset)
            offset += len(w)
        return {"tokens": words,
                "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
                "top_logprobs": [None if lp is None else {self.tokenizer.decode([i]): v for i, v in lp.top}
                                 for _, lp in entries],
                "text_offset": offsets}

    def usage_chunk(self) -> dict:
        """stream_options.include_usage's last chunk: no choices, the request's usage (OpenAI's)."""
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}

    def chunk(self, reason: Optional[str], piece, include_usage: bool = False) -> dict:
        """A stream's chunk of `piece` (or chat's first, the role); include_usage: with "usage": null, as
        OpenAI sends every chunk before the last (usage_chunk) when a stream asks for its usage."""
        if self.chat:
            if isinstance(piece, dict) and "role" in piece:
                delta, logprobs = piece, None
            else:
                delta = {"content": piece["text"]} if piece["text"] else {}
                logprobs = piece["logprobs"]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece["text"], "logprobs": piece["logprobs"], "finish_reason": reason}
        out = {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
               "object": "chat.completion.chunk" if self.chat else "text_completion", "created": self.created,
               "model": self.model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out
