"""An OpenAI-compatible server with continuous batching (engine.py) on one model.

    python serve.py --port 8000 --max-batch-size 8                      # the embedded model, dense
    python serve.py --port 8000 --max-batch-size 16 --sparq-r 16 --sparq-k 128
    python serve.py --checkpoint model.gguf --api-key KEY --metrics      # your own model; keyed; Prometheus
    python serve.py --random-weights llama-3.1-8b --max-batch-size 16 --max-seq-length 20480   # a GPU, no files
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 8}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text), and vLLM's POST /tokenize, POST /detokenize, GET
/tokenizer_info (lm-evaluation-harness tokenizes through them). `stream: true` answers in server-sent
events, OpenAI's chunk format. The fields each endpoint reads are openai_api.py's; any `model` name is
accepted and the served one (--served-model-name) reported. Bad input is a 400 with an OpenAI-style
error body, a missing or wrong key (--api-key) a 401, a full queue a 429 with Retry-After; SIGTERM stops
admitting, ends the requests in flight and exits.

The port opens at once: /health answers 503 {"status": "loading"} while the model loads, then 200. On a
machine where the fused CPU kernels were never built, they build in the background (at a lower priority)
while the torch kernels serve, and are taken between two engine steps once built. On the CPU the decode step
then serves eagerly while its
compiled programs (one per row bucket, engine.ROW_BUCKETS) build in a thread of their own, each said on
stderr; the engine takes them once all are built (/health's "decode_step" says which runs). Built
programs are cached on disk, so a later start loads them in seconds. On CUDA the step is captured in
CUDA graphs before /health says 200.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

import cli
import data
import tp
from assemble import (DTYPES, TokenIds, add_cache_flags, add_model_flags, allocate_caches, cache_format,
                      is_quantized_checkpoint, kernels_for, load_checkpoint, load_tokenizer, model_args,
                      solve_compression)
from budgets import Storage
from cli import UserError
from convert_hf_checkpoint import resolve_checkpoint
from decoding import COMPILE_BACKENDS, compiled_decode_step, decode_step, default_compile_backend
from engine import PREFILL_CHUNK, ROW_BUCKETS, STEP_TOKENS, Engine, QueueFull, Request, Stopped, run_alone
from kernels import ALL_CPU_BUILDS, KERNEL_CHOICES, batch_invariant_kernels, cpu_kernel_error, cpu_kernels_built
from model import ModelArgs, Transformer, checkpoint_paths, random_model
from openai_api import (BadRequest, Reply, TextOut, _field, check_context, read_messages, read_options, read_prompt,
                        sse)
from policies import add_attention_flags, attention_settings, describe_layers, install_policy, policy_factory

WARM_UP_SHORT, WARM_UP_LONG = 16, 1024  # the compiled step's live lengths: below and above SparQ's k (128 by default)
API_KEY_ENV = "SPARQ_FAST_API_KEY"  # --api-key's default: a key kept out of the process list
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (an orchestrator's probes), as vLLM does


# ---------------------------------------------------------------------------------------------
# What the handlers serve
# ---------------------------------------------------------------------------------------------


@dataclass
class Served:
    """What the endpoints need: the engine, its thread, the tokenizer, what /v1/models reports, the metrics."""

    engine: Engine
    tokenizer: object
    model_name: str
    description: dict
    metrics: Optional["Metrics"] = None
    leader: Optional[tp.Leader] = None  # under torchrun: rank 0's model, which sends each step to the other ranks
    thread: Optional[threading.Thread] = None
    decode_step: str = "eager"  # what the engine's step is: "eager", "compiling (n of m built)", or the backend

    def use_step(self, step: Callable) -> None:
        """The decode step the engine runs from its next step on (under torchrun, the one run on rank 0 after
        the step is sent: the other ranks run their own, tp.follow)."""
        if self.leader is not None:
            self.leader.step = step
        else:
            self.engine.decode = step

    def start(self) -> None:
        self.thread = threading.Thread(target=self.engine.run_forever, name="engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.engine.stop()
        if self.thread is not None:
            self.thread.join(timeout)
        if self.leader is not None:
            self.leader.stop()


class Metrics:
    """The Prometheus series of one server (prometheus_client, a registry of its own): requests, tokens in and
    out, queue depth, rows in use, time to first token, inter-token latency and each request's whole time."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.requests = Counter("sparq_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=registry)
        self.prompt_tokens = Counter("sparq_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generated_tokens = Counter("sparq_generation_tokens", "Tokens generated", registry=registry)
        self.prefix_hits = Counter("sparq_prefix_cache_hits", "Requests that kept a prefix of an earlier prompt",
                                   registry=registry)
        self.cached_tokens = Counter("sparq_prefix_cached_tokens", "Prompt tokens served from a kept prefix",
                                     registry=registry)
        queue = Gauge("sparq_queue_depth", "Requests waiting for a cache row", registry=registry)
        queue.set_function(lambda: len(engine.waiting))
        rows = Gauge("sparq_rows_in_use", "Cache rows holding a request", registry=registry)
        rows.set_function(lambda: engine.busy_rows)
        seconds = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("sparq_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=seconds, registry=registry)
        self.itl = Histogram("sparq_inter_token_latency_seconds", "Between a request's successive tokens",
                             buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
                             registry=registry)
        self.e2e = Histogram("sparq_request_seconds", "From a request's arrival to its last token", buckets=seconds,
                             registry=registry)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


@dataclass
class Timing:
    """One request's clock for the metrics: its arrival, its last token."""

    start: float = field(default_factory=time.perf_counter)
    last: Optional[float] = None

    def event(self, event: tuple, metrics: Optional[Metrics]) -> None:
        """An engine event (Reply.step's): a token's latency observed, an admission's kept prefix counted."""
        kind = event[0]
        if kind == "admitted":
            if metrics is not None and event[1]:
                metrics.prefix_hits.inc()
                metrics.cached_tokens.inc(event[1])
            return
        if kind is None or kind == "prompt":
            return
        now = time.perf_counter()
        if metrics is not None:
            (metrics.ttft if self.last is None else metrics.itl).observe(now - (self.start if self.last is None else self.last))
            metrics.generated_tokens.inc()
        self.last = now


# ---------------------------------------------------------------------------------------------
# Handlers: each reads the app's state (request.app.state: served, None while loading; api_key)
# ---------------------------------------------------------------------------------------------


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                   headers: Optional[dict] = None, code: Optional[str] = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


async def json_body(request) -> dict:
    """The request's JSON object, or BadRequest."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def serving(request) -> Served:
    """The served model; LoadingError (a 503) while it loads."""
    served = request.app.state.served
    if served is None:
        raise LoadingError(request.app.state.loading)
    return served


class LoadingError(Exception):
    """A request before the model is ready: a 503 saying what is under way."""


async def health(request):
    from starlette.responses import JSONResponse

    served = request.app.state.served
    if served is None:
        return JSONResponse({"status": "loading", "detail": request.app.state.loading}, 503)
    engine = served.engine
    return JSONResponse({"status": "ok", "decode_step": served.decode_step, "kernels": served.description["kernels"],
                         "busy_rows": engine.busy_rows,
                         "waiting": len(engine.waiting), **engine.stats})


async def metrics(request):
    from starlette.responses import Response

    served = request.app.state.served
    if served is None or served.metrics is None:
        why = "loading" if served is None else "started without --metrics"
        return error_response(503 if served is None else 404, f"no metrics: the server is {why}", "server_error")
    return Response(served.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def models(request):
    from starlette.responses import JSONResponse

    served = serving(request)
    return JSONResponse({"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                                     "owned_by": "sparq-fast", **served.description}]})


async def tokenizer_info(request):
    """vLLM's tokenizer endpoint, what lm-evaluation-harness's "remote" tokenizer reads."""
    from starlette.responses import JSONResponse

    served = serving(request)
    tokenizer = served.tokenizer
    if isinstance(tokenizer, TokenIds):
        return error_response(404, "random weights have no tokenizer")
    names = {i: text for text, i in tokenizer.special_tokens.items()}
    return JSONResponse({"eos_token": names.get(tokenizer.eos_id), "bos_token": names.get(tokenizer.bos_id),
                         "pad_token": None, "chat_template": tokenizer.chat_template,
                         "model_max_length": served.engine.max_seq_length, "tokenizer_class": type(tokenizer).__name__})


async def tokenize(request):
    """{"prompt": text, "add_special_tokens": true} -> {"tokens", "count", "max_model_len"}: the ids this
    server runs, special-token strings as their ids (BOS first when the tokenizer adds one and asked)."""
    from starlette.responses import JSONResponse

    served = serving(request)
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
    tokenizer = served.tokenizer
    ids = ([tokenizer.bos_id] if special and tokenizer.add_bos else []) + tokenizer.encode_with_special_tokens(text)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_seq_length})


async def detokenize(request):
    from starlette.responses import JSONResponse

    served = serving(request)
    body = await json_body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    return JSONResponse({"prompt": served.tokenizer.decode(tokens)})


async def completions(request):
    return await generate(request, chat=False)


async def chat_completions(request):
    return await generate(request, chat=True)


async def generate(request, chat: bool):
    """A completion or a chat completion: the request read (openai_api), submitted to the engine, and its
    events turned into the reply, whole or streamed."""
    from starlette.responses import JSONResponse, StreamingResponse

    served = serving(request)
    engine, tokenizer = served.engine, served.tokenizer
    body = await json_body(request)
    options = read_options(body, chat, engine.model.args.vocab_size)
    prompt = read_messages(body, tokenizer) if chat else read_prompt(body, tokenizer, engine.model.args.vocab_size)
    check_context(prompt, options, engine.max_seq_length, chat)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    reply = Reply(chat, served.model_name, prompt, TextOut(tokenizer, options.stop), tokenizer, options.echo,
                  options.logprobs)
    max_new = options.max_tokens if options.max_tokens is not None else engine.max_seq_length - len(prompt)
    submitted = Request(prompt=prompt, max_new_tokens=max_new,
                        stop_ids=frozenset(() if options.ignore_eos else tokenizer.stop_ids),
                        sampling=options.sampling, seed=options.seed, logprobs=options.logprobs,
                        echo_logprobs=options.echo and options.logprobs is not None,
                        emit=lambda token, reason, logprob=None: loop.call_soon_threadsafe(
                            events.put_nowait, (token, reason, logprob)),
                        emit_prompt=lambda logprobs: loop.call_soon_threadsafe(
                            events.put_nowait, ("prompt", None, logprobs)),
                        emit_admitted=lambda cached: loop.call_soon_threadsafe(
                            events.put_nowait, ("admitted", cached, None)))
    try:
        request_id = engine.submit(submitted)
    except ValueError as e:  # the engine's own check of the prompt
        raise BadRequest(str(e), "messages" if chat else "prompt") from None
    except QueueFull as e:
        return error_response(429, f"busy: {e}; retry shortly", "rate_limit_error", headers={"Retry-After": "1"})
    except Stopped as e:
        return error_response(503, str(e), "server_error")
    if served.metrics is not None:
        served.metrics.prompt_tokens.inc(len(prompt))
    timing = Timing()
    if options.stream:
        return StreamingResponse(stream_events(served, request_id, events, reply, options.include_usage, timing),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        reason = None
        while reason is None:
            event = await events.get()
            timing.event(event, served.metrics)
            reason = reply.step(*event)
            if reason is not None and event[1] is None:  # a stop string: the engine can stop
                engine.cancel(request_id)
    except asyncio.CancelledError:
        engine.cancel(request_id)
        raise
    finished(served, timing)
    return JSONResponse(reply.whole(reason))


async def stream_events(served: Served, request_id: int, events: asyncio.Queue, reply: Reply, include_usage: bool,
                        timing: Timing):
    """The server-sent events of a streamed reply: chunks as text is released, the finish, with
    include_usage a last chunk of the usage alone (OpenAI's), then [DONE]."""
    try:
        if reply.chat:
            yield sse(reply.chunk(None, {"role": "assistant", "content": ""}, include_usage))
        reason = None
        while reason is None:
            event = await events.get()
            timing.event(event, served.metrics)
            reason = reply.step(*event)
            piece = reply.pending()
            if piece is not None:
                yield sse(reply.chunk(None, piece, include_usage))
        yield sse(reply.chunk(reason, reply.pending() or reply.empty_piece(), include_usage))
        if include_usage:
            yield sse(reply.usage_chunk())
        yield "data: [DONE]\n\n"
        finished(served, timing)
    finally:  # finished, or the client went away: either way the row is free
        served.engine.cancel(request_id)


def finished(served: Served, timing: Timing) -> None:
    if served.metrics is not None:
        served.metrics.e2e.observe(time.perf_counter() - timing.start)


async def on_error(request, exc):
    """Every failure as an OpenAI-style error body, never a traceback to the client."""
    from starlette.exceptions import HTTPException

    if isinstance(exc, BadRequest):
        return error_response(400, str(exc), param=exc.param)
    if isinstance(exc, LoadingError):
        return error_response(503, f"the model is loading: {exc}", "server_error", headers={"Retry-After": "2"})
    if isinstance(exc, HTTPException):
        return error_response(exc.status_code, exc.detail)
    print(f"serve.py: {type(exc).__name__}: {exc}", file=sys.stderr)
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


def counted(endpoint: str, handler: Callable) -> Callable:
    """handler, its outcomes counted in the metrics (by status class) once the model serves."""
    async def wrapped(request):
        try:
            response = await handler(request)
        except Exception as exc:
            response = await on_error(request, exc)
        served = request.app.state.served
        if served is not None and served.metrics is not None:
            served.metrics.requests.labels(endpoint, f"{response.status_code // 100}xx").inc()
        return response

    return wrapped


class APIKey:
    """--api-key: every path but OPEN_PATHS needs `Authorization: Bearer KEY` (a 401 otherwise, as vLLM and
    llama-server answer). A plain ASGI middleware: streamed replies pass through untouched."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "a missing or wrong API key: send 'Authorization: Bearer KEY'",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


ENDPOINTS = (("/health", health, ["GET"]), ("/metrics", metrics, ["GET"]), ("/v1/models", models, ["GET"]),
             ("/tokenizer_info", tokenizer_info, ["GET"]), ("/tokenize", tokenize, ["POST"]),
             ("/detokenize", detokenize, ["POST"]), ("/v1/completions", completions, ["POST"]),
             ("/v1/chat/completions", chat_completions, ["POST"]))


def build_app(served: Optional[Served] = None, api_key: Optional[str] = None, loading: str = "starting"):
    """The Starlette application: ENDPOINTS, the API key where one is set. served None: loading (every
    endpoint but /health answers 503 until app.state.served is set)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    routes = [Route(path, counted(path, handler), methods=methods) for path, handler, methods in ENDPOINTS]
    middleware = [Middleware(APIKey, key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: on_error})
    app.state.served, app.state.loading = served, loading
    return app


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, "no tokenizer either: prompts are token ids, replies their token ids (a GPU machine carries "
                       "no files)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cli.non_negative_int, default=8000, help="0: any free port (printed)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name /v1/models and every reply report (default: the checkpoint's directory)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                        f"(default: ${API_KEY_ENV}, else none)")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="Prometheus text at /metrics (default; --no-metrics: none)")
    p.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="rows decoding together")
    p.add_argument("--max-seq-length", type=cli.positive_int, default=None,
                   help="context per row: prompt + generated (default: the model's, at most 8192)")
    p.add_argument("--step-tokens", type=cli.positive_int, default=STEP_TOKENS,
                   help=f"tokens a step carries: one per decoding row, then prompt pieces while they fit (default "
                        f"{STEP_TOKENS}; vLLM's chunked-prefill budget)")
    p.add_argument("--prefill-chunk", type=cli.positive_int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill piece, one forward pass each (default {PREFILL_CHUNK})")
    p.add_argument("--reuse-replies", action=argparse.BooleanOptionalAction, default=False,
                   help="a chat's next turn keeps its earlier replies' cached positions too, not only the prompts' "
                        "(less prefill per turn; those positions hold what decode wrote, its rounding and a sparse "
                        "policy's approximation, so a warm reply is one session's, not its cold run's: docs/serving.md)")
    p.add_argument("--max-queue", type=cli.positive_int, default=64,
                   help="requests waiting for a row before the server answers 429")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--threads", type=cli.positive_int, default=None,
                   help="torch threads (default: torch's, one per core)")
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto")
    add_cache_flags(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step, one per row bucket (default; --no-compile: eager)")
    p.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=None,
                   help="default: aot on the CPU (built ahead of time in the background, cached across runs), "
                        "inductor's CUDA graphs on CUDA")
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


@dataclass
class Plan:
    """What the flags ask for, checked before the port opens (a user error exits at once, in one line)."""

    settings: object  # the attention settings, a --compression target solved
    config: ModelArgs
    max_seq_length: int
    length_bucket: int
    kv_format: object


def plan(args: argparse.Namespace) -> Plan:
    """The flags checked and the device defaults set, from the checkpoint's config alone (nothing loaded)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # aot builds one process's step; under torchrun every rank compiles its own (inductor)
    args.compile_backend = args.compile_backend or (default_compile_backend(args.device) if tp.world_size() == 1
                                                    else "inductor")
    if args.compile_backend == "aot" and args.device == "cuda":
        raise UserError("--compile-backend aot builds the CPU step; on CUDA the step is captured in CUDA graphs (inductor)")
    if args.compile_backend == "aot" and tp.world_size() > 1:
        raise UserError("--compile-backend aot builds one process's CPU step; under torchrun each rank compiles its "
                        "own: --compile-backend inductor (the default there) or --no-compile")
    if not args.random_weights:  # a .gguf file or an HF directory: converted once, beside it
        args.checkpoint = resolve_checkpoint(args.checkpoint or data.DEFAULT_CHECKPOINT)
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
    # the budget in the bytes the cache will store: activations in --dtype (quantized weights dequantize to it)
    settings = solve_compression(settings, max_seq_length, config, Storage(kv_format, DTYPES[args.dtype]))
    try:
        probe = policy_factory(settings, config)(config.n_layer - 1)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not probe.follows_rows:  # rows come and go: a policy with per-row state it cannot roll back cannot serve
        raise UserError(f"cannot serve {settings.policy} attention: it keeps per-row state its decode steps build "
                        f"up, which the server's row operations (a row freed and refilled) would leave stale")
    return Plan(settings, config, max_seq_length, length_bucket, kv_format)


def server_kernels(choice: str, args: argparse.Namespace, planned: Plan):
    # rows come and go between steps: a row's result must not depend on its neighbours
    return batch_invariant_kernels(kernels_for(choice, args.device, planned.config, planned.length_bucket,
                                               [planned.kv_format]))


def load_model(args: argparse.Namespace, planned: Plan, kernel: Optional[str] = None):
    """(the model, with this rank's shard under torchrun, its caches allocated and its policy installed; the
    tokenizer; the served name; the kernels): what every rank of a server loads. kernel: --kernel's choice
    unless given."""
    settings, config, kv_format = planned.settings, planned.config, planned.kv_format
    kernels = server_kernels(kernel or args.kernel, args, planned)
    if args.random_weights:
        model, tokenizer = random_model(config, args.device, DTYPES[args.dtype], kernels), TokenIds()
        name = args.random_weights
    else:
        model = load_checkpoint(args.checkpoint, args.device, DTYPES[args.dtype], kernels)
        tokenizer = load_tokenizer(args.checkpoint)
        path = Path(args.checkpoint)
        name = path.name if path.is_dir() else path.parent.name
    tp.maybe_shard(model, args.device)  # under torchrun: this rank's KV heads (tp.py)
    allocate_caches(model, kv_format, args.max_batch_size, planned.max_seq_length, planned.length_bucket)
    install_policy(model, settings)
    return model, tokenizer, name, kernels


def load(args: argparse.Namespace, planned: Plan, kernel: Optional[str] = None) -> Served:
    """The model, its policy and the engine (not started) on the eager step; UserError for what cannot serve.
    Under torchrun, rank 0's: its engine steps the other ranks through a tp.Leader. kernel: as load_model's."""
    settings, config = planned.settings, planned.config
    model, tokenizer, name, kernels = load_model(args, planned, kernel)
    leader = tp.Leader(model, decode_step) if tp.world_size() > 1 else None
    engine = Engine(leader or model, planned.max_seq_length, prefill_chunk=args.prefill_chunk,
                    step_tokens=args.step_tokens, max_queue=args.max_queue, reuse_replies=args.reuse_replies,
                    decode=leader.decode_step if leader else decode_step)
    description = {"attention": describe_layers(model), "settings": public_settings(settings, args.checkpoint),
                   "max_batch_size": args.max_batch_size, "max_seq_length": planned.max_seq_length,
                   "step_tokens": args.step_tokens, "prefill_chunk": args.prefill_chunk,
                   "reuse_replies": args.reuse_replies,
                   "dtype": args.dtype, "device": args.device, "kernels": kernels.name,
                   "compiled": args.compile_backend if args.compile else None,
                   "tokenizer": not isinstance(tokenizer, TokenIds), "vocab_size": config.vocab_size,
                   "tensor_parallel": tp.world_size()}
    return Served(engine, tokenizer, args.served_model_name or name, description,
                  Metrics(engine) if args.metrics else None, leader=leader)


def fused_build_pending(args: argparse.Namespace, planned: Plan) -> bool:
    """Loading would wait minutes for the fused CPU kernels' first build (169 s on two Zen 3 cores): --kernel
    auto on the CPU, one process, exact lengths, a float checkpoint (a quantized one packs its weights for the
    kernels it loads with), either build missing on this machine (both build beside serving). The server then serves on the torch kernels
    while they build (use_fused_kernels)."""
    if args.kernel != "auto" or args.device != "cpu" or tp.world_size() > 1 or planned.length_bucket > 1:
        return False
    if args.compile and args.compile_backend != "aot":  # inductor's step is built before serving, on the kernels
        return False
    if cpu_kernels_built(ALL_CPU_BUILDS):  # every start but a machine's first: decided without opening the checkpoint
        return False
    return bool(args.random_weights) or not is_quantized_checkpoint(args.checkpoint)


BUILD_NICENESS = 10  # the builds beside serving: their compilers yield the cores to the engine's steps


def build_at_low_priority(build: Callable[[], object]) -> None:
    """build() on this thread at a lower priority: on Linux a thread's niceness is its own, and the compilers
    it starts inherit it, so the requests served meanwhile keep the cores (the model loads beside the build:
    /health's 200 at 29 s became 13 s on two Zen 3 cores). For a build whose work is in child processes only:
    a niced thread that holds the GIL makes the engine wait (the AOT build's took a 16-token reply to 34 s)."""
    try:
        os.nice(BUILD_NICENESS)
    except OSError:  # not permitted: build at the same priority
        pass
    build()


def use_fused_kernels(served: Served, args: argparse.Namespace, planned: Plan) -> bool:
    """The fused CPU kernels, once built, taken between two engine steps: the model's linears and prefill
    attention, its policies made again (they bind their kernels when made); the free rows' kept prefixes are
    dropped (other kernels wrote them: a warm request computes what a cold one does). False where they could not
    be built (said; the torch kernels serve on)."""
    kernels = server_kernels("auto", args, planned)  # loads the build the background thread made
    if kernels.name != "cpu":
        return False
    model, engine = served.engine.model, served.engine

    def swap() -> None:
        model.use_kernels(kernels)
        install_policy(model, planned.settings)
        engine.forget_prefixes()

    engine.run_between_steps(swap)
    served.description["kernels"] = kernels.name
    served.description["attention"] = describe_layers(model)
    return True


def warm_up_lengths(engine: Engine) -> list[int]:
    """The live lengths the compiled steps are built at: one on each side of SparQ's k (its two programs)."""
    longest = engine.max_seq_length - 2
    return sorted({min(WARM_UP_SHORT, longest), min(WARM_UP_LONG, longest)})


def shadow_copy(model: Transformer) -> Transformer:
    """A copy of the model's modules sharing every tensor with it: export traces the copy (swapping its
    attributes for fake tensors while it does), so the model itself, which the engine steps meanwhile, is
    never touched; the programs built on it read and write the model's own tensors."""
    shared = {id(t): t for module in model.modules()
              for t in [*module._parameters.values(), *module._buffers.values(),
                        *(v for v in vars(module).values() if isinstance(v, torch.Tensor))] if t is not None}
    return copy.deepcopy(model, shared)


BUILD_SWITCH_INTERVAL_S = 2e-4  # the interpreter's switch interval while the compiled step builds beside serving


def build_in_background(served: Served, say: Callable[[str], None]) -> None:
    """The CPU's compiled decode step (AOTDecodeStep), each row bucket's programs built on a shadow copy of the
    model while the engine serves eagerly, then swapped in (the engine reads its step at every step)."""
    engine = served.engine
    model = engine.model
    compiled = compiled_decode_step(decode_step, "cpu", "aot")
    buckets = sorted({min(b, len(engine.rows)) for b in ROW_BUCKETS if b <= len(engine.rows)} | {len(engine.rows)})
    lengths = warm_up_lengths(engine)
    shadow = shadow_copy(model)
    total, done = len(buckets) * len(lengths), 0
    start = time.perf_counter()
    # The build's Python (export, inductor's code generation) and the engine's eager ops share the interpreter:
    # each op gives the GIL up while it runs and then waits up to the switch interval to take it back, so at the
    # default 5 ms the eager step crawled beside the build (docs/NOTES.md, "The first ten minutes").
    interval = sys.getswitchinterval()
    sys.setswitchinterval(BUILD_SWITCH_INTERVAL_S)
    try:
        for n in buckets:
            for length in lengths:
                served.decode_step = f"eager, the compiled step building ({done} of {total} done)"
                tokens = torch.zeros((n, 1), dtype=torch.long)
                positions = torch.full((n, 1), length)
                what = compiled.prepare(model, tokens, positions, model.read_length(length + 1), build_on=shadow)
                done += 1
                say(f"decode step {done} of {total} ready ({n} row{'s' * (n > 1)}, live length {length}): {what}")
    finally:
        sys.setswitchinterval(interval)
    served.use_step(compiled)
    served.decode_step = "aot"
    say(f"the compiled decode step serves from now on ({time.perf_counter() - start:.0f} s; {compiled.summary()})")


def warm_up_in_place(served: Served, backend: str) -> float:
    """CUDA (or --compile-backend inductor): the compiled step built and captured on the idle engine, every row
    bucket at each warm-up length (Engine.warm_up), then one short request end to end, before any request."""
    engine = served.engine
    start = time.perf_counter()
    served.use_step(compiled_decode_step(decode_step, engine.model.device.type, backend))
    if not engine.model.args.has_window_layers:  # (window layers' caches cannot hold rows of set lengths; one row)
        engine.warm_up(warm_up_lengths(engine))
    run_alone(engine, Request(prompt=[1, 2, 3], max_new_tokens=2))
    served.decode_step = backend
    return time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


def say(line: str) -> None:
    print(f"serve.py: {line}", file=sys.stderr, flush=True)


def prepare_in_background(args: argparse.Namespace, planned: Plan, app, server, failure: list) -> None:
    """The loading thread: the model and its engine, then the ready line; then the compiled step (CPU: in a
    thread of its own while requests are served eagerly). A failure is said in one line and stops the server."""
    try:
        builder = None
        if fused_build_pending(args, planned):  # built beside serving: the torch kernels serve meanwhile
            builder = threading.Thread(target=build_at_low_priority,  # both builds: a SparQ policy binds SparQ's
                                       args=(partial(cpu_kernel_error, ALL_CPU_BUILDS),), name="fused-kernels",
                                       daemon=True)
            builder.start()
            app.state.loading = "loading the model (the fused CPU kernels build beside it, once per machine)"
        else:
            app.state.loading = "loading the model"
        served = load(args, planned, "torch" if builder else None)
        for i in range(len(served.engine.rows)):  # the rows as serving leaves them (ragged): the compiled
            served.engine.model.reset_row(i)  # steps are built on what they will run
        if args.compile and args.compile_backend != "aot":
            app.state.loading = f"compiling the decode step ({args.compile_backend})"
            say(f"compiling the decode step ({args.compile_backend}) for each row bucket up to "
                f"{args.max_batch_size} rows...")
            say(f"warm-up {warm_up_in_place(served, args.compile_backend):.0f} s")
        served.start()
        app.state.served = served
        say(f"ready: {served.model_name} ({served.description['attention']}; {args.max_batch_size} rows x "
            f"{served.engine.max_seq_length} positions, {args.dtype} on {args.device}, decode step "
            f"{served.decode_step})")
        if builder is not None:
            say("serving on the torch kernels while the fused CPU kernels build (once per machine; a few minutes "
                "on two cores)...")
            start = time.perf_counter()
            builder.join()
            if use_fused_kernels(served, args, planned):
                say(f"the fused CPU kernels serve from now on (built in {time.perf_counter() - start:.0f} s more)")
        if args.compile and args.compile_backend == "aot":
            say(f"building the compiled decode step in the background, one program per row bucket up to "
                f"{args.max_batch_size} rows (requests are served eagerly meanwhile)...")
            build_in_background(served, say)  # not niced: its thread holds the GIL the engine waits for
    except UserError as e:
        failure.append(e)
        server.should_exit = True
    except Exception as e:  # a failure while loading: said in one line, the server stops
        failure.append(UserError(f"loading failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        server.should_exit = True


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    planned = plan(args)
    if tp.rank() > 0:  # under torchrun: rank 0 speaks HTTP, the others make its engine's calls on their shards
        return follow_rank_0(args, planned)
    app = build_app(api_key=args.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: admit nothing more, end what is in flight
            if app.state.served is not None:
                app.state.served.engine.stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="off")
    server = Server(config)
    failure: list = []
    loader = threading.Thread(target=prepare_in_background, args=(args, planned, app, server, failure),
                              name="loading", daemon=True)
    # uvicorn re-raises SIGTERM once its graceful shutdown is over, under the handler found at start:
    # by then every request has ended, so that handler does nothing and the process exits with 0
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    asyncio.run(_serve_and_report(server, args, loader))
    if app.state.served is not None:
        app.state.served.stop()
    tp.shutdown()
    if failure:
        raise failure[0]
    return 0


def follow_rank_0(args: argparse.Namespace, planned: Plan) -> int:
    """A rank other than 0 of a tensor-parallel server: its shard loaded as rank 0 loads its own, then every call
    rank 0's engine sends made here (tp.follow) until rank 0 stops."""
    model = load_model(args, planned)[0]
    step = compiled_decode_step(decode_step, args.device, args.compile_backend) if args.compile else decode_step
    try:
        tp.follow(model, step)
    finally:
        tp.shutdown()
    return 0


async def _serve_and_report(server, args, loader: threading.Thread) -> None:
    """Serve; once listening, print the address (the port the OS chose for --port 0) and start loading."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        say(f"listening on http://{args.host}:{port}/v1 (/health says 503 'loading' until the model serves)")
        loader.start()
    await task


if __name__ == "__main__":
    sys.exit(main())
