"""Measured activation memory of the V schedules: per rank, the peak of the bytes autograd saves
(and the deferred weight-gradient GEMMs keep, and the executor keeps of each forward's output)
during a real training step, seen by planning/measure.SavedActivations, equals what the simulator's timeline of that rank holds when each
(micro-batch, chunk) weighs what one micro-batch's forward of that chunk kept, until its B (BW),
and what the B left for the W until that (simulator.held_peak); on a rank whose two chunks are
alike that is the simulator's peak in-flight count times one micro-batch's chunk size. (Below the
peak, on the turn rank, the hand-off tensor shared by both chunks is freed by whichever of B of
chunk 0 and W of chunk 1 comes last: a per-action model is exact only at the peak.)"""
import os

import pytest
import torch

from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import build_schedule
from megatron_lite.parallel.pipeline.simulator import held_peak, simulate
from megatron_lite.planning.measure import SavedActivations
from megatron_lite.testing import run_distributed

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "2", "--device", "cpu", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--lr", "3e-3", "--eval-iters", "0"]


def _measure_step(rank, world, argv):
    """(pp rank, [(action, saved bytes before, after)] of the second step, its peak saved bytes)."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.training.step import train_step
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    executor, t = trainer.forward_backward.executor, cfg.training
    meter, steps = SavedActivations(), []
    compute = executor._compute

    def recorded(a):
        before = meter.saved_bytes
        compute(a)
        for t in executor.outputs.get((a.microbatch, a.chunk), ()) if a.kind == "F" else ():
            meter.hold(t)  # what the executor keeps for the backward (on the turn rank: the next chunk's input)
        steps.append((a, before, meter.saved_bytes))

    for step in range(2):  # the first step builds what is built once; measure the second
        batches = trainer._next_batches(trainer.train_iter, trainer.num_microbatches)
        fb = trainer.forward_backward
        if step == 1:
            executor._compute = recorded

            def fb(*args, inner=trainer.forward_backward, **kw):
                with meter:
                    return inner(*args, **kw)
        train_step(trainer.chunks, batches, trainer.dims, trainer.optimizer, trainer.grad_sync, t.lr,
                   trainer.forward_step, fb, loss_normalizer=float(t.global_batch_size * t.seq_length))
    return trainer.dims.pp_rank, steps, meter.peak_saved_bytes


def _check(schedule, p, m, world, extra):
    results = run_distributed(_measure_step, world, BASE + extra + ["--pipeline-model-parallel-size", str(p),
                                                                    "--pipeline-schedule", schedule])
    sim = simulate(build_schedule(schedule, p, m), placement=StagePlacement(p, 2, "V"))
    for pp_rank, steps, peak in results:
        held, freed = {}, {}  # per chunk: bytes one micro-batch's F keeps, its B (or BW) frees
        for a, before, after in steps:
            if a.kind == "F":  # every micro-batch of a chunk alike
                assert held.setdefault(a.chunk, after - before) == after - before, a
            else:
                freed.setdefault((a.kind, a.chunk), before - after)
        kept = {c: held[c] - freed[("B", c)] for c in held if ("B", c) in freed}  # until W: the GEMMs' inputs
        change = {"F": lambda c: held[c], "BW": lambda c: -held[c], "B": lambda c: kept[c] - held[c],
                  "W": lambda c: -kept[c]}
        timeline = sim.timelines[pp_rank]
        assert [a for _, _, a in timeline] == [a for a, _, _ in steps]  # the simulator replays what ran
        assert peak == held_peak(timeline, lambda a: change[a.kind](a.chunk)), (schedule, pp_rank)
        if 0 < pp_rank < p - 1:  # two chunks of transformer layers alike, no hand-off: count x size
            assert held[0] == held[1] and peak == sim.peak_in_flight[pp_rank] * held[0], (schedule, pp_rank)
    return results


@pytest.mark.parametrize("schedule", ["dualpipe-v", pytest.param("zb-v", marks=pytest.mark.slow)])
def test_pp2_peak_saved_activations_match_the_simulator(schedule):
    _check(schedule, 2, 4, 2, ["--global-batch-size", "4"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_pp4_peak_saved_activations_match_the_simulator(schedule):
    _check(schedule, 4, 8, 4, ["--num-layers", "8", "--global-batch-size", "8"])
