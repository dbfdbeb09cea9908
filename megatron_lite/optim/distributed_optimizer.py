"""Mixed-precision AdamW over this rank's shard of the gradient buckets: ZeRO stages 0-3.

At stage 0 a rank's shard of a bucket is the whole bucket; at stages 1-3 it is its 1/N slice
(see parallel/data_parallel.py), so one code path serves every stage. For its shard only, the
optimizer keeps the fp32 main params (the param shard itself when params are fp32) and Adam's m
and v, reads the reduced gradient, and writes the updated values back into the param shard;
GradientSync then all-gathers the params at stages 1-2 (at stage 3 the shard is all there is).

A step: unscale (fp16) -> skip everywhere if any rank found inf/NaN (the scale backs off) -> the
grad norm of the whole model (model-parallel ranks count each distinct element once, see
`sharding.counts_in_norm`; sharded stages also sum over DP, each shard counted once) -> clip ->
AdamW -> copy back -> param all-gather.

With --optimizer-cpu-offload the state of the first --optimizer-offload-fraction of the buckets
lives in host memory and Adam runs there (see _ShardState): the norm and clipping still run on
the device gradients, so the numerics are those of the device run.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import TrainingConfig
from ..errors import NonFiniteError
from ..parallel import comm
from ..parallel.bucket_plan import offloaded_buckets, state_bytes
from ..parallel.data_parallel import Bucket, GradientSync
from ..parallel.sharding import counts_in_norm
from ..parallel.state import ParallelDims
from .adam import adamw_
from .loss_scaler import ConstantLossScaler, DynamicLossScaler

_NORM_SLICE = 1 << 18  # elements per float64 slice of the gradient norm


def no_weight_decay(name: str, ndim: int) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed."""
    return ndim == 1 or name.endswith(".bias")


def _merge(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


class _ShardState:
    """Optimizer state of one bucket's shard: fp32 main params, Adam m and v, and which ranges
    of the shard are weight-decayed and counted in the grad norm.

    Offloaded (`host` set: --optimizer-cpu-offload), the main params, m and v live in host memory
    (pinned when the device is a GPU, so that the copies are asynchronous DMA) with a host buffer
    for the gradient: each step copies the reduced gradient shard down, runs the fused CPU Adam
    there, and copies the updated main params back up into the param shard. The main params are
    then always a separate copy, even of fp32 params."""

    def __init__(self, bucket: Bucket, dims: ParallelDims, host: Optional[torch.device] = None):
        self.bucket, self.host = bucket, host
        shard = bucket.param_shard_view()
        if host is not None:
            pin = shard.device.type == "cuda"  # page-locked host memory exists only beside a GPU
            self.main, self.grad_host, self.exp_avg, self.exp_avg_sq = (
                torch.zeros(shard.numel(), dtype=torch.float32, device=host, pin_memory=pin) for _ in range(4))
            self.main.copy_(shard)
        else:
            self.main = shard if shard.dtype == torch.float32 else shard.detach().float()
            self.grad_host = None
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.main), torch.zeros_like(self.main)
        segments = bucket.shard_segments()
        self.decay = _merge([(lo, hi) for i, lo, hi in segments
                             if not no_weight_decay(bucket.names[i], len(bucket.shapes[i]))])
        self.norm = _merge([(lo, hi) for i, lo, hi in segments if counts_in_norm(bucket.params[i], dims)])
        # Summed over the whole world: a shard (ZeRO 1-3) is this rank's alone; an unsharded bucket
        # is held alike by every rank of its data-parallel group, each counting its share.
        self.norm_weight = 1.0 if bucket.shard_numel < bucket.numel else 1.0 / bucket.group_size

    @property
    def owns_main(self) -> bool:
        """True when the main params are a separate fp32 copy (low-precision or offloaded params)."""
        return self.main.data_ptr() != self.bucket.param_shard_view().data_ptr()

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {"main": self.main, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def stage_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient where Adam runs: the device shard, or (offloaded) its host copy, whose
        asynchronous copy the caller waits for (`_wait_copies`) before reading it."""
        if self.grad_host is None:
            return grad
        self.grad_host.copy_(grad, non_blocking=True)
        return self.grad_host

    def write_back(self) -> None:
        """The updated main params into the (low-precision or device) param shard."""
        if self.owns_main:
            self.bucket.param_shard_view().copy_(self.main, non_blocking=self.host is not None)


def _wait_copies(device: Optional[torch.device]) -> None:
    """Host reads of device-to-host copies issued with non_blocking wait for the device stream."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DistributedOptimizer:
    def __init__(self, grad_sync: GradientSync, tcfg: TrainingConfig):
        self.sync, self.tcfg, self.dims = grad_sync, tcfg, grad_sync.dims
        offload = offloaded_buckets([b.shard_numel for b in grad_sync.buckets],
                                    tcfg.optimizer_offload_fraction if tcfg.optimizer_cpu_offload else 0.0)
        self.shards = [_ShardState(b, self.dims, torch.device("cpu") if off else None)
                       for b, off in zip(grad_sync.buckets, offload)]
        if tcfg.fp16 and tcfg.loss_scale is not None:
            self.scaler = ConstantLossScaler(tcfg.loss_scale)
        elif tcfg.fp16:
            self.scaler = DynamicLossScaler(tcfg.initial_loss_scale, tcfg.min_loss_scale, tcfg.loss_scale_window,
                                            tcfg.hysteresis)
        else:
            self.scaler = ConstantLossScaler(1.0)
        self.num_updates = 0
        params = [b.param_shard_view() for b in grad_sync.buckets]
        self.device = params[0].device if params else None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the whole world: every rank holds a part of the gradients (dense and expert
        parameters reduce over different data-parallel groups; see _ShardState.norm_weight)."""
        comm.all_reduce(t, self.dims.group("world"), op=op, counter=self.dims.comm_counter)
        return t

    def _found_inf(self, tensors: List[torch.Tensor], bad_loss: bool) -> Tuple[bool, bool]:
        """(any rank has a non-finite element in `tensors`, any rank's loss is non-finite)."""
        flags = torch.zeros(2, dtype=torch.float32, device=self.device)
        flags[0] = float(any(not torch.isfinite(t).all() for t in tensors))
        flags[1] = float(bad_loss)
        flags = self._all_reduce(flags, dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())

    def _grad_norm(self, grads: List[torch.Tensor], bad_loss: bool) -> Tuple[float, bool]:
        """(global grad norm, any rank's loss non-finite), in one all-reduce. The norm is the sqrt
        of the sum of squares over every distinct gradient element of the model, summed in
        float64 (slice by slice, so the float64 copies stay small): float32 sums over millions of
        elements drift by 1e-5, which would make the clipping coefficient depend on the layout."""
        sq = torch.zeros(2, dtype=torch.float64, device=self.device)
        for s, g in zip(self.shards, grads):
            part = torch.zeros((), dtype=torch.float64, device=self.device)
            for lo, hi in s.norm:
                for a in range(lo, hi, _NORM_SLICE):
                    seg = g[a:min(hi, a + _NORM_SLICE)].double()
                    part += torch.dot(seg, seg)
            sq[0] += part * s.norm_weight
        sq[1] = float(bad_loss)
        sq = self._all_reduce(sq)
        return math.sqrt(sq[0].item()), bool(sq[1].item())

    @torch.no_grad()
    def step(self, lr: float, loss_is_finite: bool = True, grad_scale: float = 1.0) -> Dict[str, float]:
        """One update from the reduced gradients (call after GradientSync.finish()).
        `loss_is_finite`: this rank's view of the step's loss (ranks without a loss: True);
        `grad_scale`: what the reduced gradients are multiplied by first (1 / global token count:
        the schedules backpropagate loss sums), in the same pass as the loss-scale unscaling.

        With check_for_nan_in_loss_and_grad, a non-finite loss or gradient norm (fp16: a non-finite
        loss; its gradient overflows are the loss scaler's to skip) or an fp16 parameter that
        overflows when cast from its fp32 main param raises NonFiniteError on every rank."""
        self.sync.wait_param_gather()
        check = self.tcfg.check_for_nan_in_loss_and_grad
        scale = self.scaler.scale
        grads = [s.bucket.grad_shard_view() for s in self.shards]
        grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
        if grad_scale / scale != 1.0:
            for g in grads:
                g.mul_(grad_scale / scale)
        if self.tcfg.fp16:
            found_inf, bad_loss = self._found_inf(grads, not loss_is_finite)
            if check and bad_loss:
                raise NonFiniteError("the loss is not finite")
            if found_inf:
                self.scaler.update(True)
                self.sync.zero_grad()
                return {"update_successful": False, "grad_norm": float("nan"), "loss_scale": scale}
        self.scaler.update(False)
        norm, bad_loss = self._grad_norm(grads, not loss_is_finite)
        if check and bad_loss:
            raise NonFiniteError("the loss is not finite")
        if check and not math.isfinite(norm):
            raise NonFiniteError(f"the gradient norm is {norm}")
        clip = self.tcfg.clip_grad
        if clip > 0 and norm > clip:
            coeff = clip / (norm + 1e-6)
            for g in grads:
                g.mul_(coeff)
        self.num_updates += 1
        t = self.tcfg
        staged = [s.stage_grad(g) for s, g in zip(self.shards, grads)]  # offloaded: all copies in flight
        _wait_copies(self.device)
        for s, g in zip(self.shards, staged):
            adamw_(s.main, g, s.exp_avg, s.exp_avg_sq, step=self.num_updates, lr=lr, beta1=t.adam_beta1,
                   beta2=t.adam_beta2, eps=t.adam_eps, weight_decay=t.weight_decay, decay_ranges=s.decay)
            s.write_back()
        if check and self.tcfg.fp16 and self._found_inf([s.bucket.param_shard_view() for s in self.shards], False)[0]:
            raise NonFiniteError("fp16 parameters overflow (|w| > 65504) when cast from their fp32 main params: the "
                                 "model diverged; lower --lr, or train with --bf16")
        self.sync.zero_grad()
        self.sync.gather_params()
        return {"update_successful": True, "grad_norm": norm, "loss_scale": scale}

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds across steps: params, grads, optimizer state (main params, m, v) on
        the device, and the offloaded optimizer state (with its gradient staging buffer) on the
        host, as bucket_plan.state_bytes accounts them: the planner's figures (`held_bytes`
        measures the tensors; tests hold the two equal)."""
        return state_bytes(self.sync.plans, self.sync.stage, self.sync.grad_dtype,
                           [s.host is not None for s in self.shards])

    def held_bytes(self) -> Dict[str, int]:
        """memory_bytes() measured from the tensors this rank holds."""
        out = self.sync.held_bytes()
        device = host = 0
        for s in self.shards:
            n = sum(t.numel() * t.element_size() for k, t in s.tensors().items() if k != "main" or s.owns_main)
            if s.host is None:
                device += n
            else:
                host += n + s.grad_host.numel() * s.grad_host.element_size()
        out["optimizer_state_bytes"] = device
        if host:
            out["optimizer_host_bytes"] = host
        return out

    # --- accessors for checkpoints -------------------------------------------------------------
    def shard_tensors(self) -> List[Tuple[Bucket, Dict[str, torch.Tensor]]]:
        """Per bucket, this rank's optimizer tensors over its shard (positions shard_lo onwards of
        the bucket), to read or fill in place: 'exp_avg', 'exp_avg_sq', and 'main' when the fp32
        main params are a separate copy of low-precision params (else they are the params)."""
        return [(s.bucket, {k: v for k, v in s.tensors().items() if k != "main" or s.owns_main})
                for s in self.shards]

    def scalar_state(self) -> dict:
        return {"num_updates": self.num_updates, "loss_scaler": type(self.scaler).__name__,
                "loss_scaler_state": self.scaler.state_dict()}

    def load_scalar_state(self, state: dict) -> bool:
        """Restore the update count, and the loss scaler when it is of the same kind (fp16 to fp16);
        returns whether the scaler was restored."""
        self.num_updates = int(state["num_updates"])
        if state["loss_scaler"] != type(self.scaler).__name__:
            return False
        self.scaler.load_state_dict(state["loss_scaler_state"])
        return True
