"""NVMe offload of the optimizer (--optimizer-offload-nvme-path DIR): each bucket shard's fp32 main
params and update-rule states live in one file per rank under DIR, not in memory.

The file holds one region per bucket shard, [main | state 1 | state 2 ...] in fp32, each region
starting on a 4 KiB boundary (O_DIRECT). Two staging buffers (pinned beside a GPU) each hold the
largest region plus its gradient: while bucket k is updated in one, an I/O thread reads bucket
k+1 into the other; after the update bucket k is written back behind it. The thread runs its jobs
in order, so a buffer is written out before the read that reuses it, and the last write of a step
overlaps the next forward/backward. Memory held = the two buffers.

The file, its direct or page-cache-dropping writes and the I/O thread are parallel/nvme_file.py's
(shared with ZeRO-3's parameter offload, parallel/param_offload.py).

Checkpoints read the state from the file through a memory map (nothing extra held); a load fills
fp32 copies, then writes them to the file through a staging buffer."""
from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..parallel.bucket_plan import region_bytes, slot_bytes
from ..parallel.nvme_file import NvmeFile, aligned_buffer


class NvmeSpill:
    """This rank's optimizer file (parallel/nvme_file.py: its I/O thread, `bytes_read` /
    `bytes_written`), and its two staging buffers, for the bucket shards of one
    DistributedOptimizer (in order): the placement of its state (state_store.InMemory's interface)."""
    nvme = True

    def __init__(self, directory: str, rank: int, shard_numels: Sequence[int], names: Sequence[str],
                 pin: bool, flag: str = "--optimizer-offload-nvme-path"):
        self.names, self.numels = tuple(names), list(shard_numels)
        self.sizes = [region_bytes(n, len(self.names)) for n in self.numels]
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.file = NvmeFile(directory, "optimizer-state", rank, sum(self.sizes), flag, "optimizer state")
        self.slots = [aligned_buffer(slot_bytes(self.numels, len(self.names)), pin) for _ in range(2)]

    path = property(lambda self: self.file.path)
    direct = property(lambda self: self.file.direct)
    file_bytes = property(lambda self: self.file.file_bytes)
    bytes_read = property(lambda self: self.file.bytes_read)
    bytes_written = property(lambda self: self.file.bytes_written)

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def views(self, k: int, slot: int) -> Dict[str, torch.Tensor]:
        """Shard k's tensors, and its 'grad', in staging buffer `slot`."""
        n, buf = self.numels[k], self.slots[slot]
        flat = buf[:len(self.names) * 4 * n].view(torch.float32)
        out = {name: flat[i * n:(i + 1) * n] for i, name in enumerate(self.names)}
        grad_at = self.sizes[k]
        out["grad"] = buf[grad_at:grad_at + 4 * n].view(torch.float32)
        return out

    # --- file I/O (on the I/O thread) --------------------------------------------------------------
    def read(self, k: int, slot: int) -> Future:
        return self.file.read(self.slots[slot][:self.sizes[k]], self.offsets[k])

    def write(self, k: int, slot: int, event=None) -> Future:
        """Behind the device's copies out of this buffer (publish, `event`)."""
        return self.file.write(self.slots[slot][:self.sizes[k]], self.offsets[k], event)

    def drain(self) -> None:
        """Wait for every queued read and write; an I/O error surfaces here."""
        self.file.drain()

    # --- the file seen whole (checkpoints, start-up) ------------------------------------------------
    def mapped(self, k: int) -> Dict[str, torch.Tensor]:
        """Shard k's tensors, to read, as views of a private memory map of the file (nothing held
        beyond the page cache); dropped by `unmap()` before the next direct I/O."""
        whole = self.file.mapped(torch.float32)
        n, at = self.numels[k], self.offsets[k] // 4
        return {name: whole[at + i * n:at + (i + 1) * n] for i, name in enumerate(self.names)}

    def unmap(self) -> None:
        self.file.unmap()

    def store(self, k: int, values: Dict[str, torch.Tensor]) -> None:
        """Write shard k's tensors (fp32, by name) to the file, through staging buffer 0, and wait."""
        self.unmap()
        self.drain()
        views = self.views(k, 0)
        for name in self.names:
            views[name].copy_(values[name])
        self.write(k, 0)
        self.drain()

    def close(self) -> None:
        self.file.close()

    # --- the placement interface (state_store.py) --------------------------------------------------
    def store_for(self, k: int):
        return functools.partial(NvmeStore, self, k)

    def update_all(self, stores, grads, update) -> None:
        update_all(self, stores, grads, update)

    def held_bytes(self, shards) -> Dict[str, int]:
        """The state is in the file; the staging buffers are what is held."""
        return {"optimizer_staging_bytes": self.staging_bytes, "optimizer_nvme_bytes": self.file_bytes}

    def loading_copies(self, tensors: Dict[str, torch.Tensor], plain: bool):
        """fp32 copies of the mapped file, written to it by commit_loaded (what a load leaves keeps its value)."""
        return {k: v.clone() for k, v in tensors.items()}, True

    def commit_loaded(self, k: int, shard) -> None:
        self.store(k, shard.staged)

    def describe(self) -> str:
        return self.file.describe("optimizer state", self.staging_bytes)


class NvmeStore:
    """One bucket shard's state in the spill's file (state_store.py's interface): `tensors` are the
    staging views while the shard is resident (`resident`, set by `update_all`), else read-only
    views of the file's memory map."""
    on_host, staging_bytes = True, 0  # the spill's buffers are counted once, by the optimizer

    def __init__(self, spill: NvmeSpill, index: int, shard: torch.Tensor, state_names, segments, precision):
        self.spill, self.index = spill, index
        self.resident: Optional[Dict[str, torch.Tensor]] = None
        self.event = None
        zero = torch.zeros((), dtype=torch.float32)
        spill.store(index, {"main": shard.detach().reshape(-1), **{name: zero for name in state_names}})

    @property
    def tensors(self) -> Dict[str, torch.Tensor]:
        return self.resident if self.resident is not None else self.spill.mapped(self.index)

    def publish(self, param: torch.Tensor, main: torch.Tensor) -> None:
        param.copy_(main, non_blocking=True)
        if param.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()


def update_all(spill: NvmeSpill, stores: List[NvmeStore], grads: List[torch.Tensor],
               update: Callable[[int, torch.Tensor], None]) -> None:
    """`update(k, grad)` of every shard in turn with its state resident in a staging buffer: shard
    k+1 is read while k updates, k is written back behind it."""
    spill.unmap()
    spill.drain()  # the previous step's last write-back (it overlapped this step's forward/backward)
    if not stores:
        return
    reading = spill.read(0, 0)
    for k, (store, grad) in enumerate(zip(stores, grads)):
        reading.result()
        if k + 1 < len(stores):
            reading = spill.read(k + 1, (k + 1) % 2)
        views = spill.views(k, k % 2)
        views["grad"].copy_(grad)
        store.resident, store.event = {name: views[name] for name in spill.names}, None
        try:
            update(k, views["grad"])
        finally:
            store.resident = None
        spill.write(k, k % 2, store.event)
