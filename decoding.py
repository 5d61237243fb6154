"""The decode engine: chunked prefill, the (compiled) decode step and `Generator`, the token-by-token
loop over rows of any lengths (sampling.py chooses each token). generate.py is its command line; bench
and evals drive the same step; speculation.py and the server's engine.py build on it.
"""
from __future__ import annotations

import re
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

import torch
from torch import Tensor

from aot import AOTDecodeStep
from attention import DenseDecode
from model import Transformer
from sampling import GREEDY, Sampling, TokenHistory, sample


PREFILL_CHUNK = 2048  # prompt tokens per prefill step: memory stays bounded at any prompt length


def prefill_chunk(model: Transformer, tokens: Tensor, input_pos: Tensor, end: int,
                  lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
    """tokens (B, T) at positions input_pos = [end - T, end) -> logits (B, vocab) of the last one
    (or of each row's last real token, for right-padded prompts of these lengths). row: tokens (1, T)
    into that batch row of the caches alone (Transformer.forward)."""
    return model.prefill(tokens, input_pos, end, lengths, row)


def chunk_ends(start: int, end: int, chunk: int) -> list[int]:
    """Where the prefill chunks of positions [start, end) end: at the multiples of `chunk` between them, and at
    end. The boundaries are the same whatever a prompt's length, so two prompts sharing a prefix prefill its
    pieces alike: a server that keeps a prefix a multiple of `chunk` long (engine.py) holds what a cold
    prefill of the new prompt would write there, bit for bit."""
    return list(range((start // chunk + 1) * chunk, end, chunk)) + [end]


def prefill(model: Transformer, prompt: Tensor, chunk: int = PREFILL_CHUNK, step: Callable = prefill_chunk,
            progress: bool = False, lengths: Optional[Tensor] = None, start: int = 0,
            row: Optional[int] = None) -> Tensor:
    """prompt (B, T) at positions [start, start + T), in chunks of `chunk` tokens (each attends to the
    cache the chunks before it wrote) -> logits (B, vocab) of the last position. lengths (B,): a
    right-padded batch of prompts of those lengths, whose logits are each row's at its last real
    token (the padding is written to the cache, and set_live_lengths makes it dead). progress: a
    bar on stderr for long prompts (tqdm, when it is installed). row: prompt (1, T) prefilled into
    that batch row of the caches, which holds `start` positions; the other rows keep their state."""
    T = prompt.shape[1]
    ends = chunk_ends(start, start + T, chunk)
    logits = None
    with progress_bar(T, "prefill", "tok", enabled=progress and len(ends) > 1) as bar:
        for begin, end in zip([start] + ends[:-1], ends):
            tokens = prompt[:, begin - start:end - start]
            positions = torch.arange(begin, end, device=prompt.device)
            if row is not None:
                logits = step(model, tokens, positions, end, None, row)
            elif lengths is None:
                logits = step(model, tokens, positions, end)
            else:  # keep each row's logits from the chunk that holds its last real token
                last_pos = start + lengths - 1
                chunk_logits = step(model, tokens, positions, end, start + lengths)
                here = ((last_pos >= begin) & (last_pos < end))[:, None]
                logits = chunk_logits if logits is None else torch.where(here, chunk_logits, logits)
            bar.update(end - begin)
    return logits


def prefill_rows(model: Transformer, rows: list[list[int]], chunk: int = PREFILL_CHUNK, step: Callable = prefill_chunk,
                 progress: bool = False) -> Tensor:
    """Empty the caches and prefill one prompt per row, of any lengths (right-padded, then each row's
    live length set to its own) -> logits (B, vocab) at each row's last token."""
    lengths = [len(p) for p in rows]
    T, device = max(lengths), model.device
    ragged = len(set(lengths)) > 1
    padded = torch.tensor([p + [0] * (T - len(p)) for p in rows], device=device)  # (B, T) right-padded
    row_lengths = torch.tensor(lengths, device=device)
    model.reset_caches()
    logits = prefill(model, padded, chunk, step, progress, row_lengths if ragged else None)
    if ragged:
        model.set_live_lengths(row_lengths)
    return logits


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A tqdm bar on stderr (transient), or one that shows nothing when tqdm is not installed (the bare
    GPU machine's rehearsal has only torch) or `enabled` is False."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=False)


def decode_step(model: Transformer, token: Tensor, input_pos: Tensor, length: int) -> Tensor:
    """token (B, 1) at positions input_pos ((1,) for every row, or (B, 1) per row); length = the
    positions decode attention reads -> logits (B, vocab)."""
    return model.decode(token, input_pos, length)




def own_step(step: Callable, name: str) -> Callable:
    """step under a code object of its own (named step_name). Dynamo keeps compiled graphs per code
    object and checks a call against them in turn, the one that last ran first: with one step shared
    by two policies, or by two contexts on either side of a specialisation (SparQ runs dense while a
    layer sees at most k positions: one graph below k, one above), each call would first evaluate,
    and fail, the other graph's guards, a cost generate.py, with one policy at one growing length,
    pays at most once; a benchmark of several policies, or speculation's draft and verify, would pay
    it at every call."""
    code = step.__code__.replace(co_name=f"{step.__name__}_{re.sub(r'[^0-9a-zA-Z_]', '_', name)}")
    return types.FunctionType(code, step.__globals__, code.co_name)


COMPILE_BACKENDS = ("inductor", "aot")  # --compile-backend (compiled_decode_step also takes "cudagraphs")


def default_compile_backend(device_type: str) -> str:
    """The backend --compile takes unless told: on the CPU the step built ahead of time (aot: no Python
    between its ops, the faster at short context: docs/cpu.md), on CUDA inductor's CUDA graphs."""
    return "aot" if device_type == "cpu" else "inductor"


def compiled_decode_step(step: Callable, device_type: str, backend: str = "inductor") -> Callable:
    """torch.compile of a decode step (fullgraph, dynamic lengths), the one place its settings live:
    generate.py, python -m bench, bench/gpu_check.py and the tests compile this way.

    CUDA: gpt-fast's settings, CUDA graphs per shape (mode="reduce-overhead") and tuned GEMVs;
    backend="cudagraphs" captures the eager ops into CUDA graphs without inductor (quick to build:
    gpu_check's fallback when inductor fails). CPU: inductor's C++ wrapper, which calls the graph's
    kernels and ops from C++: a small model's step is hundreds of small calls, and a Python wrapper
    between them costs a visible share of it (docs/NOTES.md); backend="aot" builds the step ahead of time
    instead (AOTDecodeStep: no dynamo, no guards, no Python at all in a step).

    Both: the Python floats the step reads (norm eps and offsets, soft-caps, scales) compile in as
    constants, guarded by value; dynamic=True (for the live length) would otherwise make each a graph
    input rebuilt as a tensor on every call (docs/NOTES.md). The setting is read whenever dynamo compiles, which can be at any call (SparQ recompiles once
    its layers see more than k positions), so every call runs under it.
    """
    import torch._dynamo.config as dynamo_config

    if backend == "aot":
        if device_type != "cpu":
            raise ValueError("the aot compile backend is for the CPU (CUDA: inductor's CUDA graphs)")
        return AOTDecodeStep(step)
    if backend == "cudagraphs":
        compiled = torch.compile(step, backend="cudagraphs", fullgraph=True, dynamic=True)
    elif device_type == "cuda":
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        inductor_config.triton.unique_kernel_names = True
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=True)
    else:
        compiled = torch.compile(step, fullgraph=True, dynamic=True, options={"cpp_wrapper": True})

    def floats_as_constants(*args):
        with dynamo_config.patch(specialize_float=True):
            return compiled(*args)

    return floats_as_constants


@dataclass
class DecodeStats:
    prefill_tokens: int  # prompt tokens prefilled (every row)
    prefill_s: float
    decode_s: float  # time in decode steps (printing excluded, see print_s)
    steps: int  # decode steps actually run (the first token comes from prefill)
    kv_bytes_read: int  # KV-cache bytes read over all decode steps, every row at its own length
    print_s: float = 0.0  # time spent printing streamed text, excluded from decode_s
    dense_kv_bytes_read: int = 0  # what dense attention would have read over the same steps (compression)
    weight_bytes_read: Optional[int] = None  # None: the weights once per step; speculation: per round, draft included
    rounds: int = 0  # speculative decoding: draft-and-verify rounds,
    proposed: int = 0  # draft tokens proposed (every row),
    accepted: int = 0  # and accepted by the verifier
    draft_s: float = 0.0  # time in the draft's steps
    verify_s: float = 0.0  # and in the verify passes

    def summary(self, batch_size: int, weights: int) -> dict:
        """The figures a run reports (generate.py --json): rates, and bandwidth counting the weights
        (`weights` bytes a step) and the KV bytes read."""
        steps_per_s = self.steps / self.decode_s if self.steps and self.decode_s > 0 else float("nan")
        weights_read = weights * self.steps if self.weight_bytes_read is None else self.weight_bytes_read
        bytes_per_s = (weights_read + self.kv_bytes_read) / self.decode_s if self.steps else float("nan")
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("nan"),
            "decode_steps": self.steps,
            "decode_tokens_per_s": steps_per_s,
            "total_tokens_per_s": steps_per_s * batch_size,
            "bandwidth_gb_s": bytes_per_s / 1e9,
            "weight_bytes": weights,
            "kv_bytes_read_per_step": self.kv_bytes_read // max(self.steps, 1),
            # KV transfers over dense's for the same cache and steps (every layer, every row at its length)
            "compression_achieved": self.kv_bytes_read / self.dense_kv_bytes_read if self.dense_kv_bytes_read else None,
            "print_s": self.print_s,
        }


class TextStream:
    """Prints a row's text as its tokens arrive. It decodes the whole row and prints what is new, so
    merges and multi-byte characters come out right; an incomplete character (decoded as U+FFFD) is
    held back until the next token completes it."""

    def __init__(self, tokenizer, out: TextIO = sys.stdout):
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = 0
        self.stopped = False  # the row's stop token came: what follows is not printed

    def add(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd") and len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


@dataclass
class Generator:
    """Prefill + token-by-token decode on a model with caches set up, optionally compiled.

    Rows of different lengths (a batch of different prompts) each decode at their own positions;
    a row that has stopped keeps computing (its tokens are dropped) until every row has stopped.
    No host sync per step on a GPU: positions live on the device and advance in place, sampling
    stays there (`sample`), and the host looks at the tokens (stop tokens, streamed text) every
    `check_every` steps; on the CPU, where a look costs nothing, a streamed row is printed every
    step. The KV bytes read are counted after the timed loop, from the lengths."""

    model: Transformer
    stop_ids: set[int] = field(default_factory=set)
    sampling: Sampling = GREEDY
    compile_decode: bool = False
    compile_backend: str = "inductor"  # or "cudagraphs" (compiled_decode_step)
    compile_prefill: bool = False
    compile_name: Optional[str] = None  # the compiled step's own code (own_step): generators side by side
    prefill_chunk: int = PREFILL_CHUNK
    progress: bool = False  # a progress bar over long prefills
    check_every: int = 16  # steps between the host's looks at the tokens (a sync on a GPU)

    def __post_init__(self):
        self._prefill_chunk = prefill_chunk
        self._decode = decode_step
        if self.compile_decode:
            step = decode_step if self.compile_name is None else own_step(decode_step, self.compile_name)
            self._decode = compiled_decode_step(step, self.model.device.type, self.compile_backend)
        if self.compile_prefill:
            self._prefill_chunk = torch.compile(prefill_chunk, fullgraph=True, dynamic=True)
        self._stop_tensor = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=self.model.device)

    @torch.no_grad()
    def warm_up(self, prompts: Tensor | list[list[int]], max_new_tokens: int) -> float:
        """Compile (and on a GPU capture) every variant of the decode step a generation of these
        prompts will use, before the timed runs; returns the seconds it took. A short generation
        compiles the prefill and the first read lengths, then warm_up_reads the rest. The next
        generate() resets the caches."""
        start = time.perf_counter()
        rows = prompts.tolist() if isinstance(prompts, Tensor) else [list(p) for p in prompts]
        self.generate(rows, min(max_new_tokens, 3))
        self.warm_up_reads([len(p) for p in rows], max_new_tokens)
        return time.perf_counter() - start

    @torch.no_grad()
    def build_summary(self) -> str:
        """What compiling the decode step made, in words (AOT programs built or loaded from the cache), or ""."""
        return self._decode.summary() if isinstance(self._decode, AOTDecodeStep) else ""

    def warm_up_decode(self, lengths: list[int], max_new_tokens: int) -> float:
        """warm_up for decode() from filled caches (benchmarks): the caches are as before afterwards."""
        start = time.perf_counter()
        token = torch.zeros(len(lengths), dtype=torch.long, device=self.model.device)
        with self.model.preserved_caches():
            self.decode(token, lengths, min(max_new_tokens, 3))
            self.warm_up_reads(lengths, max_new_tokens)
        return time.perf_counter() - start

    def warm_up_reads(self, lengths: list[int], max_new_tokens: int) -> None:
        """One decode step at every read length a decode from rows of these lengths reaches beyond the
        first two (which a short decode compiled): each length bucket (a CUDA graph each, and a
        Triton plan per power of two), or on the CPU, where lengths are exact and compile as one
        dynamic graph, the last one (SparQ's step branches once its layers see more than k
        positions). A step writes position length - 1, which the real run rewrites before reading."""
        B, T, device = len(lengths), max(lengths), self.model.device
        ragged = len(set(lengths)) > 1
        done = {self.model.read_length(T + 1), self.model.read_length(T + 2)}
        reads = sorted({self.model.read_length(T + 1 + step) for step in range(max_new_tokens - 1)} - done)
        if self.model.caches[0].length_bucket == 1:
            reads = reads[-1:]
        token = torch.zeros((B, 1), dtype=torch.long, device=device)
        for length in reads:
            position = torch.full((B, 1) if ragged else (1,), length - 1, device=device)
            self._decode(self.model, token, position, length)
        synchronize(device)

    @torch.no_grad()
    def generate(self, prompts: Tensor | list[list[int]], max_new_tokens: int,
                 stream: Optional[TextStream] = None) -> tuple[list[list[int]], DecodeStats]:
        """prompts: (B, T) tokens, or a list of B prompts of any lengths -> the new tokens of each
        row (cut after a stop token) and timings. stream: print row 0 as it is generated (B = 1)."""
        rows = prompts.tolist() if isinstance(prompts, Tensor) else [list(p) for p in prompts]
        lengths = [len(p) for p in rows]
        start = time.perf_counter()
        logits = prefill_rows(self.model, rows, self.prefill_chunk, self._prefill_chunk, self.progress)
        history = self.history(rows)
        next_token = sample(logits, self.sampling, history)
        synchronize(self.model.device)
        prefill_s = time.perf_counter() - start
        tokens, stats = self.decode(next_token, lengths, max_new_tokens, stream, history)
        stats.prefill_tokens, stats.prefill_s = sum(lengths), prefill_s
        return tokens, stats

    def history(self, rows: list[list[int]]) -> Optional[TokenHistory]:
        """The rows' tokens so far, where the sampling's penalties read them (None where they do not)."""
        if not self.sampling.penalized:
            return None
        return TokenHistory.of_prompts(rows, self.model.args.vocab_size, self.model.device)

    @torch.no_grad()
    def decode(self, next_token: Tensor, lengths: list[int], max_new_tokens: int,
               stream: Optional[TextStream] = None,
               history: Optional[TokenHistory] = None) -> tuple[list[list[int]], DecodeStats]:
        """Decode from caches that hold each row's first lengths[b] positions (a prefill, or any filled
        cache: benchmarks), next_token (B,) being the token at position lengths[b] -> the new tokens
        of each row (cut after a stop token) and timings (prefill fields zero). history: the rows' tokens
        before next_token, where the penalties read them (generate() passes its prompts')."""
        B, T, device = len(lengths), max(lengths), self.model.device
        ragged = len(set(lengths)) > 1
        # Positions on the device, advanced in place: (1,) shared, or (B, 1) per row.
        input_pos = torch.tensor(lengths, device=device).view(B, 1) if ragged else torch.tensor([T], device=device)
        generated, done = [next_token], self._is_stop(next_token)
        if history is None and self.sampling.penalized:  # benchmarks: a filled cache, its prompts unknown
            history = TokenHistory.of_prompts([[] for _ in lengths], self.model.args.vocab_size, device)
        if history is not None:
            history.add(next_token)
        look_every = 1 if stream is not None and device.type == "cpu" else self.check_every
        print_s, steps, printed = 0.0, 0, 0
        start = time.perf_counter()
        for step in range(max_new_tokens - 1):
            if step % look_every == 0:  # the host looks at the tokens: a sync on a GPU
                print_s, printed = print_s + self._stream(stream, generated[printed:]), len(generated)
                if self.stop_ids and bool(done.all()):
                    break
            logits = self._decode(self.model, next_token.view(B, 1), input_pos, self.model.read_length(T + step + 1))
            input_pos += 1
            next_token = sample(logits, self.sampling, history)
            if history is not None:
                history.add(next_token)
            generated.append(next_token)
            if self.stop_ids:
                done |= self._is_stop(next_token)
            steps += 1
        print_s += self._stream(stream, generated[printed:])
        synchronize(device)
        decode_s = time.perf_counter() - start - print_s

        tokens = torch.stack(generated, dim=1).tolist()  # (B, n)
        # the KV bytes of each step, every row at its own live length: counted outside the timed loop
        stats = DecodeStats(0, 0.0, decode_s, steps, self._kv_bytes(lengths, steps), print_s,
                            self._kv_bytes(lengths, steps, [DenseDecode()] * len(self.model.layers)))
        return [cut_at_stop(row, self.stop_ids) for row in tokens], stats

    def _kv_bytes(self, lengths: list[int], steps: int, policies: Optional[list] = None) -> int:
        """KV bytes `steps` decode steps read from rows of these lengths, each at its own live length,
        with the installed policies (or `policies`, one per layer)."""
        if len(set(lengths)) == 1:
            return sum(self.model.decode_kv_bytes(lengths[0] + step + 1, len(lengths), policies) for step in range(steps))
        return sum(self.model.decode_kv_bytes(n + step + 1, 1, policies) for n in lengths for step in range(steps))

    def _stream(self, stream: Optional[TextStream], tokens: list[Tensor]) -> float:
        """Print row 0's new tokens (up to its stop token); returns the seconds it took (kept out of
        the decode timing)."""
        if stream is None or not tokens:
            return 0.0
        start = time.perf_counter()
        for value in torch.stack(tokens)[:, 0].tolist():
            if value in self.stop_ids or stream.stopped:
                stream.stopped = True
                continue
            stream.add(value)
        return time.perf_counter() - start

    def _is_stop(self, token: Tensor) -> Tensor:
        return torch.isin(token, self._stop_tensor)



def cut_at_stop(row: list[int], stop_ids: set[int], limit: Optional[int] = None) -> list[int]:
    """A row's tokens up to its first stop token (kept) and at most `limit` of them."""
    row = row if limit is None else row[:limit]
    for i, token in enumerate(row):
        if token in stop_ids:
            return row[: i + 1]
    return row


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
