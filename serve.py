"""An OpenAI-compatible server with continuous batching (engine.py) on one model.

    python serve.py --port 8000 --max-batch-size 8                      # the embedded model, dense
    python serve.py --port 8000 --max-batch-size 16 --sparq-r 16 --sparq-k 128
    python serve.py --random-weights llama-3.1-8b --max-batch-size 16 --max-seq-length 20480   # a GPU, no files
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 8}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET /v1/models,
GET /health, and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info (lm-evaluation-harness
tokenizes through them). `stream: true` answers in server-sent events, OpenAI's chunk format. Any `model` name is
accepted; the served one is reported. Request fields: max_tokens (completions default 16, 0 with echo
to score the prompt alone; chat: max_tokens or max_completion_tokens, else to the end of the turn or
the context), temperature, top_k, stop (a string or up to 4), seed (a request's samples depend on its
own seed alone), stream, ignore_eos (vLLM's and llama-server's extension: generate max_tokens
whatever comes); completions: logprobs (0-20 alternatives, OpenAI's legacy format: tokens,
token_logprobs, top_logprobs, text_offset) and echo (the prompt comes back first, with its own
logprobs, the first one null: what lm-evaluation-harness scores choices with), prompts as text or
token ids; chat: logprobs and top_logprobs (the chat format). Every other field is a 400 naming it,
but for a few at the value that changes nothing (top_p 1, penalties 0, user...: NEUTRAL), so that no
field a client relies on is silently ignored; n > 1 is refused. A prompt and max_tokens beyond the
context are a 400 naming the limit. Bad input is a 400 with an OpenAI-style error body, a full queue
a 429 with Retry-After; SIGTERM stops admitting, ends the requests in flight and exits.

The decode step is compiled by default (on the CPU built ahead of time and cached across runs; on
CUDA captured in CUDA graphs), one per row bucket (engine.ROW_BUCKETS), all of them before the port
opens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

import cli
import data
from cli import UserError
from assemble import (DTYPES, TokenIds, add_cache_flags, add_model_flags, allocate_caches, cache_format, cache_storage,
                      kernels_for, load_checkpoint, load_tokenizer, model_args, solve_compression)
from aot import AOTDecodeStep
from decoding import COMPILE_BACKENDS, compiled_decode_step, decode_step, default_compile_backend
from engine import PREFILL_CHUNK, STEP_TOKENS, Engine, QueueFull, Request, Stopped, TokenLogprob, run_alone
from model import ModelArgs, checkpoint_paths, random_model
from kernels import KERNEL_CHOICES, batch_invariant_kernels
from policies import add_attention_flags, attention_settings, describe_layers, install_policy

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_LOGPROBS = 20  # alternatives per token (OpenAI: 5 on /v1/completions, 20 on chat)
WARM_UP_SHORT, WARM_UP_LONG = 16, 1024  # the warm-up's live lengths: below and above SparQ's k (128 by default)

# The OpenAI fields each endpoint acts on. Any other field is a 400 naming it (a client must not
# mistake a field we would ignore for one we honoured), except those in NEUTRAL at a value that
# changes nothing.
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_k", "n", "stop", "seed", "stream",
                     "stream_options", "ignore_eos", "logprobs", "echo"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_k", "n", "stop", "seed",
               "stream", "stream_options", "ignore_eos", "logprobs", "top_logprobs"}
NEUTRAL = {  # field -> (whether a value changes nothing, what to say otherwise)
    "top_p": (lambda v: v is None or v == 1, "nucleus sampling is not implemented: 'top_p' must be 1"),
    "presence_penalty": (lambda v: v is None or v == 0, "penalties are not implemented: 'presence_penalty' must be 0"),
    "frequency_penalty": (lambda v: v is None or v == 0, "penalties are not implemented: 'frequency_penalty' must be 0"),
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
class Sampling:
    max_tokens: Optional[int]  # None: to the end of the turn or the context (chat)
    temperature: float
    top_k: Optional[int]
    stop: list[str]
    seed: Optional[int]
    stream: bool
    ignore_eos: bool  # vLLM's and llama-server's extension: run to max_tokens (load tests)
    logprobs: Optional[int]  # alternatives per token, None: no logprobs
    echo: bool  # completions: the prompt comes back first, with its logprobs when asked
    limit_field: str = "max_tokens"  # the field max_tokens came from (chat: or max_completion_tokens)


def read_sampling(body: dict, chat: bool) -> Sampling:
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
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_k=_field(body, "top_k", (int,), None, lambda v: v >= 1, "a positive integer"),
        stop=stop,
        seed=_field(body, "seed", (int,), None),
        stream=_field(body, "stream", (bool,), False),
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        echo=echo,
        limit_field=limit if chat else "max_tokens",
    )


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


def read_messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest("each message must be an object with string 'role' and 'content'", "messages")
    try:
        return tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
    except ValueError as e:  # no chat template (or no tokenizer)
        raise BadRequest(str(e), "messages") from None


def check_context(prompt: list[int], sampling: Sampling, max_seq_length: int, chat: bool) -> None:
    """A 400 naming the limit when the prompt and max_tokens do not fit the context (OpenAI's and vLLM's
    answer), rather than a row held until the context ends."""
    param = "messages" if chat else "prompt"
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", param)
    if len(prompt) >= max_seq_length:
        raise BadRequest(f"this server's context is {max_seq_length} tokens; the prompt has {len(prompt)}", param)
    if sampling.max_tokens is not None and len(prompt) + sampling.max_tokens > max_seq_length:
        raise BadRequest(f"this server's context is {max_seq_length} tokens: the prompt's {len(prompt)} and "
                         f"max_tokens {sampling.max_tokens} exceed it (at most {max_seq_length - len(prompt)})",
                         sampling.limit_field)


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


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


@dataclass
class Served:
    """What the endpoints need: the engine, its thread, the tokenizer, and what /v1/models reports."""

    engine: Engine
    tokenizer: Any
    model_name: str
    description: dict
    thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.engine.run_forever, name="engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.engine.stop()
        if self.thread is not None:
            self.thread.join(timeout)


async def json_body(request) -> dict:
    """The request's JSON object, or BadRequest."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                   headers: Optional[dict] = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status,
                        headers=headers)


def build_app(served: Served):
    """The Starlette application over a started engine."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok", "busy_rows": served.engine.busy_rows,
                             "waiting": len(served.engine.waiting), **served.engine.stats})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                                         "owned_by": "sparq-fast", **served.description}]})

    async def completions(request):
        return await generate(request, chat=False)

    async def tokenizer_info(request):  # vLLM's tokenizer endpoints, what lm-evaluation-harness's "remote" reads
        tokenizer = served.tokenizer
        if isinstance(tokenizer, TokenIds):
            return error_response(404, "random weights have no tokenizer")
        names = {i: text for text, i in tokenizer.special_tokens.items()}
        return JSONResponse({"eos_token": names.get(tokenizer.eos_id), "bos_token": names.get(tokenizer.bos_id),
                             "pad_token": None, "chat_template": tokenizer.chat_template,
                             "model_max_length": served.engine.max_seq_length,
                             "tokenizer_class": type(tokenizer).__name__})

    async def tokenize(request):
        """{"prompt": text, "add_special_tokens": true} -> {"tokens", "count", "max_model_len"}: the ids this
        server runs, special-token strings as their ids (BOS first when the tokenizer adds one and asked)."""
        try:
            body = await json_body(request)
            if isinstance(served.tokenizer, TokenIds):
                raise BadRequest("random weights have no tokenizer: prompts are token ids", "prompt")
            unknown = sorted(set(body) - {"prompt", "add_special_tokens", "model"})
            if unknown:
                raise BadRequest(f"'{unknown[0]}' is not supported by this server", unknown[0])
            text = _field(body, "prompt", (str,), None, what="a string")
            if text is None:
                raise BadRequest("'prompt' must be a string", "prompt")
            special = _field(body, "add_special_tokens", (bool,), True)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        tokenizer = served.tokenizer
        ids = ([tokenizer.bos_id] if special and tokenizer.add_bos else []) + tokenizer.encode_with_special_tokens(text)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_seq_length})

    async def detokenize(request):
        try:
            body = await json_body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("'tokens' must be a list of token ids", "tokens")
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        return JSONResponse({"prompt": served.tokenizer.decode(tokens)})

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def generate(request, chat: bool):
        engine, tokenizer = served.engine, served.tokenizer
        try:
            body = await json_body(request)
            sampling = read_sampling(body, chat)
            prompt = read_messages(body, tokenizer) if chat else read_prompt(body, tokenizer, engine.model.args.vocab_size)
            check_context(prompt, sampling, engine.max_seq_length, chat)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        reply = Reply(chat, served.model_name, prompt, TextOut(tokenizer, sampling.stop), tokenizer, sampling.echo,
                      sampling.logprobs)
        max_new = sampling.max_tokens if sampling.max_tokens is not None else engine.max_seq_length - len(prompt)
        engine_request = Request(prompt=prompt, max_new_tokens=max_new,
                                 stop_ids=frozenset(() if sampling.ignore_eos else tokenizer.stop_ids),
                                 temperature=sampling.temperature, top_k=sampling.top_k, seed=sampling.seed,
                                 logprobs=sampling.logprobs, echo_logprobs=sampling.echo and sampling.logprobs is not None,
                                 emit=lambda token, reason, logprob=None: loop.call_soon_threadsafe(
                                     events.put_nowait, (token, reason, logprob)),
                                 emit_prompt=lambda logprobs: loop.call_soon_threadsafe(
                                     events.put_nowait, ("prompt", None, logprobs)))
        try:
            request_id = engine.submit(engine_request)
        except ValueError as e:  # the engine's own check of the prompt
            return error_response(400, str(e), param="messages" if chat else "prompt")
        except QueueFull as e:
            return error_response(429, f"busy: {e}; retry shortly", "rate_limit_error", headers={"Retry-After": "1"})
        except Stopped as e:
            return error_response(503, str(e), "server_error")
        if sampling.stream:
            return StreamingResponse(stream_events(engine, request_id, events, reply),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            reason = None
            while reason is None:
                event = await events.get()
                reason = reply.step(*event)
                if reason is not None and event[1] is None:  # a stop string: the engine can stop
                    engine.cancel(request_id)
        except asyncio.CancelledError:
            engine.cancel(request_id)
            raise
        return JSONResponse(reply.whole(reason))

    async def stream_events(engine: Engine, request_id: int, events: asyncio.Queue, reply: "Reply"):
        try:
            if reply.chat:
                yield sse(reply.chunk(None, {"role": "assistant", "content": ""}))
            reason = None
            while reason is None:
                event = await events.get()
                reason = reply.step(*event)
                piece = reply.pending()
                if piece is not None:
                    yield sse(reply.chunk(None, piece))
            yield sse(reply.chunk(reason, reply.pending() or reply.empty_piece(), usage=True))
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client went away: either way the row is free
            engine.cancel(request_id)

    async def on_error(request, exc):  # never a traceback to the client
        if isinstance(exc, HTTPException):
            return error_response(exc.status_code, exc.detail)
        print(f"serve.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    routes = [Route("/health", health), Route("/v1/models", models), Route("/tokenizer_info", tokenizer_info),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={Exception: on_error, HTTPException: on_error})


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

    def __post_init__(self):
        if self.echo:  # the prompt's text; its logprobs come once it is prefilled (emit_prompt)
            self.released = self.tokenizer.decode(self.prompt)

    def step(self, token, finish: Optional[str], logprob) -> Optional[str]:
        """An engine event -> the finish reason, or None while the request goes on."""
        if token == "prompt":  # the prompt's logprobs (echo): reported before the generated tokens
            self.entries = [(t, lp) for t, lp in zip(self.prompt, logprob)] + self.entries
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
        n = len(self.text.tokens) + self.stop_token
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}

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

    def chunk(self, reason: Optional[str], piece, usage: bool = False) -> dict:
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
        if usage:
            out["usage"] = self.usage()
        return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, "no tokenizer either: prompts are token ids, replies their token ids (a GPU machine carries "
                       "no files)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cli.non_negative_int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="rows decoding together")
    p.add_argument("--max-seq-length", type=cli.positive_int, default=None,
                   help="context per row: prompt + generated (default: the model's, at most 8192)")
    p.add_argument("--step-tokens", type=cli.positive_int, default=STEP_TOKENS,
                   help=f"tokens a step carries: one per decoding row, then prompt pieces while they fit (default "
                        f"{STEP_TOKENS}; vLLM's chunked-prefill budget)")
    p.add_argument("--prefill-chunk", type=cli.positive_int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill piece, one forward pass each (default {PREFILL_CHUNK})")
    p.add_argument("--max-queue", type=cli.positive_int, default=64,
                   help="requests waiting for a row before the server answers 429")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto")
    add_cache_flags(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step, one per row bucket (default; --no-compile: eager)")
    p.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=None,
                   help="default: aot on the CPU (built ahead of time, cached across runs), inductor's CUDA "
                        "graphs on CUDA")
    add_attention_flags(p)
    return p


def public_settings(settings, checkpoint: Optional[Path]) -> dict:
    """The attention settings /v1/models reports: files named relative to the checkpoint, or by their name
    alone (a server shows no absolute path of its machine)."""
    out = {}
    for name, value in vars(settings).items():
        if value is None:
            continue
        if isinstance(value, Path):
            base = None if checkpoint is None else checkpoint_paths(checkpoint)[1]
            value = value.relative_to(base) if base is not None and value.is_relative_to(base) else Path(value.name)
        out[name] = str(value)
    return out


def load(args: argparse.Namespace) -> Served:
    """The model, its policy and the engine (not started), from the flags; UserError for what cannot serve."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.compile_backend = args.compile_backend or default_compile_backend(args.device)
    if args.compile_backend == "aot" and args.device == "cuda":
        raise UserError("--compile-backend aot builds the CPU step; on CUDA the step is captured in CUDA graphs (inductor)")
    if not args.random_weights:
        args.checkpoint = args.checkpoint or data.DEFAULT_CHECKPOINT
    settings = attention_settings(args)
    config = ModelArgs.from_shape(args.random_weights) if args.random_weights else model_args(args.checkpoint)
    if config.has_window_layers and args.max_batch_size > 1:
        raise UserError("this model has sliding-window layers, whose rows cannot hold different lengths: "
                        "serve it with --max-batch-size 1")
    max_seq_length = args.max_seq_length or min(config.max_context, 8192)
    if max_seq_length > config.max_context:
        raise UserError(f"--max-seq-length {max_seq_length} exceeds the model's context of {config.max_context}")
    length_bucket = 256 if args.device == "cuda" and args.compile else 1  # CUDA graphs: one per length bucket
    kv_format = cache_format(args, args.device, [settings.policy])
    # rows come and go between steps: a row's result must not depend on its neighbours
    kernels = batch_invariant_kernels(kernels_for(args.kernel, args.device, config, length_bucket, [kv_format]))
    if args.random_weights:
        model, tokenizer = random_model(config, args.device, DTYPES[args.dtype], kernels), TokenIds()
        name = args.random_weights
    else:
        model = load_checkpoint(args.checkpoint, args.device, DTYPES[args.dtype], kernels)
        tokenizer = load_tokenizer(args.checkpoint)
        path = Path(args.checkpoint)
        name = path.name if path.is_dir() else path.parent.name
    settings = solve_compression(settings, max_seq_length, config, cache_storage(kv_format, model))
    allocate_caches(model, kv_format, args.max_batch_size, max_seq_length, length_bucket)
    install_policy(model, settings)
    step = compiled_decode_step(decode_step, args.device, args.compile_backend) if args.compile else decode_step
    try:
        engine = Engine(model, max_seq_length, prefill_chunk=args.prefill_chunk, step_tokens=args.step_tokens,
                        max_queue=args.max_queue, decode=step)
    except ValueError as e:  # a policy with per-row state (H2O)
        raise UserError(f"cannot serve: {e}") from None
    description = {"attention": describe_layers(model), "settings": public_settings(settings, args.checkpoint),
                   "max_batch_size": args.max_batch_size, "max_seq_length": max_seq_length,
                   "step_tokens": args.step_tokens, "prefill_chunk": args.prefill_chunk,
                   "dtype": args.dtype, "device": args.device, "kernels": kernels.name,
                   "compiled": args.compile_backend if args.compile else None,
                   "tokenizer": not isinstance(tokenizer, TokenIds), "vocab_size": config.vocab_size}
    return Served(engine, tokenizer, name, description)


def warm_up(served: Served) -> float:
    """Before the port opens: every row bucket's decode step compiled (or loaded from the AOT cache) and run
    at a short and a long live length (Engine.warm_up), then one short request end to end."""
    engine = served.engine
    start = time.perf_counter()
    longest = engine.max_seq_length - 2
    if not engine.model.args.has_window_layers:  # (window layers' caches cannot hold rows of set lengths; one row)
        engine.warm_up(sorted({min(WARM_UP_SHORT, longest), min(WARM_UP_LONG, longest)}))
    run_alone(engine, Request(prompt=[1, 2, 3], max_new_tokens=2))
    return time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    served = load(args)
    if args.compile:
        print(f"serve.py: compiling the decode step ({args.compile_backend}) for each row bucket up to "
              f"{args.max_batch_size} rows...", file=sys.stderr, flush=True)
    seconds = warm_up(served)
    if args.compile:
        built = f"; {served.engine.decode.summary()}" if isinstance(served.engine.decode, AOTDecodeStep) else ""
        print(f"serve.py: warm-up {seconds:.0f} s{built}", file=sys.stderr, flush=True)
    served.start()
    app = build_app(served)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: admit nothing more, end what is in flight
            served.engine.stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="off")
    server = Server(config)
    print(f"serve.py: {served.model_name} ({served.description['attention']}; {args.max_batch_size} rows x "
          f"{served.engine.max_seq_length} positions, {args.dtype} on {args.device}) at http://{args.host}:"
          f"{args.port}/v1 ...", file=sys.stderr, flush=True)

    # uvicorn re-raises SIGTERM once its graceful shutdown is over, under the handler found at start:
    # by then every request has ended, so that handler does nothing and the process exits with 0
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    asyncio.run(_serve_and_report(server, args))
    served.stop()
    return 0


async def _serve_and_report(server, args) -> None:
    """Serve; once listening, print the address (the port the OS chose for --port 0)."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        print(f"serve.py: listening on http://{args.host}:{port}/v1", file=sys.stderr, flush=True)
    await task


if __name__ == "__main__":
    sys.exit(main())
