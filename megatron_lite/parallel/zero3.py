"""ZeRO-3 parameter sharding: each DP rank stores only its 1/N shard of every parameter; a unit's
full parameters are all-gathered just before they are needed and freed right after.

Units are the modules the model names (GPTModel.sharding_units: its transformer layers) and the
root: the chunk's other parameters (embeddings, final norm, output layer). The root is used at both ends of the
model (embedding first, logits last, and the same tied weight for both), so it stays gathered
through the whole forward and again through the whole backward. Each unit is gathered exactly
twice per micro-batch, which is what ZeRO-3's communication theory counts.

Gather and free points, per micro-batch (`prefetch` = asynchronous all-gather of the unit that
comes next, overlapping the current unit's compute):

  forward   chunk pre-forward        gather root, prefetch layer 0
            layer i pre-forward      wait for layer i, prefetch layer i+1
            layer i post-forward     free layer i
            chunk post-forward       free root
  backward  grad of chunk output     gather root, prefetch the last layer
            grad of layer i output   wait for layer i, prefetch layer i-1
            a unit's every param
            has its gradient         free it
            end of backward          free whatever is still gathered (root)

"Grad of X output" is a tensor hook on that output: it fires once X's output gradient is
complete, i.e. just before X's backward starts. Activation recomputation replays a layer's
forward inside backward; then the hooks neither prefetch nor free.

With `reshard_after_forward=False` (--no-reshard-after-forward) nothing is freed until the step's
end (GradientSync.finish): each unit is gathered once per step, at its first use, and the full
parameters of every chunk stay for the step (one all-gather per step instead of two per
micro-batch: what torchtitan does under pipeline parallelism, where a chunk's micro-batches
interleave with the other chunks').

With --param-offload-nvme-path (param_offload.py) a unit's shards are not in memory: each gather
reads them from the file into a staging buffer (queued ahead by the previous gather: the next unit
in forward order, or in backward order during backward) and gathers from it.

Freeing sets `param.data` to an empty tensor; gathering makes `param.data` a view of the freshly
all-gathered flat bucket. Autograd keeps references to the parameters themselves, so a backward
sees whatever full storage is bound when it runs.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from .state import group_rank, group_size


def unit_params(chunk: nn.Module, layers: List[nn.Module]) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
    """The chunk's units in forward order: (chunk itself, root params), then (layer, its params)
    for the given sub-modules (the model's sharding units, in forward order)."""
    in_layers = {p for layer in layers for p in layer.parameters()}
    root = [p for p in chunk.parameters() if p.requires_grad and p not in in_layers]
    return [(chunk, root)] + [(layer, [p for p in layer.parameters() if p.requires_grad]) for layer in layers]


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _tensors(out) -> List[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class _Part:
    """One bucket of a unit (a unit has one per group its parameters reduce over: dense, experts)."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.full: Optional[torch.Tensor] = None  # gathered flat params while not freed
        self.handle = None  # in-flight all-gather
        self.bound = False  # params are views of `full`
        # --zeropp-hpz-partition-size: this rank's slice of `full` within its hpZ group, kept from
        # the forward's release to the backward, which gathers from it inside the group.
        self.secondary: Optional[torch.Tensor] = None


class _Unit:
    def __init__(self, module: nn.Module, buckets):
        self.module, self.parts = module, [_Part(b) for b in buckets]
        self.num_params = sum(len(b.params) for b in buckets)
        self.arrived = 0  # gradients accumulated since gathered for backward
        self.span: Optional[int] = None  # --param-offload-nvme-path: the unit's span in the file
        self.next_in: Tuple[Optional["_Unit"], Optional["_Unit"]] = (None, None)  # gathered after it: fwd, bwd


class ShardedParams:
    """Gathers and frees the units of a GradientSync's ZeRO-3 buckets (each unit's own buckets)."""

    def __init__(self, sync, chunk_units: List[List[Tuple[nn.Module, List[nn.Parameter]]]],
                 reshard_after_forward: bool = True, hpz_group=None):
        """`hpz_group` (ZeRO++'s hpZ): the consecutive data-parallel ranks (a node's) among which the
        dense units' parameters are re-gathered for backward from a secondary partition."""
        self.sync, self.reshard = sync, reshard_after_forward
        self.hpz_group, self.hpz, self.hpz_rank = hpz_group, group_size(hpz_group), group_rank(hpz_group)
        self.in_backward = False
        self.exact = False  # gather the owners' exact params even under --fp8-param-gather
        # hpZ's secondary partitions held now, and the most held at once (what memory_bytes accounts)
        self.secondary_bytes = self.secondary_peak_bytes = 0
        self.units: List[_Unit] = []
        self.unit_of = {}
        for units in chunk_units:
            chain = [_Unit(m, list(dict.fromkeys(sync.bucket_of[p] for p in ps))) for m, ps in units]
            self.units += chain
            for u in chain:
                for part in u.parts:
                    self.unit_of[part.bucket] = u
            self._register(chain)
        # --param-offload-nvme-path: shards are read from its file to gather (param_offload.ParamSpill)
        self.spill = sync.param_home if sync.param_home.nvme else None
        if self.spill is not None:
            for u in (u for u in self.units if u.parts):  # (a chunk may own no params of its own: no span)
                u.span = self.spill.span_of[u.parts[0].bucket.index]
                assert sorted(p.bucket.index for p in u.parts) == self.spill.spans[u.span], "a unit is one span"
        self.release_all()  # the shards were copied by GradientSync: drop the full params

    def _register(self, chain: List[_Unit]) -> None:
        """chain[0] is the root (the chunk), chain[1:] its layers in forward order."""
        root, layers = chain[0], chain[1:]
        for i, u in enumerate(chain):
            nxt = (layers[0] if layers else None) if u is root else (chain[i + 1] if i + 1 < len(chain) else None)
            prev = (layers[-1] if layers else None) if u is root else (chain[i - 1] if i > 1 else None)
            u.next_in = (nxt, prev)
            u.module.register_forward_pre_hook(lambda m, args, u=u, nxt=nxt: self._pre_forward(u, nxt))
            u.module.register_forward_hook(lambda m, args, out, u=u, prev=prev: self._post_forward(u, prev, out))

    # --- gather / free -----------------------------------------------------------------------
    def _gather(self, u: _Unit) -> None:
        """Under --fp8-param-gather FP8 weights, unless `exact` (gather_all: to read the params)."""
        fp8 = None if self.exact else self.sync.param_gather
        if all(part.full is not None for part in u.parts):
            return
        shards = self._read_shards(u)
        for part in u.parts:
            if part.full is not None:
                continue
            b = part.bucket
            part.full = torch.empty(b.numel, dtype=b.dtype, device=b.device)
            if part.secondary is not None and not self.exact:  # backward, inside the hpZ group
                part.handle = self.sync.dims.comm.all_gather(part.full, part.secondary, self.hpz_group, async_op=True,
                                                             kind="all_gather_hpz")
                continue
            shard = shards[b.index] if shards is not None else b.param_shard
            pending = fp8.start(b, part.full, shard) if fp8 is not None else None
            part.handle = pending or self.sync.dims.comm.all_gather(part.full, shard, b.group, async_op=True)

    def _read_shards(self, u: _Unit):
        """--param-offload-nvme-path: u's shards in a staging buffer (bucket index -> shard), and the
        read of the unit gathered next queued behind; None: the shards are in memory."""
        if self.spill is None:
            return None
        shards = self.spill.acquire(u.span)
        following = u.next_in[1 if self.in_backward else 0]
        if following is not None and any(part.full is None for part in following.parts):
            self.spill.prefetch(following.span)
        return shards

    def _ensure(self, u: _Unit) -> None:
        self._gather(u)
        for part in u.parts:
            if part.handle is not None:
                part.handle.wait()
                part.handle = None
            if not part.bound:
                part.bucket.bind_params(part.full)
                part.bound = True
        if u.span is not None:  # the gathers read their shards: the buffer may take the next unit
            self.spill.release(u.span)

    def _release(self, u: _Unit, keep_secondary: bool = False) -> None:
        """Free the unit's full params; after a forward (`keep_secondary`) with hpZ, keep this
        rank's slice of the dense ones for the backward."""
        for part in u.parts:
            if part.handle is not None:  # never drop a buffer a collective is still writing
                part.handle.wait()
                part.handle = None
            b = part.bucket
            self.secondary_bytes -= _nbytes(part.secondary)
            if not keep_secondary:
                part.secondary = None
            elif self.hpz > 1 and part.full is not None and b.group is self.sync.group:
                n = b.numel // self.hpz
                part.secondary = part.full[self.hpz_rank * n:(self.hpz_rank + 1) * n].clone()
            self.secondary_bytes += _nbytes(part.secondary)
            self.secondary_peak_bytes = max(self.secondary_peak_bytes, self.secondary_bytes)
            for p in part.bucket.params:
                p.data = torch.empty(0, dtype=part.bucket.dtype, device=part.bucket.device)
            part.full, part.bound = None, False
        if u.span is not None:
            self.spill.release(u.span)
        u.arrived = 0

    def gather_all(self) -> None:
        self.exact = True
        try:
            for u in self.units:
                self._ensure(u)
        finally:
            self.exact = False

    def release_all(self) -> None:
        for u in self.units:
            self._release(u)

    # --- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, u: _Unit, nxt: Optional[_Unit]) -> None:
        self._ensure(u)
        if nxt is not None and not self.in_backward:
            self._gather(nxt)

    def _post_forward(self, u: _Unit, prev: Optional[_Unit], out) -> None:
        if self.in_backward:  # recomputation inside backward: the backward hooks manage the unit
            return
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u, prev=prev: self._pre_backward(u, prev))
        if self.reshard:
            self._release(u, keep_secondary=True)

    def _pre_backward(self, u: _Unit, prev: Optional[_Unit]) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._ensure(u)
        if prev is not None:
            self._gather(prev)

    def grad_arrived(self, bucket) -> None:
        """Called by GradientSync after a param's gradient is accumulated: free the unit once all
        its params have theirs (no later backward node of this pass reads them)."""
        u = self.unit_of[bucket]
        u.arrived += 1
        if u.arrived == u.num_params and self.in_backward and self.reshard:
            self._release(u)

    def _end_backward(self) -> None:
        self.in_backward = False
        self.exact = False  # gather the owners' exact params even under --fp8-param-gather
        if self.reshard:
            self.release_all()
