"""The journal of a long evaluation: a run of hours continues where it stopped (--resume)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import cli
from cli import UserError


# =============================================================================================
# The journal: a run of hours continues where it stopped (--resume)
# =============================================================================================


def journal_path(json_path: Path) -> Path:
    return json_path.with_name(json_path.name + ".journal.jsonl")


def batch_entries(path: Path) -> list[dict]:
    """A journal's batch lines, in run order, up to a line cut short by a kill (that batch runs again)."""
    entries = []
    for line in path.read_text().split("\n")[1:]:  # after the header naming the run
        try:
            entries.append(json.loads(line))
        except ValueError:
            break  # the cut line, or the end
    return entries


class Journal:
    """Each finished batch's raw results (Results.record), one JSON line per batch after a header line
    naming the run, kept beside --json. With --resume the batches it holds are replayed and only the
    rest run; a line cut short by a kill is dropped, so at most the batch in flight is lost."""

    def __init__(self, path: Path, run: dict, resume: bool):
        self.path = path
        self.done: dict[int, dict] = {}  # batch number (1-based, in run order) -> its line
        lines = path.read_text().split("\n") if path.is_file() else []
        header = self._header(lines)
        if resume:
            self._read(run, lines, header)
        elif header == run and any(line.strip() for line in lines[1:]):
            raise UserError(f"{path} already holds batches of this run: add --resume to continue it, or delete "
                            f"it to start over")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(cli.json_text({"run": run}, indent=None) + "\n")

    @staticmethod
    def _header(lines: list[str]) -> Optional[dict]:
        try:
            return json.loads(lines[0])["run"]
        except (IndexError, ValueError, KeyError, TypeError):
            return None

    def _read(self, run: dict, lines: list[str], header: Optional[dict]) -> None:
        if not lines:
            raise UserError(f"--resume: no journal at {self.path} (a run with --json writes one there)")
        if header is None:
            raise UserError(f"--resume: {self.path} is not a python -m evals journal")
        changed = [key for key in sorted(set(run) | set(header)) if run.get(key) != header.get(key)]
        if changed:
            raise UserError(f"--resume: {self.path} holds a different run ({', '.join(changed)} differ): "
                            f"rerun with its settings, or without --resume to start over")
        kept = [lines[0]]
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # the last line, cut short by a kill: that batch runs again
            self.done[entry["batch"]] = entry
            kept.append(line)
        self.path.write_text("\n".join(kept) + "\n")  # without the cut line

    def check(self, number: int, task: str, size: int, examples: int) -> Optional[dict]:
        """The journal's line for batch `number` if it holds it (checked to be the same batch)."""
        entry = self.done.get(number)
        if entry is not None and (entry["task"], entry["size"], entry["examples"]) != (task, size, examples):
            raise UserError(f"--resume: batch {number} of {self.path} is not this run's batch {number}")
        return entry

    def append(self, number: int, task: str, size: int, examples: int, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(cli.json_text({"batch": number, "task": task, "size": size, "examples": examples,
                                   "record": record}, indent=None) + "\n")
