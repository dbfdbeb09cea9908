"""Which peers of a failed collective did not answer: each surviving rank reports its failure in
the world's key-value store (torchrun's agent store, or init_process_group's) with the time it
entered the collective, then waits a little for the other ranks of the group to report theirs. A
rank that does not report is dead, or hung elsewhere; one that entered the collective only after
this rank had given up on it was late (a hang it woke from). gloo's and NCCL's own errors name an
address at best, never a rank."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from typing import List, Optional

import torch.distributed as dist

KEY = "megatron_lite/collective_failed"


def not_heard_from(ranks: List[int], rank: int, entered: float, failed: float, window_s: float) -> Optional[List[int]]:
    """The ranks of `ranks` (other than `rank`) that did not report a failure within `window_s`
    seconds, or entered the collective after `failed` (this rank's time of failure; wall clock, as
    `entered`); None when the store cannot be reached (e.g. it lived on the node that died). Each
    process reports once: it exits after a failed collective."""
    with _without_store_noise():
        return _not_heard_from(ranks, rank, entered, failed, window_s)


def _not_heard_from(ranks, rank, entered, failed, window_s):
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{KEY}/{rank}", repr(entered))
        deadline = time.monotonic() + window_s
        while True:
            missing = [r for r in ranks if r != rank and not store.check([f"{KEY}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        late = [r for r in ranks if r != rank and r not in missing and float(store.get(f"{KEY}/{r}")) > failed]
        return sorted(missing + late)
    except Exception:  # noqa: BLE001 (any failure of the store: the answer is unknown)
        return None


# What torch's C++ side writes to stderr when the store's host is gone: a c10d warning from
# TCPStore.cpp with the exception's C++ stack ("Exception raised from sendBytes ...", frame #0-#22).
_STORE_NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WE]\d{4} .*(TCPStore|socket)\.cpp|^Exception raised from |^frame #\d+: "
                          r"|^<omitting python frames>$|^$")


@contextlib.contextmanager
def _without_store_noise():
    """Runs the block with the process's stderr (fd 2, where C++ logs) in a file, then writes back
    what it caught except the store's C++ failure report: the error line names the lost rank."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not _STORE_NOISE.match(line.rstrip("\n"))]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
