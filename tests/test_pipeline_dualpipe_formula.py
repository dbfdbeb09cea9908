"""DualPipe-V against the table of deepseek-ai/DualPipe's README (its DualPipeV row).

The table gives DualPipeV a bubble of (PP/2 - 1)(F&B + B - 3W) and PP + 1 activations per device
on PP/2 devices, where PP is the number of pipeline STAGES (even) and B a FULL backward. Our
dualpipe-v runs p ranks with two chunks each (V placement), so PP = 2p, and the table's B is our
B + W (input grad + weight grad): bubble = (p - 1)(F&B + B + W - 3W), activations 2p + 1 chunks.

Bubble, as the papers count it: the idle time of the rank that idles most, makespan - busy, with
an overlapped pair busy for F&B once (simulate(..., pair_cost=F&B), comm left out as the table
does). Our list equals the table whenever F <= B and W <= B (the input gradient the longest
piece); where F > B or W > B ours is larger by (p - 1)((F - B)+ + (W - B)+).
Peak activations: 2p + 1 with overlapped pairs (a pair's forward allocates before its backward
frees); 2p when the pairs run serialized, backward first.
"""
import pytest

from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import build_schedule
from megatron_lite.parallel.pipeline.simulator import simulate

# (F, B, W, F&B) with F <= B, W <= B and max(F, B + W) <= F&B <= F + B + W (overlap never slower)
COSTS = [(1, 1, 1, 2), (1, 1, 1, 2.5), (1, 1, 1, 3), (1, 2, 1, 3), (1, 2, 1, 4),
         (0.5, 1, 0.5, 1.5), (0.5, 1, 0.5, 2), (1, 1.5, 0.5, 2), (1, 1.5, 0.5, 3)]


def table_bubble(p: int, f_and_b: float, b_full: float, w: float) -> float:
    """(PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and B the full backward."""
    pp_stages = 2 * p
    return (pp_stages // 2 - 1) * (f_and_b + b_full - 3 * w)


def _sim(p: int, m: int, costs, pair_cost=None):
    lists = build_schedule("dualpipe-v", p, m, overlap=True)
    return simulate(lists, costs=costs, comm="ideal", placement=StagePlacement(p, 2, "V"), pair_cost=pair_cost)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_bubble_and_activations_equal_the_table(p):
    for m in (2 * p - 1, 2 * p + 2, 3 * p):
        for f, b, w, fb in COSTS:
            res = _sim(p, m, (f, b, w), pair_cost=fb)
            idle = [res.makespan - busy for busy in res.busy]
            assert max(idle) == pytest.approx(table_bubble(p, fb, b + w, w), abs=1e-9), (m, f, b, w, fb)
            assert idle[-1] == pytest.approx(max(idle), abs=1e-9)  # the last rank idles most
            assert max(res.peak_in_flight) == 2 * p + 1, (m, f, b, w, fb)
        assert max(_sim(p, m, (1, 1, 1)).peak_in_flight) == 2 * p  # serialized pairs: one fewer


@pytest.mark.parametrize("p", [2, 3, 4])
def test_outside_the_tables_assumptions_f_or_w_longer_than_b_add_their_excess(p):
    """F > B or W > B: our bubble is the table's formula plus exactly (p - 1)((F - B)+ + (W - B)+),
    i.e. (p - 1)(F&B + B + W - 3W + max(0, F - B) + max(0, W - B)) for every m >= 2p - 1."""
    for f, b, w in [(2, 1, 1), (1.5, 1, 0.5), (1, 0.5, 0.5), (0.5, 0.5, 1.5), (1, 0.5, 1), (2, 1, 1.5), (1, 2, 2.5)]:
        for fb in (max(f, b + w), f + b + w):
            for m in (2 * p - 1, 3 * p):
                res = _sim(p, m, (f, b, w), pair_cost=fb)
                idle = max(res.makespan - busy for busy in res.busy)
                excess = (p - 1) * (max(0, f - b) + max(0, w - b))
                assert excess > 0 and idle == pytest.approx(table_bubble(p, fb, b + w, w) + excess, abs=1e-9)


def test_pair_cost_must_be_positive():
    with pytest.raises(ValueError, match="pair_cost must be > 0"):
        _sim(2, 4, (1, 1, 1), pair_cost=0)


def test_cli_prints_the_table_beside_the_simulated_figures(capsys):
    from tools.pipeline_schedule import main
    assert main(["--pp", "4", "--microbatches", "10", "--schedule", "dualpipe-v", "--pair-cost", "2.5"]) == 0
    out = capsys.readouterr().out
    assert "bubble (PP/2-1)(F&B+B-3W) = 4.5 (simulated 4.5), activations PP+1 = 9 chunks (simulated 9)" in out
    assert all("&F" in line for line in out.splitlines() if line.endswith("|"))  # a pair: one span
    assert main(["--pp", "4", "--microbatches", "10", "--schedule", "zb-v", "--pair-cost", "2.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --pair-cost (2.5)") and "--schedule dualpipe-v" in err and err.count("\n") == 1


def test_pairs_replay_with_comm_and_scale_with_stage_weights():
    """Overlapped pairs under both executor models with transfer time (no deadlock, no faster than
    comm-free), and a pair's cost scales with its stages' weights like any action's."""
    for p in (2, 3, 4):
        lists, v = build_schedule("dualpipe-v", p, 2 * p + 1, overlap=True), StagePlacement(p, 2, "V")
        free = simulate(lists, costs=(1, 1, 1), comm="ideal", placement=v, pair_cost=2.5).makespan
        for comm in ("lazy", "blocking"):
            assert simulate(lists, costs=(1, 1, 1), comm_cost=0.5, comm=comm, placement=v, pair_cost=2.5).makespan > free
        doubled = simulate(lists, costs=(1, 1, 1), comm="ideal", placement=v, pair_cost=2.5, stage_weights=[2.0] * 2 * p)
        assert doubled.makespan == pytest.approx(2 * free) and max(doubled.peak_in_flight) == 2 * p + 1
