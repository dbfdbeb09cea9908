"""Which transformer layers each (virtual) pipeline stage holds."""
from __future__ import annotations

from typing import List, Optional, Tuple

from ...errors import ConfigError


def stage_layer_ranges(num_layers: int, pp: int, vpp: int = 1, first: Optional[int] = None,
                       last: Optional[int] = None, placement: str = "loop") -> List[Tuple[int, int]]:
    """[start, end) of global layer indices for each virtual stage, in virtual-stage order. Even
    split, or `first`/`last` layers on the first/last stage and the rest even over the middle ones
    (no virtual stages then, except under the V placement, where both ends sit on rank 0 and the
    embedding and the loss already weigh on it: fewer layers there balance the V)."""
    if first is not None or last is not None:
        if vpp > 1 and placement != "V":
            raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with virtual "
                              "pipeline stages; use one or the other")
        if pp == 1:
            raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        for what, n in (("first", first), ("last", last)):
            if n is not None and n < 0:
                raise ConfigError(f"--decoder-{what}-pipeline-num-layers ({n}) must be >= 0")
        sizes = [None] * (pp * vpp)
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        rest = num_layers - sum(s for s in sizes if s is not None)
        middle = sum(1 for s in sizes if s is None)
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise ConfigError(
                f"num_layers ({num_layers}) minus the first ({first}) and last ({last}) stage layers must "
                f"split evenly over the {middle} remaining (virtual) pipeline stages; adjust the layer counts")
        if middle and rest == 0:  # a middle stage without parameters: nothing to build or optimize
            raise ConfigError(f"num_layers ({num_layers}) minus the first ({first}) and last ({last}) stage layers "
                              f"leaves no layer for the {middle} middle pipeline stages; lower those counts")
        sizes = [s if s is not None else rest // middle for s in sizes]
    else:
        stages = pp * vpp
        if num_layers % stages:
            what = f"pipeline_model_parallel_size ({pp})" + (f" x virtual stages ({vpp})" if vpp > 1 else "")
            raise ConfigError(f"num_layers ({num_layers}) must be divisible by {what} = {stages}; "
                              f"change --num-layers or the pipeline sizes")
        sizes = [num_layers // stages] * stages
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges
