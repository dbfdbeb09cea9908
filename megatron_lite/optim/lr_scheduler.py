"""Learning-rate and weight-decay schedules as Megatron-LM's OptimizerParamScheduler computes them.

The schedule is a function of `num_steps`, a count the loop advances after each successful update
(skipped fp16 steps do not count). Megatron counts in SAMPLES: iteration flags are converted to
samples by multiplying with the global batch size (`build_param_scheduler`), and every update
advances the count by the samples of that step, so a batch-size ramp-up moves the schedule by
the batch actually consumed. The LR used by an update is the one at the samples consumed before
it (so with warmup the first update uses `lr_warmup_init`).

    warmup  n <= W (W > 0):     init + (max - init) * n / W
    constant (after warmup):    max
    n > D:                      min
    inverse-square-root:        max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise, r = (n - W) / (D - W), lr = min + c * (max - min) with
      linear  c = 1 - r;  cosine  c = (1 + cos(pi r)) / 2;
      WSD     c = 1 while n <= D - A, then with q = (n - (D - A)) / A:
              exponential 2 * 0.5^q - 1 | linear 1 - q | cosine (1 + cos(pi q)) / 2 | minus_sqrt 1 - sqrt(q)

Parameter groups (`--decoupled-lr`) share the shape and the horizons and differ only in max and
min LR; the warmup starts from the same `lr_warmup_init` for all of them.

Weight decay rises from start to end over `wd_incr_steps` (constant | linear | cosine).

`LRScheduler` is the older iteration-counting interface (one step per update), kept for callers
that train by iterations with a constant batch: the same formulas with counts in iterations.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

DEFAULT_GROUP = "default"
DECOUPLED_GROUP = "decoupled"  # word embedding and output layer under --decoupled-lr
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _wsd_coeff(style: str, q: float) -> float:
    """The annealing factor of WSD's decay phase at fraction q in [0, 1] of that phase."""
    if style == "linear":
        return 1.0 - q
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * q) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, q) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(q)
    raise ConfigError(f"--lr-wsd-decay-style {style}: choose one of {', '.join(WSD_DECAY_STYLES)}")


class OptimizerParamScheduler:
    """LR per parameter group and weight decay as functions of the samples consumed so far.

    `groups` maps a group name to its (max_lr, min_lr); the default group uses (max_lr, min_lr).
    Steps, warmup and horizons are in one unit (samples for Megatron's flags); `step(increment)`
    adds an update's worth of that unit."""

    step_unit = "samples"

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: float,
                 decay_style: str = "cosine", *, init_lr: float = 0.0, wsd_decay_steps: Optional[float] = None,
                 wsd_decay_style: str = "exponential", start_wd: float = 0.0, end_wd: float = 0.0,
                 wd_incr_steps: float = 0, wd_incr_style: str = "constant",
                 groups: Optional[Dict[str, Tuple[float, float]]] = None):
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.groups = {DEFAULT_GROUP: (self.max_lr, self.min_lr)}
        self.groups.update({k: (float(a), float(b)) for k, (a, b) in (groups or {}).items()})
        self.num_steps = 0  # samples (or this scheduler's unit) consumed by successful updates
        self._validate()

    def _validate(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.decay_style}: choose one of {', '.join(DECAY_STYLES)}")
        if self.decay_style == "WSD" and self.wsd_decay_steps is None:
            raise ConfigError("--lr-decay-style WSD needs the length of its decay phase: --lr-wsd-decay-samples "
                              "(training by samples) or --lr-wsd-decay-iters (training by iterations)")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"--lr-wsd-decay-style {self.wsd_decay_style}: choose one of "
                              f"{', '.join(WSD_DECAY_STYLES)}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ConfigError(f"--weight-decay-incr-style {self.wd_incr_style}: choose one of "
                              f"{', '.join(WD_INCR_STYLES)}")
        for name, (top, floor) in self.groups.items():
            if not 0.0 <= floor <= top:
                raise ConfigError(f"LR group {name}: need 0 <= min lr ({floor}) <= max lr ({top})")
            if self.init_lr > top:
                raise ConfigError(f"--lr-warmup-init ({self.init_lr}) exceeds the max LR ({top}) of group {name}")
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ConfigError(f"need 0 <= --start-weight-decay ({self.start_wd}) <= --end-weight-decay "
                              f"({self.end_wd})")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError("--weight-decay-incr-style constant: start and end weight decay must be equal")

    # --- learning rate ----------------------------------------------------------------------
    def lr(self, num_steps: Optional[float] = None, group: str = DEFAULT_GROUP) -> float:
        """The LR of `group` after `num_steps` (default: the current count)."""
        n = self.num_steps if num_steps is None else num_steps
        top, floor = self.groups[group]
        w, d = self.warmup_steps, self.decay_steps
        if w > 0 and n <= w:
            return self.init_lr + (top - self.init_lr) * float(n) / float(w)
        if self.decay_style == "constant":
            return top
        if n > d:
            return floor
        if self.decay_style == "inverse-square-root":
            return max(floor, top * math.sqrt(max(w, 1)) / math.sqrt(max(n, 1)))
        return floor + self._decay_coeff(n) * (top - floor)

    def _decay_coeff(self, n: float) -> float:
        """Factor in [0, 1] between min and max LR, for warmup < n <= decay_steps."""
        ratio = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            return 1.0 - ratio
        if self.decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        # WSD: stable until the last wsd_decay_steps of the horizon, then anneal
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        return _wsd_coeff(self.wsd_decay_style, float(n - anneal_start) / float(self.wsd_decay_steps))

    def lrs(self, num_steps: Optional[float] = None) -> Dict[str, float]:
        """Every group's LR (what the optimizer's step takes)."""
        return {g: self.lr(num_steps, g) for g in self.groups}

    # --- weight decay -----------------------------------------------------------------------
    def weight_decay(self, num_steps: Optional[float] = None) -> float:
        """Weight decay of decayed parameters after `num_steps` (the no-decay ones stay at 0)."""
        n = self.num_steps if num_steps is None else num_steps
        if n > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(n) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine: slow start, slow finish
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    # --- progress and checkpoints -----------------------------------------------------------
    def step(self, increment: int) -> None:
        """After a successful update: `increment` = the samples that update consumed."""
        self.num_steps += increment

    def state_dict(self) -> dict:
        """The position (num_steps) and, for the notes a resume prints, the flags it ran with."""
        return {"step_unit": self.step_unit, "num_steps": self.num_steps, "max_lr": self.max_lr,
                "min_lr": self.min_lr, "init_lr": self.init_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "wsd_decay_steps": self.wsd_decay_steps, "lr_wsd_decay_style": self.wsd_decay_style,
                "start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_steps": self.wd_incr_steps,
                "wd_incr_style": self.wd_incr_style,
                "groups": {k: list(v) for k, v in self.groups.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the checkpoint's position. The schedule's shape comes from this run's flags
        (a longer --train-samples stretches the decay, as intended): see `changes_from`."""
        unit = state.get("step_unit", "iterations")
        if unit != self.step_unit:
            raise ConfigError(f"the checkpoint's LR schedule counted {unit}, this run counts {self.step_unit}: "
                              f"convert its num_steps ({state['num_steps']}) before resuming")
        self.num_steps = state["num_steps"]

    def changes_from(self, state: dict) -> List[str]:
        """'field old -> new' for every flag that differs from the checkpoint's."""
        ours = self.state_dict()
        return [f"{k} {state[k]} -> {v}" for k, v in ours.items()
                if k in state and k not in ("num_steps", "step_unit") and state[k] != v]

    def resume(self, saved: dict, meta: dict) -> None:
        """Resume at the samples of the checkpoint's successful updates. A checkpoint of an older
        megatron-lite counted updates: times its global batch (it had no ramp-up)."""
        if saved.get("step_unit") == self.step_unit:
            self.num_steps = saved["num_steps"]
        else:
            updates = saved.get("num_steps", meta["iteration"])
            self.num_steps = updates * meta["config"]["training"]["global_batch_size"]

    def changes_note(self, saved: dict, meta: dict) -> List[str]:
        """The schedule is a function of the samples consumed and the flags: this run's flags win
        (e.g. a longer --train-samples stretches the decay, as intended); say so when they changed."""
        changed = self.changes_from(saved) if saved.get("step_unit") == self.step_unit else []
        return [f"LR schedule from this run's flags ({', '.join(changed)})"] if changed else []


class LRScheduler(OptimizerParamScheduler):
    """The iteration-counting interface: warmup and decay in iterations, one step per update,
    linear warmup from 0. For training by iterations at a constant global batch this gives the
    same LRs as the sample-counting scheduler (every count scaled by the batch)."""

    step_unit = "iterations"

    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str = "cosine"):
        super().__init__(max_lr, min_lr, warmup_iters, max(decay_iters, 1), style)

    def step(self, increment: int = 1) -> None:
        super().step(increment)


# --- from Megatron's flags ------------------------------------------------------------------
SCHEDULE_FLAGS = (
    "lr", "min_lr", "lr_decay_style", "lr_warmup_init", "global_batch_size", "train_iters", "train_samples",
    "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
    "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples", "weight_decay", "start_weight_decay",
    "end_weight_decay", "weight_decay_incr_style", "decoupled_lr", "decoupled_min_lr")


def _check_mode_flags(by_samples: bool, f: dict) -> None:
    """Megatron's validate_args: each mode refuses the other's decay and warmup lengths (its
    --lr-wsd-decay-* of the other mode is ignored, as in Megatron)."""
    mode, other = ("--train-samples", "iters") if by_samples else ("--train-iters", "samples")
    wrong = [k for k in (f"lr_decay_{other}", f"lr_warmup_{other}") if f.get(k)]
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise ConfigError(f"{flags}: training by {mode} counts the schedule in "
                          f"{'samples' if by_samples else 'iterations'}; use the --lr-*-"
                          f"{'samples' if by_samples else 'iters'} flags")
    warmup = f.get("lr_warmup_samples" if by_samples else "lr_warmup_iters") or 0
    if warmup and f.get("lr_warmup_fraction") is not None:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive; choose one")


def build_param_scheduler(*, lr: float, min_lr: float = 0.0, lr_decay_style: str = "linear",
                          lr_warmup_init: float = 0.0, global_batch_size: int, train_iters: Optional[int] = None,
                          train_samples: Optional[int] = None, lr_decay_iters: Optional[int] = None,
                          lr_decay_samples: Optional[int] = None, lr_warmup_iters: int = 0,
                          lr_warmup_samples: int = 0, lr_warmup_fraction: Optional[float] = None,
                          lr_wsd_decay_style: str = "exponential", lr_wsd_decay_iters: Optional[int] = None,
                          lr_wsd_decay_samples: Optional[int] = None, weight_decay: float = 0.01,
                          start_weight_decay: Optional[float] = None, end_weight_decay: Optional[float] = None,
                          weight_decay_incr_style: str = "constant", decoupled_lr: Optional[float] = None,
                          decoupled_min_lr: Optional[float] = None) -> OptimizerParamScheduler:
    """The scheduler Megatron-LM's get_optimizer_param_scheduler builds, counting samples.

    By iterations every length is iterations x global_batch_size (the NOMINAL global batch: with
    a ramp-up Megatron allows only training by samples). Lengths left unset default to the
    training length; --lr-warmup-fraction is a fraction of the decay length."""
    f = dict(locals())
    if (train_iters is None) == (train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    by_samples = train_samples is not None
    _check_mode_flags(by_samples, f)
    if by_samples:
        decay = lr_decay_samples if lr_decay_samples is not None else train_samples
        wsd, wd_steps, warmup = lr_wsd_decay_samples, train_samples, lr_warmup_samples
    else:
        g = global_batch_size
        decay = (lr_decay_iters if lr_decay_iters is not None else train_iters) * g
        wsd = None if lr_wsd_decay_iters is None else lr_wsd_decay_iters * g
        wd_steps, warmup = train_iters * g, lr_warmup_iters * g
    if lr_warmup_fraction is not None:
        warmup = lr_warmup_fraction * decay  # a float, as in Megatron
    if decay == 0 and not (train_samples if by_samples else train_iters):
        decay = 1  # no training steps (evaluation only): no schedule to run, nothing to check
    if decay <= 0:
        raise ConfigError(f"the LR decay length ({decay} samples) must be positive: set --train-iters/--train-samples "
                          f"or --lr-decay-iters/--lr-decay-samples")
    if warmup >= decay:
        raise ConfigError(f"the LR warmup ({warmup} samples) must be shorter than its decay length ({decay} samples)")
    start_wd, end_wd = _weight_decay_range(weight_decay, start_weight_decay, end_weight_decay, weight_decay_incr_style)
    groups = {}
    if decoupled_lr is not None:  # --decoupled-min-lr alone changes nothing, as in Megatron
        groups[DECOUPLED_GROUP] = (decoupled_lr, min_lr if decoupled_min_lr is None else decoupled_min_lr)
    return OptimizerParamScheduler(lr, min_lr, warmup, decay, lr_decay_style, init_lr=lr_warmup_init,
                                   wsd_decay_steps=wsd, wsd_decay_style=lr_wsd_decay_style, start_wd=start_wd,
                                   end_wd=end_wd, wd_incr_steps=wd_steps, wd_incr_style=weight_decay_incr_style,
                                   groups=groups)


def _weight_decay_range(weight_decay: float, start: Optional[float], end: Optional[float],
                        style: str) -> Tuple[float, float]:
    """(start, end) weight decay as Megatron's validate_args derives them."""
    if style == "constant":
        if start is not None or end is not None:
            raise ConfigError("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or "
                              "cosine (constant uses --weight-decay)")
        return weight_decay, weight_decay
    if start is None or end is None:
        raise ConfigError(f"--weight-decay-incr-style {style} needs both --start-weight-decay and --end-weight-decay")
    return start, end
