"""--hang-detection-factor: a watchdog thread per rank that notices a step which has run for N
times the median step time so far, dumps every thread's Python stack of this rank to a file,
says so in one line and ends the process (exit 1, which torchrun restarts).

A hang on one rank stalls its peers in their next collective, so every rank's watchdog fires at
about the same time: the hung rank's dump shows where it hangs, the others' show the collective
they wait in. Only the step itself is timed (data, forward-backward, optimizer): checkpoint saves
and evaluations between steps are not. The first `warmup` steps (slow: allocation, warm-up) only
set the median.
"""
from __future__ import annotations

import bisect
import faulthandler
import os
import sys
import threading
import time
from typing import List, Optional


class HangWatchdog:
    def __init__(self, factor: float, warmup: int, dump_dir: str, rank: int):
        self.factor, self.warmup, self.rank = factor, warmup, rank
        self.path = os.path.join(os.path.abspath(dump_dir), f"hang-rank{rank}.txt")
        self._times: List[float] = []  # the completed steps' times, sorted
        self._step: Optional[tuple] = None  # (iteration, start) of the step running now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def train_started(self) -> None:  # (the trainer's feature hooks, features.py)
        self._thread.start()

    def step_started(self, iteration: int) -> None:
        self._step = (iteration, time.monotonic())

    def step_ended(self, iteration: Optional[int] = None, phases=None) -> None:
        step, self._step = self._step, None
        if step is not None:
            bisect.insort(self._times, time.monotonic() - step[1])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _median(self) -> Optional[float]:
        times = self._times
        return times[len(times) // 2] if len(times) >= self.warmup else None

    def _watch(self) -> None:
        poll = 0.5
        while not self._stop.wait(poll):
            step, median = self._step, self._median()
            if median is None:
                continue
            limit = self.factor * median
            poll = min(1.0, max(0.01, limit / 10))  # notice within ~10% of the limit
            if step is not None and time.monotonic() - step[1] > limit:
                self._fire(step[0], time.monotonic() - step[1], median)

    def _fire(self, iteration: int, elapsed: float, median: float) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"rank {self.rank}, iteration {iteration}: {elapsed:.1f} s into the step (median step "
                    f"{median:.3f} s); every thread's Python stack, most recent call first:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        sys.stdout.flush()
        print(f"error: [rank {self.rank}] iteration {iteration} has run for {elapsed:.1f} s, over "
              f"--hang-detection-factor {self.factor:g} x the median step time {median:.3f} s: a hang; every "
              f"thread's stack is in {self.path}; exiting for torchrun to restart from the last checkpoint",
              file=sys.stderr, flush=True)
        os._exit(1)  # the main thread is stuck: no cleanup can run
