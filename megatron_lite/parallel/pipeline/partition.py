"""Which transformer layers each (virtual) pipeline stage holds.

The even split gives every one of the pp x vpp virtual stages num_layers / (pp x vpp) layers.
Megatron-LM's ways to do otherwise (`LayerSplit`, one of them at a time):
  - `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`: the first / last
    pipeline rank holds that many layers, the other ranks the rest evenly; with virtual stages each
    rank's layers are spread evenly over its chunks (so each rank's count must divide by vpp);
  - `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`: the
    embedding / the loss counts as one layer of the even split, so the first / last virtual stage
    holds one layer fewer;
  - `--pipeline-model-parallel-layout`: every virtual stage spelled out, e.g. "Et*3|(tt|)*29,m|L":
    `|` separates the pp x vpp stages in virtual-stage order, `E` embedding, `t` transformer layer,
    `m` multi-token-prediction layer, `L` loss; `(...)*n` and `x*n` repeat, commas are cosmetic.
    The number of stages sets vpp. The MTP modules sit with the loss: every `m` in the last stage,
    after its transformer layers and before L (which may leave that stage to MTP alone: "Ett|tt|mL");
    Megatron-Core's standalone MTP (its `m` on a stage before the loss's) is refused.
A virtual stage between the first and the last needs at least one layer (it has no other parameters).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import ConfigError

LAYOUT_LETTERS = {"E": "embedding", "t": "transformer layer", "m": "multi-token prediction", "L": "loss"}


@dataclass(frozen=True)
class LayerSplit:
    """How the decoder layers are cut into virtual stages when not evenly (Megatron-LM's flags)."""
    first: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last: Optional[int] = None  # --decoder-last-pipeline-num-layers
    layout: Optional[str] = None  # --pipeline-model-parallel-layout
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split

    @classmethod
    def of(cls, parallel) -> "LayerSplit":
        """From a ParallelConfig (its Megatron-named fields)."""
        return cls(parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers,
                   parallel.pipeline_model_parallel_layout, parallel.account_for_embedding_in_pipeline_split,
                   parallel.account_for_loss_in_pipeline_split)

    @property
    def even(self) -> bool:
        return self == LayerSplit()


def parse_layout(text: str) -> List[str]:
    """The stages of a --pipeline-model-parallel-layout string, repetitions unrolled (one string of
    layer letters per virtual stage, in virtual-stage order), as Megatron-LM parses it."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    unknown = sorted({c for c in s if c != "|" and c not in LAYOUT_LETTERS})
    if unknown:
        raise ConfigError(f"--pipeline-model-parallel-layout {text!r}: unknown {' '.join(map(repr, unknown))}; use "
                          + ", ".join(f"{k} ({v})" for k, v in LAYOUT_LETTERS.items())
                          + ", | between stages, (...)*n or x*n to repeat")
    return s.split("|")


def layout_stage_sizes(text: str, num_layers: int, pp: int) -> List[int]:
    """Layers of each virtual stage of a --pipeline-model-parallel-layout (len = pp x vpp)."""
    stages = parse_layout(text)
    flat, bad = "".join(stages), f"--pipeline-model-parallel-layout {text!r}"
    if len(stages) % pp:
        raise ConfigError(f"{bad} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size ({pp}); "
                          f"give pp x virtual-stages stages separated by |")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{bad}: the embedding E must come once, first in the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{bad}: the loss L must come once, last in the last stage")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{bad} places {flat.count('t')} transformer layers (t) but --num-layers is {num_layers}")
    if "m" in flat and not (re.fullmatch(r"[^m]*m+L", flat) and stages[-1].count("m") == flat.count("m")):
        raise ConfigError(f"{bad}: the multi-token prediction layers (m) go together into the last stage, after "
                          f"every transformer layer and just before L (an m stage before the loss's, Megatron-Core's "
                          f"standalone MTP, is not supported)")
    return [st.count("t") for st in stages]


def layout_mtp_layers(text: str) -> int:
    """How many multi-token prediction layers (m) a --pipeline-model-parallel-layout places."""
    return "".join(parse_layout(text)).count("m")


def _ends_and_rest(num_layers: int, n: int, first: Optional[int], last: Optional[int]) -> List[int]:
    """`n` sizes: `first` / `last` layers at the two ends (where given), the rest even over the others."""
    for what, k in (("first", first), ("last", last)):
        if k is not None and k < 0:
            raise ConfigError(f"--decoder-{what}-pipeline-num-layers ({k}) must be >= 0")
    sizes = [None] * n
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    rest = num_layers - sum(s for s in sizes if s is not None)
    middle = sum(1 for s in sizes if s is None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise ConfigError(
            f"num_layers ({num_layers}) minus the first ({first}) and last ({last}) stage layers must "
            f"split evenly over the {middle} remaining pipeline stages; adjust the layer counts")
    if middle and rest == 0:  # a middle stage without parameters: nothing to build or optimize
        raise ConfigError(f"num_layers ({num_layers}) minus the first ({first}) and last ({last}) stage layers "
                          f"leaves no layer for the {middle} middle pipeline stages; lower those counts")
    return [s if s is not None else rest // middle for s in sizes]


def _first_last_sizes(num_layers: int, pp: int, vpp: int, first: Optional[int], last: Optional[int]) -> List[int]:
    """Per virtual stage: `first` / `last` layers on the first / last rank, the rest even over the
    others; each rank's layers even over its vpp chunks."""
    if pp == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    ranks = _ends_and_rest(num_layers, pp, first, last)
    if vpp > 1 and any(n % vpp for n in ranks):
        raise ConfigError(f"with {vpp} virtual stages each pipeline rank's layers ({'+'.join(map(str, ranks))}) "
                          f"must divide by {vpp}; change --decoder-first/last-pipeline-num-layers or the sizes")
    return [ranks[r] // vpp for c in range(vpp) for r in range(pp)]


def _accounted_sizes(num_layers: int, stages: int, split: LayerSplit) -> List[int]:
    """The embedding and / or the loss counted as a layer of the even split."""
    extra = int(split.account_for_embedding) + int(split.account_for_loss)
    if (num_layers + extra) % stages:
        raise ConfigError(f"num_layers ({num_layers}) + {extra} (embedding / loss counted as layers) must be "
                          f"divisible by the {stages} pipeline stages; change --num-layers or the pipeline sizes")
    sizes = [(num_layers + extra) // stages] * stages
    if split.account_for_embedding:
        sizes[0] -= 1
    if split.account_for_loss:
        sizes[-1] -= 1
    return sizes


def stage_sizes(num_layers: int, pp: int, vpp: int = 1, split: Optional[LayerSplit] = None,
                placement: str = "loop") -> List[int]:
    """Layers of each virtual stage, in virtual-stage order (`placement`: loop or V, StagePlacement's)."""
    split = split or LayerSplit()
    stages = pp * vpp
    accounted = split.account_for_embedding or split.account_for_loss
    uneven = split.first is not None or split.last is not None
    if sum((split.layout is not None, accounted, uneven)) > 1:
        raise ConfigError("--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers and "
                          "--account-for-embedding/loss-in-pipeline-split each set the split: give one of them")
    if split.layout is not None:
        sizes = layout_stage_sizes(split.layout, num_layers, pp)
        if len(sizes) != stages:
            raise ConfigError(f"--pipeline-model-parallel-layout has {len(sizes)} stages but pipeline "
                              f"size ({pp}) x virtual stages ({vpp}) = {stages}; drop the virtual-stage flags")
    elif uneven and placement == "V":
        # the first and last virtual stages both sit on rank 0, beside the embedding and the loss
        sizes = _ends_and_rest(num_layers, stages, split.first, split.last)
    elif uneven:
        sizes = _first_last_sizes(num_layers, pp, vpp, split.first, split.last)
    elif accounted:
        sizes = _accounted_sizes(num_layers, stages, split)
    else:
        if num_layers % stages:
            what = f"pipeline_model_parallel_size ({pp})" + (f" x virtual stages ({vpp})" if vpp > 1 else "")
            raise ConfigError(f"num_layers ({num_layers}) must be divisible by {what} = {stages}; "
                              f"change --num-layers or the pipeline sizes")
        sizes = [num_layers // stages] * stages
    empty = [s for s in range(1, stages - 1) if sizes[s] == 0]
    if empty:
        raise ConfigError(f"virtual pipeline stage {empty[0]} (of {stages}) holds no transformer layer and is "
                          f"neither the first nor the last: give every middle stage a layer")
    return sizes


def stage_layer_ranges(num_layers: int, pp: int, vpp: int = 1, split: Optional[LayerSplit] = None,
                       placement: str = "loop") -> List[Tuple[int, int]]:
    """[start, end) of global layer indices for each virtual stage, in virtual-stage order."""
    ranges, start = [], 0
    for s in stage_sizes(num_layers, pp, vpp, split, placement):
        ranges.append((start, start + s))
        start += s
    return ranges
