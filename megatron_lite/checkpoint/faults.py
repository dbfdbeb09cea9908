"""Fault injection for the crash tests: one hook that kills this process with SIGKILL at a named
point of a named iteration.

`MEGATRON_LITE_FAULT=<point>:<iteration>:<rank>` kills global rank <rank> at <point> of iteration
<iteration>: "save" (its checkpoint file half written), "local" (its local checkpoint's file half
written), "commit" (rank 0: the checkpoint complete but not yet named by the tracker file) or
"iteration" (the end of the iteration). Only the first attempt of a torchrun job dies (TORCHELASTIC_RESTART_COUNT 0 or unset), so that a restarted job can
run through. `fault_hook()` is None when unset: the checkpointing code then calls nothing.
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Optional

FaultHook = Callable[..., None]  # hook(point, iteration, file_to_flush=None)


def fault_hook(rank: int) -> Optional[FaultHook]:
    spec = os.environ.get("MEGATRON_LITE_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    point, iteration, victim = spec.split(":")
    if int(victim) != rank:
        return None

    def hook(at: str, it: int, flush=None) -> None:
        if at == point and it == int(iteration):
            if flush is not None:
                flush.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
