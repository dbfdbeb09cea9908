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


# --- Megatron's OptimizerParamScheduler: samples, styles, WSD, groups, weight decay, resume ---------
import json

from megatron_lite.errors import ConfigError
from megatron_lite.optim.lr_scheduler import DECOUPLED_GROUP, OptimizerParamScheduler, build_param_scheduler

GBS = 16


def lrs_over(sched, increments):
    """The LR of each update, stepping by each update's samples."""
    out = []
    for inc in increments:
        out.append(sched.lr())
        sched.step(inc)
    return out


@pytest.mark.parametrize("style,extra_iters,extra_samples", [
    ("cosine", {}, {}), ("linear", {}, {}), ("constant", {}, {}), ("inverse-square-root", {}, {}),
    ("WSD", {"lr_wsd_decay_iters": 30}, {"lr_wsd_decay_samples": 30 * GBS}),
])
def test_samples_equal_iterations_where_they_coincide(style, extra_iters, extra_samples):
    common = dict(lr=1e-3, min_lr=1e-5, lr_decay_style=style, global_batch_size=GBS, lr_wsd_decay_style="cosine")
    by_iters = build_param_scheduler(train_iters=100, lr_warmup_iters=10, lr_decay_iters=80, **common, **extra_iters)
    by_samples = build_param_scheduler(train_samples=100 * GBS, lr_warmup_samples=10 * GBS, lr_decay_samples=80 * GBS,
                                       **common, **extra_samples)
    a, b = lrs_over(by_iters, [GBS] * 110), lrs_over(by_samples, [GBS] * 110)
    assert a == b
    if style != "WSD":  # the iteration-counting interface agrees step for step
        assert a == pytest.approx(lrs_over(LRScheduler(1e-3, 1e-5, 10, 80, style), [1] * 110), abs=1e-18)


def test_warmup_fraction_is_a_fraction_of_the_decay_samples():
    s = build_param_scheduler(lr=1.0, global_batch_size=10, train_iters=100, lr_warmup_fraction=0.05)
    assert (s.warmup_steps, s.decay_steps) == (50.0, 1000)
    assert s.lr(25) == pytest.approx(0.5)


# max 1.0, min 0.1, warmup 100 samples, decay horizon 1100: hand-computed values.
HAND = {
    "linear": {50: 0.5, 100: 1.0, 600: 0.55, 1100: 0.1, 1101: 0.1},
    "cosine": {350: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 600: 0.55, 1100: 0.1, 5000: 0.1},
    "constant": {50: 0.5, 101: 1.0, 5000: 1.0},
    "inverse-square-root": {100: 1.0, 400: 0.5, 1100: 10 / math.sqrt(1100), 1101: 0.1},
}


@pytest.mark.parametrize("style", sorted(HAND))
def test_each_style_against_hand_computed_points(style):
    s = OptimizerParamScheduler(1.0, 0.1, 100, 1100, style)
    for n, expected in HAND[style].items():
        assert s.lr(n) == pytest.approx(expected, rel=1e-12), (style, n)


def test_warmup_starts_at_lr_warmup_init():
    s = OptimizerParamScheduler(1.0, 0.1, 100, 1100, "cosine", init_lr=0.2)
    assert [s.lr(0), s.lr(50), s.lr(100)] == pytest.approx([0.2, 0.6, 1.0])


@pytest.mark.parametrize("wsd_style,at_q_half", [
    ("exponential", 2 * 0.5 ** 0.5 - 1), ("linear", 0.5), ("cosine", 0.5), ("minus_sqrt", 1 - 0.5 ** 0.5)])
def test_wsd_phases(wsd_style, at_q_half):
    """Warmup to 100, stable at max until 1100 - 200 = 900, anneal over 200 to min, then min."""
    s = OptimizerParamScheduler(1.0, 0.1, 100, 1100, "WSD", wsd_decay_steps=200, wsd_decay_style=wsd_style)
    assert s.lr(50) == pytest.approx(0.5)
    assert s.lr(101) == s.lr(500) == s.lr(900) == 1.0
    assert s.lr(1000) == pytest.approx(0.1 + 0.9 * at_q_half, rel=1e-12)
    assert s.lr(1100) == pytest.approx(0.1, abs=1e-15)
    assert s.lr(1101) == s.lr(10 ** 6) == 0.1
    assert all(s.lr(n) >= s.lr(n + 25) for n in range(900, 1100, 25))  # monotone anneal


def test_decoupled_group_has_its_own_max_and_min_and_the_shared_warmup():
    s = build_param_scheduler(lr=1.0, min_lr=0.1, lr_decay_style="linear", global_batch_size=1, train_samples=1100,
                              lr_warmup_samples=100, lr_warmup_init=0.0, decoupled_lr=4.0, decoupled_min_lr=0.4)
    assert s.lrs(50) == pytest.approx({"default": 0.5, DECOUPLED_GROUP: 2.0})
    assert s.lrs(600) == pytest.approx({"default": 0.55, DECOUPLED_GROUP: 2.2})
    assert s.lrs(2000) == pytest.approx({"default": 0.1, DECOUPLED_GROUP: 0.4})
    plain = build_param_scheduler(lr=1.0, global_batch_size=1, train_samples=10, decoupled_min_lr=0.4)
    assert list(plain.lrs()) == ["default"]  # --decoupled-min-lr without --decoupled-lr: no group


@pytest.mark.parametrize("style,at_quarter", [("linear", 0.25), ("cosine", 0.5 * (math.cos(0.75 * math.pi) + 1))])
def test_weight_decay_increment(style, at_quarter):
    s = build_param_scheduler(lr=1.0, global_batch_size=4, train_iters=100, start_weight_decay=0.01,
                              end_weight_decay=0.11, weight_decay_incr_style=style)
    assert s.wd_incr_steps == 400
    assert s.weight_decay(0) == pytest.approx(0.01)
    assert s.weight_decay(100) == pytest.approx(0.01 + 0.1 * at_quarter)
    assert s.weight_decay(400) == s.weight_decay(401) == pytest.approx(0.11)
    const = build_param_scheduler(lr=1.0, global_batch_size=4, train_iters=100, weight_decay=0.1)
    assert const.weight_decay(0) == const.weight_decay(399) == 0.1


def test_ramp_up_advances_by_each_steps_samples():
    s = OptimizerParamScheduler(1.0, 0.0, 100, 1000, "linear")
    assert lrs_over(s, [4, 4, 6, 8, 8]) == pytest.approx([0.0, 0.04, 0.08, 0.14, 0.22])
    assert s.num_steps == 30


def test_resume_mid_schedule_through_a_json_checkpoint():
    flags = dict(lr=3e-4, min_lr=3e-5, lr_decay_style="WSD", lr_wsd_decay_samples=300, global_batch_size=8,
                 train_samples=1000, lr_warmup_samples=96, decoupled_lr=1e-3)
    first = build_param_scheduler(**flags)
    incs = [8] * 125
    lrs_over(first, incs[:37])
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = build_param_scheduler(**flags)
    resumed.load_state_dict(saved)
    assert resumed.changes_from(saved) == []
    for inc in incs[37:]:
        assert resumed.lrs() == first.lrs() and resumed.weight_decay() == first.weight_decay()
        resumed.step(inc)
        first.step(inc)
    longer = build_param_scheduler(**dict(flags, train_samples=2000))
    assert longer.changes_from(saved) == ["lr_decay_steps 1000 -> 2000", "wd_incr_steps 1000 -> 2000"]
    with pytest.raises(ConfigError, match="counted iterations"):
        resumed.load_state_dict({"num_steps": 3})  # an iteration-counting checkpoint


@pytest.mark.parametrize("flags,match", [
    (dict(train_iters=10, lr_decay_samples=100), "--lr-decay-samples"),
    (dict(train_samples=100, lr_warmup_iters=3), "--lr-warmup-iters"),
    (dict(train_samples=100, lr_warmup_samples=3, lr_warmup_fraction=0.1), "exclusive"),
    (dict(train_iters=10, train_samples=100), "exactly one"),
    (dict(train_samples=100, lr_decay_style="WSD", lr_wsd_decay_iters=5), "WSD needs"),
    (dict(train_samples=100, lr_warmup_samples=100), "shorter"),
    (dict(train_iters=10, start_weight_decay=0.1), "incr-style"),
    (dict(train_iters=10, weight_decay_incr_style="linear", start_weight_decay=0.1), "both"),
])
def test_megatron_flag_rules(flags, match):
    with pytest.raises(ConfigError, match=match):
        build_param_scheduler(lr=1.0, global_batch_size=4, **flags)
