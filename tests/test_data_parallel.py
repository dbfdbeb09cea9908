"""GradientSync mechanics: bucket layout, when reductions start, the deferred (zero-bubble)
weight-gradient path, unused parameters, a pluggable bucket reducer, config checks, and the
command line end to end."""
import pytest
import torch
import torch.nn as nn

from megatron_lite.arguments import parse_args
from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.data_parallel import GradientSync, PlainReducer
from megatron_lite.parallel.gemm import GemmPath
from megatron_lite.parallel.state import ParallelDims, partial_dp_groups
from megatron_lite.testing import assert_close, assert_same_run, run_distributed
from megatron_lite.training.step import LossTotals
from models.gpt import build_model, gpt_forward_step
from models.zoo import zoo
from test_zero import LR, MODEL, SEQ, make_batches, run_step, setup
from training_utils import (merged_params, read_metrics, records_of, reduce_step, torchrun, train_and_gather,
                            train_in_process)


def _layout(rank, world):
    dims, cfg, chunks, optimizer, sync, psi = setup(1, 1, torch.bfloat16, ddp_bucket_size=3000)
    flat = sync.buckets[0].param_data._base
    out = {"psi": psi, "numels": [b.numel for b in sync.buckets], "dp": sync.dp,
           "order": [n for b in sync.buckets for n in b.names],
           "registration": [n for n, _ in chunks[0].named_parameters()],
           "views": all(p.data_ptr() - flat.data_ptr() in range(flat.numel() * 2) for p in sync.params),
           "grad_views": all(p.main_grad.dtype == torch.float32 for p in sync.params)}
    covered = []
    for b in sync.buckets:
        covered.append(sum(hi - lo for _, lo, hi in b.shard_segments()))
        assert all(hi - lo > 0 for _, lo, hi in b.shard_segments())
    out["covered"] = covered
    out["param_elements"] = [sum(p.numel() for p in b.params) for b in sync.buckets]
    return out


def test_buckets_are_views_of_one_buffer_in_backward_order_and_shard_evenly():
    results = run_distributed(_layout, 2)
    r = results[0]
    assert len(r["numels"]) > 2 and all(n % r["dp"] == 0 for n in r["numels"])
    assert sum(r["numels"]) >= r["psi"] and r["order"] == r["registration"][::-1]
    assert r["views"] and r["grad_views"]
    # The two ranks' shards of each bucket together hold every parameter element exactly once.
    assert [a + b for a, b in zip(results[0]["covered"], results[1]["covered"])] == r["param_elements"]


def _launch_timing(rank, world, stage, overlap, once=False):
    dims, cfg, chunks, optimizer, sync, _ = setup(1, stage, ddp_bucket_size=3000, overlap_grad_reduce=overlap,
                                                  grad_reduce_once_per_step=once)
    seen = []

    def recording(chunks_, batches, forward_step, loss_weight, forward_only=False):
        totals = LossTotals(torch.device("cpu"))
        for batch in batches:  # one micro-batch at a time, noting what was launched after each
            output, loss_func = forward_step(batch, chunks_[0])
            loss_sum, tokens, logs = loss_func(output)
            loss_weight(loss_sum, tokens).backward()
            totals.add(loss_sum, tokens, logs)
            seen.append([b.rounds for b in sync.buckets])
        return totals

    run_step(chunks, make_batches(0, dims, 1, cfg.vocab_size, global_batch=2 * world), dims, optimizer, sync,
             recording)
    return seen


@pytest.mark.parametrize("stage,once", [(0, False), (2, True), (3, True)])
def test_reductions_start_during_the_last_micro_batch_backward_only(stage, once):
    """Once per step (stages 0-1; 2-3 with --grad-reduce-once-per-step)."""
    first, last = run_distributed(_launch_timing, 2, stage, True, once)[0]
    assert not any(first), "a bucket was reduced before the last micro-batch"
    assert all(last) and len(last) > 1, "with --overlap-grad-reduce every bucket starts during backward"
    first, last = run_distributed(_launch_timing, 2, stage, False, once)[0]
    assert not any(first) and not any(last), "without overlap nothing starts before finish()"


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_gradients_reduce_every_bucket_in_every_micro_batch(stage):
    """Stages 2-3 by default: each micro-batch's backward reduces every bucket (with or without
    overlap), and no full gradient buffer is left once it is over."""
    for overlap in (True, False):
        first, last = run_distributed(_launch_timing, 2, stage, overlap)[0]
        assert len(first) > 1 and first == [1] * len(first) and last == [2] * len(last), (overlap, first, last)


def _deferred_weight_grads(rank, world, stage, defer):
    """Weight gradients computed outside autograd (zero-bubble W pass) reach the buckets too.
    (Untied output layer: a tied one would get two gradients per micro-batch, one per path.)"""
    untied = dict(MODEL, untie_embeddings_and_output_weights=True)
    store = GemmPath(deferrable=True)
    dims, cfg, chunks, optimizer, sync, _ = setup(1, stage, model=untied, overlap_grad_reduce=True,
                                                  gemm=store)
    batches = make_batches(0, dims, 1, cfg.vocab_size)
    denom = sum(b["loss_mask"].sum() for b in batches) * world
    sync.start_step(len(batches))
    for batch in batches:
        store.deferring = defer
        try:
            output, loss_func = gpt_forward_step(batch, chunks[0])
            (loss_func(output)[0] / denom).backward()
        finally:
            store.deferring = False
        store.flush()
    sync.finish()
    return [b.grad_shard_view().clone() for b in sync.buckets]


@pytest.mark.parametrize("stage", [1, 2])
def test_deferred_weight_gradients_are_reduced_like_autograd_ones(stage):
    direct = run_distributed(_deferred_weight_grads, 2, stage, False)
    deferred = run_distributed(_deferred_weight_grads, 2, stage, True)
    for rank in range(2):
        for a, b in zip(deferred[rank], direct[rank]):
            assert_close(a, b, rtol=1e-6, what=f"rank {rank} reduced gradient shard")


def _unused(rank, world, stage):
    dims = ParallelDims.from_world()
    cfg = ModelConfig(**MODEL)
    chunks = build_model(cfg, dims, seed=5)
    chunks[0].unused = nn.Parameter(torch.ones(8))  # never touched by forward
    pcfg = ParallelConfig(zero_stage=stage, overlap_grad_reduce=True, ddp_bucket_size=3000)
    optimizer, sync = build_optimizer(chunks, dims, TrainingConfig(lr=LR), pcfg)
    out = [run_step(chunks, make_batches(s, dims, 1, cfg.vocab_size), dims, optimizer, sync)["lm_loss"]
           for s in range(2)]
    with sync.gathered_params():
        out.append(chunks[0].unused.detach().clone())
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_without_gradient_do_not_hang_the_step(stage):
    for losses_and_param in run_distributed(_unused, 2, stage):
        assert torch.equal(losses_and_param[-1], torch.ones(8))


class RecordingReducer:
    """A reducer plugged into GradientSync: notes each call, then reduces as the plain one does."""

    def __init__(self, comm):
        self.plain, self.calls = PlainReducer(comm), []

    def start(self, bucket):
        self.calls.append(("start", bucket.index))
        return self.plain.start(bucket)

    def finish(self, bucket):
        self.calls.append(("finish", bucket.index))
        self.plain.finish(bucket)


def _reduced_grads(rank, world, stage, overlap, instances):
    """Per reducer (the default, then a RecordingReducer): each of 2 steps' reduced gradient
    shards, and the recording's calls per step."""
    out = {}
    for name in ("default", "recording"):
        dims = ParallelDims.from_world()
        cfg = ModelConfig(**MODEL)
        chunks = build_model(cfg, dims, seed=5)
        reducer = RecordingReducer(dims.comm) if name == "recording" else None
        sync = GradientSync(chunks, dims, zero_stage=stage, bucket_size=3000, overlap_grad_reduce=overlap,
                            units=[c.sharding_units() for c in chunks], reducer=reducer,
                            dp_groups=partial_dp_groups(dims, instances) if instances > 1 else None)
        shards, calls = [], []
        for step in range(2):
            batches = make_batches(step, dims, 1, cfg.vocab_size)
            reduce_step(sync, chunks, batches)
            shards.append([b.grad_shard_view().clone() for b in sync.buckets])
            sync.zero_grad()
            if reducer is not None:
                calls.append(reducer.calls)
                reducer.calls = []
        out[name] = (shards, calls, len(sync.buckets))
    return out


@pytest.mark.parametrize("stage,overlap,instances,world", [
    (0, False, 1, 2), (1, True, 1, 2), (2, True, 1, 2), (2, False, 1, 2), (3, True, 1, 2), (1, False, 2, 4)])
def test_a_plugged_in_reducer_sees_every_bucket_once_per_round(stage, overlap, instances, world):
    """Each bucket is started once per step (stages 0-1) or once per micro-batch (2-3: 4 here),
    and finished once per step, after its last start."""
    rounds = 4 if stage >= 2 else 1
    for rank, run in enumerate(run_distributed(_reduced_grads, world, stage, overlap, instances)):
        shards, calls, n = run["recording"]
        assert n > 2
        for step_calls in calls:
            assert sorted(step_calls) == sorted([("start", i) for i in range(n)] * rounds
                                                + [("finish", i) for i in range(n)])
            assert all(len(step_calls) - step_calls[::-1].index(("start", i)) - 1 < step_calls.index(("finish", i))
                       for i in range(n))
        for step, (got, plain) in enumerate(zip(shards, run["default"][0])):
            assert all(torch.equal(a, b) for a, b in zip(got, plain)), f"rank {rank} step {step}"

def test_config_rules():
    model = ModelConfig(**MODEL)
    with pytest.raises(ConfigError, match="--no-reshard-after-forward applies to --zero-stage 3"):
        ParallelConfig(zero_stage=2, reshard_after_forward=False).validate(2, model, SEQ)
    ParallelConfig(pipeline_model_parallel_size=2, zero_stage=3).validate(4, model, SEQ)
    with pytest.raises(ConfigError, match="overlap-param-gather"):
        ParallelConfig(overlap_param_gather=True).validate(2, model, SEQ)
    ParallelConfig(pipeline_model_parallel_size=2, zero_stage=2).validate(4, model, SEQ)
    assert parse_args(["--use-distributed-optimizer"], zoo()).parallel.zero_stage == 1
    assert parse_args(["--zero-stage", "3"], zoo()).parallel.zero_stage == 3


# --- end to end ------------------------------------------------------------------------------
CLI = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
       "--log-comm-volume"]


def test_cli_zero3_on_4_ranks_and_zero1_with_tp2_on_8_ranks(tmp_path):
    """The issue's command line (torchrun, 4 ranks, ZeRO-3); then TP2 x DP4 with the distributed
    optimizer (forked ranks running the same Trainer) must give the same losses."""
    proc = torchrun(4, CLI + ["--zero-stage", "3"], tmp_path / "z3.jsonl")
    assert "optimizer_state_bytes" in proc.stdout and "zero stage 3" in proc.stdout
    z3 = read_metrics(tmp_path / "z3.jsonl")
    first = z3[0]
    n, micro_batches = 4, 2
    psi = first["param_bytes"] * n // 4  # fp32 params: param_bytes = 4 Psi / N
    assert first["grad_bytes"] == first["param_bytes"] and first["optimizer_state_bytes"] == 2 * first["param_bytes"]
    assert len(z3) == 5 and "param_bytes" not in z3[1]
    for rec in z3:
        assert rec["comm_bytes"]["all_gather"] == 2 * micro_batches * 4 * psi
        # ZeRO-3 reduce-scatters every micro-batch's gradients
        assert rec["comm_bytes"]["reduce_scatter"] == micro_batches * 4 * psi and not rec["skipped"]
    argv = CLI + ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--eval-iters", "0"]
    z1 = run_distributed(train_in_process, 8, argv)  # same seed and global batch, whatever the layout
    assert_same_run(z3, records_of(z1), rtol=1e-5, grad_norm_rtol=1e-6)


PP_ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--lr", "3e-3", "--eval-iters", "0", "--disable-bias-linear"]  # no key bias: see test_zero.MODEL
ZERO_OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "5000"]


@pytest.mark.parametrize("stage,schedule", [
    ("2", ["--pipeline-schedule", "zb-h1"]), ("1", ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("2", ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("3", ["--num-layers-per-virtual-pipeline-stage", "1", "--recompute-granularity", "full"]),
    pytest.param("2", ["--pipeline-schedule", "1f1b", "--grad-reduce-once-per-step"], marks=pytest.mark.slow),
    pytest.param("3", ["--pipeline-schedule", "1f1b"], marks=pytest.mark.slow),
    pytest.param("3", ["--pipeline-schedule", "zb-h1"], marks=pytest.mark.slow),
    pytest.param("3", ["--num-layers-per-virtual-pipeline-stage", "1", "--no-reshard-after-forward"],
                 marks=pytest.mark.slow)])
def test_zero_with_pipeline_and_data_parallel_matches_single_process(stage, schedule):
    """PP2 x DP2: several chunks per rank (interleaved), deferred weight gradients (zb-h1) and the
    tied embedding summed across stages before its DP reduce-scatter. ZeRO-2 reduce-scatters each
    micro-batch's buckets as they complete (zb-h1: a later micro-batch's B may bring some of a
    bucket's gradients before an earlier one's W brings the rest), or once per step. ZeRO-3 gathers
    each chunk's units per use (zb-h1's W finds them freed: the weight gradient goes straight into
    the buffers), with recomputation, or keeps them through the step."""
    ref = run_distributed(train_and_gather, 1, PP_ARGV)
    argv = PP_ARGV + ["--pipeline-model-parallel-size", "2", "--zero-stage", stage] + ZERO_OVERLAP + schedule
    results = run_distributed(train_and_gather, 4, argv)
    assert_same_run(records_of([r[0] for r in ref]), records_of([r[0] for r in results]), grad_norm_rtol=1e-6,
                    params=merged_params(results), ref_params=merged_params(ref))
