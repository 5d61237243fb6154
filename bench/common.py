"""What the benchmarks share: dtype names and the CPU's last-level cache size (working sets are sized
against it so that timed calls read from DRAM)."""
from __future__ import annotations

from pathlib import Path

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
