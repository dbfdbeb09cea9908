"""The run as checkpoints see it: the holders of its tensors (saved through plan.py and rng.py) and
the values its components register, so that the checkpoint package reads no trainer attribute.

A value is JSON in metadata.json under its registered name (the names are the format:
`iteration`, `consumed_samples`, `lr_scheduler`, `optimizer`, ...). A load restores it at the
moments it registered for, `progress` (unless --finetune) and `optimizer` (also unless
--no-load-optim), from the saved value (None when an older checkpoint lacks it) and the whole
metadata (older formats), and prints the notes returned."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..config import Config
from ..parallel.random import RNGStatesTracker
from ..parallel.state import ParallelDims

Restore = Callable[[Any, dict], Optional[List[str]]]  # (saved value or None, metadata) -> notes


@dataclass
class TrainState:
    cfg: Config
    dims: ParallelDims
    device: torch.device
    chunks: list  # this rank's model chunks
    optimizer: Any  # the DistributedOptimizer (its `sync` is the GradientSync)
    tracker: RNGStatesTracker
    formats: tuple = ()  # the foreign checkpoint formats a load may read (foreign.py)
    saves: Dict[str, Callable[[], Any]] = field(default_factory=dict)  # name -> the value to save now
    restores: Dict[str, Dict[str, Restore]] = field(default_factory=lambda: {"progress": {}, "optimizer": {}})

    def register(self, name: str, save: Optional[Callable[[], Any]], **restores: Restore) -> None:
        """`restores`: progress=..., optimizer=... (either or both). `save` None: a value this run
        does not write but reads when a checkpoint has it (to say that it is not used)."""
        assert name not in self.saves and all(name not in r for r in self.restores.values()), \
            f"checkpoint value {name!r} registered twice"
        if save is not None:
            self.saves[name] = save
        for moment, restore in restores.items():
            self.restores[moment][name] = restore

    def register_attribute(self, owner, name: str, default: Any = 0) -> None:
        """`owner.<name>`, restored with the progress (`default` when a checkpoint lacks it)."""
        self.register(name, lambda: getattr(owner, name),
                      progress=lambda saved, meta: setattr(owner, name, default if saved is None else saved))

    def value(self, name: str) -> Any:
        return self.saves[name]()

    def restore(self, meta: dict, moment: str) -> List[str]:
        """Restore the values registered for `moment` (in registration order); their notes."""
        notes = []
        for name, restore in self.restores[moment].items():
            notes += restore(meta.get(name), meta) or []
        return notes
