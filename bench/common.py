"""What the benchmarks share: dtype names, the CPU's last-level cache size (working sets are sized
against it so that timed calls read from DRAM) and timing by turns (A/B pairs in one process)."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux sysfs), or 64 MiB where it cannot be read."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=64 << 20)


def alternating_medians(calls: dict[str, Callable[[], object]], rounds: int, reps: int,
                        warm: int = 3) -> dict[str, float]:
    """Seconds per call of each of `calls`, taking turns in one process: each is first called `warm`
    times untimed (a compiled step builds on its first calls), then every round times `reps` calls of
    each in turn; the median over the rounds. Taking turns spreads this machine's drift (up to 2x
    within an hour on the shared VMs) over every candidate alike, which separate runs cannot."""
    for call in calls.values():
        for _ in range(warm):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(reps):
                call()
            times[name].append((time.perf_counter() - start) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def cache_formats(text: str):
    """--cache-format: [(label, KVFormat)], "KV[/KT[/SCALE]]" each (KV a --kv-dtype, KT a --kt-dtype, SCALE a
    --kt-scale-dtype)."""
    from cli import UserError
    from assemble import cache_format

    formats = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        kv, _, rest = item.partition("/")
        kt, _, scale = rest.partition("/")
        flags = argparse.Namespace(kv_layout="twice", kv_dtype=kv, kt_dtype=kt or "same", kt_scale_dtype=scale or "auto")
        formats.append((item, cache_format(flags, "cpu")))
    if not formats:
        raise UserError("--cache-format: give at least one format")
    return formats
