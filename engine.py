"""Continuous batching on the static cache: the scheduler behind serve.py.

The caches hold `max_batch` rows. A request takes a free row, is prefilled into it `prefill_chunk`
tokens at a time (one chunk between two decode steps, so a long prompt never stalls the others for
its whole prefill; several per step while nothing decodes), then decodes with the other busy rows,
each at its own position; a finished or cancelled request frees its row at once. The decode step always runs every row (the shapes never
change, so one compiled step serves any mix): a row that is free or still prefilling computes a
token nobody reads, written at its own live length (a free row's: position 0) and truncated away
after the step (a free row's when a request takes it).

Each request samples with its own torch.Generator (its `seed`), so its tokens depend on its prompt
and settings alone, never on what else is in the batch; greedy requests are token for token their
solo run (tests/test_serve.py; the fused CPU attention kernels split S over threads by the whole
batch's lengths, which at long ragged contexts can change a row's rounding: README). The engine runs in one thread (`run_forever`); `submit` and `cancel`
may be called from any other, and a request's events reach its `emit` callback from the engine's.
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

from decoding import PREFILL_CHUNK, chunk_ends, decode_step, prefill, probabilities
from model import Transformer


class QueueFull(Exception):
    """submit() while `max_queue` requests already wait for a row."""


class Stopped(Exception):
    """submit() after stop(): the engine admits nothing more."""


@dataclass
class Request:
    """What to generate. stop_ids end it (the stop token is reported, not returned); max_new_tokens
    counts the generated tokens; temperature 0 is greedy; seed: its own sampler (None: random)."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    # emit(token or None, finish_reason or None): a token as it comes, then (None, reason) once at the
    # end: "stop" (a stop token, or cancel()), "length" (max_new_tokens or the context), "shutdown",
    # "error" (a step failed: run_forever ends the requests in the rows and goes on)
    emit: Callable[[Optional[int], Optional[str]], None] = lambda token, reason: None


@dataclass
class _Row:
    """A request in a row: its progress through prefill and decode."""

    request: Request
    id: int
    sampler: torch.Generator
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0
    next_token: Optional[int] = None  # sampled, not yet in the cache (decoding)
    cancelled: bool = False

    @property
    def decoding(self) -> bool:
        return self.next_token is not None

    @property
    def length(self) -> int:
        """Positions of this row the cache holds."""
        return self.prefilled + max(0, self.generated - 1)


@dataclass
class Engine:
    model: Transformer  # caches set up for max_batch rows, the policy installed
    max_seq_length: int
    prefill_chunk: int = 128  # prompt tokens per prefill chunk: one chunk between two decode steps
    idle_prefill: int = PREFILL_CHUNK  # prompt tokens per step while no row decodes (whole chunks)
    max_queue: int = 64  # requests waiting for a row before submit() refuses (QueueFull)
    decode: Callable = decode_step  # the step (decoding.compiled_decode_step for --compile)
    rows: list[Optional[_Row]] = field(init=False)
    waiting: deque = field(init=False, default_factory=deque)

    def __post_init__(self):
        self.rows = [None] * self.model.caches[0].max_batch
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._stopping = False
        self._cancelled: set[int] = set()
        self.model.check_row_operations()  # a policy with per-row state cannot share the cache (ValueError)

    # -- any thread -----------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id (for cancel). QueueFull / Stopped when it cannot be taken;
        ValueError for a prompt that leaves no room in the context."""
        if not request.prompt or len(request.prompt) >= self.max_seq_length:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens; the context holds {self.max_seq_length}")
        with self._lock:
            if self._stopping:
                raise Stopped("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting for a row")
            request_id = next(self._ids)
            sampler = torch.Generator()
            sampler.manual_seed(request.seed if request.seed is not None else torch.seed())
            self.waiting.append(_Row(request, request_id, sampler))
            self._lock.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        """End a request (a client gone): its row is freed before the next step."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def stop(self) -> None:
        """Admit nothing more; every request waiting or in a row ends with "shutdown" at the next step."""
        with self._lock:
            self._stopping = True
            self._lock.notify()

    @property
    def busy_rows(self) -> int:
        return sum(row is not None for row in self.rows)

    # -- the engine's thread ----------------------------------------------------------------------

    def run_forever(self) -> None:
        """Step until stop() has ended every request."""
        while True:
            with self._lock:
                while not self._has_work() and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self._has_work():
                    return
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
        """End what was cancelled, admit, prefill (one chunk, or up to idle_prefill tokens while no row
        decodes), then one decode step of every decoding row."""
        self._end_cancelled()
        self._admit()
        decoding = any(row is not None and row.decoding for row in self.rows)
        # One chunk between two decode steps while rows decode (their tokens wait for it); with none
        # decoding, chunks up to idle_prefill tokens (nobody waits). Chunk boundaries stay the same.
        budget = self.prefill_chunk if decoding else max(self.prefill_chunk, self.idle_prefill)
        while budget > 0:
            prefilling = [i for i, row in enumerate(self.rows) if row is not None and not row.decoding]
            if not prefilling:
                break
            budget -= self._prefill_chunk(min(prefilling, key=lambda i: self.rows[i].id))  # oldest first
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
            row.request.emit(None, "shutdown" if stopping else "stop")
        for i, row in enumerate(self.rows):
            if row is not None and (stopping or row.id in cancelled):
                self._finish(i, "shutdown" if stopping else "stop")

    def _admit(self) -> None:
        with self._lock:
            for i, row in enumerate(self.rows):
                if row is None and self.waiting:
                    self.rows[i] = self.waiting.popleft()
                    self.model.reset_row(i)

    def _prefill_chunk(self, i: int) -> int:
        """The next prefill chunk of row i; returns its tokens."""
        row = self.rows[i]
        prompt = row.request.prompt
        end = next(e for e in chunk_ends(0, len(prompt), self.prefill_chunk) if e > row.prefilled)  # as prefill() cuts
        tokens = torch.tensor([prompt[row.prefilled:end]], device=self.model.device)
        logits = prefill(self.model, tokens, chunk=end - row.prefilled, start=row.prefilled, row=i)  # (1, vocab)
        tokens_done, row.prefilled = end - row.prefilled, end
        if end == len(prompt):
            self._take(i, self._sample(row, logits[0]))
        return tokens_done

    def _decode_step(self) -> None:
        """Every row steps: a decoding row feeds its next token at its length; any other row feeds a
        dummy token at its own length, which is truncated away (its cache is as before)."""
        B, device = len(self.rows), self.model.device
        tokens = [row.next_token if row is not None and row.decoding else 0 for row in self.rows]
        lengths = [0 if row is None else row.length for row in self.rows]
        input_pos = torch.tensor(lengths, device=device).view(B, 1)
        token = torch.tensor(tokens, device=device).view(B, 1)
        logits = self.decode(self.model, token, input_pos, self.model.read_length(max(lengths) + 1))  # (B, vocab)
        for i, row in enumerate(self.rows):
            if row is not None and not row.decoding:  # a free row's scratch position is reset when it is taken
                self.model.truncate_row(i, lengths[i])
        for i, row in enumerate(self.rows):
            if row is not None and row.decoding:
                self._take(i, self._sample(row, logits[i]))

    def _sample(self, row: _Row, logits: Tensor) -> int:
        """The next token from (vocab,) logits with the request's own sampler."""
        request = row.request
        if request.temperature == 0:
            return int(logits.argmax())
        probs = probabilities(logits.float(), request.temperature, request.top_k).cpu()
        return int(torch.multinomial(probs, 1, generator=row.sampler))

    def _take(self, i: int, token: int) -> None:
        """Row i sampled `token`: pass it on, or end the request."""
        row, request = self.rows[i], self.rows[i].request
        row.generated += 1
        if token in request.stop_ids:
            self._finish(i, "stop")
            return
        request.emit(token, None)
        if row.generated >= request.max_new_tokens or row.prefilled + row.generated >= self.max_seq_length:
            self._finish(i, "length")
        else:
            row.next_token = token

    def _finish(self, i: int, reason: str) -> None:
        row = self.rows[i]
        self.rows[i] = None  # reset when the next request takes the row
        row.request.emit(None, reason)


def run_alone(engine: Engine, request: Request) -> tuple[list[int], str]:
    """A request through the engine with nothing else in it, in the calling thread: (tokens, finish
    reason). The solo run the batched one must equal (tests) and a warm-up."""
    out: list[int] = []
    reason: list[str] = []

    def emit(token, finish):
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
