"""Data parallelism: gradients in contiguous bucketed buffers, reduced over the DP group, with
the storage of ZeRO stages 0-3.

Every DP rank runs the same model on different micro-batches. Each micro-batch loss is already
normalised by the GLOBAL token count, so the global-batch gradient is the SUM of the ranks'
gradients (all-reduce at stage 0, reduce-scatter at stages 1-3).

Buckets. Each model chunk's parameters are packed, in reverse registration order (about the
order in which backward produces their gradients), into buckets of about `ddp_bucket_size`
elements; at ZeRO-3 a bucket is one unit instead (a transformer layer, or the rest of the chunk:
see zero3.py), because a unit's parameters are gathered and freed together. A bucket is padded to
a multiple of the DP size and DP rank r owns the r-th contiguous 1/N of every bucket (its shard),
which is what its optimizer updates. Storage, one flat tensor per dtype with buckets as views:

  stage  parameters                          gradients (fp32; bf16 with --grad-reduce-in-bf16)
  0      full (params are views into it)     full, all-reduced
  1      full                                full, reduce-scattered in place (shard valid)
  2      full                                a persistent reduced shard; a bucket's full gradient
                                             only from its first gradient of a micro-batch to its
                                             reduce-scatter in that micro-batch (of the step with
                                             --grad-reduce-once-per-step)
  3      shard; a unit's full params exist   as stage 2
         only around its forward/backward

Readiness. A gradient lands in `param.grad` (autograd's post-accumulate-grad hook, or
`gemm.accumulate_grad` for deferred weight gradients, which calls
`param.grad_ready_hook`); the hook adds it into `param.main_grad` (the param's view of its bucket,
fp32 by default) and counts it. `start_step(m)` announces m gradients per parameter this step
(one per micro-batch). Once per step (stages 0-1; stages 2-3 with --grad-reduce-once-per-step):
when every parameter of a bucket has had its m-th, the bucket is complete and, with
--overlap-grad-reduce, its reduction starts at once, asynchronously, while backward goes on.
Per micro-batch (stages 2-3 by default, as DeepSpeed's ZeRO-2 and FSDP do): when every parameter
of a bucket has had its k-th gradient, round k of its reduction starts (and, without
--overlap-grad-reduce, is waited for right there) and the full buffer is dropped once it is
done; rounds after the first reduce-scatter into a shard-sized buffer that is then added into the
persistent shard. Reduction is linear, so any split of the gradients into rounds gives the same
sum (in another order: fp32 rounding differs). `finish()` launches whatever is left (no overlap;
parameters that got no gradient; buckets holding the pipeline-tied embedding, whose cross-stage
sum must wait for every stage) and waits. Just before its DP reduction a bucket's model-parallel partial sums (sequence-parallel
norms, replicated K/V, tied embedding) are summed by `finalize_model_grads`: sums commute, and in
this order they act on full gradients, which ZeRO shards are not.

Distributed-optimizer instances (--num-distributed-optimizer-instances N): `dp_groups` = (shard
group, replica group) splits the DP ranks into N instances. Buckets are sharded over an instance
(the shard group) and reduce-scattered there; each reduced shard is then summed over the replica
group (the ranks holding the same shard in the other instances), so every instance ends with the
global gradient, as one ZeRO run over all DP ranks would. Params are gathered inside an instance.

Reduction. A bucket's gradient is reduced by a bucket reducer chosen at construction:
`PlainReducer` moves it as it is; another reducer (e.g. compressed, with error feedback) plugs in
with the same two calls, `start(bucket)` for each reduction round (once per step, or once per
micro-batch) and `finish(bucket)` once per step after the last round has completed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .comm import Communicator
from .bucket_plan import BucketPlan, ParamInfo, padded, plan_buckets, state_bytes
from .grads import finalize_model_grads, sum_local_tie_copies
from .param_offload import ParamsInMemory, place_params
from .sharding import spec_of
from .state import ParallelDims, group_rank, group_size
from .tiled_init import materialize_, param_device, swap_in


def _is_expert(p: nn.Parameter) -> bool:
    return spec_of(p).split("ep") is not None


def default_bucket_size(dp: int) -> int:
    """Megatron-LM's default bucket size in elements: 40M, more for large DP groups."""
    return max(40_000_000, 1_000_000 * dp)


class Bucket:
    """Parameters whose gradients are reduced by one collective, and this rank's shard of them."""

    def __init__(self, index: int, params: List[nn.Parameter], names: List[str], group, sharded: bool,
                 grad_dtype: torch.dtype, replica_group=None):
        """`group`: the data-parallel ranks holding the same parameters (DP x CP, or the
        expert-data-parallel group for experts), over which the gradients are reduced and, when
        `sharded` (ZeRO 1-3), the shards are cut. `replica_group` (distributed-optimizer
        instances): the ranks holding the same shard in the other instances, over which each
        reduced shard is summed; replica rank 0 writes it to checkpoints."""
        self.index, self.params, self.names, self.sharded = index, params, names, sharded
        self.group, self.group_size, self.group_rank = group, group_size(group), group_rank(group)
        self.replica_group, self.replica_rank = replica_group, group_rank(replica_group)
        shards = self.group_size if sharded else 1
        shard_rank = self.group_rank if sharded else 0
        self.shapes = [tuple(p.shape) for p in params]
        self.offsets: List[Tuple[int, int]] = []
        n = 0
        for p in params:
            self.offsets.append((n, n + p.numel()))
            n += p.numel()
        self.numel = padded(n, shards)  # every rank's shard has the same size
        self.shard_numel = self.numel // shards
        self.shard_lo = shard_rank * self.shard_numel
        # Parameters may still be on the meta device (built with a DeferredInit): then the buffers
        # go where they will live and are filled from the tiles of their full tensors.
        self.dtype, self.grad_dtype, self.device = params[0].dtype, grad_dtype, param_device(params[0])
        self.param_data: Optional[torch.Tensor] = None  # full flat params (stages 0-2)
        self.param_shard: Optional[torch.Tensor] = None  # stage 3: the only persistent copy
        self.home = ParamsInMemory()  # where the shard lives (param_offload.py)
        self.loaded_shard: Optional[torch.Tensor] = None  # a checkpoint's values for the file (ParamSpill)
        self.grad_data: Optional[torch.Tensor] = None  # full flat gradient
        self.grad_shard: Optional[torch.Tensor] = None  # stages 2-3: reduced shard
        # Stages 2-3, reduction rounds after the first of a step: where the round's reduce-scatter
        # writes (shard-sized), added into grad_shard once it completes.
        self.round_shard: Optional[torch.Tensor] = None
        self.param_handle = None  # in-flight all-gather of updated params (stages 1-2)
        self.launched = False  # the step's last reduction round has started
        self.rounds = 0  # reduction rounds started this step
        self.target = 1  # gradients every param needs before the next round starts
        self.missing = len(params)  # params still short of `target` gradients
        # The pipeline-tied embedding is summed over the first and last stage before its DP
        # reduction; that cannot happen inside one stage's backward without deadlock.
        self.deferred = any(spec_of(p).tie is not None for p in params)

    @property
    def shard(self) -> slice:
        return slice(self.shard_lo, self.shard_lo + self.shard_numel)

    def param_shard_view(self) -> torch.Tensor:
        """The shard to read or update; under --param-offload-nvme-path outside an update: a fresh
        copy read from the file."""
        return self.param_shard if self.param_shard is not None else self.home.shard_view(self)

    def param_shard_for_checkpoint(self, for_loading: bool) -> torch.Tensor:
        """ZeRO-3's shard for a checkpoint to read or fill; an offloaded one is a copy, and a filled
        copy goes to the file at GradientSync.commit_loaded_params()."""
        return self.home.checkpoint_shard(self, for_loading)

    def grad_shard_view(self) -> torch.Tensor:
        return self.grad_shard if self.grad_shard is not None else self.grad_data[self.shard]

    def reduce_out(self) -> torch.Tensor:
        """Where the reduction round being started writes this rank's reduced shard."""
        return self.round_shard if self.round_shard is not None else self.grad_shard_view()

    def segments(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """(param index, a, b): elements [a, b) of that param's flat tensor lie in bucket positions
        [lo, hi)."""
        return [(i, max(s, lo) - s, min(e, hi) - s) for i, (s, e) in enumerate(self.offsets) if max(s, lo) < min(e, hi)]

    def shard_segments(self) -> List[Tuple[int, int, int]]:
        """(param index, lo, hi): positions [lo, hi) of this rank's shard that belong to that param."""
        return [(i, a + self.offsets[i][0] - self.shard_lo, b + self.offsets[i][0] - self.shard_lo)
                for i, a, b in self.segments(self.shard_lo, self.shard_lo + self.shard_numel)]

    def fill_flat(self, out: torch.Tensor, lo: int) -> None:
        """Write bucket positions [lo, lo + out.numel()) of the flat parameters into `out` (zeroed:
        padding stays zero): copied from materialized parameters, drawn for meta ones (only the
        tiles that range meets: a ZeRO-3 shard never sees the rest of its bucket)."""
        for i, a, b in self.segments(lo, lo + out.numel()):
            p = self.params[i]
            dst = out[self.offsets[i][0] + a - lo: self.offsets[i][0] + b - lo]
            if p.is_meta:
                p.deferred_init.fill(dst, p, a)
            else:
                dst.copy_(p.detach().reshape(-1)[a:b])

    def bind_params(self, flat: torch.Tensor) -> None:
        """Make the parameters views of `flat`, the bucket's full flat parameters."""
        self.unbind_meta_params()
        for p, (a, b), shape in zip(self.params, self.offsets, self.shapes):
            # `.data`, not the view itself: the parameter keeps its own version counter, so the
            # in-place writes into the flat buffer (all-gathers, updates) are not autograd's concern.
            p.data = flat[a:b].view(shape)

    def unbind_meta_params(self) -> None:
        """Give parameters still on meta an empty storage on the bucket's device, so that `.data`
        can bind them (at ZeRO-3 to gathered buffers only while their unit runs)."""
        for p in self.params:
            if p.is_meta:
                swap_in(p, torch.empty(0, dtype=self.dtype, device=self.device))
                del p.deferred_init

    def bind_grads(self) -> None:
        for p, (a, b), shape in zip(self.params, self.offsets, self.shapes):
            p.main_grad = self.grad_data[a:b].view(shape)


class PlainReducer:
    """A bucket's gradient reduced as it is: all-reduced over its group (ZeRO 0), or
    reduce-scattered into this rank's shard (ZeRO 1-3), then, with distributed-optimizer
    instances, that shard summed over the replica group. A reducer that keeps state across steps
    (a compressed one's error-feedback residual) keeps it per bucket, keyed by `bucket.index`
    (bucket.numel elements before the reduce-scatter, bucket.shard_numel for the replica sum)."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def start(self, b: "Bucket"):
        """Launch the reduction of b.grad_data over b.group (into b.reduce_out() when sharded);
        returns its async handle (or None)."""
        if not b.sharded:
            return self.comm.all_reduce(b.grad_data, b.group, async_op=True)
        return self.comm.reduce_scatter(b.reduce_out(), b.grad_data, b.group, async_op=True)

    def finish(self, b: "Bucket") -> None:
        """After the step's last round completed (and was added into the shard): the
        replica-group sum of the reduced shard (if any)."""
        if b.replica_group is not None:
            self.comm.all_reduce(b.grad_shard_view(), b.replica_group)


@dataclass
class _Round:
    """One reduction of a bucket in flight: what it reads and writes stays referenced until it is
    retired (at stages 2-3 the bucket itself already accumulates the next micro-batch afresh)."""
    bucket: Bucket
    handle: object
    grad: torch.Tensor  # the full gradient being reduced
    out: Optional[torch.Tensor]  # a round after the first: its reduced shard, to add into grad_shard
    final: bool  # the bucket's last round of the step: the reducer's finish() follows


def _flat_views(buckets: List[Bucket], size: Callable[[Bucket], int], dtype: Callable[[Bucket], torch.dtype]):
    """One zeroed flat tensor per (dtype, device) holding the buckets' pieces back to back."""
    views: List[Optional[torch.Tensor]] = [None] * len(buckets)
    by_kind: Dict[tuple, List[int]] = {}
    for i, b in enumerate(buckets):
        by_kind.setdefault((dtype(b), b.device), []).append(i)
    for (dt, device), idx in by_kind.items():
        flat = torch.zeros(sum(size(buckets[i]) for i in idx), dtype=dt, device=device)
        n = 0
        for i in idx:
            views[i] = flat[n:n + size(buckets[i])]
            n += size(buckets[i])
    return views


class GradientSync:
    """Owns the parameter and gradient buffers of every model chunk and their DP communication.

    Per step: `start_step(num_microbatches)`, forward/backward of every micro-batch, `finish()`,
    then the optimizer reads `bucket.grad_shard_view()`, writes `bucket.param_shard_view()` and
    calls `zero_grad()` and `gather_params()`."""

    def __init__(self, chunks: List[nn.Module], dims: ParallelDims, *, zero_stage: int = 0,
                 bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False, grad_dtype: torch.dtype = torch.float32,
                 units: Optional[List[List[nn.Module]]] = None, dp_groups: Optional[Tuple[object, object]] = None,
                 reducer=None, grad_reduce_once_per_step: bool = False, reshard_after_forward: bool = True,
                 param_gather=None, hpz_group=None, param_offload_nvme_path: Optional[str] = None):
        """`units` (ZeRO-3): per chunk, the modules whose parameters are gathered and freed
        together (a model's transformer layers); the rest of a chunk is one more unit.
        `dp_groups` (distributed-optimizer instances): (shard group, replica group) of the dense
        parameters, instead of sharding over all DP x CP ranks. `reducer`: what reduces each
        complete bucket (PlainReducer's start / finish; None: a PlainReducer).
        `grad_reduce_once_per_step`: stages 2-3 keep each bucket's full gradient across the step's
        micro-batches and reduce it once (less traffic, no gradient memory sharded during the
        step) instead of once per micro-batch; stages 0-1 always reduce once per step.
        `reshard_after_forward` (ZeRO-3): False keeps each unit gathered from its first use to the
        end of the step (zero3.py). `param_gather` (--fp8-param-gather, stages 1-2): its start(bucket) gathers a bucket's updated params
        instead of the plain all-gather (None where it does not apply). `hpz_group` (ZeRO-3,
        --zeropp-hpz-partition-size): where backward re-gathers the dense units (zero3.py).
        `param_offload_nvme_path` (ZeRO-3): keep the param shards in a file there (param_offload.py;
        collective: a full or unwritable directory on any rank is every rank's one-line error)."""
        from .zero3 import ShardedParams, unit_params  # zero3 builds on Bucket: import late

        self.dims, self.stage, self.param_gather = dims, zero_stage, param_gather
        self.reducer = reducer if reducer is not None else PlainReducer(dims.comm)
        # The group dense buckets are sharded and reduced over, and (distributed-optimizer
        # instances only) the group each reduced shard is then summed over (None: one member).
        self.group, self.replica_group = (dims.dp_cp_group, None) if dp_groups is None else dp_groups
        if self.replica_group is not None and self.stage == 0:
            raise ValueError("distributed-optimizer instances need a sharded optimizer (ZeRO stage >= 1)")
        self.replica_rank = group_rank(self.replica_group)  # 0: the instance that writes checkpoints
        self.dp, self.dp_rank = group_size(self.group), group_rank(self.group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.per_microbatch = self.stage >= 2 and not grad_reduce_once_per_step
        self.overlap_param_gather = overlap_param_gather and self.stage in (1, 2)
        self.grad_dtype = grad_dtype
        bucket_size = bucket_size or default_bucket_size(self.dp)
        for chunk in chunks:
            for p in chunk.parameters():
                spec_of(p)  # a plain parameter's default spec, from its shape before ZeRO-3 frees it
        self.buckets: List[Bucket] = []
        self.plans: List[BucketPlan] = []  # the buckets as bucket_plan describes them (the accounting)
        units_of_chunks, units = units, []  # ZeRO-3: per chunk, its units (module, params) in forward order
        for c, chunk in enumerate(chunks):
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            unit_of = {}
            if self.stage == 3:
                units.append(unit_params(chunk, units_of_chunks[c] if units_of_chunks else []))
                unit_of = {p: u for u, (_, ps) in enumerate(units[-1]) for p in ps}
            infos = [ParamInfo(n, p.numel(), p.dtype, _is_expert(p), unit_of.get(p, 0)) for n, p in named]
            for plan in plan_buckets(infos, self.stage, bucket_size, self.dp, group_size(dims.group("edp"))):
                group = dims.group("edp") if plan.expert else self.group  # experts: over expert-data-parallel
                self.buckets.append(Bucket(len(self.buckets), [named[i][1] for i in plan.params],
                                           [named[i][0] for i in plan.params], group, self.stage >= 1, self.grad_dtype,
                                           None if plan.expert else self.replica_group))
                self.plans.append(plan)
        self.params = [p for b in self.buckets for p in b.params]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.arrivals = {p: 0 for p in self.params}
        self.expected: Optional[int] = None
        self._inflight: List[_Round] = []  # launched reductions not yet retired
        self._retire_queued = False  # per micro-batch: retirement queued for the end of this backward
        self._allocate()
        for chunk in chunks:  # parameters in no bucket (frozen) that were left on meta
            materialize_(chunk)
        self.param_home = place_params(param_offload_nvme_path, self.buckets, self.plans)  # (param_offload.py)
        self.zero3 = ShardedParams(self, units, reshard_after_forward, hpz_group) if self.stage == 3 else None
        self._register_hooks(chunks)

    # --- storage -----------------------------------------------------------------------------
    def _allocate(self) -> None:
        bs = self.buckets
        if self.stage == 3:
            for b, shard in zip(bs, _flat_views(bs, lambda b: b.shard_numel, lambda b: b.dtype)):
                b.param_shard = shard
                b.fill_flat(shard, b.shard_lo)  # zero3.ShardedParams frees the full params
                b.unbind_meta_params()
        else:
            for b, flat in zip(bs, _flat_views(bs, lambda b: b.numel, lambda b: b.dtype)):
                b.fill_flat(flat, 0)
                b.param_data = flat
                b.bind_params(flat)
        if self.stage <= 1:
            for b, flat in zip(bs, _flat_views(bs, lambda b: b.numel, lambda b: b.grad_dtype)):
                b.grad_data = flat
                b.bind_grads()
        else:
            for b, shard in zip(bs, _flat_views(bs, lambda b: b.shard_numel, lambda b: b.grad_dtype)):
                b.grad_shard = shard

    def commit_loaded_params(self) -> None:
        """Write the shards a checkpoint filled (Bucket.param_shard_for_checkpoint) where they live."""
        self.param_home.commit_loaded(self.buckets)

    def _alloc_grad(self, b: Bucket) -> None:
        """Stages 2-3: the bucket's full gradient, from its first gradient of the step."""
        b.grad_data = torch.zeros(b.numel, dtype=b.grad_dtype, device=b.device)
        b.bind_grads()

    def _free_grad(self, b: Bucket) -> None:
        b.grad_data = None
        for p in b.params:
            p.main_grad = None

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of parameters and gradients this rank keeps across steps, as bucket_plan accounts
        them (the planner's function; `held_bytes` measures the tensors)."""
        acc = self.param_home.accounted(state_bytes(self.plans, self.stage, self.grad_dtype), self.plans, True)
        return {k: v for k, v in acc.items() if k != "optimizer_state_bytes"}

    def held_bytes(self) -> Dict[str, int]:
        """Bytes of the parameter and gradient tensors this rank keeps across steps, measured."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        params = [b.param_shard if self.stage == 3 else b.param_data for b in self.buckets]
        grads = [b.grad_shard if self.stage >= 2 else b.grad_data for b in self.buckets]
        return {"param_bytes": nbytes(params), "grad_bytes": nbytes(grads), **self.param_home.held_bytes()}

    # --- gradient readiness and reduction ----------------------------------------------------
    def _register_hooks(self, chunks: List[nn.Module]) -> None:
        for p in self.params:
            p.grad_ready_hook = self._on_grad_ready
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.overlap_param_gather:
            for chunk in chunks:
                for m in chunk.modules():
                    owned = {self.bucket_of[p] for p in m.parameters(recurse=False) if p in self.bucket_of}
                    if owned:
                        m.register_forward_pre_hook(lambda mod, args, bs=tuple(owned): self._wait_params(bs))

    def start_step(self, num_microbatches: int) -> None:
        """Each parameter will receive `num_microbatches` gradients before finish()."""
        self.expected = num_microbatches
        for b in self.buckets:
            b.target = 1 if self.per_microbatch else num_microbatches

    @torch.no_grad()  # also when called from accumulate_grad outside autograd
    def _on_grad_ready(self, p: nn.Parameter, grad: Optional[torch.Tensor] = None) -> None:
        """p.grad (autograd's hook), or `grad` (accumulate_grad: a deferred weight gradient)."""
        g = p.grad if grad is None else grad
        if g is None:
            return
        b = self.bucket_of[p]
        if b.grad_data is None:
            self._alloc_grad(b)
        p.main_grad.add_(g)
        p.grad = None
        if self.zero3 is not None:
            self.zero3.grad_arrived(b)
        self.arrivals[p] += 1
        n = self.arrivals[p]
        if self.expected is None or n < b.target:
            return
        if b.deferred:
            # reduced at finish() whatever the count: the last stage's copy of the embedding may take
            # its gradient in two passes (the lookups in backward, the output GEMMs deferred by zb-h1)
            return
        if n > self.expected:  # its bucket may already be reduced: refuse to return wrong gradients
            name = next(nm for q, nm in zip(b.params, b.names) if q is p)
            raise RuntimeError(f"parameter {name} received {n} gradients in a step of {self.expected} "
                               f"micro-batches (used twice per micro-batch?); the data-parallel reduction "
                               f"expects one per micro-batch")
        if n > b.target:  # arrived early (zb-h1's B of a later micro-batch before W): already counted
            return
        b.missing -= 1
        if b.deferred or not (self.per_microbatch or self.overlap_grad_reduce):
            return  # reduced in finish()
        while b.missing == 0 and not b.launched:
            self._launch(b, final=b.target == self.expected)
            if not self.overlap_grad_reduce:  # per micro-batch: wait here, so that the buffer goes now
                self._complete(wait=True)
            b.target += 1
            b.missing = sum(self.arrivals[q] < b.target for q in b.params)

    def _launch(self, b: Bucket, final: bool) -> None:
        if b.grad_data is None:  # no gradient since the last round (or at all): reduce zeros, like every rank
            self._alloc_grad(b)
        finalize_model_grads(b.params, self.dims)
        if b.rounds and b.grad_shard is not None:  # the shard holds earlier rounds: add this one after
            b.round_shard = torch.empty(b.shard_numel, dtype=b.grad_dtype, device=b.device)
        if self.per_microbatch:
            # One round in flight at a time (it overlaps the compute that fills the next bucket), and
            # none past the end of this backward: the full buffers are bounded whatever the
            # backend's completion polling says (gloo's never reports an op done before its wait).
            self._complete(wait=True)
            if not self._retire_queued and torch._C._current_graph_task_id() != -1:
                self._retire_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        rnd = _Round(b, self.reducer.start(b), b.grad_data, b.round_shard, final)
        b.round_shard, b.rounds, b.launched = None, b.rounds + 1, final
        if self.stage >= 2:  # the round holds the full gradient until it is retired
            self._free_grad(b)
        self._inflight.append(rnd)
        self._complete(wait=False)

    def _end_backward(self) -> None:
        self._retire_queued = False
        self._complete(wait=True)

    def _complete(self, wait: bool) -> None:
        """Retire reductions that are done (all of them when `wait`), each bucket's in launch order
        (a later round adds into the shard an earlier one writes). Stages 2-3 drop a round's full
        gradient right away, so that with --overlap-grad-reduce and several buckets only the
        buckets still accumulating or in flight exist at once."""
        pending, blocked = [], set()
        for r in self._inflight:
            b = r.bucket
            if b.index in blocked or (r.handle is not None and not (wait or r.handle.is_completed())):
                pending.append(r)
                blocked.add(b.index)
                continue
            if r.handle is not None:
                r.handle.wait()
            if r.out is not None:
                b.grad_shard.add_(r.out)
            if r.final:
                self.reducer.finish(b)
        self._inflight = pending

    def finish(self) -> None:
        """After the last micro-batch's backward: every bucket reduced; stages 2-3 keep only shards."""
        if self.dims.pp > 1 and len(set(self.dims.placement.end_ranks())) == 1:
            # Both tied copies on this rank, in two chunks' buckets: neither bucket has been
            # launched (tied buckets are deferred), so sum them before any reduction.
            for b in self.buckets:
                if b.deferred and b.grad_data is None:
                    self._alloc_grad(b)
            sum_local_tie_copies(p for b in self.buckets if b.deferred for p in b.params)
        for b in self.buckets:
            if not b.launched:
                self._launch(b, final=True)
        self._complete(wait=True)
        if self.zero3 is not None and not self.zero3.reshard:  # kept gathered through the step
            self.zero3.release_all()
        for b in self.buckets:
            b.launched, b.missing, b.rounds, b.target = False, len(b.params), 0, 1
        self.expected = None
        for p in self.arrivals:
            self.arrivals[p] = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.grad_data is not None:
                b.grad_data.zero_()
        for p in self.params:
            p.grad = None

    # --- parameters after the update ---------------------------------------------------------
    def gather_params(self) -> None:
        """Stages 1-2: all-gather every rank's updated shard into the full params (asynchronously
        with --overlap-param-gather: each module's forward pre-hook waits for its buckets)."""
        if self.stage not in (1, 2):
            return
        for b in self.buckets:
            pending = self.param_gather.start(b) if self.param_gather is not None else None
            b.param_handle = pending or self.dims.comm.all_gather(b.param_data, b.param_data[b.shard], b.group,
                                                                  async_op=True)
        if not self.overlap_param_gather:
            self.wait_param_gather()

    def _wait_params(self, buckets) -> None:
        for b in buckets:
            if b.param_handle is not None:
                b.param_handle.wait()
                b.param_handle = None

    def wait_param_gather(self) -> None:
        self._wait_params(self.buckets)

    @contextmanager
    def gathered_params(self):
        """Full, current parameters inside the block (collective over DP at ZeRO-3), e.g. to read
        or save them; at ZeRO-3 they are sharded again on exit. With --fp8-param-gather the other
        ranks' shards are FP8 values: gathered again exactly from their owners."""
        self.wait_param_gather()
        if self.zero3 is None:
            if self.param_gather is not None and self.stage in (1, 2):
                for b in self.buckets:
                    self.dims.comm.all_gather(b.param_data, b.param_data[b.shard], b.group)
            yield
            return
        self.zero3.gather_all()
        try:
            yield
        finally:
            self.zero3.release_all()
