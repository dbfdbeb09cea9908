"""ModelHooks: what a model does around each training step besides its forward and backward.

Parts with per-step state register one object each, in the same order on every rank: the model's
while it is built (`BuildContext.hooks`: MoE's load balancing), the trainer's after (`add`: delayed
FP8 scaling's amax history, QK-Clip); multi-token prediction needs none (its loss goes through the
step's LossNormalization). The trainer calls them all on every rank and knows none of them:
  before_step(iteration)  before the step's first forward
  after_update()          after an optimizer update that was applied (not skipped)
  metrics() -> dict       collective, once per step: fields for the step's record
and, where a part changes how the step learns (DSA's dense warm-up),
  step_settings(lrs, norm, default_group) -> (lrs, norm)   after before_step: the step's LRs and loss weights
"""
from __future__ import annotations

from typing import Dict, Type, TypeVar

Part = TypeVar("Part")


class ModelHooks:
    """The step hooks of this rank's model chunks: one part per kind, each with the methods above."""

    def __init__(self):
        self.parts: Dict[type, object] = {}

    def shared(self, kind: Type[Part], *args) -> Part:
        """The model's one `kind` part, built as kind(*args) by whichever builder asks first."""
        if kind not in self.parts:
            self.parts[kind] = kind(*args)
        return self.parts[kind]

    def add(self, part) -> None:
        """A part built outside the model (the trainer's: delayed FP8 scaling's state, QK-Clip)."""
        assert type(part) not in self.parts, type(part)
        self.parts[type(part)] = part

    def before_step(self, iteration: int) -> None:
        for part in self.parts.values():
            part.before_step(iteration)

    def after_update(self) -> None:
        for part in self.parts.values():
            part.after_update()

    def step_settings(self, lrs, norm, default_group: str):
        for part in self.parts.values():
            if hasattr(part, "step_settings"):
                lrs, norm = part.step_settings(lrs, norm, default_group)
        return lrs, norm

    def metrics(self) -> dict:
        return {k: v for part in self.parts.values() for k, v in part.metrics().items()}
