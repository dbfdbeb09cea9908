"""The shape of a command-line entry point run under torchrun (tools/generate.py, tools/evaluate.py).

Flags are resolved first, on every rank alike, so a bad command line is one line on stderr and
exit status 2 before any process group exists (printed by rank 0, which the other ranks wait
for). Then the ranks join the world (NCCL on GPUs, gloo on CPU) and the work runs; a ConfigError
found then is raised on every rank alike (loading goes through `agree_on_errors`), printed once,
and every rank exits 2 together. A collective that fails because a peer died or did not answer
in time ends each surviving rank with one line naming the operation, its group and the rank(s)
that did not answer (parallel/peers.py), and exit 1, which torchrun restarts.
"""
from __future__ import annotations

import os
import re
import sys
import time
from typing import Callable, Optional, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def _report(error: ConfigError, rank: int) -> None:
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)


UNEVEN_ERROR_WAIT_S = 60.0  # how long a rank waits for rank 0 to report a start-up error it found too


def _report_before_world(error: ConfigError) -> None:
    """A ConfigError found before the process group exists. Every rank resolves the same flags and
    finds the same error, and rank 0 prints it. The others must not exit first: torchrun would end
    rank 0 before it prints. So they wait, and torchrun ends them once rank 0 has printed and exited.
    A rank still alive after the wait found an error rank 0 did not (a file missing on its node):
    it prints that one itself, naming the rank."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or world == 1:
        _report(error, 0)
        return
    time.sleep(UNEVEN_ERROR_WAIT_S)
    print(f"error: [rank {rank}] {error}", file=sys.stderr, flush=True)


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
        who = _store_lost()
    elif missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of the group did not answer "
               f"in time (dead, or hung past --distributed-timeout-minutes)")
    else:
        who = "every other rank of the group entered it in time and failed too"
    return f"a collective failed: {e}: {who}"


def _store_lost() -> str:
    """Who is gone when the job's store cannot be reached either: the store lives with rank 0 (its
    process, or under torchrun its node's agent: node 0 of a static rendezvous, which holds rank 0)."""
    where = f" ({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})" if "MASTER_ADDR" in os.environ else ""
    return f"rank 0 did not answer: it died, with the job's store{where} that its node hosts"


def launch(resolve: Callable[[], T], device_of: Callable[[T], Optional[str]], work: Callable[[T, object], None],
           timeout_of: Callable[[T], Optional[float]] = lambda setup: None) -> int:
    """resolve() -> setup (raises ConfigError); work(setup, device) in the world, whose collectives
    time out after timeout_of(setup) minutes (None: torch's default). Exit status."""
    try:
        setup = resolve()
    except ConfigError as e:
        _report_before_world(e)
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
