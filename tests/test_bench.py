"""python -m bench runs end to end and reports what it promises (shapes of the report, not speed)."""
from __future__ import annotations


import pytest

import bench.__main__ as bench_cli
from bench import decode as bench_decode
from cli import UserError
from conftest import assert_one_line_error, read_json, run_main, run_python
from model import ModelArgs, Transformer


def test_decode_json_rows(tmp_path, smollm2_checkpoint, capsys):
    out = tmp_path / "decode.json"
    code = bench_cli.main(["decode", "--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "0,40",
                       "--batch-size", "1,2", "--steps", "2", "--warmup", "0", "--sparq-k", "16", "--prefill",
                       "--json", str(out), "--plot", str(tmp_path / "decode.png")])
    assert code == 0
    rows = read_json(out)["rows"]
    assert len(rows) == 2 * 2 * 2  # contexts x batches x {dense, sparq}
    assert {r["attention"] for r in rows} == {"dense", "sparq"}
    for row in rows:
        assert row["decode_tokens_per_s"] > 0 and row["kv_gb_s"] >= 0
        assert row["live_length"] == row["prompt_tokens"] + 2  # the median of two steps at context + 1, + 2
        if row["attention"] == "dense":
            assert row["speedup_vs_dense"] == 1.0 and row["theoretical_speedup"] == 1.0
        # --prefill: our prefill of the context's N tokens, timed for N > 0 only
        assert (row["prefill_tokens_per_s"] > 0) if row["prompt_tokens"] else row["prefill_tokens_per_s"] is None
    sparq_40 = [r for r in rows if r["attention"] == "sparq" and r["prompt_tokens"] == 40]
    assert all(r["theoretical_kv_speedup"] > 1 for r in sparq_40)  # S = 42 > k = 16: SparQ reads less
    assert (tmp_path / "decode.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "dense tok/s" in printed and "prefill, float32, B = 1" in printed and "N=40: " in printed


def test_decode_adaptive_rows_beside_sparq_at_the_same_target(tmp_path, smollm2_checkpoint):
    """--adaptive: a sparq-adaptive row per --compression target beside SparQ's, both reading about the
    target's share of dense's KV bytes."""
    out = tmp_path / "decode.json"
    code = bench_cli.main(["decode", "--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "600",
                           "--batch-size", "1", "--steps", "2", "--warmup", "0", "--compression", "1/4",
                           "--adaptive", "--json", str(out)])
    assert code == 0
    rows = {r["attention"]: r for r in read_json(out)["rows"]}
    assert set(rows) == {"dense", "sparq", "sparq-adaptive"}
    assert rows["sparq-adaptive"]["adaptive_compression"] == 0.25 and rows["sparq"]["adaptive_compression"] is None
    for name in ("sparq", "sparq-adaptive"):
        assert rows[name]["theoretical_kv_speedup"] == pytest.approx(4, rel=0.1)


def test_decode_cache_formats_each_run_every_policy_on_its_own_caches(tmp_path, smollm2_checkpoint):
    """--cache-format auto,int8/int4: dense and SparQ on each format's caches, speedups over dense on the
    first, each row's KV bytes as its cache stores them (int8 rows of d plus a 4-byte scale)."""
    out = tmp_path / "decode.json"
    code = bench_cli.main(["decode", "--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "200",
                           "--batch-size", "1", "--steps", "2", "--warmup", "0", "--sparq-k", "16",
                           "--cache-format", "auto,int8/int4", "--json", str(out)])
    assert code == 0
    rows = {r["attention"]: r for r in read_json(out)["rows"]}
    assert set(rows) == {"dense", "sparq", "dense int8/int4", "sparq int8/int4"}
    assert rows["dense int8/int4"]["cache_format"] == "int8/int4" and rows["dense"]["cache_format"] == "auto"
    d = 64  # fp32 checkpoint: an int8 row of d moves d + 4 bytes for 4 d
    assert rows["dense int8/int4"]["theoretical_kv_speedup"] == pytest.approx(4 * d / (d + 4))
    assert rows["sparq int8/int4"]["theoretical_kv_speedup"] > rows["sparq"]["theoretical_kv_speedup"]


def test_decode_near_the_model_context_ends_there(smollm2_checkpoint):
    from model import ModelArgs

    max_context = ModelArgs.from_json(smollm2_checkpoint / "config.json").max_context
    starts = bench_decode._first_decode_positions([0, 100, max_context], max_context, steps=19)
    assert starts == {0: 0, 100: 100, max_context: max_context - 19}


def test_attention_json_rows(tmp_path, capsys):
    out = tmp_path / "attention.json"
    code = bench_cli.main(["attention", "--shape", "smollm2", "--batch-size", "1", "--seq-len", "300",
                       "--iters", "2", "--warmup", "0", "--max-copies", "2", "--json", str(out)])
    assert code == 0
    rows = read_json(out)["rows"]
    methods = {r["method"] for r in rows}
    assert {"sparq-torch", "sparq-fused", "sparq-fused-1xk", "sparq-floor"} <= methods
    assert any(m.startswith("dense") for m in methods)
    for row in rows:
        assert row["time_ms"] > 0 and row["theoretical_speedup"] > 0
        assert row["of_theory"] == pytest.approx(row["speedup_vs_dense"] / row["theoretical_speedup"])
    by = {r["method"]: r for r in rows}
    # the floor reads one row of K^T and 8 of K and V: far fewer bytes than r = 16, k = 128 (here k >= S)
    assert by["sparq-floor"]["theoretical_speedup"] > 2 * by["sparq-fused"]["theoretical_speedup"]
    assert by["sparq-fused"]["floor_share"] == pytest.approx(by["sparq-floor"]["time_ms"] / by["sparq-fused"]["time_ms"])
    assert "floor" in capsys.readouterr().out


def test_attention_cache_formats_count_stored_bytes(tmp_path):
    """--cache-format auto,int8/int4: the fused ops on the quantized cache too, bytes as stored (counted
    here by hand), against dense on the float cache; dense runs once per int8 K/V."""
    out = tmp_path / "attention.json"
    S, r, k, d, n_kv = 300, 16, 128, 64, 3
    code = bench_cli.main(["attention", "--shape", "smollm2", "--batch-size", "1", "--seq-len", str(S), "--dtype",
                           "bfloat16", "--kernel", "cpu", "--cache-format", "auto,int8/int4,int8", "--iters", "2",
                           "--warmup", "0", "--max-copies", "2", "--json", str(out)])
    assert code == 0
    by = {row["method"]: row for row in read_json(out)["rows"]}
    assert {"dense-fused int8/int4", "sparq-fused int8/int4", "sparq-floor int8/int4", "sparq-fused int8"} <= set(by)
    assert "dense-fused int8" not in by  # the same op on the same K and V as dense-fused int8/int4
    assert by["sparq-fused int8/int4"]["cache_format"] == "int8/int4" and by["sparq-fused"]["cache_format"] == "auto"
    assert by["dense-fused int8/int4"]["dense_baseline"] in ("dense-matmul", "dense-sdpa", "dense-fused")
    dense_bf16 = (2 * S * d + 2 * d) * 2 * n_kv
    rest = 2 * k * d + 4 * d  # K and V elements: an int8 byte each, a 4-byte scale per row of d
    sparq_int4 = (S * r / 2 + S * 4 + rest + rest / d * 4) * n_kv  # K^T: half a byte each, a scale per position
    sparq_int8 = (S * r + S * 4 + rest + rest / d * 4) * n_kv  # K^T is K's int8 transposed, step 1 reads K's scales
    dense_int8 = ((2 * S * d + 2 * d) + (2 * S + 2) * 4) * n_kv
    assert by["sparq-fused int8/int4"]["theoretical_speedup"] == pytest.approx(dense_bf16 / sparq_int4)
    assert by["sparq-fused int8"]["theoretical_speedup"] == pytest.approx(dense_bf16 / sparq_int8)
    assert by["dense-fused int8/int4"]["theoretical_speedup"] == pytest.approx(dense_bf16 / dense_int8)
    assert by["sparq-fused int8/int4"]["floor_share"] == pytest.approx(
        by["sparq-floor int8/int4"]["time_ms"] / by["sparq-fused int8/int4"]["time_ms"])


def test_prefill_json_rows_time_both_and_check_each_against_fp64(tmp_path):
    """bench prefill: SDPA and the fused kernel on each case, flops over the causal pairs (counted here
    from the mask), each output's error from fp64 small in its dtype."""
    import torch

    out = tmp_path / "prefill.json"
    code = bench_cli.main(["prefill", "--heads", "6/2/16", "--chunk", "40", "--keys", "40,100,30", "--dtype",
                           "bfloat16,float32", "--rounds", "1", "--json", str(out)])
    assert code == 0
    rows = read_json(out)["rows"]
    assert [(r["dtype"], r["T"], r["S"]) for r in rows] == [(dt, 40, S) for dt in ("bfloat16", "float32")
                                                            for S in (40, 100)]  # S = 30 < T: no such chunk
    for row in rows:
        T, S = row["T"], row["S"]
        allowed = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S): key <= query position
        assert row["flops"] == 4 * 16 * 6 * int(allowed.sum())
        assert row["sdpa_ms"] > 0 and row["fused_ms"] > 0 and row["speedup"] == pytest.approx(
            row["sdpa_ms"] / row["fused_ms"])
        bound = 2e-2 if row["dtype"] == "bfloat16" else 1e-5
        assert row["sdpa_error"] < bound and row["fused_error"] < bound


@pytest.mark.parametrize("argv, fragment", [
    (["decode", "--prompt-tokens", "1k"], "--prompt-tokens"),
    (["decode", "--batch-size", "0"], "--batch-size"),
    (["attention", "--shape", "gpt5"], "gpt5"),
    (["attention", "--cache-format", "float16"], "--cache-format float16"),
    (["attention", "--cache-format", "int8", "--kernel", "torch"], "--kernel cpu"),
    (["decode", "--adaptive"], "--compression"),
    (["decode", "--cache-format", "int9"], "--kv-dtype"),
    (["decode", "--compile-backend", "aot"], "give --compile"),
    (["prefill", "--heads", "14/64"], "H/n_kv/d"),
    (["prefill", "--heads", "9/2/64"], "multiple of the KV heads"),
    (["prefill", "--chunk", "2048", "--keys", "1024"], "a chunk sees itself"),
])
def test_bad_input_is_a_one_line_error(argv, fragment, capsys):
    status = bench_cli.main(argv)
    assert_one_line_error((status, capsys.readouterr().err), fragment)


def test_decode_ragged_case_counts_every_row_at_its_length(tmp_path, smollm2_checkpoint):
    out = tmp_path / "decode.json"
    code = bench_cli.main(["decode", "--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "40",
                       "--batch-size", "1", "--ragged", "30,200", "--steps", "2", "--warmup", "0", "--sparq-k", "16",
                       "--sparq-r", "8,16", "--kernel", "torch", "--json", str(out)])
    assert code == 0
    rows = [r for r in read_json(out)["rows"] if r["prompt_tokens"] == "30/200"]
    assert {r["attention"] for r in rows} == {"dense", "sparq-r8", "sparq-r16"}  # one SparQ policy per r
    assert all(r["batch_size"] == 2 for r in rows)
    dense = next(r for r in rows if r["attention"] == "dense")
    # two rows at live lengths 32 and 202 (the median of two steps): 2 S d + 2 d per head, layer and row
    per_row = [(2 * S * 64 + 2 * 64) * 3 * 30 * 4 for S in (32, 202)]
    assert dense["kv_bytes_read_per_step"] == sum(per_row)


def test_beside_llamacpp_shows_every_sparq_r(monkeypatch, capsys, tmp_path):
    """Our B = 1 rows (dense and one SparQ per r) beside llama.cpp's decode at each context: the median
    of its rounds, in the dtype's format or the one --llamacpp-format names (llama.cpp faked: its build
    and timing are bench/llamacpp.py's own tests)."""
    import argparse
    from types import SimpleNamespace

    from bench import llamacpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    requantized, per_round = [], iter([10.0, 30.0, 20.0] * 2)
    monkeypatch.setattr(llamacpp, "build", lambda *a, **k: SimpleNamespace(version="llama.cpp test"))
    monkeypatch.setattr(llamacpp, "requantize", lambda g, fmt, build_: requantized.append(fmt) or g)
    monkeypatch.setattr(llamacpp, "time_decode", lambda g, contexts, *a, **k: [
        {"context": c, "decode_tok_s": next(per_round), "prefill_tok_s": 100.0, "load_avg": 0.0} for c in contexts])

    def llama_rows(fmt=None):
        args = argparse.Namespace(llamacpp=str(gguf), llamacpp_format=fmt, llamacpp_kv=None, steps=4, threads=2)
        llama = bench_decode._LlamaCpp(args, [4096])
        return llama, bench_decode._median_rounds([llama.time("bfloat16", prefill=i == 0) for i in range(3)], "bfloat16")

    rows = [{"dtype": "bfloat16", "prompt_tokens": 4096, "batch_size": b, "sparq_r": r, "decode_tokens_per_s": t}
            for b in (1, 4) for r, t in ((None, 5.0), (16, 8.0), (32, 7.0))]
    llama, theirs = llama_rows()
    assert theirs[("bfloat16", 4096)]["decode_tok_s_rounds"] == [10.0, 30.0, 20.0] and requantized == ["bf16"]
    bench_decode._beside_llamacpp(rows, theirs, llama, [4096], ["bfloat16"])
    out = capsys.readouterr().out
    assert "SparQ r=16" in out and "SparQ r=32" in out and "r=32/llama" in out and "medians of 3 rounds" in out
    line = next(x for x in out.splitlines() if x.startswith("bfloat16"))
    assert line.split()[1:9] == ["bf16", "4096", "20.0", "5.0", "8.0", "7.0", "0.25x", "0.40x"]
    assert "ours prefill" not in out  # no --prefill: no prefill columns

    for row in rows:  # with --prefill: our prefill beside llama.cpp's, and the ratio
        row["prefill_tokens_per_s"] = 150.0
    llama, theirs = llama_rows("q8_0")  # an int8 checkpoint beside Q8_0
    bench_decode._beside_llamacpp(rows, theirs, llama, [4096], ["bfloat16"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("bfloat16"))
    assert "ours prefill" in out and line.split()[-3:] == ["100", "150", "1.50x"] and line.split()[1] == "q8_0"
    assert requantized[-1] == "q8_0"
    with pytest.raises(UserError, match="unknown --llamacpp-format 'q3'"):
        llama_rows("q3")


def test_decode_cases_and_policies_take_turns_step_by_step(monkeypatch):
    """_time_decode: step i of every case and policy runs before step i + 1 of any, each from its own
    live positions (the caches rewound to them, ragged rows made ragged, then the CPU's caches
    cleared, then an untimed lead-in step of the same policy), and each case's medians come from its
    own timed steps after the warm-up (a fake clock: a step of B rows at step i takes B (dense) or
    2B (SparQ) seconds plus i / 10; a lead-in takes 100 more, which no median may see)."""
    import types

    calls, clock = [], [0.0]
    monkeypatch.setattr(bench_decode, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Cache:
        def rewind(self, length):
            calls.append(("rewind", length))

    class Model:
        caches = [Cache()]

        def set_live_lengths(self, lengths):
            calls.append(("live", lengths.tolist()))

        def set_decode_attention(self, make):
            calls.append(("policy", make(0)))

    def step_of(case, name):  # each (case, policy) its own step function
        def step(model, token, positions, length):
            i = sum(c[0] == "step" for c in calls) // 12  # 3 cases x 2 policies x (lead-in, timed) a round
            lead_in = calls[-1] == ("evict",)
            clock[0] += token.shape[0] * (2 if name == "sparq" else 1) + i / 10 + (100 if lead_in else 0)
            calls.append(("step", token.shape[0], positions.flatten().tolist(), length, (case, name)))
        return step

    cases = [[10], [20, 20], [5, 30]]
    steps = {(c, name): step_of(c, name) for c in range(3) for name in ("dense", "sparq")}
    seconds = bench_decode._time_decode(steps, Model(), {"dense": ["dense"], "sparq": ["sparq"]},
                                 cases, steps=2, warmup=1, evict=lambda: calls.append(("evict",)))
    expected = []
    for i in range(3):
        for c, starts in enumerate(cases):
            top = max(starts)
            positions = [s + i for s in starts] if len(set(starts)) > 1 else [top + i]
            for name in ("dense", "sparq"):  # the lead-in, then the timed step one position on
                expected += [("step", len(starts), positions, top + i + 1, (c, name)),
                             ("step", len(starts), [p + 1 for p in positions], top + i + 2, (c, name))]
    assert [c for c in calls if c[0] == "step"] == expected
    assert calls[:6] == [("rewind", 10), ("policy", "dense"), ("evict",), ("step", 1, [10], 11, (0, "dense")),
                         ("step", 1, [11], 12, (0, "dense")), ("rewind", 10)]
    step_at = [j for j, c in enumerate(calls) if c[0] == "step"]
    assert all(calls[j - 1] == ("evict",) for j in step_at[0::2])  # caches cleared right before each lead-in
    assert ("live", [5 + 2, 30 + 2]) in calls and ("live", [20, 20]) not in calls
    for s, starts in zip(seconds, cases):  # the median of steps 1 and 2: + 0.15
        B = len(starts)
        assert s == pytest.approx({"dense": B + 0.15, "sparq": 2 * B + 0.15})


@pytest.mark.parametrize("argv, fragment", [
    (["decode", "--steps", "0"], "--steps"), (["attention", "--seq-len", "abc"], "--seq-len"),
    (["linear", "--rows", "99"], "--rows")])
def test_bench_flags_are_one_line_errors(argv, fragment):
    assert_one_line_error(run_main(bench_cli.main, *argv), fragment)


def test_speculate_json_rows(tmp_path, smollm2_checkpoint, capsys):
    """Every method generates the same greedy tokens as dense (the speculators are lossless; SparQ alone
    need not be), the speculators report their acceptance and theory; with a draft model (here the
    verifier's own checkpoint: every proposal accepted)."""
    out = tmp_path / "speculate.json"
    code = bench_cli.main(["speculate", "--checkpoint", str(smollm2_checkpoint), "--draft-checkpoint",
                           str(smollm2_checkpoint), "--prompt-tokens", "300", "--batch-size", "2", "--new-tokens", "8",
                           "--rounds", "1", "--speculate-k", "2", "--sparq-k", "64", "--json", str(out)])
    assert code == 0
    rows = {r["method"]: r for r in read_json(out)["rows"]}
    assert set(rows) == {"dense", "sparq", "sparq-draft k=2", "model-draft k=2"}
    for name in ("sparq-draft k=2", "model-draft k=2"):
        assert rows[name]["same_tokens_as_dense"] and rows[name]["speculate_k"] == 2
        assert 0 <= rows[name]["acceptance_rate"] <= 1 and rows[name]["theory_speedup"] > 0
        row = rows[name]  # the theory against dense: tokens per round x dense's step / the round's cost
        dense_step = 1 / rows["dense"]["decode_tokens_per_s"]
        assert row["theory_vs_dense"] == pytest.approx(row["tokens_per_round"] * dense_step / (
            2 * row["draft_step_s"] + row["verify_pass_s"]))
        a = row["acceptance_for_goal"]  # the acceptance at which this theory reaches the goal (1.15x), or None
        reach = 3 * dense_step / (2 * row["draft_step_s"] + row["verify_pass_s"])
        assert (a is None) == (reach < 1.15) and row["goal"] == 1.15
    assert rows["model-draft k=2"]["acceptance_rate"] == 1.0 and rows["model-draft k=2"]["tokens_per_round"] == 3.0
    assert rows["dense"]["speedup_vs_dense"] == 1.0
    assert "sparq-draft k=2" in capsys.readouterr().out


def test_speculate_predict_is_the_byte_model(tmp_path):
    """--predict: a draft of the verifier's own shape costs a verifier step, so n = 2 gives 1/3 at acceptance
    0 (one token for three steps' bytes) and 1 at acceptance 1; the bytes are the weights' and the dense
    KV's (2 S d per KV head and layer, plus the new k and v)."""
    out = tmp_path / "predict.json"
    code = bench_cli.main(["speculate", "--predict", "tiny", "--draft-shape", "tiny", "--dtype", "bfloat16",
                           "--prompt-tokens", "1000", "--batch-size", "2", "--speculate-k", "2",
                           "--acceptance", "0,1", "--json", str(out)])
    assert code == 0
    (row,) = read_json(out)["rows"]
    assert row["predicted_speedup"] == {"0.0": pytest.approx(1 / 3), "1.0": pytest.approx(1.0)}
    args = ModelArgs.from_shape("tiny")
    kv = args.n_layer * args.n_kv_head * 2 * (2 * 1000 * args.head_dim + 2 * args.head_dim) * 2
    weights = sum(p.numel() for p in Transformer(args).parameters()) * 2
    assert row["verifier_step_bytes"] == row["draft_step_bytes"] == weights + kv


def test_alternating_medians_takes_turns_and_times_each_call():
    """A/B timing (scripts/studies/compile_backend_ab.py, dense_step_ab.py): warm calls first, then rounds in which
    each candidate runs its reps in turn; the result is seconds per call, a slow call measured as slow."""
    import time

    from bench.common import alternating_medians

    order = []
    calls = {"fast": lambda: order.append("fast"), "slow": lambda: (order.append("slow"), time.sleep(0.004))}
    seconds = alternating_medians(calls, rounds=3, reps=2, warm=1)
    assert order == ["fast", "slow"] + ["fast", "fast", "slow", "slow"] * 3
    assert seconds["slow"] >= 0.004 > seconds["fast"]
