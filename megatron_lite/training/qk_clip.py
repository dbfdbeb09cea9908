"""QK-clip after each update (--qk-clip; the rule is in transformer/qk_clip.py): a step part
(transformer/step_hooks.py) that turns on the attention layers' max-logit measurement, and after an
applied update reduces each layer's per-head maxima over the ranks that saw other tokens or hold
other heads (TP: heads are split; CP and DP: other tokens) and scales the query / key rows of the
params and of the optimizer's main params (DistributedOptimizer.scale_rows_).

`metrics()` gives `max_attention_logit` (Megatron-LM's --log-max-attention-logit): the largest
logit of the step over every layer of every stage, before the clip."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..transformer.qk_clip import LOW, MaxLogitObserver


def attention_modules(chunks) -> List[torch.nn.Module]:
    """The self-attention modules (standard or MLA) of this rank's chunks, in registration order."""
    return [m for c in chunks for m in c.modules() if hasattr(m, "qk_clip_rows")]


class QKClip:
    def __init__(self, chunks, dims, optimizer, threshold: float, alpha: float, clip: bool = True):
        self.dims, self.optimizer, self.tau, self.alpha, self.clip = dims, optimizer, threshold, alpha, clip
        self.modules = attention_modules(chunks)
        for m in self.modules:
            m.max_logits = MaxLogitObserver(m.heads, dims)
        self.last: Optional[float] = None
        self.device = self.modules[0].linear_proj.weight.device if self.modules else None

    def before_step(self, iteration: int) -> None:
        for m in self.modules:
            m.max_logits.reset()

    def _global_maxima(self) -> torch.Tensor:
        """[layers, all heads]: every head's largest logit of the step, reduced over TP, CP and DP."""
        dims = self.dims
        if not self.modules:
            return torch.zeros(0, 0)
        heads = self.modules[0].heads * dims.tp
        device = self.modules[0].linear_proj.weight.device
        out = torch.full((len(self.modules), heads), LOW, dtype=torch.float32, device=device)
        for row, m in enumerate(self.modules):
            if m.max_logits.value is not None:
                out[row, dims.tp_rank * m.heads:(dims.tp_rank + 1) * m.heads] = m.max_logits.value
        for group in (dims.tp_group, dims.dp_cp_group):
            dims.comm.all_reduce(out, group, op=dist.ReduceOp.MAX)
        return out

    @torch.no_grad()
    def after_update(self) -> None:
        maxima = self._global_maxima()
        self.last = float(maxima.max()) if maxima.numel() else None
        if self.clip and maxima.numel() and self.last > self.tau:
            scales = [pair for m, mx in zip(self.modules, maxima) for pair in m.qk_clip_rows(mx, self.tau, self.alpha)]
            self.optimizer.scale_rows_(scales)
        for m in self.modules:
            m.max_logits.reset()

    def metrics(self) -> dict:
        """Collective over the pipeline stages: the step's largest logit of any layer."""
        value = torch.tensor([self.last if self.last is not None else LOW], dtype=torch.float32, device=self.device)
        self.dims.comm.all_reduce(value, self.dims.pp_group, op=dist.ReduceOp.MAX)
        return {"max_attention_logit": float(value.item())} if value.item() > LOW else {}
