"""The global batch of each step and its number of micro-batches, as Megatron-LM computes them
(megatron/core/num_microbatches_calculator.py), including `--rampup-batch-size START INCR SAMPLES`.

Everything is a function of the samples consumed before the step, with no state of its own, so
a resumed run (consumed samples from its checkpoint) continues the ramp exactly.

Ramp-up: the global batch starts at START and grows by INCR every SAMPLES / ((GBS - START) /
INCR) samples (a float, as in Megatron), reaching GBS once more than SAMPLES samples are consumed:

    gbs(c) = GBS                                   if c > SAMPLES
           = START + int(c / per_increment) * INCR  otherwise

Each global batch must split into micro-batches over the data-parallel ranks (a multiple of
micro_batch_size x DP). `--decrease-batch-size-if-needed` instead rounds it down to such a
multiple: the RUNNING batch, which is what is consumed (and what the LR schedule advances by).
That rounding depends on DP, so only without it is the data order layout-independent.

`--step-batch-size-schedule "0:16 2.4B:320 ..."` (Megatron-LM's StepBatchsizeNumMicroBatchesCalculator):
THRESHOLD:BS pairs, thresholds in tokens (K/M/B/T suffixes) turned into samples by // seq_length;
a step uses the BS of the last threshold at or below the samples consumed before it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..errors import ConfigError


class BatchSchedule:
    """Global batch per step: constant, or Megatron's linear ramp-up."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Optional[Sequence[int]] = None, decrease_batch_size_if_needed: bool = False,
                 steps: Optional[List[Tuple[int, int]]] = None):
        self.gbs, self.mbs, self.dp = int(global_batch_size), int(micro_batch_size), int(data_parallel_size)
        self.steps = steps  # [(threshold samples, global batch)], from parse_step_schedule
        self.decrease = decrease_batch_size_if_needed
        if self.gbs < 1 or self.mbs < 1 or self.dp < 1:
            raise ConfigError(f"global batch ({self.gbs}), micro-batch ({self.mbs}) and data-parallel size ({self.dp}) "
                              f"must be >= 1")
        self.ramp = None if rampup_batch_size is None else _parse_ramp(rampup_batch_size, self.gbs)
        if self.ramp is not None:
            start, incr, samples = self.ramp
            self.samples_per_increment = samples / ((self.gbs - start) // incr)
        self.running_global_batch_size(0)  # refuse a schedule that cannot start, or cannot end
        if self.ramp is not None:
            self.running_global_batch_size(self.ramp[2] + 1)

    @property
    def unit(self) -> int:
        """Samples per micro-batch step over every DP rank: micro_batch_size x DP."""
        return self.mbs * self.dp

    def global_batch_size(self, consumed_samples: int) -> int:
        """The nominal global batch of the step that starts after `consumed_samples`."""
        if self.steps is not None:
            return [bs for threshold, bs in self.steps if threshold <= consumed_samples][-1]
        if self.ramp is None:
            return self.gbs
        start, incr, samples = self.ramp
        if consumed_samples > samples:
            return self.gbs
        return start + int(consumed_samples / self.samples_per_increment) * incr

    def running_global_batch_size(self, consumed_samples: int) -> int:
        """The samples that step consumes: the nominal batch, or with --decrease-batch-size-if-needed
        that batch rounded down to a multiple of micro_batch_size x DP."""
        g = self.global_batch_size(consumed_samples)
        if g % self.unit == 0:
            return g
        if not self.decrease:
            when = f" (the schedule's, after {consumed_samples} samples)" if self.ramp or self.steps else ""
            raise ConfigError(f"global_batch_size ({g}){when} must be divisible by micro_batch_size ({self.mbs}) x "
                              f"data-parallel size ({self.dp}) = {self.unit}; " + ("change the schedule or the sizes" if self.steps
                              else "change the sizes or pass --decrease-batch-size-if-needed"))
        running = g // self.unit * self.unit
        if running == 0:
            raise ConfigError(f"global batch size {g} (after {consumed_samples} samples) is smaller than "
                              f"micro_batch_size ({self.mbs}) x data-parallel size ({self.dp}) = {self.unit}: "
                              f"--decrease-batch-size-if-needed would leave no micro-batch")
        return running

    def num_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank in the step that starts after `consumed_samples`."""
        return self.running_global_batch_size(consumed_samples) // self.unit

    def step_sizes(self, num_steps: int, consumed_samples: int = 0) -> List[int]:
        """The running global batch of each of the next `num_steps` steps."""
        out, c = [], consumed_samples
        for _ in range(num_steps):
            out.append(self.running_global_batch_size(c))
            c += out[-1]
        return out

    def train_iters(self, train_samples: int) -> int:
        """Iterations for --train-samples, as Megatron's update_train_iters counts them: the ramp
        steps (nominal batch sizes) while at most SAMPLES and train_samples are consumed, then
        whole global batches of the rest (a partial last batch is dropped)."""
        if self.steps is not None:  # Megatron's update_train_iters with a step schedule
            iterations, consumed = 0, 0
            while consumed < train_samples:
                consumed += self.global_batch_size(consumed)
                iterations += 1
            return iterations
        if self.ramp is None:
            return train_samples // self.gbs
        iterations, consumed = 0, 0
        while consumed <= self.ramp[2] and consumed <= train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.gbs
        return iterations

    def microbatch_counts(self, num_steps: int) -> List[int]:
        """Every number of micro-batches the first `num_steps` steps use, ascending (a pipeline
        schedule must accept each). Raises now, where Megatron would assert only when it got
        there, if a step's batch does not split into micro-batches."""
        counts, c = set(), 0
        for _ in range(num_steps):
            counts.add(self.num_microbatches(c))
            if self.steps is not None:
                if c >= self.steps[-1][0]:
                    break
            elif self.ramp is None or c > self.ramp[2]:
                break  # constant from here on
            c += self.running_global_batch_size(c)
        return sorted(counts)

    def samples(self, num_steps: int) -> int:
        """Samples the first `num_steps` steps consume."""
        return num_steps * self.gbs if self.ramp is None and self.steps is None else sum(self.step_sizes(num_steps))


def parse_step_schedule(schedule: str, seq_length: int) -> List[Tuple[int, int]]:
    """Megatron-LM's --step-batch-size-schedule: "THRESHOLD:BS ..." (spaces or commas; K, M, B, T
    suffixes) -> [(threshold in samples = tokens // seq_length, global batch)], sorted; the first
    threshold must be 0, thresholds strictly increasing (in samples), batches >= 1."""
    def number(text: str) -> int:
        scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text.strip().upper()[-1:], 1)
        try:
            return int(float(text.strip()[:-1] if scale > 1 else text) * scale)
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule: {text!r} is not a number (K, M, B, T suffixes allowed)")
    steps = []
    for entry in schedule.replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH_SIZE "
                              f"(e.g. \"0:16 2.4B:320\", thresholds in tokens)")
        threshold, bs = entry.split(":", 1)
        steps.append((number(threshold) // seq_length, number(bs)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ConfigError(f"--step-batch-size-schedule {schedule!r}: the first threshold must be 0")
    for (a, _), (b, _) in zip(steps, steps[1:]):
        if b <= a:
            raise ConfigError(f"--step-batch-size-schedule {schedule!r}: thresholds must be strictly increasing "
                              f"in samples (tokens // seq_length {seq_length}); {a} then {b}")
    if any(bs < 1 for _, bs in steps):
        raise ConfigError(f"--step-batch-size-schedule {schedule!r}: every batch size must be >= 1")
    return steps


def _parse_ramp(rampup_batch_size: Sequence[int], gbs: int):
    """(START, INCR, SAMPLES) with Megatron's checks, plus the two that would crash it later
    (a division by zero): START == GBS, and SAMPLES == 0."""
    if len(rampup_batch_size) != 3:
        raise ConfigError(f"--rampup-batch-size takes 3 values: START INCR SAMPLES, got {list(rampup_batch_size)}")
    start, incr, samples = (int(v) for v in rampup_batch_size)
    if start < 1 or incr < 1 or samples < 1:
        raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: START, INCR and SAMPLES must be >= 1")
    if not start < gbs:
        raise ConfigError(f"--rampup-batch-size START ({start}) must be smaller than --global-batch-size ({gbs})")
    if (gbs - start) % incr:
        raise ConfigError(f"--global-batch-size ({gbs}) - START ({start}) = {gbs - start} must be a multiple of "
                          f"INCR ({incr})")
    return start, incr, samples
