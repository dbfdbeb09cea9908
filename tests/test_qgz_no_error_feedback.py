"""qgZ without error feedback (the default, DeepSpeed's qgZ; --zeropp-qgz-error-feedback adds it): each reduced
gradient within int4's rounding of the fp32 reduce-scatter's and independent of the steps before
(a step's gradients reduced again give the same values, bitwise), the same bytes on the wire as with error
feedback, no error tensor held at either hop, an idle bucket reduced to exact zeros, and the
checkpoint contract: no residual written; one loaded (written with error feedback) applied once."""
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.compression import CompressedReducer, ErrorFeedbackExchange, node_hops
from megatron_lite.parallel.compression import codec as make_codec
from megatron_lite.parallel.state import ParallelDims, group_rank
from megatron_lite.testing import run_distributed
from models.gpt import build_model
from test_compression import STEP_TOLERANCE, STEPS
from test_qgz_two_hops import zero3_reduce_steps
from test_zero import MODEL, make_batches
from training_utils import TINY, losses_of, reduce_step, train_in_process

INT4 = make_codec("int4-blocks")


def _idle_steps(dims, reducer, hops, world, rank):
    """A 2-block-per-rank bucket: a gradient of 1e-3, then denormals, then zeros. Its reduced shards."""
    numel = world * 2 * INT4.align
    out = torch.zeros(numel // world)
    group = hops.group if hops is not None else dims.dp_cp_group
    b = SimpleNamespace(index=99, group=group, group_size=world, group_rank=group_rank(group), sharded=True,
                        numel=numel, grad_data=None, replica_group=None, reduce_out=lambda: out)
    gen, shards = torch.Generator().manual_seed(rank), []
    for scale in (1e-3, 1e-44, 0.0):
        b.grad_data = torch.randn(numel, generator=gen) * scale
        reducer.start(b).wait()
        shards.append(out.clone())
    return shards


def _reduce_steps(rank, world, node):
    """Per reducer (plain, qgZ with error feedback, without) in `node`-rank nodes: every step's
    reduced shards and bytes, the error tensors it holds after; the idle bucket's shards without."""
    out = {}
    for name in ("plain", "ef", "no-ef"):
        dims, chunks, sync, shards, volume = zero3_reduce_steps(
            lambda dims: None if name == "plain" else CompressedReducer(dims.comm, "int4-blocks", node_hops(dims, node),
                                                                        error_feedback=name == "ef"))
        reducer = None if name == "plain" else sync.reducer
        held = (None if reducer is None else
                sum(len(s) for s in (reducer.exchange.worker, reducer.exchange.server, reducer.node_error)))
        reduce_step(sync, chunks, make_batches(0, dims, 1, MODEL["vocab_size"]))  # step 0's gradients again
        again = [b.grad_shard_view().clone() for b in sync.buckets]
        out[name] = shards, volume, held, again
        if name == "no-ef":
            out["idle"] = _idle_steps(dims, reducer, reducer.hops, world, rank)
            out["idle_held"] = len(reducer.exchange.worker) + len(reducer.node_error)
    return out


def _check_reductions(runs, world, node):
    for run in runs:
        exact, plain_volume, _, _ = run["plain"]
        _, ef_volume, ef_held, ef_again = run["ef"]
        got, volume, held, again = run["no-ef"]
        for step in range(STEPS):
            for e, g in zip(exact[step], got[step]):
                assert torch.all((g - e).abs() <= STEP_TOLERANCE["int4-blocks"] * world * e.abs().max() + 1e-12)
            assert any(v.startswith("all_to_all") for v in volume[step]) and "reduce_scatter" not in volume[step]
        assert volume == ef_volume and plain_volume[0]["reduce_scatter"] > 0  # same wire format, same bytes
        assert ("all_to_all_inter_node" in volume[0]) == (node < world)  # (two hops where nodes are smaller)
        # the same gradients reduce to the same values whatever came before (with EF: its errors join)
        assert all(torch.equal(a, b) for a, b in zip(again, got[0]))
        assert any(not torch.equal(a, b) for a, b in zip(ef_again, run["ef"][0][0]))
        assert held == 0 and run["idle_held"] == 0 and ef_held > 0
        first, denormal, zero = run["idle"]
        assert first.abs().max() > 0 and all(torch.isfinite(s).all() for s in run["idle"])
        assert denormal.abs().max() < 1e-40 and not zero.any()  # nothing left over to drain


def test_no_error_feedback_reduces_like_fp32_in_one_and_two_hops_with_the_same_bytes_and_no_errors():
    """DP4 ZeRO-3, one hop (one node of 4) and two hops (nodes of 2), in one world."""
    world = 4
    for node in (world, 2):
        _check_reductions(run_distributed(_reduce_steps, world, node, timeout=180), world, node)


def test_the_exchange_without_error_feedback_encodes_as_is_and_keeps_nothing():
    """The rows sent are the int4 round trip of the input alone (finite for denormals, zeros for zeros)."""
    ex = ErrorFeedbackExchange(None, "int4-blocks", error_feedback=False)
    x = torch.cat([torch.randn(3 * INT4.align), torch.full((INT4.align,), 1e-44), torch.zeros(INT4.align)])
    for _ in range(2):  # (twice: a kept error would change the second)
        payload, n = ex.encode_rows(0, x, 2)
        assert torch.equal(INT4.decode(payload, n), INT4.encode(ex.to_rows(x, 2))[1]) and not ex.worker
    assert torch.isfinite(INT4.decode(payload, n)).all()


def _checkpointed_states(rank, world, error_feedback):
    dims = ParallelDims.from_world()
    chunks = build_model(ModelConfig(**MODEL), dims, seed=5)
    optimizer, _ = build_optimizer(chunks, dims, TrainingConfig(lr=1e-3), ParallelConfig(
        zero_stage=3, zeropp_quantized_gradients=True, zeropp_qgz_error_feedback=error_feedback))
    return [sorted({k for _, t in optimizer.shard_tensors(for_loading=loading) for k in t}) for loading in (0, 1)]


def test_checkpoints_of_a_run_without_error_feedback_hold_no_residual_but_load_one():
    """Saving lists no grad_residual without error feedback; loading still takes one (applied once)."""
    assert run_distributed(_checkpointed_states, 1, False)[0] == [["exp_avg", "exp_avg_sq"],
                                                                 ["exp_avg", "exp_avg_sq", "grad_residual"]]
    assert run_distributed(_checkpointed_states, 1, True)[0] == [["exp_avg", "exp_avg_sq", "grad_residual"]] * 2


def _residual_then_steps(rank, world, argv):
    """After a checkpoint load: this rank's pending residuals (summed |.|), and after a step's reduction
    whether any is left; the losses of the run."""
    import os
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    trainer = make_trainer(*resolve(argv), torch.device("cpu"))
    reducer = trainer.grad_sync.reducer
    pending = sum(r.abs().sum().item() for r in reducer.residual.values())
    history = trainer.train()
    return pending, len(reducer.residual), history


@pytest.mark.slow  # (three DP2 runs: ~15 s here; the save / load lists are in the default cell above)
def test_checkpoints_cross_between_runs_with_and_without_error_feedback(tmp_path):
    """DP2 ZeRO-3 qgZ: a checkpoint written with error feedback loads into a run without it, whose
    first step applies its residual once (none pending after); that run's checkpoint has no
    grad_residual and loads into a run with error feedback (zeros: nothing pending)."""
    from megatron_lite.checkpoint.offline import open_checkpoint
    argv, ef = TINY + ["--zero-stage", "3", "--zeropp-quantized-gradients"], ["--zeropp-qgz-error-feedback"]
    losses_of(run_distributed(train_in_process, 2, argv + ef + ["--train-iters", "3", "--save", str(tmp_path / "ef")],
                              timeout=240))
    runs = run_distributed(_residual_then_steps, 2, argv + ["--train-iters", "5", "--load", str(tmp_path / "ef"),
                                                            "--save", str(tmp_path / "no-ef")], timeout=240)
    assert all(pending > 0 and left == 0 for pending, left, _ in runs)
    with open_checkpoint(str(tmp_path / "no-ef"), 5) as reader:
        assert reader.pieces and not [k for k in reader.pieces if k.endswith("/grad_residual")]
    back = run_distributed(_residual_then_steps, 2, argv + ef + ["--train-iters", "7", "--load",
                                                                 str(tmp_path / "no-ef")], timeout=240)
    assert all(pending == 0 and left == 0 for pending, left, _ in back)
    assert all(torch.isfinite(torch.tensor(r["lm_loss"])).all() for _, _, h in back for r in h if r["lm_loss"])
