"""Which pipeline rank runs each virtual stage: one object shared by the model builder, the
executor, the simulator and the planner.

With p ranks and v chunks per rank, a micro-batch's forward runs virtual stages 0 .. p*v - 1 in
order (its backward in reverse). A placement maps stage s to (rank, local chunk):
  loop  chunk c walks down the ranks: stage c * p + r is on rank r (Megatron's interleaving).
  V     the chunks alternate direction: chunk 0 down the ranks 0..p-1, chunk 1 back up p-1..0.
        With v = 2 rank 0 holds the first and the last stage (embedding and loss), and the hop
        from stage p-1 to p stays on rank p-1: a local hand-off, not a message (ZB-V).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .partition import LayerSplit, stage_layer_ranges

KINDS = ("loop", "V")


@dataclass(frozen=True)
class StagePlacement:
    pp: int
    vpp: int = 1
    kind: str = "loop"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown pipeline placement {self.kind!r}; use one of {', '.join(KINDS)}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def _upward(self, chunk: int) -> bool:
        return self.kind == "V" and chunk % 2 == 1

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + (self.pp - 1 - rank if self._upward(chunk) else rank)

    def location(self, stage: int) -> Tuple[int, int]:
        """(rank, local chunk) of virtual stage `stage`."""
        chunk, i = divmod(stage, self.pp)
        return (self.pp - 1 - i if self._upward(chunk) else i), chunk

    def is_first(self, rank: int, chunk: int) -> bool:  # embeds the tokens
        return self.stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:  # computes the loss
        return self.stage(rank, chunk) == self.num_stages - 1

    def end_ranks(self) -> Tuple[int, int]:
        """The ranks of the first and the last virtual stage (the embedding and the loss)."""
        return self.location(0)[0], self.location(self.num_stages - 1)[0]

    def neighbour(self, rank: int, chunk: int, step: int) -> Optional[Tuple[int, int]]:
        """(rank, chunk) of the next (step = 1) or previous (step = -1) stage; None past an end."""
        s = self.stage(rank, chunk) + step
        return self.location(s) if 0 <= s < self.num_stages else None

    def peer(self, rank: int, chunk: int, step: int) -> Optional[int]:
        """The rank (rank, chunk) exchanges messages with about its neighbour `step` (forward
        outputs and their gradients); None when there is none or it is a local hand-off."""
        n = self.neighbour(rank, chunk, step)
        return n[0] if n is not None and n[0] != rank else None

    def rank_chunks(self, rank: int, num_layers: int,
                    split: Optional[LayerSplit] = None) -> List[Tuple[Tuple[int, int], bool, bool]]:
        """(layer range, is first stage, is last stage) of each local chunk of `rank`; `split`: the
        layers per virtual stage when not even (partition.py)."""
        ranges = stage_layer_ranges(num_layers, self.pp, self.vpp, split, self.kind)
        return [(ranges[self.stage(rank, c)], self.is_first(rank, c), self.is_last(rank, c)) for c in range(self.vpp)]
