"""The shape of a command-line entry point run under torchrun (tools/generate.py, tools/evaluate.py).

Flags are resolved first, on every rank alike, so a bad command line is one line on stderr and
exit status 2 before any process group exists. Then the ranks join the world (NCCL on GPUs, gloo
on CPU) and the work runs; a ConfigError found then is raised on every rank alike (loading goes
through `agree_on_errors`), printed once, and every rank exits 2 together.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def _report(error: ConfigError, rank: int) -> None:
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)


def launch(resolve: Callable[[], T], device_of: Callable[[T], Optional[str]], work: Callable[[T, object], None]) -> int:
    """resolve() -> setup (raises ConfigError); work(setup, device) in the world. Exit status."""
    try:
        setup = resolve()
    except ConfigError as e:
        _report(e, int(os.environ.get("RANK", "0")))
        return 2
    import torch.distributed as dist

    from .training.loop import choose_device, init_distributed

    device = choose_device(device_of(setup))
    init_distributed(device)
    try:
        work(setup, device)
    except ConfigError as e:
        _report(e, dist.get_rank() if dist.is_initialized() else 0)
        if dist.is_initialized():
            dist.barrier()  # exit together, so that the launcher sees every rank exit 2
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def is_printing_rank() -> bool:
    """Rank 0 of the world (or a single process): the one that writes to stdout."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
