"""GPT samples: windows of seq_length + 1 tokens cut across document boundaries.

Three index arrays, built once with vectorised numpy and cached (see cache.py):
- document_index: the sequence ids of each epoch, each epoch in its own shuffled order;
- sample_index [num_samples + 1, 2]: (position in document_index, token offset) where sample i
  starts; sample i runs from its start to the next sample's start inclusive, so consecutive
  samples share one token (the last label of one is the first input of the next);
- shuffle_index: the order in which samples are served.
As in Megatron, when the last epoch is needed only in small part (< 80% of it) its samples are
shuffled separately, so the partial epoch does not skew the mix of the earlier full ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.data.cache import corpus_identity, load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset

INDEX_VERSION = 1  # bump when the index construction changes: old caches are then ignored


@dataclass
class SampleOptions:
    """How samples become training items (Megatron's flags of the same names)."""
    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens make at least num_samples windows of seq_length + 1."""
    needed_tokens = num_samples * seq_length + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def build_indices(sizes: np.ndarray, seq_length: int, num_samples: int, seed: int,
                  first_sequence: int = 0) -> Dict[str, np.ndarray]:
    """The three index arrays for sequences of `sizes` tokens (sequence ids start at first_sequence)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    tokens_per_epoch = int(sizes.sum())
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.default_rng(seed)
    n = sizes.size
    positions = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    id_dtype = np.int32 if first_sequence + n < 2**31 else np.int64
    document_index = (positions + first_sequence).astype(id_dtype)

    ends = np.cumsum(sizes[positions])
    total_samples = (epochs * tokens_per_epoch - 1) // seq_length
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[where] - sizes[positions[where]])
    sample_index = np.stack([where, offsets], axis=1).astype(np.int64)

    shuffle_dtype = np.uint32 if total_samples < 2**32 - 1 else np.int64
    before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if epochs > 1 else 0
    per_epoch = (tokens_per_epoch - 1) // seq_length
    if epochs > 1 and (num_samples - before_last) < int(0.8 * per_epoch):
        shuffle_index = np.concatenate([rng.permutation(before_last),
                                        before_last + rng.permutation(total_samples - before_last)])
    else:
        shuffle_index = rng.permutation(total_samples)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index.astype(shuffle_dtype)}


def make_item(sample: np.ndarray, opts: SampleOptions) -> Dict[str, torch.Tensor]:
    """Turn seq_length + 1 tokens into inputs, labels, loss mask, positions (and, with
    reset_attention_mask, each token's document id)."""
    sample = np.asarray(sample, dtype=np.int64)
    tokens, labels = sample[:-1], sample[1:]
    seq = tokens.size
    loss_mask = np.ones(seq, dtype=np.float32)
    is_eod = tokens == opts.eod
    if opts.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    item = {"tokens": torch.from_numpy(tokens.copy()), "labels": torch.from_numpy(labels.copy()),
            "loss_mask": torch.from_numpy(loss_mask)}
    # A document starts after each EOD; the EOD itself still belongs to the one it ends.
    doc_id = np.concatenate([[0], np.cumsum(is_eod[:-1])]) if seq else np.zeros(0, np.int64)
    positions = np.arange(seq, dtype=np.int64)
    if opts.reset_position_ids:
        doc_start = np.flatnonzero(np.concatenate([[True], doc_id[1:] != doc_id[:-1]]))
        positions = positions - doc_start[doc_id]
    item["position_ids"] = torch.from_numpy(positions)
    if opts.reset_attention_mask:  # packed documents: the core attention masks across their boundaries
        item["document_ids"] = torch.from_numpy(doc_id.astype(np.int64))
    return item


class GPTDataset(torch.utils.data.Dataset):
    """Samples over the sequences [start, end) of one indexed dataset, for one split."""

    def __init__(self, indexed: IndexedDataset, seq_range: Tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, opts: SampleOptions, cache_dir: Optional[str],
                 split_name: str = "train"):
        self.indexed, self.opts, self.seq_length = indexed, opts, seq_length
        self.split_name = split_name
        start, end = seq_range
        sizes = indexed.sequence_lengths[start:end]
        tokens = int(sizes.sum(dtype=np.int64))
        if tokens < 2:  # not even one (input, label) pair
            raise ConfigError(f"{indexed.prefix}: the {split_name} split (sequences {start}-{end}) has "
                              f"{tokens} tokens; need at least 2 (adjust --split or add data)")
        self.description = {
            "class": "GPTDataset", "version": INDEX_VERSION, "corpus": corpus_identity(indexed),
            "split": split_name, "range": [start, end],
            "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
        }
        arrays, self.built_indices = load_or_build(
            cache_dir, f"GPTDataset-{split_name}", self.description,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(sizes, seq_length, num_samples, seed, first_sequence=start))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample idx (after shuffling)."""
        j = int(self.shuffle_index[idx])
        (p0, o0), (p1, o1) = self.sample_index[j], self.sample_index[j + 1]
        doc = self.document_index
        if p0 == p1:
            return self.indexed.get(int(doc[p0]), int(o0), int(o1 - o0 + 1))
        parts = [self.indexed.get(int(doc[p0]), int(o0))]
        parts += [self.indexed.get(int(doc[p])) for p in range(p0 + 1, p1)]
        parts.append(self.indexed.get(int(doc[p1]), 0, int(o1) + 1))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return make_item(self.sample_tokens(idx), self.opts)


class MockGPTDataset(torch.utils.data.Dataset):
    """Uniform random tokens in [0, vocab_size), a pure function of (seed, split, index)."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int,
                 opts: SampleOptions, split_index: int = 0):
        self.vocab_size, self.seq_length, self.opts = vocab_size, seq_length, opts
        self.num_samples, self.seed, self.split_index = max(1, num_samples), seed, split_index

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, self.split_index, idx])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return make_item(self.sample_tokens(idx), self.opts)
