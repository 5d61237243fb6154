"""An OpenAI-compatible server with continuous batching (engine.py) on one model.

    python serve.py --port 8000 --max-batch-size 8                      # the embedded model, dense
    python serve.py --port 8000 --max-batch-size 16 --sparq-r 16 --sparq-k 128
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 8}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET /v1/models,
GET /health. `stream: true` answers in server-sent events, OpenAI's chunk format. Any `model` name is
accepted; the served one is reported. Request fields: max_tokens (completions default 16; chat runs
to the end of the turn or the context), temperature, top_k, stop (a string or up to 4), seed (a
request's samples depend on its own seed alone), stream, ignore_eos (vLLM's and llama-server's
extension: generate max_tokens whatever comes); n > 1 and logprobs are refused (400).
Unknown fields are ignored. Bad input is a 400 with an OpenAI-style error body, a full queue a 429
with Retry-After; SIGTERM stops admitting, ends the requests in flight and exits.
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
from assemble import (DTYPES, add_cache_flags, cache_format, cache_storage, kernels_for, load_checkpoint, load_tokenizer,
                      model_args, setup, solve_compression)
from decoding import compiled_decode_step, decode_step
from engine import Engine, QueueFull, Request, Stopped, run_alone
from kernels import KERNEL_CHOICES
from policies import add_attention_flags, attention_settings, describe_layers

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on `stop` strings


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


@dataclass
class Sampling:
    max_tokens: Optional[int]
    temperature: float
    top_k: Optional[int]
    stop: list[str]
    seed: Optional[int]
    stream: bool
    ignore_eos: bool  # vLLM's and llama-server's extension: run to max_tokens (load tests)


def read_sampling(body: dict, default_max_tokens: Optional[int]) -> Sampling:
    n = _field(body, "n", (int,), 1, lambda v: v >= 1, "a positive integer")
    if n != 1:
        raise BadRequest("n > 1 is not supported: send the request n times (with different seeds)", "n")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs are not supported", "logprobs")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return Sampling(
        max_tokens=_field(body, "max_tokens", (int,), default_max_tokens, lambda v: v > 0, "a positive integer"),
        temperature=float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_k=_field(body, "top_k", (int,), None, lambda v: v >= 1, "a positive integer"),
        stop=stop,
        seed=_field(body, "seed", (int,), None),
        stream=_field(body, "stream", (bool,), False),
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
    )


def read_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """/v1/completions' prompt: a string, a one-string list, or a list of token ids (each in the vocabulary)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
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
    return tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])


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
                             "waiting": len(served.engine.waiting)})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                                         "owned_by": "sparq-fast", **served.description}]})

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def generate(request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        try:
            sampling = read_sampling(body, None if chat else COMPLETIONS_MAX_TOKENS)
            prompt = read_messages(body, served.tokenizer) if chat else \
                read_prompt(body, served.tokenizer, served.engine.model.args.vocab_size)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        engine_request = Request(prompt=prompt, max_new_tokens=sampling.max_tokens or served.engine.max_seq_length,
                                 stop_ids=frozenset(() if sampling.ignore_eos else served.tokenizer.stop_ids),
                                 temperature=sampling.temperature,
                                 top_k=sampling.top_k, seed=sampling.seed,
                                 emit=lambda token, reason: loop.call_soon_threadsafe(events.put_nowait, (token, reason)))
        try:
            request_id = served.engine.submit(engine_request)
        except ValueError as e:  # an empty prompt, or one the context cannot hold (the engine's check)
            return error_response(400, str(e), param="messages" if chat else "prompt")
        except QueueFull as e:
            return error_response(429, f"busy: {e}; retry shortly", "rate_limit_error", headers={"Retry-After": "1"})
        except Stopped as e:
            return error_response(503, str(e), "server_error")
        reply = Reply(chat, served.model_name, len(prompt), TextOut(served.tokenizer, sampling.stop))
        if sampling.stream:
            return StreamingResponse(stream_events(served.engine, request_id, events, reply),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            text, reason = "", None
            while reason is None:
                token, finish = await events.get()
                piece, reason = reply.step(token, finish)
                text += piece
                if reason is not None and finish is None:  # a stop string: the engine can stop
                    served.engine.cancel(request_id)
        except asyncio.CancelledError:
            served.engine.cancel(request_id)
            raise
        return JSONResponse(reply.whole(text, reason))

    async def stream_events(engine: Engine, request_id: int, events: asyncio.Queue, reply: "Reply"):
        try:
            if reply.chat:
                yield sse(reply.chunk({"role": "assistant", "content": ""}, None))
            reason = None
            while reason is None:
                token, finish = await events.get()
                piece, reason = reply.step(token, finish)
                if piece:
                    yield sse(reply.chunk(piece, None))
            yield sse(reply.chunk("", reason, usage=True))
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client went away: either way the row is free
            engine.cancel(request_id)

    async def on_error(request, exc):  # never a traceback to the client
        if isinstance(exc, HTTPException):
            return error_response(exc.status_code, exc.detail)
        print(f"serve.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={Exception: on_error, HTTPException: on_error})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class Reply:
    """One request's answer in OpenAI's shapes, whole or as chunks."""

    chat: bool
    model: str
    prompt_tokens: int
    text: TextOut
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def step(self, token: Optional[int], finish: Optional[str]) -> tuple[str, Optional[str]]:
        """An engine event -> (text released, finish reason or None)."""
        if token is not None:
            piece = self.text.add(token)
            return piece, "stop" if self.text.stopped else None
        return self.text.finish(), finish

    def usage(self) -> dict:
        n = len(self.text.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def whole(self, text: str, reason: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
                "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunk(self, piece, reason: Optional[str], usage: bool = False) -> dict:
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
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
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="model.pth or its directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cli.non_negative_int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="rows decoding together")
    p.add_argument("--max-seq-length", type=cli.positive_int, default=None,
                   help="context per row: prompt + generated (default: the model's, at most 8192)")
    p.add_argument("--prefill-chunk", type=cli.positive_int, default=128,
                   help="prompt tokens prefilled between two decode steps (default 128: on 2 CPU cores a chunk "
                        "then costs about two decode steps, README)")
    p.add_argument("--max-queue", type=cli.positive_int, default=64,
                   help="requests waiting for a row before the server answers 429")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto")
    add_cache_flags(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    add_attention_flags(p)
    return p


def load(args: argparse.Namespace) -> Served:
    """The model, its policy and the engine (not started), from the flags; UserError for what cannot serve."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.checkpoint = args.checkpoint or data.DEFAULT_CHECKPOINT
    settings = attention_settings(args)
    config = model_args(args.checkpoint)
    if config.has_window_layers and args.max_batch_size > 1:
        raise UserError("this model has sliding-window layers, whose rows cannot hold different lengths: "
                        "serve it with --max-batch-size 1")
    max_seq_length = args.max_seq_length or min(config.max_context, 8192)
    if max_seq_length > config.max_context:
        raise UserError(f"--max-seq-length {max_seq_length} exceeds the model's context of {config.max_context}")
    length_bucket = 256 if args.device == "cuda" and args.compile else 1
    kernels = kernels_for(args.kernel, args.device, config, length_bucket, [cache_format(args)])
    model = load_checkpoint(args.checkpoint, args.device, DTYPES[args.dtype], kernels)
    tokenizer = load_tokenizer(args.checkpoint)
    settings = solve_compression(settings, max_seq_length, config, cache_storage(cache_format(args), model))
    setup(model, cache_format(args), settings, args.max_batch_size, max_seq_length, length_bucket)
    step = compiled_decode_step(decode_step, args.device) if args.compile else decode_step
    try:
        engine = Engine(model, max_seq_length, prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, decode=step)
    except ValueError as e:  # a policy with per-row state (H2O)
        raise UserError(f"cannot serve: {e}") from None
    name = Path(args.checkpoint).name if Path(args.checkpoint).is_dir() else Path(args.checkpoint).parent.name
    description = {"attention": describe_layers(model), "settings": {k: str(v) for k, v in vars(settings).items()
                                                                     if v is not None},
                   "max_batch_size": args.max_batch_size, "max_seq_length": max_seq_length,
                   "dtype": args.dtype, "device": args.device, "kernels": kernels.name}
    return Served(engine, tokenizer, name, description)


def warm_up(served: Served) -> float:
    """One short request through the engine before the port opens (compiles, allocates)."""
    start = time.perf_counter()
    prompt = served.tokenizer.encode_prompt("Hello")
    run_alone(served.engine, Request(prompt=prompt, max_new_tokens=4))
    return time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    served = load(args)
    warm_up(served)
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
