"""Global batch per step (--rampup-batch-size, --decrease-batch-size-if-needed) as Megatron-LM's
calculator gives it, --train-samples to iterations, and the sampler's data order across a ramp."""
import pytest
import torch

from megatron_lite.data import build_pretraining_data_loader
from megatron_lite.errors import ConfigError
from megatron_lite.training.microbatches import BatchSchedule, parse_step_schedule


def test_ramp_batch_sizes_per_step():
    """START 4, INCR 2 over 20 samples to 8: one increment per 20 / 2 = 10 samples, by the samples
    consumed before each step: 0 4 8 -> 4; 12 18 -> 6 (int(1.2), int(1.8) increments); 24 > 20 -> 8."""
    s = BatchSchedule(8, 1, 2, rampup_batch_size=[4, 2, 20])
    assert s.step_sizes(8) == [4, 4, 4, 6, 6, 8, 8, 8]
    assert [s.num_microbatches(c) for c in (0, 4, 8, 12, 18, 24, 10 ** 9)] == [2, 2, 2, 3, 3, 4, 4]
    assert [s.global_batch_size(c) for c in (9, 10, 19, 20, 21)] == [4, 6, 6, 8, 8]  # 20 is not > 20: int(2.0)
    assert s.microbatch_counts(6) == [2, 3, 4] and s.microbatch_counts(4) == [2, 3]
    assert s.microbatch_counts(3) == [2]


def test_constant_batch():
    s = BatchSchedule(16, 2, 4)
    assert s.step_sizes(3) == [16, 16, 16] and s.num_microbatches(123) == 2
    assert s.train_iters(100) == 6  # 100 // 16: the partial last batch is dropped


def test_train_samples_to_iterations_with_a_ramp():
    s = BatchSchedule(8, 1, 1, rampup_batch_size=[4, 2, 20])
    assert s.train_iters(100) == 5 + (100 - 24) // 8  # ramp steps 4 4 4 6 6, then 9 of 8
    assert s.train_iters(10) == 3  # stops once past train_samples: 0 -> 4 -> 8 -> 12


def test_gpt3_175b_ramp():
    """The GPT-3 script's 16 16 5859375 to 1536: 95 increments of 61677.63 samples; the ramp takes
    19802 steps and 5859424 samples, then full batches."""
    s = BatchSchedule(1536, 1, 16, rampup_batch_size=[16, 16, 5859375])
    assert s.samples_per_increment == pytest.approx(5859375 / 95)
    assert s.train_iters(5859424 + 10 * 1536 + 7) == 19802 + 10
    assert s.global_batch_size(61677) == 16 and s.global_batch_size(61678) == 32
    assert s.global_batch_size(5859374) == 1520 and s.global_batch_size(5859375) == 1536  # int(95.0)


def test_decrease_batch_size_if_needed():
    with pytest.raises(ConfigError, match="decrease-batch-size-if-needed"):
        BatchSchedule(10, 1, 4)
    s = BatchSchedule(10, 1, 4, decrease_batch_size_if_needed=True)
    assert (s.running_global_batch_size(0), s.global_batch_size(0), s.num_microbatches(0)) == (8, 10, 2)
    ramp = BatchSchedule(14, 1, 4, rampup_batch_size=[6, 4, 10], decrease_batch_size_if_needed=True)
    assert ramp.step_sizes(5) == [4, 4, 8, 12, 12]  # nominal 6 6 10 14 14, rounded down to multiples of 4
    with pytest.raises(ConfigError, match="no micro-batch"):
        BatchSchedule(14, 1, 8, rampup_batch_size=[6, 4, 10], decrease_batch_size_if_needed=True)


@pytest.mark.parametrize("ramp,gbs,match", [
    ([8, 8, 100], 8, "smaller than"), ([4, 3, 100], 8, "multiple of INCR"), ([4, 2], 8, "3 values"),
    ([4, 2, 0], 8, ">= 1"), ([2, 2, 10], 8, "must be divisible"),
])
def test_bad_ramps(ramp, gbs, match):
    with pytest.raises(ConfigError, match=match):
        BatchSchedule(gbs, 1, 4, rampup_batch_size=ramp)


class Counting(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i])}


def ramp_global_batches(consumed, mbs, dp, steps):
    """The global batches of `steps` steps from `consumed`, reassembled from each DP rank's loader."""
    sched = BatchSchedule(32, mbs, dp, rampup_batch_size=[8, 8, 100])
    loaders = [iter(build_pretraining_data_loader(Counting(), consumed, mbs, sched.running_global_batch_size, r, dp))
               for r in range(dp)]
    out = []
    for _ in range(steps):
        micro = sched.num_microbatches(consumed)
        batch = [i for it in loaders for _ in range(micro) for i in next(it)["tokens"][:, 0].tolist()]
        out.append(batch)
        consumed += len(batch)
    return out


def test_data_order_does_not_depend_on_dp_across_a_ramp():
    ref = ramp_global_batches(0, 2, 1, 12)
    sizes = [len(b) for b in ref]
    # 33.3 samples per increment: consumed 0..32 -> 8; 40, 56 -> 16; 72, 96 -> 24; 120 > 100 -> 32
    assert sizes == [8] * 5 + [16] * 2 + [24] * 2 + [32] * 3
    starts = [sum(sizes[:k]) for k in range(12)]
    assert ref == [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    assert ramp_global_batches(0, 2, 2, 12) == ref
    assert ramp_global_batches(0, 2, 4, 12) == ref
    assert ramp_global_batches(0, 1, 4, 12) == ref


@pytest.mark.parametrize("dp", [1, 4])
def test_resume_mid_ramp_continues_the_same_samples(dp):
    full = ramp_global_batches(0, 2, dp, 12)
    for k in (3, 6, 9):
        consumed = sum(len(b) for b in full[:k])
        assert ramp_global_batches(consumed, 2, dp, 12 - k) == full[k:]


def test_step_batch_size_schedule_as_megatron_lm_parses_it():
    """Megatron-LM's GPT-3 175B script: thresholds in tokens (B = 1e9) -> samples by // seq_length."""
    steps = parse_step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert steps == [(0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536)]
    assert parse_step_schedule("1K:8,0:4", 10) == [(0, 4), (100, 8)]  # commas, any order, K suffix


def test_step_batch_size_schedule_per_step():
    """From 0 samples: 4; from 10: 8; from 30: 12 (the last threshold at or below the samples consumed
    before the step); --train-samples counts steps until the samples are reached, as update_train_iters."""
    s = BatchSchedule(2, 1, 2, steps=parse_step_schedule("0:4 100:8 300:12", 10))
    assert s.step_sizes(7) == [4, 4, 4, 8, 8, 8, 12]  # consumed 0 4 8 12 20 28 36
    assert s.microbatch_counts(100) == [2, 4, 6] and s.microbatch_counts(3) == [2]
    assert s.samples(7) == 48 and s.train_iters(48) == 7 and s.train_iters(49) == 8
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\) \(the schedule's, after 32 samples\) must be divisible .* change the schedule or the sizes"):
        BatchSchedule(4, 1, 8, steps=parse_step_schedule("0:8 300:12", 10)).microbatch_counts(10)


@pytest.mark.parametrize("schedule,match", [("16:4", "first threshold must be 0"), ("0:4 x:8", "'x' is not a number"),
                                            ("0:4 5:8", "strictly increasing"), ("0-4", "THRESHOLD:BATCH_SIZE"),
                                            ("0:0", "must be >= 1")])
def test_bad_step_schedules(schedule, match):
    with pytest.raises(ConfigError, match=match):
        parse_step_schedule(schedule, 10)
