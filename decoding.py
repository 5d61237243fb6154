"""The decode engine: chunked prefill, the (compiled) decode step, sampling, and `Generator`, the
token-by-token loop over rows of any lengths. generate.py is its command line; bench and evals
drive the same step.
"""
from __future__ import annotations

import re
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor

from aot import AOTDecodeStep
from attention import DenseDecode
from model import Transformer


def probabilities(logits: Tensor, temperature: float, top_k: Optional[int]) -> Tensor:
    """(..., vocab) logits -> the distribution sampling draws from: softmax(logits / temperature) over
    the top_k tokens (temperature > 0)."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    return torch.softmax(logits, dim=-1)


def draw(probs: Tensor) -> Tensor:
    """One token per row of probs (..., vocab), as the argmax of p / E with E ~ Exp(1) per token (the
    exponential race: P(argmax = i) = p_i), which stays on the device where torch.multinomial
    syncs with the host (gpt-fast samples this way)."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def sample(logits: Tensor, temperature: float, top_k: Optional[int]) -> Tensor:
    """logits (B, vocab) fp32 -> next tokens (B,). temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, temperature, top_k))


PREFILL_CHUNK = 2048  # prompt tokens per prefill step: memory stays bounded at any prompt length


def prefill_chunk(model: Transformer, tokens: Tensor, input_pos: Tensor, end: int,
                  lengths: Optional[Tensor] = None, row: Optional[int] = None) -> Tensor:
    """tokens (B, T) at positions input_pos = [end - T, end) -> logits (B, vocab) of the last one
    (or of each row's last real token, for right-padded prompts of these lengths). row: tokens (1, T)
    into that batch row of the caches alone (Transformer.forward)."""
    return model(tokens, input_pos, end, lengths, row)


def chunk_ends(start: int, end: int, chunk: int) -> list[int]:
    """Where the prefill chunks of positions [start, end) end: every chunk `chunk` long but the first,
    which may be short (so the last, whose logits sample the first token, is always whole)."""
    return list(range(end, start, -chunk))[::-1]


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
        for end in ends:
            begin = max(start, end - chunk)
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
    return model(token, input_pos, length)


def verify_step(model: Transformer, tokens: Tensor, input_pos: Tensor, length: int) -> Tensor:
    """tokens (B, T) at per-row positions input_pos (B, T), scored in one pass (speculative
    verification); length = the positions attention reads -> logits (B, T, vocab)."""
    return model(tokens, input_pos, length, every_position=True)


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
    between its ops, a quarter faster at short context; README), on CUDA inductor's CUDA graphs."""
    return "aot" if device_type == "cpu" else "inductor"


def compiled_decode_step(step: Callable, device_type: str, backend: str = "inductor") -> Callable:
    """torch.compile of a decode step (fullgraph, dynamic lengths), the one place its settings live:
    generate.py, python -m bench, bench/gpu_check.py and the tests compile this way.

    CUDA: gpt-fast's settings, CUDA graphs per shape (mode="reduce-overhead") and tuned GEMVs;
    backend="cudagraphs" captures the eager ops into CUDA graphs without inductor (quick to build:
    gpu_check's fallback when inductor fails). CPU: inductor's C++ wrapper, which calls the graph's
    kernels and ops from C++: a small model's step is hundreds of small calls, and a Python wrapper
    between them costs a tenth of it (docs/NOTES.md); backend="aot" builds the step ahead of time
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
    temperature: float = 0.0
    top_k: Optional[int] = None
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
        next_token = sample(logits, self.temperature, self.top_k)
        synchronize(self.model.device)
        prefill_s = time.perf_counter() - start
        tokens, stats = self.decode(next_token, lengths, max_new_tokens, stream)
        stats.prefill_tokens, stats.prefill_s = sum(lengths), prefill_s
        return tokens, stats

    @torch.no_grad()
    def decode(self, next_token: Tensor, lengths: list[int], max_new_tokens: int,
               stream: Optional[TextStream] = None) -> tuple[list[list[int]], DecodeStats]:
        """Decode from caches that hold each row's first lengths[b] positions (a prefill, or any filled
        cache: benchmarks), next_token (B,) being the token at position lengths[b] -> the new tokens
        of each row (cut after a stop token) and timings (prefill fields zero)."""
        B, T, device = len(lengths), max(lengths), self.model.device
        ragged = len(set(lengths)) > 1
        # Positions on the device, advanced in place: (1,) shared, or (B, 1) per row.
        input_pos = torch.tensor(lengths, device=device).view(B, 1) if ragged else torch.tensor([T], device=device)
        generated, done = [next_token], self._is_stop(next_token)
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
            next_token = sample(logits, self.temperature, self.top_k)
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
        return [self._cut_at_stop(row) for row in tokens], stats

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

    def _cut_at_stop(self, row: list[int]) -> list[int]:
        for i, token in enumerate(row):
            if token in self.stop_ids:
                return row[: i + 1]
        return row


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Speculative decoding: a draft proposes n tokens per row, the verifier scores them in one pass
# ---------------------------------------------------------------------------------------------


def expected_tokens_per_round(acceptance: float, n: int) -> float:
    """(1 - a^(n+1)) / (1 - a): a row's tokens per round when each proposal is accepted with probability a."""
    a = acceptance
    return n + 1 if a >= 1 else (1 - a ** (n + 1)) / (1 - a)


def speculative_speedup(acceptance: float, n: int, draft_step: float, verify_pass: float) -> float:
    """Expected tokens per round over the round's cost in verifier steps (a verify pass taken as one
    step: both read the weights and the cache once)."""
    return expected_tokens_per_round(acceptance, n) * verify_pass / (n * draft_step + verify_pass)


def acceptance_needed(speedup: float, n: int, draft_step: float, verify_pass: float, step: float) -> Optional[float]:
    """The acceptance at which n proposals per round, at these draft-step and verify-pass costs, reach
    `speedup` over a one-token step of cost `step`; None where even acceptance 1 falls short."""
    def predicted(a: float) -> float:  # speculative_speedup counts in verify passes: rescaled to `step`
        return speculative_speedup(a, n, draft_step, verify_pass) * step / verify_pass

    if predicted(1.0) < speedup:
        return None
    lo, hi = 0.0, 1.0  # predicted() grows with a
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < speedup else (lo, mid)
    return hi


def speculation_summary(stats: DecodeStats, n: int) -> dict:
    """acceptance_rate: accepted over proposed draft tokens; tokens_per_round: tokens a row gains per round
    (its accepted proposals and the verifier's own token); the measured step costs and the speedup they
    and the acceptance predict (speculative_speedup)."""
    if not stats.rounds:
        return {"acceptance_rate": None, "tokens_per_round": None}
    row_rounds = stats.proposed // n  # rounds x rows
    a = stats.accepted / stats.proposed
    draft_step, verify_pass = stats.draft_s / (stats.rounds * n), stats.verify_s / stats.rounds
    return {"acceptance_rate": a, "tokens_per_round": 1 + stats.accepted / row_rounds,
            "draft_step_s": draft_step, "verify_pass_s": verify_pass,
            "theory_speedup": speculative_speedup(a, n, draft_step, verify_pass)}


@dataclass
class Speculator:
    """Each round the draft proposes n tokens per row; the verifier scores the n + 1 positions in one
    pass (Transformer.forward over per-row positions, every_position) and each row keeps the longest
    prefix it agrees with plus one token of its own; the caches drop the rest (truncate_rows), so rows
    accept different counts in the same round. Greedy: the verifier's own tokens (its one pass is its
    one-token steps bit for bit on the fused CPU kernels, up to fp32 rounding elsewhere:
    DenseDecode.verify, kernels.linear_cpu). Sampling: the rejection rule (accept
    d with min(1, p(d) / q(d)), else draw from max(0, p - q) renormalized), which leaves the output
    distributed exactly as the verifier's own samples.

    Self-speculation (draft_model None): the verifier's model and caches, running draft_policies to
    propose (SparQ reading a fraction of the cache) and verify_policies to verify; the verify pass
    rewrites the drafted positions with the verifier's keys and values. A draft model: its own caches
    and installed policies, fed one token more than it proposes so that its cache holds every
    position a round can accept."""

    model: Transformer
    n: int  # tokens proposed per round
    verify_policies: list
    draft_policies: Optional[list] = None  # self-speculation
    draft_model: Optional[Transformer] = None
    stop_ids: set[int] = field(default_factory=set)
    temperature: float = 0.0
    top_k: Optional[int] = None
    prefill_chunk: int = PREFILL_CHUNK
    compile: bool = False  # the draft step and the verify pass, each compiled as Generator's step
    compile_name: str = "speculate"  # their code's own name (own_step), apart from a Generator's step
    compile_backend: str = "inductor"  # compiled_decode_step's backend

    def __post_init__(self):
        self._draft_step, self._verify_step = decode_step, verify_step
        if self.compile:
            device = self.model.device.type
            # two compiled functions of their own code, each meeting the same policies at every call
            # (self-speculation swaps the layers' policies between them)
            self._draft_step = compiled_decode_step(own_step(decode_step, f"draft_{self.compile_name}"), device,
                                                    self.compile_backend)
            self._verify_step = compiled_decode_step(own_step(verify_step, self.compile_name), device,
                                                     self.compile_backend)

    @torch.no_grad()
    def warm_up(self, prompts: list[list[int]]) -> float:
        """Compile the draft step and the verify pass (their dynamic graphs, and SparQ's second branch
        past k positions, which a long prompt reaches at once) with two rounds outside the timed runs;
        the next generate() resets the caches. Returns the seconds it took."""
        start = time.perf_counter()
        self.generate(prompts, 2 * (self.n + 1))
        return time.perf_counter() - start

    def _install(self, policies: list) -> None:
        self.model.set_decode_attention(lambda layer: policies[layer])

    def _sample(self, logits: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """(tokens, the distribution they were drawn from, or None when greedy)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1), None
        probs = probabilities(logits, self.temperature, self.top_k)
        return draw(probs), probs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        rows = [list(p) for p in prompts]
        device = self.model.device
        start = time.perf_counter()
        if self.draft_policies is not None:
            self._install(self.verify_policies)
        token, _ = self._sample(prefill_rows(self.model, rows, self.prefill_chunk))
        if self.draft_model is not None:
            prefill_rows(self.draft_model, rows, self.prefill_chunk)
        synchronize(device)
        prefill_s = time.perf_counter() - start
        out, stats = self.decode(token, [len(p) for p in rows], max_new_tokens)
        stats.prefill_tokens, stats.prefill_s = sum(len(p) for p in rows), prefill_s
        return out, stats

    @torch.no_grad()
    def decode(self, token: Tensor, lengths: list[int], max_new_tokens: int) -> tuple[list[list[int]], DecodeStats]:
        """Speculate from caches that hold each row's first lengths[b] positions (the draft model's too),
        token (B,) being the token at position lengths[b] -> the new tokens of each row (cut after a stop
        token and at max_new_tokens) and timings (prefill fields zero)."""
        device = self.model.device
        lengths_at_start = list(lengths)
        out = [[t] for t in token.tolist()]
        stats = DecodeStats(0, 0.0, 0.0, 0, 0, weight_bytes_read=0)
        # weights a round reads: the verify pass's, and the draft's once per step it runs
        round_weights = self.model.weight_bytes() + (self.n * self.model.weight_bytes() if self.draft_model is None
                                                     else (self.n + 1) * self.draft_model.weight_bytes())
        start = time.perf_counter()
        while True:
            # a row done (its tokens, or a stop token) stays where it is while the others go on
            active = [len(o) < max_new_tokens and not self._stopped(o) for o in out]
            if not any(active):
                break
            phase = time.perf_counter()
            proposals, q, draft_bytes = self._propose(token, lengths)  # (B, n), (B, n, vocab) or None
            synchronize(device)
            stats.draft_s += time.perf_counter() - phase
            phase = time.perf_counter()
            logits, verify_bytes = self._verify(token, proposals, lengths)  # (B, n + 1, vocab)
            synchronize(device)
            stats.verify_s += time.perf_counter() - phase
            accepted, next_token = self._accept(logits, proposals, q)  # (B,), (B,)
            accepted_list = [m if live else -1 for m, live in zip(accepted.tolist(), active)]
            proposal_rows = proposals.tolist()
            for b, (m, t) in enumerate(zip(accepted_list, next_token.tolist())):
                if m >= 0:
                    out[b] += proposal_rows[b][:m] + [t]
            token = torch.where(torch.tensor(active, device=device), next_token, token)
            lengths = [n + m + 1 for n, m in zip(lengths, accepted_list)]  # a done row: m + 1 = 0
            keep = torch.tensor(lengths, device=device)
            for model in (self.model, self.draft_model):
                if model is not None:
                    for cache in model.caches:
                        cache.truncate_rows(keep)
            stats.rounds += 1
            stats.proposed += self.n * sum(active)
            stats.accepted += sum(m for m in accepted_list if m > 0)
            stats.kv_bytes_read += draft_bytes + verify_bytes
            stats.weight_bytes_read += round_weights
        synchronize(device)
        stats.decode_s = time.perf_counter() - start
        out = [self._cut(row, max_new_tokens) for row in out]
        stats.steps = max(0, max(len(row) for row in out) - 1)  # tokens after the first, as Generator counts
        dense = [DenseDecode()] * len(self.model.layers)
        stats.dense_kv_bytes_read = sum(self.model.decode_kv_bytes(n + i + 1, 1, dense)
                                        for n, row in zip(lengths_at_start, out) for i in range(len(row) - 1))
        return out, stats

    def _propose(self, token: Tensor, lengths: list[int]) -> tuple[Tensor, Optional[Tensor], int]:
        """n draft tokens per row after `token` (at each row's position lengths[b]), the distributions
        they were drawn from, and the KV bytes the draft read."""
        B, longest = len(lengths), max(lengths)
        draft = self.draft_model or self.model
        if self.draft_policies is not None:
            self._install(self.draft_policies)
        steps = self.n if self.draft_model is None else self.n + 1  # a draft model also caches its last proposal
        position = torch.tensor(lengths, device=token.device).view(B, 1)
        current, proposals, dists, kv_bytes = token, [], [], 0
        for i in range(steps):
            logits = self._draft_step(draft, current.view(B, 1), position + i, draft.read_length(longest + i + 1))
            kv_bytes += sum(draft.decode_kv_bytes(n + i + 1, 1) for n in lengths)
            if i == self.n:
                break
            current, probs = self._sample(logits)
            proposals.append(current)
            dists.append(probs)
        if self.draft_model is None:  # the verify pass writes these positions again, the verifier's way
            for cache in self.model.caches:
                cache.truncate_rows(torch.tensor(lengths, device=token.device))
        q = None if dists[0] is None else torch.stack(dists, dim=1)
        return torch.stack(proposals, dim=1), q, kv_bytes

    def _verify(self, token: Tensor, proposals: Tensor, lengths: list[int]) -> tuple[Tensor, int]:
        """The verifier's logits (B, n + 1, vocab) at `token` and the n proposals after it, in one pass."""
        B, T = len(lengths), self.n + 1
        self._install(self.verify_policies)
        tokens = torch.cat([token.view(B, 1), proposals], dim=1)  # (B, n + 1)
        positions = torch.tensor(lengths, device=token.device).view(B, 1) + torch.arange(T, device=token.device)
        logits = self._verify_step(self.model, tokens, positions, self.model.read_length(max(lengths) + T))
        return logits, sum(self.model.decode_kv_bytes(n + T, 1) for n in lengths)

    def _accept(self, logits: Tensor, proposals: Tensor, q: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(accepted count (B,), each row's next token (B,)): greedy, the proposals the verifier's argmax
        repeats and then its own; sampling, the rejection rule."""
        n = self.n
        if q is None:
            best = logits.argmax(dim=-1)  # (B, n + 1)
            accepted = (best[:, :n] == proposals).long().cumprod(dim=1).sum(dim=1)
            return accepted, best.gather(1, accepted[:, None]).squeeze(1)
        p = probabilities(logits, self.temperature, self.top_k)  # (B, n + 1, vocab)
        index = proposals[..., None]
        ratio = p[:, :n].gather(2, index).squeeze(2) / q.gather(2, index).squeeze(2)  # (B, n)
        accepted = (torch.rand_like(ratio) < ratio).long().cumprod(dim=1).sum(dim=1)
        # the next token: from max(0, p - q) at the first rejection, from p after the last proposal
        at = accepted.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
        p_next = p.gather(1, at).squeeze(1)
        q_next = F.pad(q, (0, 0, 0, 1)).gather(1, at).squeeze(1)  # zeros after the last proposal
        residual = (p_next - q_next).clamp(min=0)
        return accepted, draw(residual / residual.sum(dim=-1, keepdim=True))

    def _stopped(self, row: list[int]) -> bool:
        return any(t in self.stop_ids for t in row)

    def _cut(self, row: list[int], max_new_tokens: int) -> list[int]:
        row = row[:max_new_tokens]
        for i, token in enumerate(row):
            if token in self.stop_ids:
                return row[: i + 1]
        return row
