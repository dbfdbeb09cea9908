"""ZeRO-Infinity's parameter offload (--param-offload-nvme-path DIR, ZeRO-3): this rank's param
shards (working precision) live in one file per rank under DIR, not in memory.

The file holds each bucket's shard, padded to 4 KiB (O_DIRECT), in bucket order, so that a unit's
buckets (dense, then experts) are one contiguous span. Two staging buffers each hold the largest
unit's span. A unit's all-gather reads from a buffer: `acquire` waits for the span's read (or
reads it now), the gather is issued, and `release` hands the buffer back once the gather has
completed; meanwhile `prefetch` has the I/O thread read the unit that comes next (zero3.py knows
which: forward order in forward, reverse in backward) into the other buffer. Nothing is cached
across gathers: each gather of a unit reads its span once, which is the traffic the tests count.

The optimizer step writes each updated shard back (write-behind): `updating(k)` lends a buffer
that the update's publish fills, then queues its write; the buffer is reused two buckets later,
after that write. Reads queued later on the one I/O thread see the written shard.

Beside a GPU the buffers are pinned host memory and a gather copies its shards to the device just
before the collective (transient). Checkpoints and start-up read shards through `read_copy`
(fresh tensors) and `store` writes filled ones."""
from __future__ import annotations

import contextlib
from contextlib import contextmanager
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence

import torch

from .bucket_plan import BucketPlan, param_region_bytes, param_spans, with_param_offload
from ..errors import agree_on_errors
from .nvme_file import NvmeFile, aligned_buffer

FLAG = "--param-offload-nvme-path"


def place_params(directory: Optional[str], buckets, plans: Sequence[BucketPlan]):
    """ZeRO-3's param shards of `buckets` moved into this rank's file under `directory` (collective:
    a full or unwritable directory on any rank is every rank's one-line error), or left in memory."""
    if not directory:
        return ParamsInMemory()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    device = buckets[0].device if buckets else torch.device("cpu")
    spill = agree_on_errors(lambda: ParamSpill(directory, rank, plans, device))
    for b in buckets:
        spill.store(b.index, b.param_shard)
        b.param_shard, b.home = None, spill
    return spill


class ParamsInMemory:
    """Where the param shards live unless --param-offload-nvme-path puts them in a file: the
    bucket's own tensors. ParamSpill has the same interface, the only one GradientSync and the
    optimizer use; here each call has nothing to do."""
    nvme = copies = False  # (copies: shard_view() is a fresh copy each time)
    shard_view = staticmethod(lambda b: b.param_data[b.shard])
    checkpoint_shard = staticmethod(lambda b, for_loading: b.param_shard)
    update_into = staticmethod(lambda b, n: contextlib.nullcontext())
    accounted = staticmethod(lambda acc, plans, optimizer_nvme, offloaded=None: acc)
    held_bytes = staticmethod(lambda: {})
    commit_loaded = staticmethod(lambda buckets: None)
    describe = staticmethod(lambda: None)


class ParamSpill:
    """This rank's param-shard file and its two staging buffers, for the buckets `plans` (a
    GradientSync's, in order) on `device`; units are param_spans(plans), by index."""

    def __init__(self, directory: str, rank: int, plans: Sequence[BucketPlan], device: torch.device):
        self.plans, self.device = list(plans), device
        self.sizes = [param_region_bytes(b) for b in self.plans]
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.spans = param_spans(self.plans)
        self.span_of = {j: u for u, span in enumerate(self.spans) for j in span}
        self.file = NvmeFile(directory, "param-shards", rank, sum(self.sizes), FLAG, "parameter shards")
        largest = max((self._span_bytes(u) for u in range(len(self.spans))), default=0)
        pin = device.type == "cuda"
        self.slots = [aligned_buffer(largest, pin) for _ in range(2)]
        self.slot_unit: List[Optional[int]] = [None, None]  # the unit read (or being read) into each buffer
        self.slot_read: List[Optional[Future]] = [None, None]
        self.slot_busy = [False, False]  # a gather reads from it
        self.slot_write: List[Optional[Future]] = [None, None]  # the step's write-back out of it

    path = property(lambda self: self.file.path)
    direct = property(lambda self: self.file.direct)
    file_bytes = property(lambda self: self.file.file_bytes)

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _span_bytes(self, u: int) -> int:
        return sum(self.sizes[j] for j in self.spans[u])

    def _view(self, buffer: torch.Tensor, k: int, at: int) -> torch.Tensor:
        """Bucket k's shard in `buffer`, starting `at` bytes in."""
        b = self.plans[k]
        elt = torch.empty((), dtype=b.dtype).element_size()
        return buffer[at:at + b.shard_numel * elt].view(b.dtype)

    # --- gathers -------------------------------------------------------------------------------
    def prefetch(self, u: int) -> bool:
        """Queue the read of unit u into a buffer no gather uses (an empty one first); False when
        both are in use."""
        if u in self.slot_unit:
            return True
        free = [s for s in (0, 1) if not self.slot_busy[s]]
        if not free:
            return False
        s = next((s for s in free if self.slot_unit[s] is None), free[0])
        self.file.unmap()
        first = self.spans[u][0]
        self.slot_unit[s] = u
        self.slot_read[s] = self.file.read(self.slots[s][:self._span_bytes(u)], self.offsets[first])
        return True

    def acquire(self, u: int) -> Dict[int, torch.Tensor]:
        """Bucket index -> its shard (on the device), read for unit u's all-gather; the buffer is
        the gather's until `release(u)`."""
        if self.prefetch(u):
            s = self.slot_unit.index(u)
            self.slot_read[s].result()
            self.slot_busy[s] = True
            buffer = self.slots[s]
        else:  # both buffers feed gathers in flight (interleaved schedules): a transient one
            buffer = aligned_buffer(self._span_bytes(u), False)
            self.file.read(buffer, self.offsets[self.spans[u][0]]).result()
        out, at = {}, 0
        for k in self.spans[u]:
            view = self._view(buffer, k, at)
            # (a blocking copy: the buffer is read into again once the gather is waited for, which
            # on a GPU does not wait for the host)
            out[k] = view if self.device.type != "cuda" else view.to(self.device)
            at += self.sizes[k]
        return out

    def release(self, u: int) -> None:
        """Unit u's gather has completed: its buffer may be read into again."""
        if u in self.slot_unit:
            s = self.slot_unit.index(u)
            self.slot_unit[s], self.slot_read[s], self.slot_busy[s] = None, None, False

    # --- updates, start-up and checkpoints ---------------------------------------------------------
    def _settle(self) -> None:
        """Drop what the buffers hold (stale once a shard is written) and wait for queued I/O."""
        assert not any(self.slot_busy), "a gather is in flight while the param shards are written"
        self.slot_unit, self.slot_read = [None, None], [None, None]
        self.file.unmap()
        self.file.drain()

    @contextmanager
    def updating(self, k: int, n: int):
        """Bucket k's shard (the n-th written this step) in a buffer, for the update to overwrite
        whole; written back behind it on exit."""
        if n == 0:
            self._settle()
        s = n % 2
        if self.slot_write[s] is not None:
            self.slot_write[s].result()  # the buffer's previous write-back
        view = self._view(self.slots[s], k, 0)
        view.zero_()  # the padding past the last parameter stays zero
        yield view
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.slot_write[s] = self.file.write(self.slots[s][:self.sizes[k]], self.offsets[k], event)

    def read_copy(self, k: int) -> torch.Tensor:
        """Bucket k's shard as a fresh tensor on the device (after every queued write)."""
        buf = aligned_buffer(self.sizes[k], False)
        self.file.read(buf, self.offsets[k]).result()
        return self._view(buf, k, 0).to(self.device)

    def store(self, k: int, shard: torch.Tensor) -> None:
        """Write bucket k's shard (its values) to the file, through a staging buffer, and wait."""
        with self.updating(k, 0) as view:
            view.copy_(shard.reshape(-1))
        self.drain()

    def drain(self) -> None:
        self.file.drain()
        self.slot_write = [None, None]

    def close(self) -> None:
        self.file.close()

    # --- the interface of where param shards live (ParamsInMemory) ----------------------------------
    nvme = copies = True

    def shard_view(self, b) -> torch.Tensor:
        return self.read_copy(b.index)

    def checkpoint_shard(self, b, for_loading: bool) -> torch.Tensor:
        """A copy; a filled one goes to the file at commit_loaded."""
        shard = self.read_copy(b.index)
        b.loaded_shard = shard if for_loading else None
        return shard

    @contextmanager
    def update_into(self, b, n: int):
        """The optimizer's update of bucket b (the n-th written this step) goes to a staging buffer."""
        with self.updating(b.index, n) as shard:
            b.param_shard = shard
            try:
                yield
            finally:
                b.param_shard = None

    def accounted(self, acc: Dict[str, int], plans, optimizer_nvme: bool, offloaded=None) -> Dict[str, int]:
        return with_param_offload(acc, plans, optimizer_nvme, offloaded)

    def held_bytes(self) -> Dict[str, int]:
        """The shards are in the file; the staging buffers are held."""
        return {"param_staging_bytes": self.staging_bytes, "param_nvme_bytes": self.file_bytes}

    def commit_loaded(self, buckets) -> None:
        for b in buckets:
            if b.loaded_shard is not None:
                self.store(b.index, b.loaded_shard)
                b.loaded_shard = None

    def describe(self) -> str:
        return self.file.describe("parameter shards", self.staging_bytes)
