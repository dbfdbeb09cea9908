"""Mixed-precision distributed optimizer over this rank's shard of the gradient buckets: ZeRO 0-3.

At stage 0 a rank's shard of a bucket is the whole bucket; at stages 1-3 it is its 1/N slice
(see parallel/data_parallel.py), so one code path serves every stage. For its shard only, the
optimizer keeps the fp32 main params (the param shard itself when params are fp32) and the update
rule's states (AdamW: m and v; adam.py) in a state store (state_store.py: device or host), reads
the reduced gradient, and writes the updated values back into the param shard; GradientSync then
all-gathers the params at stages 1-2 (at stage 3 the shard is all there is).

A step: unscale (fp16) -> skip everywhere if any rank found inf/NaN (the scale backs off) -> the
grad norm of the whole model (model-parallel ranks count each distinct element once, see
`sharding.counts_in_norm`; sharded stages also sum over DP, each shard counted once) -> clip ->
the rule's update -> copy back -> param all-gather.

Parameter groups: the step takes one LR, or one per group (--decoupled-lr: the word embedding and
the output layer form DECOUPLED_GROUP); a shard is updated in one piece whenever its groups share
this step's LR, else run by run. Precision (--use-precision-aware-optimizer, see precision.py):
main params, m and v may be kept in bf16 / fp16 / fp8; each parameter's part of the shard is then
updated in fp32 and stored again.

With --optimizer-cpu-offload the state of the first --optimizer-offload-fraction of the buckets
lives in host memory and the rule runs there (HostStore): the norm and clipping still run on
the device gradients, so the numerics are those of the device run. With
--optimizer-offload-nvme-path every bucket's state lives in a file instead (nvme_store.py), read
into staging buffers around each bucket's update.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist

from ..config import TrainingConfig
from ..errors import NonFiniteError
from ..parallel.bucket_plan import KeptFeatures, state_bytes
from ..parallel.data_parallel import Bucket, GradientSync
from ..parallel.sharding import counts_in_norm, spec_of
from ..parallel.state import ParallelDims, group_size
from .adam import AdamW
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .lr_scheduler import DECOUPLED_GROUP, DEFAULT_GROUP
from .precision import OptimizerPrecision, StateStorage
from .state_store import DeviceStore, held_bytes, place_state

_NORM_SLICE = 1 << 18  # elements per float64 slice of the gradient norm
# shard_tensors()'s entry for params a checkpoint holds instead of the live ones (0/1 Adam's synchronised copy)
CHECKPOINT_PARAMS = "params"


def no_weight_decay(name: str, ndim: int, decay_qk_norms: bool = False) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed; with `decay_qk_norms`
    (--apply-wd-to-qk-layernorm, Megatron-Core's rule for Qwen3-Next, whose zero-centred q/k norm
    weights decay towards a gain of 1) the q/k norms are."""
    if decay_qk_norms and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    return ndim == 1 or name.endswith(".bias")


def _merge(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


LR = Union[float, Mapping[str, float]]  # one LR, or one per parameter group (OptimizerParamScheduler.lrs())
# Parameters of the decoupled-LR group (--decoupled-lr): Megatron's is_embedding_or_output_parameter.
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def lr_group(name: str, param) -> str:
    """The LR group of a parameter: the word embedding and the output layer (also the last stage's
    copy of a tied embedding) are DECOUPLED_GROUP; learned position embeddings are not."""
    if getattr(param, "lr_group", None):  # set by the layer that owns it (DSA's indexer)
        return param.lr_group
    if getattr(param, "is_embedding_or_output_parameter", False) or \
            any(name == n or name.endswith("." + n) for n in EMBEDDING_OR_OUTPUT):
        return DECOUPLED_GROUP
    return DEFAULT_GROUP


def _within(ranges: List[Tuple[int, int]], lo: int, hi: int) -> List[Tuple[int, int]]:
    """`ranges` clipped to [lo, hi), relative to lo."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if max(a, lo) < min(b, hi)]


def _group_runs(groups: List[str], segments: List[Tuple[int, int]], numel: int) -> List[Tuple[str, int, int]]:
    """(group, lo, hi) runs covering [0, numel): consecutive segments of one group merged, the
    bucket's padding at the end given to the last run."""
    runs: List[List] = []
    for g, (lo, hi) in zip(groups, segments):
        if runs and runs[-1][0] == g:
            runs[-1][2] = hi
        else:
            runs.append([g, lo, hi])
    if not runs:
        return [(DEFAULT_GROUP, 0, numel)]
    runs[0][1], runs[-1][2] = 0, numel
    return [tuple(r) for r in runs]


def _stored_numel(param) -> int:
    """Leading flat elements of this rank's piece of `param` that checkpoints hold: all but the
    padding rows past the true vocabulary (vocabulary-parallel weights split along dim 0)."""
    spec = spec_of(param)
    if spec.stored_rows is None:
        return param.numel()
    rows = spec.local_shape[0]
    split = spec.split("tp")
    first = split.index * rows if split is not None and split.dim == 0 else 0
    return max(0, min(rows, spec.stored_rows - first)) * (param.numel() // rows)


def _split_padding(bucket: Bucket) -> List[Tuple[int, int, int]]:
    """The shard's (param index, lo, hi) segments, each cut where its vocabulary padding begins:
    padding is not checkpointed, so it must not share a low-precision scale with stored values."""
    out = []
    for i, lo, hi in bucket.shard_segments():
        cut = _stored_numel(bucket.params[i]) + bucket.offsets[i][0] - bucket.shard_lo
        out += [(i, lo, cut), (i, cut, hi)] if lo < cut < hi else [(i, lo, hi)]
    return out


class _ShardState:
    """One bucket's shard: its store (where 'main' and the update rule's states live, see
    state_store.py) and which ranges of the shard are weight-decayed, counted in the grad norm, and
    in which LR group."""

    def __init__(self, bucket: Bucket, dims: ParallelDims, store: Type[DeviceStore], state_names: Sequence[str],
                 precision: OptimizerPrecision, decay_qk_norms: bool = False):
        self.bucket = bucket
        shard = bucket.param_shard_view()
        segments = _split_padding(bucket)
        self.segment_params = segments  # (param index in the bucket, lo, hi)
        self.segments = [(lo, hi) for _, lo, hi in segments]
        self.segment_decays = [not no_weight_decay(bucket.names[i], len(bucket.shapes[i]), decay_qk_norms)
                               for i, _, _ in segments]
        self.segment_groups = [lr_group(bucket.names[i], bucket.params[i]) for i, _, _ in segments]
        self.decay = _merge([seg for seg, d in zip(self.segments, self.segment_decays) if d])
        self.norm = _merge([(lo, hi) for i, lo, hi in segments if counts_in_norm(bucket.params[i], dims)])
        # Summed over the whole world: a shard (ZeRO 1-3) is this rank's alone, up to its copies in
        # the other distributed-optimizer instances; an unsharded bucket is held alike by every
        # rank of its data-parallel group, each counting its share.
        sharded = bucket.shard_numel < bucket.numel
        self.norm_weight = (1.0 if sharded else 1.0 / bucket.group_size) / group_size(bucket.replica_group)
        self.lr_runs = _group_runs(self.segment_groups, self.segments, shard.numel())
        self.groups = {g for g, _, _ in self.lr_runs}
        self.store = store(shard, state_names, self.segments, precision)
        # all plain fp32 tensors: one update over whole runs (else per parameter segment)
        self.plain = all(isinstance(t, torch.Tensor) for t in self.store.tensors.values())
        self.staged = None  # fp32 copies of low-precision states being filled from a checkpoint
        # The main params are a separate copy of the params (always when the params' views are copies
        # read from their file: --param-offload-nvme-path).
        main = self.store.tensors["main"]
        self.owns_main = bucket.home.copies or not isinstance(main, torch.Tensor) or main.data_ptr() != shard.data_ptr()

    def lr_runs_for(self, lr_of) -> List[Tuple[str, int, int]]:
        """The runs to update separately: one run over the whole shard when every group of it has
        the same LR this step (always, without --decoupled-lr)."""
        if len({lr_of(g) for g in self.groups}) == 1:
            return [(self.lr_runs[0][0], 0, self.lr_runs[-1][2])]
        return self.lr_runs

    def update(self, rule, grad: torch.Tensor, lr_of, weight_decay: float, step: int) -> None:
        """The rule's update of the shard from its fp32 gradient (where the store put it); the
        params follow their main params."""
        tensors, param = self.store.tensors, self.bucket.param_shard_view()
        if hasattr(rule, "update_shard_"):  # a rule over whole matrices (muon.py): plain fp32 states only
            rule.update_shard_(self, grad, lr_of, weight_decay, step)
            if self.owns_main:
                self.store.publish(param, tensors["main"])
            return
        if self.plain:
            for group, lo, hi in self.lr_runs_for(lr_of):
                views = {name: t[lo:hi] for name, t in tensors.items()}
                rule.update_(views["main"], grad[lo:hi], views, step=step, lr=lr_of(group), weight_decay=weight_decay,
                             decay_ranges=_within(self.decay, lo, hi))
            if self.owns_main:
                self.store.publish(param, tensors["main"])
            return
        for k, (lo, hi) in enumerate(self.segments):  # low precision: each parameter's part in fp32
            values = {name: _read(t, k, lo, hi) for name, t in tensors.items()}
            rule.update_(values["main"], grad[lo:hi], values, step=step, lr=lr_of(self.segment_groups[k]),
                         weight_decay=weight_decay, decay_ranges=[(0, hi - lo)] if self.segment_decays[k] else [])
            for name, t in tensors.items():
                _write(t, k, values[name])
            if self.owns_main:
                self.store.publish(param[lo:hi], values["main"])

    def tensors(self) -> Dict[str, torch.Tensor]:
        """fp32 'main' and the rule's states: the states themselves, or fp32 copies of low-precision ones."""
        return {name: _as_fp32(t) for name, t in self.store.tensors.items()}

    def load(self, values: Dict[str, torch.Tensor]) -> None:
        """Store the fp32 copies tensors() gave of low-precision states, filled (plain fp32 tensors
        were filled in place)."""
        for name, t in self.store.tensors.items():
            if isinstance(t, StateStorage):
                t.write_all(values[name])

    @property
    def nbytes(self) -> int:
        """Bytes of the store: its states (main params when a copy) and its staging buffers."""
        held = [t for name, t in self.store.tensors.items() if name != "main" or self.owns_main]
        return sum(held_bytes(t) for t in held) + self.store.staging_bytes


def _read(t, k: int, lo: int, hi: int) -> torch.Tensor:
    return t.read(k) if isinstance(t, StateStorage) else t[lo:hi]


def _write(t, k: int, x: torch.Tensor) -> None:
    if isinstance(t, StateStorage):
        t.write(k, x)  # a plain tensor was updated in place


def _as_fp32(t) -> torch.Tensor:
    return t.read_all() if isinstance(t, StateStorage) else t


class DistributedOptimizer:
    def __init__(self, grad_sync: GradientSync, tcfg: TrainingConfig, precision: Optional[OptimizerPrecision] = None,
                 rule=None):
        self.sync, self.tcfg, self.dims = grad_sync, tcfg, grad_sync.dims
        self.precision = precision or OptimizerPrecision()
        self.rule = rule or AdamW(tcfg.adam_beta1, tcfg.adam_beta2, tcfg.adam_eps)  # the update rule (adam.py)
        self.device = grad_sync.buckets[0].device if grad_sync.buckets else None
        self.placement = place_state([b.shard_numel for b in grad_sync.buckets], self.rule.state_names, self.device,
                                     tcfg.optimizer_cpu_offload, tcfg.optimizer_offload_fraction,
                                     tcfg.optimizer_offload_nvme_path)  # where the state lives (state_store.py)
        self.shards = [_ShardState(b, self.dims, self.placement.store_for(k), self.rule.state_names, self.precision,
                                   tcfg.apply_wd_to_qk_layernorm)
                       for k, b in enumerate(grad_sync.buckets)]
        if tcfg.fp16 and tcfg.loss_scale is not None:
            self.scaler = ConstantLossScaler(tcfg.loss_scale)
        elif tcfg.fp16:
            self.scaler = DynamicLossScaler(tcfg.initial_loss_scale, tcfg.min_loss_scale, tcfg.loss_scale_window,
                                            tcfg.hysteresis)
        else:
            self.scaler = ConstantLossScaler(1.0)
        self.num_updates = 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the whole world: every rank holds a part of the gradients (dense and expert
        parameters reduce over different data-parallel groups; see _ShardState.norm_weight)."""
        self.dims.comm.all_reduce(t, self.dims.group("world"), op=op)
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
        # A rule whose step takes each rank's own gradient (0/1 Adam's local steps): the norm of its
        # estimate of the whole, N_dp x its part of the sum, as the clipping of the other steps sees.
        local = getattr(self.rule, "takes_local_gradients", lambda step: False)(self.num_updates + 1)
        for s, g in zip(self.shards, grads):
            part = torch.zeros((), dtype=torch.float64, device=self.device)
            for lo, hi in s.norm:
                for a in range(lo, hi, _NORM_SLICE):
                    seg = g[a:min(hi, a + _NORM_SLICE)].double()
                    part += torch.dot(seg, seg)
            sq[0] += part * s.norm_weight * (s.bucket.group_size ** 2 if local else 1)
        sq[1] = float(bad_loss)
        sq = self._all_reduce(sq)
        return math.sqrt(sq[0].item()), bool(sq[1].item())

    @torch.no_grad()
    def step(self, lr: LR, loss_is_finite: bool = True, grad_scale: float = 1.0,
             weight_decay: Optional[float] = None) -> Dict[str, float]:
        """One update from the reduced gradients (call after GradientSync.finish()).
        `lr`: one LR, or a mapping group -> LR (`OptimizerParamScheduler.lrs()`; a group missing
        from it takes DEFAULT_GROUP's). `loss_is_finite`: this rank's view of the step's loss
        (ranks without a loss: True). `grad_scale`: what the reduced gradients are multiplied by
        first (1 / global token count: the schedules backpropagate loss sums), in the same pass as
        the loss-scale unscaling. `weight_decay`: this step's (a weight-decay schedule); None:
        --weight-decay.

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
        lr_of = (lambda g: lr) if not isinstance(lr, Mapping) else (lambda g: lr.get(g, lr[DEFAULT_GROUP]))
        wd = self.tcfg.weight_decay if weight_decay is None else weight_decay
        self.placement.update_all([s.store for s in self.shards], grads, lambda k, g: self._update(k, g, lr_of, wd))
        if check and self.tcfg.fp16 and self._found_inf([s.bucket.param_shard_view() for s in self.shards], False)[0]:
            raise NonFiniteError("fp16 parameters overflow (|w| > 65504) when cast from their fp32 main params: the "
                                 "model diverged; lower --lr, or train with --bf16")
        self.sync.zero_grad()
        self.sync.gather_params()
        return {"update_successful": True, "grad_norm": norm, "loss_scale": scale}

    def _update(self, k: int, grad: torch.Tensor, lr_of, weight_decay: float) -> None:
        """Shard k's update, into where its params live (the k-th written this step)."""
        s = self.shards[k]
        with self.sync.param_home.update_into(s.bucket, k):
            s.update(self.rule, grad, lr_of, weight_decay, step=self.num_updates)

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    @torch.no_grad()
    def scale_rows_(self, scales: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Multiply rows of parameters (after an update): (param, factor of each row of this rank's
        piece) pairs; the params and their main params both (QK-clip). Every rank passes its own
        pieces' factors; a ZeRO shard takes the part of them that falls in it. Needs the params and
        fp32 main params in memory (TrainingConfig refuses --qk-clip otherwise)."""
        self.sync.wait_param_gather()
        factors = {id(p): (p, f) for p, f in scales}
        sharded_params = self.sync.stage == 3
        if not sharded_params:
            for p, f in factors.values():  # every rank's full piece (the shard is a view of it)
                p.mul_(f.to(p.dtype).view(-1, *([1] * (p.dim() - 1))))
        for s in self.shards:
            main, shard = s.store.tensors["main"], s.bucket.param_shard_view()
            for i, lo, hi in s.segment_params:
                if id(s.bucket.params[i]) not in factors:
                    continue
                p, f = factors[id(s.bucket.params[i])]
                per_element = f.float().repeat_interleave(math.prod(s.bucket.shapes[i][1:]))
                a = s.bucket.shard_lo + lo - s.bucket.offsets[i][0]
                part = per_element[a:a + hi - lo]
                if s.owns_main:
                    main[lo:hi].mul_(part)
                if sharded_params:
                    shard[lo:hi].mul_(part.to(shard.dtype))

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds across steps: params, grads, optimizer state (main params and the
        rule's states) on the device, and the offloaded optimizer state (with its gradient staging
        buffer) on the host, as bucket_plan.state_bytes accounts them (the planner's figures; `held_bytes`
        measures the tensors; tests hold the two equal). Low-precision states count as stored."""
        on_host = [s.store.on_host for s in self.shards]
        out = state_bytes(self.sync.plans, self.sync.stage, self.sync.grad_dtype, on_host, nvme=self.placement.nvme,
                          kept=self.kept_features())
        out = self.sync.param_home.accounted(out, self.sync.plans, optimizer_nvme=self.placement.nvme, offloaded=on_host)
        if not self.precision.is_default:
            out["optimizer_state_bytes"] = sum(s.nbytes for s in self.shards if not s.store.on_host)
        return out

    def kept_features(self) -> KeptFeatures:
        """What of compression, ZeRO++ and the update rule bucket_plan.kept_bytes accounts here."""
        exchange = getattr(self.sync.reducer, "exchange", None)  # CompressedReducer's error feedback
        zero3, hops = self.sync.zero3, getattr(self.sync.reducer, "hops", None)
        keeps_errors = exchange is not None and exchange.error_feedback
        return KeptFeatures(grad_codec=exchange.codec.name if keeps_errors else None,
                            optimizer=self.tcfg.optimizer, hpz=zero3.hpz if zero3 is not None else 1,
                            group_sizes=tuple(b.group_size for b in self.sync.buckets),
                            qgz_nodes=hops.nodes if hops is not None else 1)

    def _held_kept_bytes(self) -> Dict[str, int]:
        """kept_bytes() measured: the error tensors of every exchange, hpZ's most secondary held at once."""
        out = {}
        exchanges = [h.exchange for h in (self.sync.reducer, self.rule)
                     if hasattr(h, "exchange") and h.exchange.error_feedback]
        if exchanges:
            stores = [s for ex in exchanges for s in (ex.worker, ex.server)]
            stores += [getattr(self.sync.reducer, "node_error", {})]  # two-hop qgZ's second hop
            out["error_feedback_bytes"] = sum(t.numel() * t.element_size() for s in stores for t in s.values())
        zero3 = self.sync.zero3
        if zero3 is not None and zero3.hpz > 1:
            out["hpz_secondary_bytes"] = zero3.secondary_peak_bytes
        return out

    def held_bytes(self) -> Dict[str, int]:
        """memory_bytes() measured from the tensors this rank holds."""
        out = self.sync.held_bytes()
        out["optimizer_state_bytes"] = sum(s.nbytes for s in self.shards if not s.store.on_host)
        out.update(self._held_kept_bytes())
        out["optimizer_state_bytes"] += sum(t.numel() * t.element_size() for t in getattr(self.rule, "anchor", {}).values())
        out.update(self.placement.held_bytes(self.shards))
        return out

    # --- accessors for checkpoints -------------------------------------------------------------
    def shard_tensors(self, for_loading: bool = False) -> List[Tuple[Bucket, Dict[str, torch.Tensor]]]:
        """Per bucket, this rank's optimizer tensors over its shard (positions shard_lo onwards of
        the bucket), in fp32, named as checkpoints store them: the update rule's states, and 'main'
        when the main params are a separate copy of low-precision params (else they are the params;
        an offloaded shard's host copy of fp32 params is stored too), and with --grad-comm-dtype or
        --optimizer adam-1bit the compression residual (compression.py, onebit_adam.py; saving
        folds every rank's errors into it, a collective); when saving, a rule's checkpointed_instead()
        states (0/1 Adam's synchronised copies, CHECKPOINT_PARAMS for the params). Read them, or fill them
        in place: states kept in low precision come as fp32 copies, which `for_loading` keeps
        until `commit_loaded_state()` stores them."""
        out = []
        feedback = [h for h in (self.sync.reducer, self.rule) if hasattr(h, "fold_for_checkpoint")
                    and (for_loading or getattr(h, "checkpoints_residual", True))]  # (no-EF qgZ: loads one only)
        for s in self.shards:
            tensors = {k: v for k, v in s.tensors().items() if k != "main" or s.owns_main}
            staged = False
            if for_loading:  # fp32 copies where the state is not plain fp32 in memory, stored on commit
                tensors, staged = self.placement.loading_copies(tensors, s.plain)
            s.staged = tensors if staged else None
            for h in feedback:  # compression's error feedback (collective when saving)
                tensors[h.residual_name] = (h.residual_for_loading if for_loading else h.fold_for_checkpoint)(s.bucket)
            if not for_loading and hasattr(self.rule, "checkpointed_instead"):  # 0/1 Adam's pending local steps
                tensors.update(self.rule.checkpointed_instead(s))
            out.append((s.bucket, tensors))
        return out

    def commit_loaded_state(self) -> None:
        """After filling shard_tensors(for_loading=True): store the filled low-precision states."""
        for k, s in enumerate(self.shards):
            if s.staged is not None:
                self.placement.commit_loaded(k, s)
            s.staged = None
        self.sync.commit_loaded_params()

    def scalar_state(self) -> dict:
        return {"num_updates": self.num_updates, "loss_scaler": type(self.scaler).__name__,
                "loss_scaler_state": self.scaler.state_dict()}

    def load_scalar_state(self, state: dict, meta: Optional[dict] = None) -> List[str]:
        """Restore the update count, and the loss scaler when it is of the same kind (fp16 to fp16);
        returns a note when the scaler is not restored."""
        self.num_updates = int(state["num_updates"])
        if state["loss_scaler"] != type(self.scaler).__name__:
            return [f"loss scaler not restored ({state['loss_scaler']} in the checkpoint)"]
        self.scaler.load_state_dict(state["loss_scaler_state"])
        return []
