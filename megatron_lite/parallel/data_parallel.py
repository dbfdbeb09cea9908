"""Data-parallel gradient synchronisation.

Every rank's loss is already normalised by the global number of tokens, so summing gradients
over the data-parallel group gives the gradient of the global-batch loss.
"""
from __future__ import annotations

from typing import List

import torch.nn as nn

from . import comm
from .grads import finalize_model_grads
from .state import ParallelDims


class GradientSync:
    def __init__(self, chunks: List[nn.Module], dims: ParallelDims):
        self.dims = dims
        self.params = [p for c in chunks for p in c.parameters()]

    def finish(self) -> None:
        """Called once per step after the last micro-batch's backward."""
        for p in self.params:
            if p.grad is not None:
                comm.all_reduce(p.grad, self.dims.dp_cp_group)
        finalize_model_grads(self.params, self.dims)
