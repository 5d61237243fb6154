"""Model families (Qwen 2 / 3, Gemma 1 / 2 / 3, GPT-NeoX, and Mistral's sliding window) against
transformers, the independent reference.

Each case is a tiny random model built with transformers' own config class (MHA and GQA where the
family has both, odd sizes, window and global layers for Gemma 2 / 3), saved with save_pretrained,
converted by convert_hf_checkpoint.py, then compared: prefill logits and 8 greedy decode steps
within a tight fp32 tolerance, identical greedy tokens, SparQ with r = head_dim and k >= S giving
exactly dense's tokens, and compiled decode equal to eager. Prompts are longer than the sliding
windows, so window layers really slide, and prefill runs in chunks smaller than the prompt.
"""
from __future__ import annotations

import json
import math
import zlib

import pytest
import torch

import convert_hf_checkpoint
import model
from decoding import Generator, compiled_decode_step, decode_step
from policies import AttentionSettings, policy_factory

transformers = pytest.importorskip("transformers")

VOCAB = 97
ATOL = 2e-4
DECODE_STEPS = 8


def _base(**overrides) -> dict:
    kwargs = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    return kwargs


CASES = {
    # name: config factory. Head dims: 12 (48 / 4) unless set; windows of 6 with 20-token prompts.
    "qwen2-gqa": lambda: transformers.Qwen2Config(**_base(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen2-mha": lambda: transformers.Qwen2Config(**_base(num_key_value_heads=4, num_hidden_layers=3)),
    "qwen3-gqa": lambda: transformers.Qwen3Config(**_base(head_dim=16, num_attention_heads=6)),
    "gemma-mha": lambda: transformers.GemmaConfig(**_base(head_dim=16, num_key_value_heads=4, tie_word_embeddings=True)),
    "gemma-mqa": lambda: transformers.GemmaConfig(**_base(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True)),
    "gemma2": lambda: transformers.Gemma2Config(**_base(
        head_dim=16, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_base(
        head_dim=16, num_hidden_layers=4, sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        tie_word_embeddings=True)),
    "gpt-neox-parallel": lambda: transformers.GPTNeoXConfig(**_base(
        num_key_value_heads=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})),
    "gpt-neox-serial": lambda: transformers.GPTNeoXConfig(**_base(
        num_key_value_heads=None, hidden_size=64, use_parallel_residual=False, hidden_act="gelu_new",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    "mistral-window": lambda: transformers.MistralConfig(**_base(head_dim=16, sliding_window=7)),
}


def _randomize(hf_model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp and RoPE matters (HF's init makes attention
    nearly uniform, so a wrong rotation or a wrong window would hardly show in the logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1 and "bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # norm gains (Gemma's are offsets from 1)
                p.copy_((0.0 if "gemma" in type(hf_model).__name__.lower() else 1.0)
                        + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[1])))


def _hf_reference(hf_model, prompt: torch.Tensor, steps: int):
    """Greedy decoding with HF's own KV cache: logits (B, vocab) of the prefill and every step, and
    the tokens fed back (B, steps)."""
    with torch.no_grad():
        out = hf_model(input_ids=prompt, use_cache=True)
        logits, cache = [out.logits[:, -1].float()], out.past_key_values
        tokens = []
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            tokens.append(token)
            out = hf_model(input_ids=token, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
            cache = out.past_key_values
    return logits, torch.cat(tokens, dim=1)


def _prefill_in_chunks(ours: model.Transformer, prompt: torch.Tensor, chunk: int) -> torch.Tensor:
    T = prompt.shape[1]
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        logits = ours.prefill(prompt[:, start:end], torch.arange(start, end), end)
    return logits


def _ours(ours: model.Transformer, prompt: torch.Tensor, tokens: torch.Tensor, chunk: int, step=None) -> list:
    step = step or (lambda m, token, pos, length: m.decode(token, pos, length))
    ours.reset_caches()
    T = prompt.shape[1]
    with torch.no_grad():
        logits = [_prefill_in_chunks(ours, prompt, chunk)]
        for i in range(tokens.shape[1]):
            p = T + i
            logits.append(step(ours, tokens[:, i:i + 1], torch.tensor([p]), p + 1))
    return logits


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    case = request.param
    config = CASES[case]()
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(hf_model, zlib.crc32(case.encode()))
    root = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(root / "hf")
    assert convert_hf_checkpoint.main([str(root / "hf"), "--out", str(root / "ours")]) == 0
    return case, config, hf_model, root / "ours"


def test_logits_and_greedy_tokens_match_transformers(converted):
    case, config, hf_model, out_dir = converted
    saved = json.loads((out_dir / "config.json").read_text())
    ours = model.load_model(out_dir)
    B, T = 2, 20
    prompt = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    ours.setup_caches(B, T + DECODE_STEPS + 2)
    expected, tokens = _hf_reference(hf_model, prompt, DECODE_STEPS)
    assert expected[0].abs().max() > 0.5, "the comparison must be meaningful: logits not all ~0"
    for chunk in (T, 7):  # the whole prompt at once, then in chunks (the chunk attends to the cache)
        actual = _ours(ours, prompt, tokens, chunk)
        for step, (a, e) in enumerate(zip(actual, expected)):
            diff = (a - e).abs().max().item()
            assert diff < ATOL, f"{case} (chunk {chunk}): step {step} (0 = prefill) logits differ by {diff:.2e}"
        assert torch.equal(torch.stack([lg.argmax(-1) for lg in actual[:-1]], dim=1), tokens)
    if "window" in str(saved.get("layer_types")):
        assert T > saved["sliding_window"]  # the windows slide over this prompt


def test_sparq_with_full_r_and_k_generates_dense_tokens(converted):
    """r = head_dim and k >= S: SparQ is dense attention, soft-capping and windows included."""
    _, _, _, out_dir = converted
    ours = model.load_model(out_dir)
    prompt = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    rows = {}
    for policy, settings in (("dense", AttentionSettings("dense")),
                             ("sparq", AttentionSettings("sparq", sparq_r=ours.args.head_dim, sparq_k=256, sparq_local=0))):
        ours.setup_caches(2, 24 + 16)
        ours.set_decode_attention(policy_factory(settings, ours.args))
        for layer in ours.layers:  # test SparQ itself, not the dense path it takes while S <= k
            layer.attention.decode_attention.dense_when_short = False
        rows[policy], _ = Generator(ours).generate(prompt, 16)
        if policy == "sparq" and ours.args.layer_types is None:
            assert all(layer.attention.decode_attention.name == "sparq" for layer in ours.layers)
    assert rows["sparq"] == rows["dense"]


def test_h2o_holding_every_visible_position_generates_dense_tokens(converted):
    """H2O with a budget of each layer's whole view (the window on a window layer, the prompt and its
    continuation on a global one) keeps every position it may see: dense's tokens. The window layers'
    H2O scores only the keys in the window during the chunked prefill (model.py passes the window)."""
    from baselines import H2ODecode

    _, _, _, out_dir = converted
    ours = model.load_model(out_dir)
    prompt = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    rows = {}
    for policy in ("dense", "h2o"):
        ours.setup_caches(2, 24 + 16)
        if policy == "dense":
            ours.set_decode_attention(policy_factory(AttentionSettings("dense"), ours.args))
        else:
            ours.set_decode_attention(lambda i: H2ODecode(ours.args.window(i) or 64, local=0, prefill_chunk=8,
                                                          cap=ours.args.attn_softcap))
        rows[policy], _ = Generator(ours).generate(prompt, 16)
    assert rows["h2o"] == rows["dense"]


# Compiled decode, on the cases whose features differ (a cold compile with inductor's C++ wrapper
# takes 25-200 s a case): soft-capping and sandwich norms, q/k norms and two RoPEs with a window
# pattern, partial RoPE with a parallel residual and biases, tied embeddings with qkv biases.
COMPILED_CASES = ("gemma2", "gemma3", "gpt-neox-parallel", "qwen2-gqa")


def test_compiled_decode_matches_eager(converted):
    case, _, _, out_dir = converted
    if case not in COMPILED_CASES:
        pytest.skip(f"compiled on {', '.join(COMPILED_CASES)} only (their features cover {case}'s)")
    ours = model.load_model(out_dir)
    prompt = torch.randint(3, VOCAB, (2, 15), generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(6))
    ours.setup_caches(2, 15 + 6)
    eager = _ours(ours, prompt, tokens, chunk=15)
    torch._dynamo.reset()
    compiled = _ours(ours, prompt, tokens, chunk=15, step=compiled_decode_step(decode_step, "cpu"))
    for a, e in zip(compiled[1:], eager[1:]):
        assert (a - e).abs().max().item() < 1e-4
