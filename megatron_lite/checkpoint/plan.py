"""Which parts of which full tensors a rank writes at save time and fills at load time.

Everything a rank holds of the model and optimizer lives in the flat buckets of its GradientSync
(parameters; and, over the rank's shard of each bucket, the optimizer's named state tensors). So
one description serves every ZeRO stage: a range of bucket positions, cut into parameters
(`Region`s), each mapped onto boxes of its full tensor by `geometry`.

Stored keys: `model/<name>` (params in their training dtype), `optim/<name>/<state>` for each
state the optimizer enumerates: its update rule's (AdamW's `exp_avg`, `exp_avg_sq`) and `main`
(fp32 main params, only when the params are bf16/fp16). Names are the layout-independent global
names (layers by global index; the last pipeline stage's copy of a tied embedding reads the
embedding's name).

Writers (each stored element written exactly once):
- model parallelism: the rank that counts a parameter in the gradient norm (`counts_in_norm`):
  TP rank 0 for replicated params, one of each group of TP replicas, the embedding's stage;
- data parallelism: at ZeRO 1-3 each DP rank writes its own shard (with distributed-optimizer
  instances, the ranks of the first instance); at ZeRO 0 the replicas split each bucket evenly, so
  the writing is balanced over DP ranks too.
Readers fill their whole shard of each bucket (the whole bucket at ZeRO 0).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, NamedTuple, Tuple

import torch

from ..optim.distributed_optimizer import CHECKPOINT_PARAMS
from ..parallel.data_parallel import Bucket
from ..parallel.sharding import ShardSpec, counts_in_norm, spec_of, stored_name
from ..parallel.state import ParallelDims
from .geometry import Run, flat_range_to_full

MODEL = "model"


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim/{name}/{state}"


class Region(NamedTuple):
    """Local flat elements [lo, hi) of one parameter; local element j sits at bucket position
    j + start."""
    name: str
    spec: ShardSpec
    lo: int
    hi: int
    start: int

    def runs(self) -> List[Run]:
        return flat_range_to_full(self.spec, self.lo, self.hi)


def regions(bucket: Bucket, lo: int, hi: int, dims: ParallelDims, writers_only: bool) -> List[Region]:
    """The parameters' parts within bucket positions [lo, hi)."""
    return [Region(stored_name(bucket.names[i], bucket.params[i]), spec_of(bucket.params[i]), a, b,
                   bucket.offsets[i][0])
            for i, a, b in bucket.segments(lo, hi)
            if not (writers_only and not counts_in_norm(bucket.params[i], dims))]


def even_part(n: int, parts: int, index: int) -> Tuple[int, int]:
    """[lo, hi) of part `index` of `n` elements cut into `parts` nearly equal runs."""
    return index * n // parts, (index + 1) * n // parts


def write_range(bucket: Bucket) -> Tuple[int, int]:
    """Bucket positions this rank writes: its ZeRO shard (nothing outside the first
    distributed-optimizer instance, which holds the same shards), or (unsharded) its even share of
    the bucket among the data-parallel ranks holding it."""
    if bucket.replica_rank:
        return bucket.shard_lo, bucket.shard_lo
    if bucket.shard_numel < bucket.numel:
        return bucket.shard_lo, bucket.shard_lo + bucket.shard_numel
    return even_part(bucket.numel, bucket.group_size, bucket.group_rank)


def fill_range(bucket: Bucket) -> Tuple[int, int]:
    return bucket.shard_lo, bucket.shard_lo + bucket.shard_numel


def bucket_sources(optimizer, for_loading: bool = False) -> Iterator[Tuple[Bucket, Dict[str, Tuple[torch.Tensor, int]]]]:
    """Per bucket: stored kind ('model' or an optimizer state) -> (flat tensor, bucket position of
    its element 0); the params are the optimizer's substitute when it gives one (a save with 0/1
    Adam's local steps pending: their synchronised copy). Optimizer states are fp32 (copies of
    low-precision ones: `for_loading` keeps them for the optimizer's commit_loaded_state())."""
    for bucket, states in optimizer.shard_tensors(for_loading):
        params = states.pop(CHECKPOINT_PARAMS, None)  # (saving: the rule's substitute over the shard)
        if params is not None:
            sources = {MODEL: (params, bucket.shard_lo)}
        elif bucket.param_data is not None:
            sources = {MODEL: (bucket.param_data, 0)}
        else:  # ZeRO-3: the shard is all there is
            sources = {MODEL: (bucket.param_shard_for_checkpoint(for_loading), bucket.shard_lo)}
        for state, t in states.items():
            sources[state] = (t, bucket.shard_lo)
        yield bucket, sources


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def persistent_buffers(chunks) -> Iterator[Tuple[str, torch.Tensor]]:
    """(global name, tensor) of the model's persistent buffers (e.g. MoE expert biases): whole
    tensors, the same on every rank that holds their layer."""
    for chunk in chunks:
        params = {n for n, _ in chunk.named_parameters()}
        buffers = dict(chunk.named_buffers())
        for name in chunk.state_dict():
            if name not in params and name in buffers:
                yield name, buffers[name]


def stored_key(kind: str, name: str) -> str:
    return model_key(name) if kind == MODEL else optim_key(name, kind)
