"""Fault injection for the crash tests: kill this process with SIGKILL at a named point.

`MEGATRON_LITE_FAULT=<point>:<iteration>:<rank>` kills global rank <rank> at <point> of
iteration <iteration>: "save" (its checkpoint file half written), "commit" (rank 0: the checkpoint
complete but not yet named by the tracker file) or "iteration" (the end of the iteration). Only the first attempt of a torchrun job dies (TORCHELASTIC_RESTART_COUNT 0 or
unset), so that a restarted job can run through. Unset, this costs one dictionary lookup.
"""
from __future__ import annotations

import os
import signal

_iteration = 0


def set_iteration(iteration: int) -> None:
    global _iteration
    _iteration = iteration


def fault_point(point: str, flush=None) -> None:
    spec = os.environ.get("MEGATRON_LITE_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    name, iteration, rank = spec.split(":")
    if name == point and int(iteration) == _iteration and int(rank) == int(os.environ.get("RANK", "0")):
        if flush is not None:
            flush.flush()
        os.kill(os.getpid(), signal.SIGKILL)
