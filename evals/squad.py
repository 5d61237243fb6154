"""SQuAD v1.1 1-shot with confusion contexts: the SparQ paper's headline QA task (Figure 1,
Table 2, Figure 6; prompt format in Appendix G.1.1).

Data: the SQuAD v1.1 dev set (CC BY-SA 4.0) as BIG-bench ships it, taken from the `bigbench==1.0.0`
sdist on PyPI (`pip download --no-deps --no-binary bigbench`, 358 MB, never installed) and cached
outside the repo, in $SPARQ_FAST_CACHE or ~/.cache/sparq-fast (`python -m evals.squad fetch`, `make squad`):
    <cache>/squad/bigbench-1.0.0.tar.gz   the sdist (kept; delete it once the JSON is there)
    <cache>/squad/squaddev_v1.1.json      bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/
It is the original dev-v1.1.json (48 articles, 2,067 paragraphs) except that BIG-bench removed 46
reference answers its output regex could not produce (e.g. "FCC v. Pacifica Foundation", and 3
empty ones; listed in squaddev_v1.1_removed.json) and so the 5 questions left with none: 10,565
questions (not 10,570), 34,680 answers (not 34,726), 1 to 6 per question (mostly 3, duplicates
included). fetch() checks the extracted file's sha256.

Prompt, as in Appendix G.1.1 (one line each, joined by "\n"):
    Title: <title>. Background: <paragraph>          x (1 + n_confusion), seeded order
    From what you've just read about <title>, please answer the following questions.
    Question: <another question on the target paragraph>
    Answer: <its first reference answer>
    Question: <target question>
    Answer:
The model greedy-decodes after "Answer:" until the end of the line; answer_from_generation() takes
that line. Score with exact_match() (the paper's accuracy) and f1(), both max over the references
exactly as SQuAD's official evaluate-v1.1.py computes them (normalize_answer: lower case, drop
ASCII punctuation, drop the words a/an/the, collapse whitespace; unicode punctuation such as
"–" or "’" is kept, as there). The prompt is plain text without BOS: the caller tokenizes. A chat
model would get the whole prompt as its single user message (`tokenizer.encode_prompt(prompt,
chat=True)`) and the first line of its reply as the answer; the harness decides which to use.
For Pythia the paper used "Single-word answer:" for the last line (`answer_prefix`).

Choices where the paper is silent (or that the brief fixed):
- Confusion paragraphs come from other articles only (exclude_target_article=True). The paper's
  own example is looser: it holds a second paragraph of the target's article ("Fresno,
  California" twice); exclude_target_article=False draws from every paragraph but the target.
  Several confusion paragraphs may come from one article (the example has "Oxygen" twice).
- Titles are rendered human-readable: underscores become spaces ("Super_Bowl_50" -> "Super Bowl
  50"), as the paper's example shows ("Fresno, California", "Sky (United Kingdom)").
- Whitespace runs in paragraphs, questions and the 1-shot answer collapse to one space, so every
  context is one line (28 paragraphs hold newlines, e.g. "O\\n2" for O2; 344 questions have stray
  leading/trailing spaces).
- Questions: those whose paragraph has at least one other question with a different text
  (10,554 of 10,565), in a seeded permutation; example `index` of `seed` is the index-th of that
  permutation, so the first n examples are a sample without replacement. The 1-shot is a random
  other question of the same paragraph (never one with the same text) with its first answer.
- Per example, a random.Random seeded by (seed, index) shuffles the candidate paragraphs and takes
  the first n_confusion, then puts the target at a uniform position among them: examples depend on
  (seed, index, n_confusion) only, and the 7-context prompt's paragraphs are a subset of the 15's.
- Figure 6 used SQuAD *train*; only dev is here, so the length sweep runs on dev.
Prompt lengths with SmolLM2's tokenizer (seed 0, first 300 examples, median [min, max]): 1,445
[1,006, 2,226] / 2,847 [2,217, 3,892] / 5,652 [4,549, 7,030] / 11,259 [9,885, 13,231] tokens for
7 / 15 / 31 / 63 confusion contexts (`python -m evals.squad lengths`). Reference answers are short
(median 4 tokens, 99th percentile 21): a harness can stop at a newline or after ~32 new tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import cli
import data

SDIST = "bigbench==1.0.0"
SDIST_FILE = "bigbench-1.0.0.tar.gz"
MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
JSON_FILE = "squaddev_v1.1.json"
JSON_SHA256 = "45089eff3cf52004b1dca6814cde5c57082fdb09872f18c79a5d944d45be523a"


@dataclass
class QA:
    id: str
    question: str
    answers: list[str]


@dataclass
class Paragraph:
    context: str
    qas: list[QA]


@dataclass
class Article:
    title: str  # as in the file, e.g. "Super_Bowl_50"
    paragraphs: list[Paragraph]


@dataclass
class SquadExample:
    prompt: str
    answers: list[str]  # all references, as in the file
    id: str  # the target question's SQuAD id
    question: str
    title: str  # human-readable title of the target's article
    article: int  # index of the target's article in the list
    paragraph: int  # index of the target paragraph in its article
    shot_id: str  # SQuAD id of the 1-shot question
    target_position: int  # where the target paragraph is among the 1 + n_confusion contexts
    confusion: list[tuple[int, int]] = field(default_factory=list)  # (article, paragraph), prompt order
    confusion_titles: list[str] = field(default_factory=list)


# ---- data ----

def default_cache_dir() -> Path:
    return data.cache_dir()


def default_path() -> Path:
    return default_cache_dir() / "squad" / JSON_FILE


class FetchError(cli.UserError):
    """fetch() failed; the message is one line."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_sdist(target: Path) -> None:
    """pip download the bigbench sdist into target (via a temporary dir next to it)."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        print(f"squad: downloading {SDIST} (358 MB sdist, data only, never installed) ...", flush=True)
        # --no-binary for this package alone: `:all:` would have pip build the sdist's build tools from source
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST.split("==")[0],
               "--progress-bar", "on", "-d", tmp, SDIST]
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)  # progress goes to stdout
        if proc.returncode != 0:
            lines = [l.strip() for l in proc.stderr.splitlines() if l.strip()]
            errors = [l for l in lines if l.startswith("ERROR")] or lines or ["(no message)"]
            raise FetchError(f"pip download {SDIST} failed (exit {proc.returncode}): {errors[-1]}")
        got = Path(tmp) / SDIST_FILE
        if not got.is_file():
            raise FetchError(f"pip download {SDIST} did not produce {SDIST_FILE}")
        os.replace(got, target)


def _extract(sdist: Path, target: Path) -> None:
    """Extract MEMBER from the sdist to target, via target.tmp, checking its sha256."""
    print(f"squad: extracting {JSON_FILE} from {sdist.name} ...", flush=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            member = next((m for m in tar if m.name == MEMBER), None)
            if member is None:
                raise FetchError(f"{MEMBER} is not in {sdist}")
            with tar.extractfile(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        digest = _sha256(tmp)
        if digest != JSON_SHA256:
            raise FetchError(f"{MEMBER} has sha256 {digest}, expected {JSON_SHA256}")
        os.replace(tmp, target)
    except (OSError, tarfile.TarError, EOFError) as e:
        raise FetchError(f"cannot extract {MEMBER} from {sdist} (delete it to download again): {e}") from e
    finally:
        tmp.unlink(missing_ok=True)


def fetch(cache_dir: Optional[Path] = None) -> Path:
    """Path of the SQuAD v1.1 dev JSON, downloading and extracting it first if needed. Idempotent;
    every file is written under a temporary name and renamed, so nothing is ever half-written."""
    directory = Path(cache_dir or default_cache_dir()) / "squad"
    target = directory / JSON_FILE
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create {directory}: {e}") from e
    sdist = directory / SDIST_FILE
    if not sdist.is_file():
        _download_sdist(sdist)
    _extract(sdist, target)
    print(f"squad: {target}", flush=True)
    return target


def _clean(text: str) -> str:
    return " ".join(text.split())


def load(path: Optional[Path] = None) -> list[Article]:
    """The articles of a SQuAD v1.1-format JSON file (default: where fetch() puts the dev set)."""
    path = Path(path or default_path())
    if not path.is_file():
        raise data.DataMissing(f"{path} is missing (run `make squad` or `python -m evals.squad fetch`)")
    articles = json.loads(path.read_text(encoding="utf-8"))["data"]
    return [Article(a["title"], [Paragraph(p["context"], [QA(q["id"], q["question"], [x["text"] for x in q["answers"]])
                                                         for q in p["qas"]])
                                 for p in a["paragraphs"]])
            for a in articles]


def display_title(title: str) -> str:
    return title.replace("_", " ")


# ---- examples ----

def _shot_candidates(paragraph: Paragraph, qa_index: int) -> list[int]:
    """Other questions of the paragraph usable as the 1-shot: a different id and a different text."""
    target = _clean(paragraph.qas[qa_index].question).lower()
    return [j for j, qa in enumerate(paragraph.qas) if j != qa_index and _clean(qa.question).lower() != target]


def eligible_questions(articles: list[Article]) -> list[tuple[int, int, int]]:
    """(article, paragraph, qa) of every question with a 1-shot candidate, in file order."""
    # A question has a candidate iff its paragraph has two different question texts.
    return [(a, p, q) for a, article in enumerate(articles) for p, paragraph in enumerate(article.paragraphs)
            if len({_clean(qa.question).lower() for qa in paragraph.qas}) > 1 for q in range(len(paragraph.qas))]


def question_order(articles: list[Article], seed: int = 0) -> list[tuple[int, int, int]]:
    """The eligible questions in the seeded order that example indices refer to."""
    order = eligible_questions(articles)
    random.Random(f"squad-order/{seed}").shuffle(order)
    return order


def _context_line(article: Article, paragraph: int) -> str:
    return f"Title: {display_title(article.title)}. Background: {_clean(article.paragraphs[paragraph].context)}"


def _build(articles: list[Article], key: tuple[int, int, int], rng: random.Random, n_confusion: int,
           exclude_target_article: bool, answer_prefix: str) -> SquadExample:
    a, p, q = key
    article, paragraph = articles[a], articles[a].paragraphs[p]
    target, shot = paragraph.qas[q], paragraph.qas[rng.choice(_shot_candidates(paragraph, q))]
    pool = [(i, j) for i, other in enumerate(articles) for j in range(len(other.paragraphs))
            if (i != a if exclude_target_article else (i, j) != (a, p))]
    if not 0 <= n_confusion <= len(pool):
        raise ValueError(f"n_confusion={n_confusion}: between 0 and {len(pool)} paragraphs available")
    rng.shuffle(pool)
    confusion = pool[:n_confusion]
    position = rng.randrange(n_confusion + 1)
    contexts = confusion[:position] + [(a, p)] + confusion[position:]
    title = display_title(article.title)
    lines = [_context_line(articles[i], j) for i, j in contexts]
    lines += [f"From what you've just read about {title}, please answer the following questions.",
              f"Question: {_clean(shot.question)}", f"{answer_prefix} {_clean(shot.answers[0])}",
              f"Question: {_clean(target.question)}", answer_prefix]
    return SquadExample(prompt="\n".join(lines), answers=list(target.answers), id=target.id,
                        question=_clean(target.question), title=title, article=a, paragraph=p, shot_id=shot.id,
                        target_position=position, confusion=confusion,
                        confusion_titles=[display_title(articles[i].title) for i, _ in confusion])


def build_example(articles: list[Article], index: int, n_confusion: int = 7, seed: int = 0, *,
                  exclude_target_article: bool = True, answer_prefix: str = "Answer:") -> SquadExample:
    """Example `index` of the seeded question order, with n_confusion confusion paragraphs."""
    order = question_order(articles, seed)
    return _build(articles, order[index], random.Random(f"squad/{seed}/{index}"), n_confusion,
                  exclude_target_article, answer_prefix)


def iter_examples(articles: list[Article], n: Optional[int] = None, n_confusion: int = 7, seed: int = 0, *,
                  exclude_target_article: bool = True, answer_prefix: str = "Answer:") -> Iterator[SquadExample]:
    """Examples 0 .. n-1 (all eligible questions if n is None); the same as build_example(i) each."""
    order = question_order(articles, seed)
    for index in range(len(order) if n is None else min(n, len(order))):
        yield _build(articles, order[index], random.Random(f"squad/{seed}/{index}"), n_confusion,
                     exclude_target_article, answer_prefix)


# ---- scoring (SQuAD v1.1 official evaluate-v1.1.py, written from its definition) ----

_PUNCTUATION = set(string.punctuation)  # ASCII only, as in the official script
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, remove ASCII punctuation, remove the words a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: list[str]) -> bool:
    """Whether the normalized prediction equals any normalized reference."""
    return any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers)


def _f1(prediction: str, answer: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(answer).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0  # also when both are empty (v1.1; v2.0 scores that 1)
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, answers: list[str]) -> float:
    """Token-overlap F1 of the normalized texts, max over the references."""
    return max((_f1(prediction, answer) for answer in answers), default=0.0)


def answer_from_generation(text: str) -> str:
    """The answer in a generated continuation: up to the first newline, stripped."""
    return text.partition("\n")[0].strip()


# ---- CLI ----

def _lengths(args) -> None:
    from tokenizer import load_tokenizer
    tokenizer, articles = load_tokenizer(args.checkpoint), load(args.path)
    for n_confusion in args.n_confusion:
        counts = sorted(len(tokenizer.encode(ex.prompt))
                        for ex in iter_examples(articles, args.n, n_confusion, args.seed))
        print(f"n_confusion={n_confusion:3d}: tokens min {counts[0]}, median {counts[len(counts) // 2]}, "
              f"mean {sum(counts) / len(counts):.0f}, max {counts[-1]} ({len(counts)} examples)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = cli.ArgumentParser(prog="python -m evals.squad",
                                description="SQuAD v1.1 1-shot with confusion contexts (SparQ paper, Appendix G.1.1)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=cli.ArgumentParser)
    p = commands.add_parser("fetch", help="download and extract the SQuAD v1.1 dev set into the cache")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $SPARQ_FAST_CACHE or ~/.cache/sparq-fast")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--path", type=Path, default=None, help="default: the fetched dev set")
    common.add_argument("--seed", type=int, default=0)
    p = commands.add_parser("show", parents=[common], help="print one example prompt and its answers")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--n-confusion", type=int, default=7)
    p = commands.add_parser("lengths", parents=[common], help="prompt lengths in tokens")
    p.add_argument("--checkpoint", default="checkpoints/SmolLM2-135M-Instruct")
    p.add_argument("-n", type=int, default=200, help="examples per setting")
    p.add_argument("--n-confusion", type=int, nargs="+", default=[7, 15, 31, 63])
    return cli.main(parser, run, argv)


def run(args: argparse.Namespace) -> int:
    if args.command == "fetch":
        fetch(args.cache_dir)
    elif args.command == "show":
        ex = build_example(load(args.path), args.index, args.n_confusion, args.seed)
        print(ex.prompt)
        print(f"### id {ex.id}, answers {ex.answers}, target context {ex.target_position}")
    else:
        _lengths(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
