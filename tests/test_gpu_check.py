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
from conftest import assert_one_line_error, read_json, run_python  # noqa: E402

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
    assert [g.name for g in goals if "rest of the step" in g.name] and all(g.passed is None for g in goals[1:])


def test_issue_72s_goals_from_e2e_rows():
    """int4 at B = 1, the batches of long contexts (self-speculation included), the rest of the step within
    2% and the int4 linears' read rate: each goal from its rows; a model / weights / B not measured gives
    no goal at all."""
    def row(model, weights, B, context, policy, tokens_per_s, **extra):
        return dict(model=model, weights=weights, kv="bfloat16", B=B, context=context, policy=policy,
                    tokens_per_s=tokens_per_s, **extra)

    rows = [row("llama-2-7b", "int4", 1, 32768, "dense", 100.0, linear_read_pct=55.0),
            row("llama-2-7b", "int4", 1, 32768, "sparq", 210.0),
            row("llama-3.1-8b", "bf16", 16, 32768, "dense", 100.0),
            row("llama-3.1-8b", "bf16", 16, 32768, "sparq", 240.0),
            row("llama-3.1-8b", "bf16", 16, 32768, "speculate", 140.0),
            dict(model="llama-3.1-8b", weights="bf16", kv="bfloat16", B=8, context=32768, policy="dense", error="x"),
            row("llama-2-7b", "bf16", 1, 32768, "dense", 100.0),
            row("llama-2-7b", "bf16", 1, 32768, "sparq", 170.0, rest_vs_dense=1.015, linears="fixed")]
    goals = {g.name: g for g in gpu_check.e2e_goals(rows)}
    by = lambda fragment: next(g for name, g in goals.items() if fragment in name)  # noqa: E731
    assert by("llama-2-7b B=1 int4 32k").passed and round(by("llama-2-7b B=1 int4 32k").value, 2) == 2.1
    assert by("B=16 bf16 32k: SparQ").passed is False and by("B=16 bf16 32k: self-speculation").passed
    assert by("B=8 bf16 32k").passed is None  # measured, failed: n/a
    assert by("llama-2-7b B=1 bf16 32k: SparQ /").passed and by("bf16 32k: SparQ's rest").passed
    assert round(by("bf16 32k: SparQ's rest").value, 1) == 1.5 and "fixed linears" in by("bf16 32k: SparQ's rest").name
    assert by("int4 B=1 32k: the linears' read rate").passed is False
    assert not [name for name in goals if "llama-3.1-8b B=1 " in name]  # not measured: no goal
    text = gpu_check.e2e_table([dict(rows[1], ms_per_step=4.8, gb_per_s=900.0, speedup=2.1, step_rest_us=3000.0,
                                     rest_vs_dense=1.01, linear_read_gbs=2900.0, linear_read_pct=65.0, warm_up_s=70.0)])
    assert "2.10x" in text and "1.010" in text and "2900 (65%)" in text and "tuned" in text


def test_linear_kernels_are_told_from_the_rest():
    """The profile's linears: inductor's fused GEMV reductions, cuBLAS / CUTLASS GEMMs and tinygemm; not
    the pointwise kernels named after a matmul they follow, nor attention or copies."""
    linear = ["triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_view_8",
              "triton_per_fused_mm_1", "nvjet_tst_128x64_64x8_2x1_v_bz_TNT",
              "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
              "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(Params)",
              "void at::native::(anonymous namespace)::tinygemm_m16n8k16_chunk_kernel<(KReductionType)0, 8>(Params)",
              "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(params)"]
    other = ["triton_poi_fused__to_copy__unsafe_view_add_arange_cat_index_index_put_mm_mul_select_3",
             "_sparq_step1_kernel", "_dense_decode_kernel", "triton_red_fused__to_copy_mean_pow_7",
             "void at::native::reduce_kernel<512, 1>(float)"]
    assert all(gpu_check.is_linear_kernel(n) for n in linear), [n for n in linear if not gpu_check.is_linear_kernel(n)]
    assert not any(gpu_check.is_linear_kernel(n) for n in other)
    assert gpu_attention.short_kernel_name(linear[5]) == "void at::native::tinygemm_m16n8k16_chunk"


def test_linear_bytes_and_kernels_of_a_quantized_model():
    """linear_weight_bytes counts the linears' weights (packed or not) and leaves the embedding out;
    linear_kernel_counts says which kernel each linear runs."""
    import kernels
    from model import ModelArgs, random_model

    model = random_model(ModelArgs.from_shape("tiny"), "cpu", torch.float32, kernels.TORCH_KERNELS)
    args = model.args
    assert gpu_check.linear_weight_bytes(model) == model.weight_bytes() - args.vocab_size * args.dim * 4 - sum(
        p.numel() * 4 for name, p in model.named_parameters() if "norm" in name)
    assert gpu_check.linear_kernel_counts(model) == {"F.linear": 4 * args.n_layer + 1}
    int4 = gpu_check.quantized_model(model, kernels.TORCH_KERNELS, "int4", "cpu", torch.float32)
    assert gpu_check.linear_kernel_counts(int4) == {"dequant": 4 * args.n_layer + 1}
    assert 0 < gpu_check.linear_weight_bytes(int4) < gpu_check.linear_weight_bytes(model) / 3


def test_fixed_linears_turns_tuning_off_and_can_leave_deterministic_mode():
    """--fixed-linears: coordinate descent and pointwise autotuning off, inductor's deterministic mode on;
    a compile that the deterministic mode refuses turns the mode off (once) and says why."""
    import torch._inductor.config as inductor_config

    # inductor's own patch restores its settings after (pytest's monkeypatch, undoing through setattr on the
    # config module, left later compiles in this process without coordinate_descent_tuning at all)
    with inductor_config.patch({"coordinate_descent_tuning": True, "deterministic": False,
                                "triton.autotune_pointwise": True}):
        check_fixed_linears(inductor_config)


def check_fixed_linears(inductor_config) -> None:
    assert gpu_check.fix_linear_configs() == {"coordinate_descent_tuning": False, "autotune_pointwise": False,
                                              "deterministic": True}
    assert not inductor_config.coordinate_descent_tuning and inductor_config.deterministic
    assert gpu_check.leave_deterministic_mode(RuntimeError("CUDA out of memory")) is None and inductor_config.deterministic
    left = gpu_check.leave_deterministic_mode(RuntimeError("In the deterministic mode of Inductor, we will avoid\nmore"))
    assert left == "off after: In the deterministic mode of Inductor, we will avoid" and not inductor_config.deterministic
    assert gpu_check.leave_deterministic_mode(RuntimeError("deterministic mode")) is None  # already off


def test_e2e_plan_defaults_flags_and_the_cpu_smoke():
    args = gpu_check.build_parser().parse_args([])
    for k in ("models", "contexts", "batches", "weights"):
        setattr(args, k, None)
    assert gpu_check.e2e_plan("e2e", args, cuda=True) == (("llama-2-7b", "llama-3.1-8b"), ("bf16",), (1, 8),
                                                          (4096, 16384, 32768))
    assert gpu_check.e2e_plan("quant", args, cuda=True) == (("llama-2-7b",), ("int8", "int4"), (1,), (16384,))
    assert gpu_check.e2e_plan("e2e", args, cuda=False) == (("tiny",), ("bf16",), (1, 2), (64, 200))
    args.models, args.weights, args.batches, args.contexts = ["llama-3.1-8b"], ["int4"], [16, 8], [32768, 16384, 4096]
    assert gpu_check.e2e_plan("e2e", args, cuda=True) == (("llama-3.1-8b",), ("int4",), (16, 8), (32768, 16384, 4096))
    assert gpu_check.e2e_plan("e2e", args, cuda=False) == (("tiny",), ("int4",), (16, 8), (512, 256, 64))


def test_a_batch_the_device_cannot_hold_is_a_skipped_row(tmp_path, monkeypatch):
    """cache_fit checks a batch size's KV cache against the free memory before allocating it: too large,
    its rows are recorded as skipped with the numbers (and the H200 note where it needs over 80 GB)."""
    import kernels
    from model import ModelArgs, random_model

    model = random_model(ModelArgs.from_shape("tiny"), "cpu", torch.float32, kernels.TORCH_KERNELS)
    fields, refusal = gpu_check.cache_fit(model, 2, 256, gpu_check.KVFormat(), free=None)
    assert refusal is None and fields["cache_gib"] > 0 and "memory_note" not in fields
    fields, refusal = gpu_check.cache_fit(model, 2, 256, gpu_check.KVFormat(), free=2**30)
    assert refusal.startswith("skipped: the KV cache needs") and "GiB are free" in refusal
    big = type("Big", (), {"args": ModelArgs.from_shape("llama-3.1-8b"), "cache_dtype": torch.bfloat16,
                           "weight_bytes": lambda self: 16 * 10**9, "cache_bytes": staticmethod(model.cache_bytes)})()
    fields, refusal = gpu_check.cache_fit(big, 16, 33024, gpu_check.KVFormat(), free=79 * 2**30)
    assert 95 < fields["cache_gib"] < 100 and "H200" in fields["memory_note"] and "H200" in refusal
    fields, refusal = gpu_check.cache_fit(big, 16, 33024, gpu_check.KVFormat(), free=138 * 2**30)
    assert refusal is None and "H200" in fields["memory_note"]

    report = gpu_check.Report(tmp_path / "r.json", environment={"device": "test"})
    report.section("e2e")
    monkeypatch.setattr(gpu_check, "device_free_bytes", lambda device: 2**20)
    gpu_check.e2e_rows(report, "e2e", model, "tiny", "fp32", [2], [64], 2, None, lambda: False)
    rows = report.sections["e2e"]["rows"]
    assert [r["policy"] for r in rows] == ["dense", "sparq"] and all(r["error"].startswith("skipped") for r in rows)
    assert "skipped" in gpu_check.e2e_table(rows)


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
    """e2e with --speculate-k and a quantized cache, over two weight modes and batch sizes with
    --fixed-linears: each shape's dense, SparQ and self-speculation rows on an int8 K/V + int4 K^T cache,
    the speculation row's draft step and verify pass and the speedups they predict; the goals skip
    these rows (they are not the bf16 cache's)."""
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--compile", "eager", "--steps", "3",
                           "--sections", "e2e", "--speculate-k", "2", "--kv-dtype", "int8", "--kt-dtype", "int4",
                           "--weights", "bf16,int4", "--batches", "1,4", "--contexts", "16384", "--fixed-linears",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = read_json(out)
    rows = report["sections"]["e2e"]["rows"]
    assert not [r for r in rows if "error" in r], rows
    assert {r["kv"] for r in rows} == {"int8, K^T int4"}
    shapes = {(r["weights"], r["B"], r["context"]) for r in rows}
    assert shapes == {(w, B, 256) for w in ("fp32", "int4") for B in (1, 4)}  # 16384 / 64 on the CPU
    assert sorted(r["policy"] for r in rows) == sorted(["dense", "sparq", "speculate"] * len(shapes))
    assert all(r["linears"] == "fixed" and r["cache_gib"] > 0 for r in rows)
    assert all(r["linear_kernels"] == {"dequant": 9} and r["quantize_s"] >= 0 for r in rows if r["weights"] == "int4")
    assert report["environment"]["fixed_linears"]["coordinate_descent_tuning"] is False
    assert "fixed linears" in proc.stdout and "linears' kernels: dequant x9" in proc.stdout
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
    assert gpu_check.speedup_at_dense_rest(dense, sparq) == {"speedup_at_dense_rest": 9000.0 / 6600.0,
                                                             "dense_rest_us": 4500.0, "rest_vs_dense": 4300.0 / 4500.0}
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


# ---------------------------------------------------------------------------------------------
# generate.py --profile, and the prepared contact calls (scripts/gpu_contact.sh)
# ---------------------------------------------------------------------------------------------


def test_generate_profile_writes_a_chrome_trace_of_decode_steps(tmp_path, smollm2_checkpoint):
    """generate.py --profile PATH (gpt-fast's flag): after the timed generation, a torch.profiler trace of
    a few decode steps as a Chrome trace (CPU activities here), where it went said on stderr; a PATH in
    no directory is a one-line error before anything loads."""
    trace = tmp_path / "trace.json"
    proc = run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "4", "--no-stream",
                      "--profile", trace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"3 decode steps traced (CPU activities) to {trace}" in proc.stderr, proc.stderr[-2000:]
    events = read_json(trace)["traceEvents"]
    assert any(e.get("cat") == "cpu_op" for e in events) and any("linear" in e.get("name", "") for e in events)
    proc = run_python("generate.py", "--profile", tmp_path / "missing" / "trace.json", timeout=300)
    assert_one_line_error(proc, "--profile", "no directory")


CONTACT_SCRIPT = REPO / "scripts" / "gpu_contact.sh"


def contact_calls() -> dict[str, list[tuple[str, int, int, list[str]]]]:
    """The script's calls: label -> its gpu_check commands (name, timeout s, budget s, arguments)."""
    import re
    import shlex

    calls, label = {}, None
    text = CONTACT_SCRIPT.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        start = re.match(r"^([0-9][0-9a-z |]*)\)$", line.strip())
        if start:
            label = start.group(1)
            calls[label] = []
        elif line.strip() == ";;":
            label = None
        elif label is not None and line.strip().startswith("check "):
            _, name, limit, budget, *args = shlex.split(line.strip())
            calls[label].append((name, int(limit), int(budget), args))
    return calls


@pytest.mark.skipif(ON_GPU, reason="on a GPU machine gpu_check would run the calls, not only read their flags")
def test_every_prepared_calls_flags_are_valid_and_fit_the_limit(tmp_path, capsys):
    """Each call of scripts/gpu_contact.sh: its gpu_check commands' flags pass gpu_check's checks (here,
    without CUDA, every section is then skipped), each command's budget ends before its timeout, and a
    call's timeouts add up to less than the device's 10 minutes."""
    calls = contact_calls()
    assert set(calls) == {"1", "2", "3", "4 | 4a | 4b", "5", "6", "7"} and all(calls[c] for c in ("1", "2", "3", "5", "6"))
    for label, commands in calls.items():
        assert sum(limit for _, limit, _, _ in commands) <= 590, label
        for name, limit, budget, args in commands:
            assert budget < limit, name
            assert gpu_check.main(args + ["--budget-s", str(budget), "--json", str(tmp_path / f"{name}.json")]) == 0, \
                (name, capsys.readouterr())
            assert read_json(tmp_path / f"{name}.json")["skipped"], name
    proc = subprocess.run(["bash", str(CONTACT_SCRIPT), "8"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give the call" in proc.stderr


def test_cpu_smoke_of_the_prepared_calls(tmp_path):
    """GPU_CONTACT_SMOKE=1 runs a call on the CPU at tiny scale with the same flags: call 6 (a batch with
    self-speculation) leaves its JSON and log under $OUT; call 4 starts serve.py twice (SparQ, then dense)
    with random weights and drives each with bench serve-load's token-id prompts, every request served; call 7
    the same over two tensor-parallel ranks."""
    env = {**os.environ, "GPU_CONTACT_SMOKE": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    out = {}
    for call in ("6", "4", "7"):
        proc = subprocess.run(["bash", str(CONTACT_SCRIPT), call], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[call] = proc.stdout
    rows = read_json(tmp_path / "e2e_l2_b4.json")["sections"]["e2e"]["rows"]
    assert sorted(r["policy"] for r in rows) == ["dense", "sparq", "speculate"] and all(r["B"] == 4 for r in rows)
    assert "e2e_l2_b4: exit 0" in out["6"] and "smoke" in (tmp_path / "e2e_l2_b4.log").read_text()
    assert "serve_sparq: serve-load exit 0" in out["4"] and "serve_dense: serve-load exit 0" in out["4"]
    assert "serve_tp: serve-load exit 0" in out["7"]  # tensor parallel: two ranks on gloo
    for name, policy in (("serve_sparq", "sparq"), ("serve_dense", "dense"), ("serve_tp", "sparq")):
        log = (tmp_path / f"{name}.log").read_text()
        assert f"({policy} on" in log and "listening on" in log, log[-2000:]
        load = read_json(tmp_path / f"{name}.json")["rows"]
        assert len(load) == 1 and load[0]["requests"] > 0 and load[0]["failed"] == 0 and load[0]["tokens"] > 0, load
