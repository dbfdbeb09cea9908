"""Reading boxes of full tensors out of a checkpoint's pieces, lazily.

The index in metadata.json says, per tensor key, which file holds which box of it. A request
for a box reads only the overlapping parts of the pieces (`safe_open(...).get_slice`, memory
mapped), so a rank of any layout reads just what it needs.
"""
from __future__ import annotations

import mmap
import os
from contextlib import ExitStack
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from .files import DTYPE_CODES, CheckpointError, bytes_crc32, read_header
from .geometry import Box, box_volume, intersect, relative_slices, whole_box


CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Piece(NamedTuple):
    file: str
    name: str  # tensor name inside the file
    box: Box
    crc: Optional[int]  # CRC-32 of its bytes (None in checkpoints written before checksums)


class CheckpointReader:
    """`verify`: check each piece's CRC-32 the first time it is read (the whole piece is read
    once then, also when only a part of it is needed)."""

    def __init__(self, ckpt_dir: str, meta: dict, verify: bool = True):
        self.dir, self.meta, self.verify = ckpt_dir, meta, verify
        self.pieces: Dict[str, List[Piece]] = {}
        self.shapes: Dict[str, tuple] = {}
        for fname, entry in meta["files"].items():
            for name, (key, box, shape, *crc) in entry["pieces"].items():
                self.pieces.setdefault(key, []).append(
                    Piece(fname, name, tuple(tuple(d) for d in box), crc[0] if crc else None))
                self.shapes[key] = tuple(shape)
        self._stack = ExitStack()
        self._handles = {}
        self._headers: Dict[str, tuple] = {}
        self._verified = set()

    def _check_piece(self, piece: Piece, key: str) -> None:
        if not self.verify or piece.crc is None or (piece.file, piece.name) in self._verified:
            return
        path = os.path.join(self.dir, piece.file)
        self._handle(piece.file)  # a file safetensors cannot parse is reported as such first
        try:
            if piece.file not in self._headers:  # header offsets, and the file mapped (no copy)
                start, entries = read_header(path)
                with open(path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(path) else b""
                self._headers[piece.file] = (start, entries, mapped)
            start, entries, mapped = self._headers[piece.file]
            lo, hi = entries[piece.name]["data_offsets"]
            with memoryview(mapped) as view:
                crc = bytes_crc32(view[start + lo:start + hi])
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as e:
            raise CheckpointError(f"checkpoint file {path}: cannot read tensor {key} ({piece.name}): {e!r}") from e
        if crc != piece.crc:
            raise CheckpointError(f"checkpoint file {path} is corrupted: tensor {key} ({piece.name}) fails its "
                                  f"checksum (crc32 {crc:08x}, {piece.crc:08x} when saved); load an earlier "
                                  f"checkpoint, or pass --no-verify-checkpoint to load it anyway")
        self._verified.add((piece.file, piece.name))

    def verify_files(self) -> None:
        """Every file exists with the recorded size (a truncated or missing shard is named)."""
        for fname, entry in self.meta["files"].items():
            path = os.path.join(self.dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file {path} is missing")
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint file {path} has {size} bytes but {entry['bytes']} were written "
                                      f"(truncated or corrupted)")

    def has(self, key: str) -> bool:
        return key in self.pieces

    def pick(self, keys: List[str], shape: Sequence[int]) -> str:
        """The first of `keys` stored (else the last, which a read reports missing), checked to have `shape`."""
        key = next((k for k in keys if k in self.pieces), keys[-1])
        stored = self.shapes.get(key)
        if stored is not None and stored != shape:
            raise CheckpointError(f"checkpoint {self.dir}: {key!r} has shape {list(stored)}, this model needs "
                                  f"{list(shape)}")
        return key

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = os.path.join(self.dir, fname)
            try:
                self._handles[fname] = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"checkpoint file {path} cannot be read: {e}") from e
        return self._handles[fname]

    def read_into(self, key: str, box: Box, out: torch.Tensor) -> None:
        """Fill `out` (shaped like `box`) with box `box` of full tensor `key`."""
        if key not in self.pieces:
            raise CheckpointError(f"checkpoint {self.dir} has no tensor {key!r}")
        covered = 0
        for piece in self.pieces[key]:
            common = intersect(box, piece.box)
            if common is None:
                continue
            self._check_piece(piece, key)
            try:
                data = self._handle(piece.file).get_slice(piece.name)[relative_slices(common, piece.box)]
            except SafetensorError as e:
                raise CheckpointError(f"checkpoint file {os.path.join(self.dir, piece.file)}: cannot read "
                                      f"{piece.name}: {e}") from e
            out[relative_slices(common, box)].copy_(data)
            covered += box_volume(common)
        if covered != box_volume(box):
            raise CheckpointError(f"checkpoint {self.dir} covers {covered} of the {box_volume(box)} elements of "
                                  f"{key!r} in box {list(box)} (pieces missing)")

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of `key` (that of its first piece)."""
        if key not in self.pieces:
            raise CheckpointError(f"checkpoint {self.dir} has no tensor {key!r}")
        first = self.pieces[key][0]
        return CODE_DTYPES[self._handle(first.file).get_slice(first.name).get_dtype()]

    def read_full(self, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole stored tensor `key`, in its stored dtype unless `dtype` is given."""
        out = torch.empty(self.shapes.get(key, ()), dtype=dtype or self.dtype(key))
        self.read_into(key, whole_box(self.shapes[key]), out)
        return out

    def close(self) -> None:
        self._stack.close()
        self._handles = {}
        for _, _, mapped in self._headers.values():
            if isinstance(mapped, mmap.mmap):
                mapped.close()
        self._headers = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
