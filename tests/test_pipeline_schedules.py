"""Pipeline schedules: theory-exact bubbles, memory, deadlock-free comm, validation, CLI."""
import os
import subprocess
import sys

import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import (
    Action, build_schedule, comm_peer, compute_orders, default_schedule, group_steps,
    validate_schedule_args)
from megatron_lite.parallel.pipeline.simulator import (
    ScheduleError, check_schedule, format_timeline, save_png, simulate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _theory(name, p, m, v):
    return {"interleaved": (p - 1) / (v * m), "zb-h1": (p - 1) / (3 * m)}.get(name, (p - 1) / m)


def _cases():
    for p in (2, 4, 8):
        for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p} - {0}):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            if m >= p:
                yield "zb-h1", p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield "interleaved", p, m, v


CASES = list(_cases())


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_bubble_equals_theory(name, p, m, v):
    sched = build_schedule(name, p, m, v)
    want = _theory(name, p, m, v)
    for comm in ("lazy", "ideal"):
        res = simulate(sched, costs=(1, 1, 1), comm=comm)
        assert res.bubble == pytest.approx([want] * p, abs=1e-12), comm
        assert res.busy == [3.0 * m * v] * p


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_blocking_executor_never_beats_theory(name, p, m, v):
    res = simulate(build_schedule(name, p, m, v), comm="blocking")
    want = _theory(name, p, m, v)
    assert min(res.bubble) >= want - 1e-12
    if name != "interleaved":  # interleaved with p % 3 == 2 stalls when every batch blocks
        assert res.bubble == pytest.approx([want] * p, abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_peak_in_flight(p, m):
    assert simulate(build_schedule("gpipe", p, m)).peak_in_flight[0] == m
    assert simulate(build_schedule("1f1b", p, m)).peak_in_flight[0] == min(p, m)
    if m >= p:
        res = simulate(build_schedule("zb-h1", p, m))
        assert res.peak_in_flight[0] <= p
        # ZB-H1 keeps 1F1B's memory even counting activations until W: at most p per rank.
        for tl in res.timelines:
            marks = sorted([(s, 1) for s, _, a in tl if a.kind == "F"] + [(e, -1) for _, e, a in tl if a.kind == "W"])
            live = [sum(d for _, d in marks[: i + 1]) for i in range(len(marks))]
            assert max(live) <= p


def test_checker_accepts_every_schedule_on_a_grid():
    n = 0
    for p in (1, 2, 3, 4, 5, 6, 8):
        for m in range(1, 3 * p + 1):
            for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("zb-h1", (1,)), ("interleaved", (2, 3, 4))):
                for v in vs:
                    try:
                        sched = build_schedule(name, p, m, v)
                    except ConfigError:
                        continue
                    check_schedule(sched)
                    n += 1
    assert n > 250


def test_lists_follow_the_documented_rules():
    sched = build_schedule("interleaved", 4, 8, 2)
    for r, lst in enumerate(sched):
        assert len(set(lst)) == len(lst)
        for step in group_steps(lst):
            if isinstance(step, tuple):
                assert all(a.is_comm for a in step) and {comm_peer(a, r, StagePlacement(4, 2)) for a in step} <= {(r + 1) % 4, (r - 1) % 4}
    assert all(a.kind != "BW" for a in sum(build_schedule("zb-h1", 4, 8), []))
    assert all(a.kind not in ("B", "W") for a in sum(sched, []))


def test_non_unit_costs_and_comm_cost():
    p, m = 4, 8
    for costs in ((1, 2, 0), (2, 1, 1), (1, 0.5, 0.5)):
        res = simulate(build_schedule("1f1b", p, m), costs=costs)
        assert res.bubble == pytest.approx([(p - 1) / m] * p)
    f, bw, c = 1.0, 2.0, 0.5
    ideal = simulate(build_schedule("gpipe", p, m), comm_cost=c, comm="ideal")
    assert ideal.makespan == pytest.approx(m * (f + bw) + (p - 1) * (f + bw + 2 * c))
    for comm in ("lazy", "blocking"):
        assert simulate(build_schedule("gpipe", p, m), comm_cost=c, comm=comm).makespan >= ideal.makespan


# ---------------------------------------------------------------- broken schedules
def _rm(lst, action):
    return [a for a in lst if a != action]


def test_checker_rejects_missing_compute():
    sched = build_schedule("1f1b", 2, 4)
    sched[1] = _rm(sched[1], Action("F", 2))
    with pytest.raises(ScheduleError, match="missing F2"):
        check_schedule(sched)


def test_checker_rejects_missing_receive():
    sched = build_schedule("1f1b", 4, 4)
    sched[2] = _rm(sched[2], Action("RECV_F", 1))
    with pytest.raises(ScheduleError, match="lacks its RECV_F"):
        check_schedule(sched)


def test_checker_rejects_duplicate_and_mixed_backward():
    sched = build_schedule("gpipe", 2, 2)
    sched[0] = sched[0] + [Action("W", 0)]
    with pytest.raises(ScheduleError, match="exactly one BW"):
        check_schedule(sched)
    sched = build_schedule("gpipe", 2, 2)
    sched[0] = sched[0] + [Action("F", 0)]
    with pytest.raises(ScheduleError, match="twice"):
        check_schedule(sched)


def test_checker_rejects_fifo_mismatch():
    f = [Action(k, i) for i in range(2) for k in ("F",)]
    rank0 = f + [Action("SEND_F", 0), Action("SEND_F", 1), Action("RECV_B", 0), Action("RECV_B", 1),
                 Action("BW", 0), Action("BW", 1)]
    rank1 = [Action("RECV_F", 1), Action("RECV_F", 0), Action("F", 0), Action("F", 1), Action("BW", 0),
             Action("BW", 1), Action("SEND_B", 0), Action("SEND_B", 1)]
    with pytest.raises(ScheduleError, match="FIFO mismatch"):
        check_schedule([rank0, rank1])
    check_schedule([rank0, [rank1[1], rank1[0]] + rank1[2:]])  # the same lists, matched order: fine


def test_checker_finds_deadlock():
    # Rank 0 waits for the gradient of micro-batch 0 before it has sent that micro-batch forward.
    rank0 = [Action("F", 0), Action("RECV_B", 0), Action("F", 1), Action("SEND_F", 0), Action("SEND_F", 1),
             Action("BW", 0), Action("RECV_B", 1), Action("BW", 1)]
    rank1 = [Action("RECV_F", 0), Action("F", 0), Action("BW", 0), Action("SEND_B", 0), Action("RECV_F", 1),
             Action("F", 1), Action("BW", 1), Action("SEND_B", 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule([rank0, rank1])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([rank0, rank1])


def test_checker_rejects_comm_on_one_rank_and_edge_sends():
    with pytest.raises(ScheduleError):
        check_schedule([[Action("F", 0), Action("SEND_F", 0), Action("BW", 0)]])
    sched = build_schedule("1f1b", 2, 2)
    sched[1] = sched[1] + [Action("SEND_F", 1)]
    with pytest.raises(ScheduleError):
        check_schedule(sched)


def test_compute_only_lists_replay_on_dependencies():
    res = simulate(compute_orders("1f1b", 4, 8))
    assert res.bubble == pytest.approx([3 / 8] * 4)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 4, 1), "unknown pipeline schedule 'pipedream'"),
    (("1f1b", 0, 4, 1), r"pipeline_model_parallel_size \(0\)"),
    (("1f1b", 2, 0, 1), r"micro-batches \(0\)"),
    (("1f1b", 2, 4, 0), r"virtual pipeline size \(0\)"),
    (("interleaved", 4, 8, 1), r"needs virtual pipeline size > 1 \(got 1\)"),
    (("interleaved", 1, 8, 2), r"pipeline_model_parallel_size >= 2 \(got 1\)"),
    (("interleaved", 4, 6, 2), r"micro-batches \(6\) to be a multiple of pipeline_model_parallel_size \(4\)"),
    (("1f1b", 4, 8, 2), r"'1f1b' does not support virtual pipeline stages \(vpp=2\)"),
    (("gpipe", 4, 8, 2), r"'gpipe' does not support"),
    (("zb-h1", 4, 8, 2), r"'zb-h1' does not support"),
    (("zb-h1", 4, 3, 1), r"micro-batches \(3\) as pipeline stages \(4\)"),
])
def test_validation_errors(args, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_schedule_args(*args)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        build_schedule(*args)


def test_validation_of_layers_and_defaults():
    with pytest.raises(ConfigError, match=r"num_layers \(6\) must be >= .* = 8"):
        validate_schedule_args("1f1b", 8, 8, 1, num_layers=6)
    with pytest.raises(ConfigError, match=r"num_layers \(12\) must be divisible .* = 8"):
        validate_schedule_args("interleaved", 4, 8, 2, num_layers=12)
    validate_schedule_args("interleaved", 4, 8, 2, num_layers=16)
    validate_schedule_args("1f1b", 4, 2, 1, num_layers=6)  # uneven split and m < p: fine for 1f1b
    assert default_schedule(1) == "1f1b" and default_schedule(None) == "1f1b"
    assert default_schedule(2) == "interleaved"


# ---------------------------------------------------------------- rendering and CLI
def test_format_timeline():
    res = simulate(build_schedule("zb-h1", 4, 8))
    text = format_timeline(res)
    rows = text.splitlines()
    assert len(rows) == 4 and "F0" in rows[0] and "W7" in rows[3] and rows[3].count(".") > 0
    narrow = format_timeline(res, width=27).splitlines()
    assert all(len(r) == len(narrow[0]) for r in narrow) and "|" + "Ff" in narrow[0]


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    labels = save_png(simulate(build_schedule("interleaved", 2, 2, 2)), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    assert labels == ["F forward", "BW backward (input + weight)",
                      "F3.1 = micro-batch 3, chunk 1 (lighter: later of 2 chunks)"]
    zb = save_png(simulate(build_schedule("zb-h1", 2, 2, 1)), str(out))  # only the kinds the schedule has
    assert zb == ["F forward", "B backward (input grad)", "W weight grad"]


def _cli(*args, module=False):
    cmd = [sys.executable] + (["-m", "tools.pipeline_schedule"] if module else ["tools/pipeline_schedule.py"])
    return subprocess.run(cmd + list(args), cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_cli_prints_timeline_and_bubble():
    out = _cli("--pp", "4", "--vpp", "2", "--microbatches", "8", "--schedule", "interleaved")
    assert out.returncode == 0, out.stderr
    assert "rank  3 |" in out.stdout and "BW7.0" in out.stdout
    assert "(p-1)/(v*m) = 0.1875" in out.stdout
    assert "   0   0.1875" in out.stdout
    out = _cli("--pp", "4", "--microbatches", "8", "--schedule", "zb-h1", "--costs", "1,1,1", module=True)
    assert out.returncode == 0, out.stderr
    assert "0.1250" in out.stdout


def test_cli_validation_error_exits_2():
    out = _cli("--pp", "4", "--vpp", "2", "--microbatches", "6")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "multiple of pipeline_model_parallel_size (4)" in out.stderr
    out = _cli("--costs", "1,x,1")
    assert out.returncode == 2 and "--costs" in out.stderr
