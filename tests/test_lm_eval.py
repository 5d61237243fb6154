"""lm-evaluation-harness as a client of serve.py: `lm_eval --model local-completions` runs a multiple-choice
(loglikelihood) task and a generation task (tests/lm_eval_tasks/, local data) against the server, and lm-eval's
own `hf` backend runs them on the same model (transformers reading the embedded GGUF); the scores agree to
within one example, each choice's loglikelihood to LOGLIKELIHOOD_TOLERANCE.

The server answers lm-eval's requests as vLLM would: token-id prompts, echo with logprobs and max_tokens 1
(lm-eval reads token_logprobs[ctxlen:-1], so the one generated token must be reported, whatever it is), and
tokenizes through /tokenize (lm-eval's remote tokenizer, detected from base_url). No network: the tasks'
data are local JSONL files and every Hugging Face library runs offline."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMOLLM2_GGUF, skip_or_fail
from test_serve import Server

TASKS_DIR = REPO / "tests" / "lm_eval_tasks"
MC_TASK, GEN_TASK = "sparq_mc", "sparq_gen"
MC_DOCS, GEN_DOCS = 40, 20  # the lines of mc.jsonl and gen.jsonl
# Both sides compute in float32 on the CPU: the choices' loglikelihoods agree to 4e-5 nats (measured); a token
# missing or added on either side moves one by more (the smallest such slip here: 5e-3 nats).
LOGLIKELIHOOD_TOLERANCE = 1e-3
LM_EVAL_TIMEOUT = 900


class Evaluations(dict):
    """{"server" or "hf": {task: {doc_id: sample}}}, shown by its size alone in a failing test's traceback."""

    def __repr__(self) -> str:
        sizes = [f"{name} {task}: {len(rows)} docs" for name, tasks in self.items() for task, rows in tasks.items()]
        return f"Evaluations({', '.join(sizes)})"


def lm_eval_env(tmp: Path) -> dict:
    """The environment of every process here: offline, one thread each (the server and the hf run overlap on
    two cores), the datasets cache in the test's own directory."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp / "datasets"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("OPENAI_API_KEY", None)
    return env


def lm_eval_command(model: str, model_args: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
            "--tasks", MC_TASK, GEN_TASK, "--include_path", str(TASKS_DIR.relative_to(REPO)),
            "--output_path", str(out), "--log_samples", *extra]


def samples(out: Path, task: str) -> dict[int, dict]:
    """lm-eval's --log_samples output for one task: doc_id -> the sample."""
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    assert len(files) == 1, (out, files)
    rows = [json.loads(line) for line in Path(files[0]).read_text().splitlines() if line.strip()]
    return {row["doc_id"]: row for row in rows}


def finished(proc: subprocess.Popen, log: Path, what: str) -> None:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n" + log.read_text()[-6000:]


@pytest.fixture(scope="module")
def evaluations(smollm2_checkpoint, tmp_path_factory):
    """lm-eval's samples from both backends: {"server": {task: {doc_id: sample}}, "hf": ...}; the hf run
    goes on in the background while the server's runs."""
    if importlib.util.find_spec("lm_eval") is None:
        skip_or_fail("lm-evaluation-harness is missing (pip install -r requirements-test.txt)")
    tmp = tmp_path_factory.mktemp("lm_eval")
    env = lm_eval_env(tmp)
    started = time.time()

    hf_out, hf_log = tmp / "hf", tmp / "hf.log"
    hf_args = f"pretrained={SMOLLM2_GGUF.parent},gguf_file={SMOLLM2_GGUF.name},dtype=float32"
    with open(hf_log, "w") as log:
        hf = subprocess.Popen(lm_eval_command("hf", hf_args, hf_out, "--device", "cpu", "--batch_size", "16"),
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            server = Server(smollm2_checkpoint, "--dtype", "float32", "--max-batch-size", "2")
        server_out, server_log = tmp / "server", tmp / "server.log"
        server_args = (f"base_url={server.url}/completions,model=smollm2,num_concurrent=2,max_retries=1,"
                       f"tokenized_requests=True,max_length=1024")
        with open(server_log, "w") as log:
            run = subprocess.run(lm_eval_command("local-completions", server_args, server_out), cwd=REPO, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, text=True, timeout=LM_EVAL_TIMEOUT)
        finished(run, server_log, "lm_eval against serve.py (server log:\n" + "".join(server.lines)[-3000:] + ")")
        hf.wait(LM_EVAL_TIMEOUT)
        finished(hf, hf_log, "lm_eval --model hf")
    finally:
        if hf.poll() is None:
            hf.kill()
            hf.wait(30)
        if server is not None:
            server.close()
    print(f"lm_eval, both backends: {time.time() - started:.0f} s")
    return Evaluations({name: {task: samples(out, task) for task in (MC_TASK, GEN_TASK)}
                        for name, out in (("server", server_out), ("hf", hf_out))})


def check_scores(evaluations, task: str, metric: str, docs: int) -> None:
    server, hf = evaluations["server"][task], evaluations["hf"][task]
    assert sorted(server) == sorted(hf) == list(range(docs)), (sorted(server), sorted(hf))
    right = {name: round(sum(row[metric] for row in rows.values())) for name, rows in (("server", server), ("hf", hf))}
    print(f"{task} {metric}: server {right['server']}/{docs}, hf {right['hf']}/{docs}")
    assert abs(right["server"] - right["hf"]) <= 1, (task, right)
    for name, n in right.items():  # neither all right nor all wrong: the comparison could fail
        assert 0 < n < docs, (task, name, n)


def loglikelihoods(sample: dict) -> list[float]:
    """A multiple-choice sample's choices' loglikelihoods (lm-eval logs each as [loglikelihood, is_greedy])."""
    return [float(resp[0]) for resp in sample["filtered_resps"]]


def test_multiple_choice_accuracy_matches_hf(evaluations):
    check_scores(evaluations, MC_TASK, "acc", MC_DOCS)


def test_choice_loglikelihoods_match_hf(evaluations):
    server, hf = evaluations["server"][MC_TASK], evaluations["hf"][MC_TASK]
    worst, off = 0.0, []
    for doc_id in sorted(hf):
        ours, theirs = loglikelihoods(server[doc_id]), loglikelihoods(hf[doc_id])
        assert len(ours) == len(theirs) == len(hf[doc_id]["doc"]["choices"]), doc_id
        for choice, (a, b) in enumerate(zip(ours, theirs)):
            worst = max(worst, abs(a - b))
            if abs(a - b) >= LOGLIKELIHOOD_TOLERANCE:
                off.append(f"doc {doc_id} ({hf[doc_id]['doc']['question']!r}) choice "
                           f"{hf[doc_id]['arguments'][f'gen_args_{choice}']['arg_1']!r}: server {a:.4f}, hf {b:.4f}")
    print(f"{MC_TASK}: the largest loglikelihood difference {worst:.2e} nats")
    assert not off, f"{len(off)} loglikelihoods differ by {LOGLIKELIHOOD_TOLERANCE} nats or more:\n" + "\n".join(off)


def test_generation_exact_match_matches_hf(evaluations):
    check_scores(evaluations, GEN_TASK, "exact_match", GEN_DOCS)
    server, hf = evaluations["server"][GEN_TASK], evaluations["hf"][GEN_TASK]
    differ = [(doc_id, server[doc_id]["resps"], hf[doc_id]["resps"]) for doc_id in sorted(hf)
              if server[doc_id]["resps"] != hf[doc_id]["resps"]]
    assert len(differ) <= 1, differ  # greedy decoding of the same model: the same text, but for a near tie
