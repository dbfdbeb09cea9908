"""Which samples each data-parallel rank reads, in an order that does not depend on DP size.

Global batch i is dataset samples [i*G, (i+1)*G) (the dataset is already shuffled); DP rank r of
D takes the contiguous chunk [r*G/D, (r+1)*G/D) of it, cut into micro-batches in order. So DP=1,
2 or 4 see the same global batches, and resuming from `consumed_samples` continues with exactly the
batch that would have come next. Past the end of the dataset the order wraps around, so the
stream never runs dry.
"""
from __future__ import annotations

from typing import Iterator, List

import torch
from torch.utils.data import DataLoader

from megatron_lite.errors import ConfigError


class PretrainingBatchSampler:
    """Yields this rank's micro-batches as lists of dataset indices, forever."""

    def __init__(self, dataset_len: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int):
        g, m, d = global_batch_size, micro_batch_size, dp_size
        if dataset_len < 1:
            raise ConfigError("the dataset is empty: there is nothing to sample")
        if m < 1 or d < 1 or g < 1:
            raise ConfigError(f"micro_batch_size ({m}), global_batch_size ({g}) and dp_size ({d}) must be >= 1")
        if g % (m * d):
            raise ConfigError(f"global_batch_size ({g}) must be divisible by micro_batch_size ({m}) x "
                              f"data-parallel size ({d}) = {m * d}")
        if not 0 <= dp_rank < d:
            raise ConfigError(f"dp_rank ({dp_rank}) must lie in [0, {d})")
        if consumed_samples < 0 or consumed_samples % g:
            raise ConfigError(f"consumed_samples ({consumed_samples}) must be a non-negative multiple "
                              f"of global_batch_size ({g})")
        self.dataset_len, self.consumed = dataset_len, consumed_samples
        self.micro, self.global_batch, self.dp_rank, self.dp_size = m, g, dp_rank, d

    def __iter__(self) -> Iterator[List[int]]:
        per_rank = self.global_batch // self.dp_size
        batch = self.consumed // self.global_batch
        while True:
            first = batch * self.global_batch + self.dp_rank * per_rank
            for s in range(first, first + per_rank, self.micro):
                yield [i % self.dataset_len for i in range(s, s + self.micro)]
            batch += 1


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  global_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0):
    """An endless iterable of this DP rank's micro-batches (dicts of tensors, batch dim first),
    starting after `consumed_samples`. None when there is no dataset."""
    if dataset is None:
        return None
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size, global_batch_size,
                                      dp_rank, dp_size)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      **({"prefetch_factor": 2} if num_workers > 0 else {}))
