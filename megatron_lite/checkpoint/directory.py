"""The on-disk layout of a checkpoint root, and which checkpoint in it counts.

    ROOT/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    ROOT/iter_0000100/metadata.json           written last: its presence marks a complete checkpoint
    ROOT/iter_0000100/shard_00000.safetensors one file per writing rank
    ROOT/iter_0000200.staging/                a save in progress (renamed when complete)

A save writes into the staging directory; once every rank's file is there, rank 0 adds
metadata.json, renames the directory to its final name, and only then replaces the tracker file.
A crash at any point leaves the tracker at the previous complete checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from typing import List, Optional, Tuple

from .files import FORMAT, CheckpointError, fsync_dir, metadata_checksum, write_text_atomic

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    return iter_dir(root, iteration) + ".staging"


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def read_tracker(root: str) -> Optional[int]:
    """The latest complete iteration recorded in ROOT, None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def has_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and (os.path.isfile(os.path.join(path, TRACKER)) or os.path.isfile(os.path.join(path, METADATA)))


def resolve(path: str, iteration: Optional[int] = None) -> Tuple[str, int]:
    """(checkpoint directory, iteration) for a root (its latest, or `iteration`) or an iter_* dir."""
    if os.path.isfile(os.path.join(path, METADATA)) and iteration is None:
        return path, read_metadata(path)["iteration"]
    if iteration is None:
        iteration = read_tracker(path)
        if iteration is None:
            raise CheckpointError(f"no checkpoint in {path}: neither {TRACKER} nor {METADATA} exists")
    return iter_dir(path, iteration), iteration


def read_metadata(ckpt_dir: str, verify: bool = True) -> dict:
    path = os.path.join(ckpt_dir, METADATA)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: {METADATA} is missing (a save that never "
                              f"finished); load an earlier iteration")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from e
    if verify and "checksum" in meta and meta["checksum"] != metadata_checksum(meta):
        raise CheckpointError(f"{path} is corrupted: its content does not match its checksum; load an earlier "
                              f"checkpoint (or pass --no-verify-checkpoint to load it anyway)")
    if meta.get("format") != FORMAT or meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r} is not "
                              f"{FORMAT!r} version <= {VERSION}")
    return meta


def seal(root: str, iteration: int, meta: dict) -> Tuple[str, Optional[str]]:
    """Complete the staging directory of `iteration`: metadata.json (with its checksum), then the
    rename to its final name. Returns (final, the replaced copy of the same iteration or None)."""
    staging, final = staging_dir(root, iteration), iter_dir(root, iteration)
    meta = dict(meta, checksum=metadata_checksum(meta))
    write_text_atomic(os.path.join(staging, METADATA), json.dumps(meta, indent=1, sort_keys=True) + "\n")
    old = None
    if os.path.exists(final):  # the same iteration saved again: swap, then drop the old copy
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(root)
    return final, old


def commit(root: str, iteration: int, meta: dict, fault=None) -> str:
    """Rank 0, once every rank's file is in the staging directory: metadata.json, rename, tracker.
    `fault`: the crash tests' hook (faults.py), called between the rename and the tracker update."""
    final, old = seal(root, iteration, meta)
    if fault is not None:  # tests: die with a complete checkpoint that `latest` does not name yet
        fault("commit", iteration)
    write_text_atomic(os.path.join(root, TRACKER), f"{iteration}\n")
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_save_dir(root: str, expected_bytes: int, rank: int, flag: str = "--save") -> None:
    """At start-up, on every rank (each writes its own file): ROOT can be created and written, so
    that a bad --save stops the run now rather than at the first save hours later; warn when the
    free space is below one checkpoint's expected size."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{flag} {root} cannot be created ({e.strerror or e}); choose a writable "
                              f"directory") from e
    probe = os.path.join(root, f".write_test.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"{flag} {root} is not writable ({e.strerror or e}); choose a writable "
                              f"directory") from e
    free = shutil.disk_usage(root).free
    if rank == 0 and free < expected_bytes:
        print(f"warning: {flag} {root} has {free / 2**30:.1f} GiB free, less than one checkpoint "
              f"(about {expected_bytes / 2**30:.1f} GiB): saves will fail", file=sys.stderr, flush=True)


def complete_iterations(root: str) -> List[int]:
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, METADATA)):
            out.append(int(m.group(1)))
    return sorted(out)


def prune(root: str, keep_last: Optional[int]) -> List[int]:
    """Delete all but the newest `keep_last` complete checkpoints (never the tracked one) and
    leftover staging directories of earlier saves; returns the deleted iterations."""
    latest = read_tracker(root)
    for name in os.listdir(root):  # a save in progress is always newer than the tracked one
        m = _ITER_RE.match(name[:-len(".staging")]) if name.endswith(".staging") else None
        if m and latest is not None and int(m.group(1)) < latest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if not keep_last:
        return []
    done = complete_iterations(root)
    drop = [i for i in done[:-keep_last] if i != latest]
    for i in drop:
        shutil.rmtree(iter_dir(root, i), ignore_errors=True)
    return drop
