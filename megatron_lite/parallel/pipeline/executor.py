"""Runs a pipeline schedule (a list of actions per rank, from schedules.py) on real model chunks.

One executor serves every schedule. Each rank walks its list in order; consecutive comm
actions form one batch posted with batch_isend_irecv and waited for lazily (just before the
first compute that needs what it received, before the next batch is posted, and at the end),
which schedules.py proves deadlock-free. The zero-bubble B/W split defers the weight-gradient
GEMMs of the layers built with the executor's GemmPath from B to the later W. With `overlap`
(dualpipe-v, --overlap-moe-expert-parallel-comm) the lists put each BW/F pair side by side and the
executor runs the two as interleaved pieces (parallel/overlap.py), each MoE all-to-all of one
micro-batch in flight while the other computes.

A forward is the forward-step protocol (training/step.py): `forward_step(batch, chunk)` after
`chunk.set_input_tensor(received)` on a later stage, and on the last virtual stage the loss
function over its output; the executor knows no batch keys and no loss formula. Stages and
peers come from `dims.placement`, which the lists must be written for; a hop between two chunks
of this rank (V's turn) is a local hand-off. A message is what a chunk's forward returns: one
tensor or a tuple (e.g. multi-token prediction's extra hidden states). Receive buffers need no
shape exchange: the receiving chunk's `pipeline_input_spec(batch)` gives (shape, dtype) per
tensor (lengths may vary by micro-batch); a gradient is shaped like its floating-point output.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..state import ParallelDims
from ..gemm import GemmPath
from ..overlap import Interleaver
from .p2p import P2PBatch
from .schedules import Action, build_schedule, comm_peer, group_steps

Key = Tuple[int, int]  # (microbatch, local chunk)
Message = Tuple[torch.Tensor, ...]


def _differentiable(msg: Message) -> List[torch.Tensor]:
    """The tensors of a message that carry a gradient back."""
    return [t for t in msg if t.is_floating_point()]


class PipelineExecutor:
    def __init__(self, chunks: List[nn.Module], dims: ParallelDims, schedule: str, device,
                 gemm: Optional[GemmPath] = None, overlap: bool = False):
        self.chunks, self.dims, self.schedule, self.device = chunks, dims, schedule, device
        # DualPipe-V's pairs run overlapped (--overlap-moe-expert-parallel-comm): Interleaver.log
        # records the order of their pieces when set to a list
        self.interleaver = Interleaver() if overlap else None
        self.placement, self.rank = dims.placement, dims.pp_rank
        self.gemm = gemm  # the chunks' weight GEMMs defer into it during B (zb-h1, zb-v)
        self.trace: Optional[List[Action]] = None  # set to [] to record the executed actions
        self._lists: Dict[Tuple[int, bool], List[Action]] = {}
        self._warmed_up = False

    def actions(self, num_microbatches: int, forward_only: bool) -> List[Action]:
        key = (num_microbatches, forward_only)
        if key not in self._lists:
            acts = build_schedule(self.schedule, self.dims.pp, num_microbatches, self.dims.vpp,
                                  overlap=self.interleaver is not None)[self.rank]
            assert all(a.kind != "B" for a in acts) or (self.gemm is not None and self.gemm.deferrable), \
                f"the {self.schedule} schedule needs a deferrable GemmPath"
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
        self.inputs: Dict[Key, Message] = {}
        self.outputs: Dict[Key, Message] = {}  # what each forward returned (the last stage: its loss)
        self.out_grads: Dict[Key, Message] = {}
        self.in_grads: Dict[Key, Message] = {}
        self.deferred: Dict[Key, list] = {}
        self.totals = totals
        pending: Optional[P2PBatch] = None
        pending_keys: set = set()
        steps = group_steps(self.actions(len(batches), forward_only))
        paired = None  # the F of an overlapped pair, run with its BW
        for i, step in enumerate(steps):
            if isinstance(step, tuple):  # one batch of communication
                if pending is not None:
                    pending.wait()
                pending, pending_keys = self._post(step), {(a.kind, a.microbatch, a.chunk) for a in step}
                continue
            if step is paired:
                continue
            paired = self._partner(step, steps[i + 1] if i + 1 < len(steps) else None)
            if pending is not None and any(self._uses(a, pending_keys) for a in (step, paired) if a is not None):
                pending.wait()
                pending, pending_keys = None, set()
            if paired is None:
                self._compute(step)
            else:
                self._run_pair(step, paired)
        if pending is not None:
            pending.wait()
        assert not self.deferred, "weight-gradient passes left undone"
        return self.totals

    # --- communication -------------------------------------------------------------------------
    def _post(self, batch: Tuple[Action, ...]) -> P2PBatch:
        ops = []
        for a in batch:
            key, peer = (a.microbatch, a.chunk), self.dims.pp_ranks()[comm_peer(a, self.rank, self.placement)]
            if a.kind == "SEND_F":
                out = self.outputs.pop(key) if self.forward_only else self.outputs[key]
                ops += [("send", t.detach().contiguous(), peer) for t in out]
            elif a.kind == "SEND_B":
                ops += [("send", g.contiguous(), peer) for g in self.in_grads.pop(key)]
            else:
                if a.kind == "RECV_F":
                    spec = self.chunks[a.chunk].pipeline_input_spec(self.batches[a.microbatch])
                    bufs = self.inputs[key] = tuple(torch.empty(s, dtype=d, device=self.device) for s, d in spec)
                else:
                    bufs = self.out_grads[key] = tuple(map(torch.empty_like, _differentiable(self.outputs[key])))
                ops += [("recv", t, peer) for t in bufs]
            if self.trace is not None:
                self.trace.append(a)
        return P2PBatch(ops, self.dims.comm, self.dims.pp_group)

    @staticmethod
    def _uses(a: Action, received: set) -> bool:
        if a.kind == "F":
            return ("RECV_F", a.microbatch, a.chunk) in received
        if a.kind in ("B", "BW"):
            return ("RECV_B", a.microbatch, a.chunk) in received
        return False

    # --- computation ---------------------------------------------------------------------------
    def _partner(self, step: Action, nxt) -> Optional[Action]:
        """The F that runs overlapped with `step` (a BW followed at once by an F), or None."""
        if self.interleaver is None or self.forward_only or step.kind != "BW":
            return None
        return nxt if isinstance(nxt, Action) and nxt.kind == "F" else None

    def _run_pair(self, backward: Action, forward: Action) -> None:
        """BW and F of two micro-batches as interleaved pieces: each hands over to the other after
        starting an MoE all-to-all (Communicator.wait_overlapped), backward first on every rank."""
        comm = self.dims.comm
        comm.interleaver = self.interleaver
        try:
            self.interleaver.run(lambda: self._compute(backward), lambda: self._compute(forward))
        finally:
            comm.interleaver = None

    def _compute(self, a: Action) -> None:
        if self.trace is not None:
            self.trace.append(a)
        key = (a.microbatch, a.chunk)
        if a.kind == "F":
            self._forward(key)
        elif a.kind == "W":
            self.gemm.run(self.deferred.pop(key))
        else:
            self._backward(key, defer_weight_grads=a.kind == "B")

    def _forward(self, key: Key) -> None:
        mb, c = key
        chunk, last = self.chunks[c], self.placement.is_last(self.rank, c)
        with torch.set_grad_enabled(not self.forward_only):
            if not self.placement.is_first(self.rank, c):
                x = self.inputs[key]
                if not self.forward_only:
                    for t in _differentiable(x):
                        t.requires_grad_(True)
                chunk.set_input_tensor(x[0] if len(x) == 1 else x)
            out, loss_func = self.forward_step(self.batches[mb], chunk)
            if not self.placement.is_first(self.rank, c):  # self.inputs holds it for the backward; the
                chunk.set_input_tensor(None)  # chunk would keep it alive until its next forward
            if last:
                loss_sum, tokens, logs = loss_func(out)
                self.totals.add(loss_sum, tokens, logs)
                out = loss_sum if self.forward_only else self.loss_normalization(loss_sum, tokens)
        self.outputs[key] = out = out if isinstance(out, tuple) else (out,)
        after = self.placement.neighbour(self.rank, c, 1)
        if after is not None and after[0] == self.rank:  # a local hand-off: the next chunk's input
            self.inputs[(mb, after[1])] = tuple(t.detach() for t in out)
        if self.forward_only:
            self.inputs.pop(key, None)
            if self.placement.peer(self.rank, c, 1) is None:  # nothing to send
                del self.outputs[key]

    def _backward(self, key: Key, defer_weight_grads: bool) -> None:
        mb, c = key
        outs = _differentiable(self.outputs.pop(key))
        grads = self.out_grads.pop(key, (None,))  # the last stage: the loss, its own gradient
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        if defer_weight_grads:
            self.gemm.deferring = True
        try:
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        finally:
            if defer_weight_grads:
                self.gemm.deferring = False
        if defer_weight_grads:
            self.deferred[key] = self.gemm.take()
        x = self.inputs.pop(key, None)
        if x is not None:
            grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in _differentiable(x))
            before = self.placement.neighbour(self.rank, c, -1)
            if before[0] == self.rank:  # a local hand-off: the previous chunk's output gradient
                self.out_grads[(mb, before[1])] = grads
            else:
                self.in_grads[key] = grads
