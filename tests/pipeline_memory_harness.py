"""Activation memory of a pipeline schedule, measured and simulated, per rank (used by
tests/test_pipeline_v_memory.py and benchmarks/bench_pipeline.py --memory).

Measured: in forked gloo ranks, the second training step under planning/measure.SavedActivations:
the bytes autograd saves for a backward, the deferred weight-gradient GEMMs keep, and the executor
keeps of each forward's output, while they live; per compute action the change it made.
Simulated: simulator.held_peak over the rank's timeline, each (micro-batch, chunk) weighing what one
micro-batch's forward of that chunk kept until its B (BW), and what the B left for the W until that.
"""
import os
from typing import Dict, List

import torch

from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import build_schedule, schedule_placement
from megatron_lite.parallel.pipeline.simulator import held_peak, simulate
from megatron_lite.planning.measure import SavedActivations
from megatron_lite.testing import run_distributed


def measure_step(rank, world, argv):
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
        for out in executor.outputs.get((a.microbatch, a.chunk), ()) if a.kind == "F" else ():
            meter.hold(out)  # what the executor keeps for the backward (on the turn rank: the next chunk's input)
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


def measured_and_simulated(argv: List[str], schedule: str, p: int, m: int, vpp: int = 2) -> List[Dict]:
    """Per pipeline rank (argv's world is p ranks): measured peak, simulated peak, the simulator's
    peak in-flight count, bytes per chunk forward, and whether the simulator replays what ran."""
    results = run_distributed(measure_step, p, argv)
    placement = StagePlacement(p, vpp, schedule_placement(schedule))
    sim = simulate(build_schedule(schedule, p, m, vpp), placement=placement)
    rows = []
    for pp_rank, steps, peak in sorted(results, key=lambda r: r[0]):
        held, freed, uniform = {}, {}, True  # per chunk: bytes one micro-batch's F keeps, its B (BW) frees
        for a, before, after in steps:
            if a.kind == "F":  # every micro-batch of a chunk alike
                uniform &= held.setdefault(a.chunk, after - before) == after - before
            else:
                freed.setdefault((a.kind, a.chunk), before - after)
        kept = {c: held[c] - freed[("B", c)] for c in held if ("B", c) in freed}  # until W: the GEMMs' inputs
        change = {"F": lambda c: held[c], "BW": lambda c: -held[c], "B": lambda c: kept[c] - held[c],
                  "W": lambda c: -kept[c]}
        timeline = sim.timelines[pp_rank]
        rows.append({"pp_rank": pp_rank, "measured": peak, "in_flight": sim.peak_in_flight[pp_rank],
                     "simulated": held_peak(timeline, lambda a: change[a.kind](a.chunk)), "held": held,
                     "uniform": uniform, "replayed": [a for _, _, a in timeline] == [a for a, _, _ in steps]})
    return rows
