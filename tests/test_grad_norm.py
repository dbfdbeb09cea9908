"""The global gradient norm (it sets the clipping coefficient) is exact to float64 rounding, at
every ZeRO stage and DP size, for gradients of millions of elements."""
import math

import pytest
import torch
import torch.nn as nn

from megatron_lite.config import ParallelConfig, TrainingConfig
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import run_distributed

SHAPES = [(2500, 2000), (3001,), (700, 3)]  # 5M elements, odd sizes so that shards split params


def _grads():
    gen = torch.Generator().manual_seed(3)
    # A mean far from zero makes float32 accumulation drift: what a real gradient's bulk does.
    return [torch.randn(s, generator=gen) * 1e-3 + 5e-4 for s in SHAPES]


def _norm(rank, world, stage):
    dims = ParallelDims.from_world()
    model = nn.Module()
    for i, s in enumerate(SHAPES):
        model.register_parameter(f"p{i}", nn.Parameter(torch.zeros(s)))
    optimizer, sync = build_optimizer([model], dims, TrainingConfig(clip_grad=0.0),
                                      ParallelConfig(zero_stage=stage))
    sync.start_step(1)
    for p, g in zip(model.parameters(), _grads()):
        p.grad = g / world  # every DP rank's share of the sum
        p.grad_ready_hook(p)
    sync.finish()
    return optimizer.step(1e-3)["grad_norm"]


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 0), (2, 1), (2, 2)])
def test_grad_norm_is_exact(world, stage):
    expected = math.sqrt(sum(g.double().pow(2).sum().item() for g in _grads()))
    norms = run_distributed(_norm, world, stage)
    for n in norms:  # identical on every rank, and exact
        assert abs(n - expected) <= 1e-9 * expected, f"{n!r} vs {expected!r}"
