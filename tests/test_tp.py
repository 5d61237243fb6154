"""Tensor parallel decode (tp.py) on gloo with 2 processes: greedy tokens equal one process's, for dense,
SparQ and H2O eager, dense and SparQ compiled; sharded shapes per rank; generate.py under torchrun; the errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_python


def torchrun(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_ranks_generate_what_one_process_does(tmp_path, compiled):
    out = tmp_path / "tp.json"
    result = torchrun("tests/tp_worker.py", out, *(["--compile"] if compiled else []))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report) == (["3"] if compiled else ["3", "4"])
    for n_kv, run in report.items():
        assert sorted(run["single"]) == (["dense", "sparq"] if compiled else ["dense", "h2o", "sparq"])
        for policy in run["single"]:
            assert run["sharded"][policy] == run["single"][policy], (n_kv, policy)
        # q/k/v rows: (own query heads + 2 x own KV heads) x d; MLP up rows and down columns: a share each
        heads = [2, 2] if n_kv == "4" else [2, 1]  # 3 KV heads split 2 + 1
        for shapes, kv in zip(run["shapes"], heads):
            assert shapes["wqkv"] == [(2 * kv + 2 * kv) * 16, 96]
            assert shapes["wo"] == [96, 2 * kv * 16] and shapes["cache_k"][1] == kv
        assert sum(s["w13"][0] for s in run["shapes"]) == 2 * 100  # [gate; up], a share of each


def test_generate_under_torchrun_matches_one_process(tmp_path, smollm2_checkpoint):
    common = ["--checkpoint", smollm2_checkpoint, "--prompt", "The three best things about Paris are",
              "--max-new-tokens", "10", "--no-stream", "--kernel", "torch"]
    single = run_python("generate.py", *common, "--json", tmp_path / "one.json")
    assert single.returncode == 0, single.stderr
    result = torchrun("generate.py", *common, "--json", tmp_path / "tp.json")
    assert result.returncode == 0, result.stderr[-3000:]
    # the whole model's shape, then rank 0's share of SmolLM2's 3 KV heads; rank 0 alone writes --json
    assert "9 heads / 3 KV heads" in result.stderr and "rank 0 holds 2 of 3 KV heads" in result.stderr
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "tp.json"))
    assert two["samples"][0]["tokens"] == one["samples"][0]["tokens"]


def test_more_ranks_than_kv_heads_is_one_line(tmp_path):
    """SmolLM2 has 3 KV heads: 4 ranks cannot each own one (the check runs before any collective)."""
    import tp
    from cli import UserError
    from model import ModelArgs, Transformer

    args = ModelArgs(vocab_size=10, dim=32, n_layer=1, n_head=3, n_kv_head=3, head_dim=8, intermediate_size=16)
    with pytest.raises(UserError, match="needs a KV head for each"):
        tp.check_shardable(Transformer(args), 4)
    assert tp.span(3, 2, 0) == (0, 2) and tp.span(3, 2, 1) == (2, 3) and tp.span(1536, 2, 1) == (768, 1536)


def test_interactive_refuses_torchrun(smollm2_checkpoint):
    result = torchrun("generate.py", "--checkpoint", smollm2_checkpoint, "--interactive", timeout=300)
    assert result.returncode != 0 and "one process" in result.stderr


def rank_0_of(torchrun_pid: int) -> int:
    """The pid of the worker torchrun started as rank 0 (its environment says RANK=0)."""
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if parent == torchrun_pid and b"RANK=0" in environ:
            return pid
    raise AssertionError("no rank 0 under torchrun")


def test_the_server_over_two_ranks_answers_what_one_process_does(smollm2_checkpoint):
    """torchrun --nproc-per-node 2 serve.py: rank 0 speaks HTTP and its engine's every step reaches rank 1
    (tp.Leader / tp.follow, gloo); through the OpenAI client two concurrent greedy completions equal one
    process's, and SIGTERM ends both ranks."""
    import signal
    import time

    import openai

    from test_serve import Server

    prompts = ["The three best things about Paris are", "Once upon a time"]
    flags = ["--max-batch-size", "2", "--kernel", "torch", "--max-seq-length", "512"]
    single = Server(smollm2_checkpoint, *flags)
    try:
        client = single.client()
        expected = [client.completions.create(model="x", prompt=p, max_tokens=10, temperature=0).choices[0].text
                    for p in prompts]
    finally:
        single.close()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "serve.py", "--checkpoint", str(smollm2_checkpoint), "--port", "0", "--no-compile",
                             *flags], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        lines, url = [], None
        deadline = time.time() + 300
        while time.time() < deadline:
            line = proc.stderr.readline()
            assert line, "torchrun serve.py exited: " + "".join(lines)
            lines.append(line)
            if "listening on" in line:
                url = line.split("listening on ")[1].split()[0]
            if "serve.py: ready:" in line:
                break
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        assert client.models.list().data[0].model_extra["tensor_parallel"] == 2
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: client.completions.create(model="x", prompt=p, max_tokens=10,
                                                                    temperature=0).choices[0].text, prompts))
        assert got == expected
        os.kill(rank_0_of(proc.pid), signal.SIGTERM)  # the server's own shutdown (torchrun's would kill the ranks)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
