#!/usr/bin/env python
"""Pipeline schedules on CPU: step time and bubble of PP=4 with m=8 micro-batches for gpipe, 1f1b,
interleaved (vpp 2), zb-h1, zb-v and dualpipe-v (two chunks per rank, V placement; dualpipe-v's F/B
pairs serialized), against PP=1 of the same model in the same run; and the simulator's bubble at
F = B = W over pp and m (no training).

    python benchmarks/bench_pipeline.py              # real compute: GPT-2 style, 8 layers, h 512
    python benchmarks/bench_pipeline.py --emulate    # sleep-based stage costs on a tiny model
    python benchmarks/bench_pipeline.py --simulate   # bubble table for pp 4/8/16, m 8-64
    python benchmarks/bench_pipeline.py --moe-overlap  # dualpipe-v PP2 x EP2 MoE: pairs serialized vs overlapped
                                                       # (--a2a-ms 20: each all-to-all takes >= 20 ms)
    python benchmarks/bench_pipeline.py --memory     # peak activation bytes per rank: measured vs simulated

Every configuration trains warm-up + measured steps with the project's Trainer in forked gloo ranks
(one torch thread each). In those ranks only, the benchmark wraps PipelineExecutor.run and
._compute to time, per step, each rank's forward-backward window and every compute action
(F, B, W, BW). PP=1 runs through the same executor (its one-rank list is F, BW per micro-batch,
the order of the no-pipelining loop) so the same hooks apply.

Measured bubble of a rank = (makespan - busy) / busy, with makespan from the first rank entering
the step's forward-backward to the last one leaving it (perf_counter is the system-wide monotonic
clock, so forked ranks' stamps compare) and busy = its compute actions' time: the definition of
megatron_lite.parallel.pipeline.simulator. The simulator's bubble replays the same action lists
with the measured mean F, B, W (BW when fused) per chunk and no transfer time; "implied p2p" (--emulate)
is the transfer time at which that replay matches the measured makespan. Unit-cost theory: (p-1)/m,
(p-1)/(v m), (p-1)/(3m), (p-1)/(6m) (zb-v).

--emulate pads every compute action with time.sleep to a fixed duration (layers in the chunk x
--unit-ms x its F/B/W weight from --costs; BW = B + W). Ranks then mostly sleep, so four of them
run concurrently even on two cores, while the real executor, p2p, gradient sync and optimizer
still run on tiny tensors: the schedule's own bubble, free of CPU oversubscription.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402

from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.parallel.pipeline.placement import StagePlacement  # noqa: E402
from megatron_lite.parallel.pipeline.schedules import (  # noqa: E402
    build_schedule, schedule_placement, schedule_vpp, validate_schedule_args)
from megatron_lite.parallel.pipeline.simulator import simulate  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402

PP, M, LAYERS = 4, 8, 8
SCHEDULES = [  # (label, pp, schedule, vpp)
    ("PP=1", 1, "1f1b", 1),
    ("gpipe", PP, "gpipe", 1),
    ("1f1b", PP, "1f1b", 1),
    ("interleaved (vpp 2)", PP, "interleaved", 2),
    ("zb-h1", PP, "zb-h1", 1),
    ("zb-v (V, vpp 2)", PP, "zb-v", 2),
    ("dualpipe-v (V, vpp 2)", PP, "dualpipe-v", 2),
]


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """Unit-cost bubble (idle / busy per rank) of each schedule (zb-v, dualpipe-v: from m >= 2p - 1)."""
    return {"interleaved": (p - 1) / (v * m), "zb-h1": (p - 1) / (3 * m), "zb-v": (p - 1) / (6 * m),
            "dualpipe-v": (p - 1) / (6 * m)}.get(schedule, (p - 1) / m)


def simulated(schedule: str, p: int, m: int, vpp: int, costs=(1.0, 1.0, 1.0), comm_cost: float = 0.0):
    """(lists, simulator result) of a schedule at per-chunk costs, on the placement it is written for."""
    vpp = schedule_vpp(schedule, vpp)
    lists = build_schedule(schedule, p, m, vpp)
    placement = StagePlacement(p, vpp, schedule_placement(schedule))
    return lists, placement, simulate(lists, costs=costs, comm_cost=comm_cost, placement=placement)


def simulate_table() -> None:
    """Max bubble per rank at F = B = W per layer (a chunk of v per rank costs 1/v: the same model)."""
    rows = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipe-v", 2)]
    print("| pp | m | " + " | ".join(n + (" (v 2)" if v > 1 else "") for n, v in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for p in (4, 8, 16):
        for m in (8, 16, 32, 64):
            cells = []
            for name, v in rows:
                try:
                    validate_schedule_args(name, p, m, v)
                except ConfigError:
                    cells.append("-")
                    continue
                res = simulated(name, p, m, v, costs=(1 / v,) * 3)[2]
                cells.append(f"{max(res.bubble):.4f}")
            print(f"| {p} | {m} | " + " | ".join(cells) + " |")
    print("\npp 4, m 16, other F,B,W costs per layer (the lists are made for equal costs):\n")
    print("| F,B,W | " + " | ".join(n for n, _ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for costs in ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1, 1.5, 0.5)):
        cells = [f"{max(simulated(n, 4, 16, v, costs=tuple(c / v for c in costs))[2].bubble):.4f}" for n, v in rows]
        print(f"| {','.join(f'{c:g}' for c in costs)} | " + " | ".join(cells) + " |")


def model_flags(args) -> List[str]:
    size = (["--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"] if args.emulate else
            ["--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
             "--seq-length", str(args.seq_length)])
    return size + ["--num-layers", str(LAYERS), "--micro-batch-size", "1", "--global-batch-size", str(M),
                   "--train-iters", str(args.warmup + args.steps), "--eval-iters", "0", "--lr", "1e-4",
                   "--device", "cpu", "--log-interval", "1000000"]


def _instrument(executor_cls, records: list, pad: Optional[Dict[str, float]]) -> None:
    """Time every forward-backward and compute action; with `pad` (seconds per layer by action
    kind), sleep each action up to its emulated duration."""
    run, compute = executor_cls.run, executor_cls._compute

    def timed_run(self, *a, **k):
        self.bench_record = {"start": time.perf_counter(), "actions": []}
        records.append(self.bench_record)
        out = run(self, *a, **k)
        self.bench_record["end"] = time.perf_counter()
        return out

    def timed_compute(self, action):
        t0 = time.perf_counter()
        compute(self, action)
        if pad is not None:
            rest = pad[action.kind] * len(self.chunks[action.chunk].layers) - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        self.bench_record["actions"].append((action.kind, time.perf_counter() - t0))

    executor_cls.run, executor_cls._compute = timed_run, timed_compute


def _worker(rank: int, world: int, argv: List[str], pad: Optional[Dict[str, float]]) -> dict:
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.parallel.pipeline.executor import PipelineExecutor
    from megatron_lite.training.step import pipelined_forward_backward

    records: list = []
    _instrument(PipelineExecutor, records, pad)  # this forked rank only
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        cfg, tokenizer = resolve(argv)
        trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
        if trainer.dims.pp == 1:  # the one-stage baseline runs through the executor too (same timing hooks)
            executor = PipelineExecutor(trainer.chunks, trainer.dims, "1f1b", trainer.device)
            trainer.forward_backward = pipelined_forward_backward(executor)
        history = trainer.train()
    return {"pp_rank": trainer.dims.pp_rank, "records": records, "step_time": [h["step_time_s"] for h in history],
            "loss": history[-1]["lm_loss"]}


def implied_latency(lists, placement, costs, makespan: float) -> float:
    """The per-transfer p2p time (simulator comm_cost) at which the replay's makespan equals the
    measured one: how much of the excess bubble the critical path's transfers would explain."""
    lo, hi = 0.0, makespan
    if simulate(lists, costs=costs, placement=placement).makespan >= makespan:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        fast = simulate(lists, costs=costs, comm_cost=mid, placement=placement).makespan < makespan
        lo, hi = (mid, hi) if fast else (lo, mid)
    return lo


def measure(label: str, pp: int, schedule: str, vpp: int, args) -> dict:
    argv = model_flags(args) + ["--pipeline-model-parallel-size", str(pp)]
    if pp > 1:
        argv += ["--pipeline-schedule", schedule]
        if vpp > 1 and schedule == "interleaved":  # the V schedules imply their two chunks
            argv += ["--virtual-pipeline-model-parallel-size", str(vpp)]
    pad = None
    if args.emulate:
        f, b, w = (float(x) * args.unit_ms / 1e3 for x in args.costs.split(","))
        pad = {"F": f, "B": b, "W": w, "BW": b + w}
    ranks = sorted(run_distributed(_worker, pp, argv, pad, timeout=1800), key=lambda r: r["pp_rank"])
    steps = range(args.warmup, args.warmup + args.steps)
    bubbles, makespans, busy, kinds = [[] for _ in ranks], [], [[] for _ in ranks], {}
    for s in steps:
        recs = [r["records"][s] for r in ranks]
        makespan = max(x["end"] for x in recs) - min(x["start"] for x in recs)
        makespans.append(makespan)
        for i, x in enumerate(recs):
            b = sum(d for _, d in x["actions"])
            busy[i].append(b)
            bubbles[i].append((makespan - b) / b)
            for kind, d in x["actions"]:
                kinds.setdefault(kind, []).append(d)
    step = statistics.median(max(r["step_time"][s] for r in ranks) for s in steps)
    cost = {k: statistics.mean(v) for k, v in kinds.items()}
    out = {"label": label, "step_s": step, "fb_s": statistics.median(makespans), "costs": cost,
           "busy_s": [statistics.median(b) for b in busy], "loss": next(r["loss"] for r in ranks if r["loss"])}
    if pp > 1:
        out["bubble"] = [statistics.median(b) for b in bubbles]
        sim_costs = (cost["F"], cost["B"], cost["W"]) if "W" in cost else (cost["F"], cost["BW"], 0.0)
        lists, placement, res = simulated(schedule, pp, M, vpp, sim_costs)
        out["sim"] = statistics.mean(res.bubble)
        # Real compute on shared cores: action times depend on how many ranks run at once, so a
        # replay with mean costs does not model the makespan and no latency can be inferred.
        out["latency"] = implied_latency(lists, placement, sim_costs, out["fb_s"]) if args.emulate else None
        out["theory"] = theory(schedule, pp, M, vpp)
    return out


def report(rows: List[dict], args) -> None:
    base = rows[0]["step_s"]
    mode = (f"emulated: sleep {args.costs} x {args.unit_ms} ms per layer (F,B,W)" if args.emulate else
            f"real compute, h {args.hidden_size}, seq {args.seq_length}")
    print(f"\nPP={PP}, m={M}, {LAYERS} layers, {mode}; medians of {args.steps} steps after {args.warmup} warm-up; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print("| schedule | step ms | fwd-bwd ms | measured bubble (mean; per stage) | simulator bubble | unit-cost theory "
          "| implied p2p ms | speedup vs PP=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "bubble" in r:
            per = " / ".join(f"{b:.3f}" for b in r["bubble"])
            latency = "-" if r["latency"] is None else f"{r['latency'] * 1e3:.1f}"
            cells = f"{statistics.mean(r['bubble']):.3f} ({per}) | {r['sim']:.3f} | {r['theory']:.3f} | {latency}"
        else:
            cells = "- | - | - | -"
        times = f"{r['step_s'] * 1e3:.0f} | {r['fb_s'] * 1e3:.0f}"
        print(f"| {r['label']} | {times} | {cells} | {base / r['step_s']:.2f}x |")
    print("\nper-stage busy compute ms per step (rank 0..3) and mean action cost ms per chunk:")
    for r in rows:
        busy = " / ".join(f"{b * 1e3:.0f}" for b in r["busy_s"])
        costs = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(r["costs"].items()))
        print(f"  {r['label']:<20} busy {busy:<24} {costs}   final loss {r['loss']:.4f}")


MOE_OVERLAP = [("dualpipe-v, pairs serialized", []), ("dualpipe-v, pairs overlapped", ["--overlap-moe-expert-parallel-comm"])]


class _SlowWork:
    """An asynchronous collective that completes no sooner than `seconds` after it was posted (an
    emulated network): waiting for it sleeps the rest, which `exposed` adds up."""

    def __init__(self, work, seconds: float, exposed: list):
        self.work, self.ready, self.exposed = work, time.perf_counter() + seconds, exposed

    def wait(self):
        rest = self.ready - time.perf_counter()
        if rest > 0:
            self.exposed[0] += rest
            time.sleep(rest)
        return self.work.wait()


def _moe_worker(rank: int, world: int, argv: List[str], a2a_s: float) -> dict:
    """Per step on this rank: forward-backward seconds, seconds blocked in collectives and waits
    (Communicator.blocked_s) and the emulated all-to-all latency left exposed (a2a_s > 0)."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.parallel.comm import Communicator

    exposed = [0.0]
    if a2a_s > 0:  # this forked rank only: every asynchronous all-to-all takes at least a2a_s
        plain = Communicator.all_to_all

        def slow(self, *a, async_op=False, **k):
            work = plain(self, *a, async_op=async_op, **k)
            return _SlowWork(work, a2a_s, exposed) if async_op and work is not None else work

        Communicator.all_to_all = slow
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        cfg, tokenizer = resolve(argv)
        trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
        comm, inner, records = trainer.dims.comm, trainer.forward_backward, []

        def timed(*a, **k):
            blocked, hidden, start = comm.blocked_s, exposed[0], time.perf_counter()
            out = inner(*a, **k)
            records.append((time.perf_counter() - start, comm.blocked_s - blocked, exposed[0] - hidden))
            return out

        trainer.forward_backward = timed
        history = trainer.train()
    return {"records": records, "step_time": [h["step_time_s"] for h in history], "loss": history[-1]["lm_loss"]}


def moe_overlap(args) -> None:
    """DualPipe-V at PP2 x EP2 on an MoE model (4 ranks): its F/B pairs serialized, then overlapped."""
    argv = ["--num-layers", "4", "--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
            "--seq-length", str(args.seq_length), "--micro-batch-size", "1", "--global-batch-size", "16",
            "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "dualpipe-v", "--train-iters", str(args.warmup + args.steps),
            "--eval-iters", "0", "--lr", "1e-4", "--device", "cpu", "--log-interval", "1000000",
            "--attention-dropout", "0", "--hidden-dropout", "0"]
    print(f"\nPP=2 x EP=2 (4 ranks), m=8, 4 MoE layers (8 experts, top 2, alltoall), h {args.hidden_size}, "
          f"seq {args.seq_length}, all-to-all latency emulated to >= {args.a2a_ms} ms; medians of {args.steps} "
          f"steps after {args.warmup} warm-up; {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print("| dualpipe-v | step ms | fwd-bwd ms | blocked in comm ms | exposed a2a latency ms | final loss |")
    print("|---|---|---|---|---|---|")
    for label, extra in MOE_OVERLAP * args.rounds:  # alternating: the machine's load drifts
        ranks = run_distributed(_moe_worker, 4, argv + extra, args.a2a_ms / 1e3, timeout=1800)
        steps = range(args.warmup, args.warmup + args.steps)
        step = statistics.median(max(r["step_time"][s] for r in ranks) for s in steps)
        fb, blocked, exposed = (statistics.median(max(r["records"][s][i] for r in ranks) for s in steps)
                                for i in range(3))  # each the worst rank's
        loss = next(r["loss"] for r in ranks if r["loss"])
        print(f"| {label} | {step * 1e3:.0f} | {fb * 1e3:.0f} | {blocked * 1e3:.0f} | {exposed * 1e3:.0f} "
              f"| {loss:.6f} |")


def memory_table() -> None:
    """Peak activation bytes per rank, measured in a real step and simulated from the same lists
    (tests/pipeline_memory_harness.py), for the V schedules and 1F1B at PP2 and PP4 (h 64, seq 64)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
    from pipeline_memory_harness import measured_and_simulated

    print("| schedule | pp | m | per rank: measured KiB = simulated KiB (peak in flight x KiB per chunk F) |")
    print("|---|---|---|---|")
    for p, m in ((2, 4), (4, 8)):
        argv = ["--num-layers", str(2 * p), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                "--micro-batch-size", "1", "--global-batch-size", str(m), "--train-iters", "2", "--device", "cpu",
                "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
                "--pipeline-model-parallel-size", str(p)]
        for schedule, vpp in (("1f1b", 1), ("zb-v", 2), ("dualpipe-v", 2)):
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                rows = measured_and_simulated(argv + ["--pipeline-schedule", schedule], schedule, p, m, vpp)
            cells = [f"{r['measured'] / 1024:.1f} {'=' if r['measured'] == r['simulated'] else '!='} "
                     f"{r['simulated'] / 1024:.1f} ({r['in_flight']} x "
                     + "/".join(f"{b / 1024:.1f}" for _, b in sorted(r["held"].items())) + ")" for r in rows]
            print(f"| {schedule} | {p} | {m} | " + "; ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--emulate", action="store_true", help="sleep-based stage costs on a tiny model")
    ap.add_argument("--costs", default="1,1,1", help="emulated F,B,W weights per layer (BW = B + W)")
    ap.add_argument("--unit-ms", type=float, default=20.0, help="emulated ms per layer for weight 1")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated schedules, e.g. gpipe,zb-h1 (PP=1 always runs)")
    ap.add_argument("--simulate", action="store_true", help="only the simulator's bubble table (pp 4/8/16, m 8-64)")
    ap.add_argument("--moe-overlap", action="store_true",
                    help="only dualpipe-v at PP2 x EP2 on an MoE model, F/B pairs serialized vs overlapped")
    ap.add_argument("--rounds", type=int, default=1, help="--moe-overlap: alternate the two runs this many times")
    ap.add_argument("--a2a-ms", type=float, default=0.0,
                    help="--moe-overlap: every MoE all-to-all completes no sooner than this (an emulated network)")
    ap.add_argument("--memory", action="store_true", help="only peak activation memory per rank, measured vs simulated")
    args = ap.parse_args(argv)
    if args.memory:
        memory_table()
        return 0
    if args.simulate:
        simulate_table()
        return 0
    torch.set_num_threads(1)
    if args.moe_overlap:
        moe_overlap(args)
        return 0
    wanted = None if args.only is None else set(args.only.split(","))
    rows = [measure(*s, args) for s in SCHEDULES if wanted is None or s[1] == 1 or s[2] in wanted]
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
