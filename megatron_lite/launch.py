"""The shape of a command-line entry point run under torchrun (tools/generate.py, tools/evaluate.py).

Flags are resolved first, on every rank alike, so a bad command line is one line on stderr and
exit status 2 before any process group exists. Then the ranks join the world (NCCL on GPUs, gloo
on CPU) and the work runs; a ConfigError found then is raised on every rank alike (loading goes
through `agree_on_errors`), printed once, and every rank exits 2 together.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Callable, Optional, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def _report(error: ConfigError, rank: int) -> None:
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)


def launch(resolve: Callable[[], T], device_of: Callable[[T], Optional[str]], work: Callable[[T, object], None],
           timeout_of: Callable[[T], Optional[float]] = lambda setup: None) -> int:
    """resolve() -> setup (raises ConfigError); work(setup, device) in the world, whose collectives
    time out after timeout_of(setup) minutes (None: torch's default). Exit status."""
    try:
        setup = resolve()
    except ConfigError as e:
        _report(e, int(os.environ.get("RANK", "0")))
        return 2
    import torch.distributed as dist

    from .training.loop import choose_device, init_distributed

    device = choose_device(device_of(setup))
    init_distributed(device, timeout_of(setup))
    try:
        work(setup, device)
    except ConfigError as e:
        _report(e, dist.get_rank() if dist.is_initialized() else 0)
        if dist.is_initialized():
            dist.barrier()  # exit together, so that the launcher sees every rank exit 2
        return 2
    except RuntimeError as e:
        if not (isinstance(e, dist.DistError) or "/gloo/" in str(e)):
            raise
        # A peer died or did not answer in time: every surviving rank says so (which ones survive
        # is unknown), exit 1 so that torchrun restarts the job from the last checkpoint.
        what = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()[0]
        print(f"error: [rank {dist.get_rank()}] a collective failed: {what}: a peer rank died or did not answer "
              f"in time (--distributed-timeout-minutes); restart from the last checkpoint", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def is_printing_rank() -> bool:
    """Rank 0 of the world (or a single process): the one that writes to stdout."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
