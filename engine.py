"""Continuous batching on the static cache: the scheduler behind serve.py.

The caches hold `max_batch` rows. A request waits in a queue for a free row, is prefilled into it, then
decodes with the other decoding rows, each at its own position; a finished or cancelled request frees its
row at once.

Prefix reuse: a freed row remembers the ids of the prompt its cache holds. A new request takes the free row
whose prompt shares the longest prefix with its own (compared as token ids, not text), least recently used
among equals, keeps that prefix rounded down to a multiple of `prefill_chunk` (prompt pieces end at those
multiples whatever the prompt's length: decoding.chunk_ends) and prefills only the rest. The row then holds
what a cold prefill of the new prompt would write, bit for bit, its running sums included
(KVCache.keep_prefix sums them again in the same pieces), so a warm request's tokens are its cold run's.
By default only prefilled positions are kept: a chat's earlier reply, written by decode steps, holds a
decode step's rounding, not a prefill's, and is prefilled again as part of the next turn. With
`reuse_replies` a freed row remembers its reply's ids too and a next turn keeps the positions decode wrote:
less prefill for every follow-up, but the kept reply then holds what decode wrote, its rounding (dense: in
fp32 the tokens stayed a cold run's, in bf16 not always) and under a sparse policy its approximation past
the first layer, so a warm request is what one uninterrupted session on the row writes, not its cold run
(docs/serving.md measures both). Requests that score their prompt (echo with logprobs) prefill it whole.

A step carries at most `step_tokens` tokens (vLLM's chunked-prefill rule): one for each decoding
row, then prompt pieces of the oldest prefilling requests while the budget lasts (at least one piece
while a prompt waits, so prefill always advances). While prompts wait, every step carries about the
same work, so the decoding rows' tokens keep an even pace; with none waiting, a step is a decode step
alone. Prompts are cut at fixed places, at the multiples of `prefill_chunk` as decoding.prefill cuts
them, whatever the load: a piece is one forward pass.

A decode step computes only the first n rows, n the smallest of ROW_BUCKETS holding every decoding
row. A row inside the bucket that
is not decoding (free, or still prefilling) computes a token nobody reads, written at its own live
length and truncated away after the step. The buckets bound the compiled steps: one per bucket.

Each row's arithmetic is its own: the decode GEMVs compute each row alone (kernels.linear_cpu, the
same bits for any row count up to 16), the fused attention kernels split a row's positions by its own
length (csrc/parallel.h), and each request samples with its own torch.Generator (its `seed`). So a
greedy request is token for token its solo run, and a sampled one depends on its seed alone, whatever
else is in the batch (tests/test_serve.py). The engine runs in one thread (`run_forever`); `submit`
and `cancel` may be called from any other, and a request's events reach its callbacks from the
engine's.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from decoding import chunk_ends, decode_step
from model import Transformer
from sampling import GREEDY, Sampling, TokenHistory, sample

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows a decode step computes: the first n of the cache
# Prompt tokens per prefill piece (one forward pass). Half the step's budget: torch's CPU GEMM runs
# 256-row pieces faster than 128-row ones (which also widen bf16 weights more often), and beside decoding
# rows a step carries one piece, half of a 512-token one's cost, so the decoding rows' tokens keep an even
# pace at the same throughput (docs/NOTES.md, 'Figures behind the code's choices'; docs/serving.md).
PREFILL_CHUNK = 256
STEP_TOKENS = 512  # tokens per step: the decoding rows' plus prompt pieces


def row_bucket(rows: int, max_batch: int) -> int:
    """The rows a decode step computes when its decoding rows are among the first `rows`: the smallest
    bucket holding them, at most the cache's max_batch."""
    return min(next((b for b in ROW_BUCKETS if b >= rows), rows), max_batch)


class QueueFull(Exception):
    """submit() while `max_queue` requests already wait for a row."""


class Stopped(Exception):
    """submit() after stop(): the engine admits nothing more."""


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its logits, whatever the sampling
    temperature), and the `top` most likely tokens at that position with theirs, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Request:
    """What to generate. stop_ids end it (the stop token is reported, not returned); max_new_tokens
    counts the generated tokens (0: the prompt is only scored, with echo_logprobs); sampling: how each token
    is chosen (sampling.py; greedy by default); seed: its draws' own random stream (None: random)."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: Sampling = GREEDY
    seed: Optional[int] = None
    logprobs: Optional[int] = None  # each generated token's TokenLogprob with this many alternatives (None: none)
    echo_logprobs: bool = False  # the prompt's own TokenLogprobs too (its first token has none)
    # emit(token or None, finish_reason or None, TokenLogprob or None): a token as it comes (with its
    # logprob when asked), then (None, reason, logprob) once at the end: "stop" (a stop token, whose
    # TokenLogprob comes with it when logprobs are asked, or cancel()), "length" (max_new_tokens or the
    # context), "shutdown", "error" (a step failed: run_forever ends the requests in the rows and goes on)
    emit: Callable[[Optional[int], Optional[str], Optional[TokenLogprob]], None] = \
        lambda token, reason, logprob=None: None
    # emit_prompt([None, TokenLogprob, ...]): once, when the prompt is prefilled (echo_logprobs only)
    emit_prompt: Callable[[list[Optional[TokenLogprob]]], None] = lambda logprobs: None
    # emit_admitted(cached): once, when the request takes a row: how many prompt tokens its cache kept
    emit_admitted: Callable[[int], None] = lambda cached: None


@dataclass
class _Row:
    """A request in a row: its progress through prefill and decode."""

    request: Request
    id: int
    sampler: torch.Generator
    pieces: list[int] = field(default_factory=list)  # where its prompt pieces end (chunk_ends)
    history: Optional[TokenHistory] = None  # its tokens so far, where its sampling's penalties read them
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0
    output: list[int] = field(default_factory=list)  # the generated tokens (the stop token included)
    next_token: Optional[int] = None  # sampled, not yet in the cache (decoding)
    prompt_logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.next_token is not None

    @property
    def length(self) -> int:
        """Positions of this row the cache holds."""
        return self.prefilled + max(0, self.generated - 1)

    def next_piece(self) -> int:
        """Tokens of the prompt's next piece."""
        return next(e for e in self.pieces if e > self.prefilled) - self.prefilled


@dataclass
class Engine:
    model: Transformer  # caches set up for max_batch rows, the policy installed
    max_seq_length: int
    prefill_chunk: int = PREFILL_CHUNK  # where prompts are cut: pieces of this many tokens (one pass each)
    step_tokens: int = STEP_TOKENS  # the per-step token budget: decoding rows + prompt pieces
    max_queue: int = 64  # requests waiting for a row before submit() refuses (QueueFull)
    decode: Callable = decode_step  # the step (decoding.compiled_decode_step for --compile)
    reuse_prefixes: bool = True  # a new request keeps the longest prefix a free row's cache shares with it
    reuse_replies: bool = False  # ... its reply's decode-written positions included (not a cold run's)
    rows: list[Optional[_Row]] = field(init=False)
    waiting: deque = field(init=False, default_factory=deque)
    stats: dict = field(init=False)  # counters since the start: decode steps, tokens and seconds; prefill's (/health)

    def __post_init__(self):
        if self.prefill_chunk < 1 or self.step_tokens < 1:
            raise ValueError("the prefill chunk and the step's token budget must be positive")
        self.rows = [None] * self.model.caches[0].max_batch
        self.cached: list[list[int]] = [[] for _ in self.rows]  # the token ids each free row's cache holds, from 0
        self.held = [0] * len(self.rows)  # positions a free row's cache holds (its last request's)
        self.used: list[float] = [0.0] * len(self.rows)  # when each row was last taken (least recently used first)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._stopping = False
        self._cancelled: set[int] = set()
        self._between: list[tuple[Callable[[], None], threading.Event, list]] = []  # run_between_steps' work
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "decode_s": 0.0, "prefill_tokens": 0, "prefill_s": 0.0,
                      "prompt_tokens": 0, "prefix_hits": 0, "prefix_reused_tokens": 0}
        self.model.check_row_operations()  # a policy with per-row state cannot share the cache (ValueError)

    # -- any thread -----------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id (for cancel). QueueFull / Stopped when it cannot be taken;
        ValueError for a prompt that leaves no room in the context."""
        if not request.prompt or len(request.prompt) >= self.max_seq_length:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens; the context holds {self.max_seq_length}")
        if request.max_new_tokens < 0 or (request.max_new_tokens == 0 and not request.echo_logprobs):
            raise ValueError("max_new_tokens must be positive (0 only to score the prompt, with echo_logprobs)")
        with self._lock:
            if self._stopping:
                raise Stopped("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting for a row")
            request_id = next(self._ids)
            sampler = torch.Generator()
            sampler.manual_seed(request.seed if request.seed is not None else torch.seed())
            history = (TokenHistory.of_prompts([request.prompt], self.model.args.vocab_size)
                       if request.sampling.penalized else None)
            self.waiting.append(_Row(request, request_id, sampler, history=history))
            self._lock.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        """End a request (a client gone): its row is freed before the next step."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def run_between_steps(self, work: Callable[[], None]) -> None:
        """Run `work` on the engine's thread between two steps (at once if it is idle) and wait for it; what it
        raises is raised here. For what must not change while a step runs: the kernels a server takes once
        they are built (serve.py). The engine's thread must be running."""
        done, failure = threading.Event(), []
        with self._lock:
            self._between.append((work, done, failure))
            self._lock.notify()
        done.wait()
        if failure:
            raise failure[0]

    def forget_prefixes(self) -> None:
        """The free rows' caches hold nothing to reuse from now on (their positions were written by other
        kernels: a warm request must compute what a cold one does). The engine's thread only."""
        for i, row in enumerate(self.rows):
            if row is None:
                self.cached[i], self.held[i] = [], 0

    def stop(self) -> None:
        """Admit nothing more; every request waiting or in a row ends with "shutdown" at the next step."""
        with self._lock:
            self._stopping = True
            self._lock.notify()

    @property
    def busy_rows(self) -> int:
        return sum(row is not None for row in self.rows)

    @torch.no_grad()
    def warm_up(self, lengths: list[int]) -> None:
        """Run the decode step once for every row bucket at each of these live lengths (the positions a
        row holds before the step), on whatever the rows hold, then empty them: a compiled step builds
        (or loads) its programs now, not while a request waits (SparQ runs dense while a layer sees at
        most k positions: a length on either side). Call before any request."""
        if self.busy_rows or self.waiting:
            raise RuntimeError("warm_up runs on an idle engine")
        device = self.model.device
        for n in sorted({row_bucket(b, len(self.rows)) for b in range(1, len(self.rows) + 1)}):
            for length in lengths:
                self.model.set_live_lengths(torch.full((n,), length, device=device))
                positions = torch.full((n, 1), length, device=device)
                self.decode(self.model, torch.zeros((n, 1), dtype=torch.long, device=device), positions,
                            self.model.read_length(length + 1))
                for i in range(n):
                    self.model.reset_row(i)

    # -- the engine's thread ----------------------------------------------------------------------

    def run_forever(self) -> None:
        """Step until stop() has ended every request."""
        while True:
            with self._lock:
                while not self._has_work() and not self._stopping and not self._between:
                    self._lock.wait()
                between, self._between = self._between, []
                if self._stopping and not self._has_work() and not between:
                    return
            for work, done, failure in between:
                try:
                    work()
                except Exception as e:  # said to the caller, who waits for it
                    failure.append(e)
                done.set()
            if not self._has_work():
                continue
            try:
                self.step()
            except Exception as e:  # a failed step ends the requests in the rows, not the server
                print(f"engine: a step failed ({type(e).__name__}: {e}); its requests end with 'error'", file=sys.stderr)
                for i, row in enumerate(self.rows):
                    if row is not None:
                        self._finish(i, "error")

    def _has_work(self) -> bool:
        return bool(self.waiting) or self.busy_rows > 0

    @torch.no_grad()
    def step(self) -> None:
        """End what was cancelled, admit, prefill prompt pieces of the oldest prefilling requests within
        the step's token budget (at least one piece), then one decode step of the decoding rows."""
        self._end_cancelled()
        self._admit()
        decoding = sum(row is not None and row.decoding for row in self.rows)
        budget = self.step_tokens - decoding
        first = True
        while True:
            prefilling = [i for i, row in enumerate(self.rows) if row is not None and not row.decoding]
            if not prefilling:
                break
            i = min(prefilling, key=lambda i: self.rows[i].id)  # oldest first
            piece = self.rows[i].next_piece()
            if piece > budget and not first:
                break
            self._prefill_piece(i)
            budget -= piece
            first = False
        if any(row is not None and row.decoding for row in self.rows):
            self._decode_step()

    def _end_cancelled(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            stopping = self._stopping
            if stopping:
                waiting, self.waiting = list(self.waiting), deque()
            else:
                waiting = [row for row in self.waiting if row.id in cancelled]
                self.waiting = deque(row for row in self.waiting if row.id not in cancelled)
        for row in waiting:
            row.request.emit(None, "shutdown" if stopping else "stop", None)
        for i, row in enumerate(self.rows):
            if row is not None and (stopping or row.id in cancelled):
                self._finish(i, "shutdown" if stopping else "stop")

    def _admit(self) -> None:
        """Each waiting request, oldest first, into a free row: the one keeping most of its prompt (least
        recently used among equals), the prefix kept and the rest to prefill."""
        with self._lock:
            while self.waiting and None in self.rows:
                row = self.waiting.popleft()
                i, kept = self._best_row(row.request)
                self.rows[i], self.used[i] = row, time.monotonic()
                if kept:
                    self.model.keep_prefix(i, kept, self.prefill_chunk)
                    self.stats["prefix_hits"] += 1
                    self.stats["prefix_reused_tokens"] += kept
                else:
                    self.model.reset_row(i)
                self.cached[i], self.held[i] = [], 0  # the row is the request's from now on (_finish records it)
                row.prefilled = kept
                row.pieces = chunk_ends(kept, len(row.request.prompt), self.prefill_chunk)
                self.stats["prompt_tokens"] += len(row.request.prompt)
                row.request.emit_admitted(kept)

    def _best_row(self, request: Request) -> tuple[int, int]:
        """(the free row for `request`, the positions of its cache to keep): the longest shared prefix, kept
        at a multiple of prefill_chunk and short of the whole prompt (its last token's logits come from a
        prefill); among equals the least recently used row."""
        def kept(i: int) -> int:
            if not self.reuse_prefixes or request.echo_logprobs:  # the prompt's logprobs need its every position
                return 0
            shared = 0
            for a, b in zip(self.cached[i], request.prompt[:-1]):
                if a != b:
                    break
                shared += 1
            return shared // self.prefill_chunk * self.prefill_chunk

        free = [i for i, row in enumerate(self.rows) if row is None]
        best = max(free, key=lambda i: (kept(i), -self.used[i], -i))
        return best, kept(best)

    def _prefill_piece(self, i: int) -> None:
        """The next piece of row i's prompt, one forward pass into its row of the caches."""
        row = self.rows[i]
        request, begin = row.request, row.prefilled
        end = begin + row.next_piece()
        tokens = torch.tensor([request.prompt[begin:end]], device=self.model.device)
        positions = torch.arange(begin, end, device=self.model.device)
        every = request.echo_logprobs
        start = time.perf_counter()
        logits = self.model.prefill(tokens, positions, end, None, i, every_position=every)  # (1, [T,] vocab)
        logits = logits.float().cpu()  # on the host (one sync: the piece's time is its own)
        self.stats["prefill_tokens"] += end - begin
        self.stats["prefill_s"] += time.perf_counter() - start
        row.prefilled = end
        if every:  # position p's logits score the token at p + 1
            top = request.logprobs or 0
            scored = request.prompt[begin + 1:end + 1]
            row.prompt_logprobs += [None] * (begin == 0) + token_logprobs(logits[0, :len(scored)], scored, top)
            logits = logits[:, -1]
        if end == len(request.prompt):
            if every:
                request.emit_prompt(row.prompt_logprobs)
            if request.max_new_tokens == 0:  # scored, nothing to generate
                self._finish(i, "length")
            else:
                self._take(i, logits[0])

    def _decode_step(self) -> None:
        """The first n rows step (row_bucket): a decoding row feeds its next token at its length; any
        other row among them (prefilling, or free with the prefix it keeps) feeds a dummy token at its own
        length, its running sums and live length set aside before and put back after, bit for bit: its
        cache is as before (the dummy's position is past its live length, rewritten before it is read)."""
        last = max(i for i, row in enumerate(self.rows) if row is not None and row.decoding)
        n, device = row_bucket(last + 1, len(self.rows)), self.model.device
        rows = self.rows[:n]
        tokens = [row.next_token if row is not None and row.decoding else 0 for row in rows]
        lengths = [self.held[i] if row is None else row.length for i, row in enumerate(rows)]
        idle = [i for i, row in enumerate(rows) if row is None or not row.decoding]
        aside = self.model.rows_state(idle) if idle else None
        input_pos = torch.tensor(lengths, device=device).view(n, 1)
        token = torch.tensor(tokens, device=device).view(n, 1)
        start = time.perf_counter()
        logits = self.decode(self.model, token, input_pos, self.model.read_length(max(lengths) + 1))  # (n, vocab)
        decoding = [i for i, row in enumerate(rows) if row is not None and row.decoding]
        picked = logits[decoding].float().cpu()  # the decoding rows' logits, on the host: the step has ended
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(decoding)
        self.stats["decode_s"] += time.perf_counter() - start
        if aside is not None:
            self.model.restore_rows_state(aside)
        for i, row_logits in zip(decoding, picked):
            self._take(i, row_logits)

    def _take(self, i: int, logits: Tensor) -> None:
        """Row i's next token from its logits (vocab,): pass it on, or end the request."""
        row, request = self.rows[i], self.rows[i].request
        token = int(sample(logits[None], request.sampling, row.history, row.sampler)[0])  # its own random stream
        if row.history is not None:
            row.history.add(torch.tensor([token]))
        row.generated += 1
        row.output.append(token)
        logprob = None if request.logprobs is None else token_logprobs(logits[None], [token], request.logprobs)[0]
        if token in request.stop_ids:  # reported with the finish (and its logprob when asked), not returned
            self._finish(i, "stop", logprob)
            return
        request.emit(token, None, logprob)
        if row.generated >= request.max_new_tokens or row.prefilled + row.generated >= self.max_seq_length:
            self._finish(i, "length")
        else:
            row.next_token = token

    def _finish(self, i: int, reason: str, stop_logprob: Optional[TokenLogprob] = None) -> None:
        row = self.rows[i]
        self.rows[i] = None  # kept or reset when the next request takes the row (_admit)
        # what the next request may keep (nothing after a failed step, whose writes are unknown)
        self.cached[i] = [] if reason == "error" else self._held_ids(row)
        self.held[i] = row.length
        row.request.emit(None, reason, stop_logprob)

    def _held_ids(self, row: _Row) -> list[int]:
        """The ids of the positions a finished request's row holds that the next request may keep: its
        prefilled prompt, then (reuse_replies) the generated tokens decode fed, every one but the last (sampled,
        never fed: row.length counts the same; none while the prompt was still prefilling)."""
        prompt = row.request.prompt[:row.prefilled]
        return prompt + row.output[:row.length - row.prefilled] if self.reuse_replies else prompt


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits (T, vocab) at T positions, the token that follows each -> their TokenLogprobs with the
    `top` most likely alternatives (log-softmax in fp32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top > 0:
        values, ids = logprobs.topk(top, dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]


def run_alone(engine: Engine, request: Request) -> tuple[list[int], str]:
    """A request through the engine with nothing else in it, in the calling thread: (tokens, finish
    reason). The solo run the batched one must equal (tests) and a warm-up."""
    out: list[int] = []
    reason: list[str] = []

    def emit(token, finish, logprob=None):
        if token is not None:
            out.append(token)
        if finish is not None:
            reason.append(finish)

    engine.submit(Request(**{**request.__dict__, "emit": emit}))
    start = time.perf_counter()
    while not reason:
        engine.step()
        if time.perf_counter() - start > 600:
            raise RuntimeError("a solo request did not finish in 10 minutes")
    return out, reason[0]
