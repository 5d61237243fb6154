"""Our converter + model against Hugging Face transformers, the independent reference.

Tiny random Llama/Mistral models are saved by transformers, converted by convert_hf_checkpoint.py
and compared logit by logit (prefill and decode); the embedded SmolLM2 GGUF must generate the
same greedy tokens as transformers' own GGUF loader.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch

import convert_hf_checkpoint
import decoding
import model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
DECODE_STEPS = 8
VOCAB = 256


def _llama(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _mistral(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  sliding_window=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    return transformers.MistralConfig(**kwargs)


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

CASES = {
    # name: (config factory, how the weights are saved)
    "llama-mha": (lambda: _llama(), "safetensors"),
    "llama-gqa": (lambda: _llama(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0), "safetensors"),
    "llama31-rope-scaling": (lambda: _llama(num_key_value_heads=2, rope_scaling=dict(LLAMA31_ROPE)), "safetensors"),
    "llama-tied": (lambda: _llama(num_key_value_heads=2, tie_word_embeddings=True), "safetensors"),
    "llama-tied-bin": (lambda: _llama(num_key_value_heads=1, tie_word_embeddings=True), "bin"),
    "llama-bin": (lambda: _llama(num_attention_heads=2, num_key_value_heads=2), "bin"),
    "llama-sharded": (lambda: _llama(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3), "sharded"),
    "mistral": (lambda: _mistral(), "safetensors"),
}


def _randomize(hf_model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp and RoPE matters (HF's init, std 0.02, makes
    every attention nearly uniform, so a wrong rotation would hardly show in the logits)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1:  # RMSNorm gains
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * (1.5 / math.sqrt(p.shape[1])))


def _save(hf_model, directory: Path, how: str) -> None:
    if how == "safetensors":
        hf_model.save_pretrained(directory)
    elif how == "sharded":
        hf_model.save_pretrained(directory, max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    elif how == "bin":
        # transformers 5 only writes safetensors: write the legacy format as older versions did
        # (a torch.save'd state dict; tied weights share their storage).
        directory.mkdir(parents=True, exist_ok=True)
        hf_model.config.save_pretrained(directory)
        torch.save(hf_model.state_dict(), directory / "pytorch_model.bin")
    else:
        raise ValueError(how)


def _hf_reference(hf_model, prompt: torch.Tensor, steps: int):
    """Greedy decoding with HF's own KV cache: logits (B, vocab) of the prefill and of every step,
    and the tokens fed back (B, steps)."""
    with torch.no_grad():
        out = hf_model(input_ids=prompt, use_cache=True)
        logits, cache = [out.logits[:, -1].float()], out.past_key_values
        tokens = []
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)  # (B, 1)
            tokens.append(token)
            out = hf_model(input_ids=token, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
            cache = out.past_key_values
    return logits, torch.cat(tokens, dim=1)


def _ours(ours: model.Transformer, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill, then decode the given tokens one by one: the logits at every step."""
    B, T = prompt.shape
    ours.reset_caches()
    with torch.no_grad():
        logits = [ours.prefill(prompt, input_pos=torch.arange(T), kv_end=T)]
        for i in range(tokens.shape[1]):
            p = T + i
            logits.append(ours.decode(tokens[:, i:i + 1], input_pos=torch.tensor([p]), kv_end=p + 1))
    return logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_parity(case: str, tmp_path: Path):
    make_config, how = CASES[case]
    config = make_config()
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(hf_model, seed=zlib.crc32(case.encode()))
    if config.tie_word_embeddings:
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    hf_dir, out_dir = tmp_path / case, tmp_path / "converted"
    _save(hf_model, hf_dir, how)

    assert convert_hf_checkpoint.main([str(hf_dir), "--out", str(out_dir)]) == 0

    saved = json.loads((out_dir / "config.json").read_text())
    state = torch.load(out_dir / "model.pth", weights_only=True)
    assert ("output.weight" in state) == (not config.tie_word_embeddings)
    assert saved["tie_embeddings"] == bool(config.tie_word_embeddings)
    assert all(t.dtype == torch.float32 for t in state.values())
    if case == "mistral":
        assert saved["architecture"] == "mistral"
        assert saved["sliding_window"] == config.sliding_window and saved["layer_types"] == ["window"] * 2
    if case == "llama31-rope-scaling":
        assert saved["rope_scaling"]["rope_type"] == "llama3"

    ours = model.load_model(out_dir, device="cpu", dtype=torch.float32)
    B, T = 2, 12
    prompt = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    ours.setup_caches(max_batch_size=B, max_seq_length=T + DECODE_STEPS + 4)

    expected, tokens = _hf_reference(hf_model, prompt, DECODE_STEPS)
    actual = _ours(ours, prompt, tokens)
    assert expected[0].abs().max() > 1.0  # the comparison is meaningful: logits are not all ~0
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape == (B, VOCAB)
        diff = (a - e).abs().max().item()
        assert diff < ATOL, f"{case}: step {step} (0 = prefill) logits differ by {diff:.2e}"
    # Greedy decoding with our model alone picks the same tokens as HF's.
    assert torch.equal(torch.stack([lg.argmax(-1) for lg in actual[:-1]], dim=1), tokens)


def test_compiled_decode_matches_eager(tmp_path: Path):
    """torch.compile'd decode steps (as generate.py compiles them) equal the eager ones."""
    args = model.ModelArgs(vocab_size=VOCAB, dim=64, n_layer=2, n_head=8, n_kv_head=2, head_dim=8,
                           intermediate_size=96, rope_base=10000.0)
    torch.manual_seed(0)
    m = model.Transformer(args)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]) if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    m.eval()
    B, T, steps = 2, 10, 5
    m.setup_caches(max_batch_size=B, max_seq_length=T + steps + 2)
    prompt = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))

    compiled = decoding.compiled_decode_step(decoding.decode_step, "cpu")

    def run(step_fn):
        m.reset_caches()
        with torch.no_grad():
            logits = m.prefill(prompt, torch.arange(T), T)
            out = []
            for p in range(T, T + steps):
                token = logits.argmax(-1, keepdim=True)
                logits = step_fn(m, token, torch.tensor([p]), p + 1)
                out.append(logits)
        return torch.stack(out)

    eager = run(decoding.decode_step)
    torch._dynamo.reset()
    result = run(compiled)
    assert (result - eager).abs().max().item() < 1e-4

    # The norms' eps compile in as constants, guarded by value: a changed eps recompiles, never reuses
    # the old constant.
    for module in m.modules():
        if isinstance(module, model.RMSNorm):
            module.eps = 0.5
    eager_changed = run(decoding.decode_step)
    assert (eager_changed - eager).abs().max().item() > 1e-2
    assert (run(compiled) - eager_changed).abs().max().item() < 1e-4


def test_smollm2_greedy_matches_transformers(smollm2_checkpoint: Path, smollm2_gguf: Path):
    """The embedded GGUF, converted by us, generates what transformers' GGUF loader generates."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    text = "The three most important things to remember when baking bread at home are"
    prompt = torch.tensor([tokenizer(text)["input_ids"]])
    new_tokens = 32
    expected_logits, expected = _hf_reference(hf_model, prompt, new_tokens)

    ours = model.load_model(smollm2_checkpoint, device="cpu", dtype=torch.float32)
    assert ours.args.tie_embeddings and ours.args.n_layer == 30 and ours.args.n_kv_head == 3
    T = prompt.shape[1]
    ours.setup_caches(max_batch_size=1, max_seq_length=T + new_tokens + 1)
    ours.reset_caches()
    generated = []
    with torch.no_grad():
        logits = ours.prefill(prompt, input_pos=torch.arange(T), kv_end=T)
        prefill_diff = (logits - expected_logits[0]).abs().max().item()
        for i in range(new_tokens):
            token = logits.argmax(-1, keepdim=True)
            generated.append(token.item())
            logits = ours.decode(token, input_pos=torch.tensor([T + i]), kv_end=T + i + 1)
    assert generated == expected[0].tolist(), tokenizer.decode(generated) + " | " + tokenizer.decode(expected[0])
    assert prefill_diff < 1e-3
