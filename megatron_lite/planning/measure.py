"""Measuring the memory a training step allocates, on any device (the CPU included, where
`torch.cuda.max_memory_allocated` does not exist and the resident set is blurred by malloc's
pools): a TorchDispatchMode that sees every tensor an operator creates, forward, backward,
recomputation and collectives alike, counts the bytes of each new storage while it is alive (a
weak reference tells when it dies) and keeps the peak. Storages that existed before (parameters,
gradient buffers, optimizer state, the batch) are not counted, nor views and in-place results.

This is what the planner's activation model is checked against (tests/test_planner.py): the
peak of what one step allocates on top of the state held across steps.
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> Dict[int, torch.UntypedStorage]:
    out = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            out[id(st)] = st
    return out


class StepMemory(TorchDispatchMode):
    """`with StepMemory() as m: ...` -> m.peak_bytes (and m.live_bytes now): bytes of the storages
    created inside the block, at their most."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._alive: Dict[int, tuple] = {}  # id(storage) -> (weak ref, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        for key, st in _storages(out).items():
            if key not in inputs and key not in self._alive:
                self._add(key, st)
        return out

    def _add(self, key: int, st: torch.UntypedStorage) -> None:
        n = st.nbytes()
        self._alive[key] = (weakref.ref(st, lambda _, key=key: self._drop(key)), n)
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _drop(self, key: int) -> None:
        _, n = self._alive.pop(key, (None, 0))
        self.live_bytes -= n


class SavedActivations(StepMemory):
    """StepMemory that also counts, in `saved_bytes` (peak: `peak_saved_bytes`), the storages made
    inside the block that autograd saved for a backward (or that a deferred weight-gradient GEMM
    still holds), while they live: the activations a pipeline rank holds between its forwards and
    backwards, without the temporaries of the op running now."""

    def __init__(self):
        super().__init__()
        self._saved, self.saved_bytes, self.peak_saved_bytes = {}, 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def hold(self, t: torch.Tensor) -> None:
        """Count t's storage, if made in the block, while it lives (e.g. a forward's output that a
        pipeline executor keeps for the backward)."""
        if t.device.type != "meta":
            st = t.untyped_storage()
            entry = self._alive.get(id(st))
            if entry is not None and id(st) not in self._saved:
                self._saved[id(st)] = entry[1]
                self.saved_bytes += entry[1]
                self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.hold(t)
        return t.detach()  # not the tensor itself: an output saving its own grad_fn would make a cycle

    def _drop(self, key: int) -> None:
        super()._drop(key)
        self.saved_bytes -= self._saved.pop(key, 0)

    def __enter__(self):
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._hooks.__exit__(*exc)

class SavedBytes:
    """`with SavedBytes(layers) as saved: <forward>` -> saved.per_layer {layer name: bytes}: the
    storages autograd keeps for backward (saved-tensor hooks), each counted once, in the layer that
    saves it first; parameters and buffers are not counted. `layers`: {name: module}."""

    def __init__(self, layers: Dict[str, torch.nn.Module]):
        self.per_layer: Dict[str, int] = {}
        self._current = None
        self._seen: Dict[int, torch.UntypedStorage] = {}  # kept alive so no id is reused
        self._layers = layers
        self._hooks = []
        self._held = set()

    def __enter__(self) -> "SavedBytes":
        for name, layer in self._layers.items():
            self._held |= {id(t.untyped_storage()) for t in (*layer.parameters(), *layer.buffers())}
            self._hooks.append(layer.register_forward_pre_hook(lambda m, a, name=name: self._enter_layer(name)))
            self._hooks.append(layer.register_forward_hook(lambda m, a, o: self._enter_layer(None)))
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for h in self._hooks:
            h.remove()

    def _enter_layer(self, name) -> None:
        self._current = name

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = id(st)
        if self._current is not None and key not in self._held and key not in self._seen:
            self._seen[key] = st
            self.per_layer[self._current] = self.per_layer.get(self._current, 0) + st.nbytes()
        return t
