"""The tokenizers behind --tokenizer-type, with independent oracles where one exists."""
import json
import os
import sysconfig

import pytest
import regex

from megatron_lite.errors import ConfigError
from megatron_lite.data.tokenizers import build_tokenizer

TEXTS = ["Hello world!  Two  spaces,\ttabs\nand newlines.", "ünïcödé 日本語 😀", " leading", "don't we'll 1234"]


def corpus():
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:30]
    return [open(os.path.join(root, f), encoding="utf-8").read() for f in names] + TEXTS


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer
    d = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_byte_tokenizer():
    tok = build_tokenizer("ByteTokenizer")
    assert (tok.vocab_size, tok.eod) == (257, 256)
    for t in TEXTS:
        assert tok.tokenize(t) == list(t.encode()) == tok.tokenize_array(t).tolist()
        assert tok.detokenize(tok.tokenize(t) + [tok.eod]) == t


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)  # Megatron-LM's convention
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


class ReferenceGPT2BPE:
    """GPT-2's byte-level BPE as published (byte-to-unicode map, pre-split regex, rank-ordered
    merges), written independently of the `tokenizers` library the implementation uses."""
    PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file, merge_file):
        self.encoder = json.load(open(vocab_file, encoding="utf-8"))
        lines = open(merge_file, encoding="utf-8").read().split("\n")
        merges = [tuple(m.split()) for m in lines if m and not m.startswith("#version")]
        self.ranks = {m: i for i, m in enumerate(merges)}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
        cs = bs[:]
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + len(cs) - 188)
        self.byte_map = {b: chr(c) for b, c in zip(bs, cs)}

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(parts[i], parts[i + 1]) for i in range(len(parts) - 1)]
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text):
        ids = []
        for piece in self.PAT.findall(text):
            word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[p] for p in self.bpe(word))
        return ids


def test_gpt2_bpe_matches_reference_implementation(gpt2_files):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    oracle = ReferenceGPT2BPE(vocab, merges)
    assert tok.vocab_size == len(oracle.encoder) and tok.eod == oracle.encoder["<|endoftext|>"]
    for t in TEXTS + corpus()[:8]:
        assert tok.tokenize(t) == oracle.encode(t)
        assert tok.detokenize(tok.tokenize(t)) == t


def test_huggingface_directory(tmp_path, gpt2_files):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    vocab, merges = gpt2_files
    inner = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)._tok
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>").save_pretrained(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.eod == raw.token_to_id("<|endoftext|>") and tok.vocab_size == raw.get_vocab_size()
    for t in TEXTS:
        assert tok.tokenize(t) == raw.encode(t).ids and tok.detokenize(tok.tokenize(t)) == t


def test_sentencepiece_aliases(tmp_path):
    from tools.train_tokenizer import train
    src = tmp_path / "c.txt"
    src.write_text("\n".join(corpus()))
    model = train([str(src)], str(tmp_path / "m"), vocab_size=800)
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = build_tokenizer(name, tokenizer_model=model)
        assert tok.vocab_size == 800 and tok.eod == 2
        assert all(tok.detokenize(tok.tokenize(t)) == t for t in TEXTS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tokenizer_type="Bogus"), "unknown"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nope.model"), "/nope.model: no such file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/v.json", merge_file="/m.txt"), "/v.json: no such file"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/no/dir"), "/no/dir: no such file"),
])
def test_bad_tokenizer_flags(kwargs, match):
    kind = kwargs.pop("tokenizer_type")
    with pytest.raises(ConfigError, match=match):
        build_tokenizer(kind, **kwargs)


def test_not_a_sentencepiece_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="bad.model: not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
