"""Offline operations on a checkpoint, without process groups (tools/convert_checkpoint.py):
consolidating its full weights, rewriting it as the ranks of another layout would have written
it, and writing a weights-only checkpoint at a layout from a stream of full tensors (converted
from Hugging Face or Megatron-LM). All stream: one full tensor, or one target rank's pieces, in
memory at a time."""
from __future__ import annotations

import copy
import os
import shutil
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.sharding import counts_in_norm, spec_of, stored_name
from ..parallel.state import ParallelDims
from . import directory
from .files import PieceSet, StreamingPieceFile, describe_files
from .geometry import flat_range_to_full, whole_box
from .plan import MODEL, buffer_key, even_part, model_key, optim_key, persistent_buffers
from .reader import CheckpointReader


def open_checkpoint(path: str, iteration: Optional[int] = None, verify: bool = True) -> CheckpointReader:
    ckpt_dir, _ = directory.resolve(path, iteration)
    reader = CheckpointReader(ckpt_dir, directory.read_metadata(ckpt_dir, verify), verify)
    reader.verify_files()
    return reader


def full_weights(reader: CheckpointReader, fp32_from_main: bool) -> Dict[str, torch.Tensor]:
    """Every model tensor (and persistent buffer), full and by global name. `fp32_from_main`: take the fp32 main params
    where the checkpoint has them (bf16/fp16 training) instead of the rounded params."""
    out = {}
    for key in sorted(k for k in reader.pieces if k.startswith(f"{MODEL}/")):
        name = key[len(MODEL) + 1:]
        main = optim_key(name, "main")
        out[name] = reader.read_full(main if fp32_from_main and reader.has(main) else key)
    for key in sorted(k for k in reader.pieces if k.startswith(buffer_key(""))):  # (MoE expert biases)
        out[key[len(buffer_key("")):]] = reader.read_full(key)
    return out


def _writes(dims: ParallelDims, chunks: List[nn.Module]) -> Iterator[Tuple[str, object, list]]:
    """(stored name, spec, runs) of every parameter part rank `dims.rank` writes (ZeRO's split: see _rank_pieces)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not counts_in_norm(p, dims):
                continue
            spec = spec_of(p)
            copies = (dims.edp, dims.edp_rank) if spec.split("ep") is not None else (dims.dp, dims.dp_rank)
            yield stored_name(name, p), spec, flat_range_to_full(spec, *even_part(p.numel(), *copies))


def _rank_pieces(reader: CheckpointReader, dims: ParallelDims, chunks: List[nn.Module]) -> PieceSet:
    """What rank `dims.rank` of the target layout writes: its TP slice of every parameter it owns,
    split over the DP ranks by even flat ranges (ZeRO's split, up to bucket boundaries)."""
    pieces = PieceSet()
    for name, spec, runs in _writes(dims, chunks):  # the weights and whatever states the optimizer stored
        for key in [model_key(name)] + sorted(k for k in reader.pieces if k.startswith(optim_key(name, ""))):
            if not reader.has(key):
                continue
            for run in runs:
                data = torch.empty([k for _, k in run.full], dtype=reader.dtype(key))
                reader.read_into(key, run.full, data)
                pieces.add(key, run.full, spec.stored_shape, data)
    return pieces


def reshard(reader: CheckpointReader, out_root: str, ranks: Iterable[Tuple[ParallelDims, List[nn.Module]]],
            layout: dict) -> str:
    """Write the checkpoint as the ranks of `layout` would: one file per (dims, model chunks on the
    meta device) in `ranks`. RNG states are per layout and are not carried over."""
    meta = copy.deepcopy(reader.meta)
    iteration = meta["iteration"]
    staging = directory.staging_dir(out_root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    names = []
    for dims, chunks in ranks:
        names.append(directory.shard_file(dims.rank))
        _rank_pieces(reader, dims, chunks).write(os.path.join(staging, names[-1]))
    meta["layout"] = dict(meta["layout"], **layout)
    meta["files"] = describe_files(staging, names)
    return directory.commit(out_root, iteration, meta)


def write_weights_checkpoint(out_root: str, meta: dict, ranks: Iterable[Tuple[ParallelDims, List[nn.Module]]],
                             tensors: Iterable[Tuple[str, torch.Tensor]], order: List[str], dtype: torch.dtype) -> str:
    """A weights-only training checkpoint (iteration 0) at the layout of `ranks`, from `tensors`,
    a stream of (stored name, full tensor) in the order `order`: each full tensor is cut into
    every rank's pieces as it arrives and then dropped, so memory holds one full tensor. Stored
    in `dtype` (a run of any precision loads it)."""
    iteration = 0
    staging = directory.staging_dir(out_root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    position = {name: i for i, name in enumerate(order)}
    files, wanted = [], {}
    for dims, chunks in ranks:
        out = StreamingPieceFile(os.path.join(staging, directory.shard_file(dims.rank)))
        parts = [(position[n], model_key(n), n, run.full, spec.stored_shape, dtype)
                 for n, spec, runs in _writes(dims, chunks) for run in runs]
        if dims.tp_rank == dims.cp_rank == dims.dp_rank == 0:  # persistent buffers (MoE expert biases): whole, in
            parts += [(position[n], buffer_key(n), n, whole_box(b.shape), tuple(b.shape), b.dtype)  # their own dtype,
                      for n, b in persistent_buffers(chunks) if n in position]  # once per pipeline stage (the saver's)
        for _, key, name, box, shape, kind in sorted(parts, key=lambda x: x[0]):
            wanted.setdefault(name, []).append((out, out.declare(key, box, shape, kind), box, kind))
        files.append(out)
    for out in files:
        out.open()
    for name, full in tensors:
        converted = {}
        for out, piece, box, kind in wanted.pop(name, []):
            data = converted.setdefault(kind, full.to(kind))
            out.write(piece, data[tuple(slice(s, s + n) for s, n in box)])
    if wanted:
        raise ValueError(f"the stream lacked {len(wanted)} tensors, e.g. {sorted(wanted)[:3]}")
    names = [os.path.basename(f.path) for f in files]
    for f in files:
        f.close()
    meta = dict(meta, iteration=iteration, consumed_samples=0, weights_only=True)
    meta["files"] = describe_files(staging, names)
    return directory.commit(out_root, iteration, meta)
