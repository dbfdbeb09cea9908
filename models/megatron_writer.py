"""Writing Megatron-LM checkpoints (tools/convert_checkpoint.py ml-to-megatron) from a stream of
full tensors under Megatron-Core's canonical names (megatron_conversion's table):

  legacy      each rank's state dict, torch.saved to `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`: its
              TP piece of every tensor, its stage's layers numbered from 0, its EP rank's experts
              numbered from 0;
  torch_dist  one process writes Megatron-Core's sharded keys through torch.distributed.checkpoint, a
              layer's tensor as a chunk of `decoder.layers.X` [num_layers, ...] (or per layer when
              dense and MoE layers mix), an expert's as a chunk of `...mlp.experts.experts.X`, and
              every linear's (empty) extra state as Megatron-Core's ShardedObjects.
"""
from __future__ import annotations

import argparse
import json
import os
import re

import torch

from megatron_lite.config import ModelConfig

from .megatron_checkpoint import LEGACY_FILE
from .megatron_conversion import ALIASES, split_tp

EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")


def local_names(name: str) -> str:
    """The local spec's names of the norms that Megatron-Core's sharded keys fold into the next linear."""
    for canonical, local in ALIASES.items():
        name = name.replace(canonical, local)
    return name


def pad_vocab(full: torch.Tensor, padded: int) -> torch.Tensor:
    """Megatron's padded vocabulary: zero rows past the true one."""
    return torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])


def write_legacy(release: str, stream, cfg: ModelConfig, margs: dict, tp: int, pp: int, ep: int,
                  experts: int) -> torch.dtype:
    """Megatron-LM's per-rank files (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt): each TP rank's piece,
    each stage's layers numbered from 0, each EP rank's experts numbered from 0."""
    per_stage, local_experts = cfg.num_layers // pp, experts // ep if experts else 0
    states = {(t, p, e): {} for t in range(tp) for p in range(pp) for e in range(ep)}
    params = None
    for name, full in stream:
        params = params or (full.dtype if full.is_floating_point() else None)
        stages = [pp - 1] if name.startswith(("decoder.final_layernorm", "output_layer")) else [0]
        ep_ranks = range(ep)
        m = EXPERT.match(name)
        if m:  # one EP rank holds the expert, under its local number
            e = int(m.group(2))
            ep_ranks, name = [e // local_experts], f"{m.group(1)}local_experts.{e % local_experts}.{m.group(3)}"
        if name.startswith("decoder.layers."):
            layer, rest = name.split(".", 3)[2:]
            stages, name = [int(layer) // per_stage], f"decoder.layers.{int(layer) % per_stage}.{rest}"
        elif name == "embedding.word_embeddings.weight" and pp > 1 and not cfg.untie_embeddings_and_output_weights:
            stages = [0, pp - 1]  # the last stage's copy of the tied embedding is its output layer
        name = local_names(name)
        for t, piece in enumerate(split_tp(name, full, tp, cfg.swiglu)):
            for p in stages:
                key = "output_layer.weight" if p != 0 and name.startswith("embedding.") else name
                for e in ep_ranks:
                    states[(t, p, e)][key] = piece.clone()
    margs.update(params_dtype=params, bf16=params == torch.bfloat16, fp16=params == torch.float16,
                 ckpt_format="torch", iteration=0)
    for (t, p, e), state in states.items():
        rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
        path = os.path.join(release, rank_dir, LEGACY_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"args": argparse.Namespace(**margs), "checkpoint_version": 3.0, "iteration": 0, "model": state},
                   path)
    return params


# The linear layers of a Megatron-Core layer (local spec: `linear_*`) have an `_extra_state` (None;
# Transformer Engine's FP8 metadata otherwise), stored as one pickled object per layer (per layer and expert).


def write_torch_dist(path: str, stream, num_layers: int, experts: int, margs: dict, per_layer: bool) -> torch.dtype:
    """Megatron-Core's torch_dist layout in one process through torch.distributed.checkpoint, as its
    sharded state dict names it: a layer's tensor is a chunk of `decoder.layers.X` [num_layers, ...],
    or `decoder.layers.N.X` itself when `per_layer`; an expert's a chunk of `...mlp.experts.experts.X`
    [(num_layers,) experts, ...]; each linear's extra state a ShardedObject per chunk
    (`KEY/shard_OFFSETS_SHAPE`); then common.pt (args) and metadata.json."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state, chunks = {}, {}  # chunks: sharded key -> (global shape prefix, {offsets: tensor})
    for name, full in stream:
        if not name.startswith("decoder.layers."):
            state[name] = full
            continue
        m = EXPERT.match(name)
        layer, rest = name.split(".", 3)[2:]
        index, prefix = ((int(layer), int(m.group(2))), (num_layers, experts)) if m else ((int(layer),), (num_layers,))
        rest = f"mlp.experts.experts.{m.group(3)}" if m else rest
        key = f"decoder.layers.{layer}.{rest}" if per_layer else f"decoder.layers.{rest}"
        if per_layer:
            index, prefix = index[1:], prefix[1:]
            if not index:
                state[key] = full
        if index:
            chunks.setdefault(key, (prefix, {}))[1][index] = full
        module, param = key.rsplit(".", 2)[-2:]
        if module.startswith("linear_") and param == "weight":
            # (DCP pickles it; Megatron-Core's object of a key is the list of its ranks' objects)
            offsets, shape = (index, prefix) if index else ((0,), (1,))
            state[f"{key[:-len('weight')]}_extra_state/shard_{'.'.join(map(str, offsets))}_"
                  f"{'.'.join(map(str, shape))}"] = [None]
    floats = [t for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    params = floats[0].dtype
    margs.update(params_dtype=params, bf16=params == torch.bfloat16, fp16=params == torch.float16,
                 ckpt_format="torch_dist", iteration=0)
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: save in a single process" (we do)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=_named_writer(path), planner=_chunk_planner(chunks), no_dist=True)
    torch.save({"args": argparse.Namespace(**margs), "checkpoint_version": 3.0, "iteration": 0},
               os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    return params


def _named_writer(path: str):
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):  # .metadata names the checkpoint by a string, as Megatron-Core's does
        @property
        def checkpoint_id(self) -> str:
            return str(self.path)

    return Writer(path)


def _chunk_planner(chunks):
    """DCP's save planner, plus tensors written as chunks of a larger global tensor that no one
    holds whole (Megatron-Core's sharded tensors): key -> (global shape prefix, {index: tensor})."""
    import dataclasses as dc

    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class Planner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for key, (prefix, pieces) in chunks.items():
                for index, t in pieces.items():
                    offsets = torch.Size(index + (0,) * t.dim())
                    items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(offsets, torch.Size((1,) * len(index)) + t.shape),
                                               properties=TensorProperties.create_from_tensor(t),
                                               size=torch.Size(prefix) + t.shape)))
            self.plan = dc.replace(plan, items=plan.items + items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn in chunks:
                prefix = chunks[index.fqn][0]
                t = chunks[index.fqn][1][tuple(index.offset[:len(prefix)])]
                return t.reshape((1,) * len(prefix) + t.shape).contiguous()
            return super().lookup_object(index)

    return Planner()
