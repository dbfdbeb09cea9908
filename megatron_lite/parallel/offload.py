"""Activation CPU offloading (--cpu-offloading, --cpu-offloading-num-layers, Megatron-LM's flags):
what autograd saves inside an offloaded layer's forward goes to host memory and comes back when
backward needs it, per micro-batch (each forward's saved tensors are its own).

Saved-tensor hooks around the layer: packing copies a saved tensor (not a parameter; a tensor
saved twice once) into a host buffer, pinned on CUDA, on a side stream that waits for the
tensor's producer, so the copy overlaps the rest of the forward (the device block is kept until
the copy is done: record_stream). In backward, the first unpack of a layer's tensors brings all
of them back on the side stream, and starts bringing the layer before it (the next one backward
needs), so its copy overlaps this layer's backward. On the CPU the "host copy" is a second CPU
tensor, copied back for backward, and nothing needs a stream: the same path, checked by the tests.

planning/measure.StepMemory does not count the host buffers (made outside any dispatch mode): it
measures device memory, on the CPU too.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes


def _host_buffer(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    with _disable_current_modes():  # not device memory: hidden from StepMemory (and any dispatch mode)
        # the same strides: backward kernels (compiled ones check) see the layout they saved
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pinned)


class _LayerGroup:
    """One layer's saved tensors of one forward: their host copies, then their device copies."""

    def __init__(self, offloader: "ActivationOffloader", layer_number: int, before: Optional["_LayerGroup"]):
        self.offloader, self.layer_number = offloader, layer_number
        self.before = weakref.ref(before) if before is not None else None  # the layer run just before, if any
        self.host: List[torch.Tensor] = []
        self.index: Dict[tuple, tuple] = {}  # a saved tensor's place -> (its storage, weakly; its index)
        self.fetched: Optional[List[torch.Tensor]] = None
        self.ready = None  # CUDA: the event after the copies back

    def pack(self, t: torch.Tensor):
        weight = isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)
        if weight or t.device.type != self.offloader.device.type:
            return t  # weights stay where they are, and so do tensors that are not on the device
        st = t.untyped_storage()
        key = (st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen = self.index.get(key)
        if seen is not None and seen[0]() is st:  # the same tensor again (not a new one at a freed address)
            return seen[1]
        self.index[key] = (weakref.ref(st), len(self.host))
        self.host.append(self.offloader.to_host(t))
        return len(self.host) - 1

    def unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        return self.fetch()[handle]

    def fetch(self) -> List[torch.Tensor]:
        self._bring()
        self.offloader.wait(self.ready)  # this layer's copies only, not the prefetch below
        before = self.before() if self.before is not None else None
        self.before = None
        if before is not None:  # the layer whose backward comes next: start bringing it back now
            before._bring()
        return self.fetched

    def _bring(self) -> None:
        if self.fetched is None:
            self.fetched, self.ready = self.offloader.to_device(self.host)


class ActivationOffloader:
    """Saved-tensor offloading for the layers that ask for it (`layer(n)` around their forward)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last: Optional[weakref.ref] = None

    @contextmanager
    def layer(self, layer_number: int):
        last = self._last() if self._last is not None else None
        before = last if last is not None and last.layer_number == layer_number - 1 else None
        group = _LayerGroup(self, layer_number, before)
        self._last = weakref.ref(group)
        with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
            yield

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = _host_buffer(t, pinned=self.cuda)
        if not self.cuda:
            return host.copy_(t)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its block is not reused before the copy is done
        return host

    def to_device(self, host: List[torch.Tensor]):
        """(device copies of `host`, the CUDA event that says they are there, or None)."""
        if not self.cuda:  # the CPU stands in for the device: copies back, as memory measurements expect
            return [torch.empty_like(h).copy_(h) for h in host], None
        with torch.cuda.stream(self.stream):
            out = [torch.empty_like(h, device=self.device).copy_(h, non_blocking=True) for h in host]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        current = torch.cuda.current_stream(self.device)
        for t in out:
            t.record_stream(current)  # used by backward on the compute stream
        return out, ready

    def wait(self, ready) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
