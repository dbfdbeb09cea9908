"""Offline operations on a checkpoint, without process groups (tools/convert_checkpoint.py):
consolidating its full weights, and rewriting it as the ranks of another layout would have
written it. Both stream: one full tensor, or one target rank's pieces, in memory at a time."""
from __future__ import annotations

import copy
import os
import shutil
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.sharding import counts_in_norm, spec_of, stored_name
from ..parallel.state import ParallelDims
from . import directory
from .files import PieceSet, describe_files
from .geometry import flat_range_to_full
from .plan import MODEL, OPTIM_STATES, even_part, optim_key, stored_key
from .reader import CheckpointReader


def open_checkpoint(path: str, iteration: Optional[int] = None, verify: bool = True) -> CheckpointReader:
    ckpt_dir, _ = directory.resolve(path, iteration)
    reader = CheckpointReader(ckpt_dir, directory.read_metadata(ckpt_dir, verify), verify)
    reader.verify_files()
    return reader


def full_weights(reader: CheckpointReader, fp32_from_main: bool) -> Dict[str, torch.Tensor]:
    """Every model tensor, full and by global name. `fp32_from_main`: take the fp32 main params
    where the checkpoint has them (bf16/fp16 training) instead of the rounded params."""
    out = {}
    for key in sorted(k for k in reader.pieces if k.startswith(f"{MODEL}/")):
        name = key[len(MODEL) + 1:]
        main = optim_key(name, "main")
        out[name] = reader.read_full(main if fp32_from_main and reader.has(main) else key)
    return out


def _rank_pieces(reader: CheckpointReader, dims: ParallelDims, chunks: List[nn.Module]) -> PieceSet:
    """What rank `dims.rank` of the target layout writes: its TP slice of every parameter it owns,
    split over the DP ranks by even flat ranges (ZeRO's split, up to bucket boundaries)."""
    pieces = PieceSet()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not counts_in_norm(p, dims):
                continue
            name, spec = stored_name(name, p), spec_of(p)
            copies = (dims.edp, dims.edp_rank) if spec.split("ep") is not None else (dims.dp, dims.dp_rank)
            runs = flat_range_to_full(spec, *even_part(p.numel(), *copies))
            for kind in (MODEL,) + OPTIM_STATES:
                key = stored_key(kind, name)
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
