"""The real 32k-context models (`make models`): our conversion of each GGUF generates, greedily and in
fp32, exactly what transformers generates from the same GGUF file.

These need the converted checkpoints in checkpoints/<name> and the GGUFs in the fetch cache: they
skip with the command to run when absent (CI runs neither `make models` nor these).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts import fetch_models
import model
import tokenizer as tokenizer_module
from conftest import REPO

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPTS = {  # Qwen is an instruct model (chat template); Gemma 3 270M is a base model (plain text)
    "Qwen2.5-Coder-0.5B-Instruct": ("Write a Python function that checks whether a number is prime.", True),
    "Qwen2.5-Coder-1.5B-Instruct": ("Explain what a hash map is in two sentences.", True),
    "gemma-3-270m": ("The three most important things to remember when baking bread at home are", False),
}


def real_model(name: str) -> tuple[Path, Path]:
    gguf, checkpoint = fetch_models.gguf_path(name), REPO / "checkpoints" / name
    if not gguf.is_file() or not (checkpoint / "model.pth").is_file():
        pytest.skip(f"{name} is not fetched and converted (run `make models`)")
    return gguf, checkpoint


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_tokens_match_transformers_on_the_same_gguf(name: str):
    gguf, checkpoint = real_model(name)
    text, chat = PROMPTS[name]
    tok = tokenizer_module.load_tokenizer(checkpoint)
    prompt = torch.tensor([tok.encode_prompt(text, chat=chat)])
    T = prompt.shape[1]

    ours = model.load_model(checkpoint, dtype=torch.float32)
    ours.setup_caches(1, T + NEW_TOKENS)
    generated, first_logits = [], None
    with torch.no_grad():
        logits = ours.prefill(prompt, torch.arange(T), T)
        first_logits = logits
        for i in range(NEW_TOKENS):
            token = logits.argmax(-1, keepdim=True)
            generated.append(token.item())
            logits = ours.decode(token, torch.tensor([T + i]), T + i + 1)
    del ours

    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                          output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, T:].tolist()
    prefill_diff = (first_logits[0] - out.logits[0][0].float()).abs().max().item()  # raw logits, no processors
    assert generated == expected, f"ours: {tok.decode(generated)!r}\ntransformers: {tok.decode(expected)!r}"
    assert prefill_diff < 1e-2, prefill_diff
