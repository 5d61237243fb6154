"""Batches of different prompts: every row of a ragged batch generates exactly what its prompt
generates alone (the reference), for every policy that runs ragged rows, eager and compiled; and the
command line around it (a .jsonl prompt file, its errors)."""
from __future__ import annotations

import json
import math
import pytest
import torch

import data
import kernels
import generate
from conftest import assert_one_line_error, channels_file, read_json, run_main, run_python
from decoding import PREFILL_CHUNK, Generator, chunk_ends
from kernels import TORCH_KERNELS
from model import ModelArgs, Transformer, load_model
from policies import POLICIES, AttentionSettings, policy_factory


def run_rows(model, rows, new_tokens, settings, compile_decode=False, prefill_chunk=PREFILL_CHUNK):
    """Greedy tokens of each row, generated together in one batch (prompts prefilled in pieces of prefill_chunk)."""
    model.setup_caches(len(rows), max(map(len, rows)) + new_tokens)
    model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
    generator = Generator(model, compile_decode=compile_decode, prefill_chunk=prefill_chunk)
    tokens, stats = generator.generate(rows, new_tokens)
    assert stats.steps == new_tokens - 1
    return tokens


def alone(model, rows, new_tokens, settings, prefill_chunk=PREFILL_CHUNK):
    return [run_rows(model, [row], new_tokens, settings, prefill_chunk=prefill_chunk)[0] for row in rows]


def tiny_model(seed: int = 0, scale: float = 1.5, kernels=TORCH_KERNELS, **shape) -> Transformer:
    """A random model of this shape (ModelArgs fields in `shape` override it): matrices N(0, scale^2 / fan-in),
    norms near 1, seeded."""
    torch.manual_seed(seed)
    args = ModelArgs(**{**dict(vocab_size=101, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16,
                               intermediate_size=96, max_context=512), **shape})
    model = Transformer(args, kernels)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * (scale / math.sqrt(p.shape[-1])) if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    return model.eval()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_row_equals_its_prompt_alone_tiny_model(policy):
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 70, 33)]
    settings = AttentionSettings(policy, sparq_r=6 if "sparq_r" in POLICIES[policy].flags else None, sparq_k=24,
                                 kv_budget=24 if POLICIES[policy].knob == "kv_budget" else None,
                                 channels=channels_file(model.args))
    batch = run_rows(model, rows, 14, settings)
    assert batch == alone(model, rows, 14, settings)
    assert len({str(r) for r in batch}) == 3


def test_sliding_window_models_refuse_ragged_rows():
    """A window layer's visible positions start at each row's own length minus the window: not done
    for ragged rows (generate.py refuses such a batch in one line before it gets here)."""
    args = ModelArgs(vocab_size=101, dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, intermediate_size=96,
                     sliding_window=8, layer_types=["window", "global"])
    model = Transformer(args).eval()
    with pytest.raises(ValueError, match="one at a time"):
        run_rows(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 3, AttentionSettings("dense"))


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    import tokenizer

    return load_model(smollm2_checkpoint), tokenizer.load_tokenizer(smollm2_checkpoint)


@pytest.mark.parametrize("policy", ["dense", "sparq"])
def test_smollm2_rows_of_20_200_450_tokens_equal_each_prompt_alone(smollm2, policy):
    """The issue's reference (rows of 20, 700 and 2100 tokens, prefilled in the default chunks of 2048), scaled
    down: a batch mixing short and long prompts prefilled in chunks of 128 tokens, the short row ending in the
    first chunk, the middle one in the second, the longest crossing three chunk boundaries; fp32, eager, torch
    kernels (fused kernels: test_fused_kernels_run_ragged_rows)."""
    model, tok = smollm2
    essay = data.essay_tokens(tok, 550)
    rows = [essay[:20], essay[50:250], essay[100:550]]
    assert [len(chunk_ends(0, len(row), 128)) for row in rows] == [1, 2, 4]
    settings = AttentionSettings(policy, sparq_r=16 if "sparq_r" in POLICIES[policy].flags else None, sparq_k=64)
    batch = run_rows(model, rows, 10, settings, prefill_chunk=128)
    assert batch == alone(model, rows, 10, settings, prefill_chunk=128)


@pytest.mark.parametrize("policy", ["dense", "sparq"])
def test_compiled_ragged_decode_equals_eager(policy):
    """Compiled decode of a ragged batch gives the eager batch's tokens (which equal each row alone:
    the tests above); a small random model, so compiling stays cheap."""
    model = tiny_model(seed=2)
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (4, 90, 41)]
    settings = AttentionSettings(policy, sparq_r=6 if "sparq_r" in POLICIES[policy].flags else None, sparq_k=24)
    eager = run_rows(model, rows, 12, settings)
    torch._dynamo.reset()
    assert run_rows(model, rows, 12, settings, compile_decode=True) == eager
    assert len({str(r) for r in eager}) == 3


def test_fused_kernels_run_ragged_rows(smollm2_checkpoint, smollm2):
    """The fused CPU kernels read each row's own live length: the same tokens as the torch path (the module's
    model, loaded with the torch kernels); rows of 25, 300 and 200 tokens, the shortest below SparQ's k = 64."""
    plain, tok = smollm2
    assert plain.kernels.name == TORCH_KERNELS.name
    error = kernels.cpu_kernel_error()
    if error is not None:
        pytest.fail(f"the fused CPU kernels did not build: {error}")
    fused = load_model(smollm2_checkpoint, kernels=kernels.CPU_KERNELS)
    essay = data.essay_tokens(tok, 400)
    rows = [essay[:25], essay[100:400], essay[10:210]]
    for policy in ("dense", "sparq"):
        settings = AttentionSettings(policy, sparq_r=16 if "sparq_r" in POLICIES[policy].flags else None, sparq_k=64)
        assert run_rows(fused, rows, 10, settings) == run_rows(plain, rows, 10, settings)


def test_prompt_file_jsonl_keeps_input_order(tmp_path, smollm2_checkpoint):
    prompts = ["What is the capital of France?", "Name a prime number.",
               "Write one sentence about the sea, then stop."]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "chat": True}) for p in prompts) + "\n\n")
    out = tmp_path / "out.json"
    result = run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt-file", path, "--max-new-tokens",
                        "12", "--json", out, "--kernel", "torch")
    assert result.returncode == 0, result.stderr
    report = read_json(out)
    assert report["batch_size"] == 3 and len(report["samples"]) == 3
    lengths = [s["prompt_tokens"] for s in report["samples"]]
    assert len(set(lengths)) > 1  # a ragged batch
    single = run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--chat", "--prompt", prompts[1],
                        "--max-new-tokens", "12", "--json", tmp_path / "one.json", "--kernel", "torch")
    assert single.returncode == 0, single.stderr
    assert read_json(tmp_path / "one.json")["samples"][0]["tokens"] == report["samples"][1]["tokens"]


@pytest.mark.parametrize("content, fragment", [
    ("", "holds no prompt"), ('{"prompt": ""}\n', "non-empty"), ("not json\n", "not JSON"),
    ('{"text": "hi"}\n', '"prompt"')])
def test_bad_prompt_files_are_one_line_errors(tmp_path, smollm2_checkpoint, content, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--prompt-file", path), fragment)
