"""Profiling and memory tools of the training loop: Megatron-LM's --profile window,
--record-memory-history snapshots and --empty-unused-memory-level.

The loop makes one `StepProfiler` and calls `on_step_start(n)` / `on_step_end(n)` around
training step n (1-based). With --profile, the ranks in --profile-ranks trace steps n with
profile_step_start < n <= profile_step_end: Megatron starts its capture when `profile_step_start`
steps are done and stops it when `profile_step_end` are, so --profile-step-start 4
--profile-step-end 6 traces steps 5 and 6. Each rank writes one Chrome trace (opens in Perfetto,
chrome://tracing, or TensorBoard's profiler plugin) named `rank-{rank}.json.gz`, by default in
`{tensorboard_dir}/../torch_profile` as Megatron does. Each step is a `step {n}` range in it.
On a GPU the same window is also a CUDA profiler capture range, so `nsys profile
--capture-range=cudaProfilerApi` (Megatron's recipe) records those steps too.

--record-memory-history records the CUDA caching allocator's history from the start, and the
last rank dumps `torch.cuda.memory._snapshot()` with pickle to --memory-snapshot-path every
`snapshot_interval` steps (Megatron: every --log-interval) and on an out-of-memory error; view it
at pytorch.org/memory_viz. CPU runs have no such allocator: `notes` says so in one line.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from typing import List, Optional, Sequence

import torch

from ..errors import ConfigError

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept, as Megatron records them


def default_trace_dir(tensorboard_dir: Optional[str]) -> str:
    """Megatron's place for torch.profiler traces: beside the TensorBoard directory."""
    return os.path.join(tensorboard_dir, os.pardir, "torch_profile") if tensorboard_dir else "torch_profile"


class StepProfiler:
    """--profile window and --record-memory-history for one rank; every method is cheap when off."""

    def __init__(self, rank: int, *, profile: bool, step_start: int, step_end: int, ranks: Optional[Sequence[int]],
                 trace_dir: str, record_memory_history: bool = False, memory_snapshot_path: Optional[str] = None,
                 snapshot_interval: int = 1, is_last_rank: bool = False, device: Optional[torch.device] = None):
        if profile and not 0 <= step_start < step_end:
            raise ConfigError(f"--profile-step-start ({step_start}) must be >= 0 and below --profile-step-end "
                              f"({step_end})")
        if record_memory_history and not memory_snapshot_path:
            raise ConfigError("--record-memory-history needs --memory-snapshot-path")
        self.rank, self.start, self.end = rank, step_start, step_end
        self.profiling = profile and (not ranks or rank in ranks)  # no ranks given: every rank
        self.trace_path = os.path.join(trace_dir, f"rank-{rank}.json.gz")
        self.cuda = (device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        self.snapshot_path, self.snapshot_interval = memory_snapshot_path, max(1, snapshot_interval)
        self.dumps_snapshots = record_memory_history and is_last_rank and self.cuda
        self.notes: List[str] = []
        self._prof = None
        self._range = None
        self._traced: List[int] = []
        self.wait_param_gather, self.printed = (lambda: None), 0  # (the trainer's, once attached)
        if record_memory_history:
            self._start_memory_history()

    # --- the trainer's feature hooks (features.py) -------------------------------------------------
    def attached(self, trainer) -> None:
        self.wait_param_gather = trainer.grad_sync.wait_param_gather

    def start_lines(self) -> List[str]:
        self.printed = len(self.notes)
        return list(self.notes)

    def step_started(self, step: int) -> None:
        if self.starts_or_stops(step, at_start=True):
            self.wait_param_gather()  # --overlap-param-gather's collectives end outside the trace
        self.on_step_start(step)

    def step_ended(self, step: int, phases=None) -> None:
        if self.starts_or_stops(step, at_start=False):
            self.wait_param_gather()  # ... and inside it
        self.on_step_end(step)

    def train_finished(self) -> None:
        self.wait_param_gather()  # in-flight gathers end inside a trace cut short by the end
        self.close()
        for note in self.notes[self.printed:]:  # each tracing rank says where its trace is
            print(f"> rank {self.rank}: {note}", flush=True)

    # --- the loop's calls ---------------------------------------------------------------------
    def starts_or_stops(self, step: int, at_start: bool) -> bool:
        """Whether the trace starts before step `step` (at_start) or stops after it: the loop
        lets in-flight asynchronous collectives finish first (gloo's work objects record into
        the profiler from their own thread: one that ends after the profiler stopped crashes)."""
        if not self.profiling:
            return False
        if at_start:
            return self._prof is None and self.start < step <= self.end
        return self._prof is not None and step >= self.end

    def on_step_start(self, step: int) -> None:
        """Before training step `step` (1-based)."""
        if not self.profiling or not self.start < step <= self.end:
            return
        if self._prof is None:
            self._start_trace()
        self._range = torch.profiler.record_function(f"step {step}")
        self._range.__enter__()
        self._traced.append(step)

    def on_step_end(self, step: int) -> None:
        """After training step `step`, its optimizer update included."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
            self._prof.step()
        if self._prof is not None and step >= self.end:
            self._write_trace()
        if self.dumps_snapshots and step % self.snapshot_interval == 0:
            self.dump_memory_snapshot()

    def close(self) -> None:
        """At the end of training: a window cut short by the end of the run is still written."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._write_trace()

    # --- torch.profiler trace -----------------------------------------------------------------
    def _start_trace(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.start()
        if self.cuda:  # also the capture range of an enclosing `nsys profile --capture-range=cudaProfilerApi`
            torch.cuda.cudart().cudaProfilerStart()

    def _write_trace(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        self._prof.stop()
        os.makedirs(os.path.dirname(self.trace_path) or ".", exist_ok=True)
        self._prof.export_chrome_trace(self.trace_path)  # gzipped: the name ends in .gz
        self._prof = None
        self.notes.append(f"profile of steps {self._traced[0]}-{self._traced[-1]} written to {self.trace_path}")

    # --- CUDA memory history --------------------------------------------------------------------
    def _start_memory_history(self) -> None:
        if not self.cuda:
            self.notes.append("--record-memory-history: CUDA allocator snapshots need a GPU; nothing is recorded "
                              "on CPU")
            return
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        if self.dumps_snapshots:
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)

    def _on_oom(self, device, alloc, device_alloc, device_free) -> None:
        self.dump_memory_snapshot()

    def dump_memory_snapshot(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.snapshot_path)), exist_ok=True)
        with open(self.snapshot_path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)


def empty_unused_memory(level: int, after: str) -> None:
    """--empty-unused-memory-level: hand cached, unused CUDA blocks back to the driver (fewer
    fragmentation OOMs, slower allocation). Level >= 1: after each step's forward-backward (before
    the optimizer) and after each evaluation step; level 2 also after the optimizer step. A no-op
    on CPU. `after`: "forward_backward" | "eval_step" | "optimizer"."""
    if after not in ("forward_backward", "eval_step", "optimizer"):
        raise ValueError(f"empty_unused_memory(after={after!r})")
    needed = 2 if after == "optimizer" else 1
    if level >= needed and torch.cuda.is_available():
        torch.cuda.empty_cache()


class HostSyncCounter:
    """`MEGATRON_LITE_SYNC_DEBUG_FROM=N` on CUDA: from step N on, every host synchronization inside
    the training step is reported by torch.cuda's sync debug mode and counted; the step's record
    gets `host_syncs` and their `host_sync_sites` (file:line). A step should have none but the
    logged scalars (benchmarks/gpu_bench.py's host-syncs row)."""

    def __init__(self, device: torch.device):
        start = os.environ.get("MEGATRON_LITE_SYNC_DEBUG_FROM")
        self.start = int(start) if start and device.type == "cuda" else None
        self.caught: Optional[list] = None

    @contextlib.contextmanager
    def step(self, step: int):
        if self.start is None or step < self.start:
            self.caught = None
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.caught = [w for w in caught if "synchroniz" in str(w.message)]
        for w in caught:  # every other warning goes on as usual
            if "synchroniz" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def fields(self) -> dict:
        if self.caught is None:
            return {}
        return {"host_syncs": len(self.caught),
                "host_sync_sites": sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in self.caught})}

