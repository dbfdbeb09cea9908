"""--profile window per rank (a Chrome trace of exactly the right steps), memory-history notes on
CPU, --empty-unused-memory-level levels."""
import gzip
import json
import os

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.training import profiling
from megatron_lite.training.profiling import StepProfiler, default_trace_dir, empty_unused_memory


def train_steps(prof, steps):
    """Each step runs a matmul of a size that names it (rows = 100 + step), so the trace shows
    which steps it recorded."""
    for n in range(1, steps + 1):
        prof.on_step_start(n)
        torch.ones(100 + n, 8) @ torch.ones(8, 8)
        prof.on_step_end(n)
    prof.close()


def traced(path):
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = sorted(int(e["name"].split()[1]) for e in events if e.get("name", "").startswith("step "))
    rows = sorted({e["args"]["Input Dims"][0][0] for e in events
                   if e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {})})
    return steps, rows


def test_trace_of_the_window_on_the_chosen_ranks(tmp_path):
    """--profile-step-start 4 --profile-step-end 6 --profile-ranks 1 3: steps 5 and 6, ranks 1 and 3."""
    for rank in range(4):
        prof = StepProfiler(rank, profile=True, step_start=4, step_end=6, ranks=[1, 3], trace_dir=str(tmp_path),
                            device=torch.device("cpu"))
        train_steps(prof, 9)
        assert prof.notes == ([f"profile of steps 5-6 written to {tmp_path}/rank-{rank}.json.gz"]
                              if rank in (1, 3) else [])
    assert sorted(os.listdir(tmp_path)) == ["rank-1.json.gz", "rank-3.json.gz"]
    assert traced(tmp_path / "rank-3.json.gz") == ([5, 6], [105, 106])


def test_no_ranks_means_every_rank_and_a_short_run_still_writes(tmp_path):
    prof = StepProfiler(5, profile=True, step_start=0, step_end=10, ranks=[], trace_dir=str(tmp_path / "t"))
    train_steps(prof, 3)  # the run ends inside the window
    assert traced(tmp_path / "t" / "rank-5.json.gz") == ([1, 2, 3], [101, 102, 103])


def test_off_does_nothing(tmp_path):
    prof = StepProfiler(0, profile=False, step_start=0, step_end=1, ranks=[0], trace_dir=str(tmp_path))
    train_steps(prof, 3)
    assert os.listdir(tmp_path) == [] and prof.notes == []


def test_default_trace_dir_beside_tensorboard():
    assert default_trace_dir("/runs/tb") == "/runs/tb/../torch_profile"
    assert default_trace_dir(None) == "torch_profile"


def test_memory_history_on_cpu_is_a_one_line_note(tmp_path):
    prof = StepProfiler(0, profile=False, step_start=0, step_end=1, ranks=None, trace_dir=str(tmp_path),
                        record_memory_history=True, memory_snapshot_path=str(tmp_path / "s.pickle"),
                        is_last_rank=True, device=torch.device("cpu"))
    train_steps(prof, 2)
    assert prof.notes == ["--record-memory-history: CUDA allocator snapshots need a GPU; nothing is recorded on CPU"]
    assert not (tmp_path / "s.pickle").exists()


@pytest.mark.parametrize("kw,match", [
    (dict(profile=True, step_start=6, step_end=6), "below"),
    (dict(profile=False, step_start=0, step_end=1, record_memory_history=True), "memory-snapshot-path"),
])
def test_bad_profiling_flags(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        StepProfiler(0, ranks=[0], trace_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("level,expected", [
    (0, []), (1, ["forward_backward", "eval_step"]), (2, ["forward_backward", "eval_step", "optimizer"])])
def test_empty_unused_memory_levels(monkeypatch, level, expected):
    calls, where = [], None
    monkeypatch.setattr(profiling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profiling.torch.cuda, "empty_cache", lambda: calls.append(where))
    for where in ("forward_backward", "eval_step", "optimizer"):
        empty_unused_memory(level, where)
    assert calls == expected
