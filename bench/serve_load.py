"""python -m bench serve-load: a closed-loop load against serve.py (and, optionally, llama-server),
on the loopback interface only.

    python -m bench serve-load --clients 1,4,16 --prompt-tokens 512,4096 --new-tokens 128 --duration 60
    python -m bench serve-load --server-args "--sparq-r 16 --sparq-k 128" --clients 16 --prompt-tokens 4096
    python -m bench serve-load --url http://127.0.0.1:8000/v1 --clients 4 --prompt-tokens 512

With --conversations each client instead holds a chat whose history grows by a user turn and a reply
each turn (up to --history-tokens, then a new chat), llama-server with its prompt cache on: the TTFT
columns are then the follow-up turns', and "reused" the share of prompt tokens the server kept.

C clients each send their next request when the last one finished (streamed /v1/completions, a prompt
of N essay tokens at its own offset after a head of its own, "Request i.", so that no server reuses a
cached prefix; `max_tokens` new tokens with ignore_eos, greedy), for --duration
seconds; requests in flight then finish. Per (C, N): total decode throughput (generated tokens of every
request over the run's wall time), time to first token and inter-token latency (p50, p99: the gaps
between a request's streamed tokens), requests and failures. Without --url the server is started here
(serve.py on the embedded model, --max-batch-size = the largest C, --server-args added) and stopped
after; --llama-server also starts llama.cpp's server (bench/llamacpp.py builds it from the source
`bench decode --llamacpp` times; -np = the same rows, the embedded GGUF converted to --llama-format)
and the same load runs against both, taking turns at each (C, N).
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

import cli
from cli import UserError

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ---------------------------------------------------------------------------------------------
# One request, streamed
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    ttft_s: Optional[float] = None
    gaps_s: list[float] = field(default_factory=list)  # between successive streamed tokens
    error: str = ""
    text: str = ""  # what was streamed
    prompt_tokens: Optional[int] = None  # the usage's, where the server reports it
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens, where reported


def stream_completion(url: str, prompt: str | list[int], new_tokens: int, timeout: float = 600,
                      cache_prompt: bool = False) -> Outcome:
    """POST {url}/completions with stream: true (a text prompt, or token ids); time each server-sent chunk
    that carries text."""
    parsed = urlparse(url)
    body = json.dumps({"model": "any", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "cache_prompt": cache_prompt})  # llama-server's prompt cache: on for conversations only
    start = time.perf_counter()
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request("POST", parsed.path.rstrip("/") + "/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return Outcome(False, error=f"HTTP {response.status}: {response.read()[:200]!r}")
        out, last = Outcome(True), None
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = chunk["usage"]
                out.tokens = usage.get("completion_tokens", out.tokens)
                out.prompt_tokens = usage.get("prompt_tokens")
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            choices = chunk.get("choices") or [{}]
            out.text += choices[0].get("text") or ""
            if choices[0].get("text"):
                now = time.perf_counter()
                if last is None:
                    out.ttft_s = now - start
                else:
                    out.gaps_s.append(now - last)
                last = now
                if not chunk.get("usage"):
                    out.tokens = max(out.tokens, len(out.gaps_s) + 1)
        if out.ttft_s is None:
            return Outcome(False, error="no token streamed")
        return out
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return Outcome(False, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# The closed loop
# ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def closed_loop(url: str, prompts: list[str] | list[list[int]], clients: int, new_tokens: int, duration: float) -> dict:
    """`clients` threads, each sending its next prompt (round robin over `prompts`, from its own offset)
    when the last finished, until `duration` seconds have passed; then every request in flight finishes.
    Each request gets a head of its own (text "Request i. ", or token ids: i's digits as ids 10 + digit
    ahead of the prompt's ids) so that no server reuses another's cached prefix."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(c: int) -> None:
        i = c
        while time.perf_counter() - start < duration:
            # a head of its own: no server reuses another request's cached prefix (llama-server would)
            prompt = prompts[i % len(prompts)]
            head = f"Request {i}. " if isinstance(prompt, str) else [10 + int(c) for c in str(i)]
            outcome = stream_completion(url, head + prompt, new_tokens)
            i += clients
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [o for o in outcomes if o.ok]
    gaps = [g for o in done for g in o.gaps_s]
    ttft = [o.ttft_s for o in done]
    return dict(clients=clients, requests=len(outcomes), failed=len(outcomes) - len(done),
                errors=sorted({o.error for o in outcomes if not o.ok})[:3], wall_s=wall,
                tokens=sum(o.tokens for o in done), tokens_per_s=sum(o.tokens for o in done) / wall,
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99))


def conversation_loop(url: str, clients: int, turns: Callable[[int, int], list[int]], encode: Callable[[str], list[int]],
                      new_tokens: int, history_tokens: int, duration: float) -> dict:
    """`clients` threads, each holding a chat for `duration` seconds: each turn sends the history so far plus
    a user turn (turns(client, k): token ids, its k-th), streams `new_tokens` of reply, and appends both (the
    reply's text as `encode` tokenizes it) to the history; a history that would pass `history_tokens` starts a
    new conversation. Reports the generated tokens' throughput, the time to the first token of a conversation's
    first turn and of its follow-ups, the inter-token latency and the share of prompt tokens the server says it
    kept (usage.prompt_tokens_details.cached_tokens)."""
    outcomes: list[tuple[Outcome, bool]] = []  # (outcome, a follow-up turn)
    lock = threading.Lock()
    start = time.perf_counter()

    def client(c: int) -> None:
        history, k, follow_up = [], 0, False
        while time.perf_counter() - start < duration:
            prompt = history + turns(c, k)
            outcome = stream_completion(url, prompt, new_tokens, cache_prompt=True)
            k += 1
            with lock:
                outcomes.append((outcome, follow_up))
            history = prompt + encode(outcome.text)[:new_tokens] if outcome.ok else []
            follow_up = bool(history) and len(history) + len(turns(c, k)) + new_tokens <= history_tokens
            if not follow_up:
                history = []

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [(o, f) for o, f in outcomes if o.ok]
    gaps = [g for o, _ in done for g in o.gaps_s]
    prompts = sum(o.prompt_tokens or 0 for o, _ in done)
    cached = [o.cached_tokens for o, _ in done if o.cached_tokens is not None]
    return dict(clients=clients, requests=len(outcomes), failed=len(outcomes) - len(done),
                errors=sorted({o.error for o, _ in outcomes if not o.ok})[:3], wall_s=wall,
                tokens=sum(o.tokens for o, _ in done), tokens_per_s=sum(o.tokens for o, _ in done) / wall,
                ttft_p50_s=percentile([o.ttft_s for o, f in done if f], 50),
                ttft_p99_s=percentile([o.ttft_s for o, f in done if f], 99),
                first_turn_ttft_p50_s=percentile([o.ttft_s for o, f in done if not f], 50),
                itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
                follow_ups=sum(f for _, f in done), prompt_tokens_sent=prompts,
                reused_share=sum(cached) / prompts if cached and prompts else None)


def token_prompts(n_tokens: int, count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` different prompts of n_tokens random token ids in [20, vocab_size) (below 20: the heads'
    digits), for a server without a tokenizer (--random-weights)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(20, vocab_size) for _ in range(n_tokens)] for _ in range(count)]


def get_json(url: str, path: str) -> Optional[dict]:
    """GET {server}{path} as JSON, None if the server does not answer it (llama-server's differ)."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return None
    finally:
        conn.close()


def served_model(url: str) -> dict:
    """/v1/models' entry of the served model ({} where it says nothing): serve.py says "tokenizer": false
    under --random-weights, and its vocab_size."""
    models = get_json(url, urlparse(url).path.rstrip("/") + "/models") or {}
    return (models.get("data") or [{}])[0]


def server_decode_rate(before: Optional[dict], after: Optional[dict]) -> dict:
    """serve.py's own counters (/health) over a run: decode tokens per second of its decode steps' time
    (prefill excluded: a long prompt's prefill would otherwise hide what the decode step costs), and its
    prefill rate; {} for a server without them (llama-server)."""
    if not before or not after or "decode_s" not in after:
        return {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("decode_tokens", "decode_s", "decode_steps", "prefill_tokens",
                                                         "prefill_s", "prompt_tokens", "prefix_reused_tokens")}
    return {"server_decode_tokens_per_s": d["decode_tokens"] / d["decode_s"] if d["decode_s"] > 0 else None,
            "server_reused_share": d["prefix_reused_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else None,
            "server_decode_step_ms": 1e3 * d["decode_s"] / d["decode_steps"] if d["decode_steps"] else None,
            "server_rows_per_step": d["decode_tokens"] / d["decode_steps"] if d["decode_steps"] else None,
            "server_prefill_tokens_per_s": d["prefill_tokens"] / d["prefill_s"] if d["prefill_s"] > 0 else None}


def conversation_turns(text: bool, vocab_size: int, turn_tokens: int) -> tuple[Callable, Callable]:
    """(turns(client, k) -> the user turn's token ids, encode(reply text) -> its ids) for a conversation load:
    essay tokens of the embedded model's tokenizer, each client and turn at an offset of its own, the reply
    tokenized as both servers tokenize text (text: True), or random ids and a reply of token ids (a server
    without a tokenizer). A client's turn 0 starts with a head of its own ("Client c, chat k."), so no server
    reuses another conversation's prefix."""
    if text:
        import data
        import tokenizer as tokenizer_module

        tok = tokenizer_module.load_tokenizer(data.DEFAULT_CHECKPOINT)
        ids = data.essay_tokens(tok, 100_000)

        def turns(c: int, k: int) -> list[int]:
            at = (7919 * c + 811 * k) % (len(ids) - turn_tokens)
            head = tok.encode(f"Client {c}, turn {k}. ")
            return head + ids[at:at + turn_tokens - len(head)]

        return turns, tok.encode
    import random

    def random_turns(c: int, k: int) -> list[int]:
        rng = random.Random(1000 * c + k)
        return [rng.randrange(20, vocab_size) for _ in range(turn_tokens)]

    return random_turns, lambda reply: [int(t) for t in reply.split()]


def essay_prompts(n_tokens: int, count: int) -> list[str]:
    """`count` different prompts of n_tokens essay tokens each (the embedded model's tokenizer), at offsets
    far apart; each is decoded back to text, which both servers tokenize the same way."""
    import data
    import tokenizer as tokenizer_module

    tok = tokenizer_module.load_tokenizer(data.DEFAULT_CHECKPOINT)
    ids = data.essay_tokens(tok, n_tokens + 997 * count)
    return [tok.decode(ids[997 * i: 997 * i + n_tokens]) for i in range(count)]


# ---------------------------------------------------------------------------------------------
# Servers started here
# ---------------------------------------------------------------------------------------------


def last_lines(proc: subprocess.Popen, n: int = 3) -> list[str]:
    """The last lines a server started here wrote to stderr (its log file)."""
    proc.log.seek(0)
    return proc.log.read().strip().splitlines()[-n:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: Optional[subprocess.Popen], what: str, timeout: float = 1800) -> None:
    """Until /health says 200 and, for serve.py, that its compiled decode step serves (a load measured on
    the eager step it serves with while the compiled one builds would not be the server's speed)."""
    parsed = urlparse(url)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            said = last_lines(proc)
            raise UserError(f"{what} exited with status {proc.returncode} before answering"
                            + (f": {' | '.join(said)}" if said else ""))
        try:
            conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=5)
            conn.request("GET", "/health")
            response = conn.getresponse()
            health = json.loads(response.read() or b"{}") if response.status == 200 else None
            if health is not None and not str(health.get("decode_step", "")).startswith("eager, "):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise UserError(f"{what} did not answer /health within {timeout:.0f} s")


def start_ours(rows: int, context: int, extra: list[str]) -> tuple[str, subprocess.Popen]:
    """serve.py on a free port, its stderr in a temporary log (a pipe nobody reads could fill and stall
    it); a server that exits before answering is a UserError with the log's last lines."""
    port = free_port()
    cmd = [sys.executable, "serve.py", "--port", str(port), "--max-batch-size", str(rows),
           "--max-seq-length", str(context), *extra]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}/v1"
    wait_healthy(url, proc, "serve.py")
    return url, proc


def llama_server_command(server, gguf, port: int, rows: int, context: int, threads: int,
                         avoid_amx_tiles: bool) -> list[str]:
    """llama-server's command line: -np rows of `context` positions each (-c is their total).
    avoid_amx_tiles (bench/llamacpp.py's amx_tiles_avoided): --no-repack, without ggml's extra buffer
    types: the server batches several rows (and a prompt's tokens) in one matmul, where ggml's AMX
    tiles died with SIGILL on the CPU that saw it (bench decode avoids them the same way)."""
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(rows),
            "-c", str(rows * context), "-t", str(threads), *(["--no-repack"] if avoid_amx_tiles else [])]


def start_llama_server(rows: int, context: int, fmt: str, threads: int) -> tuple[str, subprocess.Popen, str]:
    """llama-server (bench/llamacpp.py's build, the source `bench decode --llamacpp` times) on the
    embedded GGUF in `fmt`: -np rows, each with `context` positions (-c is their total)."""
    import data
    from bench import llamacpp

    build = llamacpp.build(roles=("server",))
    gguf = llamacpp.requantize(data.DEFAULT_GGUF, fmt, build_=build)
    port = free_port()
    cmd = llama_server_command(build.tool("server"), gguf, port, rows, context, threads, llamacpp.amx_tiles_avoided())
    log = tempfile.TemporaryFile("w+")  # as start_ours's: llama-server logs every request, and a pipe nobody
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)  # reads stalled it when full
    proc.log = log
    url = f"http://127.0.0.1:{port}/v1"
    wait_healthy(url, proc, "llama-server")
    return url, proc, build.version


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    p = sub.add_parser("serve-load", help="closed-loop load against serve.py (and llama-server)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's base URL (loopback only), e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--server-args", default="", help="flags added to serve.py when it is started here")
    p.add_argument("--clients", default="1,4,16", help="comma list of concurrent clients (default 1,4,16)")
    p.add_argument("--prompt-tokens", default="512,4096", help="comma list of prompt lengths (default 512,4096)")
    p.add_argument("--new-tokens", type=cli.positive_int, default=128)
    p.add_argument("--conversations", action="store_true",
                   help="each client holds a chat: every turn sends the history so far and a user turn of "
                        "--turn-tokens, gets a reply of --new-tokens, until the history reaches --history-tokens "
                        "(then a new chat); reports follow-up TTFT and the share of prompt tokens reused")
    p.add_argument("--turn-tokens", type=cli.positive_int, default=200, help="a user turn's tokens (default 200)")
    p.add_argument("--history-tokens", type=cli.positive_int, default=8000,
                   help="a conversation's longest history before a new one starts (default 8000: the servers' rows "
                        "hold 64 positions more, within the embedded model's 8192)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each (C, N) keeps sending (default 60)")
    p.add_argument("--llama-server", action="store_true",
                   help="the same load against llama-server in the same run (the servers take turns at each C, N)")
    p.add_argument("--llama-format", default="bf16", help="llama-server's GGUF format (default bf16)")
    p.add_argument("--threads", type=cli.positive_int, default=2, help="llama-server's threads (default 2)")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    clients = cli.int_list(args.clients, "--clients")
    lengths = cli.int_list(args.prompt_tokens, "--prompt-tokens")
    if args.duration <= 0:
        raise UserError(f"--duration must be positive, got {args.duration}")
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK:
        raise UserError(f"--url must be a loopback address (this load generator stays on this machine), got {args.url}")
    rows, context = max(clients), max(lengths) + args.new_tokens + 64
    if args.conversations:
        lengths, context = [args.history_tokens], args.history_tokens + 64
    targets = []  # (label, url, process or None)
    if args.url:
        wait_healthy(args.url, None, "the server at --url")
        targets.append(("serve.py (given URL)", args.url, None))
    else:
        url, proc = start_ours(rows, context, shlex.split(args.server_args))
        targets.append((f"serve.py {args.server_args}".strip(), url, proc))
    results = []
    try:
        model = served_model(targets[0][1])
        text = model.get("tokenizer", True) is not False
        if not text and args.llama_server:
            raise UserError("--llama-server runs the embedded GGUF, and a server without a tokenizer (--random-weights) "
                            "does not: drop one of them")
        if args.conversations:
            turns, encode = conversation_turns(text, model.get("vocab_size", 0), args.turn_tokens)
        else:
            prompts = {n: essay_prompts(n, 2 * max(clients)) if text
                       else token_prompts(n, 2 * max(clients), model["vocab_size"]) for n in lengths}
        if args.llama_server:
            url, proc, version = start_llama_server(rows, context, args.llama_format, args.threads)
            targets.append((f"llama-server {version.split(' (')[0]} {args.llama_format}", url, proc))
        for n in lengths:
            for c in clients:
                for label, url, _ in targets:
                    print(f"{label}: C={c} N={n} ...", file=sys.stderr, flush=True)
                    before = get_json(url, "/health")
                    if args.conversations:
                        load = conversation_loop(url, c, turns, encode, args.new_tokens, args.history_tokens,
                                                 args.duration)
                    else:
                        load = closed_loop(url, prompts[n], c, args.new_tokens, args.duration)
                    row = dict(server=label, prompt_tokens=n, new_tokens=args.new_tokens, **load)
                    row.update(server_decode_rate(before, get_json(url, "/health")))
                    results.append(row)
                    print(format_row(row), file=sys.stderr, flush=True)
    finally:
        for _, _, proc in targets:
            if proc is not None:
                stop(proc)
    print(format_table(results))
    if args.json:
        cli.write_json(args.json, dict(rows=results, args={k: str(v) for k, v in vars(args).items() if k != "func"}))
    return 1 if any(r["failed"] for r in results) else 0


def ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def format_row(r: dict) -> str:
    return (f"  {r['tokens_per_s']:.1f} tok/s, TTFT p50/p99 {ms(r['ttft_p50_s'])}/{ms(r['ttft_p99_s'])} ms, "
            f"ITL p50/p99 {ms(r['itl_p50_s'])}/{ms(r['itl_p99_s'])} ms, {r['requests']} requests, {r['failed']} failed")


def format_table(rows: list[dict]) -> str:
    """The rows as a table; serve.py's own decode rate (server_decode_rate) where it reports one."""
    head = ["server", "C", "prompt", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "p99/p50", "requests", "failed", "decode tok/s", "step ms", "reused"]

    def num(x: Optional[float], spec: str) -> str:
        return "-" if x is None else format(x, spec)

    body = [[r["server"], r["clients"], r["prompt_tokens"], f"{r['tokens_per_s']:.1f}", ms(r["ttft_p50_s"]),
             ms(r["ttft_p99_s"]), ms(r["itl_p50_s"]), ms(r["itl_p99_s"]),
             f"{r['itl_p99_s'] / r['itl_p50_s']:.1f}" if r["itl_p50_s"] else "-", r["requests"], r["failed"],
             num(r.get("server_decode_tokens_per_s"), ".1f"), num(r.get("server_decode_step_ms"), ".1f"),
             num(r.get("reused_share") if r.get("reused_share") is not None else r.get("server_reused_share"), ".0%")]
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
             for line in [head] + body]
    return "\n".join(lines)
