"""The one error type users see, and how ranks agree on it.

A `ConfigError` is a problem with the user's input (flags, data, checkpoint) whose message names
what is wrong and how to fix it; `pretrain_gpt.py` prints it as one line and exits 2. Found before
the process group exists, every rank finds the same one. Found after, it may be found by one rank
only (its shard file is corrupt, its node's disk is read-only): `agree_on_errors` runs a step on
every rank and then makes every rank raise the first rank's error, so that no rank is left
waiting in a collective for one that has already exited.
"""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot run. The message says what is wrong and how to fix it."""


class NonFiniteError(ConfigError):
    """Training produced a non-finite loss, gradient or parameter (--check-for-nan-in-loss-and-grad).
    Every rank raises it at the same point: the values it is decided on are all-reduced."""


def agree_on_errors(step: Callable[[], T], device=None) -> T:
    """Collective over the whole world: run `step()` here; if it raised a ConfigError on any
    rank, raise on every rank a ConfigError with the lowest such rank's message and number."""
    import torch  # here, not at the top: flags are parsed and checked before torch is imported
    import torch.distributed as dist

    error = None
    try:
        result = step()
    except ConfigError as e:
        error = e
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return result
    message = [str(error) if error is not None else None]
    dist.broadcast_object_list(message, src=src, device=device)
    raise ConfigError(f"[rank {src}] {message[0]}") from error
