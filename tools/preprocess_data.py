#!/usr/bin/env python
"""Tokenize JSON Lines into Megatron-LM's indexed dataset format (`.bin` + `.idx`).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --json-keys text --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 8

writes data/corpus_text_document.bin/.idx (`_sentence` with --split-sentences), byte-compatible
with Megatron-LM's tools/preprocess_data.py. Bad lines (malformed JSON, a missing key, an empty
document) are skipped and counted; --strict stops at the first one instead.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype  # noqa: E402
from megatron_lite.data.tokenizers import ByteTokenizer, build_tokenizer  # noqa: E402

CHUNK_BYTES = 1 << 20  # lines are handed to workers in ~1 MB chunks
PROGRESS_MIN_BYTES = 8 << 20  # inputs smaller than this finish before a bar would help
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+")


def split_sentences(text: str) -> List[str]:
    """Cut after sentence-final punctuation; whitespace stays with the sentence before it, so the
    sentences concatenate back to the text exactly."""
    out, pos = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[pos:m.end()])
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


@dataclass
class KeyResult:
    """One chunk's documents for one JSON key: tokens back to back and their layout."""
    arrays: List[np.ndarray] = field(default_factory=list)
    lists: List[List[int]] = field(default_factory=list)
    seq_lengths: List[int] = field(default_factory=list)
    seqs_per_doc: List[int] = field(default_factory=list)

    def tokens(self, dtype) -> np.ndarray:
        n = sum(self.seq_lengths)
        if self.lists:
            return np.fromiter(itertools.chain.from_iterable(self.lists), dtype=dtype, count=n)
        return np.concatenate(self.arrays).astype(dtype, copy=False) if self.arrays else np.zeros(0, dtype)


@dataclass
class ChunkResult:
    docs: Dict[str, KeyResult]
    skipped: Counter
    first_problem: Optional[Tuple[int, str]]  # (line number, reason) of the first skipped line
    num_bytes: int
    num_lines: int


class Encoder:
    """Turns chunks of raw JSON lines into token arrays; one per process."""

    def __init__(self, args):
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.split = args.split_sentences
        self.tokenizer = make_tokenizer(args)
        self.eod = self.tokenizer.eod
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        fast = isinstance(self.tokenizer, ByteTokenizer)  # bytes are the tokens: stay in numpy
        self._encode = self.tokenizer.tokenize_array if fast else self.tokenizer.tokenize
        self._as_arrays = fast

    def encode_document(self, text: str) -> List:
        pieces = split_sentences(text) if self.split else [text]
        seqs = [s for s in (self._encode(p) for p in pieces) if len(s)]
        if seqs and self.append_eod:
            eod = np.array([self.eod], dtype=self.dtype) if self._as_arrays else [self.eod]
            seqs[-1] = np.concatenate([seqs[-1], eod]) if self._as_arrays else seqs[-1] + eod
        return seqs

    def encode_chunk(self, chunk: Tuple[int, List[bytes]]) -> ChunkResult:
        first_line, lines = chunk
        docs = {k: KeyResult() for k in self.keys}
        skipped, first_problem = Counter(), None
        for lineno, raw in enumerate(lines, start=first_line):
            problems = self._encode_line(raw, docs)
            for reason in problems:
                skipped[reason] += 1
                if first_problem is None:
                    first_problem = (lineno, reason)
        return ChunkResult(docs, skipped, first_problem, sum(len(x) for x in lines), len(lines))

    def _encode_line(self, raw: bytes, docs: Dict[str, KeyResult]) -> List[str]:
        if not raw.strip():
            return ["blank line"]
        try:
            obj = json.loads(raw)
        except ValueError:
            return ["malformed JSON"]
        if not isinstance(obj, dict):
            return ["malformed JSON"]
        problems = []
        for key in self.keys:
            if key not in obj:
                problems.append(f"missing key '{key}'")
                continue
            text = obj[key]
            if not isinstance(text, str):
                problems.append(f"'{key}' is not a string")
                continue
            try:
                seqs = self.encode_document(text)
            except UnicodeEncodeError:  # e.g. a lone surrogate escape ("\ud800") from a web scrape
                problems.append(f"'{key}' is not valid Unicode")
                continue
            if not seqs:
                problems.append(f"empty document ('{key}')")
                continue
            out = docs[key]
            (out.arrays if self._as_arrays else out.lists).extend(seqs)
            out.seq_lengths.extend(len(s) for s in seqs)
            out.seqs_per_doc.append(len(seqs))
        return problems


_WORKER = {}  # in each pool worker process: its Encoder, made once by the pool's initializer


def _init_worker(args) -> None:
    _WORKER["encoder"] = Encoder(args)


def _encode_in_worker(chunk):
    return _WORKER["encoder"].encode_chunk(chunk)


def read_chunks(path: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Tuple[int, List[bytes]]]:
    """(first line number, raw lines) in chunks of about chunk_bytes."""
    lineno = 1
    with open(path, "rb") as f:
        while True:
            lines = f.readlines(chunk_bytes)
            if not lines:
                return
            yield lineno, lines
            lineno += len(lines)


def make_tokenizer(args):
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)


def output_prefix(args, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


class Progress:
    """A tqdm bar over input bytes (MB/s and ETA) with docs/s, for inputs big enough to need it."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.bar, self.docs, self.t0 = None, 0, time.time()
        if enabled and total_bytes >= PROGRESS_MIN_BYTES:
            from tqdm import tqdm
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True,
                            desc="preprocess", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, num_bytes: int, num_docs: int) -> None:
        self.docs += num_docs
        if self.bar is not None:
            self.bar.update(num_bytes)
            self.bar.set_postfix(docs_per_s=f"{self.docs / max(time.time() - self.t0, 1e-9):.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args) -> dict:
    """Preprocess args.input; returns the summary figures. Raises ConfigError on --strict problems."""
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input}: no such file")
    encoder = Encoder(args)  # also checks the tokenizer flags before any worker starts
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
        writers = {k: IndexedDatasetWriter(output_prefix(args, k), encoder.dtype) for k in args.json_keys}
    except OSError as e:
        raise ConfigError(f"--output-prefix {args.output_prefix}: cannot write there ({e.strerror}: "
                          f"{e.filename}); give a writable location") from None
    total_bytes = os.path.getsize(args.input)
    progress = Progress(total_bytes, not args.quiet)
    skipped, first_problem, lines, t0 = Counter(), None, 0, time.time()
    pool = None
    try:
        if args.workers > 1:
            ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(args,))
            results = pool.imap(_encode_in_worker, read_chunks(args.input), chunksize=1)
        else:
            results = map(encoder.encode_chunk, read_chunks(args.input))
        for res in results:
            if res.first_problem and first_problem is None:
                first_problem = (res.first_problem[0], res.first_problem[1])
                if args.strict:
                    raise ConfigError(f"{args.input}:{first_problem[0]}: {first_problem[1]} (--strict)")
            skipped.update(res.skipped)
            lines += res.num_lines
            for key, kr in res.docs.items():
                if kr.seq_lengths:
                    writers[key].add_documents(kr.tokens(encoder.dtype), np.asarray(kr.seq_lengths),
                                               np.asarray(kr.seqs_per_doc))
            progress.update(res.num_bytes, len(next(iter(res.docs.values())).seqs_per_doc))
        for key, w in writers.items():
            if not w.num_documents:  # a wrong --json-keys (or a file of nothing usable): write nothing
                why = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items())) or "no lines"
                raise ConfigError(f"--json-keys {key}: no line of {args.input} gives a document for it ({why}); "
                                  f"nothing written: name a key the lines have")
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    return {"seconds": time.time() - t0, "bytes": total_bytes, "lines": lines, "skipped": skipped,
            "first_problem": first_problem, "dtype": np.dtype(encoder.dtype).name,
            "tokenizer": encoder.tokenizer, "writers": writers}


def format_summary(args, s: dict) -> str:
    secs = max(s["seconds"], 1e-9)
    docs = {k: w.num_documents for k, w in s["writers"].items()}
    lines = [f"preprocess_data: {args.input} -> {s['lines']} lines in {s['seconds']:.2f} s "
             f"({s['bytes'] / secs / 1e6:.1f} MB/s, {max(docs.values()) / secs:.0f} docs/s, "
             f"{args.workers} worker{'s' if args.workers > 1 else ''})"]
    tok = s["tokenizer"]
    for key, w in s["writers"].items():
        lines.append(f"  {key}: {w.num_documents} documents, {w.num_tokens} tokens ({s['dtype']}, "
                     f"{tok.name} vocab {tok.vocab_size}) -> {w.prefix}.bin/.idx")
    total = sum(s["skipped"].values())
    if total:
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(s["skipped"].items()))
        line, reason = s["first_problem"]
        lines.append(f"  skipped: {total} ({why}); first at line {line} ({reason})")
    else:
        lines.append("  skipped: 0")
    return "\n".join(lines)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input and output")
    g.add_argument("--input", required=True, help="JSON Lines file")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one dataset each)")
    g.add_argument("--split-sentences", action="store_true", help="store each sentence as a sequence")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="ByteTokenizer",
                   help="ByteTokenizer | NullTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer | "
                        "GPT2BPETokenizer")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file or Hugging Face tokenizer directory")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        summary = run(args)
    except ConfigError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(args, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
