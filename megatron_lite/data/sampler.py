"""Which samples each data-parallel rank reads, in an order that does not depend on DP size.

A step that starts after c consumed samples takes the global batch [c, c + G) of dataset samples
(the dataset is already shuffled); DP rank r of D takes the contiguous chunk [c + r*G/D,
c + (r+1)*G/D) of it, cut into micro-batches in order. So DP=1, 2 or 4 see the same global
batches (and the same micro-batches), and resuming from `consumed_samples` continues with exactly
the batch that would have come next. Past the end of the dataset the order wraps around, so the
stream never runs dry.

G may change from step to step (--rampup-batch-size): pass `global_batch_size` as a function of
the consumed samples (e.g. `BatchSchedule.running_global_batch_size`); the batches still depend
only on that function, not on DP.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Union

import torch
from torch.utils.data import DataLoader

from megatron_lite.errors import ConfigError


BatchSize = Union[int, Callable[[int], int]]  # per step: a constant, or f(consumed samples)


def _check_batch(g: int, m: int, d: int) -> None:
    if g < 1:
        raise ConfigError(f"global_batch_size ({g}) must be >= 1")
    if g % (m * d):
        raise ConfigError(f"global_batch_size ({g}) must be divisible by micro_batch_size ({m}) x "
                          f"data-parallel size ({d}) = {m * d}")


class PretrainingBatchSampler:
    """Yields this rank's micro-batches as lists of dataset indices, forever."""

    def __init__(self, dataset_len: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: BatchSize, dp_rank: int, dp_size: int):
        m, d = micro_batch_size, dp_size
        if dataset_len < 1:
            raise ConfigError("the dataset is empty: there is nothing to sample")
        if m < 1 or d < 1:
            raise ConfigError(f"micro_batch_size ({m}) and dp_size ({d}) must be >= 1")
        if not 0 <= dp_rank < d:
            raise ConfigError(f"dp_rank ({dp_rank}) must lie in [0, {d})")
        if consumed_samples < 0:
            raise ConfigError(f"consumed_samples ({consumed_samples}) must be >= 0")
        if not callable(global_batch_size):
            _check_batch(global_batch_size, m, d)
            if consumed_samples % global_batch_size:  # a constant batch: resume on a step boundary
                raise ConfigError(f"consumed_samples ({consumed_samples}) must be a non-negative multiple "
                                  f"of global_batch_size ({global_batch_size})")
        self.batch_size = global_batch_size if callable(global_batch_size) else (lambda _c, g=global_batch_size: g)
        _check_batch(self.batch_size(consumed_samples), m, d)
        self.dataset_len, self.consumed = dataset_len, consumed_samples
        self.micro, self.dp_rank, self.dp_size = m, dp_rank, d

    def __iter__(self) -> Iterator[List[int]]:
        consumed = self.consumed
        while True:
            g = self.batch_size(consumed)
            _check_batch(g, self.micro, self.dp_size)
            per_rank = g // self.dp_size
            first = consumed + self.dp_rank * per_rank
            for s in range(first, first + per_rank, self.micro):
                yield [i % self.dataset_len for i in range(s, s + self.micro)]
            consumed += g


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  global_batch_size: BatchSize, dp_rank: int, dp_size: int, num_workers: int = 0):
    """An endless iterable of this DP rank's micro-batches (dicts of tensors, batch dim first),
    starting after `consumed_samples`; `global_batch_size` per step as in PretrainingBatchSampler.
    None when there is no dataset."""
    if dataset is None:
        return None
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size, global_batch_size,
                                      dp_rank, dp_size)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      **({"prefetch_factor": 2} if num_workers > 0 else {}))
