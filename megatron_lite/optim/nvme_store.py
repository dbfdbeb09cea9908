"""NVMe offload of the optimizer (--optimizer-offload-nvme-path DIR): each bucket shard's fp32 main
params and update-rule states live in one file per rank under DIR, not in memory.

The file holds one region per bucket shard, [main | state 1 | state 2 ...] in fp32, each region
starting on a 4 KiB boundary (O_DIRECT). Two staging buffers (pinned beside a GPU) each hold the
largest region plus its gradient: while bucket k is updated in one, an I/O thread reads bucket
k+1 into the other; after the update bucket k is written back behind it. The thread runs its jobs
in order, so a buffer is written out before the read that reuses it, and the last write of a step
overlaps the next forward/backward. Memory held = the two buffers.

Writes bypass the page cache with O_DIRECT where the file system allows it; elsewhere they are
buffered, then fdatasync'ed and dropped from the page cache (POSIX_FADV_DONTNEED), so that the
cache does not keep a second copy of the state in host memory. Durability is not what the sync is
for: the file is scratch, rebuilt from the checkpoint after a crash.

Checkpoints read the state from the file through a memory map (nothing extra held); a load fills
fp32 copies, then writes them to the file through a staging buffer."""
from __future__ import annotations

import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import ConfigError
from ..parallel.bucket_plan import NVME_ALIGN as ALIGN, region_bytes, slot_bytes

_OPEN_PATHS: set = set()  # files of this process (several optimizers may live in one test process)


def _aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def _rank_file(directory: str, rank: int) -> str:
    path, k = os.path.join(directory, f"optimizer-state-rank{rank:05d}.bin"), 0
    while path in _OPEN_PATHS:
        k += 1
        path = os.path.join(directory, f"optimizer-state-rank{rank:05d}-{k}.bin")
    return path


def _open(path: str, nbytes: int, flag: str):
    """(fd, direct): the file created at `nbytes`, opened with O_DIRECT where the file system takes it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        have = os.path.getsize(path) if os.path.exists(path) else 0
        free = shutil.disk_usage(os.path.dirname(path)).free + have
    except OSError as e:
        raise ConfigError(f"{flag} {os.path.dirname(path)}: {e.strerror}; give a writable directory") from e
    if free < nbytes:
        raise ConfigError(f"{flag} {os.path.dirname(path)} has {free / 2**20:.1f} MiB free but this rank's "
                          f"optimizer state needs {nbytes / 2**20:.1f} MiB there: free space or give another directory")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    for direct in (True, False):
        try:
            fd = os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o600)
            break
        except PermissionError as e:
            raise ConfigError(f"{flag} {os.path.dirname(path)} is not writable ({e.strerror}): give a writable "
                              f"directory") from e
        except OSError:
            if not direct:
                raise
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve the space now: a full disk fails here, not mid-run
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise ConfigError(f"{flag} {os.path.dirname(path)}: cannot reserve {nbytes / 2**20:.1f} MiB ({e.strerror}); "
                          f"free space or give another directory") from e
    return fd, direct and bool(getattr(os, "O_DIRECT", 0))


def _close(fd: int, path: str, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
    _OPEN_PATHS.discard(path)
    if os.path.exists(path):
        os.unlink(path)


class NvmeSpill:
    """This rank's optimizer file, its two staging buffers and its I/O thread, for the bucket shards
    of one DistributedOptimizer (in order); `bytes_read` / `bytes_written` count the file traffic."""

    def __init__(self, directory: str, rank: int, shard_numels: Sequence[int], names: Sequence[str],
                 pin: bool, flag: str = "--optimizer-offload-nvme-path"):
        self.names, self.numels = tuple(names), list(shard_numels)
        self.sizes = [region_bytes(n, len(self.names)) for n in self.numels]
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.file_bytes = sum(self.sizes)
        self.path = _rank_file(directory, rank)
        self.fd, self.direct = _open(self.path, self.file_bytes, flag)
        _OPEN_PATHS.add(self.path)
        self.slots = [_aligned_buffer(slot_bytes(self.numels, len(self.names)), pin) for _ in range(2)]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")  # one thread: jobs in order
        self._finalizer = weakref.finalize(self, _close, self.fd, self.path, self.pool)
        self.pending: List[Future] = []
        self.bytes_read = self.bytes_written = 0
        self._map: Optional[torch.Tensor] = None

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
    def _io(self, write: bool, k: int, slot: int) -> None:
        view = memoryview(self.slots[slot][:self.sizes[k]].numpy())
        done, offset = 0, self.offsets[k]
        while done < len(view):
            part = view[done:]
            n = os.pwritev(self.fd, [part], offset + done) if write else os.preadv(self.fd, [part], offset + done)
            if n <= 0:
                raise OSError(f"{'write to' if write else 'read from'} {self.path} stopped at byte {offset + done}")
            done += n
        if write and not self.direct:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, self.sizes[k], os.POSIX_FADV_DONTNEED)
        if write:
            self.bytes_written += done
        else:
            self.bytes_read += done

    def _submit(self, fn: Callable, *args) -> Future:
        future = self.pool.submit(fn, *args)
        self.pending.append(future)
        return future

    def read(self, k: int, slot: int) -> Future:
        return self._submit(self._io, False, k, slot)

    def write(self, k: int, slot: int, event=None) -> Future:
        def job():
            if event is not None:  # the device's copies out of this buffer (publish) come first
                event.synchronize()
            self._io(True, k, slot)
        return self._submit(job)

    def drain(self) -> None:
        """Wait for every queued read and write; an I/O error surfaces here."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    # --- the file seen whole (checkpoints, start-up) ------------------------------------------------
    def mapped(self, k: int) -> Dict[str, torch.Tensor]:
        """Shard k's tensors, to read, as views of a private memory map of the file (nothing held
        beyond the page cache); dropped by `unmap()` before the next direct I/O."""
        if self._map is None:
            self.drain()
            self._map = torch.from_file(self.path, shared=False, size=self.file_bytes // 4, dtype=torch.float32)
        n, at = self.numels[k], self.offsets[k] // 4
        return {name: self._map[at + i * n:at + (i + 1) * n] for i, name in enumerate(self.names)}

    def unmap(self) -> None:
        self._map = None

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
        self.unmap()
        self.drain()
        self._finalizer()


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
