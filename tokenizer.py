"""Tokenizers for the checkpoints we run: one interface, three kinds of files.

    load_tokenizer(dir) picks the kind from the files in a checkpoint dir:
      tokenizer.model, a sentencepiece ModelProto  -> SentencePieceTokenizer (Llama 2, Mistral, Gemma)
      tokenizer.model, base64-token + rank lines   -> BPETokenizer.from_tiktoken_file (Llama 3)
      tokenizer.json, HF byte-level BPE            -> BPETokenizer.from_hf_json (SmolLM2, Qwen2, GPT-2 style)
    next to tokenizer_config.json / special_tokens_map.json / generation_config.json /
    chat_template.jinja when present (bos/eos, add_bos_token, chat template, stop ids).

Both BPE kinds run on tiktoken. For an HF tokenizer.json the merge list becomes tiktoken ranks
(rank = position of the first merge producing a token), so tiktoken's "merge the adjacent pair
whose concatenation has the lowest rank" replays HF's merge order; ranks map back to HF ids.
tiktoken also returns a pre-token whole when it is a token, as HF does with ignore_merges=true
(Llama 3); with ignore_merges=false that agrees as long as each token's own merges rebuild it,
which holds for every token of SmolLM2 and Qwen2.5 (the tests compare with HF on all essays).

The converter calls write_tokenizer_from_gguf or copy_tokenizer_files (HF model dir -> checkpoint
dir). From a GGUF (tokenizer.ggml.model):
  "gpt2"  (byte-level BPE: SmolLM2, Qwen2, Llama 3) -> tokenizer.json + tokenizer_config.json
  "llama" (llama.cpp's SPM: Gemma, Llama 2, Mistral) -> tokenizer.model, a sentencepiece BPE ModelProto
          rebuilt from the tokens, scores and token types (serialized here: no protobuf package), run by
          sentencepiece exactly as the original tokenizer.model would be; + tokenizer_config.json
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import unicodedata
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import gguf

# Tokens that end a sample whenever the vocab has them (besides eos and generation_config.json).
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")

HF_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json", "chat_template.jinja")

# Pre-tokenizer regexes (tiktoken / fancy-regex syntax).
# GPT-2, as HF's ByteLevel(use_regex=True) applies it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# HF Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)] in one regex (SmolLM2,
# llama.cpp "smollm"/"starcoder"): every digit is its own piece, and because Digits splits first,
# whitespace before a digit ends a piece there, so `\s+(?!\S)` becomes `\s+(?![^\s\p{N}])`.
GPT2_DIGITS_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen2 / Qwen2.5 (their tokenizer.json, llama.cpp "qwen2"): Llama 3's, but every digit on its own.
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Llama 3.1's special tokens (meta-llama/llama-models), ids len(base vocab) + i: 128000 + i.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - 11)]


class Tokenizer:
    """The interface generate.py uses. Subclasses implement encode/decode and fill the fields."""

    bos_id: Optional[int]
    eos_id: int
    stop_ids: set[int]  # ids that end a sample: eos, <|im_end|>, <|eot_id|>, ...
    add_bos: bool  # whether encode_prompt (chat=False) prepends BOS
    vocab_size: int
    special_tokens: dict[str, int]  # token text -> id, recognized only in rendered chat templates
    chat_template: Optional[str] = None

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. No BOS; special-token strings in `text` are encoded as plain text."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode_prompt(self, text: str, chat: bool = False, system: Optional[str] = None) -> list[int]:
        """Ids of a prompt. chat=True renders the chat template (one user message, plus the system
        message if given, and the assistant header); the template writes any BOS itself, as HF's
        apply_chat_template(tokenize=True) assumes, so no BOS is added here."""
        if not chat:
            if system is not None:
                raise ValueError("a system prompt needs chat=True")
            return ([self.bos_id] if self.add_bos else []) + self.encode(text)
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": text})
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Ids of a conversation ({"role", "content"} messages) rendered by the chat template, with the
        assistant header for the next reply (the template writes any BOS itself)."""
        if self.chat_template is None:
            raise ValueError("chat=True, but this tokenizer has no chat template "
                             "(none in tokenizer_config.json or chat_template.jinja)")
        names = {i: s for s, i in self.special_tokens.items()}
        rendered = render_chat_template(self.chat_template, messages, bos_token=names.get(self.bos_id, ""),
                                        eos_token=names.get(self.eos_id, ""))
        return self.encode_with_special_tokens(rendered)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Like encode, but special-token strings in `text` become their ids."""
        if not self.special_tokens:
            return self.encode(text)
        ids: list[int] = []
        for i, part in enumerate(_special_split_regex(tuple(self.special_tokens)).split(text)):
            if i % 2:  # odd parts are the captured special tokens
                ids.append(self.special_tokens[part])
            elif part:
                ids += self.encode(part)
        return ids

    def _apply_config(self, checkpoint_dir: Path) -> None:
        """bos/eos, add_bos, chat template and stop ids from the HF files next to the tokenizer."""
        config = _read_json(checkpoint_dir / "tokenizer_config.json")
        special_map = _read_json(checkpoint_dir / "special_tokens_map.json")
        for key in ("bos_token", "eos_token"):
            name = _token_text(config.get(key)) or _token_text(special_map.get(key))
            if name is not None:
                if name not in self.special_tokens:
                    raise ValueError(f"{key} {name!r} of {checkpoint_dir} is not a special token of the tokenizer")
                setattr(self, key.replace("_token", "_id"), self.special_tokens[name])
        stop_ids = {self.special_tokens[t] for t in STOP_TOKENS if t in self.special_tokens}
        if self.eos_id is None:  # no config: the first known end token the vocab has
            self.eos_id = next((self.special_tokens[t] for t in STOP_TOKENS if t in self.special_tokens), None)
        if self.eos_id is None:
            raise ValueError(f"no eos token: set eos_token in {checkpoint_dir / 'tokenizer_config.json'}")
        self.add_bos = bool(config.get("add_bos_token", self.add_bos)) and self.bos_id is not None
        self.chat_template = _chat_template(checkpoint_dir, config) or self.chat_template
        eos = _read_json(checkpoint_dir / "generation_config.json").get("eos_token_id") or []
        self.stop_ids = {self.eos_id, *([eos] if isinstance(eos, int) else eos), *stop_ids}


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece tokenizer.model (Llama 2, Mistral), run by the sentencepiece library."""

    def __init__(self, model_file: Path):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        self.vocab_size = self.sp.get_piece_size()
        self.special_tokens = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)
                               if self.sp.is_control(i) or self.sp.is_unknown(i)}  # <unk>, <s>, </s>
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.add_bos = self.bos_id is not None

    def encode(self, text: str) -> list[int]:
        # With a dummy prefix (Llama 2; Gemma has none) each call adds "▁", also to each piece between
        # special tokens in encode_with_special_tokens: Meta's Llama 2 chat encoding (HF's legacy=True).
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class BPETokenizer(Tokenizer):
    """Byte-level BPE run by tiktoken: Llama 3 tokenizer.model files and HF byte-level tokenizer.json."""

    def __init__(self, ranks: dict[bytes, int], rank_to_id: Optional[list[int]], pattern: str,
                 special_tokens: dict[str, int], id_to_bytes: dict[int, bytes],
                 plain_tokens: Optional[dict[str, int]] = None, normalization: Optional[str] = None):
        """ranks: token bytes -> tiktoken rank (merge priority); rank_to_id: rank -> model id (None:
        ranks are the ids); special_tokens: text -> id; id_to_bytes: id -> bytes for decoding;
        plain_tokens: added tokens that are not special (Qwen2's <tool_call>), matched in plain text
        too, as HF and llama.cpp do; normalization: a unicodedata form applied before the split (NFC)."""
        import regex
        import tiktoken

        self.enc = tiktoken.Encoding("bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self.rank_to_id = rank_to_id
        self.special_tokens = special_tokens
        self.plain_tokens = plain_tokens or {}
        self.normalization = normalization
        self.vocab_size = max(id_to_bytes) + 1
        self.id_to_bytes = [id_to_bytes.get(i, b"") for i in range(self.vocab_size)]
        # Bytes with no token (SmolLM2 lacks 21, e.g. \x04 and 0xF1): HF's BPE drops them from a
        # pre-token before merging, tiktoken would panic. Text holding them takes a slower path.
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self.pattern = regex.compile(pattern)
        self.bos_id, self.eos_id, self.add_bos = None, None, False

    @classmethod
    def from_tiktoken_file(cls, path: Path) -> "BPETokenizer":
        """Llama 3's tokenizer.model: lines "base64(token bytes) rank"; the 256 special tokens follow.
        Any tiktoken file is taken to be Llama 3's (its split regex and special tokens)."""
        ranks = _read_tiktoken_ranks(path)
        specials = {s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIAL_TOKENS)}
        tok = cls(ranks, None, LLAMA3_PATTERN, specials, {**{r: b for b, r in ranks.items()},
                                                         **{i: s.encode() for s, i in specials.items()}})
        tok.bos_id, tok.eos_id, tok.add_bos = specials["<|begin_of_text|>"], specials["<|end_of_text|>"], True
        return tok

    @classmethod
    def from_hf_json(cls, path: Path) -> "BPETokenizer":
        """An HF tokenizer.json holding a byte-level BPE model (vocab + merges)."""
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj.get("model", {})
        if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError(f"{path}: only plain byte-level BPE models are supported, not {_short(model)}")
        if tj.get("normalizer") not in (None, {"type": "NFC"}):
            raise ValueError(f"{path}: normalizers other than NFC are not supported: {_short(tj['normalizer'])}")
        pattern = pattern_from_pre_tokenizer(tj.get("pre_tokenizer"))
        vocab: dict[str, int] = model["vocab"]
        specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
        plain = {t["content"]: t["id"] for t in tj.get("added_tokens", []) if not t.get("special", True)}
        id_to_bytes = {i: _byte_level_decode(s) or s.encode() for s, i in vocab.items()}
        id_to_bytes.update({i: s.encode() for s, i in specials.items()})

        ranks: dict[bytes, int] = {}  # single bytes first, then merge results in merge order
        rank_to_id: list[int] = []

        def add(token: str) -> None:
            b = _byte_level_decode(token)
            if b is not None and b not in ranks:
                ranks[b] = len(rank_to_id)
                rank_to_id.append(vocab[token])

        for token in _BYTE_TO_UNICODE.values():
            if token in vocab:
                add(token)
        for merge in model["merges"]:
            left, right = merge.split(" ") if isinstance(merge, str) else merge
            if left + right not in vocab:
                raise ValueError(f"{path}: merge {left!r} {right!r} makes a token missing from the vocab")
            add(left + right)
        tok = cls(ranks, rank_to_id, pattern, specials, id_to_bytes, plain,
                  "NFC" if tj.get("normalizer") else None)
        bos = _template_bos(tj.get("post_processor"))
        if bos in specials:
            tok.bos_id, tok.add_bos = specials[bos], True
        return tok

    def encode(self, text: str) -> list[int]:
        if not self.plain_tokens:
            return self._encode_text(text)
        ids: list[int] = []
        for i, part in enumerate(_special_split_regex(tuple(self.plain_tokens)).split(text)):
            if i % 2:  # odd parts are the captured added tokens
                ids.append(self.plain_tokens[part])
            elif part:
                ids += self._encode_text(part)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        if self.missing_bytes and _has_any_byte(text, self.missing_bytes):
            ranks = self._encode_dropping_missing_bytes(text)
        else:
            ranks = self.enc.encode_ordinary(text)
        return ranks if self.rank_to_id is None else [self.rank_to_id[r] for r in ranks]

    def _encode_dropping_missing_bytes(self, text: str) -> list[int]:
        ranks: list[int] = []
        for piece in self.pattern.findall(text):
            data = piece.encode("utf-8", errors="surrogatepass").translate(None, self.missing_bytes)
            if data:
                ranks += self.enc._encode_single_piece(data)
        return ranks

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.id_to_bytes[i] for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """The tokenizer of a checkpoint dir, its kind picked from the files present (see module doc)."""
    checkpoint_dir = Path(checkpoint_dir)
    model_file, json_file = checkpoint_dir / "tokenizer.model", checkpoint_dir / "tokenizer.json"
    tok: Tokenizer
    if model_file.is_file():
        if _is_tiktoken_file(model_file):
            tok = BPETokenizer.from_tiktoken_file(model_file)
        else:
            try:
                tok = SentencePieceTokenizer(model_file)
            except (RuntimeError, OSError) as e:  # sentencepiece raises RuntimeError on a bad proto
                raise ValueError(f"{model_file} is neither a sentencepiece model nor a tiktoken file: {e}") from None
    elif json_file.is_file():
        tok = BPETokenizer.from_hf_json(json_file)
    else:
        raise ValueError(f"no tokenizer in {checkpoint_dir}: expected tokenizer.model or tokenizer.json")
    tok._apply_config(checkpoint_dir)
    return tok


# ---------------------------------------------------------------------------------------------
# Files for the converter
# ---------------------------------------------------------------------------------------------

# tokenizer.ggml.token_type values: sentencepiece's ModelProto.SentencePiece.Type, which llama.cpp reuses.
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = 1, 2, 3, 4, 5, 6

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split_then_byte_level(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "use_regex": False}]}


# tokenizer.ggml.pre -> HF pre_tokenizer (the splits llama.cpp applies for that name).
GGUF_PRE_TOKENIZERS = {
    "gpt2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "starcoder": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": _split_then_byte_level(LLAMA3_PATTERN),
    "qwen2": _split_then_byte_level(QWEN2_PATTERN),
}
# tokenizer.ggml.pre -> HF normalizer. Qwen2's own tokenizer.json applies NFC first; llama.cpp and
# transformers' GGUF conversion skip it (the same ids on NFC text, which is nearly all text).
GGUF_NORMALIZERS = {"qwen2": {"type": "NFC"}}


def write_tokenizer_from_gguf(reader: "gguf.GGUFReader", out_dir: Path) -> None:
    """Write the tokenizer files of a GGUF file's metadata into out_dir (see the module doc):
    tokenizer.ggml.model "gpt2" (with a tokenizer.ggml.pre of GGUF_PRE_TOKENIZERS) or "llama".
    Anything else raises ValueError, before any file is written."""
    def field(name: str, default=None):
        f = reader.fields.get(name)
        return f.contents() if f is not None else default

    kind = field("tokenizer.ggml.model")
    if kind == "gpt2":
        files = _byte_level_bpe_files(field)
    elif kind == "llama":
        files = _sentencepiece_files(field)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported "
                         "(only 'gpt2' byte-level BPE and 'llama' sentencepiece)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out_dir / name).write_bytes(data)


def _gguf_config(field, tokens: list[str], add_bos_default: bool) -> bytes:
    """tokenizer_config.json: bos/eos, add_bos_token, the chat template."""
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    config = {"bos_token": tokens[bos] if bos is not None else None,
              "eos_token": tokens[eos] if eos is not None else None,
              "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", add_bos_default))}
    if field("tokenizer.chat_template") is not None:
        config["chat_template"] = field("tokenizer.chat_template")
    return json.dumps(config, ensure_ascii=False, indent=2).encode()


def _byte_level_bpe_files(field) -> dict[str, bytes]:
    """tokenizer.json (HF byte-level BPE) + tokenizer_config.json."""
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(GGUF_PRE_TOKENIZERS)})")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [GGUF_NORMAL] * len(tokens))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": k == GGUF_CONTROL} for i, (t, k) in enumerate(zip(tokens, types))
             if k in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": GGUF_NORMALIZERS.get(pre), "pre_tokenizer": GGUF_PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre == "llama-bpe",  # as in Llama 3's own tokenizer.json
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in field("tokenizer.ggml.merges", [])]},
    }
    return {"tokenizer.json": json.dumps(tokenizer_json, ensure_ascii=False).encode(),
            "tokenizer_config.json": _gguf_config(field, tokens, add_bos_default=False)}


def _sentencepiece_files(field) -> dict[str, bytes]:
    """tokenizer.model (a sentencepiece BPE ModelProto) + tokenizer_config.json, from llama.cpp's SPM
    vocab: tokens, scores (merge priority: the pair making the best-scored piece merges first) and
    token types. llama.cpp adds BOS unless the file says otherwise, as transformers assumes too."""
    tokens: list[str] = field("tokenizer.ggml.tokens")
    scores: list[float] = field("tokenizer.ggml.scores")
    types: list[int] = field("tokenizer.ggml.token_type")
    if scores is None or types is None or not len(tokens) == len(scores) == len(types):
        raise ValueError("GGUF sentencepiece vocab needs tokenizer.ggml.tokens, .scores and .token_type of one length")
    add_prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    proto = sentencepiece_model_proto(tokens, scores, types, add_dummy_prefix=add_prefix,
                                      unk_id=field("tokenizer.ggml.unknown_token_id"),
                                      bos_id=field("tokenizer.ggml.bos_token_id"),
                                      eos_id=field("tokenizer.ggml.eos_token_id"),
                                      pad_id=field("tokenizer.ggml.padding_token_id"))
    try:  # never write a file sentencepiece would refuse
        import sentencepiece

        sentencepiece.SentencePieceProcessor(model_proto=proto)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece refuses the vocab of this GGUF: {e}") from None
    return {"tokenizer.model": proto, "tokenizer_config.json": _gguf_config(field, tokens, add_bos_default=True)}


def sentencepiece_model_proto(tokens: list[str], scores: list[float], types: list[int], add_dummy_prefix: bool,
                              unk_id: Optional[int], bos_id: Optional[int], eos_id: Optional[int],
                              pad_id: Optional[int]) -> bytes:
    """A serialized sentencepiece ModelProto (BPE, identity normalizer, spaces escaped as "▁", byte
    fallback when the vocab has the 256 <0xXX> pieces), as sentencepiece_model.proto lays it out.

    llama.cpp's converter writes the "▁" of user-defined pieces as plain spaces (Gemma's runs of
    spaces "▁▁"...); sentencepiece matches user-defined pieces after escaping, so they get their "▁"
    back. The unknown piece gets type UNKNOWN (Gemma's GGUF marks <unk> CONTROL)."""
    types = list(types)  # sentencepiece needs exactly one UNKNOWN piece
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == GGUF_UNKNOWN), None)
    if unk_id is None:
        raise ValueError("GGUF sentencepiece vocab has no unknown token")
    types[unk_id] = GGUF_UNKNOWN
    pieces = [t.replace(" ", "▁") if k == GGUF_USER_DEFINED else t for t, k in zip(tokens, types)]
    if len(set(pieces)) != len(pieces):
        raise ValueError("GGUF sentencepiece vocab has duplicate tokens")
    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    n_bytes = sum(1 for p, k in zip(pieces, types) if k == GGUF_BYTE and p in byte_pieces)
    if n_bytes not in (0, 256) or n_bytes != types.count(GGUF_BYTE):
        raise ValueError(f"GGUF sentencepiece vocab has {types.count(GGUF_BYTE)} byte tokens, "
                         "not the 256 <0x00>..<0xFF> that byte fallback needs")
    if any(k not in (GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE) for k in types):
        raise ValueError(f"GGUF sentencepiece vocab has unknown token types {sorted(set(types))}")

    proto = bytearray()
    for piece, score, kind in zip(pieces, scores, types):
        proto += _pb_bytes(1, _pb_bytes(1, piece.encode()) + _pb_float(2, score) + _pb_varint(3, kind))
    trainer = _pb_varint(3, 2) + _pb_varint(4, len(pieces)) + _pb_varint(35, n_bytes == 256)  # BPE, byte_fallback
    for number, token_id in ((40, unk_id), (41, bos_id), (42, eos_id), (43, pad_id)):  # unk/bos/eos/pad_id
        trainer += _pb_varint(number, -1 if token_id is None else token_id)
    for number, token_id in ((45, unk_id), (46, bos_id), (47, eos_id), (48, pad_id)):  # their pieces
        if token_id is not None:
            trainer += _pb_bytes(number, pieces[token_id].encode())
    # identity normalizer: name, add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces
    normalizer = _pb_bytes(1, b"identity") + _pb_varint(3, add_dummy_prefix) + _pb_varint(4, 0) + _pb_varint(5, 1)
    proto += _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)
    return bytes(proto)


def _pb_varint(number: int, value: int) -> bytes:
    """A protobuf varint field (int32, bool, enum); negative values as 10-byte two's complement."""
    return _varint(number << 3) + _varint(int(value) % (1 << 64))


def _pb_bytes(number: int, data: bytes) -> bytes:
    """A protobuf length-delimited field (string, bytes, message)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _pb_float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def copy_tokenizer_files(hf_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer files an HF model dir has (HF_FILES) into our checkpoint dir."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "tokenizer.model").is_file() and not (hf_dir / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer in {hf_dir}: expected tokenizer.model or tokenizer.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def pattern_from_pre_tokenizer(pre: Optional[dict]) -> str:
    """The tiktoken regex equivalent to an HF byte-level pre_tokenizer; ValueError if we have none."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    steps = [{k: v for k, v in s.items() if k != "trim_offsets"} for s in steps if s]  # offsets only
    steps = [{"use_regex": True, **s} if s["type"] == "ByteLevel" else s for s in steps]  # old files omit it
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    if steps == [byte_level]:
        return GPT2_PATTERN
    if steps == [{"type": "Digits", "individual_digits": True}, byte_level]:
        return GPT2_DIGITS_PATTERN
    if (len(steps) == 2 and steps[0].get("type") == "Split" and "Regex" in steps[0].get("pattern", {})
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and steps[1] == {**byte_level, "use_regex": False}):
        return steps[0]["pattern"]["Regex"]
    raise ValueError(f"unsupported pre_tokenizer (only byte-level GPT-2 / Digits+GPT-2 / Split+ByteLevel): {_short(pre)}")


def render_chat_template(template: str, messages: list[dict], **special_tokens: str) -> str:
    """Render an HF chat template the way transformers does, with the assistant header added."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabs are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


_BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


def _byte_level_decode(token: str) -> Optional[bytes]:
    """'Ġhello' -> b' hello'; None if the token is not spelled in the byte alphabet."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return None


def _has_any_byte(text: str, byte_set: bytes) -> bool:
    data = text.encode("utf-8", errors="surrogatepass")
    return len(data.translate(None, byte_set)) != len(data)


@lru_cache(maxsize=8)
def _special_split_regex(tokens: tuple[str, ...]) -> re.Pattern:
    # Longest first, so that "<|a|>x" never wins over a longer token sharing its prefix.
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def _is_tiktoken_file(path: Path) -> bool:
    """True for tiktoken's "base64 rank" lines; a sentencepiece proto is binary (it starts with 0x0A)."""
    with open(path, "rb") as f:
        first = f.readline(4096)
    try:
        token, rank = first.split()
        base64.b64decode(token, validate=True)
        int(rank)
    except ValueError:  # also binascii.Error
        return False
    return True


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _template_bos(post_processor: Optional[dict]) -> Optional[str]:
    """The special token an HF post_processor puts first in a single sequence (Llama 3: BOS)."""
    if not post_processor:
        return None
    if post_processor.get("type") == "Sequence":
        return next(filter(None, map(_template_bos, post_processor.get("processors", []))), None)
    single = post_processor.get("single") if post_processor.get("type") == "TemplateProcessing" else None
    return single[0]["SpecialToken"]["id"] if single and "SpecialToken" in single[0] else None


def _chat_template(checkpoint_dir: Path, config: dict) -> Optional[str]:
    if (checkpoint_dir / "chat_template.jinja").is_file():
        return (checkpoint_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token) -> Optional[str]:
    """tokenizer_config.json writes a token as "<s>" or as {"content": "<s>", ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _short(obj) -> str:
    text = json.dumps(obj, ensure_ascii=False)
    return text if len(text) < 300 else text[:300] + "..."
