"""ml-to-hf's tokenizers: every tokenizer type a HF fast tokenizer can express is written as one that,
saved and loaded back with AutoTokenizer, gives our ids on any text and decodes them to our text."""
from __future__ import annotations

import base64
import json

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from models.hf_tokenizers import hf_tokenizer
from test_data_tokenizers import MERGES, NUM_SPECIAL, TEXTS, corpus

MORE = TEXTS + ["  two  spaces", "line\nbreak\ttab", "▁x", " ", "", "hello world the World </s> <s>x <unk>",
                "ünïcödé ✓ 日本語"]


def _round_trip(data, tmp_path):
    """Our tokenizer and the HF one of `data`, saved and loaded back as a user would load it."""
    from transformers import AutoTokenizer

    hf, why = hf_tokenizer(data)
    assert hf is not None, why
    hf.save_pretrained(tmp_path / "hf")
    ours = build_tokenizer(**data)
    return ours, AutoTokenizer.from_pretrained(tmp_path / "hf")


def _assert_same(ours, hf):
    assert hf.eos_token_id == ours.eod
    for text in MORE:
        ids = ours.tokenize(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids) == ours.detokenize(ids), text


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_models_are_written_with_their_ids(tmp_path, model_type):
    from tools.train_tokenizer import train
    src = tmp_path / "c.txt"
    src.write_text("\n".join(corpus()[:8] + TEXTS))  # (a few source files: enough for 400 pieces, quick to train)
    model = train([str(src)], str(tmp_path / "m"), vocab_size=400, model_type=model_type)
    ours, hf = _round_trip({"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model}, tmp_path)
    assert len(hf) == ours.vocab_size
    _assert_same(ours, hf)


@pytest.mark.parametrize("legacy", [False, True])
def test_tiktoken_is_written_with_megatrons_ids(tmp_path, legacy):
    tokens = [bytes([i]) for i in range(256)] + MERGES
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                  "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]))
    data = {"tokenizer_type": "TikTokenizer", "tokenizer_model": str(vocab), "vocab_size": NUM_SPECIAL + len(tokens),
            "tiktoken_num_special_tokens": NUM_SPECIAL, "legacy_tokenizer": legacy,
            "tiktoken_pattern": "v1" if legacy else "v2"}
    ours, hf = _round_trip(data, tmp_path)
    _assert_same(ours, hf)
    special = hf("a </s>")["input_ids"]  # the default tokenizer reads "</s>" as its id, the legacy one as text
    assert (ours.eod in special) == (not legacy) and special == ours.tokenize("a </s>")


def test_null_tokenizer_has_no_hf_tokenizer():
    hf, why = hf_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 100})
    assert hf is None and "NullTokenizer is not written as a HF tokenizer" in why
