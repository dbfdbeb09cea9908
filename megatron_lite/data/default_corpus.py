"""The built-in corpus: the Python standard library's own source files.

Every Python install has them, so `pretrain_gpt.py` trains on real text with no download and no
flags. Files are taken in sorted order up to a size cap (deterministic for a given Python), each
one a document, tokenized once into a Megatron `.bin`/`.idx` under the cache directory. Ranks that
start together serialise on a lock file; the files appear atomically.
"""
from __future__ import annotations

import fcntl
import os
import sys
import sysconfig
import time
from typing import List, Tuple

import numpy as np

from megatron_lite.data.cache import DEFAULT_CACHE_ROOT, cache_key
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter, dataset_exists, optimal_dtype
from megatron_lite.data.tokenizers import ByteTokenizer

CAP_BYTES = 20 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(cap_bytes: int = CAP_BYTES) -> List[Tuple[str, int]]:
    """(relative path, size) of the stdlib's .py files in sorted order, up to cap_bytes in total."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    chosen, total = [], 0
    for rel in sorted(found):
        size = os.path.getsize(os.path.join(root, rel))
        if total + size > cap_bytes:
            break
        chosen.append((rel, size))
        total += size
    return chosen


def default_corpus_prefix(tokenizer, cache_root: str = None) -> str:
    """Path prefix of the built-in corpus for `tokenizer`, building it first if needed."""
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_sources()
    fingerprint = getattr(tokenizer, "fingerprint", f"{tokenizer.name}:{tokenizer.vocab_size}")
    key = cache_key({"corpus": "stdlib", "root": root, "python": sys.version, "files": files,
                     "tokenizer": fingerprint, "eod": tokenizer.eod, "cap": CAP_BYTES})
    directory = os.path.join(cache_root or DEFAULT_CACHE_ROOT, "default_corpus")
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, f"stdlib_{key[:16]}_text_document")
    if dataset_exists(prefix):
        return prefix
    with open(prefix + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait here, then find it built
        if not dataset_exists(prefix):
            _build(prefix, root, files, tokenizer)
    return prefix


def _build(prefix: str, root: str, files: List[Tuple[str, int]], tokenizer) -> None:
    t0 = time.time()
    writer = IndexedDatasetWriter(prefix, optimal_dtype(tokenizer.vocab_size))
    fast = isinstance(tokenizer, ByteTokenizer)
    eod = np.array([tokenizer.eod])
    try:
        for rel, _ in files:
            with open(os.path.join(root, rel), "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few test fixtures are deliberately not UTF-8
            if not text:
                continue
            if fast:  # UTF-8 bytes are the tokens: no Python-level loop
                tokens = np.frombuffer(raw, dtype=np.uint8)
            else:
                tokens = np.asarray(tokenizer.tokenize(text), dtype=np.int64)
            writer.add_document(np.concatenate([tokens.astype(writer.dtype), eod.astype(writer.dtype)]))
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    print(f"megatron_lite.data: built the default corpus ({writer.num_documents} stdlib files, "
          f"{writer.num_tokens} tokens, {tokenizer.name}) in {time.time() - t0:.1f} s -> {prefix}",
          file=sys.stderr)


def default_corpus_note(data_config, training_config):
    """The start-up note of a run that loads a checkpoint (a fine-tune, most likely) but names no
    data: it trains on the built-in corpus, which the user may not expect; None otherwise."""
    if data_config.data_path or data_config.mock_data or training_config.train_iters == 0:
        return None
    source = next((f"{flag} {path}" for flag, path in (("--load", training_config.load),
                                                       ("--pretrained-checkpoint", training_config.pretrained_checkpoint))
                   if path), None)
    if source is None:
        return None
    return (f"{source} without --data-path: training on the built-in corpus (the Python standard library's "
            f"source files); give --data-path PREFIX to train on your own data")
