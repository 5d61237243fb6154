"""Benchmarks for sparq-fast, one subcommand each (the GPU check is bench/gpu_check.py):

  python -m bench attention --shape smollm2 --batch-size 1,4,16 --seq-len 2048,8192,32768 --sparq-r 16
  python -m bench decode --prompt-tokens 1024,4096,8192 --batch-size 1,4,8 --sparq-r 16 --sparq-k 128
  python -m bench linear --rows 1,8 --dtype float32,bfloat16
  python -m bench prefill --heads 14/2/64 --chunk 2048 --keys 2048,16384 --dtype bfloat16
  python -m bench speculate --prompt-tokens 8000 --batch-size 8 --speculate-k 2,4 --sparq-r 16
  python -m bench serve-load --clients 1,4,16 --prompt-tokens 512,4096 --server-args "--sparq-r 16"
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import cli
from bench import attention, decode, linear, prefill, serve_load, speculate


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=cli.ArgumentParser)
    for command in (attention, decode, linear, prefill, speculate, serve_load):
        command.add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "thp", False) and "torch" not in sys.modules:
            # torch's CPU allocator backs big tensors with transparent huge pages (madvise mode):
            # fewer TLB misses for every method (random row gathers gain the most)
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        return args.func(args)

    return cli.main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
