"""The LR schedule follows Megatron-LM's OptimizerParamScheduler step for step."""
import math

import pytest

from megatron_lite.optim.lr_scheduler import LRScheduler


def megatron_reference(n, max_lr, min_lr, warmup, decay, style):
    """Megatron-LM's get_lr(), transcribed from its documented formula (num_steps = updates so far)."""
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup,decay", [(0, 10), (2, 4), (3, 20)])
def test_schedule_matches_megatron(style, warmup, decay):
    sched = LRScheduler(1e-3, 1e-5, warmup, decay, style)
    for n in range(decay + 3):
        assert sched.lr() == pytest.approx(megatron_reference(n, 1e-3, 1e-5, warmup, decay, style), abs=1e-15)
        sched.step()


def test_warmup_starts_at_zero():
    sched = LRScheduler(1e-3, 0.0, 2, 4)
    assert [sched.lr(n) for n in range(5)] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4, 0.0])


def test_skipped_fp16_steps_do_not_advance_the_schedule():
    """With fp16's default 2**32 initial scale the first steps overflow and are skipped: the LR
    must stay where it is until an update succeeds, as in Megatron-LM."""
    from megatron_lite.testing import run_distributed
    from training_utils import TINY, train_in_process

    hist = run_distributed(train_in_process, 1, TINY + ["--fp16", "--train-iters", "8", "--lr-warmup-iters", "4", "--initial-loss-scale", "4194304",
                                                         "--hysteresis", "1"])[0]
    skipped = [r["skipped"] for r in hist]
    assert any(skipped) and not all(skipped)
    sched, expected = LRScheduler(3e-3, 0.0, 4, 8), []
    for r in hist:
        expected.append(sched.lr())
        if not r["skipped"]:
            sched.step()
    assert [r["lr"] for r in hist] == pytest.approx(expected)
