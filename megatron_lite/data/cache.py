"""On-disk cache of index arrays, safe when every rank builds at once.

Arrays live in `{dir}/{key}-{name}.npy`, where key hashes everything that determines them (paths,
file sizes, mtimes, inodes and ctimes, split, seq_length, seed, sizes...), so stale entries are
simply never looked up again. Each file is written under a unique temporary name and moved into
place with os.replace: readers see either no file or a complete one, and ranks that race write
identical bytes, so the last rename is as good as the first.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

DEFAULT_CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "megatron_lite")


def cache_key(description: dict) -> str:
    blob = json.dumps(description, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def file_identity(path: str) -> dict:
    """Its absolute path, size, modification time, inode and change time. Copies (`cp -p`,
    rsync) and `touch -d` can restore size and mtime, but a file replaced or rewritten gets a new
    inode or ctime, which no tool sets back."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "ctime_ns": st.st_ctime_ns}


def corpus_identity(indexed) -> dict:
    """What the cached arrays of a corpus are keyed on: the content of its `.idx` and the
    identity of its `.bin`."""
    return {"idx_sha256": indexed.content_digest(), "idx": file_identity(indexed.idx_file),
            "bin": file_identity(indexed.bin_file)}


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def writable_dir(preferred: str, fallback_name: str) -> Optional[str]:
    """`preferred` if it can be created and written, else a directory under ~/.cache, else None."""
    for d in (preferred, os.path.join(DEFAULT_CACHE_ROOT, fallback_name)):
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                if d != preferred:
                    print(f"megatron_lite.data: {preferred} is not writable; caching indices in {d}",
                          file=sys.stderr)
                return d
        except OSError:
            continue
    return None


def load_or_build(cache_dir: Optional[str], stem: str, description: dict, names: Sequence[str],
                  build: Callable[[], Dict[str, np.ndarray]]) -> Tuple[Dict[str, np.ndarray], bool]:
    """Load the arrays `names` for `description` from the cache, or build and store them.

    Returns (arrays, built): built is False when everything came from the cache."""
    key = cache_key(description)
    paths = {n: os.path.join(cache_dir, f"{key}-{stem}-{n}.npy") for n in names} if cache_dir else {}
    if paths and all(os.path.isfile(p) for p in paths.values()):
        try:
            return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}, False
        except (OSError, ValueError):
            pass  # unreadable (e.g. disk trouble): rebuild and overwrite
    arrays = build()
    if paths:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for n, p in paths.items():
                atomic_save_npy(p, arrays[n])
            desc_path = os.path.join(cache_dir, f"{key}-{stem}-description.json")
            atomic_write_text(desc_path, json.dumps(description, indent=2, sort_keys=True, default=str))
        except OSError as e:  # a full or read-only disk costs a rebuild next time, not the run
            print(f"megatron_lite.data: could not cache {stem} indices in {cache_dir}: {e}", file=sys.stderr)
    return arrays, True
