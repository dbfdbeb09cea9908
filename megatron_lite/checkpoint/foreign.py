"""Checkpoints in another framework's format (Megatron-LM's torch_dist), read by the same loader.

The run passes the formats it knows (objects with this protocol; the GPT model's Megatron naming
lives in models/megatron_torch_dist.py), so that this package imports nothing of the models:
- `name`: the --ckpt-format value that selects it;
- `iteration_dir(path)`: the iteration directory of a --save root (its tracker) or `path` itself;
- `detect(ckpt_dir)`: whether the directory is in this format;
- `run_config(ckpt_dir)`: {"model_config": ..., "config": {"data": tokenizer fields}} for
  --use-checkpoint-args;
- `open(ckpt_dir, model_config, load_optim)`: (metadata in megatron-lite's terms: iteration,
  model_config, consumed samples, lr_scheduler, optimizer scalars; a reader with CheckpointReader's
  interface over our layout-independent keys).

Which format a load reads: the directory's own. A directory in a foreign format is read when the
run says it expects one (--ckpt-format NAME, or --auto-detect-ckpt-format as in Megatron-LM), and
refused in one line otherwise; megatron-lite's own format is always read.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .directory import has_checkpoint
from .files import CheckpointError


def foreign_checkpoint(path: Optional[str], formats: Sequence, ckpt_format: Optional[str],
                       auto_detect: bool) -> Optional[Tuple[object, str]]:
    """(format, iteration directory) when `path` holds a checkpoint in one of `formats`, else None."""
    if not has_checkpoint(path):
        return None
    for fmt in formats:
        ckpt_dir = fmt.iteration_dir(path)
        if not fmt.detect(ckpt_dir):
            continue
        if ckpt_format != fmt.name and not auto_detect:
            raise CheckpointError(f"{path} is a Megatron-LM {fmt.name} checkpoint: pass --ckpt-format {fmt.name} "
                                  f"(or --auto-detect-ckpt-format) to load it")
        return fmt, ckpt_dir
    return None


def foreign_run_config(tcfg, formats: Sequence) -> Optional[dict]:
    """--use-checkpoint-args: the run config of the first of --save / --load / --pretrained-checkpoint
    that holds a foreign checkpoint (None when the first that holds one is ours)."""
    for path in (tcfg.save, tcfg.load, tcfg.pretrained_checkpoint):
        if has_checkpoint(path):
            found = foreign_checkpoint(path, formats, tcfg.ckpt_format, tcfg.auto_detect_ckpt_format)
            return None if found is None else found[0].run_config(found[1])
    return None
