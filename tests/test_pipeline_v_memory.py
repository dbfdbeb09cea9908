"""Measured activation memory of the V schedules (tests/pipeline_memory_harness.py): per rank, the
peak of the bytes autograd saves (and the deferred weight-gradient GEMMs keep, and the executor
keeps of each forward's output) during a real training step equals what the simulator's timeline of
that rank holds when each (micro-batch, chunk) weighs what one micro-batch's forward of that chunk
kept, until its B (BW), and what the B left for the W until that (simulator.held_peak); on a rank
whose two chunks are alike that is the simulator's peak in-flight count times one micro-batch's
chunk size. (Below the peak, on the turn rank, the hand-off tensor shared by both chunks is freed
by whichever of B of chunk 0 and W of chunk 1 comes last: a per-action model is exact at the peak.)"""
import pytest

from pipeline_memory_harness import measured_and_simulated

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "2", "--device", "cpu", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--lr", "3e-3", "--eval-iters", "0"]


def _check(schedule, p, m, extra):
    argv = BASE + extra + ["--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule]
    for row in measured_and_simulated(argv, schedule, p, m):
        assert row["uniform"] and row["replayed"], row  # the simulator replays what ran, micro-batches alike
        assert row["measured"] == row["simulated"], (schedule, row)
        if 0 < row["pp_rank"] < p - 1:  # two chunks of transformer layers alike, no hand-off: count x size
            held = row["held"]
            assert held[0] == held[1] and row["measured"] == row["in_flight"] * held[0], (schedule, row)


@pytest.mark.parametrize("schedule", ["dualpipe-v", pytest.param("zb-v", marks=pytest.mark.slow)])
def test_pp2_peak_saved_activations_match_the_simulator(schedule):
    _check(schedule, 2, 4, ["--global-batch-size", "4"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_pp4_peak_saved_activations_match_the_simulator(schedule):
    _check(schedule, 4, 8, ["--num-layers", "8", "--global-batch-size", "8"])
