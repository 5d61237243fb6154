"""bench/llamacpp.py: argument parsing, one-line errors, llama-bench output parsing; one run of the real llama-bench when built."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import llamacpp

# Captured from a real run of this module's build (llama.cpp 0c1e570, llama-cpp-python 0.3.36) on the
# embedded Q4_1 SmolLM2-135M, 2 threads, 1 repetition, verbatim stdout (on a busy machine: slow figures):
#   llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16,64 -n 0 -t 2 -r 1 -o json
PREFILL_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-23T04:56:09Z",
    "avg_ns": 5944004361,
    "stddev_ns": 0,
    "avg_ts": 2.691788,
    "stddev_ts": 0.000000,
    "samples_ns": [ 5944004361 ],
    "samples_ts": [ 2.69179 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-23T04:56:21Z",
    "avg_ns": 4866719815,
    "stddev_ns": 0,
    "avg_ts": 13.150541,
    "stddev_ts": 0.000000,
    "samples_ns": [ 4866719815 ],
    "samples_ts": [ 13.1505 ]
  }
]
"""
#   llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 4 -d 16,64 -t 2 -r 1 -o json
DECODE_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 16,
    "test_time": "2026-11-23T04:56:30Z",
    "avg_ns": 252422063,
    "stddev_ns": 0,
    "avg_ts": 15.846475,
    "stddev_ts": 0.000000,
    "samples_ns": [ 252422063 ],
    "samples_ts": [ 15.8465 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 64,
    "test_time": "2026-11-23T04:56:34Z",
    "avg_ns": 810119089,
    "stddev_ns": 0,
    "avg_ts": 4.937546,
    "stddev_ts": 0.000000,
    "samples_ns": [ 810119089 ],
    "samples_ts": [ 4.93755 ]
  }
]
"""


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = llamacpp.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --- parsing ----------------------------------------------------------------------------------


def test_int_list():
    import cli

    assert cli.int_list("16,1024, 4096,16", "--contexts", minimum=0) == [16, 1024, 4096]
    assert cli.int_list("0", "--contexts", minimum=0) == [0]
    for bad in ("", ",", "16,abc", "1.5", "-1"):
        with pytest.raises(llamacpp.UserError, match="--contexts"):
            cli.int_list(bad, "--contexts", minimum=0)


def test_format_list():
    assert llamacpp.format_list("BF16,f32,q4_1,bf16") == ["bf16", "f32", "q4_1"]
    for bad in ("", "q4_k", "f32,int8"):
        with pytest.raises(llamacpp.UserError, match="unknown format"):
            llamacpp.format_list(bad)


def test_parser_defaults():
    args = llamacpp.build_parser().parse_args(["bench", "--gguf", "x.gguf"])
    assert (args.formats, args.contexts, args.threads, args.n_gen, args.reps) == (
        "bf16,f32,q8_0,q4_0,q4_1", "16,1024,4096,8000", 2, 32, 3)
    assert llamacpp.build_parser().parse_args(["build"]).jobs == 2


def test_default_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path))
    assert llamacpp.default_cache() == tmp_path / "llama.cpp"
    monkeypatch.delenv("SPARQ_FAST_CACHE")
    assert llamacpp.default_cache() == Path.home() / ".cache" / "sparq-fast" / "llama.cpp"


# --- one-line user errors, exit status 2, never a traceback -----------------------------------


@pytest.mark.parametrize("argv, message", [
    (["bench", "--gguf", "no/such/file.gguf"], "GGUF file not found: no/such/file.gguf"),
    (["bench", "--gguf", "x.gguf", "--formats", "bf16,q4_k"], "unknown format value 'q4_k'"),
    (["bench", "--gguf", "x.gguf", "--contexts", "16,many"], "--contexts must be a comma-separated list"),
    (["bench", "--gguf", "x.gguf", "--contexts", ""], "--contexts must list integers"),
    (["bench", "--gguf", "x.gguf", "--threads", "0"], "must be at least 1"),
    (["bench"], "--gguf"),
    (["frobnicate"], "invalid choice"),
])
def test_user_errors_are_one_line(capsys, argv, message):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("python -m bench.llamacpp: error: ") and message in err, err


def test_missing_cmake_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: no cmake, no compiler
    rc, out, err = run_main(capsys, "build", "--cache", str(tmp_path / "cache"))
    assert rc == 2 and err.count("\n") == 1 and "cmake not found" in err, err


def test_missing_compiler_is_one_line(capsys, monkeypatch, tmp_path):
    fake = tmp_path / "cmake"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    rc, out, err = run_main(capsys, "build", "--cache", str(tmp_path / "cache"))
    assert rc == 2 and err.count("\n") == 1 and "no C compiler found" in err, err


# --- build configuration -----------------------------------------------------------------------


def test_cmake_options_follow_the_declared_options(tmp_path):
    (tmp_path / "ggml").mkdir()
    (tmp_path / "tools" / "llama-bench").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text('option(LLAMA_OPENSSL "https" ON)\noption(LLAMA_BUILD_TESTS "t" ON)\n')
    (tmp_path / "ggml" / "CMakeLists.txt").write_text('option(GGML_NATIVE "native" ON)\n')
    opts = llamacpp.cmake_options(tmp_path)
    assert opts == ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    assert llamacpp._targets(tmp_path)["completion"] == "llama-cli"
    (tmp_path / "tools" / "completion").mkdir()
    assert llamacpp._targets(tmp_path) == {"bench": "llama-bench", "quantize": "llama-quantize",
                                           "completion": "llama-completion"}
    assert "-DLLAMA_BUILD_SERVER=ON" not in llamacpp.cmake_options(tmp_path)
    (tmp_path / "tools" / "server").mkdir()
    (tmp_path / "CMakeLists.txt").write_text('option(LLAMA_BUILD_SERVER "server" ON)\n')
    assert llamacpp._targets(tmp_path)["server"] == "llama-server"
    assert "-DLLAMA_BUILD_SERVER=ON" in llamacpp.cmake_options(tmp_path)


def test_find_build_needs_stamp_binaries_and_same_cpu(tmp_path):
    assert llamacpp.find_build(tmp_path) is None
    build_dir = tmp_path / f"build-{llamacpp.LLAMA_CPP_PYTHON}"
    (build_dir / "bin").mkdir(parents=True)
    stamp = {"root": str(tmp_path), "bin_dir": str(build_dir / "bin"), "llama_cpp_python": llamacpp.LLAMA_CPP_PYTHON,
             "commit": "0" * 40, "binaries": {"bench": "llama-bench"},
             "cmake_args": llamacpp.cmake_options(llamacpp.source_dir(tmp_path, llamacpp.LLAMA_CPP_PYTHON)),
             "cpu": llamacpp.cpu_model(),
             "build_seconds": 1.0}
    (build_dir / llamacpp.STAMP).write_text(json.dumps(stamp))
    assert llamacpp.find_build(tmp_path) is None  # binary missing
    (build_dir / "bin" / "llama-bench").write_text("")
    assert llamacpp.find_build(tmp_path).tool("bench") == build_dir / "bin" / "llama-bench"
    assert llamacpp.find_build(tmp_path, roles=("server",)) is None  # built before llama-server was a target
    (build_dir / llamacpp.STAMP).write_text(json.dumps({**stamp, "cpu": "another CPU"}))
    assert llamacpp.find_build(tmp_path) is None  # -march=native binaries of another machine
    (build_dir / llamacpp.STAMP).write_text(json.dumps({**stamp, "cmake_args": ["-DGGML_NATIVE=ON", "-DOTHER=1"]}))
    assert llamacpp.find_build(tmp_path) is None  # configured otherwise than cmake_options now would


# --- llama-bench commands and output ----------------------------------------------------------


def test_bench_commands():
    cmds = llamacpp.bench_commands(Path("bin/llama-bench"), Path("m.gguf"), [16, 1024], n_gen=32, threads=2, repetitions=3)
    common = ["-t", "2", "-r", "3", "-o", "json", "--progress", "-fa", "0,1"]  # the faster of the two kept
    assert cmds["prefill"] == ["bin/llama-bench", "-m", "m.gguf", "-p", "16,1024", "-n", "0", *common]
    assert cmds["decode"] == ["bin/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "32", "-d", "16,1024", *common]
    assert "prefill" not in llamacpp.bench_commands(Path("b"), Path("m"), [0])  # context 0: decode only
    decode_only = llamacpp.bench_commands(Path("bin/llama-bench"), Path("m.gguf"), [16, 1024], prefill=False)
    assert list(decode_only) == ["decode"] and "16,1024" in decode_only["decode"]  # --decode-only
    amx = llamacpp.bench_commands(Path("bin/llama-bench"), Path("m.gguf"), [16], avoid_amx_tiles=True)
    assert amx["decode"][-2:] == ["-ub", "1"] and amx["prefill"][-2:] == ["--repack", "0"]  # ggml's AMX tiles
    q8 = llamacpp.bench_commands(Path("bin/llama-bench"), Path("m.gguf"), [16], kv_type="q8_0")
    for cmd in q8.values():  # its quantized KV cache, with flash attention (which a quantized V needs)
        assert cmd[-6:] == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]


def test_parse_captured_llama_bench_output():
    prefill = llamacpp.parse_bench_json(PREFILL_JSON)
    decode = llamacpp.parse_bench_json(DECODE_JSON)
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in prefill] == [(16, 0, 0), (64, 0, 0)]
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in decode] == [(0, 4, 16), (0, 4, 64)]
    rows = llamacpp.rows_from_tests(prefill, decode, [16, 64, 128], "q4_1", repetitions=1)
    assert [r["context"] for r in rows] == [16, 64, 128]
    assert rows[0]["prefill_tok_s"] == round(prefill[0]["avg_ts"], 2)
    assert rows[1]["decode_tok_s"] == round(decode[1]["avg_ts"], 2)
    assert rows[2]["decode_tok_s"] is None and rows[2]["prefill_tok_s"] is None  # not measured
    assert rows[0]["threads"] == 2 and rows[0]["n_gen"] == 4 and rows[0]["llama_cpp_commit"] == decode[0]["build_commit"]
    table = llamacpp.format_table(rows)
    assert "N=16" in table and "q4_1" in table and table.count("\n") == 3
    # flash attention on and off (bench_commands): each context keeps its faster record
    fa_on = [{**t, "flash_attn": True, "avg_ts": t["avg_ts"] * (0.5 if t["n_depth"] == 16 else 2)} for t in decode]
    rows = llamacpp.rows_from_tests(prefill, decode + fa_on, [16, 64], "q4_1", repetitions=1)
    assert rows[0]["decode_tok_s"] == round(decode[0]["avg_ts"], 2) and rows[0]["flash_attn"] == decode[0]["flash_attn"]
    assert rows[1]["decode_tok_s"] == round(2 * decode[1]["avg_ts"], 2) and rows[1]["flash_attn"] is True


def test_table_marks_noisy_cells_and_busy_machines():
    rows = [{"format": "f32", "context": 16, "decode_tok_s": 30.0, "decode_tok_s_std": 0.5, "prefill_tok_s": 90.0,
             "prefill_tok_s_std": 40.0, "load_avg": 2.1}]
    table = llamacpp.format_table(rows).splitlines()
    assert table[1].split() == ["f32", "30.0"] and table[3].split() == ["f32", "90.0*"]
    assert table[-1].startswith("* std over the repetitions above 25%")
    assert llamacpp.busy_note(rows, cores=2) is None
    assert "load average reached 5.0 on 2 cores" in llamacpp.busy_note(rows + [{**rows[0], "load_avg": 5.0}], cores=2)


@pytest.mark.parametrize("text", ["", "| model | size |", '{"avg_ts": 1}', "[{\"n_gen\": 1}]"])
def test_parse_rejects_other_output(text):
    with pytest.raises(llamacpp.BuildError):
        llamacpp.parse_bench_json(text)


# --- the real thing, when built ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_build():
    found = llamacpp.find_build()
    if found is None:
        pytest.skip(f"llama.cpp not built in {llamacpp.default_cache()} (optional: `python -m bench.llamacpp build`)")
    return found


def test_llama_bench_runs(llama_build, smollm2_gguf):
    """A few tokens through the built llama-bench on the embedded Q4_1 GGUF (no requantizing)."""
    rows = llamacpp.time_decode(smollm2_gguf, contexts=[0, 16], n_gen=4, threads=min(2, os.cpu_count() or 1),
                                repetitions=1, build_=llama_build)
    assert [(r["format"], r["context"]) for r in rows] == [("q4_1", 0), ("q4_1", 16)]
    assert rows[0]["prefill_tok_s"] is None and rows[1]["prefill_tok_s"] > 0
    assert all(r["decode_tok_s"] > 0 and r["n_gen"] == 4 for r in rows)
    assert rows[0]["llama_cpp_commit"] == llama_build.commit and rows[0]["load_avg"] >= 0
