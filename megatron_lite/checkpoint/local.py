"""Non-persistent local checkpoints (Megatron-LM's --non-persistent-ckpt-type local): each rank
writes its own state to node-local disk, often and cheaply; the global checkpoint (--save) stays
the rare, layout-independent one.

    DIR/<rank>/iter_0000012/shard_<rank>.safetensors   everything this rank fills on a load
    DIR/<rank>/iter_0000012/metadata.json              as a global checkpoint's, this file only
    DIR/<rank>/iter_0000013.staging/                   being written

A save is the global format cut to one rank (saver.snapshot(own=True): the rank's ZeRO shard of
the optimizer, every parameter it holds, its RNG states; metadata.json carries the iteration,
consumed samples and the other registered values), written to a staging directory, fsynced and
renamed by the rank itself. The only collective is one agreement that every rank has renamed
its copy; only then does a rank delete its older local checkpoints. So at any moment each rank
holds the newest agreed iteration, and possibly a newer one some ranks have finished.

On restart the ranks agree (all-reduces of the minimum) on the newest iteration complete on
every rank; the run resumes it when it is newer than the global checkpoint, at the same layout
only. A rank without it (its node's disk lost, its directory deleted or damaged) sends every
rank to an older common one or to the global checkpoint.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import List, Optional, Tuple

from ..errors import agree_on_errors
from . import directory
from .files import CheckpointError, describe_files
from .loader import Loaded, load_checkpoint
from .saver import checkpoint_metadata, layout_of, snapshot, world_min, world_rank
from .state import TrainState

FLAG = "--non-persistent-local-ckpt-dir"


class LocalCheckpoints:
    def __init__(self, root: str, device, fault=None):
        self.root, self.device, self.fault = root, device, fault
        self.dir = os.path.join(root, str(world_rank()))

    def check_dir(self) -> None:
        """At start-up, every rank: its directory can be created and written."""
        agree_on_errors(lambda: directory.check_save_dir(self.dir, 0, world_rank(), FLAG), self.device)

    def save(self, state: TrainState) -> Tuple[float, float]:
        """Collective: write this rank's state of the current iteration; returns the seconds this
        rank spent writing (snapshot, checksums, file, fsync, rename) and of them on checksums."""
        iteration = state.value("iteration")
        start = time.perf_counter()
        checksum_s = agree_on_errors(lambda: self._write(state, iteration), self.device)  # also: all have it
        write_s = time.perf_counter() - start
        keep = os.path.basename(directory.iter_dir(self.dir, iteration))
        for name in os.listdir(self.dir):  # older ones, and what crashed saves left half-written
            if name.startswith("iter_") and name != keep:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
        return write_s, checksum_s

    def _write(self, state: TrainState, iteration: int) -> float:
        staging = directory.staging_dir(self.dir, iteration)
        shard = directory.shard_file(world_rank())
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            halfway = None if self.fault is None else (lambda f: self.fault("local", iteration, f))
            pieces = snapshot(state, copy=False, own=True)
            pieces.write(os.path.join(staging, shard), halfway)
            meta = dict(checkpoint_metadata(state), files=describe_files(staging, [shard]))
            _, old = directory.seal(self.dir, iteration, meta)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"saving local checkpoint iteration {iteration} to {self.dir} failed: "
                                  f"{e.strerror or e} ({e.filename or staging}); free space there or give {FLAG} "
                                  f"another directory") from e
        return pieces.checksum_s

    def _usable(self, iteration: int, verify: bool) -> bool:
        try:
            directory.read_metadata(directory.iter_dir(self.dir, iteration), verify)
        except CheckpointError:
            return False
        return True

    def newest_common(self, verify: bool) -> Optional[int]:
        """Collective: the newest iteration whose local checkpoint every rank holds (its
        metadata.json readable), None when there is none."""
        mine: List[int] = directory.complete_iterations(self.dir)
        bound = None
        while True:
            below = [i for i in mine if bound is None or i <= bound]
            candidate = world_min(below[-1] if below else -1, self.device)
            if candidate < 0:
                return None
            if world_min(int(candidate in mine and self._usable(candidate, verify)), self.device):
                return candidate
            bound = candidate - 1  # a rank lacks it: try an older one everybody may have

    def holds_any(self) -> bool:
        return bool(directory.complete_iterations(self.dir))

    def check_layout(self, state: TrainState, iteration: int, verify: bool) -> None:
        """Collective: local checkpoint `iteration` was written at this run's layout (else one line)."""
        def check():
            written = directory.read_metadata(directory.iter_dir(self.dir, iteration), verify)["layout"]
            if written != layout_of(state):
                raise CheckpointError(
                    f"local checkpoint iteration {iteration} in {self.root} was written at layout {written}, not "
                    f"this run's {layout_of(state)}: a local checkpoint resumes only at its own layout; resume "
                    f"from the global checkpoint (--load) by removing {self.root} or dropping {FLAG}")
        agree_on_errors(check, self.device)

    def load(self, state: TrainState, iteration: int, load_rng: bool, verify: bool) -> Loaded:
        """Collective: resume local checkpoint `iteration` on every rank (check_layout() first)."""
        return load_checkpoint(state, self.dir, iteration=iteration, load_rng=load_rng, verify=verify)
