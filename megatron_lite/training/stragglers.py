"""--log-straggler (Megatron-LM's flag): which ranks are slow, and by how much.

Every rank adds up, per step, its data wait, forward-backward and optimizer times and the time it
spent blocked in collectives (the communicator's `blocked_s`). Collectives make every rank's step
last as long as the slowest one's, so the step time names no one; its "busy" part (the step less
the time blocked waiting for peers) does: a slow rank is busy while the others wait for it. Every
--log-interval one all-gather over the world brings every rank's means to every rank; the logging
rank names the `count` slowest and fastest ranks and their busy time's ratio to the median (the
lower middle for an even count, so that in a world of two the slow rank is held against the other).
The times are the host's: on the CPU (gloo) a collective blocks the host until its peers answer;
NCCL's kernels wait on the device instead, so on GPUs the wait shows up in the part that next
synchronizes (the optimizer's end of step), not in "blocked" (not run on a GPU yet).
The first step of the process is left out: its one-time costs (allocation, lazy initialization)
differ from rank to rank and say nothing about stragglers.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

PARTS = ("data", "fwd_bwd", "optimizer", "blocked")  # seconds per step, in this order
LABELS = {"data": "data", "fwd_bwd": "forward-backward", "optimizer": "optimizer", "blocked": "blocked"}


class StragglerLog:
    """With `every` (--log-interval) and `last` (--train-iters), the trainer's feature (features.py)."""

    def __init__(self, dims, count: int, every: int = 1, last: int = 0, device=None):
        self.dims, self.count, self.every, self.last, self.device = dims, count, every, last, device
        self._sums = torch.zeros(len(PARTS), dtype=torch.float64)
        self._steps, self._first = 0, None
        self._warm = False  # the process's first step has been seen (and left out)

    def add(self, iteration: int, **seconds: float) -> None:
        """One step's times, by PARTS."""
        if not self._warm:
            self._warm = True
            return
        self._sums += torch.tensor([seconds[p] for p in PARTS], dtype=torch.float64)
        self._steps += 1
        self._first = iteration if self._first is None else self._first

    def step_ended(self, iteration: int, phases: Dict[str, float]) -> None:
        self.add(iteration, **phases)

    def record(self, iteration: int, rec: dict) -> Optional[str]:
        """Every `every` steps and at the last, the report in the record (a collective); its line."""
        if self.pending and (iteration % self.every == 0 or iteration == self.last):
            rec["stragglers"] = self.gather(iteration, self.device)
            rec["straggler_max_ratio"] = rec["stragglers"]["slowest"][0]["ratio"]
            return line(rec["stragglers"])
        return None

    @property
    def pending(self) -> bool:
        """Steps to report (the same on every rank: each leaves out its first)."""
        return self._steps > 0

    def gather(self, iteration: int, device) -> Dict:
        """Collective over the world: the report of the steps since the last one (then reset)."""
        dims = self.dims
        mine = (self._sums / max(self._steps, 1)).to(device)
        every = torch.empty(dims.world_size * len(PARTS), dtype=torch.float64, device=device)
        dims.comm.all_gather(every, mine, dims.group("world"))
        per_rank = every.view(dims.world_size, len(PARTS)).cpu()
        first, self._first = self._first, None
        self._sums.zero_()
        self._steps = 0
        return report(per_rank.tolist(), self.count, (first, iteration))


def report(per_rank: List[List[float]], count: int, iterations) -> Dict:
    """{"iterations", "median_busy_s", "slowest": [...], "fastest": [...]} from each rank's PARTS."""
    ranks = []
    for rank, values in enumerate(per_rank):
        parts = dict(zip(PARTS, values))
        busy = parts["data"] + parts["fwd_bwd"] + parts["optimizer"] - parts["blocked"]
        ranks.append({"rank": rank, "busy_s": busy, **{f"{p}_s": v for p, v in parts.items()}})
    by_busy = sorted(ranks, key=lambda r: (-r["busy_s"], r["rank"]))
    median = sorted(r["busy_s"] for r in ranks)[(len(ranks) - 1) // 2]
    for r in ranks:
        r["ratio"] = r["busy_s"] / max(median, 1e-9)  # finite: the metrics file is strict JSON
    count = min(count, len(ranks))
    return {"iterations": list(iterations), "median_busy_s": median, "slowest": by_busy[:count],
            "fastest": by_busy[::-1][:count]}


def line(rep: Dict) -> str:
    """The console line of a report."""
    def one(r):
        parts = ", ".join(f"{LABELS[p]} {r[p + '_s']:.3f}" for p in PARTS)
        return f"rank {r['rank']} busy {r['busy_s']:.3f} s = {r['ratio']:.2f} x median ({parts})"

    a, b = rep["iterations"]
    return (f"> stragglers, iterations {a}-{b} (s per step; busy = data + forward-backward + optimizer - blocked in "
            f"collectives; median {rep['median_busy_s']:.3f} s): slowest " + "; ".join(map(one, rep["slowest"]))
            + " | fastest " + "; ".join(map(one, rep["fastest"])))
