"""Tokenizers under Megatron-LM's `--tokenizer-type` names, behind one small interface.

Every tokenizer has `.name`, `.vocab_size` (the true vocabulary, unpadded), `.eod`,
`.tokenize(text) -> list[int]`, `.detokenize(ids) -> str`, `.fingerprint` (identifies the exact
vocabulary, for cache keys) and `.tokenize_array(text) -> np.ndarray` (the preprocessing fast path).
Heavy libraries (sentencepiece, tokenizers, transformers, tiktoken) are imported only when asked for.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from megatron_lite.errors import ConfigError


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _dir_digest(path: str) -> str:
    """Digest of a tokenizer directory: small files by content, big ones (weights that happen to
    sit beside the tokenizer) by name, size and mtime, so this stays cheap."""
    if not os.path.isdir(path):
        return _file_digest(path)
    parts = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            st = os.stat(full)
            parts.append(f"{name}:{_file_digest(full) if st.st_size < 64 << 20 else (st.st_size, st.st_mtime_ns)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _need_file(path: Optional[str], flag: str, kind: str) -> str:
    if not path:
        raise ConfigError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise ConfigError(f"{flag} {path}: no such file or directory")
    return path


class _Tokenizer:
    name = "base"
    vocab_size: int
    eod: int
    fingerprint: str

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def tokenize_array(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenize(text), dtype=np.int64)

    def __repr__(self) -> str:
        return f"{self.name}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(_Tokenizer):
    """UTF-8 bytes as tokens 0..255, end-of-document 256: needs no file, loses nothing."""
    name = "ByteTokenizer"
    vocab_size = 257
    eod = 256
    fingerprint = "ByteTokenizer"

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def tokenize_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(_Tokenizer):
    """Text is space-separated token ids (Megatron's mock-data tokenizer). As in Megatron-LM,
    `--vocab-size N` means ids 0..N-1 plus the end-of-document id N: vocab_size N + 1."""
    name = "NullTokenizer"

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)
        self.fingerprint = f"NullTokenizer:{self.vocab_size}"

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(_Tokenizer):
    """A SentencePiece model; eod is the model's </s> (as Megatron's GPTSentencePieceTokenizer)."""
    name = "SentencePieceTokenizer"

    def __init__(self, model_file: Optional[str]):
        path = _need_file(model_file, "--tokenizer-model", self.name)
        import sentencepiece as spm
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"--tokenizer-model {path}: not a SentencePiece model ({str(e).splitlines()[0]})")
        self.vocab_size = int(self._sp.vocab_size())
        self.eod = int(self._sp.eos_id())
        if self.eod < 0:
            raise ConfigError(f"--tokenizer-model {path}: the model has no end-of-sequence piece (eos_id=-1)")
        self.fingerprint = f"{self.name}:{_file_digest(path)}"
        self._encode = self._sp.encode

    def tokenize(self, text: str) -> List[int]:
        return self._encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class GPT2BPETokenizer(_Tokenizer):
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (tokenizers' BPE model)."""
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]):
        vocab = _need_file(vocab_file, "--vocab-file", self.name)
        merges = _need_file(merge_file, "--merge-file", self.name)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        try:
            tok = Tokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:  # tokenizers raises its own exception type for bad files
            raise ConfigError(f"--vocab-file {vocab} / --merge-file {merges}: cannot load GPT-2 BPE ({e})")
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        eod = tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise ConfigError(f"--vocab-file {vocab}: has no <|endoftext|> token to use as end of document")
        self.eod = int(eod)
        self.fingerprint = f"{self.name}:{_file_digest(vocab)}:{_file_digest(merges)}"

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_Tokenizer):
    """A tokenizer saved in a local directory, loaded with transformers' AutoTokenizer (or the
    directory's tokenizer.json through `tokenizers` when transformers is absent). As in Megatron,
    tokenize() adds the tokenizer's own special tokens (e.g. Llama's BOS)."""
    name = "HuggingFaceTokenizer"

    def __init__(self, path: Optional[str]):
        path = _need_file(path, "--tokenizer-model", self.name)
        self._tok = self._load(path)
        eod = self._tok.eos_token_id
        if eod is None:
            eod = self._tok.convert_tokens_to_ids("<|endoftext|>")
        if eod is None:
            raise ConfigError(f"--tokenizer-model {path}: tokenizer has no eos token to use as end of document")
        self.eod = int(eod)
        self.vocab_size = len(self._tok)
        self.fingerprint = f"{self.name}:{_dir_digest(path)}"

    @staticmethod
    def _load(path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return _TokenizersFile(path)
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types; all mean "not loadable"
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"--tokenizer-model {path}: cannot load a Hugging Face tokenizer ({msg})")

    def tokenize(self, text: str) -> List[int]:
        return self._tok(text)["input_ids"]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


class _TokenizersFile:
    """The slice of the transformers tokenizer API used above, over a bare tokenizer.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"--tokenizer-model {path}: no tokenizer.json (and transformers is not installed)")
        self._tok = Tokenizer.from_file(file)
        self.eos_token_id = self._tok.token_to_id("</s>")

    def convert_tokens_to_ids(self, token):
        return self._tok.token_to_id(token)

    def __len__(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, text):
        return {"input_ids": self._tok.encode(text).ids}

    def decode(self, ids):
        return self._tok.decode(ids)


# Megatron-LM's TikToken split patterns (--tiktoken-pattern v1 | v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Special tokens that must be among the first ids: Megatron-Core's TikTokenTokenizer (what
# pretrain_gpt.py builds by default) and the legacy CustomTikTokenizer (--legacy-tokenizer).
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_LEGACY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def load_tiktoken_ranks(path: str, max_vocab: int) -> Dict[bytes, int]:
    """A tiktoken vocabulary file as Megatron-LM reads it: a JSON list whose element i is
    {"rank": i, "token_bytes": base64, "token_str": ...}, the first 256 being the single bytes;
    only its first `max_vocab` entries are kept. Returns token bytes -> rank."""
    if not path.endswith(".json"):
        raise ConfigError(f"--tokenizer-model {path}: a TikToken vocabulary is a .json file")
    with open(path, "r", encoding="utf-8") as f:
        try:
            vocab = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--tokenizer-model {path}: not JSON ({e})")
    if not isinstance(vocab, list):
        raise ConfigError(f"--tokenizer-model {path}: expected a JSON list of tokens, got {type(vocab).__name__}")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:max_vocab]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise ConfigError(f"--tokenizer-model {path}: entry {i} must be {{'rank': {i}, 'token_bytes': ..., "
                              f"'token_str': ...}}, got {entry!r}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ConfigError(f"--tokenizer-model {path}: entry {i} must be the single byte {bytes([i])!r}")
        if token in ranks:
            raise ConfigError(f"--tokenizer-model {path}: entry {i} repeats the token {token!r}")
        ranks[token] = i
    return ranks


class TikTokenizer(_Tokenizer):
    """Megatron-LM's TikTokenizer: ids 0 .. num_special_tokens-1 are the special tokens (the given
    list, then <SPECIAL_i> fillers), the vocabulary file's ranks follow shifted by
    num_special_tokens, and the file is cut to vocab_size - num_special_tokens entries. eod is
    "</s>" (id 2 with the default lists).

    By default as Megatron-Core's TikTokenTokenizer (pretrain_gpt.py's default path): pattern v2
    unless given, seven required special tokens, and special-token text in the input encodes to
    its id. `legacy=True` is the --legacy-tokenizer CustomTikTokenizer: three required special
    tokens, and text is always encoded as plain text (encode_ordinary)."""
    name = "TikTokenizer"

    def __init__(self, path: Optional[str], pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[Sequence[str]] = None,
                 legacy: bool = False):
        path = _need_file(path, "--tokenizer-model", self.name)
        import tiktoken
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise ConfigError(f"--tiktoken-pattern {pattern}: choose v1 or v2")
        self.vocab_size = int(vocab_size) if vocab_size else 2 ** 17  # Megatron's default, 131072
        specials = _tiktoken_specials(special_tokens, num_special_tokens, self.vocab_size, legacy)
        inner = self.vocab_size - num_special_tokens
        ranks = load_tiktoken_ranks(path, inner)
        if len(ranks) < inner:
            raise ConfigError(f"--tokenizer-model {path} has {len(ranks)} tokens; a vocabulary of {self.vocab_size} "
                              f"with {num_special_tokens} special tokens needs {inner}: lower --vocab-size to "
                              f"{len(ranks) + num_special_tokens} or --tiktoken-num-special-tokens")
        self._enc = tiktoken.Encoding(name=f"megatron-lite:{os.path.basename(path)}", pat_str=TIKTOKEN_PATTERNS[pattern],
                                      mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
                                      special_tokens={t: i for i, t in enumerate(specials)})
        self.special_tokens, self.num_special_tokens, self.legacy = specials, num_special_tokens, legacy
        self.unk, self.bos, self.eod = specials.index("<unk>"), specials.index("<s>"), specials.index("</s>")
        self.fingerprint = (f"{self.name}:{_file_digest(path)}:{pattern}:{self.vocab_size}:"
                            + hashlib.sha256("\0".join(specials).encode()).hexdigest()[:16] + (":legacy" if legacy else ""))

    def tokenize(self, text: str) -> List[int]:
        if self.legacy:
            return self._enc.encode_ordinary(text)
        return self._enc.encode(text, allowed_special="all")

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def _tiktoken_specials(given: Optional[Sequence[str]], num: int, vocab_size: int, legacy: bool) -> List[str]:
    """The special tokens of ids 0 .. num-1, checked as Megatron checks them."""
    required = TIKTOKEN_LEGACY_SPECIAL_TOKENS if legacy else TIKTOKEN_SPECIAL_TOKENS
    specials = list(required if given is None else given)
    if len(set(specials)) != len(specials):
        raise ConfigError(f"--tiktoken-special-tokens must be unique: {specials}")
    if not len(specials) <= num < vocab_size:
        raise ConfigError(f"need {len(specials)} special tokens <= --tiktoken-num-special-tokens ({num}) < "
                          f"--vocab-size ({vocab_size})")
    missing = [t for t in required if t not in specials]
    if missing:
        raise ConfigError(f"--tiktoken-special-tokens must include {list(required)}; missing {missing}")
    return specials + [f"<SPECIAL_{i}>" for i in range(len(specials), num)]


# --tokenizer-type values -> the class that implements them
TOKENIZER_TYPES = {
    "ByteTokenizer": "ByteTokenizer",
    "NullTokenizer": "NullTokenizer",
    "SentencePieceTokenizer": "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
    "Llama2Tokenizer": "SentencePieceTokenizer",
    "HuggingFaceTokenizer": "HuggingFaceTokenizer",
    "GPT2BPETokenizer": "GPT2BPETokenizer",
    "TikTokenizer": "TikTokenizer",
}

# DataConfig fields read for --tokenizer-type TikTokenizer (when the config has them).
TIKTOKEN_FIELDS = ("tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens", "legacy_tokenizer")
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size") + TIKTOKEN_FIELDS


def build_tokenizer(tokenizer_type: str, *, tokenizer_model=None, vocab_file=None, merge_file=None,
                    vocab_size=None, tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
                    tiktoken_special_tokens=None, legacy_tokenizer=False):
    """Build the tokenizer Megatron-LM would build for `--tokenizer-type`."""
    kind = TOKENIZER_TYPES.get(tokenizer_type or "ByteTokenizer")
    if kind is None:
        raise ConfigError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens,
                            tiktoken_special_tokens, legacy=legacy_tokenizer)
    return HuggingFaceTokenizer(tokenizer_model)


def tokenizer_from_config(data_config):
    """build_tokenizer() from a `DataConfig`."""
    tiktoken_args = {k: getattr(data_config, k) for k in TIKTOKEN_FIELDS if hasattr(data_config, k)}
    return build_tokenizer(data_config.tokenizer_type, tokenizer_model=data_config.tokenizer_model,
                           vocab_file=data_config.vocab_file, merge_file=data_config.merge_file,
                           vocab_size=data_config.vocab_size, **tiktoken_args)
