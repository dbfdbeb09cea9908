"""The seam between where optimizer state lives and the rule that updates it: a second update rule
(SGD with momentum: one state, under its own name) plugs into the distributed optimizer; the device
and the host stores (--optimizer-offload-fraction 0.5 over several buckets) allocate its state, the
step moves each param shard by lr times that state, and checkpoints enumerate it by its name."""
import torch

from megatron_lite.checkpoint.plan import MODEL as STORED_MODEL, bucket_sources
from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.optim.distributed_optimizer import DistributedOptimizer
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import run_distributed
from models.gpt import build_model
from tests.test_zero import LR, MODEL, make_batches, run_step


class Momentum:
    """SGD with momentum 0.9 (no weight decay)."""
    state_names = ("momentum_buffer",)

    def update_(self, main, grad, states, *, step, lr, weight_decay, decay_ranges):
        buf = states["momentum_buffer"]
        buf.mul_(0.9).add_(grad)
        main.add_(buf, alpha=-lr)


def _first_step(rank, world):
    dims = ParallelDims.from_world()
    chunks = build_model(ModelConfig(**MODEL), dims, seed=5)
    tcfg = TrainingConfig(lr=LR, clip_grad=0.0, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    _, sync = build_optimizer(chunks, dims, tcfg, ParallelConfig(zero_stage=1, ddp_bucket_size=3000))
    optimizer = DistributedOptimizer(sync, tcfg, rule=Momentum())
    before = [s.bucket.param_shard_view().clone() for s in optimizer.shards]
    run_step(chunks, make_batches(0, dims, 1, MODEL["vocab_size"]), dims, optimizer, sync)
    return [(s.store.on_host, sorted(sources), p0 - s.bucket.param_shard_view(), sources["momentum_buffer"][0].clone())
            for s, p0, (_, sources) in zip(optimizer.shards, before, bucket_sources(optimizer))]


def test_a_second_rule_plugs_into_both_stores_and_checkpoints():
    shards = run_distributed(_first_step, 2)[0]
    assert {on_host for on_host, *_ in shards} == {True, False}, "several buckets, some on each side"
    for on_host, kinds, moved, buf in shards:
        # the host store keeps a copy of the fp32 params as 'main'; the device store updates them in place
        assert kinds == sorted([STORED_MODEL, "momentum_buffer"] + (["main"] if on_host else []))
        assert (LR * buf).abs().max() > 1e-5
        # first step: the buffer is the gradient; atol: the rounding of params near 1 (norm weights)
        torch.testing.assert_close(moved, LR * buf, rtol=1e-3, atol=torch.finfo(torch.float32).eps)
