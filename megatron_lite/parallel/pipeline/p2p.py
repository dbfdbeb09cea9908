"""Point-to-point transfers between pipeline stages: one batch_isend_irecv per batch of actions."""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from ..comm import Communicator


class P2PBatch:
    """Posted sends/receives of one batch. `wait()` completes them (keeps sent tensors alive)."""

    def __init__(self, ops: List[Tuple[str, torch.Tensor, int]], comm: Communicator, group=None):
        self.tensors = [t for _, t, _ in ops]
        p2p_ops = []
        for kind, tensor, peer in ops:
            if kind == "send":  # bytes sent by this rank (a receive is its peer's send)
                comm.record_p2p(tensor)
            p2p_ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer))
        self.works = comm.batch_p2p(p2p_ops, group)  # group: for the line that names a failure

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []
