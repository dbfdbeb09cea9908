"""Saving: every rank writes its own pieces; rank 0 commits once all of them are on disk.

A save is three steps:
1. snapshot (main thread, every rank): this rank's pieces of the model, the optimizer and its RNG
   states; copies when the save is asynchronous (training goes on and changes the tensors);
2. write (now, or in a background thread with --async-save): one safetensors file per rank into
   the staging directory, atomically;
3. commit (main thread, at a point every rank reaches: right away for a synchronous save, at the
   next poll for an asynchronous one): the ranks agree that every file is written (a failure
   on any rank fails every rank), then rank 0 writes metadata.json, renames the directory into
   place and replaces the tracker file (directory.commit).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import agree_on_errors
from ..optim.feedback_state import FEEDBACK, own_errors
from . import directory, rng
from .files import FORMAT, CheckpointError, PieceSet, PinnedHostBuffers, describe_files
from .geometry import whole_box
from .plan import buffer_key, bucket_sources, fill_range, persistent_buffers, regions, stored_key, write_range
from .state import TrainState


def world_min(value: int, device) -> int:
    """The minimum of `value` over all ranks (a barrier that also carries a status)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def layout_of(state: TrainState) -> dict:
    dims, p, t = state.dims, state.cfg.parallel, state.cfg.training
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "ep": dims.ep, "etp": dims.etp, "vpp": dims.vpp,
            "zero_stage": p.zero_stage, "world_size": dims.world_size,
            "precision": "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"}


def checkpoint_metadata(state: TrainState) -> dict:
    """Everything but the tensors: written by rank 0 as metadata.json."""
    return {"format": FORMAT, "version": directory.VERSION, "model_config": dataclasses.asdict(state.cfg.model),
            "config": state.cfg.to_dict(), "layout": layout_of(state),
            **{name: save() for name, save in state.saves.items()}}


def snapshot(state: TrainState, copy: bool, own: bool = False, host: Optional[PinnedHostBuffers] = None) -> PieceSet:
    """This rank's pieces of the model, the optimizer and its RNG states (copies when `copy`):
    its share of a global checkpoint, or with `own` everything a load at this layout fills on
    this rank (a local checkpoint, which this rank alone reads back)."""
    dims = state.dims
    state.optimizer.sync.wait_param_gather()  # --overlap-param-gather: the last update's params
    pieces = PieceSet(host)
    for bucket, sources in bucket_sources(state.optimizer):
        lo, hi = fill_range(bucket) if own else write_range(bucket)
        for region in regions(bucket, lo, hi, dims, writers_only=not own):
            runs = region.runs()
            for kind, (flat, base) in sources.items():
                for run in runs:
                    pieces.add(stored_key(kind, region.name), run.full, region.spec.stored_shape,
                               run.view(flat, region.start - base), copy)
    for key, rng_state in rng.capture(dims, state.tracker).items():
        pieces.add(key, whole_box(rng_state.shape), rng_state.shape, rng_state)
    for key, errors in own_errors(state.optimizer).items():  # (copies, taken after the folds above)
        pieces.add(f"{rng.rank_prefix(dims, FEEDBACK)}/{key}", whole_box(errors.shape), errors.shape, errors)
    if own or dims.tp_rank == dims.cp_rank == dims.dp_rank == 0:  # one writer per pipeline stage
        for name, buf in persistent_buffers(state.chunks):
            pieces.add(buffer_key(name), whole_box(buf.shape), buf.shape, buf, copy)
    return pieces


class PendingSave:
    """One checkpoint being written by this rank; `commit()` finishes it on every rank."""

    def __init__(self, root: str, iteration: int, meta: dict, device, started: float, fault=None):
        self.root, self.iteration, self.meta, self.device = root, iteration, meta, device
        self.fault = fault  # the crash tests' hook (faults.py), or None
        self.started = started
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.write_s = 0.0  # how long writing this rank's file took (checksums included)
        self.checksum_s = 0.0
        self.needed, self.path = 0, None  # this rank's file and its bytes (about: the header aside)

    def write(self, pieces: PieceSet, background: bool) -> None:
        path = os.path.join(directory.staging_dir(self.root, self.iteration), directory.shard_file(world_rank()))
        self.needed, self.path = sum(t.numel() * t.element_size() for _, t in pieces.tensors), path

        def run():
            start = time.perf_counter()
            try:
                halfway = None if self.fault is None else (lambda f: self.fault("save", self.iteration, f))
                pieces.write(path, halfway)
            except BaseException as e:  # reported to every rank at commit
                self.error = e
            self.write_s = time.perf_counter() - start
            self.checksum_s = pieces.checksum_s

        if background:
            self.thread = threading.Thread(target=run, name=f"checkpoint-{self.iteration}", daemon=True)
            self.thread.start()
        else:
            run()

    def status(self) -> int:
        """1 written, 0 still writing, -1 failed."""
        if self.thread is not None and self.thread.is_alive():
            return 0
        return -1 if self.error is not None else 1

    def ready(self) -> bool:
        """Collective: True when every rank's file is written (raises if any rank failed)."""
        state = world_min(self.status(), self.device)
        if state < 0:
            self._failed(f"saving checkpoint iteration {self.iteration} failed on a rank"
                         + (f": {self.error!r}" if self.error else " (see that rank's error)"))
        return state == 1

    def _failed(self, fallback: str) -> None:
        """Collective, once a rank's write or rank 0's commit failed: the staging directory is
        removed (the last complete checkpoint stays the latest) and every rank raises the same
        error: one line for a file-system error (a full disk names the space the save needs)."""
        if self.thread is not None:
            self.thread.join()  # (a background writer): nobody writes into what rank 0 removes
        needed = torch.tensor([self.needed], dtype=torch.int64, device=self.device)
        if world_size() > 1:
            dist.all_reduce(needed)
        if world_rank() == 0:
            shutil.rmtree(directory.staging_dir(self.root, self.iteration), ignore_errors=True)

        def report():
            e, kept = self.error, directory.read_tracker(self.root)
            if not isinstance(e, OSError):
                return
            where = e.filename or self.path or self.root
            kept = "no checkpoint is kept" if kept is None else f"checkpoint iteration {kept} stays the latest"
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                free = shutil.disk_usage(self.root).free
                raise CheckpointError(
                    f"saving checkpoint iteration {self.iteration} to {self.root} failed: {e.strerror} ({where}); "
                    f"it needs {int(needed.item()) / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free there: free "
                    f"space (or raise the quota or file-size limit) or give --save another directory; {kept}")
            raise CheckpointError(f"saving checkpoint iteration {self.iteration} to {self.root} failed: {e.strerror} "
                                  f"({where}); {kept}")

        agree_on_errors(report, self.device)
        raise RuntimeError(fallback)  # not the file system's: a bug, with its traceback

    def commit(self, keep_last: Optional[int]) -> None:
        """Collective, after ready(): rank 0 writes metadata.json and moves `latest`."""
        ok = 1
        if world_rank() == 0:
            try:
                self._commit_rank0(keep_last)
            except BaseException as e:
                self.error, ok = e, -1
        if world_min(ok, self.device) < 0:
            self._failed(f"committing checkpoint iteration {self.iteration} failed on rank 0: {self.error!r}")

    def _commit_rank0(self, keep_last: Optional[int]) -> None:
        staging = directory.staging_dir(self.root, self.iteration)
        self.meta["files"] = describe_files(staging, [directory.shard_file(r) for r in range(world_size())])
        final = directory.commit(self.root, self.iteration, self.meta, self.fault)
        dropped = directory.prune(self.root, keep_last)
        size = sum(f["bytes"] for f in self.meta["files"].values())
        print(f"> saved checkpoint iteration {self.iteration} to {final} ({size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - self.started:.2f} s)" + (f"; pruned {dropped}" if dropped else ""), flush=True)


def start_save(state: TrainState, root: str, background: bool, fault=None,
               host: Optional[PinnedHostBuffers] = None) -> PendingSave:
    """Collective: snapshot and write (or start writing) this rank's file of a checkpoint of the
    run's current state into ROOT. Call commit() (after ready()) to finish it."""
    started = time.perf_counter()
    iteration = state.value("iteration")
    staging = directory.staging_dir(root, iteration)
    if world_rank() == 0:  # a crashed earlier attempt may have left files here
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    world_min(1, state.device)  # nobody writes before the directory is clean
    save = PendingSave(root, iteration, checkpoint_metadata(state), state.device, started, fault)
    pieces = snapshot(state, copy=background, host=host)
    pieces.copies_issued()  # later kernels on the stream (the next update) run after the copies
    save.write(pieces, background)
    return save
