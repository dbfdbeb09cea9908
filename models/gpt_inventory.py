"""GPT's parameters per rank, described without building the model: what the planner's state
accounting (megatron_lite/planning/state.py) reads.

The description comes from GPT's own modules, built on the meta device (no storage): one chunk
with a single layer of each kind (dense, MoE) per (TP, EP, ETP) size, whose parameters are then
repeated for every layer of a chunk's range, in the registration order GPTModel uses (embedding,
layers, final norm, output layer). So a module that gains a parameter (a q/k norm, a bias) is
accounted for without touching the planner, and a llama3-70b chunk is described in milliseconds.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_lite import config as C
from megatron_lite.parallel.bucket_plan import ParamInfo
from megatron_lite.parallel.sharding import spec_of
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.transformer.spec import BuildContext
from models.gpt import GPTModel

_Piece = List[Tuple[str, int, torch.dtype, bool]]  # (name, numel, dtype, expert)


class GPTInventory:
    """`chunk(layer_range, pre, post, tp, ep, etp)` -> that chunk's trainable ParamInfos."""

    def __init__(self, cfg: C.ModelConfig, params_dtype: torch.dtype):
        self.cfg, self.dtype = cfg, params_dtype
        self.kinds = cfg.moe_layers()
        self._cache: Dict[tuple, Tuple[_Piece, Dict[bool, _Piece], _Piece]] = {}
        self._chunks: Dict[tuple, List[ParamInfo]] = {}  # callers only read the lists

    def _pieces(self, tp: int, ep: int, etp: int, pre: bool, post: bool):
        """(before the layers, {kind: one layer's params}, after the layers), from meta builds."""
        key = (tp, ep, etp, pre, post)
        if key not in self._cache:
            dims = ParallelDims(tp=tp, dp=ep * etp, ep=ep, etp=etp)  # shapes only: no process group
            ctx = BuildContext(dims, params_dtype=self.dtype)
            layers, before, after = {}, [], []
            for kind in sorted(set(self.kinds)):
                i = self.kinds.index(kind)
                with torch.device("meta"):
                    m = GPTModel(self.cfg, ctx, layer_range=(i, i + 1), pre_process=pre, post_process=post)
                named = [(n, p.numel(), p.dtype, spec_of(p).split("ep") is not None)
                         for n, p in m.named_parameters() if p.requires_grad]
                prefix = f"layers.{i}."
                layers[kind] = [(n[len(prefix):],) + tuple(rest) for n, *rest in named if n.startswith(prefix)]
                seen_layer = [n.startswith(prefix) for n, *_ in named]
                first = seen_layer.index(True) if True in seen_layer else len(named)
                before = [x for x, s in zip(named[:first], seen_layer[:first]) if not s]
                after = [x for x, s in zip(named[first:], seen_layer[first:]) if not s]
            self._cache[key] = (before, layers, after)
        return self._cache[key]

    def chunk(self, layer_range: Tuple[int, int], pre: bool, post: bool, tp: int, ep: int = 1,
              etp: int = 1) -> List[ParamInfo]:
        key = (tuple(layer_range), pre, post, tp, ep, etp)
        if key not in self._chunks:
            self._chunks[key] = self._chunk(layer_range, pre, post, tp, ep, etp)
        return self._chunks[key]

    def _chunk(self, layer_range, pre, post, tp, ep, etp) -> List[ParamInfo]:
        before, layers, after = self._pieces(tp, ep, etp, pre, post)
        out = [ParamInfo(n, k, dt, e, 0) for n, k, dt, e in before]
        for unit, i in enumerate(range(*layer_range), start=1):  # ZeRO-3 units: the layers, in order
            out += [ParamInfo(f"layers.{i}.{n}", k, dt, e, unit) for n, k, dt, e in layers[self.kinds[i]]]
        return out + [ParamInfo(n, k, dt, e, 0) for n, k, dt, e in after]
