"""Sharded, layout-independent training checkpoints with atomic commits.

Format (version 1), one directory per checkpoint (directory.py):
- `shard_<rank>.safetensors`, one per writing rank: pieces of full tensors. A piece is a box
  (per dimension: start, length) of a tensor stored under its global name and FULL shape
  (vocabulary padding dropped): `model/<param>`, `optim/<param>/<state>` (AdamW: exp_avg|exp_avg_sq;
  and main), and `rng/tp<t>_cp<c>_dp<d>_pp<p>/...`. The file's safetensors metadata indexes its pieces.
- `metadata.json`, written last by rank 0: format, model config (checked on load), whole run config,
  writer layout, the values a run registers (state.py: iteration, consumed samples, LR schedule,
  optimizer counters, ...), per file its byte size and piece index. Never loaded without it.
- `ROOT/latest_checkpointed_iteration.txt` names the newest complete checkpoint.

Nothing depends on the writing layout but the file names and RNG states: a loader of any TP / PP /
DP / ZeRO / precision reads the boxes it needs (geometry.py maps ranks' tensors onto boxes, plan.py
says who writes and reads what). Later dimensions slot in the same way: context parallelism
already rides on the data-parallel group the ZeRO shards span (and RNG keys carry cp); expert
parallelism will add one more mapping in ShardSpec (local expert -> global expert index along the
expert dimension), with the stored keys and boxes unchanged.

Modules: manager (the training loop's entry points), state, saver / loader, reader / files (I/O),
directory (layout, commit, pruning), local (per-rank non-persistent checkpoints on node-local disk),
exit_conditions (SIGTERM, time, interval), rng, offline (consolidate, reshard for
tools/convert_checkpoint.py), faults (crash injection for tests).
"""
from .directory import has_checkpoint, read_metadata, read_tracker, resolve
from .files import CheckpointError
from .loader import load_checkpoint
from .manager import Checkpointing
from .reader import CheckpointReader
from .saver import start_save

__all__ = ["CheckpointError", "CheckpointReader", "Checkpointing", "has_checkpoint", "load_checkpoint",
           "read_metadata", "read_tracker", "resolve", "start_save"]
