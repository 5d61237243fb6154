"""The evaluation tasks: one record per task (its metrics, how its examples are built, how they are
scored, when a generation is finished). `python -m evals` is the harness that runs them against the decode
policies; adding a task is one builder, one scorer and one TASKS entry.

Tasks (offline data only; examples are built by token count, so a batch shares one length):
  needle      Paul Graham essays with a needle at a depth: the paper's San Francisco sentence or a
              numeric pass key. Chat prompt. exact_match (the answer contains the key phrase) and
              answer_nll (mean NLL per token, nats, of the reference answer, teacher-forced).
              With --depths (percent), --examples at each of those depths: the needle map.
  repetition  Shakespeare context (>= 6000 characters), then a --repetition-passage (256) character
              passage from inside it (the paper's Appendix G.1.4 format); chars = characters generated
              greedily before diverging from the true continuation (at most --repetition-chars).
  bpc         bits per character of --bpc-tokens tokens of essay continuing a long essay context, and their
              answer_nll (nats per token: a paired difference d from dense is a perplexity ratio of exp(d)).
              Every continuation token is decoded by the policy (teacher-forced): with --bpc-tokens 4096
              and --lengths 512, the long-output regime.
  retrieval   synthetic multi-key retrieval (RULER niah_multikey style), deterministic from --seed:
              --retrieval-keys key-value sentences ("One of the special magic numbers for
              quiet-harbor is: 4821937.") in an essay haystack; asked for one key's value.
              exact_match and answer_nll, as for needle.
  ruler-mk    RULER's multi-key needle (niah_multikey): the retrieval task above under RULER's name.
  ruler-mv    RULER-style multi-value: one key with 4 magic numbers at spread depths, all asked.
  ruler-mq    RULER-style multi-query: 4 keys with a magic number each, all asked at once.
  ruler-vt    RULER-style variable tracking: a chain VAR ABCDE = 12345, VAR FGHIJ = VAR ABCDE, ... (4
              hops) scattered through an essay haystack; asked which variables hold the value.
  ruler-cwe   RULER-style common-word extraction: a numbered list of essay words in which 10 fill 30%
              of the entries (the rest appear at most 3 times each); asked for the 10 most common.
              The ruler-mv/mq/vt/cwe scores: recall (the fraction of the answers the greedy text holds
              as whole words, RULER's string-match-all) and exact_match (all of them).
  diagnostics on real activations at one decode step after an essay context: topk_agreement of
              SparQ's approximate and exact scores (top --sparq-k, group-summed, per layer),
              attn_rel_l2 of each policy's attention output vs dense (per layer, dense inputs),
              and top1_agreement of the next-token argmax with dense over 16 teacher-forced steps
              (scored by the harness's probes, not by a scorer here).
  squad       the paper's headline task (evals/squad.py): SQuAD v1.1 1-shot with confusion paragraphs from
              other articles (--squad-contexts of them: 7 by default, about 1.5k tokens), plain-text
              prompt ending in "Answer:", greedy answer to the end of the line; exact_match and f1
              with SQuAD's official normalisation, against any reference. Prompts differ in length:
              a batch is ragged (every row at its own positions).
  squad-diagnostics  the diagnostics above on SQuAD prompts (the paper's Figure 4e), teacher-forcing
              the first reference answer.
"""
from __future__ import annotations

import collections
import math
import random
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Optional

import data
from evals import squad
from cli import UserError

SF_NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
SF_QUESTION = "What is the best thing to do in San Francisco?"
SF_PREFIX = "The best thing to do in San Francisco is"
SF_KEY = "Dolores Park"


# =============================================================================================
# Scoring
# =============================================================================================


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def contains_key(generated: str, key: str) -> bool:
    """Exact match for needle / retrieval: the answer contains the key phrase (case and spacing ignored)."""
    return normalize(key) in normalize(generated)


def repetition_chars(generated: str, reference: str) -> int:
    """Characters generated before the output diverges from the true continuation."""
    n = 0
    for a, b in zip(generated, reference):
        if a != b:
            break
        n += 1
    return n


def answer_nll(logprobs: list[float]) -> float:
    """Mean negative log-likelihood per token (nats) of a teacher-forced reference."""
    return -sum(logprobs) / len(logprobs)


def bits_per_character(logprobs: list[float], n_chars: int) -> float:
    """sum of -log2 p over the tokens / characters they spell (logprobs in nats)."""
    return -sum(logprobs) / math.log(2) / n_chars



# =============================================================================================
# Examples of an exact token length
# =============================================================================================


@dataclass
class Example:
    prompt: list[int]
    answer: list[int] = field(default_factory=list)  # teacher-forced reference (NLL / BPC)
    answer_chars: int = 0
    key: str = ""  # exact-match key phrase (needle, retrieval)
    continuation: str = ""  # true continuation (repetition)
    max_new: int = 0  # greedy tokens (0: no generation)
    meta: dict = field(default_factory=dict)


def fit_length(build: Callable[[int], Optional[list[int]]], length: int, overhead: Optional[int] = None
               ) -> Optional[list[int]]:
    """Find n such that build(n) (a prompt with n body tokens) has exactly `length` tokens.

    overhead: tokens outside the body (default: len(build(0))). None if no n works.
    """
    if overhead is None:
        base = build(0)
        if base is None:
            return None
        overhead = len(base)
    n = length - overhead
    tried = set()
    for _ in range(12):
        if n < 0 or n in tried:
            break
        tried.add(n)
        ids = build(n)
        if ids is None:
            return None
        if len(ids) == length:
            return ids
        n += length - len(ids)
    for m in range(n + 3, n - 4, -1):  # retokenization at the seams can oscillate: scan nearby
        if m >= 0 and m not in tried:
            ids = build(m)
            if ids is not None and len(ids) == length:
                return ids
    return None


def example_rng(task: str, seed: int, length: int, index: int, attempt: int = 0) -> random.Random:
    return random.Random(f"{task}/{seed}/{length}/{index}/{attempt}")


def chat_prompt(tokenizer, user_text: str, answer_prefix: str) -> list[int]:
    """The instruct chat template around a user message, then the start of the assistant's answer."""
    return tokenizer.encode_prompt(user_text, chat=True) + tokenizer.encode(answer_prefix)


def insert_at_depth(text: str, needle: str, depth: float) -> str:
    """Insert `needle` at a sentence boundary near `depth` (0..1) of text."""
    at = int(len(text) * depth)
    cut = text.rfind(". ", 0, at)
    cut = 0 if cut < 0 else cut + 2
    return text[:cut] + needle + " " + text[cut:]


class TextSource:
    """A long text, tokenized in windows on demand (cached)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    def window(self, start_char: int, n_tokens: int) -> list[int]:
        """At least n_tokens tokens of text starting at a word boundary at or after start_char."""
        start = self.text.find(" ", start_char) + 1 if start_char > 0 else 0
        chars = 6 * n_tokens + 1000
        while True:
            ids = self.tokenizer.encode(self.text[start:start + chars])
            if len(ids) >= n_tokens or start + chars >= len(self.text):
                return ids
            chars *= 2


def needle_examples(tokenizer, length: int, n: int, seed: int, depths: Optional[tuple[float, ...]] = None
                    ) -> list[Example]:
    """n needle examples, the two variants (the San Francisco sentence, a pass key) alternating, at depths
    spread over the haystack (both variants at each). depths (percent, --depths): n examples at each of
    those depths instead, for the needle map (0 = at the start of the haystack, 100 = at its end, at
    the sentence boundary insert_at_depth takes). Example i at every depth is example i of one
    haystack, variant and key, the needle moved: a column of the map differs in depth alone. Their
    meta["depth_percent"] (absent without depths) is the depth the map groups by."""
    if depths is not None:
        return [example for d in depths
                for example in _needle_examples(tokenizer, length, n, seed, lambda i: d / 100, d)]
    return _needle_examples(tokenizer, length, n, seed, lambda i: (i // 2 + 0.5) / math.ceil(n / 2))


def _needle_examples(tokenizer, length: int, n: int, seed: int, depth_of: Callable[[int], float],
                     depth_percent: Optional[float] = None) -> list[Example]:
    source = TextSource(tokenizer, data.essays_text())
    out = []
    for i in range(n):
        depth = depth_of(i)
        for attempt in range(20):
            rng = example_rng("needle", seed, length, i, attempt)
            if i % 2 == 0:
                needle, question, prefix, key = SF_NEEDLE, SF_QUESTION, SF_PREFIX, SF_KEY
                answer = " eat a sandwich and sit in Dolores Park on a sunny day."
                variant = "sf"
            else:
                key = str(rng.randrange(10000, 100000))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."
                question, prefix, answer, variant = "What is the pass key?", "The pass key is", f" {key}.", "passkey"
            body = source.window(rng.randrange(0, len(source.text) - 8 * length), length + 200)

            def build(m: int) -> Optional[list[int]]:
                haystack = insert_at_depth(tokenizer.decode(body[:m]), needle, depth)
                user = (f"{haystack}\n\nAnswer the question using the text above. {question}")
                return chat_prompt(tokenizer, user, prefix)

            ids = fit_length(build, length)
            if ids is not None:
                break
        else:
            raise UserError(f"cannot build a needle example of exactly {length} tokens")
        meta = {"variant": variant, "depth": round(depth, 3)}
        if depth_percent is not None:
            meta["depth_percent"] = depth_percent
        out.append(Example(prompt=ids, answer=tokenizer.encode(answer), key=key, max_new=24, meta=meta))
    return out


ADJECTIVES = ("red blue green black white golden silver quiet loud happy brave calm dark bright cold warm swift slow "
              "tiny giant ancient young wild gentle proud hidden frozen sunny stormy lucky noble rusty sweet bitter "
              "empty busy clever lazy fancy plain royal").split()
NOUNS = ("river mountain tiger falcon garden castle forest ocean candle mirror rocket violin lantern harbor meadow "
         "dragon pirate wizard island bridge tower comet desert canyon engine kettle pencil rabbit turtle hammer "
         "basket anchor ladder window planet guitar compass").split()
MAGIC_KEYS = [f"{a}-{b}" for a in ADJECTIVES for b in NOUNS]  # the magic numbers' keys: word pairs


def retrieval_examples(tokenizer, length: int, n: int, seed: int, n_keys: int = 4) -> list[Example]:
    """Multi-key retrieval (RULER's niah_multikey style), deterministic from the seed: n_keys
    "special magic number" key-value sentences (word-pair keys, 7-digit values) spread through an
    essay haystack; the question asks for one key's value, the others are distractors. (Plain lists of
    hex / uuid keys are beyond the 135M model: 0-12% exact match dense at 2k tokens.)"""
    source = TextSource(tokenizer, data.essays_text())
    out = []
    for i in range(n):
        for attempt in range(20):
            rng = example_rng("retrieval", seed, length, i, attempt)
            words = rng.sample(MAGIC_KEYS, n_keys)
            pairs = [(key, str(rng.randrange(1_000_000, 10_000_000))) for key in words]
            asked = i % n_keys  # depth of the asked key cycles over the examples
            qkey, qvalue = pairs[asked]
            body = source.window(rng.randrange(0, len(source.text) - 8 * length), length + 200)

            def build(m: int) -> Optional[list[int]]:
                haystack = tokenizer.decode(body[:m])
                for j, (key, value) in enumerate(pairs):
                    haystack = insert_at_depth(haystack, f"One of the special magic numbers for {key} is: {value}.",
                                               (j + 0.5) / n_keys)
                user = f"{haystack}\n\nWhat is the special magic number for {qkey} mentioned in the text above?"
                return chat_prompt(tokenizer, user, f"The special magic number for {qkey} is")

            ids = fit_length(build, length)
            if ids is not None:
                break
        else:
            raise UserError(f"cannot build a retrieval example of exactly {length} tokens")
        out.append(Example(prompt=ids, answer=tokenizer.encode(f" {qvalue}."), key=qvalue, max_new=14,
                           meta={"key": qkey, "depth": round((asked + 0.5) / n_keys, 3), "keys": n_keys}))
    return out


def repetition_examples(tokenizer, length: int, n: int, seed: int, continuation_chars: int = 256,
                        passage_chars: int = 256) -> list[Example]:
    """The paper's text repetition (Appendix G.1.4): a Shakespeare context, then a passage from inside
    it; the model should continue it verbatim."""
    plays = data.shakespeare_texts()
    names = sorted(name for name, text in plays.items() if len(text) > 10 * length)
    if not names:
        raise UserError(f"no Shakespeare text is long enough for --lengths {length}")
    out = []
    for i in range(n):
        for attempt in range(20):
            rng = example_rng("repetition", seed, length, i, attempt)
            name = names[(i + attempt) % len(names)]
            source = TextSource(tokenizer, plays[name])
            window = source.window(rng.randrange(len(plays[name]) // 20, len(plays[name]) - 9 * length), length)
            context = tokenizer.decode(window[:length])
            if len(context) < 6000:  # this play tokenizes too densely at this length: try the next one
                continue
            # A passage starting at a line, >= passage_chars, ending before a space, in the first 70%.
            start = context.find("\n", rng.randrange(0, int(0.7 * len(context)) - passage_chars - continuation_chars)) + 1
            while context[start] in "\r\n ":
                start += 1
            end = context.find(" ", start + passage_chars)
            passage = context[start:end]
            continuation = context[end:end + continuation_chars]
            if len(continuation) < continuation_chars or "\n\n\n" in passage:
                continue

            def build(m: int) -> Optional[list[int]]:
                ctx = tokenizer.decode(window[:m])
                if len(ctx) < max(6000, end + continuation_chars):
                    return None  # too short: try another window
                return tokenizer.encode(f"{ctx}\n\n{passage}")

            ids = fit_length(build, length, overhead=len(tokenizer.encode(f"\n\n{passage}")))
            if ids is not None:
                break
        else:
            raise UserError(f"cannot build a repetition example of exactly {length} tokens with >= 6000 characters "
                            f"of context (use --lengths 2048 or more)")
        max_new = len(tokenizer.encode(continuation)) + 8
        out.append(Example(prompt=ids, continuation=continuation, max_new=max_new,
                           meta={"play": name, "passage": passage}))
    return out


def bpc_examples(tokenizer, length: int, n: int, seed: int, continuation_tokens: int = 64,
                 task: str = "bpc") -> list[Example]:
    """Essay context of `length` tokens, then the next continuation_tokens tokens, teacher-forced."""
    source = TextSource(tokenizer, data.essays_text())
    out = []
    for i in range(n):
        rng = example_rng(task, seed, length, i)
        ids = source.window(rng.randrange(0, len(source.text) - 8 * (length + continuation_tokens)),
                            length + continuation_tokens)
        answer = ids[length:length + continuation_tokens]
        out.append(Example(prompt=ids[:length], answer=answer, answer_chars=len(tokenizer.decode(answer))))
    return out




# =============================================================================================
# RULER-style tasks (Hsieh et al., 2024): generated from the essays and a seed; the answers
# (meta["answers"]) are strings the prompt holds. ruler-mk is the retrieval task above.
# =============================================================================================

RULER_MAGIC = "One of the special magic numbers for {key} is: {value}."


def _fit(task: str, tokenizer, length: int, seed: int, index: int, make) -> tuple[list[int], dict]:
    """make(rng) -> (build, meta, valid): build(m) the prompt with m body tokens (or None), valid(ids)
    whether a prompt holds a well-posed example. The first attempt that fits `length` and is valid."""
    for attempt in range(20):
        build, meta, valid = make(example_rng(task, seed, length, index, attempt))
        ids = fit_length(build, length)
        if ids is not None and valid(ids):
            return ids, meta
    raise UserError(f"cannot build a {task} example of exactly {length} tokens")


def _always(ids: list[int]) -> bool:
    return True


def _essay_body(source: TextSource, rng, length: int) -> list[int]:
    """length + 200 tokens of essay from a random start: the haystack to cut."""
    return source.window(rng.randrange(0, len(source.text) - 8 * length), length + 200)


def _seven_digits(rng) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _example(ids: list[int], answers: list[str], max_new: int, meta: dict) -> Example:
    return Example(prompt=ids, max_new=max_new, meta={**meta, "answers": answers})


def _all_magic_numbers_examples(task: str, tokenizer, length: int, n: int, seed: int, n_needles: int,
                                draw_keys) -> list[Example]:
    """n_needles magic-number sentences at spread depths, their keys from draw_keys(rng) (one key
    repeated: multi-value; distinct keys: multi-query); every value asked at once."""
    source = TextSource(tokenizer, data.essays_text())
    out = []
    for i in range(n):
        def make(rng):
            keys = draw_keys(rng)
            values = [_seven_digits(rng) for _ in keys]
            body = _essay_body(source, rng, length)
            one_key = len(set(keys)) == 1
            asked = keys[0] if one_key else ", ".join(keys[:-1]) + f", and {keys[-1]}"

            def build(m: int) -> Optional[list[int]]:
                haystack = tokenizer.decode(body[:m])
                for j, (key, value) in enumerate(zip(keys, values)):
                    haystack = insert_at_depth(haystack, RULER_MAGIC.format(key=key, value=value), (j + 0.5) / n_needles)
                user = f"{haystack}\n\nWhat are all the special magic numbers for {asked} mentioned in the text above?"
                return chat_prompt(tokenizer, user, f"The special magic numbers for {asked} mentioned in the text are")
            return build, {("key" if one_key else "keys"): keys[0] if one_key else keys, "values": values}, _always
        ids, meta = _fit(task, tokenizer, length, seed, i, make)
        out.append(_example(ids, meta.pop("values"), 12 * n_needles, meta))
    return out


def multivalue_examples(tokenizer, length: int, n: int, seed: int, n_values: int = 4) -> list[Example]:
    return _all_magic_numbers_examples("ruler-mv", tokenizer, length, n, seed, n_values,
                                       lambda rng: [rng.choice(MAGIC_KEYS)] * n_values)


def multiquery_examples(tokenizer, length: int, n: int, seed: int, n_queries: int = 4) -> list[Example]:
    return _all_magic_numbers_examples("ruler-mq", tokenizer, length, n, seed, n_queries,
                                       lambda rng: rng.sample(MAGIC_KEYS, n_queries))


def _variable_name(rng) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def variable_tracking_examples(tokenizer, length: int, n: int, seed: int, hops: int = 4) -> list[Example]:
    """One chain of hops + 1 variables holding a 5-digit value, one statement per depth, in order."""
    source = TextSource(tokenizer, data.essays_text())
    out = []
    for i in range(n):
        def make(rng):
            names: list[str] = []
            while len(names) < hops + 1:
                name = _variable_name(rng)
                if name not in names:
                    names.append(name)
            value = str(rng.randrange(10000, 100000))
            statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j]} = VAR {names[j - 1]}."
                                                           for j in range(1, hops + 1)]
            body = _essay_body(source, rng, length)

            def build(m: int) -> Optional[list[int]]:
                haystack = tokenizer.decode(body[:m])
                for j, s in enumerate(statements):
                    haystack = insert_at_depth(haystack, s, (j + 0.5) / len(statements))
                user = (f"Memorize and track the chain of variable assignments hidden in the following text.\n\n"
                        f"{haystack}\n\nQuestion: Find all variables that are assigned the value {value} in the text "
                        f"above.")
                return chat_prompt(tokenizer, user, f"According to the chain of variable assignments in the text "
                                                    f"above, {hops + 1} variables are assigned the value {value}, "
                                                    f"they are:")
            return build, {"names": names, "value": value}, _always
        ids, meta = _fit("ruler-vt", tokenizer, length, seed, i, make)
        out.append(_example(ids, meta.pop("names"), 8 * (hops + 1), meta))
    return out


def _essay_words() -> list[str]:
    """Distinct lowercase words of 4-10 letters from the essays, in order of first use."""
    return list(dict.fromkeys(w for w in re.findall(r"[a-z]{4,10}", data.essays_text())))


def common_words_examples(tokenizer, length: int, n: int, seed: int, n_common: int = 10) -> list[Example]:
    """A numbered list, shuffled, in which n_common words fill 30% of the entries and every other word
    appears at most 3 times; cut to the length in tokens, the answers are the n_common most frequent
    words of the list as cut (an attempt whose cut leaves them tied with another word is redrawn)."""
    vocabulary = _essay_words()
    out = []
    for i in range(n):
        def make(rng):
            words = rng.sample(vocabulary, len(vocabulary))
            common, rare = words[:n_common], words[n_common:]
            entries = max(64, length)  # at least one token per entry: more than any cut keeps
            n_common_each = max(1, int(0.3 * entries) // n_common)
            items = [w for w in common for _ in range(n_common_each)]
            items += [w for w in rare[: (entries - len(items)) // 3 + 1] for _ in range(3)][: entries - len(items)]
            rng.shuffle(items)
            body = tokenizer.encode("\n".join(f"{j + 1}. {w}" for j, w in enumerate(items)))

            def build(m: int) -> Optional[list[int]]:
                user = ("Below is a numbered list of words. In these words, some appear more often than others. "
                        f"Memorize the ones that appear most often.\n{tokenizer.decode(body[:m])}\n"
                        f"Question: What are the {n_common} most common words in the above list?")
                return chat_prompt(tokenizer, user, f"The top {n_common} words that appear most often in the list are:")

            def valid(ids: list[int]) -> bool:
                counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)", tokenizer.decode(ids)))
                ranked = counts.most_common()
                return len(ranked) > n_common and ranked[n_common - 1][1] > ranked[n_common][1] and \
                    {w for w, _ in ranked[:n_common]} == set(common)
            return build, {"common": common}, valid
        ids, meta = _fit("ruler-cwe", tokenizer, length, seed, i, make)
        out.append(_example(ids, meta.pop("common"), 6 * n_common, meta))
    return out


def _answers_found(example: Example, text: str) -> list[bool]:
    """Which of the example's answers the text holds as whole words (case and spacing ignored)."""
    text = normalize(text)
    return [re.search(rf"(?<![0-9a-z]){re.escape(normalize(a))}(?![0-9a-z])", text) is not None
            for a in example.meta["answers"]]


def _score_all(example: Example, outcome: Outcome) -> dict[str, float]:
    """recall: the fraction of the example's answers the greedy text holds (RULER's string-match-all);
    exact_match: all of them."""
    found = _answers_found(example, outcome.text)
    return {"recall": sum(found) / len(found), "exact_match": float(all(found))}


def _has_all(example: Example, text: str) -> bool:
    """A RULER row is done once it holds every answer."""
    return all(_answers_found(example, text))


# =============================================================================================
# The tasks
# =============================================================================================


@dataclass
class TaskOptions:
    """Per-task settings from the harness's flags."""

    bpc_tokens: int = 64
    repetition_chars: int = 256
    repetition_passage: int = 256
    retrieval_keys: int = 4
    needle_depths: Optional[tuple[float, ...]] = None  # --depths (percent): the needle map's depths



@dataclass
class Outcome:
    """What one decode policy produced for one example: the teacher-forced log-probs of its answer
    (nats per token, when it has one) and the greedy text (when it generates)."""

    logprobs: Optional[list[float]] = None
    text: Optional[str] = None


@dataclass(frozen=True)
class Task:
    name: str
    metrics: tuple[tuple[str, bool], ...]  # (metric, higher is better)
    build: Callable[[object, int, int, int, TaskOptions], list[Example]]  # (tokenizer, size, n, seed, options)
    score: Optional[Callable[[Example, Outcome], dict[str, float]]]  # None: the harness scores (diagnostics)
    finished: Callable[[Example, str], bool] = lambda example, text: False  # a greedy row is done
    size: str = "tokens"  # what `size` means: the prompt length in tokens, or "contexts" (SQuAD's paragraphs)
    default_sizes: tuple[int, ...] = (2048,)

    @property
    def equal_lengths(self) -> bool:
        """Every prompt of one size has the same length (a task sized in tokens); SQuAD's vary."""
        return self.size == "tokens"


def _answers_question(example: Example, text: str) -> bool:
    """Needle and retrieval answers are one short sentence: done at the key, a newline or a full stop."""
    return contains_key(text, example.key) or "\n" in text or "." in text.strip()[1:]


def _diverged(example: Example, text: str) -> bool:
    ref = example.continuation
    return len(text) >= len(ref) or not ref.startswith(text[:len(ref)])


def _score_question(example: Example, outcome: Outcome) -> dict[str, float]:
    return {"answer_nll": answer_nll(outcome.logprobs), "exact_match": float(contains_key(outcome.text, example.key))}


def squad_examples(tokenizer, n_confusion: int, n: int, seed: int, diagnostics: bool = False) -> list[Example]:
    """n SQuAD questions (evals/squad.py) with n_confusion confusion paragraphs, as plain-text prompts (the
    paper's format, also for instruct models: the comparison between methods is the point). For
    the diagnostics the first reference answer and the newline are teacher-forced."""
    articles = squad.load()
    out = []
    for ex in squad.iter_examples(articles, n, n_confusion, seed):
        answer = tokenizer.encode(" " + ex.answers[0] + "\n") if diagnostics else []
        out.append(Example(prompt=tokenizer.encode_prompt(ex.prompt, chat=False), answer=answer,
                           max_new=0 if diagnostics else 24,
                           meta={"id": ex.id, "answers": ex.answers, "title": ex.title}))
    return out


def _score_squad(example: Example, outcome: Outcome) -> dict[str, float]:
    answer = squad.answer_from_generation(outcome.text)
    return {"exact_match": float(squad.exact_match(answer, example.meta["answers"])),
            "f1": squad.f1(answer, example.meta["answers"])}


def _line_ended(example: Example, text: str) -> bool:
    """A SQuAD answer ends with its line (leading spaces and newlines before any text do not count)."""
    return "\n" in text.lstrip()


TASKS: dict[str, Task] = {task.name: task for task in (
    Task("needle", (("exact_match", True), ("answer_nll", False)),
         lambda tok, length, n, seed, o: needle_examples(tok, length, n, seed, o.needle_depths),
         _score_question, _answers_question),
    Task("repetition", (("chars", True),),
         lambda tok, length, n, seed, o: repetition_examples(tok, length, n, seed, o.repetition_chars,
                                                             o.repetition_passage),
         lambda e, out: {"chars": repetition_chars(out.text, e.continuation)}, _diverged),
    Task("bpc", (("bpc", False), ("answer_nll", False)),
         lambda tok, length, n, seed, o: bpc_examples(tok, length, n, seed, o.bpc_tokens),
         lambda e, out: {"bpc": bits_per_character(out.logprobs, e.answer_chars),
                         "answer_nll": answer_nll(out.logprobs)}),
    Task("retrieval", (("exact_match", True), ("answer_nll", False)),
         lambda tok, length, n, seed, o: retrieval_examples(tok, length, n, seed, o.retrieval_keys),
         _score_question, _answers_question),
    Task("ruler-mk", (("exact_match", True), ("answer_nll", False)),
         lambda tok, length, n, seed, o: retrieval_examples(tok, length, n, seed, o.retrieval_keys),
         _score_question, _answers_question),
    Task("ruler-mv", (("recall", True), ("exact_match", True)),
         lambda tok, length, n, seed, o: multivalue_examples(tok, length, n, seed), _score_all, _has_all),
    Task("ruler-mq", (("recall", True), ("exact_match", True)),
         lambda tok, length, n, seed, o: multiquery_examples(tok, length, n, seed), _score_all, _has_all),
    Task("ruler-vt", (("recall", True), ("exact_match", True)),
         lambda tok, length, n, seed, o: variable_tracking_examples(tok, length, n, seed), _score_all, _has_all),
    Task("ruler-cwe", (("recall", True), ("exact_match", True)),
         lambda tok, length, n, seed, o: common_words_examples(tok, length, n, seed), _score_all, _has_all),
    Task("diagnostics", (("topk_agreement", True), ("attn_rel_l2", False), ("top1_agreement", True)),
         lambda tok, length, n, seed, o: bpc_examples(tok, length, n, seed, continuation_tokens=17, task="diagnostics"),
         None),
    Task("squad", (("exact_match", True), ("f1", True)),
         lambda tok, contexts, n, seed, o: squad_examples(tok, contexts, n, seed),
         _score_squad, _line_ended, size="contexts", default_sizes=(7,)),
    Task("squad-diagnostics", (("topk_agreement", True), ("attn_rel_l2", False), ("top1_agreement", True)),
         lambda tok, contexts, n, seed, o: squad_examples(tok, contexts, n, seed, diagnostics=True),
         None, size="contexts", default_sizes=(7,)),
)}
