"""RNG streams for dropout, and activation recomputation that replays them exactly.

Dropout on tensors every TP rank holds whole (hidden states without SP) uses the default
stream, seeded identically on all TP ranks so they drop the same elements. Dropout on tensors
that are split across TP (attention probabilities of a rank's heads, hidden states under SP)
uses the "model-parallel" stream, seeded differently per TP rank, as in Megatron-LM.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict

import torch
import torch.utils.checkpoint as torch_checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be swapped in for the device's default generator."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = torch.device(device)
        self.states: Dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:  # no tracker seeded (e.g. unit tests): use the default stream
            yield
            return
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)


def model_parallel_seed(tracker: RNGStatesTracker, seed: int, tp_rank: int, pp_rank: int) -> None:
    """Seed the default stream (same on TP ranks) and the per-TP-rank stream (Megatron's offsets)."""
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    if tracker.device.type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker.add(MODEL_PARALLEL_RNG, default_seed + 2718 + tp_rank)


def recompute(fn, tracker: RNGStatesTracker, *args):
    """Run fn(*args) without keeping its activations; recompute them in backward with the same
    RNG streams (the default one is restored by torch.utils.checkpoint, ours here)."""
    saved = tracker.get_states()
    calls = [0]

    def replay(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            return fn(*a)
        finally:
            tracker.set_states(current)

    return torch_checkpoint.checkpoint(replay, *args, use_reentrant=False, preserve_rng_state=True)


class _Discarded:
    """What a saved tensor is replaced by under `recomputed_when_saved`: where it lies in the
    recomputed output."""
    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index: int, t: torch.Tensor):
        self.index, self.size, self.stride, self.offset = index, t.size(), t.stride(), t.storage_offset()


@contextmanager
def recomputed_when_saved(outputs, fn, *inputs):
    """Inside the block, a tensor autograd saves that lies in one of `outputs` (what fn(*inputs)
    returned: a tensor or a tuple) is not kept: backward computes fn(*inputs) again when it needs
    it (Megatron's output-discarding checkpoint: the layernorm, moe_act and mla_up_proj modules of
    --recompute-modules). fn must be deterministic and keep no RNG; `inputs` are kept (they should
    be kept by backward anyway, or nothing is saved). Other saved tensors go to the hooks outside
    (activation offloading, measurements) as if these were not there."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    where = {t.untyped_storage().data_ptr(): i for i, t in enumerate(outputs)}
    inputs = tuple(x.detach() for x in inputs)
    cache = {}
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False) or (lambda t: t, lambda t: t)

    def pack(t):
        i = where.get(t.untyped_storage().data_ptr())
        return (outer[0](t),) if i is None else _Discarded(i, t)

    def unpack(p):
        if not isinstance(p, _Discarded):
            return outer[1](p[0])
        if "out" not in cache:  # once for every tensor of this backward
            with torch.no_grad():
                out = fn(*inputs)
            cache["out"] = out if isinstance(out, (tuple, list)) else (out,)
        return cache["out"][p.index].as_strided(p.size, p.stride, p.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
