"""A fake CUDA for a dry run without a GPU (tools/fake_cuda_dry_run.py).

Under torch's FakeTensorMode, tensors on `cuda` carry shape, dtype, stride and device but no data,
and each operator runs its meta kernel, which checks the CUDA kernel's rules (torch._scaled_mm's
layouts, multiples of 16 and scale shapes; SDPA's; grouped GEMM's alignment). The few torch.cuda
calls that need a driver (device selection, streams, events, RNG state, memory statistics,
synchronize, device properties) get stand-ins, and a host read of a value (`.item()`, `bool(t)`) gets
True (a bool: `isfinite(t).all()`), 0.0 (a float: losses, norms, the optimizer's "bad loss" flags) or
1 (an integer: counts): a fake tensor holds no value, and the step needs ones that keep it going.
What torch's CPU-only build lacks besides the driver is stood in for as well: a CUDA device guard
(`cuda_device_guard`), `torch.Generator(device="cuda")`, and the autograd engine, which refuses
`cuda` tensors there ("Cannot access accelerator device"): `Tensor.backward` walks the graph in
Python instead (tools/fake_backward.py). `fake_cuda()` installs all of it and takes it all away on
exit (an exception included): nothing stays behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import types
from typing import Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tools.fake_backward import backward as python_backward

DEVICE_NAME = "fake CUDA (dry run)"
CAPABILITY = (9, 0)  # Hopper: the FP8 kernels' minimum
TOTAL_MEMORY = 80 * 2**30


class HostReads(TorchDispatchMode):
    """A value read to the host from a fake tensor: 1 (int), 0.0 (float), True (bool); counted."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
            dtype = args[0].dtype
            return True if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 1
        return func(*args, **(kwargs or {}))


class FakeStream:
    """torch.cuda.Stream without a driver: work on it is ordered with nothing, as in a fake run."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cuda", 0) if device is None else torch.device(device)

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


class _Streams:
    """The current stream per device, so that `torch.cuda.stream(s)` nests as on a GPU."""

    def __init__(self):
        self.default = FakeStream()
        self.current = self.default

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream) -> Iterator[None]:
        previous, self.current = self.current, stream if stream is not None else self.current
        try:
            yield
        finally:
            self.current = previous


def _properties():
    return types.SimpleNamespace(name=DEVICE_NAME, major=CAPABILITY[0], minor=CAPABILITY[1],
                                 total_memory=TOTAL_MEMORY, multi_processor_count=132)


def _stand_ins() -> dict:
    """torch.cuda's attributes that need a driver, by name, and what replaces each."""
    streams = _Streams()
    nothing = lambda *a, **k: None  # noqa: E731
    return {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": nothing, "synchronize": nothing, "empty_cache": nothing,
        "get_device_name": lambda *a: DEVICE_NAME, "get_device_capability": lambda *a: CAPABILITY,
        "get_device_properties": lambda *a: _properties(), "is_bf16_supported": lambda *a, **k: True,
        "Stream": FakeStream, "Event": FakeEvent, "current_stream": streams.current_stream,
        "default_stream": lambda device=None: streams.default, "stream": streams.stream,
        "get_rng_state": lambda device=None: torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": nothing, "manual_seed": nothing, "manual_seed_all": nothing, "seed": nothing,
        "max_memory_allocated": lambda *a: 0, "memory_allocated": lambda *a: 0,
        "max_memory_reserved": lambda *a: 0, "memory_reserved": lambda *a: 0,
        "reset_peak_memory_stats": nothing, "set_sync_debug_mode": nothing,
        "get_sync_debug_mode": lambda: 0,
    }


def _unpinned(factory):
    """A factory that allocates without pinning: page-locked host memory is the driver's (cudaHostAlloc),
    and host buffers made outside the fake mode (offload.py hides them from every dispatch mode) are real."""
    def allocate(*args, pin_memory=False, **kwargs):
        return factory(*args, **kwargs)
    return allocate


class _FakeMode(FakeTensorMode):
    """FakeTensorMode that keeps treating CUDA as absent (it asks torch.cuda.is_available(), which the
    dry run answers True): `torch.tensor(data, device="cuda")` is built on the CPU and lifted."""

    @property
    def avoid_device_init(self) -> bool:
        return True


_CUDA, _LAZY = 1, 17  # c10::DeviceType


@contextlib.contextmanager
def cuda_device_guard() -> Iterator[None]:
    """A no-op CUDA device guard (slicing, indexing and autograd's graph need one for `cuda` tensors).
    A CUDA build without a device gets torch's own (FakeTensorMode installs it); torch's CPU-only
    build registers none, and torch installs its fake guard only where one is registered: so the
    Lazy device's guard (present, zero devices) is lent to CUDA's empty slot of c10's registry for
    that call, and the slot is emptied again on exit."""
    if torch.cuda._is_compiled():
        yield
        return
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    registry = (ctypes.c_void_p * (_LAZY + 1)).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
    if registry[_CUDA] or not registry[_LAZY]:
        raise RuntimeError("fake CUDA: c10's device guard registry is not as expected (a CUDA guard is already "
                           "registered, or the Lazy device has none)")
    registry[_CUDA] = registry[_LAZY]
    torch._C._ensureCUDADeviceGuardSet()  # replaces the lent guard by torch's fake CUDA guard
    try:
        yield
    finally:
        registry[_CUDA] = None


_Generator = torch.Generator


def _generator(device="cpu"):
    """torch.Generator(device="cuda") needs the CUDA library: a CPU generator draws for fake tensors."""
    return _Generator(device="cpu" if torch.device(device).type == "cuda" else device)


_swap_tensors = torch.utils.swap_tensors


def _swap_fake(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """torch.utils.swap_tensors, which refuses a tensor with a weak reference: FakeTensorMode keeps
    one to the parameters made under it (its memo of fake tensors, which the swap does not confuse:
    it names the same Python object), so for fake tensors that check is passed over."""
    if not (isinstance(t1, FakeTensor) or isinstance(t2, FakeTensor)):
        return _swap_tensors(t1, t2)
    no_refs = types.SimpleNamespace(getweakrefs=lambda t: [])
    with mock.patch.object(torch.utils, "weakref", no_refs):
        _swap_tensors(t1, t2)


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    if create_graph or inputs is not None:
        raise NotImplementedError("fake CUDA: backward with create_graph or inputs")
    python_backward(self, gradient)


@contextlib.contextmanager
def fake_cuda() -> Iterator[HostReads]:
    """Fake CUDA tensors with driver stand-ins; yields the host-read counter. Everything it
    patches is restored on exit, an exception included."""
    mode = _FakeMode(allow_non_fake_inputs=True)  # first: it imports torch._dynamo, which reads torch.cuda
    with contextlib.ExitStack() as stack:
        for name, value in _stand_ins().items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=True))
        stack.enter_context(mock.patch.object(torch.Tensor, "backward", _backward))
        # the caching allocator's stream bookkeeping: nothing to keep for a fake tensor
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None))
        stack.enter_context(mock.patch.object(torch, "Generator", _generator))
        stack.enter_context(mock.patch.object(torch.utils, "swap_tensors", _swap_fake))
        stack.enter_context(mock.patch.object(torch, "empty_strided", _unpinned(torch.empty_strided)))
        stack.enter_context(cuda_device_guard())
        stack.enter_context(mode)
        reads = stack.enter_context(HostReads())
        yield reads
