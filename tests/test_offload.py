"""Optimizer CPU offload (--optimizer-cpu-offload, --optimizer-offload-fraction): the same run as
without it (fp32 on CPU: losses, grad norms and final parameters within 1e-6), composed with
ZeRO-1/2/3 and with a partial fraction over several buckets; the main params, m and v really are
separate host copies (on this CPU-only machine host and device are both the CPU, so the copies
and the host-side Adam are what is exercised), and the accounting moves their bytes to the host."""
import pytest

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, assert_same_run, run_distributed
from models.gpt import build_model
from tests.test_zero import LR, MODEL, full_params, make_batches, run_step

STEPS = 3


def _both(rank, world, stage, fraction, bucket_size):
    """The device run and the offloaded one, one after the other in the same world."""
    return _run(stage, False, 1.0, bucket_size), _run(stage, True, fraction, bucket_size)


def _run(stage, offload, fraction, bucket_size):
    dims = ParallelDims.from_world()
    chunks = build_model(ModelConfig(**MODEL), dims, seed=5)
    tcfg = TrainingConfig(lr=LR, clip_grad=1.0, optimizer_cpu_offload=offload, optimizer_offload_fraction=fraction)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, ParallelConfig(zero_stage=stage, ddp_bucket_size=bucket_size))
    records = []
    for step in range(STEPS):
        out = run_step(chunks, make_batches(step, dims, 1, MODEL["vocab_size"]), dims, optimizer, sync)
        records.append({"lm_loss": out["lm_loss"], "grad_norm": out["grad_norm"]})
    host = [s.store.on_host for s in optimizer.shards]
    separate = all(s.store.tensors["main"].data_ptr() != s.bucket.param_shard_view().data_ptr()
                   for s in optimizer.shards if s.store.on_host)
    return records, full_params(chunks, sync, dims), optimizer.memory_bytes(), optimizer.held_bytes(), host, separate


@pytest.mark.parametrize("stage,fraction,bucket_size", [(1, 1.0, None), (2, 1.0, 3000), (3, 1.0, None),
                                                        (1, 0.5, 3000)])
def test_offloaded_optimizer_equals_the_device_one(stage, fraction, bucket_size):
    ref, got = run_distributed(_both, 2, stage, fraction, bucket_size)[0]
    what = f"zero-{stage} offload {fraction}"
    assert_same_run(ref[0], got[0], rtol=1e-6, what=what)
    for name in ref[1]:
        assert_close(got[1][name], ref[1][name], rtol=1e-6, atol=0.0, what=f"{what}: {name}")
    mem, held, host, separate = got[2], got[3], got[4], got[5]
    assert mem == held, f"{what}: accounting {mem} vs measured {held}"
    assert separate, "offloaded main params must be a host copy, not the param shard"
    if fraction == 1.0:
        assert all(host) and mem["optimizer_state_bytes"] == 0
    else:
        assert any(host) and not all(host), host  # several buckets, some on each side
    state = ref[2]["optimizer_state_bytes"]  # fp32 params: m and v only, 8 bytes per shard element
    moved = mem["optimizer_host_bytes"]
    assert moved == 2 * (state - mem["optimizer_state_bytes"]), (moved, state)  # + main params + grad staging
