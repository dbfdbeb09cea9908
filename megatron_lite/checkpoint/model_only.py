"""The model of a training checkpoint without its trainer: the run's config, and the weights
read straight into model chunks of any TP layout (generation; nothing of the optimizer).

Each rank reads the boxes of the full tensors it holds (as loader.py does for a trainer, but per
parameter instead of per gradient bucket). Precision follows the model: an fp32 model takes the
fp32 main params of a bf16/fp16 checkpoint where they exist, other dtypes are cast on copy.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from ..errors import agree_on_errors
from ..parallel.sharding import spec_of, stored_name
from .files import CheckpointError
from .geometry import flat_range_to_full
from .loader import _source_keys, check_model_config
from .offline import open_checkpoint
from .plan import MODEL, buffer_key, persistent_buffers
from .reader import CheckpointReader

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig}


def _section(cls, saved: dict):
    """A config dataclass from its saved fields (fields this version does not know are dropped)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in known})


def run_config(path: str, iteration: Optional[int] = None, verify: bool = True) -> Tuple[Config, dict]:
    """(the Config of the run that wrote the checkpoint, its metadata). Raises CheckpointError."""
    with open_checkpoint(path, iteration, verify) as reader:
        meta = reader.meta
    saved = meta.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {reader.dir} has no run config in its metadata")
    cfg = Config(**{name: _section(cls, saved.get(name, {})) for name, cls in _SECTIONS.items()})
    cfg.model = _section(ModelConfig, meta["model_config"])  # what the weights are, exactly
    return cfg, meta


@torch.no_grad()
def _fill_parameter(reader: CheckpointReader, name: str, param: nn.Parameter) -> None:
    spec = spec_of(param)
    keys = _source_keys(MODEL, name, load_optim=True, dtype=param.dtype)
    key = reader.pick(keys, spec.stored_shape)
    flat = param.data.view(-1)
    for run in flat_range_to_full(spec, 0, param.numel()):
        reader.read_into(key, run.full, run.view(flat))


def _read_local(chunks: List[nn.Module], cfg: ModelConfig, path: str, iteration: Optional[int], verify: bool):
    with open_checkpoint(path, iteration, verify) as reader:
        check_model_config(reader.meta["model_config"], cfg, reader.dir)
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                _fill_parameter(reader, stored_name(name, param), param)
        for name, buf in persistent_buffers(chunks):  # e.g. MoE expert biases
            if reader.has(buffer_key(name)):
                buf.copy_(reader.read_full(buffer_key(name)))
        return reader.dir, reader.meta


def load_model_weights(chunks: List[nn.Module], cfg: ModelConfig, path: str, iteration: Optional[int] = None,
                       verify: bool = True, device=None) -> Tuple[str, dict]:
    """Collective over the world: fill this rank's model chunks (built for `cfg` at any layout)
    with the checkpoint's weights; returns (checkpoint directory, metadata). An error on any rank
    is raised on every rank."""
    return agree_on_errors(lambda: _read_local(chunks, cfg, path, iteration, verify), device)
