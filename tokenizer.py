"""Tokenizers for the checkpoints we run: one interface, three kinds of files.

    load_tokenizer(dir) picks the kind from the files in a checkpoint dir:
      tokenizer.model, a sentencepiece ModelProto  -> SentencePieceTokenizer (Llama 2, Mistral)
      tokenizer.model, base64-token + rank lines   -> BPETokenizer.from_tiktoken_file (Llama 3)
      tokenizer.json, HF byte-level BPE            -> BPETokenizer.from_hf_json (SmolLM2, GPT-2 style)
    next to tokenizer_config.json / special_tokens_map.json / generation_config.json /
    chat_template.jinja when present (bos/eos, add_bos_token, chat template, stop ids).

Both BPE kinds run on tiktoken. For an HF tokenizer.json the merge list becomes tiktoken ranks
(rank = position of the first merge producing a token), so tiktoken's "merge the adjacent pair
whose concatenation has the lowest rank" replays HF's merge order; ranks map back to HF ids.
tiktoken also returns a pre-token whole when it is a token, as HF does with ignore_merges=true
(Llama 3); with ignore_merges=false that agrees as long as each token's own merges rebuild it,
which holds for every token of SmolLM2 (the tests compare with HF on all essays).

The converter calls write_tokenizer_from_gguf (GGUF -> tokenizer.json + tokenizer_config.json)
or copy_tokenizer_files (HF model dir -> checkpoint dir).
"""
from __future__ import annotations

import base64
import json
import re
import shutil
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
        if self.chat_template is None:
            raise ValueError("chat=True, but this tokenizer has no chat template "
                             "(none in tokenizer_config.json or chat_template.jinja)")
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": text})
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
        # Each call adds sentencepiece's dummy "▁" prefix, also to each piece between special tokens
        # in encode_with_special_tokens: that is Meta's Llama 2 chat encoding (HF's legacy=True).
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class BPETokenizer(Tokenizer):
    """Byte-level BPE run by tiktoken: Llama 3 tokenizer.model files and HF byte-level tokenizer.json."""

    def __init__(self, ranks: dict[bytes, int], rank_to_id: Optional[list[int]], pattern: str,
                 special_tokens: dict[str, int], id_to_bytes: dict[int, bytes]):
        """ranks: token bytes -> tiktoken rank (merge priority); rank_to_id: rank -> model id (None:
        ranks are the ids); special_tokens: text -> id; id_to_bytes: id -> bytes for decoding."""
        import regex
        import tiktoken

        self.enc = tiktoken.Encoding("bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self.rank_to_id = rank_to_id
        self.special_tokens = special_tokens
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
        if tj.get("normalizer") is not None:
            raise ValueError(f"{path}: normalizers are not supported: {_short(tj['normalizer'])}")
        pattern = pattern_from_pre_tokenizer(tj.get("pre_tokenizer"))
        vocab: dict[str, int] = model["vocab"]
        specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
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
        tok = cls(ranks, rank_to_id, pattern, specials, id_to_bytes)
        bos = _template_bos(tj.get("post_processor"))
        if bos in specials:
            tok.bos_id, tok.add_bos = specials[bos], True
        return tok

    def encode(self, text: str) -> list[int]:
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

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# tokenizer.ggml.pre -> HF pre_tokenizer (the splits llama.cpp applies for that name).
GGUF_PRE_TOKENIZERS = {
    "gpt2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "starcoder": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "use_regex": False}]},
}


def write_tokenizer_from_gguf(reader: "gguf.GGUFReader", out_dir: Path) -> None:
    """Write tokenizer.json (HF byte-level BPE) + tokenizer_config.json from a GGUF file's metadata.

    Only tokenizer.ggml.model == "gpt2" (byte-level BPE) with a tokenizer.ggml.pre listed in
    GGUF_PRE_TOKENIZERS is supported; anything else raises ValueError."""
    def field(name: str, default=None):
        f = reader.fields.get(name)
        return f.contents() if f is not None else default

    kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(GGUF_PRE_TOKENIZERS)})")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": k == GGUF_CONTROL} for i, (t, k) in enumerate(zip(tokens, types))
             if k in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": GGUF_PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre == "llama-bpe",  # as in Llama 3's own tokenizer.json
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in field("tokenizer.ggml.merges", [])]},
    }
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    config = {"bos_token": tokens[bos] if bos is not None else None,
              "eos_token": tokens[eos] if eos is not None else None,
              "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False))}
    if field("tokenizer.chat_template") is not None:
        config["chat_template"] = field("tokenizer.chat_template")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


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
