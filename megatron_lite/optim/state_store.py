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
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

import torch

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
