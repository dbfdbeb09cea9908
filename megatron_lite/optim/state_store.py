"""Where the optimizer state of a shard lives, apart from the update rule that steps it (adam.py).

A store holds the named flat tensors over one bucket's shard, 'main' (the main params) and the
rule's `state_names` (from zero); `stage` brings the gradient to where the rule runs, `publish`
copies updated main params into the param shard.
- DeviceStore: beside the params, fp32 or in the dtypes of --use-precision-aware-optimizer
  (StateStorage); fp32 params are their own main params.
- HostStore (--optimizer-cpu-offload; --optimizer-offload-fraction picks the buckets): fp32 in host
  memory, pinned beside a GPU (asynchronous copies), with a host buffer for the gradient.
- NvmeStore (--optimizer-offload-nvme-path; nvme_store.py): in one file per rank, read into one of two
  staging buffers around the shard's update and written back behind it.

Which store each shard gets, and how a step reaches them, is a placement's: InMemory here (device
and host stores), NvmeSpill in nvme_store.py. The optimizer talks to its placement only through
`store_for`, `update_all`, `held_bytes`, `loading_copies`, `commit_loaded` and `describe`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..errors import agree_on_errors
from ..parallel.bucket_plan import offloaded_buckets
from .nvme_store import NvmeSpill
from .precision import OptimizerPrecision, StateStorage

Held = Union[torch.Tensor, StateStorage]


def _held(init: torch.Tensor, dtype: torch.dtype, segments: List[Tuple[int, int]]) -> Held:
    """`init` kept in `dtype`: an fp32 tensor (`init` itself when it is one), else StateStorage."""
    return init.float() if dtype == torch.float32 else StateStorage(init, dtype, segments)


def held_bytes(t: Held) -> int:
    return t.nbytes if isinstance(t, StateStorage) else t.numel() * t.element_size()


class DeviceStore:
    on_host, staging_bytes = False, 0

    def __init__(self, shard: torch.Tensor, state_names: Sequence[str], segments: List[Tuple[int, int]],
                 precision: OptimizerPrecision):
        main_dtype = torch.float32 if shard.dtype == torch.float32 else precision.dtype_of("main")
        self.tensors: Dict[str, Held] = {"main": _held(shard.detach(), main_dtype, segments)}
        for name in state_names:
            self.tensors[name] = _held(torch.zeros_like(shard, dtype=torch.float32), precision.dtype_of(name), segments)

    def stage(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def publish(self, param: torch.Tensor, main: torch.Tensor) -> None:
        param.copy_(main)


class HostStore(DeviceStore):
    on_host = True

    def __init__(self, shard: torch.Tensor, state_names: Sequence[str], segments, precision):
        pin = shard.device.type == "cuda"  # page-locked host memory exists only beside a GPU
        self.tensors = {name: torch.zeros(shard.numel(), dtype=torch.float32, pin_memory=pin)
                        for name in ("main", *state_names)}
        self.tensors["main"].copy_(shard)
        self.grad = torch.zeros(shard.numel(), dtype=torch.float32, pin_memory=pin)
        self.staging_bytes = held_bytes(self.grad)

    def stage(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient's host copy, in flight: the caller issues every shard's copy, then waits
        for the device once before the rule reads them."""
        self.grad.copy_(grad, non_blocking=True)
        return self.grad

    def publish(self, param: torch.Tensor, main: torch.Tensor) -> None:
        param.copy_(main, non_blocking=True)


class InMemory:
    """Every shard's state in memory: on the device, or (`offloaded[k]`, --optimizer-cpu-offload) on the host."""
    nvme, describe = False, staticmethod(lambda: None)

    def __init__(self, offloaded: Sequence[bool], device: Optional[torch.device]):
        self.offloaded, self.device = list(offloaded), device

    def store_for(self, k: int):
        return HostStore if self.offloaded[k] else DeviceStore

    def update_all(self, stores: List[DeviceStore], grads: List[torch.Tensor],
                   update: Callable[[int, torch.Tensor], None]) -> None:
        staged = [s.stage(g) for s, g in zip(stores, grads)]  # offloaded: all copies in flight, then one wait
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for k, g in enumerate(staged):
            update(k, g)

    def held_bytes(self, shards) -> Dict[str, int]:
        host = sum(s.nbytes for s in shards if s.store.on_host)
        return {"optimizer_host_bytes": host} if host else {}

    def loading_copies(self, tensors: Dict[str, torch.Tensor], plain: bool):
        """(what a checkpoint fills, whether commit_loaded stores it): low-precision states' fp32 copies."""
        return tensors, not plain

    def commit_loaded(self, k: int, shard) -> None:
        shard.load(shard.staged)


def place_state(shard_numels: Sequence[int], state_names: Sequence[str], device: Optional[torch.device],
                cpu_offload: bool, host_fraction: float, nvme_path: Optional[str]):
    """In memory (with `cpu_offload` the first `host_fraction` of the buckets on the host:
    --optimizer-cpu-offload, --optimizer-offload-fraction), or this rank's file under `nvme_path`
    (--optimizer-offload-nvme-path; collective: a directory that is full or unwritable on any rank is
    every rank's one-line error)."""
    if not nvme_path:
        return InMemory(offloaded_buckets(shard_numels, host_fraction if cpu_offload else 0.0), device)
    pin, rank = device is not None and device.type == "cuda", dist.get_rank() if dist.is_initialized() else 0
    return agree_on_errors(lambda: NvmeSpill(nvme_path, rank, shard_numels, ("main", *state_names), pin))
