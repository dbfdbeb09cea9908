"""From a `DataConfig` to the train / valid / test datasets.

`--data-path` takes Megatron-LM's forms: one prefix, or weight/prefix pairs. Each corpus is split
into train / valid / test by contiguous sequence ranges (`--split 969,30,1`), each split gets its
own GPTDataset, and several corpora are blended per split. Every file problem surfaces here as a
one-line `ConfigError`, before training starts.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_lite.errors import ConfigError
from megatron_lite.data.blended_dataset import BlendedDataset, samples_per_dataset
from megatron_lite.data.cache import corpus_identity, load_or_build, writable_dir
from megatron_lite.data.default_corpus import default_corpus_prefix
from megatron_lite.data.gpt_dataset import GPTDataset, MockGPTDataset, SampleOptions
from megatron_lite.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> List[Tuple[Optional[float], str]]:
    """Megatron's list -> [(weight or None, prefix)]. `[p]`, `[w1, p1, w2, p2, ...]` or `[p1, p2, ...]`."""
    items = [tok for entry in data_path for tok in str(entry).split()]
    if not items:
        raise ConfigError("--data-path is empty")
    if len(items) == 1:
        return [(None, items[0])]
    if all(_as_float(x) is None for x in items):
        return [(None, p) for p in items]  # unweighted list: blended by size
    if len(items) % 2:
        raise ConfigError(f"--data-path: weights and prefixes must come in pairs, got {len(items)} items "
                          f"({' '.join(items)})")
    pairs = []
    for w, p in zip(items[::2], items[1::2]):
        weight = _as_float(w)
        if weight is None:
            raise ConfigError(f"--data-path: expected a weight before {p}, got {w!r}")
        if weight < 0 or not np.isfinite(weight):
            raise ConfigError(f"--data-path: weight {w} of {p} must be a non-negative number")
        pairs.append((weight, p))
    if sum(w for w, _ in pairs) <= 0:
        raise ConfigError("--data-path: the weights sum to zero")
    return pairs


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> List[float]:
    """"969,30,1" (or "969/30/1", missing parts = 0) -> normalised train/valid/test fractions.
    Quotes around it (what a shell array hands over from `--split '99,1,0'`) are ignored."""
    parts = [p for p in str(split).strip("'\" ").replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to three numbers like 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(num_sequences: int, fractions: Sequence[float]) -> List[Tuple[int, int]]:
    """Contiguous [start, end) sequence ranges per split (Megatron's rounding rule)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_sequences)))
    excess = bounds[-1] - num_sequences
    bounds = [bounds[0]] + [min(max(b - excess, 0), num_sequences) for b in bounds[1:]]
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(3)]


def index_cache_dir(prefix: str, data_cache_path: Optional[str]) -> Optional[str]:
    preferred = data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    return writable_dir(os.path.join(preferred, "GPTDataset_indices"), "GPTDataset_indices")


def open_dataset(prefix: str, tokenizer, cache_dir: Optional[str]) -> IndexedDataset:
    """Open a corpus and check that its tokens can come from `tokenizer`."""
    ds = IndexedDataset(prefix)
    dtype, vocab = ds.dtype, int(tokenizer.vocab_size)
    if dtype.kind not in "iu":
        raise ConfigError(f"{ds.idx_file}: token dtype {dtype} is not an integer type")
    if np.iinfo(dtype).max < vocab - 1:
        raise ConfigError(f"{ds.idx_file}: {dtype} tokens cannot hold ids up to {vocab - 1}, but "
                          f"{tokenizer.name} has vocab {vocab}: the corpus was made with another tokenizer")
    if ds.num_tokens:
        lo, hi = token_range(ds, cache_dir)
        if hi >= vocab or lo < 0:
            bad = hi if hi >= vocab else lo
            raise ConfigError(f"{ds.bin_file}: token id {bad} is outside {tokenizer.name}'s vocab "
                              f"[0, {vocab}): the corpus was made with another tokenizer")
    return ds


def token_range(ds: IndexedDataset, cache_dir: Optional[str]) -> Tuple[int, int]:
    """(min, max) token id of the corpus: a full scan, cached per file version."""
    def scan():
        lo, hi, step, tokens = None, None, 1 << 26, ds.tokens
        for s in range(0, tokens.size, step):
            chunk = np.asarray(tokens[s:s + step])
            lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
            hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
        return {"range": np.array([lo, hi], dtype=np.int64)}
    desc = {"class": "TokenRange", "corpus": corpus_identity(ds)}
    arrays, _ = load_or_build(cache_dir, "TokenRange", desc, ("range",), scan)
    lo, hi = arrays["range"]
    return int(lo), int(hi)


def check_data_paths(data_config, tokenizer) -> None:
    """Open every --data-path corpus and check it against the tokenizer (ConfigError if bad), so a
    wrong path or file fails before any process group exists."""
    if data_config.mock_data or not data_config.data_path:
        return
    for _, prefix in parse_data_path(data_config.data_path):
        open_dataset(prefix, tokenizer, index_cache_dir(prefix, data_config.data_cache_path))


def build_train_valid_test_datasets(data_config, tokenizer, seq_length: int, seed: int,
                                    num_samples: Tuple[int, int, int]):
    """(train, valid, test): each a torch Dataset of at least the requested samples, or None when
    its split is empty. Mock data, `--data-path` corpora, or the built-in stdlib corpus."""
    if seq_length < 1:
        raise ConfigError(f"seq_length ({seq_length}) must be >= 1")
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples):
        raise ConfigError(f"num_samples must be three non-negative counts, got {num_samples}")
    fractions = parse_split(data_config.split)
    opts = SampleOptions(eod=int(tokenizer.eod), reset_position_ids=data_config.reset_position_ids,
                         reset_attention_mask=data_config.reset_attention_mask,
                         eod_mask_loss=data_config.eod_mask_loss)
    if data_config.mock_data:
        return tuple(MockGPTDataset(int(tokenizer.vocab_size), seq_length, int(n), seed, opts, i)
                     if fractions[i] > 0 else None for i, n in enumerate(num_samples))
    if data_config.data_path:
        blend = parse_data_path(data_config.data_path)
    else:
        blend = [(None, default_corpus_prefix(tokenizer, data_config.data_cache_path))]
    corpora = []
    for weight, prefix in blend:  # open and check every file before building anything
        cache_dir = index_cache_dir(prefix, data_config.data_cache_path)
        corpora.append((weight, open_dataset(prefix, tokenizer, cache_dir), cache_dir))
    return tuple(_build_split(corpora, i, fractions, int(num_samples[i]), seq_length, seed, opts,
                              data_config.data_cache_path) for i in range(3))


def _build_split(corpora, split: int, fractions, num_samples: int, seq_length: int, seed: int,
                 opts: SampleOptions, data_cache_path: Optional[str]):
    name = SPLIT_NAMES[split]
    parts = []  # (weight, indexed, range, cache_dir) of corpora with data in this split
    for weight, ds, cache_dir in corpora:
        start, end = split_ranges(len(ds), fractions)[split]
        tokens = int(ds.sequence_lengths[start:end].sum(dtype=np.int64))
        if weight == 0 or tokens == 0:
            continue
        if tokens < 2:
            if num_samples > 0:
                raise ConfigError(f"{ds.prefix}: the {name} split has {tokens} token; adjust --split or add data")
            continue
        parts.append((tokens if weight is None else weight, ds, (start, end), cache_dir))
    if not parts:
        if num_samples > 0 and fractions[split] > 0:
            raise ConfigError(f"the {name} split of --data-path is empty but {num_samples} samples are needed")
        return None
    if len(parts) == 1:
        _, ds, rng, cache_dir = parts[0]
        return GPTDataset(ds, rng, num_samples, seq_length, seed, opts, cache_dir, name)
    weights = [w for w, *_ in parts]
    wanted = samples_per_dataset(weights, num_samples) if num_samples else [0] * len(parts)
    members = [GPTDataset(ds, rng, n, seq_length, seed, opts, cache_dir, name)
               for (_, ds, rng, cache_dir), n in zip(parts, wanted)]
    if num_samples == 0:  # as many as every member can serve without repeating an epoch
        total = sum(weights)
        num_samples = int(min(len(m) * total / w for m, w in zip(members, weights)))
    blend_cache = writable_dir(os.path.join(data_cache_path, "GPTDataset_indices"), "GPTDataset_indices") \
        if data_cache_path else parts[0][3]
    return BlendedDataset(members, weights, num_samples, blend_cache,
                          [m.description for m in members], name)
