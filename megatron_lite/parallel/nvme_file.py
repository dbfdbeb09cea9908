"""One scratch file per rank on a fast local disk, with one I/O thread: what the NVMe offloads share
(the optimizer's, optim/nvme_store.py, and ZeRO-3's parameters, param_offload.py).

Reads and writes move a contiguous byte range between the file and an aligned staging buffer. They
bypass the page cache with O_DIRECT where the file system allows it; elsewhere writes are buffered,
then fdatasync'ed and dropped from the page cache (POSIX_FADV_DONTNEED), so that the cache does not
keep a second copy in host memory. Durability is not what the sync is for: the file is scratch,
rebuilt from the checkpoint after a crash. The thread runs its jobs in order, so a buffer written
out and then read into again is safe without further waiting. The file's space is reserved at
start-up (fallocate): a full disk is a one-line error there, not a failure mid-run."""
from __future__ import annotations

import fcntl
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

import torch

from ..errors import ConfigError
from .bucket_plan import NVME_ALIGN as ALIGN



def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of uint8 starting on an ALIGN boundary (O_DIRECT's rule), pinned beside a GPU."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def _open_here(path: str) -> bool:
    """Whether this process has `path` open (several offloads may live in one test process); the OS
    knows, so no registry is kept (where /proc is missing: never, and a second one is refused)."""
    fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []
    return any(os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path) for fd in fds)


def _rank_file(directory: str, stem: str, rank: int) -> str:
    path, k = os.path.join(directory, f"{stem}-rank{rank:05d}.bin"), 0
    while _open_here(path):
        k += 1
        path = os.path.join(directory, f"{stem}-rank{rank:05d}-{k}.bin")
    return path


def _open(path: str, nbytes: int, flag: str, what: str):
    """(fd, direct): the file created at `nbytes`, opened with O_DIRECT where the file system takes it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        have = os.path.getsize(path) if os.path.exists(path) else 0
        free = shutil.disk_usage(os.path.dirname(path)).free + have
    except OSError as e:
        raise ConfigError(f"{flag} {os.path.dirname(path)}: {e.strerror}; give a writable directory") from e
    if free < nbytes:
        raise ConfigError(f"{flag} {os.path.dirname(path)} has {free / 2**20:.1f} MiB free but this rank's "
                          f"{what} needs {nbytes / 2**20:.1f} MiB there: free space or give another directory")
    flags = os.O_RDWR | os.O_CREAT  # (truncated once locked: the file may be another live job's)
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
    try:  # one job per file: two jobs given one DIR would read and write each other's state
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (released when the process dies: kill -9 included)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"{flag} {os.path.dirname(path)}: {os.path.basename(path)} is in use by another "
                          f"running job: give each job its own directory") from e
    os.ftruncate(fd, 0)  # (a killed run's leftover file: scratch)
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
    if os.path.exists(path):  # before the close drops the lock: the name may be another job's after it
        os.unlink(path)
    os.close(fd)


class NvmeFile:
    """This rank's file `<stem>-rankNNNNN.bin` under `directory` (`file_bytes` long, removed when the
    owner goes) and its I/O thread; `bytes_read` / `bytes_written` count the traffic. `flag` and
    `what` name the option and its contents in the one-line start-up errors."""

    def __init__(self, directory: str, stem: str, rank: int, file_bytes: int, flag: str, what: str):
        self.file_bytes = file_bytes
        self.path = _rank_file(directory, stem, rank)
        self.fd, self.direct = _open(self.path, file_bytes, flag, what)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")  # one thread: jobs in order
        self._finalizer = weakref.finalize(self, _close, self.fd, self.path, self.pool)
        self.pending: List[Future] = []
        self.bytes_read = self.bytes_written = 0
        self._map: Optional[torch.Tensor] = None

    def describe(self, what: str, staging_bytes: int) -> str:
        """The start-up line of an offload: its file, how it is written, the two staging buffers held."""
        return (f"{what} on NVMe: {self.path} ({self.file_bytes / 2**20:.1f} MiB, "
                f"{'O_DIRECT' if self.direct else 'buffered + fdatasync'}); held in memory: two "
                f"staging buffers of {staging_bytes / 2 / 2**20:.1f} MiB")

    def io(self, write: bool, buffer: torch.Tensor, offset: int) -> None:
        """Move `buffer` (aligned uint8, a multiple of ALIGN long) to or from the file at `offset`, now."""
        view = memoryview(buffer.numpy())
        done = 0
        while done < len(view):
            part = view[done:]
            n = os.pwritev(self.fd, [part], offset + done) if write else os.preadv(self.fd, [part], offset + done)
            if n <= 0:
                raise OSError(f"{'write to' if write else 'read from'} {self.path} stopped at byte {offset + done}")
            done += n
        if write and not self.direct:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        if write:
            self.bytes_written += done
        else:
            self.bytes_read += done

    def submit(self, fn: Callable, *args) -> Future:
        future = self.pool.submit(fn, *args)
        self.pending.append(future)
        return future

    def read(self, buffer: torch.Tensor, offset: int) -> Future:
        return self.submit(self.io, False, buffer, offset)

    def write(self, buffer: torch.Tensor, offset: int, event=None) -> Future:
        """Queued behind every earlier job; `event` (CUDA): the device's copies into `buffer` come first."""
        def job():
            if event is not None:
                event.synchronize()
            self.io(True, buffer, offset)
        return self.submit(job)

    def drain(self) -> None:
        """Wait for every queued read and write; an I/O error surfaces here."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def mapped(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole file, to read, as a private memory map (nothing held beyond the page cache);
        dropped by `unmap()` before the next direct I/O."""
        if self._map is None or self._map.dtype != dtype:
            self.drain()
            size = self.file_bytes // torch.empty((), dtype=dtype).element_size()
            self._map = torch.from_file(self.path, shared=False, size=size, dtype=dtype)
        return self._map

    def unmap(self) -> None:
        self._map = None

    def close(self) -> None:
        self.unmap()
        self.drain()
        self._finalizer()
