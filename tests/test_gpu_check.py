"""bench/gpu_check.py: the parts that need no GPU (arguments, the transfer theory, goals and report
formatting, the import chain of a bare GPU machine, and a tiny CPU smoke of the whole harness with
the Triton kernels in the interpreter). The GPU parts skip here with a reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gpu_attention, gpu_check  # noqa: E402
from conftest import assert_one_line_error, read_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ON_GPU = torch.cuda.is_available()


def test_sections_and_bad_arguments(capsys):
    assert gpu_check.parse_sections("tests,e2e") == ["tests", "e2e"]
    assert gpu_check.main(["--sections", "tests,bogus"]) == 2
    err = capsys.readouterr().err
    assert_one_line_error((2, err), "bogus")
    assert gpu_check.main(["--steps", "0"]) == 2
    capsys.readouterr()
    for flag, value in (("--models", "llama-9"), ("--contexts", "4k"), ("--batches", "0")):
        assert gpu_check.main(["--sections", "e2e", flag, value]) == 2
        assert_one_line_error((2, capsys.readouterr().err), flag)


def test_kernel_times_sum_each_kernel_and_skip_copies():
    """The attention rows' per-kernel breakdown: device time per kernel name, memcpy/memset left out,
    names shortened, first-launch order."""
    class Span:
        def __init__(self, us):
            self.us = us

        def elapsed_us(self):
            return self.us

    class Event:
        def __init__(self, name, us, device_type="DeviceType.CUDA"):
            self.name, self.time_range, self.device_type = name, Span(us), device_type

    events = [Event("_sparq_step1_kernel", 10.0), Event("Memcpy DtoD (Device -> Device)", 99.0),
              Event("_sparq_select_kernel", 5.0), Event("aten::empty", 50.0, "DeviceType.CPU"),
              Event("_sparq_step1_kernel", 12.0), Event("void at::native::reduce_kernel<512, 1>(float)", 3.0)]
    times = gpu_attention.kernel_times(events)
    assert times == {"sparq_step1": 22.0, "sparq_select": 5.0, "void at::native::reduce": 3.0}
    rows = [dict(name="t4", sparq_us=30.0, sparq_kernel_us=times), dict(name="x", error="no")]
    text = gpu_check.kernel_table(rows)
    assert "sparq_step1=22.0" in text and "30.0" in text and "x" not in text.splitlines()[-1]
    e2e = dict(model="m", B=1, context=64, policy="sparq", ms_per_step=0.5, step_kernel_us_sum=25.0,
               step_kernel_us={"sparq_step1": 11.0}, step_kernel_launches={"sparq_step1": 2.0}, host_syncs_per_step=0.5,
               step_attention_us=11.0)
    assert "kernels 25 us/step of 500 (attention 11, the rest 14)" in gpu_check.kernel_lines([e2e]) and "sparq_step1=11 (x2)" in gpu_check.kernel_lines([e2e])


def test_cpu_device_needs_the_interpreter(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert_one_line_error((2, capsys.readouterr().err), "TRITON_INTERPRET")


@pytest.mark.skipif(ON_GPU, reason="this machine has a GPU: the check would run")
def test_without_a_gpu_every_section_is_skipped(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    report = read_json(out)
    assert set(report["skipped"]) == set(gpu_check.SECTIONS) and report["goals"] == []


def test_transfer_theory_matches_the_paper():
    """Table 4 (B=64, 32 heads, d=128, S=4096, r=32, k=128): theoretical speedup 6.4x, from the
    policies' own transfer formulas."""
    _, B, n_kv, g, d, S, r, k = gpu_attention.TABLE4
    dense, sparq = gpu_attention.attention_theory(B, n_kv, d, S, r, k)
    assert dense == B * n_kv * (2 * S * d + 2 * d) * 2
    assert sparq == B * n_kv * (S * r + 2 * k * d + 4 * d) * 2
    assert round(dense / sparq, 1) == 6.4
    assert gpu_attention.attention_theory(1, 1, 128, 64, 32, 128)[1] == (64 * 32 + 2 * 64 * 128 + 4 * 128) * 2  # k capped at S
    # the logits round trip our kernels add: 8 g bytes per position and KV head
    assert gpu_attention.sparq_extra_bytes(1, 8, 4, 1000) == 8 * 4 * 1000 * 8
    names = [s[0] for s in gpu_attention.ATTENTION_SHAPES]
    assert len(names) == 7 and any("llama3-8b" in n and "128k" in n for n in names)


def test_goals_and_report_formatting():
    rows = [dict(name=gpu_attention.TABLE4[0], B=64, S=4096, dense_us=1500.0, dense_best="triton", sparq_us=300.0,
                 theory_speedup=6.4, dense_theory_pct=95.0, sparq_theory_pct=75.0, sparq_gbs=2250.0, dense_kernels=1,
                 sparq_kernels=3, dense_all=dict(sdpa=1600.0, triton=1500.0)),
            dict(name="llama3-8b B=1 S=32k", B=1, S=32768, dense_us=30.0, dense_best="flex", sparq_us=40.0,
                 theory_speedup=7.0, sparq_theory_pct=20.0, sparq_gbs=500.0, dense_all=dict(flex=30.0)),
            dict(name="llama2-7b B=1 S=8k", B=1, S=8192, error="OutOfMemoryError: x")]
    goals = gpu_check.attention_goals(rows)
    assert [(g.passed, round(g.value, 2)) for g in goals] == [(True, 75.0), (False, 0.75)]
    text = gpu_check.attention_table(rows)
    assert "5.00x" in text and "triton" in text and "error: OutOfMemoryError" in text and "3" in text
    e2e = [dict(model="llama-2-7b", weights="bf16", B=1, context=16384, policy=p, ms_per_step=ms, tokens_per_s=1e3 / ms,
                gb_per_s=2000.0, warm_up_s=40.0) for p, ms in (("dense", 10.0), ("sparq", 7.0))]
    e2e.append(dict(model="llama-2-7b", weights="int8", B=1, context=16384, policy="-", error="RuntimeError: no"))
    goals = gpu_check.e2e_goals(e2e)
    assert goals[0].passed and round(goals[0].value, 2) == 1.43 and goals[1].passed is None
    assert "error: RuntimeError" in gpu_check.e2e_table(e2e)
    lines = gpu_check.goals_text(goals).splitlines()
    assert lines[0].startswith("  [PASS]") and lines[1].startswith("  [n/a ]")


def test_a_failing_section_is_recorded_and_every_row_is_written_as_it_comes(tmp_path):
    """The report is on disk after each row (a kill at the machine's limit loses the row in flight at
    most); a section that raises is recorded with its error, and the next one runs."""
    report = gpu_check.Report(tmp_path / "report.json", environment={"device": "test"})

    def rows(entry):
        report.add_row("first", {"x": 1})
        assert read_json(tmp_path / "report.json")["sections"]["first"]["rows"] == [{"device": "test", "x": 1}]
        report.add_row("first", {"x": 2})
        raise RuntimeError("a kernel broke\nsecond line")

    gpu_check.run_section(report, "first", rows)
    gpu_check.run_section(report, "second", lambda entry: "skipped: nothing to do")
    saved = read_json(tmp_path / "report.json")["sections"]
    assert saved["first"]["status"] == "failed" and saved["first"]["error"] == "RuntimeError: a kernel broke"
    assert [r["x"] for r in saved["first"]["rows"]] == [1, 2] and saved["first"]["traceback"]
    assert saved["second"]["status"] == "skipped: nothing to do"


def test_a_pytest_run_past_its_time_is_reported_not_raised(monkeypatch):
    def too_slow(*args, timeout, **kwargs):
        raise subprocess.TimeoutExpired(args[0], timeout, output=b"....")

    monkeypatch.setattr(gpu_check.subprocess, "run", too_slow)
    passed, summary = gpu_check.run_pytest(timeout=5)
    assert passed is False and "timed out after 5 s" in summary and "...." in summary


def test_a_kernel_off_its_reference_is_never_timed(monkeypatch):
    """The attention section compares each kernel with its reference before timing it: a wrong
    SparQ kernel gives an error row, not a time."""
    import kernels_triton

    monkeypatch.setattr(kernels_triton, "sparq_attention_triton", lambda q, *args, **kwargs: torch.zeros_like(q))
    monkeypatch.setattr(gpu_attention, "dense_candidates", lambda device: {})
    row = gpu_attention.attention_row(("tiny", 1, 2, 1, 64, 200, 8, 32), "cpu", dtype=torch.float32, replays=1)
    assert "sparq_us" not in row and row["error"].startswith("SparQ differs from the reference")


IMPORTS_ON_A_BARE_GPU_MACHINE = """
import sys
sys.modules['gguf'] = None  # the GPU machine has no gguf: importing it would fail
import bench.gpu_check, model, sparq, quantize, kernels, kernels_triton
assert 'convert_hf_checkpoint' not in sys.modules and 'gguf' not in [m for m in sys.modules if sys.modules[m]]
"""


def test_import_chain_needs_no_gguf():
    proc = subprocess.run([sys.executable, "-c", IMPORTS_ON_A_BARE_GPU_MACHINE], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cpu_smoke_of_the_whole_harness(tmp_path):
    """Every section on CPU with tiny shapes: the Triton kernels in the interpreter (attention timing
    of SparQ and every dense candidate after their reference checks), a tiny random model end to
    end through generate.py's Generator (dense and SparQ; int8 and int4 weights), the goals and the
    JSON report."""
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--compile", "eager", "--steps", "2",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = read_json(out)
    sections = report["sections"]
    assert sections["tests"]["status"].startswith("skipped")
    attention = sections["attention"]["rows"]
    assert len(attention) == 2 and all(r["sparq_us"] > 0 and {"sdpa", "triton"} <= set(r["dense_all"])
                                       and r["reference_errors"] == {} for r in attention), attention
    assert all(set(r["sparq_us_by_bpp"]) == {"1", "2"} and r["sparq_bpp"] >= 1 and
               set(r["sparq_us_by_select_bits"]) == {"1", "2"} and r["sparq_select_bits"] == 1 for r in attention), attention
    assert "blocks per program" in proc.stdout and "BPP=2" in proc.stdout and "select 1 bit/pass" in proc.stdout
    quantized = sections["attention"]["quantized_rows"]
    assert len(quantized) == 1 and "error" not in quantized[0], quantized
    assert quantized[0]["sparq_us"] > 0 and quantized[0]["dense_bytes"] < 0.6 * quantized[0]["bf16_dense_bytes"]
    assert "On a quantized cache" in proc.stdout
    for section, weights in (("e2e", ("fp32",)), ("quant", ("int8", "int4"))):
        rows = sections[section]["rows"]
        assert sections[section]["status"] == "done" and not [r for r in rows if "error" in r], rows
        assert {(r["weights"], r["policy"]) for r in rows} == {(w, p) for w in weights for p in ("dense", "sparq")}
        assert all(r["tokens_per_s"] > 0 and r["gb_per_s"] > 0 for r in rows)
        assert all(r["host_syncs_per_step"] >= 0 and "step_kernel_us" in r
                   and 0 <= r["step_attention_us"] <= r["step_kernel_us_sum"] for r in rows), rows
    assert "Device time per decode step" in proc.stdout
    assert "== goals ==" in proc.stdout


def test_cpu_smoke_of_speculation_rows_on_a_quantized_cache(tmp_path):
    """e2e with --speculate-k and a quantized cache: each shape's dense, SparQ and self-speculation
    rows on an int8 K/V + int4 K^T cache, the speculation row's draft step and verify pass and the
    speedups they predict; the goals skip these rows (they are not the bf16 cache's)."""
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--compile", "eager", "--steps", "3",
                           "--sections", "e2e", "--speculate-k", "2", "--kv-dtype", "int8", "--kt-dtype", "int4",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = read_json(out)["sections"]["e2e"]["rows"]
    assert not [r for r in rows if "error" in r], rows
    assert {r["kv"] for r in rows} == {"int8, K^T int4"}
    shapes = {(r["B"], r["context"]) for r in rows}
    assert sorted(r["policy"] for r in rows) == sorted(["dense", "sparq", "speculate"] * len(shapes))
    for r in rows:
        if r["policy"] == "speculate":
            assert r["n"] == 2 and 0 <= r["acceptance"] <= 1 and 1 <= r["tokens_per_round"] <= 3
            assert r["draft_step_ms"] > 0 and r["verify_pass_ms"] > 0 and r["speedup"] > 0
            assert set(r["predicted_speedup"]) == {"0.80", "0.90", "0.95", "1.00"}
            assert r["predicted_speedup"]["1.00"] > r["predicted_speedup"]["0.80"] > 0
    assert "speculate n=2" in proc.stdout and "Self-speculation" in proc.stdout


def test_the_speedup_at_dense_rest_sets_the_gemv_lottery_aside():
    dense = dict(step_kernel_us_sum=9000.0, step_attention_us=4500.0)
    sparq = dict(step_kernel_us_sum=6400.0, step_attention_us=2100.0)  # its own rest: 4300
    assert gpu_check.speedup_at_dense_rest(dense, sparq) == {"speedup_at_dense_rest": 9000.0 / 6600.0}
    assert gpu_check.speedup_at_dense_rest(dict(step_kernel_us_sum=0.0, step_attention_us=0.0), sparq) == {}
    assert gpu_check.speedup_at_dense_rest(dense, dict(ms_per_step=1.0)) == {}


def test_a_float_cache_in_another_dtype_is_one_line_of_error(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--sections", "e2e",
                           "--kv-dtype", "bfloat16"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "--kv-dtype bfloat16")


@pytest.mark.skipif(not ON_GPU, reason="the attention timing needs a GPU (CUDA graphs, profiler kernel counts)")
def test_attention_row_on_gpu():
    rates = gpu_attention.memory_bandwidth("cuda", gib=1)
    assert rates["read"] > 0 and rates["copy"] > 0
    row = gpu_attention.attention_row(("small", 1, 8, 4, 128, 8192, 32, 128), "cuda", bandwidth=rates["read"], replays=5)
    assert row["sparq_us"] > 0 and row["dense_us"] > 0 and 3 <= row["sparq_kernels"] <= 5
    assert len(row["sparq_kernel_us"]) == row["sparq_kernels"] and "sparq_step1" in row["sparq_kernel_us"]
    assert len(row["sparq_us_by_bpp"]) == 5 and all(us > 0 for us in row["sparq_us_by_bpp"].values())
    assert sorted(row["sparq_us_by_select_bits"]) == [1, 2]
