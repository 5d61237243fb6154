"""The accuracy harness (python -m evals) and its tasks: scoring, budgets, task construction, the shared-prefill rewind, the CLI, and a smoke run."""
import json
import math
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import data
import evals.__main__ as evals_cli
import baselines
import budgets
import policies
from evals import journal as evals_journal
from evals import report as evals_report
from evals import runner as evals_runner
from evals import tasks
from cli import UserError
from conftest import assert_one_line_error, read_json, run_main, run_python, strict_json
from decoding import Generator
from model import ModelArgs, Transformer
from policies import AttentionSettings, policy_factory

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = data.DEFAULT_CHECKPOINT
HAVE_CHECKPOINT = (CHECKPOINT / "model.pth").is_file() and (CHECKPOINT / "config.json").is_file()


class ByteTokenizer:
    """A stand-in tokenizer: one token per UTF-8 byte, a fake chat template, stop id 256."""

    stop_ids = {256}
    eos_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_prompt(self, text, chat=False):
        return self.encode(f"<user>{text}</user><assistant>" if chat else text)


# ---------------------------------------------------------------------------------------------
# Scoring on hand-made inputs
# ---------------------------------------------------------------------------------------------


def test_repetition_counts_characters_before_divergence():
    assert tasks.repetition_chars("can; for my good uncle", "can; for my good uncle Gloucester") == 22
    assert tasks.repetition_chars("can; for my goad", "can; for my good") == 14  # "can; for my go"
    assert tasks.repetition_chars("x", "can") == 0
    assert tasks.repetition_chars("", "can") == 0
    assert tasks.repetition_chars("can you", "can") == 3  # capped by the reference


def test_needle_match_ignores_case_and_spacing():
    assert tasks.contains_key(" eat a sandwich and sit in dolores  park.", "Dolores Park")
    assert tasks.contains_key(" 71432.", "71432")
    assert not tasks.contains_key(" 71423.", "71432")
    assert not tasks.contains_key(" visit the Golden Gate Bridge.", "Dolores Park")


def test_bpc_of_uniform_distribution():
    V, tokens, chars = 49152, 10, 37
    logprobs = [-math.log(V)] * tokens
    assert tasks.bits_per_character(logprobs, chars) == pytest.approx(math.log2(V) * tokens / chars)
    assert tasks.answer_nll(logprobs) == pytest.approx(math.log(V))


def test_bpc_task_scores_perplexity_beside_bits_per_character():
    """The bpc task's answer_nll (nats per token: its paired difference is a log perplexity ratio) and bpc are the
    same sum of log-probabilities, over tokens and over characters."""
    logprobs = [-0.5, -2.0, -1.25, -0.25]
    example = tasks.Example(prompt=[1, 2], answer=[3, 4, 5, 6], answer_chars=13)
    scores = tasks.TASKS["bpc"].score(example, tasks.Outcome(logprobs=logprobs))
    assert set(scores) == {name for name, _ in tasks.TASKS["bpc"].metrics} == {"bpc", "answer_nll"}
    assert scores["answer_nll"] == pytest.approx(1.0)
    assert scores["bpc"] == pytest.approx(scores["answer_nll"] * 4 / math.log(2) / 13)


def test_mean_and_standard_error():
    mean, se = evals_runner.mean_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx(math.sqrt(1 / 3 / 4))
    assert evals_runner.mean_stderr([2.0])[1] is None  # null in the JSON, no error shown


# ---------------------------------------------------------------------------------------------
# Budgets (paper, Appendix G)
# ---------------------------------------------------------------------------------------------


def args_with_head_dim(d: int) -> ModelArgs:
    return ModelArgs(vocab_size=10, dim=4 * d, n_layer=1, n_head=4, n_kv_head=2, head_dim=d, intermediate_size=8)


def test_sparq_r_for_one_eighth_at_2048_matches_the_formula():
    S, d, k = 2048, 64, 128
    budget = budgets.solve_budget("sparq", Fraction(1, 8), S, args_with_head_dim(d))
    dense = 2 * S * d + 2 * d
    r_star = (dense / 8 - 2 * k * d - 4 * d) / S  # S r + 2 k d + 4 d = dense / 8
    assert budget.k_top == 128 and budget.r == round(r_star) == 8
    assert budget.achieved == pytest.approx((S * 8 + 2 * k * d + 4 * d) / dense)


@pytest.mark.parametrize("target", [Fraction(1, 2), Fraction(1, 4), Fraction(1, 8)])
@pytest.mark.parametrize("S", [1024, 2048, 4096])
def test_budgets_hit_the_target(target, S):
    d = 64
    dense = 2 * S * d + 2 * d
    for method, transfers in [("h2o", lambda k: 2 * k * d + 2 * d + 2 * S),
                              ("local", lambda k: 2 * k * d + 2 * d),
                              ("oracle", lambda k: 2 * k * d + 2 * d)]:
        b = budgets.solve_budget(method, target, S, args_with_head_dim(d))
        assert b.achieved == pytest.approx(transfers(b.k_top) / dense)
        # the closest integer budget
        assert abs(transfers(b.k_top) / dense - target) <= abs(transfers(b.k_top + 1) / dense - target)
        assert abs(transfers(b.k_top) / dense - target) <= abs(transfers(b.k_top - 1) / dense - target)
    sparq = budgets.solve_budget("sparq", target, S, args_with_head_dim(d))
    k = sparq.settings.sparq_k
    err = lambda r: abs((S * r + 2 * k * d + 4 * d) / dense - target)
    assert all(err(sparq.r) <= err(r) for r in range(1, d + 1))  # the closest r at the solver's k
    # k = 128 unless 128 positions and r = 1 exceed the target (S = 1024 at 1/8): then half of it, and within it
    assert k == 128 or (k == 64 and (S + 2 * 128 * d + 4 * d) / dense > target)


def test_topk_cannot_go_below_one_half_and_dense_is_one():
    b = budgets.solve_budget("topk", Fraction(1, 8), 2048, args_with_head_dim(64))
    assert b.k_top == 1 and b.achieved == pytest.approx(0.5, abs=0.01)
    for method in ("sparq", "h2o", "local", "dense"):
        assert budgets.solve_budget(method, Fraction(1), 2048, args_with_head_dim(64)).method == "dense"



def test_quest_at_one_sixteenth_takes_pages_of_32_and_one_page_left_is_marked(tmp_path):
    """Quest's page summaries cost 2d per page of 16, 1/16 of dense's transfers: at 1/16 the solver takes pages
    of 32 (half the metadata) and selects several; a budget left one page of 16, the newest position's, which
    it reads whatever the query (pages_read), selects nothing. no_selection marks that cell (‡), by the record's
    own page size, not 1/8's nor the solver's 1/16; the needle map marks its misses there with the reason, and
    an off-target column with its own."""
    S, d = 4096, 64
    solved = budgets.solve_budget("quest", Fraction(1, 16), S, args_with_head_dim(d))
    assert solved.settings.page_size == 32 and solved.k_top > 32 and solved.achieved == pytest.approx(1 / 16, abs=1e-3)
    assert baselines.QuestDecode(solved.k_top, page=32).pages_read(S) > 1
    one_page = AttentionSettings("quest", kv_budget=16, page_size=16)  # the summaries' 1/16 and one page
    quest = budgets.Budget("quest", Fraction(1, 16), S, one_page, achieved=1 / 16 + 16 / S)
    assert baselines.QuestDecode(quest.k_top).pages_read(S) == 1
    eighth = budgets.solve_budget("quest", Fraction(1, 8), S, args_with_head_dim(d))
    assert eighth.k_top > 16
    records = evals_report.budget_records({("needle", "quest", b.target, S): b for b in (quest, eighth)})
    assert evals_report.no_selection(records) == {("needle", S, "quest", "1/16")}
    solved_record = evals_report.budget_records({("needle", "quest", solved.target, S): solved})
    assert evals_report.no_selection(solved_record) == set()
    assert evals_report.no_selection([{**records[0], "page_size": None}], page_size=8) == set()  # older records

    results = evals_runner.Results()
    cell = evals_runner.Cell("needle", S)
    results.depths[cell] += [50, 50]
    dense = evals_runner.Config(budget("dense", Fraction(1), S), [])
    sparq = evals_runner.Config(budget("sparq", Fraction(1, 16), S, r=1, k=128, achieved=0.09), [])  # off target
    for config, em in ((dense, [1.0, 1.0]), (evals_runner.Config(quest, []), [0.0, 0.0]),
                       (evals_runner.Config(eighth, []), [0.0, 1.0]), (sparq, [1.0, 0.0])):
        results.add(cell, config, "exact_match", em)
        results.achieved[(cell, config.method, config.budget.target)] += [config.budget.achieved]
    empty = evals_report.no_selection(records)
    marks = evals_report.needle_map_marks(results.rows(), empty)
    assert marks == {("quest", "1/16", S): "‡", ("sparq", "1/16", S): "†"}  # quest 1/8 misses one, unmarked
    text = evals_report.needle_map_table(results.needle_map(), marks=marks)
    assert "quest 1/16 at 4k tokens, depth 50%: missed 2 that dense found (dense 2/2, quest 0/2; its budget leaves " \
           "nothing to select)" in text
    assert "sparq 1/16 at 4k tokens, depth 50%: missed 1 that dense found (dense 2/2, sparq 1/2; off its target " \
           "compression)" in text
    assert "quest 1/8 at 4k tokens, depth 50%: missed 1 that dense found (dense 2/2, quest 1/2)\n" in text + "\n"
    assert re.search(r"50%\s+-!‡", text) and evals_report.MAP_MARKS in text
    assert evals_report.MAP_MARKS not in evals_report.needle_map_table(results.needle_map())
    evals_report.plot_needle_map(results.needle_map(), tmp_path / "map.png", "M", marks)
    assert (tmp_path / "map.png").stat().st_size > 5000


@pytest.mark.parametrize("text", ["1/0", "abc", "0", "2", "-1/4", ""])
def test_bad_compression_is_a_user_error(text):
    with pytest.raises(UserError):
        policies.parse_compression(text)


def test_compression_parsing():
    assert policies.parse_compression("1/4") == Fraction(1, 4)
    assert policies.parse_compression("0.125") == Fraction(1, 8)
    assert evals_cli.parse_lengths("1k,2048") == [1024, 2048]


# ---------------------------------------------------------------------------------------------
# Task construction: exact lengths, determinism
# ---------------------------------------------------------------------------------------------


def test_retrieval_examples_are_deterministic_from_the_seed():
    tok = ByteTokenizer()
    a = tasks.retrieval_examples(tok, 3000, 4, seed=7)
    b = tasks.retrieval_examples(tok, 3000, 4, seed=7)
    c = tasks.retrieval_examples(tok, 3000, 4, seed=8)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    for e in a:
        assert len(e.prompt) == 3000
        text = tok.decode(e.prompt)
        key = e.meta["key"]
        assert text.count("One of the special magic numbers for ") == 4  # the asked key and 3 distractors
        assert f"One of the special magic numbers for {key} is: {e.key}." in text
        assert text.endswith(f"for {key} mentioned in the text above?</user><assistant>"
                             f"The special magic number for {key} is")
        assert tok.decode(e.answer) == f" {e.key}." and len(e.key) == 7
    assert sorted(e.meta["depth"] for e in a) == [0.125, 0.375, 0.625, 0.875]  # the asked key's depth cycles


RULER_BUILDERS = {"ruler-mv": tasks.multivalue_examples, "ruler-mq": tasks.multiquery_examples,
                  "ruler-vt": tasks.variable_tracking_examples, "ruler-cwe": tasks.common_words_examples}


@pytest.mark.parametrize("task", sorted(RULER_BUILDERS))
def test_ruler_examples_hold_their_answers_and_are_deterministic(task):
    """A fixed seed gives fixed examples of exactly the length, whose answers the prompt holds (in the
    form the task states them), and another seed other examples; the task is registered."""
    tok, build = ByteTokenizer(), RULER_BUILDERS[task]
    a, b, c = build(tok, 3000, 3, seed=5), build(tok, 3000, 3, seed=5), build(tok, 3000, 3, seed=6)
    assert [e.prompt for e in a] == [e.prompt for e in b] and [e.prompt for e in a] != [e.prompt for e in c]
    assert task in tasks.TASKS
    for e in a:
        assert len(e.prompt) == 3000
        text, answers = tok.decode(e.prompt), e.meta["answers"]
        suffix = {"ruler-mv": "mentioned in the text are", "ruler-mq": "mentioned in the text are",
                  "ruler-vt": "they are:", "ruler-cwe": "appear most often in the list are:"}[task]
        assert "</user><assistant>" in text[-300:] and text.endswith(suffix) and answers
        if task == "ruler-mv":
            assert len(answers) == 4 and all(f"numbers for {e.meta['key']} is: {v}." in text for v in answers)
        elif task == "ruler-mq":
            assert all(f"numbers for {k} is: {v}." in text for k, v in zip(e.meta["keys"], answers))
            assert all(k in text.split("</user>")[0].split("\n\n")[-1] for k in e.meta["keys"])  # all asked
        elif task == "ruler-vt":  # the chain: the first holds the value, each next one the previous
            assert f"VAR {answers[0]} = {e.meta['value']}." in text
            assert all(f"VAR {answers[j]} = VAR {answers[j - 1]}." in text for j in range(1, len(answers)))
            assert text.index(f"VAR {answers[0]} =") < text.index(f"VAR {answers[-1]} =")
        else:  # the answers are the 10 words the list holds most often, each more often than any other
            counts = Counter(re.findall(r"\d+\. ([a-z]+)", text)).most_common()
            assert {w for w, _ in counts[:10]} == set(answers) and counts[9][1] > counts[10][1]


def test_ruler_scorer_counts_whole_answers():
    e = tasks.Example(prompt=[], meta={"answers": ["time", "ABCDE", "1234567"]})
    score = tasks.TASKS["ruler-vt"].score
    assert score(e, tasks.Outcome(text="times, abcde and 1234567")) == {"recall": 2 / 3, "exact_match": 0.0}
    assert score(e, tasks.Outcome(text=" Time: ABCDE,\n1234567.")) == {"recall": 1.0, "exact_match": 1.0}
    assert score(e, tasks.Outcome(text="12345678 ABCDEF")) == {"recall": 0.0, "exact_match": 0.0}
    assert tasks.TASKS["ruler-cwe"].finished(e, "time abcde 1234567") and not tasks.TASKS["ruler-cwe"].finished(e, "time")


def test_needle_examples_have_exact_length_and_the_needle():
    tok = ByteTokenizer()
    examples = tasks.needle_examples(tok, 3000, 4, seed=0)
    assert {len(e.prompt) for e in examples} == {3000}
    sf, passkey = examples[0], examples[1]
    assert tasks.SF_NEEDLE in tok.decode(sf.prompt) and sf.key == "Dolores Park"
    assert f"The pass key is {passkey.key}." in tok.decode(passkey.prompt)
    depths = [e.meta["depth"] for e in examples]
    assert depths == sorted(depths) and depths[0] < 0.5 < depths[-1]


def test_needle_depths_put_the_needle_at_those_depths_of_one_haystack():
    """--depths: --examples examples at each depth (the two variants alternating), the needle further into
    the prompt at each larger depth: at the haystack's start at 0, after its last sentence boundary at
    100; example i at every depth is one haystack and key, the needle moved. Without --depths the
    examples are today's (no map depth)."""
    tok = ByteTokenizer()
    examples = tasks.needle_examples(tok, 3000, 2, seed=0, depths=(0, 50, 100))
    assert {len(e.prompt) for e in examples} == {3000}
    assert [e.meta["depth_percent"] for e in examples] == [0, 0, 50, 50, 100, 100]
    assert [e.meta["variant"] for e in examples] == ["sf", "passkey"] * 3
    assert [e.meta["depth"] for e in examples] == [0, 0, 0.5, 0.5, 1.0, 1.0]
    built = tasks.TASKS["needle"].build(tok, 3000, 2, 0, tasks.TaskOptions(needle_depths=(0, 50, 100)))
    assert [e.prompt for e in built] == [e.prompt for e in examples]
    for i in range(2):
        same = examples[i::2]  # example i at 0, 50, 100
        needle = tasks.SF_NEEDLE if i == 0 else f"The pass key is {same[0].key}. Remember it. {same[0].key} is the pass key."
        texts = [tok.decode(e.prompt) for e in same]
        at = [text.index(needle) for text in texts]
        assert at[0] == len("<user>") and at[0] < at[1] < at[2]  # 0: the haystack's first words
        assert 0.4 < (at[1] - at[0]) / (at[2] - at[0]) < 0.6  # 50: the middle
        tail = texts[2][at[2] + len(needle):texts[2].index("\n\nAnswer the question")]
        assert ". " not in tail  # 100: no sentence boundary after it
        assert len({text.replace(needle + " ", "", 1) for text in texts}) == 1 and len({e.key for e in same}) == 1
    default = tasks.TASKS["needle"].build(tok, 3000, 4, 0, tasks.TaskOptions())
    assert [e.prompt for e in default] == [e.prompt for e in tasks.needle_examples(tok, 3000, 4, seed=0)]
    assert not any("depth_percent" in e.meta for e in default)
    assert evals_cli.parse_depths("0, 12.5,50%,100,50") == [0, 12.5, 50, 100]


def test_needle_map_rows_and_their_records(tmp_path):
    """Results.needle_map: a row per (length, depth, method, target), n the examples at that depth, the
    fraction found and the examples dense found and the method missed; a batch record holds the depths
    (and a run without them records none), and add_record of the records gives the same map."""
    short, long = evals_runner.Cell("needle", 1024), evals_runner.Cell("needle", 2048)
    dense = evals_runner.Config(budget("dense", Fraction(1), 1024), [])
    sparq = evals_runner.Config(budget("sparq", Fraction(1, 8), 1024, r=8, k=16, achieved=0.125), [])
    batches = []
    for cell, depths, d_em, s_em in ((short, [0, 0, 50, 50], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]),
                                     (long, [0, 0], [1.0, 0.0], [0.0, 0.0]),
                                     (short, [100, 100], [1.0, 1.0], [1.0, 1.0])):
        batch = evals_runner.Results()
        batch.depths[cell] += depths
        for config, em in ((dense, d_em), (sparq, s_em)):
            batch.add(cell, config, "exact_match", em)
            batch.add(cell, config, "answer_nll", [0.5] * len(em))
        batches.append(batch.record())
    assert all("depths" in r for r in batches) and "depths" not in evals_runner.Results().record()
    results = evals_runner.Results()
    for record in batches:
        results.add_record(json.loads(json.dumps(record)))
    rows = {(r["attention"], r["depth"]): r for r in results.needle_map() if r["length"] == 1024}
    assert len(rows) == 6 and {r["n"] for r in results.needle_map()} == {2} and len(results.needle_map()) == 8
    assert rows[("dense", 50)]["exact_match"] == 0.5 and rows[("sparq", 0)]["exact_match"] == 0.5
    assert [rows[("sparq", d)]["missed_vs_dense"] for d in (0, 50, 100)] == [1, 0, 0]  # 50: dense missed one, sparq none
    assert rows[("sparq", 0)]["compression_label"] == "1/8" and rows[("sparq", 0)]["answer_nll"] == 0.5
    assert [r["attention"] for r in results.needle_map()][:3] == ["dense"] * 3
    pooled = {(r["size"], r["attention"], r["metric"]): r for r in results.rows()}
    assert pooled[(1024, "sparq", "exact_match")]["n"] == 6  # the usual rows pool the depths
    text = evals_report.needle_map_table(results.needle_map())
    assert "sparq 1/8 at 1k tokens, depth 0%: missed 1 that dense found (dense 2/2, sparq 1/2)" in text
    assert "sparq 1/8 at 2k tokens, depth 0%: missed 1 that dense found (dense 1/2, sparq 0/2)" in text
    assert re.search(r"depth\s+1k\s+2k\s+depth\s+1k\s+2k", text)
    assert re.search(r"0%\s+\+\s+1/2\s+0%\s+1/2!\s+-!\n", text)
    assert re.search(r"50%\s+1/2\s+\.\s+50%\s+\+\s+\.\n", text)  # . = not run at 2k
    evals_report.plot_needle_map(results.needle_map(), tmp_path / "map.png", "M (float32)")
    assert (tmp_path / "map.png").stat().st_size > 5000
    legacy = {k: v for k, v in batches[0].items() if k != "depths"}  # a journal line of a run without --depths
    old = evals_runner.Results()
    old.add_record(legacy)
    assert old.needle_map() == [] and old.rows()


def test_repetition_examples_repeat_a_passage_from_the_context():
    tok = ByteTokenizer()
    for e in tasks.repetition_examples(tok, 8000, 2, seed=0):
        assert len(e.prompt) == 8000
        text, passage = tok.decode(e.prompt), e.meta["passage"]
        assert text.endswith("\n\n" + passage)
        context = text[:-len(passage) - 2]
        assert len(context) >= 6000 and len(passage) >= 128
        assert passage + e.continuation in context  # the true continuation follows the passage in the context
        assert len(e.continuation) == 256


def test_repetition_needs_6000_characters_of_context():
    tok = ByteTokenizer()  # one token per character
    with pytest.raises(UserError, match="6000 characters"):
        tasks.repetition_examples(tok, 6100, 1, seed=0)  # the passage leaves < 6000 characters of context
    assert all(len(e.prompt) == 6600 for e in tasks.repetition_examples(tok, 6600, 3, seed=0))


def test_bpc_examples_continue_the_context():
    tok = ByteTokenizer()
    e = tasks.bpc_examples(tok, 2000, 1, seed=0, continuation_tokens=64)[0]
    assert len(e.prompt) == 2000 and len(e.answer) == 64 and e.answer_chars == 64
    assert tok.decode(e.prompt + e.answer) in data.essays_text()


# ---------------------------------------------------------------------------------------------
# The shared prefill and its rewind on a tiny random model
# ---------------------------------------------------------------------------------------------


def tiny_model(seed=0):
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=97, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=128,
                     max_context=512)
    return Transformer(args).eval()


def budget(method, target, S, r=None, k=None, achieved=1.0):
    """An eval Budget with hand-picked settings (r for SparQ; k: SparQ's k or a baseline's budget)."""
    if method == "sparq":
        settings = AttentionSettings("sparq", sparq_r=r, sparq_k=k)
    else:
        settings = AttentionSettings(method, kv_budget=k)
    return budgets.Budget(method, target, S, settings, achieved)


def configs_for(model, budgets):
    out = []
    for b in budgets:
        make = policy_factory(b.settings, model.args, model.kernels)
        out.append(evals_runner.Config(b, [make(i) for i in range(model.args.n_layer)]))
    return out


def test_oracle_with_full_budget_equals_dense_through_the_model():
    model = tiny_model()
    S = 60
    runner = evals_runner.Runner(model)
    dense, oracle = configs_for(model, [budget("dense", Fraction(1), S),
                                        budget("oracle", Fraction(1, 2), S, k=S + 64)])
    prompts = torch.randint(0, 97, (3, S)).tolist()
    targets = torch.randint(0, 97, (3, 20)).tolist()
    runner.prefill(prompts, [dense, oracle], 21)
    lp_dense, _, _ = runner.teacher_force(dense, targets)
    lp_oracle, _, _ = runner.teacher_force(oracle, targets)
    torch.testing.assert_close(torch.tensor(lp_oracle), torch.tensor(lp_dense), atol=1e-5, rtol=1e-5)


def test_shared_prefill_and_rewind_equal_fresh_runs():
    """Every policy decoding from one shared prefill (after another policy ran) matches generate.py's
    Generator running that policy alone: the rewind is exact, H2O included."""
    model = tiny_model(1)
    S, new = 48, 12
    budgets = [budget("dense", Fraction(1), S), budget("h2o", Fraction(1, 4), S, k=12),
               budget("h2o", Fraction(1, 8), S, k=6),  # shares the first H2O's prefill scores
               budget("sparq", Fraction(1, 4), S, r=4, k=8), budget("local", Fraction(1, 4), S, k=20),
               budget("topk", Fraction(1, 2), S, k=5)]
    prompts = torch.randint(0, 97, (2, S))
    runner = evals_runner.Runner(model)
    configs = configs_for(model, budgets)
    runner.prefill(prompts.tolist(), configs, new + 1)
    shared = {}
    for config in configs:
        runner.teacher_force(config, torch.randint(0, 97, (2, 7)).tolist())  # disturb the cache and state
        tokens, _ = runner.greedy(config, new, set(), lambda b, t: False)
        shared[config.budget] = tokens
    for config in configs_for(model, budgets):
        model.setup_caches(2, S + new)
        model.set_decode_attention(lambda i: config.layers[i])
        fresh, _ = Generator(model).generate(prompts, new)
        assert shared[config.budget] == fresh, config.budget.describe()
    assert len({str(tokens) for tokens in shared.values()}) > 2  # the budgets bite


@pytest.mark.parametrize("cap, offset, short, window", [(None, 0, 0, None), (None, 40, 0, None),
                                                        (5.0, 0, 77, None), (5.0, 40, 77, None),
                                                        (None, 0, 0, 50), (5.0, 40, 77, 200), (None, 40, 320, None)])
def test_shared_h2o_prefill_scores_match_a_naive_reference(cap, offset, short, window):
    """FanOut computes H2O's prefill scores once for every budget: they must be the column sums of the
    causal softmax, averaged over each KV head's query heads (chunk boundaries included), also for a
    later prefill chunk (queries after `offset` earlier keys), soft-capped logits, padding queries (the
    second row `short` positions shorter; by 320 it ended before this chunk's queries) and a
    sliding-window layer (the query at p sees keys (p - window, p])."""
    from baselines import H2ODecode

    torch.manual_seed(3)
    B, H, n_kv, T, d = 2, 6, 2, 300, 16
    S = offset + T
    q = (2 * torch.randn(B, T, H, d)).transpose(1, 2)  # non-contiguous, as in the model
    k = 2 * torch.randn(B, n_kv, S, d)
    ragged = short > 0
    lengths = torch.tensor([S, S - short]) if ragged else None
    logits = q @ k.repeat_interleave(H // n_kv, dim=1).transpose(-1, -2) / math.sqrt(d)  # (B, H, T, S)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    seen = torch.ones(T, S, dtype=torch.bool).tril(offset)
    if window is not None:
        seen &= ~torch.ones(T, S, dtype=torch.bool).tril(offset - window)
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
    if ragged:
        real = (torch.arange(offset, S) < lengths[:, None]).float()  # (B, T): padding queries give nothing
        probs = probs * real[:, None, :, None]
    expected = probs.sum(2).view(B, n_kv, H // n_kv, S).mean(2)
    got = H2ODecode.prefill_received(q, k, chunk=128, cap=cap, lengths=lengths, window=window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_teacher_forcing_handles_ragged_targets():
    model = tiny_model(2)
    runner = evals_runner.Runner(model)
    (dense,) = configs_for(model, [budget("dense", Fraction(1), 30)])
    prompts = torch.randint(0, 97, (2, 30)).tolist()
    targets = [[5, 6, 7, 8, 9], [11, 12]]
    runner.prefill(prompts, [dense], 6)
    lp, _, _ = runner.teacher_force(dense, targets)
    assert [len(x) for x in lp] == [5, 2]
    runner.prefill(prompts[1:], [dense], 6)
    alone, _, _ = runner.teacher_force(dense, [targets[1]])
    torch.testing.assert_close(torch.tensor(lp[1]), torch.tensor(alone[0]), atol=1e-5, rtol=1e-5)


def test_results_rows_tables_and_plot(tmp_path):
    results = evals_runner.Results()
    dense = evals_runner.Config(budget("dense", Fraction(1), 2048), [])
    sparq = evals_runner.Config(budget("sparq", Fraction(1, 8), 2048, r=8, k=128, achieved=0.126), [])
    local = evals_runner.Config(budget("local", Fraction(1, 8), 2048, k=255, achieved=0.125), [])
    bpc, needle = evals_runner.Cell("bpc", 2048), evals_runner.Cell("needle", 2048)
    results.add(bpc, dense, "bpc", [0.9, 1.3, 1.1])
    results.add(bpc, sparq, "bpc", [0.91, 1.31, 1.12])
    results.add(bpc, local, "bpc", [1.0, 1.4, 1.2])
    results.add(needle, dense, "exact_match", [1.0, 1.0, 0.0, 1.0])
    results.add(needle, local, "exact_match", [0.0, 1.0, 0.0, 0.0])
    results.achieved[(bpc, "sparq", Fraction(1, 8))] += [0.126]
    results.achieved[(bpc, "local", Fraction(1, 8))] += [0.125]
    topk = evals_runner.Config(budget("topk", Fraction(1, 8), 2048, k=1, achieved=0.501), [])  # cannot go below 1/2
    results.add(bpc, topk, "bpc", [0.5, 0.6, 0.7])  # "better" than sparq, at four times its transfers
    results.achieved[(bpc, "topk", Fraction(1, 8))] += [0.501]
    rows = {(r["task"], r["attention"]): r for r in results.rows()}
    assert rows[("bpc", "sparq")]["score"] == pytest.approx(1.113333, abs=1e-5)
    assert rows[("bpc", "sparq")]["delta_vs_dense"] == pytest.approx(0.013333, abs=1e-5)
    assert rows[("bpc", "sparq")]["delta_stderr"] < rows[("bpc", "sparq")]["stderr"] / 10  # pairing helps
    assert rows[("bpc", "local")]["delta_vs_dense"] == pytest.approx(0.1)
    assert rows[("bpc", "sparq")]["achieved_compression"] == 0.126
    assert rows[("needle", "dense")]["higher_is_better"] and not rows[("bpc", "dense")]["higher_is_better"]
    assert "delta_vs_dense" not in rows[("needle", "dense")]
    all_rows = results.rows()
    text = evals_report.table(all_rows, ["dense", "sparq", "local", "topk"], [Fraction(1), Fraction(1, 8)])
    assert "bpc↓ 1/8" in text and "exact_match %↑ 1" in text
    sparq_line = next(line for line in text.splitlines() if line.startswith("sparq") and "1.113" in line)
    assert "1.100±" in sparq_line and "1.113±" in sparq_line and "*" in sparq_line  # dense column, best marked
    topk_line = next(line for line in text.splitlines() if line.startswith("topk"))
    assert "0.600±0.058†" in topk_line and "*" not in topk_line and "† = compression achieved" in text
    assert "‡" not in text  # no budgets given: nothing marked
    budgets = {("bpc", c.method, c.budget.target, 2048): c.budget for c in (dense, sparq, local, topk)}
    assert evals_report.no_selection(evals_report.budget_records(budgets)) == {("bpc", 2048, "topk", "1/8")}
    marked = evals_report.table(all_rows, ["dense", "sparq", "local", "topk"], [Fraction(1), Fraction(1, 8)],
                      evals_report.no_selection(evals_report.budget_records(budgets)))
    assert "0.600±0.058†‡" in marked and marked.count("‡") == 2  # the cell and the bpc block's legend
    assert evals_report.NO_SELECTION in marked.split("needle")[0] and evals_report.NO_SELECTION not in marked.split("needle")[1]
    assert "75.0±25.0" in text  # needle dense, in percent
    deltas = evals_report.delta_table(all_rows, ["sparq", "local"], [Fraction(1), Fraction(1, 8)])
    assert "+0.100±0.000" in deltas and "-50.0±28.9" in deltas  # needle diffs -1, 0, 0, -1
    evals_report.plot(all_rows, tmp_path / "p.png", ["dense", "sparq", "local"])
    assert (tmp_path / "p.png").stat().st_size > 5000
    assert not evals_report.sweeps(all_rows) and "against" not in evals_report.sweep_table(all_rows, ["sparq"], [Fraction(1, 8)])


def test_a_length_sweep_keeps_each_size_apart(tmp_path):
    """SQuAD at 7 and 15 contexts: one cell per size (never pooled), a sweep table of score against size
    with the mean prompt tokens, and a plot of score against prompt tokens."""
    results = evals_runner.Results()
    short, long = evals_runner.Cell("squad", 7), evals_runner.Cell("squad", 15)
    for cell, tokens, dense_em, sparq_em in ((short, [1500, 1700], [1.0, 1.0], [1.0, 0.0]),
                                              (long, [3100, 3300], [1.0, 0.0], [0.0, 0.0])):
        results.prompt_tokens[cell] += tokens
        results.add(cell, evals_runner.Config(budget("dense", Fraction(1), 1600), []), "exact_match", dense_em)
        results.add(cell, evals_runner.Config(budget("sparq-fixed-r", Fraction(1, 4), 1600, r=16, k=100), []), "exact_match",
                    sparq_em)
        results.achieved[(cell, "sparq-fixed-r", Fraction(1, 4))] += [0.25]
    rows = results.rows()
    by = {(r["size"], r["attention"]): r for r in rows}
    assert by[(7, "dense")]["score"] == 1.0 and by[(15, "dense")]["score"] == 0.5  # not pooled (would be 0.75)
    assert by[(7, "sparq-fixed-r")]["delta_vs_dense"] == -0.5 and by[(15, "sparq-fixed-r")]["prompt_tokens"] == 3200
    assert evals_report.sweeps(rows) == {"squad": [short, long]}
    sweep = evals_report.sweep_table(rows, ["dense", "sparq-fixed-r"], [Fraction(1), Fraction(1, 4)])
    assert "7 contexts (1600 tok)" in sweep and "15 contexts (3200 tok)" in sweep
    line = next(x for x in sweep.splitlines() if "sparq-fixed-r" in x)
    assert line.split()[0] == "1/4" and "50.0±50.0" in line and line.rstrip().endswith("0.0±0.0")
    assert "‡" not in sweep
    starved = {("squad", 15, "sparq-fixed-r", "1/4")}  # k = 1 at 15 contexts only
    line = next(x for x in evals_report.sweep_table(rows, ["dense", "sparq-fixed-r"], [Fraction(1), Fraction(1, 4)],
                                          starved).splitlines() if "sparq-fixed-r" in x)
    assert line.split()[2:] == ["50.0±50.0", "0.0±0.0‡"]
    text = evals_report.table(rows, ["dense", "sparq-fixed-r"], [Fraction(1), Fraction(1, 4)])
    assert "squad 7 contexts, 1600 prompt tokens on average" in text and "squad 15 contexts" in text
    assert "squad 15 contexts/exact_match" in evals_report.delta_table(rows, ["sparq-fixed-r"], [Fraction(1), Fraction(1, 4)])
    evals_report.plot(rows, tmp_path / "sweep.png", ["dense", "sparq-fixed-r"])
    assert (tmp_path / "sweep.png").stat().st_size > 5000


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--task", "bogus"], "unknown --task"),
    (["--attention", "sparq,nope"], "unknown --attention"),
    (["--compression", "1/0"], "--compression"),
    (["--compression", "abc"], "--compression"),
    (["--lengths", "two"], "--lengths"),
    (["--task", "needle", "--lengths", "8k"], "use at most 7892"),  # SmolLM2's 8192 less room for the answer
    (["--checkpoint", "/nonexistent/model.pth"], "checkpoint not found"),
    (["--task", "needle", "--depths", "101"], "--depths 101 is outside 0..100"),
    (["--task", "needle", "--depths", "0,-10"], "--depths -10 is outside 0..100"),
    (["--task", "needle", "--depths", "0,half"], "bad --depths value 'half'"),
    (["--task", "needle", "--depths", ","], "--depths is empty"),
    (["--task", "bpc,retrieval", "--depths", "50"], "--depths is for the needle task"),
])
def test_bad_input_is_one_line_error(argv, message, capsys):
    status = evals_cli.main(argv + ["--quiet"])
    assert_one_line_error((status, capsys.readouterr().err), message)


def test_bad_flag_is_one_line_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "evals", "--examples", "x"], cwd=REPO, capture_output=True, text=True)
    assert_one_line_error(proc, "--examples")


# ---------------------------------------------------------------------------------------------
# Smoke run on the embedded model
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_smoke_every_task_on_the_embedded_model(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    # a float K^T: SparQ reaches 1/2 at 512 tokens with r = 32 of 64 (an int4 K^T, --kt-dtype auto, makes step 1
    # so cheap that r = 64 leaves it at 0.32: a target that high is the float cache's)
    common = ["--attention", "dense,sparq,h2o,local", "--batch-size", "2", "--kernel", "torch", "--json", str(out),
              "--quiet", "--kt-dtype", "same"]
    rows = []
    for argv in (["--task", "needle,retrieval", "--lengths", "1024", "--examples", "2", "--compression", "1/8",
                  "--plot", str(png)],
                 ["--task", "bpc,diagnostics", "--lengths", "512", "--examples", "2", "--compression", "1/2",
                  "--bpc-tokens", "24", "--plot", str(tmp_path / "diagnostics.png")],  # with per-layer panels
                 # repetition needs >= 6000 characters of context: 2048 tokens of Shakespeare
                 ["--task", "repetition", "--lengths", "2048", "--examples", "1", "--compression", "1/8",
                  "--repetition-chars", "96"]):
        assert evals_cli.main(argv + common) == 0
        rows += read_json(out)["results"]
    got = {(r["task"], r["metric"], r["attention"]): r for r in rows}
    for r in rows:
        assert set(r) >= {"task", "metric", "higher_is_better", "attention", "compression", "score", "stderr", "n"}
    assert got[("needle", "exact_match", "dense")]["score"] >= 0.5
    assert got[("needle", "answer_nll", "dense")]["score"] < 1.0
    assert got[("retrieval", "answer_nll", "dense")]["score"] < 1.5
    assert got[("bpc", "bpc", "dense")]["score"] < 1.5
    assert 0 < got[("bpc", "answer_nll", "dense")]["score"] < 5  # nats per token
    assert got[("repetition", "chars", "dense")]["score"] > 10
    assert got[("diagnostics", "top1_agreement", "dense")]["score"] == 1.0
    assert got[("diagnostics", "attn_rel_l2", "dense")]["score"] == pytest.approx(0, abs=1e-6)
    assert 0.5 < got[("diagnostics", "topk_agreement", "sparq")]["score"] <= 1.0  # r = 32 of 64
    per_layer = got[("diagnostics", "topk_agreement", "sparq")]["per_layer"]
    assert len(per_layer) == 30 and sum(per_layer) / 30 == pytest.approx(got[("diagnostics", "topk_agreement", "sparq")]["score"])
    assert (tmp_path / "diagnostics.png").stat().st_size > 5000
    assert got[("diagnostics", "attn_rel_l2", "sparq")]["score"] < 0.5
    for method in ("sparq", "h2o", "local"):
        # Budgets are solved at the prompt length (512); 24 teacher-forced tokens later the live length
        # is 536, so a fixed budget's ratio drifts down by up to ~24/512 of itself (0.5 -> ~0.488).
        assert got[("bpc", "bpc", method)]["achieved_compression"] == pytest.approx(0.5, abs=0.03)
        assert got[("needle", "exact_match", method)]["achieved_compression"] == pytest.approx(0.125, abs=0.012)
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "needle" in printed and "exact_match" in printed


def fake_squad(root: Path) -> None:
    """A SQuAD-format file with 5 articles of 3 paragraphs, 2 questions each, where squad.py reads it."""
    articles = []
    for a in range(5):
        paragraphs = []
        for p in range(3):
            context = f"Article {a} paragraph {p}: the river town of Place{a}{p} was founded in {1700 + 10 * a + p}."
            qas = [{"id": f"{a}-{p}-{q}", "question": q_text, "answers": [{"text": answer, "answer_start": 0}]}
                   for q, (q_text, answer) in enumerate([(f"When was Place{a}{p} founded?", str(1700 + 10 * a + p)),
                                                         (f"What kind of town is Place{a}{p}?", "river town")])]
            paragraphs.append({"context": context, "qas": qas})
        articles.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    (root / "squad").mkdir(parents=True)
    (root / "squad" / "squaddev_v1.1.json").write_text(json.dumps({"data": articles, "version": "1.1"}))


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_squad_tasks_run_ragged_batches_through_every_method(tmp_path, monkeypatch, capsys):
    """SQuAD prompts differ in length: the batch is ragged; every method runs, with the fixed-r SparQ
    variant budgeted by k, and EM/F1 come out in [0, 1] with the achieved compression recorded."""
    fake_squad(tmp_path / "cache")
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "squad.json"
    argv = ["--task", "squad,squad-diagnostics", "--squad-contexts", "3", "--examples", "3", "--batch-size", "3",
            "--attention", "dense,sparq,sparq-fixed-r,h2o,local,topk,oracle", "--compression", "1/2",
            "--sparq-k", "16", "--sparq-r", "16", "--json", str(out), "--quiet"]
    assert evals_cli.main(argv) == 0
    rows = read_json(out)["results"]
    squad_rows = [r for r in rows if r["task"] == "squad"]
    assert {r["attention"] for r in squad_rows} == {"dense", "sparq", "sparq-fixed-r", "h2o", "local", "topk", "oracle"}
    assert all(0 <= r["score"] <= 1 and r["n"] == 3 for r in squad_rows)
    fixed = [b for b in read_json(out)["meta"]["budgets"] if b["attention"] == "sparq-fixed-r"]
    assert fixed and all(b["r"] == 16 and b["k"] > 16 for b in fixed)  # r fixed, k solved for 1/2
    assert "squad-diagnostics" in {r["task"] for r in rows}
    assert "f1 %" in capsys.readouterr().out


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_configs_with_equal_settings_decode_once(tmp_path, monkeypatch):
    """Top-k at 1/2 and 1/4 is k = 1 both times (reading K is 1/2 already): the batch decodes it once,
    and both cells equal a run of top-k at 1/4 alone."""
    fake_squad(tmp_path / "cache")
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path / "cache"))
    argv = ["--task", "squad", "--squad-contexts", "3", "--examples", "3", "--batch-size", "3", "--kernel", "torch",
            "--sparq-k", "16", "--quiet"]
    decoded = []
    decode = evals_runner.decode_and_score
    monkeypatch.setattr(evals_runner, "decode_and_score", lambda task, runner, tok, batch, config:
                        decoded.append(config.budget.target) or decode(task, runner, tok, batch, config))
    both, alone = tmp_path / "both.json", tmp_path / "alone.json"
    assert evals_cli.main(argv + ["--attention", "dense,topk", "--compression", "1/2,1/4", "--json", str(both)]) == 0
    assert decoded == [Fraction(1), Fraction(1, 2)]  # dense, then top-k once
    budgets = read_json(both)["meta"]["budgets"]
    assert [b["k"] for b in budgets if b["attention"] == "topk"] == [1, 1]
    assert evals_cli.main(argv + ["--attention", "dense,topk", "--compression", "1/4", "--json", str(alone)]) == 0
    topk = lambda path, t: {r["metric"]: (r["score"], r["achieved_compression"])
                            for r in read_json(path)["results"]
                            if r["attention"] == "topk" and r["compression_label"] == t}
    assert topk(both, "1/2") == topk(both, "1/4") == topk(alone, "1/4") and topk(alone, "1/4")


def small_squad_run(tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A two-batch SQuAD run on the embedded model over a hand-made SQuAD (seconds): its --json and argv."""
    fake_squad(tmp_path / "cache")
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "squad.json"
    argv = ["--task", "squad", "--squad-contexts", "3", "--examples", "4", "--batch-size", "2",
            "--attention", "dense,sparq,h2o", "--compression", "1/2", "--sparq-k", "16", "--sparq-r", "16",
            "--kernel", "torch", "--json", str(out), "--quiet"]
    return out, argv


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_resume_replays_the_journal_and_runs_only_the_rest(tmp_path, monkeypatch, capsys):
    """A run stopped mid-way (its journal holds batch 1 and a line cut by the kill) and resumed runs
    batch 2 alone and reports exactly what the uninterrupted run reported; a journal of another run,
    or none, is a one-line error, and so is a rerun that would start this run's journal over."""
    out, argv = small_squad_run(tmp_path, monkeypatch)
    assert evals_cli.main(argv) == 0
    whole = read_json(out)
    journal = evals_journal.journal_path(out)
    header, first, second = journal.read_text().splitlines()
    assert strict_json(first)["batch"] == 1 and strict_json(second)["batch"] == 2

    journal.write_text(f"{header}\n{first}\n{second[:len(second) // 2]}")  # killed while writing batch 2
    out.unlink()
    ran = []
    evaluate = evals_runner.evaluate_batch
    monkeypatch.setattr(evals_cli, "evaluate_batch", lambda cell, runner, tok, batch, *a: ran.append(batch) or
                        evaluate(cell, runner, tok, batch, *a))
    assert evals_cli.main(argv + ["--resume"]) == 0
    assert len(ran) == 1  # batch 2 only
    resumed = read_json(out)
    assert resumed["results"] == whole["results"] and resumed["meta"]["batches_from_journal"] == 1
    assert [strict_json(line)["batch"] for line in journal.read_text().splitlines()[1:]] == [1, 2]
    capsys.readouterr()
    assert evals_cli.main(["--report", str(out)]) == 0  # its time is the resumed process's alone, and says so
    assert "min for the batches after the 1 its journal held" in capsys.readouterr().out.splitlines()[0]
    out.unlink()  # a resume with nothing left to run still writes the results
    assert evals_cli.main(argv + ["--resume"]) == 0 and len(ran) == 1
    assert read_json(out)["results"] == whole["results"]

    capsys.readouterr()
    for extra, message in ((["--seed", "1", "--resume"], "seed differ"),
                           (["--resume", "--json", str(tmp_path / "other.json")], "no journal at"),
                           ([], "add --resume to continue it")):  # never overwritten by a rerun without --resume
        assert_one_line_error((evals_cli.main(argv + extra), capsys.readouterr().err), message)
    no_json = [a for a in argv if a not in ("--json", str(out))]
    assert_one_line_error((evals_cli.main(no_json + ["--resume"]), capsys.readouterr().err), "--resume")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_progress_counts_prefill_tokens_and_starts_a_resume_at_the_journal(tmp_path, monkeypatch):
    """The bar's total is every batch's padded prompt tokens (from the journal's records); a run adds
    them all, and a resumed run starts at the batches its journal holds and adds only the rest."""
    import tqdm

    out, argv = small_squad_run(tmp_path, monkeypatch)
    bars = []

    class Recording(tqdm.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.added, self.start_at, self.of = 0, kw.get("initial"), kw.get("total")  # (tqdm keeps none when disabled)
            if self.start_at is not None:  # eval's bar (not prefill's)
                bars.append(self)

        def update(self, n=1):
            self.added += n
            return super().update(n)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    assert evals_cli.main(argv) == 0
    header, *lines = evals_journal.journal_path(out).read_text().splitlines()
    padded = [len(lengths) * max(lengths) for line in lines for _, _, lengths in strict_json(line)["record"]["prompt_tokens"]]
    assert len(padded) == 2 and bars[0].of == sum(padded)
    assert bars[0].start_at == 0 and bars[0].added == pytest.approx(sum(padded))

    evals_journal.journal_path(out).write_text(f"{header}\n{lines[0]}\n")
    assert evals_cli.main(argv + ["--resume"]) == 0
    assert bars[1].of == sum(padded) and bars[1].start_at == padded[0]
    assert bars[1].added == pytest.approx(padded[1])


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_report_prints_the_tables_of_a_finished_or_running_run(tmp_path, monkeypatch, capsys):
    """--report on a run's --json prints the tables the run printed at its end (no model is loaded);
    on the file as it stood after the first batch, that batch's tables, marked as in progress."""
    out, argv = small_squad_run(tmp_path, monkeypatch)
    snapshots = []
    write = evals_report.write_json
    monkeypatch.setattr(evals_cli, "write_json", lambda path, rows, meta, *a: write(path, rows, meta, *a) or
                        snapshots.append(path.read_text()))
    capsys.readouterr()
    assert evals_cli.main(argv) == 0
    printed = capsys.readouterr().out
    tables = printed[printed.index("\nsquad 3 contexts"):]  # after the model line and the budgets
    assert len(snapshots) == 2

    monkeypatch.setattr(evals_cli, "load_checkpoint", None)  # --report must not load a model
    plot = tmp_path / "report.png"
    assert evals_cli.main(["--report", str(out), "--plot", str(plot)]) == 0
    reported = capsys.readouterr().out
    assert "; complete;" in reported.splitlines()[0] and reported.endswith(tables) and plot.stat().st_size > 0

    first = tmp_path / "first.json"
    first.write_text(snapshots[0])
    assert evals_cli.main(["--report", str(first)]) == 0
    reported = capsys.readouterr().out
    assert "in progress: 1 of 2 batches" in reported and "(n = 2 per cell" in reported and "(n = 4" not in reported

    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": [], "meta": json.loads(snapshots[0])["meta"]}))
    partial = tmp_path / "partial.json"  # a results file without the run's description
    partial.write_text(json.dumps({"results": json.loads(snapshots[0])["results"],
                                   "meta": {"attention": ["dense"], "compression": ["1"]}}))
    for path, message in ((tmp_path / "missing.json", "no such file"),
                          (evals_journal.journal_path(out), "not a python -m evals --json results file"),
                          (partial, "not a python -m evals --json results file"),
                          (empty, "no results yet")):
        assert_one_line_error((evals_cli.main(["--report", str(path)]), capsys.readouterr().err), message)


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_needle_map_run_resumes_and_reports_the_same_map(tmp_path, monkeypatch, capsys):
    """--task needle --depths on the embedded model (one batch: a decode step is most of the time): the
    JSON's needle_map has a row per (length, depth, method, target) with n = --examples, pooling to the
    usual rows; the text map and the heatmap come out; --resume, replaying the journal, and --report of
    the JSON give the same map; other depths are another run, and a run without --depths keeps the
    identity it had."""
    out, plot = tmp_path / "map.json", tmp_path / "map.png"
    argv = ["--task", "needle", "--lengths", "192", "--depths", "0,100", "--examples", "2", "--batch-size", "4",
            "--attention", "dense,sparq", "--compression", "1/4", "--sparq-k", "16", "--kernel", "torch",
            "--json", str(out), "--quiet"]
    assert evals_cli.main(argv + ["--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    whole = read_json(out)
    needle_map = whole["needle_map"]
    keys = [(r["length"], r["depth"], r["attention"], r["compression_label"]) for r in needle_map]
    assert sorted(keys) == sorted((192, d, m, c) for d in (0, 100) for m, c in (("dense", "1"), ("sparq", "1/4")))
    assert {r["n"] for r in needle_map} == {2} and whole["meta"]["depths"] == [0, 100]
    for pooled in whole["results"]:  # the usual rows: every depth of a length, pooled
        if pooled["metric"] == "exact_match":
            mine = [r["exact_match"] for r in needle_map if (r["attention"], r["compression_label"])
                    == (pooled["attention"], pooled["compression_label"])]
            assert pooled["n"] == 4 and pooled["score"] == pytest.approx(sum(mine) / 2)
    assert "needle map (rows = needle depth, columns = prompt tokens; n = 2 per cell)" in printed
    assert re.search(r"depth\s+192\s+depth\s+192", printed) and "cells where dense finds the needle" in printed
    assert plot.stat().st_size > 5000 and evals_report.scores_plot_path(plot).stat().st_size > 5000
    map_text = printed[printed.index("\nneedle map"):printed.index("\nplots:")]

    header, first = evals_journal.journal_path(out).read_text().splitlines()
    assert strict_json(header)["run"]["depths"] == [0, 100]
    assert strict_json(first)["record"]["depths"] == [["needle", 192, [0, 0, 100, 100]]]
    out.unlink()
    monkeypatch.setattr(evals_cli, "evaluate_batch", None)  # everything from the journal
    assert evals_cli.main(argv + ["--resume"]) == 0
    resumed = read_json(out)
    assert resumed["needle_map"] == needle_map and resumed["results"] == whole["results"]
    assert resumed["meta"]["batches_from_journal"] == 1 and map_text in capsys.readouterr().out

    monkeypatch.setattr(evals_cli, "load_checkpoint", None)  # --report loads no model
    again = tmp_path / "again.png"
    assert evals_cli.main(["--report", str(out), "--plot", str(again)]) == 0
    assert map_text in capsys.readouterr().out and again.stat().st_size > 5000
    other = [x if x != "0,100" else "0,50,100" for x in argv]
    assert_one_line_error((evals_cli.main(other + ["--resume"]), capsys.readouterr().err), "depths differ")
    plain = evals_cli.build_parser().parse_args(argv[:argv.index("--depths")] + argv[argv.index("--examples"):])
    assert "depths" not in evals_cli.run_identity(plain, ["needle"], ["dense", "sparq"], [Fraction(1), Fraction(1, 4)],
                                                  {"needle": [192]}, evals_cli.cache_format(plain, "cpu", ["sparq"]))


def test_report_of_several_files_is_one_run_across_their_lengths(tmp_path, capsys):
    """--report a.json b.json (one run per length): one sweep table and plot over both lengths; a cell
    both files hold (dense, run again beside a new policy) must score alike; files of two models refuse."""
    def results(path, size, methods, score, checkpoint="checkpoints/M"):
        rows = [{"task": "ruler-mk", "size": size, "size_unit": "tokens", "prompt_tokens": float(size),
                 "metric": "exact_match", "higher_is_better": True, "attention": m, "compression": c,
                 "compression_label": label, "achieved_compression": c, "score": score[m], "stderr": 0.1, "n": 8}
                for m in methods for c, label in ((1.0, "1"), (0.125, "1/8")) if (m == "dense") == (c == 1.0)]
        meta = {"checkpoint": checkpoint, "dtype": "bfloat16", "kernels": "cpu", "examples": 8, "elapsed_s": 60,
                "attention": methods, "compression": ["1", "1/8"], "budgets": []}
        path.write_text(json.dumps({"results": rows, "meta": meta}))
        return path

    short = results(tmp_path / "4k.json", 4096, ["dense", "sparq"], {"dense": 1.0, "sparq": 0.875})
    long = results(tmp_path / "8k.json", 8192, ["dense", "sparq"], {"dense": 0.75, "sparq": 0.5})
    beside = results(tmp_path / "4k_quest.json", 4096, ["dense", "quest"], {"dense": 1.0, "quest": 0.25})
    plot = tmp_path / "sweep.png"
    assert evals_cli.main(["--report", str(short), str(beside), str(long), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "ruler-mk 4096 tokens" in out and "ruler-mk 8192 tokens" in out and "exact_match (%) against tokens" in out
    assert re.search(r"quest\s+100\.0±10\.0\s+25\.0", out) and plot.stat().st_size > 0
    other = results(tmp_path / "again.json", 4096, ["dense"], {"dense": 0.5})
    assert_one_line_error((evals_cli.main(["--report", str(short), str(other)]), capsys.readouterr().err),
                          "scores 0.5 (n = 8) here and 1 (n = 8) in an earlier file")
    model = results(tmp_path / "model.json", 8192, ["dense"], {"dense": 0.75}, checkpoint="checkpoints/N")
    assert_one_line_error((evals_cli.main(["--report", str(short), str(model)]), capsys.readouterr().err),
                          "different runs' models or dtypes")


def test_report_versus_pairs_each_policy_with_another_from_the_journal(tmp_path, capsys):
    """--report FILE --versus quest: each policy's paired difference from Quest at the same compression,
    from the per-example values of the journal beside FILE (two batches and a line cut by a kill): the
    mean and standard error of the example-by-example differences. A file without its journal, a policy
    the run did not run, and --versus without --report are one-line errors."""
    import statistics

    scores = {"dense": [1, 1, 1, 1, 1, 1, 0, 1], "sparq-adaptive": [1, 1, 1, 1, 0, 0, 0, 0],
              "quest": [1, 1, 1, 0, 0, 0, 0, 0]}  # paired, one example apart: far tighter than unpaired
    label = {"dense": "1", "sparq-adaptive": "1/8", "quest": "1/8"}
    rows = [{"task": "ruler-mk", "size": 4096, "size_unit": "tokens", "prompt_tokens": 4096.0, "metric": "exact_match",
             "higher_is_better": True, "attention": m, "compression": float(Fraction(label[m])),
             "compression_label": label[m], "achieved_compression": float(Fraction(label[m])),
             "score": sum(v) / 8, "stderr": 0.1, "n": 8} for m, v in scores.items()]
    meta = {"checkpoint": "checkpoints/M", "dtype": "bfloat16", "kernels": "cpu", "examples": 8, "elapsed_s": 60,
            "attention": list(scores), "compression": ["1", "1/8"], "budgets": []}
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"results": rows, "meta": meta}))
    batches = [json.dumps({"batch": b + 1, "task": "ruler-mk", "size": 4096, "examples": 4, "record": {
        "values": [["ruler-mk", 4096, "exact_match", m, label[m], v[4 * b:4 * b + 4]] for m, v in scores.items()],
        "achieved": [], "per_layer": [], "prompt_tokens": []}}) for b in range(2)]
    journal = evals_journal.journal_path(out)
    journal.write_text("\n".join([json.dumps({"run": {}}), *batches, batches[0][:20]]))

    assert evals_cli.main(["--report", str(out), "--versus", "quest"]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("paired difference from quest"):]
    diffs = [a - q for a, q in zip(scores["sparq-adaptive"], scores["quest"])]
    expected = f"{100 * statistics.mean(diffs):+.1f}±{100 * statistics.stdev(diffs) / math.sqrt(8):.1f}"
    assert re.search(rf"sparq-adaptive\s+{re.escape(expected)}", table) and expected == "+12.5±12.5"
    assert "dense " not in table.split("\n", 2)[2]  # dense has no 1/8 to pair

    journal.unlink()
    for argv, message in ((["--report", str(out), "--versus", "quest"], "journal"),
                          (["--report", str(out), "--versus", "h2o"], "ran no h2o"),
                          (["--versus", "quest"], "--versus goes with --report")):
        assert_one_line_error((evals_cli.main(argv), capsys.readouterr().err), message)


def test_report_shows_recall_in_percent_and_its_differences_in_points(tmp_path, capsys):
    """RULER's recall is a fraction in the rows; the report shows it as RULER does, in percent, and its
    paired differences in points, the unit the accuracy goals are set in."""
    import statistics

    scores = {"dense": [1.0, 0.75, 0.5, 1.0], "sparq-adaptive": [1.0, 0.5, 0.5, 0.75]}
    label = {"dense": "1", "sparq-adaptive": "1/8"}
    rows = [{"task": "ruler-mv", "size": 4096, "size_unit": "tokens", "prompt_tokens": 4096.0, "metric": "recall",
             "higher_is_better": True, "attention": m, "compression": float(Fraction(label[m])),
             "compression_label": label[m], "achieved_compression": float(Fraction(label[m])),
             "score": statistics.mean(v), "stderr": statistics.stdev(v) / 2, "n": 4} for m, v in scores.items()]
    meta = {"checkpoint": "checkpoints/M", "dtype": "bfloat16", "kernels": "cpu", "examples": 4, "elapsed_s": 60,
            "attention": list(scores), "compression": ["1", "1/8"], "budgets": []}
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"results": rows, "meta": meta}))
    evals_journal.journal_path(out).write_text("\n".join([json.dumps({"run": {}}), json.dumps(
        {"batch": 1, "task": "ruler-mv", "size": 4096, "examples": 4, "record": {
            "values": [["ruler-mv", 4096, "recall", m, label[m], v] for m, v in scores.items()],
            "achieved": [], "per_layer": [], "prompt_tokens": []}})]))

    assert evals_cli.main(["--report", str(out), "--versus", "dense"]) == 0
    printed = capsys.readouterr().out
    assert "recall %↑ 1/8" in printed and re.search(r"sparq-adaptive\s+81\.2±12\.0\s+68\.8±12\.0", printed)
    diffs = [a - b for a, b in zip(scores["sparq-adaptive"], scores["dense"])]
    expected = f"{100 * statistics.mean(diffs):+.1f}±{100 * statistics.stdev(diffs) / 2:.1f}"
    table = printed[printed.index("paired difference from dense"):]
    assert "recall in points" in table and re.search(rf"sparq-adaptive\s+{re.escape(expected)}", table)
    assert expected == "-12.5±7.2"


def test_report_against_pairs_each_policy_with_itself_in_another_run(tmp_path, capsys):
    """--report A --against B: each policy of A paired with itself in run B on the same examples (a cache
    format is a run of its own), from both journals; runs whose dense values differ cannot pair (one
    line), a metric whose dense values differ is named and not paired, nor does --against go without --report."""
    import statistics

    def write_run(name: str, scores: dict[str, list[float]], losses: dict[str, list[float]] | None = None) -> Path:
        label = {"dense": "1", "sparq-adaptive": "1/16"}
        metrics = [("recall", scores)] + ([("answer_nll", losses)] if losses else [])
        rows = [{"task": "ruler-cwe", "size": 4096, "size_unit": "tokens", "prompt_tokens": 4096.0,
                 "metric": metric, "higher_is_better": metric == "recall", "attention": m,
                 "compression": float(Fraction(label[m])), "compression_label": label[m],
                 "achieved_compression": float(Fraction(label[m])), "score": statistics.mean(v),
                 "stderr": statistics.stdev(v) / 2, "n": 4} for metric, values in metrics for m, v in values.items()]
        meta = {"checkpoint": "checkpoints/M", "dtype": "bfloat16", "kernels": "cpu", "examples": 4, "elapsed_s": 60,
                "attention": list(scores), "compression": ["1", "1/16"], "budgets": []}
        out = tmp_path / f"{name}.json"
        out.write_text(json.dumps({"results": rows, "meta": meta}))
        evals_journal.journal_path(out).write_text("\n".join([json.dumps({"run": {}}), json.dumps(
            {"batch": 1, "task": "ruler-cwe", "size": 4096, "examples": 4, "record": {
                "values": [["ruler-cwe", 4096, metric, m, label[m], v] for metric, values in metrics
                           for m, v in values.items()],
                "achieved": [], "per_layer": [], "prompt_tokens": []}})]))
        return out

    dense = [0.5, 0.6, 0.4, 0.5]
    bf16 = write_run("bf16", {"dense": dense, "sparq-adaptive": [0.4, 0.5, 0.4, 0.3]})
    fp32 = write_run("fp32", {"dense": dense, "sparq-adaptive": [0.3, 0.5, 0.2, 0.3]})
    assert evals_cli.main(["--report", str(bf16), "--against", str(fp32)]) == 0
    table = capsys.readouterr().out.split("paired difference from " + str(fp32))[1]
    expected = "+7.5±4.8"  # differences 0.1, 0, 0.2, 0 (in points: 10, 0, 20, 0): their mean and standard error
    diffs = [0.1, 0.0, 0.2, 0.0]
    assert expected == f"{100 * statistics.mean(diffs):+.1f}±{100 * statistics.stdev(diffs) / 2:.1f}"
    assert re.search(rf"sparq-adaptive\s+1/16\s+40\.0\s+32\.5\s+{re.escape(expected)}", table)
    assert "dense " not in table

    # another machine's rounding: dense's losses differ, its recall does not; the recall pairs, the loss is named
    rounded = write_run("rounded", {"dense": dense, "sparq-adaptive": [0.3, 0.5, 0.2, 0.3]},
                        {"dense": [0.11, 0.2, 0.3, 0.4], "sparq-adaptive": [0.1, 0.2, 0.3, 0.4]})
    lossy = write_run("lossy", {"dense": dense, "sparq-adaptive": [0.4, 0.5, 0.4, 0.3]},
                      {"dense": [0.1, 0.2, 0.3, 0.4], "sparq-adaptive": [0.1, 0.2, 0.3, 0.5]})
    assert evals_cli.main(["--report", str(lossy), "--against", str(rounded)]) == 0
    table = capsys.readouterr().out.split("paired difference from " + str(rounded))[1]
    assert re.search(rf"recall\s+sparq-adaptive\s+1/16\s+40\.0\s+32\.5\s+{re.escape(expected)}", table)
    assert "answer_nll  " not in table
    assert table.rstrip().endswith("not paired, dense's values differ between the runs: ruler-cwe 4096 tokens answer_nll")

    other = write_run("other", {"dense": [0.5, 0.6, 0.4, 0.6], "sparq-adaptive": [0.3, 0.5, 0.2, 0.3]})
    assert_one_line_error((evals_cli.main(["--report", str(bf16), "--against", str(other)]), capsys.readouterr().err),
                          "dense's ruler-cwe 4096 tokens recall values differ")
    assert_one_line_error((evals_cli.main(["--against", str(fp32)]), capsys.readouterr().err),
                          "--against goes with --report")


def test_length_batches_group_similar_prompts_and_keep_every_example():
    from evals.tasks import Example

    rng = torch.Generator().manual_seed(0)
    examples = [Example(prompt=[0] * int(n)) for n in torch.randint(1, 500, (37,), generator=rng)]
    batches = evals_cli.length_batches(examples, 8, seed=1)
    assert sorted(map(id, (e for b in batches for e in b))) == sorted(map(id, examples))  # each once
    assert [len(b) for b in batches].count(8) == 4
    spans = sorted((min(len(e.prompt) for e in b), max(len(e.prompt) for e in b)) for b in batches)
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:]))  # batches do not overlap in length
    assert evals_cli.length_batches(examples, 8, seed=1) == batches  # seeded
    assert [b[0].prompt for b in batches] != [b[0].prompt for b in sorted(batches, key=lambda b: len(b[0].prompt))]


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason=f"no embedded checkpoint at {CHECKPOINT} (run `make model`)")
def test_ragged_batches_on_a_sliding_window_model_are_refused_up_front(tmp_path, monkeypatch, capsys):
    """SQuAD prompts differ in length and window layers' caches cannot be ragged: a one-line error
    before any work, SQuAD fetched or not (the prompts run one at a time with --batch-size 1)."""
    import shutil

    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path / "cache"))  # empty: no SQuAD

    args = ModelArgs(vocab_size=49152, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=128,
                     max_context=4096, sliding_window=64, layer_types=["window", "global"])
    torch.manual_seed(0)
    torch.save(Transformer(args).state_dict(), tmp_path / "model.pth")
    args.to_json(tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHECKPOINT / name, tmp_path / name)
    argv = ["--checkpoint", str(tmp_path), "--task", "squad", "--attention", "sparq", "--compression", "1/4",
            "--examples", "2", "--json", str(tmp_path / "out.json"), "--quiet"]
    assert_one_line_error((evals_cli.main(argv + ["--batch-size", "2"]), capsys.readouterr().err), "--batch-size 1")
    assert not (tmp_path / "out.json").exists()
    fake_squad(tmp_path / "cache")
    assert evals_cli.main(argv + ["--batch-size", "1"]) == 0
    assert read_json(tmp_path / "out.json")["meta"]["complete"]


@pytest.mark.parametrize("argv, fragment", [
    (["--examples", "0"], "--examples"), (["--threads", "0"], "--threads"), (["--lengths", "0"], "--lengths")])
def test_eval_flags_are_one_line_errors(argv, fragment):
    assert_one_line_error(run_main(evals_cli.main, *argv, "--quiet"), fragment)


def squad_run_identity(argv: list[str]) -> dict:
    """The run identity (what a --resume must match) of a SQuAD eval at 1/4 with these flags, as evals computes it."""
    args = evals_cli.build_parser().parse_args(argv)
    methods = args.attention.split(",")
    return evals_cli.run_identity(args, ["squad"], methods, [Fraction(1, 4)], {"squad": [0]},
                                  evals_cli.cache_format(args, "cpu", methods))


def test_a_run_on_bf16_k_t_scales_is_another_run():
    """--kt-scale-dtype bfloat16 stores step 1's scales otherwise and changes adaptive SparQ's split: a
    resumed run must match it; the default leaves the identity of earlier journals as it was."""
    argv = ["--task", "squad", "--attention", "dense,sparq-adaptive", "--compression", "1/8"]
    default = squad_run_identity(argv)
    assert "kt_scale_dtype" not in default
    assert squad_run_identity(argv + ["--kt-scale-dtype", "bfloat16"]) == {**default, "kt_scale_dtype": "bfloat16"}


def test_a_doublesparse_run_is_identified_by_its_calibration(tmp_path):
    """A resumed DoubleSparse run must use the channels its journal was made with: the run's identity
    holds the calibration file's content hash (a recalibration at the same path is another run), and
    runs without doublesparse keep the identity earlier journals have."""
    channels = tmp_path / "channels.pt"
    argv = ["--task", "squad", "--checkpoint", str(tmp_path), "--attention", "dense,doublesparse",
            "--sparq-r", "4", "--doublesparse-channels", str(channels)]

    torch.save({"ranking": torch.arange(12).view(1, 3, 4)}, channels)
    first = squad_run_identity(argv)
    assert str(channels) in first["doublesparse_channels"] and squad_run_identity(argv) == first
    torch.save({"ranking": torch.arange(12).flip(0).view(1, 3, 4)}, channels)
    assert squad_run_identity(argv)["doublesparse_channels"] != first["doublesparse_channels"]
    assert "doublesparse_channels" not in squad_run_identity(argv[:5] + ["dense,sparq"])


def test_an_adaptive_run_is_identified_by_its_cap_on_k(tmp_path):
    """Adaptive SparQ's k was once capped at --sparq-k: the journals of those runs resume only with
    --adaptive-k-cap equal to it, an uncapped run (the default now) is another run, and runs without
    sparq-adaptive keep the identity they had."""
    base = ["--task", "squad", "--checkpoint", str(tmp_path), "--attention", "dense,sparq-adaptive"]

    earlier = squad_run_identity(base + ["--adaptive-k-cap", "128"])
    assert "adaptive_k_cap" not in earlier  # as the journals made before the flag read back
    assert squad_run_identity(base)["adaptive_k_cap"] is None
    assert squad_run_identity(base + ["--adaptive-k-cap", "256"])["adaptive_k_cap"] == 256
    assert squad_run_identity(base + ["--sparq-k", "64", "--adaptive-k-cap", "64"]) == {**earlier, "sparq_k": 64}
    assert "adaptive_k_cap" not in squad_run_identity(base[:5] + ["dense,sparq"])


def test_an_adaptive_run_is_identified_by_its_heads_selection(tmp_path):
    """Adaptive SparQ's KV heads once pooled their picks: those journals (without the key) resume only with
    --adaptive-heads pooled, a run with each head its own (the default now) is another run, and runs
    without sparq-adaptive keep the identity they had."""
    base = ["--task", "squad", "--checkpoint", str(tmp_path), "--attention", "dense,sparq-adaptive"]

    earlier = squad_run_identity(base + ["--adaptive-heads", "pooled"])
    assert "adaptive_heads" not in earlier  # as the journals made before the flag read back
    assert squad_run_identity(base) == {**earlier, "adaptive_heads": "each"}
    assert "adaptive_heads" not in squad_run_identity(base[:5] + ["dense,sparq"])


def test_budget_lines_give_the_prompt_length_not_the_task_size():
    """A SQuAD cell's size is its context count (7); its budget line gives the tokens the budget was
    solved at, and adaptive SparQ's line its split there."""
    from budgets import solve_budget

    args = ModelArgs.from_shape("smollm2")
    budgets = {("squad", m, Fraction(1, 4), 7): solve_budget(m, Fraction(1, 4), 1442, args)
               for m in ("sparq", "sparq-adaptive")}
    text = evals_report.budget_summary(budgets)
    r, k = budgets[("squad", "sparq-adaptive", Fraction(1, 4), 7)].split
    assert "S=1442 sparq (k=128, local k/4)" in text and f"S=1442 sparq-adaptive: 1/4: r={r}, k={k}" in text
    assert "S=7" not in text


def test_plot_against_compression_shows_every_measured_compression():
    """The x axis reaches the lowest compression a run measured (1/16 here, achieved a hair under it), with a
    tick for each power of 1/2; a run stopping at 1/8 gets ticks down to 1/8 only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def row(method, target, achieved, score):
        return {"attention": method, "compression": target, "achieved_compression": achieved, "score": score,
                "stderr": 0.01}

    for rows, lowest_label in [([row("dense", 1.0, 1.0, 0.7), row("sparq", 0.125, 0.1251, 0.6),
                                  row("sparq", 0.0625, 0.06249, 0.5)], "1/16"),
                                ([row("dense", 1.0, 1.0, 0.7), row("sparq", 0.25, 0.25, 0.6),
                                  row("sparq", 0.125, 0.125, 0.5)], "1/8")]:
        fig, ax = plt.subplots()
        evals_report._plot_against_compression(ax, rows, ["dense", "sparq"])
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels[-1] == lowest_label and labels[0] == "1"
        assert ax.get_xlim()[0] < min(r["achieved_compression"] for r in rows) * 0.9  # the lowest point inside
        plt.close(fig)


def test_long_output_agreement_counts_tokens_before_the_first_difference():
    """scripts/studies/long_output_study.py: tokens equal to the reference's before they differ; a row that stopped
    (a stop token) where its reference did agrees to its end, and a row past its shorter reference agrees with all
    of it. A row stops once it has left every reference, and not before."""
    from scripts.studies.long_output_study import agreement, greedy_until_left
    assert agreement([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert agreement([1, 2], [3, 2]) == 0
    assert agreement([4, 4, 4], [4, 4, 4]) == 3
    assert agreement([4, 4], [4, 4, 4, 4]) == 2 and agreement([4, 4, 4, 4], [4, 4]) == 2

    class Scripted:  # Runner.greedy's contract: finished(row, tokens so far) is asked before each next token
        def greedy(self, config, n, stop_ids, finished):
            script = [[1, 2, 3, 4, 5, 6], [1, 9, 9, 9, 9, 9]]
            rows = [[s[0]] for s in script]
            for b, s in enumerate(script):
                while len(rows[b]) < n and not finished(b, rows[b]):
                    rows[b].append(s[len(rows[b])])
            return rows, n

    first, second = [[1, 2, 7, 7, 7, 7], [1, 9, 9, 7, 7, 7]], [[1, 2, 3, 4, 7, 7], [1, 7, 7, 7, 7, 7]]
    rows = greedy_until_left(Scripted(), None, 6, set(), [first, second])
    assert rows == [[1, 2, 3, 4, 5], [1, 9, 9, 9]]  # each stopped one token past its later divergence
    assert [agreement(r, ref) for r, ref in zip(rows, first)] == [2, 3]
    assert [agreement(r, ref) for r, ref in zip(rows, second)] == [4, 1]


def test_loss_by_position_buckets_by_absolute_position():
    """scripts/studies/loss_by_position.py: each token's NLL (-logprob) goes to the bucket of its absolute
    position, first_position + its index, and each bucket holds the mean of its own tokens only (a bucket the
    scored span enters part way through averages just the tokens it holds)."""
    from scripts.studies.loss_by_position import bucket_means
    logprobs = [-1.0, -2.0, -3.0, -4.0, -6.0]  # positions 6, 7, 8, 9, 10
    assert bucket_means(logprobs, 6, 4) == {4: 1.5, 8: 13.0 / 3}
    assert bucket_means(logprobs, 0, 8) == {0: 16.0 / 5}
    assert bucket_means(logprobs, 7, 1) == {7: 1.0, 8: 2.0, 9: 3.0, 10: 4.0, 11: 6.0}
