"""Command-line plumbing shared by every tool: one-line user errors, one exit code, comma lists, JSON files,
prompt files.

Every mistake a user can make (a bad flag, a missing checkpoint, a corrupt file, data that `make`
has not fetched) raises UserError or a subclass of it; `main` prints it as one line on stderr and
exits with USER_ERROR. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

USER_ERROR = 2  # exit status of every tool for a user mistake (argparse's own convention)


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status USER_ERROR."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): a bad flag raises UserError like any other mistake."""

    def error(self, message: str):
        raise UserError(message)


def main(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], Optional[int]],
         argv: Optional[Sequence[str]] = None) -> int:
    """Parse argv and run; a UserError becomes `prog: error: message` on stderr and exit status USER_ERROR."""
    try:
        return run(parser.parse_args(argv)) or 0
    except UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)  # argparse type: an integer >= 1
non_negative_int = _int_at_least(0)  # argparse type: an integer >= 0


def int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; UserError unless every item is an integer >= minimum."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(x < minimum for x in values):
        raise UserError(f"{flag} must list integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def name_list(text: str, flag: str, allowed: Sequence[str]) -> list[str]:
    """'a,b' -> ['a', 'b'] (duplicates dropped); UserError for an empty list or a name not in allowed."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in names if x not in allowed]
    if not names or bad:
        raise UserError(f"unknown {flag} value {', '.join(map(repr, bad)) or repr(text)} "
                        f"(choose from {', '.join(allowed)})")
    return names


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None: strict JSON parsers (jq, JavaScript)
    reject Python's NaN / Infinity, and "nothing measured" reads as null in every tool's output."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def json_text(value: Any, indent: Optional[int] = 2, default: Optional[Callable] = None) -> str:
    """Strict JSON text (no NaN or Infinity, see finite_json) of `value`."""
    return json.dumps(finite_json(value), indent=indent, allow_nan=False, default=default)


def write_json(path: Path, value: Any, flag: str = "--json", default: Optional[Callable] = None) -> None:
    """Write `value` as strict JSON to `path` whole or not at all (a temporary file renamed over it);
    an unwritable path is a UserError naming `flag`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json_text(value, default=default) + "\n")
        tmp.replace(path)
    except OSError as e:
        raise UserError(f"cannot write {flag} {path}: {e.strerror}") from None


@dataclass
class Prompt:
    text: str
    chat: bool


def read_prompts(prompt: str, prompt_file: Optional[Path], chat: bool) -> list[Prompt]:
    """The prompts of a command line: `prompt` (--prompt), or those of --prompt-file: a .jsonl file of
    {"prompt": ..., "chat": ...} lines ("chat" optional, default `chat`), any other file one prompt,
    its whole text. One-line errors."""
    if prompt_file is None:
        if not prompt.strip():
            raise UserError("the prompt is empty")
        return [Prompt(prompt, chat)]
    try:
        text = prompt_file.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read --prompt-file: {e.strerror}: {prompt_file}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt-file {prompt_file} is not UTF-8 text (byte {e.start})") from None
    if prompt_file.suffix != ".jsonl":
        if not text.strip():
            raise UserError(f"--prompt-file {prompt_file} is empty")
        return [Prompt(text, chat)]
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{prompt_file}:{number}: not JSON ({e.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise UserError(f'{prompt_file}:{number}: expected {{"prompt": "<non-empty text>"}}')
        prompts.append(Prompt(entry["prompt"], bool(entry.get("chat", chat))))
    if not prompts:
        raise UserError(f"--prompt-file {prompt_file} holds no prompt")
    return prompts


class OneTimeWork:
    """`with OneTimeWork("building the fused CPU kernels"):` says a slow one-time step on one line of stderr:
    the words, then (on a terminal) the seconds as they pass, then how long it took; off a terminal, the
    words, then the time once done. A failure ends the line with "failed"."""

    def __init__(self, what: str, stream=None):
        self.what, self.stream = what, stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._stop = None

    def __enter__(self):
        import threading
        import time

        self.start = time.perf_counter()
        print(f"{self.what}...", end="" if self.tty else "\n", file=self.stream, flush=True)
        if self.tty:
            self._stop = threading.Event()

            def tick():
                while not self._stop.wait(1.0):
                    print(f"\r{self.what}... {time.perf_counter() - self.start:.0f} s", end="", file=self.stream,
                          flush=True)

            threading.Thread(target=tick, daemon=True).start()
        return self

    def __exit__(self, kind, value, traceback):
        import time

        if self._stop is not None:
            self._stop.set()
        seconds = time.perf_counter() - self.start
        outcome = "failed" if kind is not None else "done"
        prefix = f"\r{self.what}: " if self.tty else f"{self.what}: "
        print(f"{prefix}{outcome} in {seconds:.0f} s", file=self.stream, flush=True)
        return False
