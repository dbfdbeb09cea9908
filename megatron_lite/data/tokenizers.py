"""Tokenizers under Megatron-LM's `--tokenizer-type` names, behind one small interface.

Every tokenizer has `.name`, `.vocab_size` (the true vocabulary, unpadded), `.eod`,
`.tokenize(text) -> list[int]`, `.detokenize(ids) -> str`, `.fingerprint` (identifies the exact
vocabulary, for cache keys) and `.tokenize_array(text) -> np.ndarray` (the preprocessing fast path).
Heavy libraries (sentencepiece, tokenizers, transformers) are imported only when asked for.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, List, Optional

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


_ALIASES = {
    "ByteTokenizer": "ByteTokenizer",
    "NullTokenizer": "NullTokenizer",
    "SentencePieceTokenizer": "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
    "Llama2Tokenizer": "SentencePieceTokenizer",
    "HuggingFaceTokenizer": "HuggingFaceTokenizer",
    "GPT2BPETokenizer": "GPT2BPETokenizer",
}


def build_tokenizer(tokenizer_type: str, *, tokenizer_model=None, vocab_file=None, merge_file=None,
                    vocab_size=None):
    """Build the tokenizer Megatron-LM would build for `--tokenizer-type`."""
    kind = _ALIASES.get(tokenizer_type or "ByteTokenizer")
    if kind is None:
        raise ConfigError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(_ALIASES)}")
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    return HuggingFaceTokenizer(tokenizer_model)
