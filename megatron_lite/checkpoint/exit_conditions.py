"""When a run should stop early, save and exit 0: SIGTERM (--exit-signal-handler, e.g. SLURM
preemption), a wall-clock budget (--exit-duration-in-mins), an iteration multiple (--exit-interval).

A signal reaches ranks at different moments (or only some of them), and clocks differ: so at the
end of every iteration the ranks agree with one tiny all-reduce (only when one of those two is on),
and all stop after the same iteration.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

from ..config import TrainingConfig
from .saver import world_min


class ExitConditions:
    def __init__(self, tcfg: TrainingConfig, device):
        self.device = device
        self.interval, self.minutes = tcfg.exit_interval, tcfg.exit_duration_in_mins
        self.start = time.time()
        self.signalled = False
        self.handling = tcfg.exit_signal_handler
        if self.handling:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def check(self, iteration: int) -> Optional[str]:
        """Collective: why to stop after `iteration`, or None."""
        if self.handling or self.minutes:
            late = bool(self.minutes) and (time.time() - self.start) / 60.0 > self.minutes
            why = -world_min(-(2 if self.signalled else 1 if late else 0), self.device)  # max over ranks
            if why == 2:
                return "SIGTERM received"
            if why == 1:
                return f"--exit-duration-in-mins {self.minutes} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        return None

    def close(self) -> None:
        """Give SIGTERM back to whoever had it (tests run several trainers in one process)."""
        if self.handling:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self.handling = False
