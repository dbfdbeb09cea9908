"""Two computations run as interleaved pieces, so that one's collective is in flight while the
other computes (DualPipe-V's overlapped forward/backward pair).

`Interleaver.run(first, second)` runs the two callables as coroutines on two threads that pass
one baton: exactly one of them runs at any time, `first` starts, and control changes hands only
where a running piece calls `switch()`: the MoE dispatcher does so after starting an
asynchronous all-to-all and before waiting for it (Communicator.wait_overlapped). A piece ends
at the next switch point, so each of the two runs from one of its collectives to the next:

    first:   compute .. start a2a ─┐                  ┌─ wait a2a, compute .. start a2a ─┐
    second:                        └─ compute .. start a2a ─┘                            └─ ...

Why threads and not generators: a forward and an autograd backward are deep call stacks (the
model's modules, the autograd engine) that cannot yield; a thread keeps each stack as it is,
and the baton makes the interleaving as deterministic as a generator's. Every rank of an EP
group runs the same pair of the same list, reaches the same switch points in the same order, and
so issues its collectives in the same order (gloo and NCCL match collectives by issue order).

Not a switch point: a forward recomputed inside the backward (activation checkpointing): it
swaps the RNG state for its replay and must not let the other thread draw from it. Its backward
pieces switch as usual. When one computation has finished the other runs to its end alone.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch


def _in_recomputed_forward() -> bool:
    """A forward with gradients inside a running backward: the replay of a checkpointed region."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class Interleaver:
    """Runs two callables as interleaved pieces (see the module docstring). `log`, when a list,
    records (role, event) in order: ("first"|"second", "start"|"wait"|"resume"|"end") where
    start = an asynchronous collective was posted and control handed over, wait = about to wait
    for it, resume = the baton came back."""

    ROLES = ("first", "second")

    def __init__(self, log: Optional[List[Tuple[str, str]]] = None):
        self.log = log
        self._cond = threading.Condition()
        self._turn, self._alive, self._roles = 0, [False, False], {}

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        """first() and second() to completion; the first error raised by either is re-raised."""
        self._turn, self._alive, self._roles = 0, [True, True], {}
        errors: List[Optional[BaseException]] = [None, None]
        helper = threading.Thread(target=self._body, args=(1, second, errors), daemon=True)
        helper.start()
        self._body(0, first, errors)
        helper.join()
        for e in errors:
            if e is not None:
                raise e

    def _body(self, role: int, fn: Callable[[], None], errors: list) -> None:
        self._roles[threading.get_ident()] = role
        with self._cond:
            self._cond.wait_for(lambda: self._turn == role)
        try:
            fn()
        except BaseException as e:  # handed to run(), which re-raises it on the caller's thread
            errors[role] = e
        finally:
            self._record(role, "end")
            with self._cond:
                self._alive[role] = False
                self._turn = 1 - role
                self._cond.notify_all()

    def switch(self) -> bool:
        """Hand the baton to the other computation if it is still running, and wait for it back.
        A no-op (False) off the two threads, once the other has finished, or in a recomputed forward."""
        role = self._role()
        if role is None or not self._alive[1 - role] or _in_recomputed_forward():
            return False
        self._record(role, "start")
        with self._cond:
            self._turn = 1 - role
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == role)
        self._record(role, "resume")
        return True

    def record_wait(self) -> None:
        role = self._role()
        if role is not None:
            self._record(role, "wait")

    def _role(self) -> Optional[int]:
        """The calling thread's role; on another thread while a pair runs, the baton holder's: only
        it runs, so the caller works for it (CUDA's autograd runs a backward on a device thread)."""
        role = self._roles.get(threading.get_ident())
        if role is None and all(self._alive):
            role = self._turn
        return role

    def _record(self, role: int, event: str) -> None:
        if self.log is not None:
            self.log.append((self.ROLES[role], event))
