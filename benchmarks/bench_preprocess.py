#!/usr/bin/env python
"""Preprocessing throughput against the tokenizer alone, and GPT index build time.

    python benchmarks/bench_preprocess.py [--size-mb 50] [--vocab-size 8000]

Generates a JSON Lines corpus of at least --size-mb MB (stdlib sources cut into documents) in a
temporary directory, trains a SentencePiece BPE model on part of it with tools/train_tokenizer.py,
then for SentencePiece and the byte tokenizer measures, in the same run:
  raw       tokenizer.tokenize() over the already-parsed texts (no JSON, no I/O, no output)
  pipeline  tools/preprocess_data.py end to end (read, JSON parse, tokenize, write .bin/.idx) with
            1 and 2 workers
MB/s are of JSON Lines input; each figure is the best of --repeats runs (shared machines are noisy).
Overhead = pipeline time with 1 worker / raw time - 1 (target <= 25%).
Then times the GPT dataset index build (document, sample and shuffle indices) for 1M documents.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import sysconfig
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_lite.data.gpt_dataset import GPTDataset, SampleOptions, build_indices  # noqa: E402
from megatron_lite.data.indexed_dataset import IndexedDataset, write_index  # noqa: E402
from megatron_lite.data.tokenizers import build_tokenizer  # noqa: E402
from tools import preprocess_data, train_tokenizer  # noqa: E402


def make_corpus(path: str, size_mb: float, seed: int = 0) -> int:
    """Documents of 1-16 KB cut from the stdlib's sources, cycled until the file is big enough."""
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    blob = "\n".join(texts)
    rng = np.random.default_rng(seed)
    written, target = 0, int(size_mb * 1e6)
    with open(path, "w") as f:
        while written < target:
            start = int(rng.integers(0, len(blob) - 20000))
            doc = blob[start:start + int(rng.integers(1000, 16000))]
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line.encode())
    return written


def time_raw(tokenizer, texts) -> float:
    t = time.perf_counter()
    for text in texts:
        tokenizer.tokenize(text)
    return time.perf_counter() - t


def time_pipeline(corpus: str, out: str, workers: int, tok_args) -> float:
    args = preprocess_data.get_args(["--input", corpus, "--output-prefix", out, "--workers", str(workers),
                                     "--append-eod", "--quiet", *tok_args])
    t = time.perf_counter()
    preprocess_data.run(args)
    return time.perf_counter() - t


def bench_tokenizers(tmp: str, size_mb: float, vocab_size: int, repeats: int) -> None:
    corpus = os.path.join(tmp, "corpus.jsonl")
    nbytes = make_corpus(corpus, size_mb)
    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    mb = nbytes / 1e6
    print(f"corpus: {mb:.1f} MB of JSON Lines, {len(texts)} documents")
    sample = os.path.join(tmp, "sample.jsonl")
    with open(corpus) as f, open(sample, "w") as g:
        for _, line in zip(range(len(texts) // 10), f):
            g.write(line)
    t = time.perf_counter()
    model = train_tokenizer.train([sample], os.path.join(tmp, "sp"), vocab_size=vocab_size,
                                  input_sentence_size=300_000)
    print(f"trained SentencePiece BPE, vocab {vocab_size}, on {os.path.getsize(sample) / 1e6:.1f} MB "
          f"in {time.perf_counter() - t:.1f} s")
    print(f"{'tokenizer':<24}{'raw MB/s':>10}{'1 worker':>10}{'2 workers':>11}{'overhead(1w)':>14}"
          f"{'speedup(2w)':>13}")
    for name, tok_args in (("SentencePieceTokenizer", ["--tokenizer-type", "SentencePieceTokenizer",
                                                       "--tokenizer-model", model]),
                           ("ByteTokenizer", ["--tokenizer-type", "ByteTokenizer"])):
        tok = build_tokenizer(name, tokenizer_model=model)
        raw, one, two = float("inf"), float("inf"), float("inf")
        for _ in range(repeats):  # interleaved, so a noisy spell hits all three alike
            raw = min(raw, time_raw(tok, texts))
            one = min(one, time_pipeline(corpus, os.path.join(tmp, f"{name}1"), 1, tok_args))
            two = min(two, time_pipeline(corpus, os.path.join(tmp, f"{name}2"), 2, tok_args))
        print(f"{name:<24}{mb / raw:>10.1f}{mb / one:>10.1f}{mb / two:>11.1f}{one / raw - 1:>13.0%}"
              f"{one / two:>12.2f}x")


def bench_index(tmp: str, num_docs: int = 1_000_000, seq_length: int = 2048, num_samples: int = 1_000_000) -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, num_docs)
    t = time.perf_counter()
    idx = build_indices(sizes, seq_length, num_samples, 1234)
    pure = time.perf_counter() - t
    prefix = os.path.join(tmp, "index_bench")
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(num_docs + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum()) * 2)  # sparse: the index build never reads tokens
    ds = IndexedDataset(prefix)
    cache = os.path.join(tmp, "cache")
    t = time.perf_counter()
    GPTDataset(ds, (0, num_docs), num_samples, seq_length, 1234, SampleOptions(eod=0), cache)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    d = GPTDataset(ds, (0, num_docs), num_samples, seq_length, 1234, SampleOptions(eod=0), cache)
    warm = time.perf_counter() - t
    assert not d.built_indices
    print(f"index build, {num_docs} documents ({sizes.sum() / 1e6:.0f}M tokens), seq {seq_length}, "
          f"{num_samples} samples ({len(idx['document_index']) // num_docs} epochs): build_indices {pure:.2f} s, "
          f"GPTDataset cold (build + cache write) {cold:.2f} s, warm (cache load) {warm:.3f} s (target < 10 s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=50)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        bench_tokenizers(tmp, args.size_mb, args.vocab_size, args.repeats)
        bench_index(tmp)


if __name__ == "__main__":
    main()
