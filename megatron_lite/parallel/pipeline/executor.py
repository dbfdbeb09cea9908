"""Runs a pipeline schedule (a list of actions per rank, from schedules.py) on real model chunks.

One executor serves every schedule. Each rank walks its list in order; consecutive comm
actions form one batch posted with batch_isend_irecv and waited for lazily (just before the
first compute that needs what it received, before the next batch is posted, and at the end),
which schedules.py proves deadlock-free. The zero-bubble B/W split defers the weight-gradient
GEMMs of the linear layers built with the executor's WeightGradStore from B to the later W.

A forward is the forward-step protocol (training/step.py): `forward_step(batch, chunk)` after
`chunk.set_input_tensor(received)` on a later stage, and on the last virtual stage the loss
function over its output; the executor knows no batch keys and no loss formula.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..state import ParallelDims
from ..tensor_parallel import WeightGradStore
from .p2p import P2PBatch
from .schedules import Action, build_schedule, comm_peer, group_steps

Key = Tuple[int, int]  # (microbatch, local chunk)


def activation_shape(seq_length: int, micro_batch_size: int, hidden_size: int, dims: ParallelDims,
                     sequence_parallel: bool) -> Tuple[int, int, int]:
    """[s, b, h] of the hidden states a stage sends: the sequence split over CP (context
    parallelism) and, under sequence parallelism, over TP."""
    seq = seq_length // dims.cp // (dims.tp if sequence_parallel and dims.tp > 1 else 1)
    return seq, micro_batch_size, hidden_size


class PipelineExecutor:
    def __init__(self, chunks: List[nn.Module], dims: ParallelDims, schedule: str, act_shape: Tuple[int, ...],
                 dtype: torch.dtype, device, weight_grad_store: Optional[WeightGradStore] = None):
        self.chunks, self.dims, self.schedule = chunks, dims, schedule
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.store = weight_grad_store  # the chunks' linear layers defer into it during B (zb-h1)
        if any(a.kind == "B" for a in build_schedule(schedule, dims.pp, dims.pp, dims.vpp)[dims.pp_rank]):
            assert weight_grad_store is not None, f"the {schedule} schedule needs a WeightGradStore"
        self.num_stages = dims.pp * dims.vpp
        self.trace: Optional[List[Action]] = None  # set to [] to record the executed actions
        self._lists: Dict[Tuple[int, bool], List[Action]] = {}
        self._warmed_up = False

    def actions(self, num_microbatches: int, forward_only: bool) -> List[Action]:
        key = (num_microbatches, forward_only)
        if key not in self._lists:
            acts = build_schedule(self.schedule, self.dims.pp, num_microbatches, self.dims.vpp)[self.dims.pp_rank]
            if forward_only:  # evaluation: the same order without any backward work
                acts = [a for a in acts if a.kind in ("F", "SEND_F", "RECV_F")]
            self._lists[key] = acts
        return self._lists[key]

    def run(self, batches: List[dict], forward_step, loss_normalization, totals, forward_only: bool = False):
        """One step over `batches`; the last stage adds each loss function's result to `totals`
        (anything with .add(loss_sum, tokens, logs)), which is returned, and backpropagates
        `loss_normalization(loss_sum, tokens)` (the step's LossNormalization; unused when forward_only)."""
        if not self._warmed_up and self.device.type == "cuda":
            # NCCL sets up a group's communicators lazily; a first batched p2p that does not
            # involve every rank of the group can hang, so touch the whole group once.
            torch.distributed.barrier(group=self.dims.pp_group)
        self._warmed_up = True
        self.batches, self.forward_step, self.loss_normalization = batches, forward_step, loss_normalization
        self.forward_only = forward_only
        self.inputs: Dict[Key, torch.Tensor] = {}
        self.outputs: Dict[Key, torch.Tensor] = {}
        self.out_grads: Dict[Key, torch.Tensor] = {}
        self.in_grads: Dict[Key, torch.Tensor] = {}
        self.deferred: Dict[Key, list] = {}
        self.totals = totals
        pending: Optional[P2PBatch] = None
        pending_keys: set = set()
        for step in group_steps(self.actions(len(batches), forward_only)):
            if isinstance(step, tuple):  # one batch of communication
                if pending is not None:
                    pending.wait()
                pending, pending_keys = self._post(step), {(a.kind, a.microbatch, a.chunk) for a in step}
                continue
            if pending is not None and self._uses(step, pending_keys):
                pending.wait()
                pending, pending_keys = None, set()
            self._compute(step)
        if pending is not None:
            pending.wait()
        assert not self.deferred, "weight-gradient passes left undone"
        return self.totals

    # --- communication -------------------------------------------------------------------------
    def _post(self, batch: Tuple[Action, ...]) -> P2PBatch:
        ops = []
        for a in batch:
            key, peer = (a.microbatch, a.chunk), self.dims.pp_ranks()[comm_peer(a, self.dims.pp_rank, self.dims.pp)]
            if a.kind == "SEND_F":
                ops.append(("send", self.outputs[key].detach().contiguous(), peer))
                if self.forward_only:
                    del self.outputs[key]
            elif a.kind == "SEND_B":
                ops.append(("send", self.in_grads.pop(key).contiguous(), peer))
            else:
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                (self.inputs if a.kind == "RECV_F" else self.out_grads)[key] = buf
                ops.append(("recv", buf, peer))
            if self.trace is not None:
                self.trace.append(a)
        return P2PBatch(ops, self.dims.comm_counter)

    @staticmethod
    def _uses(a: Action, received: set) -> bool:
        if a.kind == "F":
            return ("RECV_F", a.microbatch, a.chunk) in received
        if a.kind in ("B", "BW"):
            return ("RECV_B", a.microbatch, a.chunk) in received
        return False

    # --- computation ---------------------------------------------------------------------------
    def _compute(self, a: Action) -> None:
        if self.trace is not None:
            self.trace.append(a)
        key = (a.microbatch, a.chunk)
        if a.kind == "F":
            self._forward(key)
        elif a.kind == "W":
            WeightGradStore.run(self.deferred.pop(key))
        else:
            self._backward(key, defer_weight_grads=a.kind == "B")

    def _forward(self, key: Key) -> None:
        mb, c = key
        chunk, stage = self.chunks[c], c * self.dims.pp + self.dims.pp_rank
        last = stage == self.num_stages - 1
        with torch.set_grad_enabled(not self.forward_only):
            if stage > 0:
                x = self.inputs[key]
                if not self.forward_only:
                    x.requires_grad_(True)
                chunk.set_input_tensor(x)
            out, loss_func = self.forward_step(self.batches[mb], chunk)
            if last:
                loss_sum, tokens, logs = loss_func(out)
                self.totals.add(loss_sum, tokens, logs)
                out = loss_sum if self.forward_only else self.loss_normalization(loss_sum, tokens)
        self.outputs[key] = out
        if self.forward_only:
            self.inputs.pop(key, None)
            if last:
                del self.outputs[key]

    def _backward(self, key: Key, defer_weight_grads: bool) -> None:
        out = self.outputs.pop(key)
        grad = self.out_grads.pop(key, None)
        if defer_weight_grads:
            self.store.deferring = True
        try:
            torch.autograd.backward(out, grad_tensors=grad)
        finally:
            if defer_weight_grads:
                self.store.deferring = False
        if defer_weight_grads:
            self.deferred[key] = self.store.take()
        x = self.inputs.pop(key, None)
        if x is not None:
            self.in_grads[key] = x.grad
