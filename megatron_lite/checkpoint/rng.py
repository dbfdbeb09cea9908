"""Random number generator states of every rank, keyed by the rank's coordinates.

Saved per rank: the default CPU generator, the CUDA generator of its device (if any), and the
named states of its RNGStatesTracker (the model-parallel dropout stream). They are restored only
when the loading layout is the writing layout: on another layout the coordinates mean different
data, and the streams stay as seeded (a note is printed). With dropout 0 nothing depends on them.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..parallel.random import RNGStatesTracker
from ..parallel.state import ParallelDims


def rank_prefix(dims: ParallelDims, kind: str = "rng") -> str:
    tp, cp, dp, pp = dims.coords()
    return f"{kind}/tp{tp}_cp{cp}_dp{dp}_pp{pp}"


def capture(dims: ParallelDims, tracker: RNGStatesTracker) -> Dict[str, torch.Tensor]:
    prefix = rank_prefix(dims)
    out = {f"{prefix}/cpu": torch.get_rng_state()}
    if tracker.device.type == "cuda":
        out[f"{prefix}/cuda"] = torch.cuda.get_rng_state(tracker.device).cpu()
    for name, state in tracker.get_states().items():
        out[f"{prefix}/tracker/{name}"] = state.cpu()
    return out


def restore(states: Dict[str, torch.Tensor], dims: ParallelDims, tracker: RNGStatesTracker) -> None:
    """`states` as returned by capture() (keys with this rank's prefix)."""
    prefix = rank_prefix(dims)
    torch.set_rng_state(states[f"{prefix}/cpu"])
    if tracker.device.type == "cuda" and f"{prefix}/cuda" in states:
        torch.cuda.set_rng_state(states[f"{prefix}/cuda"], tracker.device)
    tracked = {k[len(prefix) + len("/tracker/"):]: v for k, v in states.items()
               if k.startswith(f"{prefix}/tracker/")}
    tracker.set_states(tracked)
