"""The shape of a command-line entry point run under torchrun (tools/generate.py, tools/evaluate.py).

Flags are resolved first, on every rank alike, so a bad command line is one line on stderr and
exit status 2 before any process group exists. Then the ranks join the world (NCCL on GPUs, gloo
on CPU) and the work runs; a ConfigError found then is raised on every rank alike (loading goes
through `agree_on_errors`), printed once, and every rank exits 2 together. A collective that fails
because a peer died or did not answer in time ends each surviving rank with one line naming the
operation, its group and the rank(s) that did not answer (parallel/peers.py), and exit 1, which
torchrun restarts.
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


REPORT_WINDOW_S = 10.0  # at most this long a failed rank waits to hear which peers failed too


def _peer_failure(e: RuntimeError, timeout_minutes: Optional[float]) -> str:
    """What failed and, where that can be known, which ranks did not answer."""
    import torch.distributed as dist

    from .parallel.comm import CollectiveError
    from .parallel.peers import not_heard_from

    if not isinstance(e, CollectiveError):  # outside the communicator (pipeline sends, start-up)
        what = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()[0]
        return (f"a collective failed: {what}: a peer rank died or did not answer in time "
                "(--distributed-timeout-minutes)")
    window = min(REPORT_WINDOW_S, 60 * timeout_minutes) if timeout_minutes else REPORT_WINDOW_S
    missing = not_heard_from(e.ranks, dist.get_rank(), e.entered, e.failed, window)
    if missing is None:
        who = "a peer rank died or did not answer in time (--distributed-timeout-minutes)"
    elif missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of the group did not answer "
               f"in time (dead, or hung past --distributed-timeout-minutes)")
    else:
        who = "every other rank of the group entered it in time and failed too"
    return f"a collective failed: {e}: {who}"


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

    from .parallel.comm import is_peer_failure
    from .parallel.state import choose_device, init_distributed

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
        if not is_peer_failure(e):
            raise
        # A peer died or did not answer in time: every surviving rank says so in one line, exit 1
        # so that torchrun restarts the job from the last checkpoint.
        print(f"error: [rank {dist.get_rank()}] {_peer_failure(e, timeout_of(setup))}; restart from the last "
              f"checkpoint", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def is_printing_rank() -> bool:
    """Rank 0 of the world (or a single process): the one that writes to stdout."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
