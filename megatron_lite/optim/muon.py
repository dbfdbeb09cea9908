"""Muon (--optimizer muon): momentum, then Newton-Schulz orthogonalization of each weight matrix's
momentum update, for the hidden weight matrices; AdamW (adam.py) for the rest: embeddings, the
output layer, the router, norms and biases (every 1-D parameter), as the reference implementations do.

Newton-Schulz needs the whole matrix, while a rank holds its ZeRO shard of a bucket and its TP piece
of each matrix: the momentum updates of the shard are all-gathered over the bucket's data-parallel
group, each matrix meeting the shard is all-gathered over TP and reassembled in the single-process
layout (ShardSpec.unshard: fused K/V and gate-up segments in place), orthogonalized (K and V apart,
as Megatron-LM splits QKV, unless --muon-no-split-qkv), and cut back to the rank's piece. Every
rank holding a piece computes the same full result (--muon-tp-mode duplicated). Stacked expert
weights [E, out, in] are orthogonalized per expert (EP splits whole experts: nothing to gather).

The momentum lives in the AdamW state 'exp_avg' of the matrix's elements (its 'exp_avg_sq' stays
zero): checkpoints, resharding and the memory planner see the states of AdamW."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..parallel.sharding import ShardSpec, spec_of, tp_axis_group
from ..parallel.state import ParallelDims, group_size
from .adam import AdamW
from .lr_scheduler import DECOUPLED_GROUP

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic iteration
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")  # Megatron-LM's --muon-scale-mode


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix (U V^T of g = U S V^T) per matrix of the last two dims, in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if tall else x


def scale_factor(out: int, inp: int, mode: str) -> float:
    if mode == "spectral":  # Moonlight's sqrt(max(m, n)); x 0.2 (--muon-extra-scale-factor) matches AdamW's RMS
        return math.sqrt(max(out, inp))
    if mode == "shape_scaling":  # Keller Jordan's
        return math.sqrt(max(1.0, out / inp))
    return math.sqrt(out / inp)  # unit_rms_norm


def uses_adam(name: str, param) -> bool:
    """Parameters Muon leaves to AdamW: vectors, biases, embeddings, the output layer, routers."""
    return (param.dim() < 2 or name.endswith(".bias") or ".router." in f".{name}" or "embedding" in name
            or _decoupled(name, param))


def _decoupled(name, param) -> bool:
    from .distributed_optimizer import lr_group  # the word embedding and output layer, as --decoupled-lr sees them
    return lr_group(name, param) == DECOUPLED_GROUP


class Muon:
    """An update rule over whole shards (`update_shard_`, called in place of AdamW's `update_`)."""
    state_names = AdamW.state_names

    def __init__(self, dims: ParallelDims, momentum: float, nesterov: bool, ns_steps: int, scale_mode: str,
                 extra_scale: float, adam: AdamW, split_qkv: bool = True):
        self.dims, self.momentum, self.nesterov, self.ns_steps = dims, momentum, nesterov, ns_steps
        self.scale_mode, self.extra_scale, self.adam, self.split_qkv = scale_mode, extra_scale, adam, split_qkv

    def _orthogonalized(self, m: torch.Tensor) -> torch.Tensor:
        return newton_schulz(m, self.ns_steps) * (self.extra_scale * scale_factor(m.size(-2), m.size(-1),
                                                                                   self.scale_mode))

    @torch.no_grad()
    def update_shard_(self, s, grad: torch.Tensor, lr_of, weight_decay: float, step: int) -> None:
        """Update shard state `s` (a _ShardState with plain fp32 tensors) from its fp32 gradient."""
        bucket, t = s.bucket, s.store.tensors
        buf = t["exp_avg"]
        update: Optional[torch.Tensor] = None  # the shard's momentum updates of matrix elements
        for k, (i, lo, hi) in enumerate(s.segment_params):
            lr, decay = lr_of(s.segment_groups[k]), s.segment_decays[k]
            if uses_adam(bucket.names[i], bucket.params[i]):
                views = {name: x[lo:hi] for name, x in t.items()}
                self.adam.update_(views["main"], grad[lo:hi], views, step=step, lr=lr, weight_decay=weight_decay,
                                  decay_ranges=[(0, hi - lo)] if decay else [])
                continue
            if update is None:
                update = torch.zeros_like(grad)
            buf[lo:hi].lerp_(grad[lo:hi], 1.0 - self.momentum)
            update[lo:hi] = grad[lo:hi].lerp(buf[lo:hi], self.momentum) if self.nesterov else buf[lo:hi]
        if bucket.sharded and bucket.group_size > 1:
            # every DP rank takes part, with zeros where its shard has no matrix
            full = torch.empty(bucket.numel, dtype=torch.float32, device=grad.device)
            local = update if update is not None else torch.zeros_like(grad)
            self.dims.comm.all_gather(full, local, bucket.group)
        elif update is None:
            return
        else:
            full = update
        done = set()  # a matrix has one segment per shard (padding splits only Adam's embeddings)
        for k, (i, lo, hi) in enumerate(s.segment_params):
            if i in done or uses_adam(bucket.names[i], bucket.params[i]):
                continue
            done.add(i)
            first, last = bucket.offsets[i]
            self._apply(s, i, full[first:last], lo, hi, lr_of(s.segment_groups[k]),
                        weight_decay if s.segment_decays[k] else 0.0)

    def _apply(self, s, i: int, flat: torch.Tensor, lo: int, hi: int, lr: float, weight_decay: float) -> None:
        """Orthogonalize matrix i of the bucket (`flat`: its local momentum update) and step its part
        in this rank's shard, shard positions [lo, hi)."""
        bucket, main = s.bucket, s.store.tensors["main"]
        param = bucket.params[i]
        local = flat.view(bucket.shapes[i])
        spec = spec_of(param)
        split = spec.split("tp")
        tp = tp_axis_group(param, self.dims)[0]  # experts: the expert TP group
        if split is not None and group_size(tp) > 1:
            pieces = torch.empty(group_size(tp) * flat.numel(), dtype=flat.dtype, device=flat.device)
            self.dims.comm.all_gather(pieces, flat, tp)
            whole = spec.unshard([p.view(local.shape) for p in pieces.chunk(group_size(tp))], "tp")
        else:
            whole, split = local, None
        if self.split_qkv and bucket.names[i].endswith("linear_kv.weight"):  # [K; V]: Megatron-LM's split QKV
            parts = whole.split(list(spec.split("tp").segments), dim=-2)
            ortho = torch.cat([self._orthogonalized(p) for p in parts], dim=-2)
        else:
            ortho = self._orthogonalized(whole)
        if split is not None:
            ortho = ShardSpec(tuple(whole.shape), (split,)).shard(ortho)
        ortho = ortho.reshape(-1)
        # the part of the matrix inside this shard
        a = bucket.shard_lo + lo - bucket.offsets[i][0]
        target = main[lo:hi]
        if weight_decay:
            target.mul_(1.0 - lr * weight_decay)
        target.add_(ortho[a:a + hi - lo], alpha=-lr)
