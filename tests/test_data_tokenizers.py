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


# --- TikTokenizer: Megatron-LM's vocabulary file, special ids, patterns -------------------------
import base64

from megatron_lite.data.tokenizers import TIKTOKEN_PATTERNS

MERGES = [b"th", b"he", b"the", b" the", b"or", b"ld", b"wor", b"world", b" world", b"ll", b"llo", b"hello",
          b"in", b"ing", b"Wor", b"World", b"aB"]
NUM_SPECIAL = 10


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    """A vocabulary in Megatron's (NeMo's) format: the 256 bytes, then merges, rank = position."""
    tokens = [bytes([i]) for i in range(256)] + MERGES
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
               for i, t in enumerate(tokens)]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries))
    return str(path)


def reference_tiktoken(text, pattern, vocab_size):
    """tiktoken's byte-pair encoding, written out: split with the pattern, then per piece merge the
    adjacent pair of lowest rank until none is in the vocabulary; ids shifted past the specials."""
    ranks = {t: i for i, t in enumerate([bytes([i]) for i in range(256)] + MERGES) if i < vocab_size - NUM_SPECIAL}
    ids = []
    for piece in regex.findall(TIKTOKEN_PATTERNS[pattern], text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids += [ranks[p] + NUM_SPECIAL for p in parts]
    return ids


def tiktok(path, **kw):
    kw.setdefault("vocab_size", NUM_SPECIAL + 256 + len(MERGES))
    return build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_num_special_tokens=NUM_SPECIAL, **kw)


def test_tiktoken_special_ids_as_megatron_assigns_them(tiktoken_file):
    tok = tiktok(tiktoken_file)
    assert tok.special_tokens == ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>",
                                  "<SPECIAL_7>", "<SPECIAL_8>", "<SPECIAL_9>"]
    assert (tok.unk, tok.bos, tok.eod, tok.vocab_size) == (0, 1, 2, 283)
    legacy = tiktok(tiktoken_file, tiktoken_pattern="v1", legacy_tokenizer=True)
    assert legacy.special_tokens[3:] == [f"<SPECIAL_{i}>" for i in range(3, 10)] and legacy.eod == 2
    custom = tiktok(tiktoken_file, tiktoken_special_tokens=["<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>",
                                                            "<sep>", "<|im_start|>"])
    assert (custom.bos, custom.eod, custom.unk) == (0, 1, 2) and custom.special_tokens[7] == "<|im_start|>"


def test_tiktoken_ids_by_hand_and_against_the_reference(tiktoken_file):
    tok = tiktok(tiktoken_file)
    # "hello" -> he, ll, llo, hello (rank 256 + 11); " world" -> or, ld, wor, world, " world" (256 + 8)
    assert tok.tokenize("hello world") == [NUM_SPECIAL + 256 + 11, NUM_SPECIAL + 256 + 8]
    for pattern in ("v1", "v2"):
        tok = tiktok(tiktoken_file, tiktoken_pattern=pattern)
        for text in TEXTS + ["the weather in the world", "HelloWorld thing", "x = 12345;\n\n  y"]:
            assert tok.tokenize(text) == reference_tiktoken(text, pattern, tok.vocab_size), (pattern, text)
            assert tok.detokenize(tok.tokenize(text)) == text
    # v1 keeps a run of letters in one piece, so "aB" merges; v2 splits before the capital
    a_b = NUM_SPECIAL + 256 + MERGES.index(b"aB")
    assert tiktok(tiktoken_file, tiktoken_pattern="v1").tokenize("aB") == [a_b]
    assert tiktok(tiktoken_file, tiktoken_pattern="v2").tokenize("aB") == [NUM_SPECIAL + ord("a"), NUM_SPECIAL + ord("B")]


def test_tiktoken_special_token_text_and_eod(tiktoken_file):
    core, legacy = tiktok(tiktoken_file), tiktok(tiktoken_file, tiktoken_pattern="v2", legacy_tokenizer=True)
    assert core.tokenize("the</s>") == core.tokenize("the") + [core.eod]  # Megatron-Core: allowed_special="all"
    assert core.eod not in legacy.tokenize("the</s>")  # legacy: encode_ordinary
    assert legacy.detokenize(legacy.tokenize("the</s>")) == "the</s>"
    assert core.detokenize(core.tokenize("hello") + [core.eod]) == "hello</s>"


def test_tiktoken_vocab_size_cuts_the_file(tiktoken_file):
    tok = tiktok(tiktoken_file, vocab_size=NUM_SPECIAL + 256 + 2)  # only "th" and "he" remain
    ids = tok.tokenize("the hello")
    assert max(ids) < tok.vocab_size and ids == reference_tiktoken("the hello", "v2", tok.vocab_size)
    assert tok.detokenize(ids) == "the hello"


@pytest.mark.parametrize("kw,match", [
    (dict(tiktoken_special_tokens=["<s>", "</s>"]), "must include"),
    (dict(tiktoken_pattern="v3"), "v1 or v2"),
    (dict(vocab_size=NUM_SPECIAL + 1000), "has 273 tokens"),
    (dict(tiktoken_special_tokens=["<unk>", "<unk>"]), "unique"),
])
def test_bad_tiktoken_flags(tiktoken_file, kw, match):
    with pytest.raises(ConfigError, match=match):
        tiktok(tiktoken_file, **kw)


def test_bad_tiktoken_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 0, "token_bytes": base64.b64encode(b"a").decode(), "token_str": "a"}]))
    with pytest.raises(ConfigError, match="single byte"):
        tiktok(str(bad))
