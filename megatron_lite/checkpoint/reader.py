"""Reading boxes of full tensors out of a checkpoint's pieces, lazily.

The index in metadata.json says, per tensor key, which file holds which box of it. A request
for a box reads only the overlapping parts of the pieces (`safe_open(...).get_slice`, memory
mapped), so a rank of any layout reads just what it needs.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Dict, List, NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open

from .files import DTYPE_CODES, CheckpointError
from .geometry import Box, box_volume, intersect, relative_slices, whole_box


CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Piece(NamedTuple):
    file: str
    name: str  # tensor name inside the file
    box: Box


class CheckpointReader:
    def __init__(self, ckpt_dir: str, meta: dict):
        self.dir, self.meta = ckpt_dir, meta
        self.pieces: Dict[str, List[Piece]] = {}
        self.shapes: Dict[str, tuple] = {}
        for fname, entry in meta["files"].items():
            for name, (key, box, shape) in entry["pieces"].items():
                self.pieces.setdefault(key, []).append(Piece(fname, name, tuple(tuple(d) for d in box)))
                self.shapes[key] = tuple(shape)
        self._stack = ExitStack()
        self._handles = {}

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

    def first_present(self, keys: List[str]) -> Optional[str]:
        return next((k for k in keys if k in self.pieces), None)

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
