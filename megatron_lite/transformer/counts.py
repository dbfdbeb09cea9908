"""What a module costs, reported by its type from the config alone (nothing is built: a 405B model
is counted on a laptop): parameters, forward FLOPs per token, activation bytes kept for backward.
Each layer type has a `counts(cfg, mb)`; model_counts.py sums them for the start-up line, MFU, the
planner and checkpoint sizes. FLOPs follow training/flops.py's PaLM convention: a forward costs 2
per weight a token uses (norms and biases too, embedding lookups not) plus the core attention's
4 H Q T (T the keys a query sees, not halved for causality); training 3 times the forward."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple


class MicroBatch(NamedTuple):
    """One micro-batch on one rank, what activation bytes depend on (the default: none are kept)."""
    seq_length: int = 0  # the whole sequence: the keys attention sees
    tokens: int = 0  # this rank's tokens: s / cp x b
    tp: int = 1
    etp: int = 1
    sequence_parallel: bool = False  # residual-stream tensors hold 1/tp of the tokens
    a: int = 2  # activation element size
    recompute: Optional[str] = None  # None | selective | full
    recompute_modules: Tuple[str, ...] = ("core_attn",)  # selective: --recompute-modules

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation covers `module` (a --recompute-modules name)."""
        return self.recompute == "selective" and module in self.recompute_modules

    @property
    def residual_tokens(self) -> int:
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


class Counts(NamedTuple):
    params: int = 0  # of the whole (unsharded) module
    active: int = 0  # of which one token uses (an MoE layer: the k experts it is routed to)
    flops: int = 0  # forward FLOPs per token
    core_flops: int = 0  # of which the core attention's (what selective recomputation replays)
    act_bytes: int = 0  # kept for backward over one micro-batch on one rank

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(*(x + y for x, y in zip(self, other)))


def weights(n: int, active: Optional[int] = None, act_bytes: int = 0) -> Counts:
    """`n` weights of which a token uses `active` (default: all), 2 forward FLOPs each."""
    active = n if active is None else active
    return Counts(n, active, 2 * active, 0, act_bytes)
