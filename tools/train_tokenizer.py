#!/usr/bin/env python
"""Train a SentencePiece BPE model whose decode(encode(text)) == text for any text.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 32000

writes tok.model and tok.vocab, for `--tokenizer-type SentencePieceTokenizer --tokenizer-model
tok.model`. Exact round trips come from identity normalization (no NFKC), kept whitespace runs,
no dummy leading space, byte fallback for unseen characters, and newline/tab as pieces of their
own. Input: JSON Lines (`--json-keys`) or plain text, by extension (.jsonl/.json) or `--format`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List

MAX_SENTENCE_BYTES = 1 << 14


def iter_texts(path: str, fmt: str, keys: List[str]) -> Iterator[str]:
    """Documents from a JSON Lines file (skipping bad lines) or lines of a text file."""
    jsonl = fmt == "jsonl" or (fmt == "auto" and path.endswith((".jsonl", ".json")))
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if not jsonl:
                yield line
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                for k in keys:
                    if isinstance(obj.get(k), str) and obj[k]:
                        yield obj[k]


def iter_sentences(paths: List[str], fmt: str, keys: List[str], max_bytes: int) -> Iterator[str]:
    """Training sentences: the documents' lines, cut to a length SentencePiece accepts, newlines kept."""
    for path in paths:
        for text in iter_texts(path, fmt, keys):
            for line in text.splitlines(keepends=True):
                while line:
                    piece, line = line[:max_bytes // 4], line[max_bytes // 4:]
                    yield piece


def train(paths: List[str], model_prefix: str, vocab_size: int, fmt: str = "auto", keys=("text",),
          input_sentence_size: int = 2_000_000, num_threads: int = None, model_type: str = "bpe") -> str:
    """Train and return the path of the .model file."""
    import sentencepiece as spm
    for p in paths:
        if not os.path.isfile(p):
            raise SystemExit(f"train_tokenizer: error: --input {p}: no such file")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    try:
        _train(spm, paths, model_prefix, vocab_size, fmt, keys, input_sentence_size, num_threads, model_type)
    except RuntimeError as e:  # e.g. "Vocabulary size too high": say it in one line
        raise SystemExit(f"train_tokenizer: error: {str(e).splitlines()[0]}") from None
    return model_prefix + ".model"


def _train(spm, paths, model_prefix, vocab_size, fmt, keys, input_sentence_size, num_threads, model_type):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_sentences(paths, fmt, list(keys), MAX_SENTENCE_BYTES),
        model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        byte_fallback=True, character_coverage=0.9995, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["\n", "\t"],
        max_sentence_length=MAX_SENTENCE_BYTES, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, num_threads=num_threads or os.cpu_count() or 1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSON Lines or text files")
    p.add_argument("--format", choices=["auto", "jsonl", "text"], default="auto")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sample at most this many sentences for training")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    model = train(args.input, args.model_prefix, args.vocab_size, args.format, args.json_keys,
                  args.input_sentence_size, args.num_threads, args.model_type)
    print(f"train_tokenizer: wrote {model} (vocab {args.vocab_size}, {args.model_type}, byte fallback)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
