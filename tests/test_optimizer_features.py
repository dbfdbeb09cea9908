"""Optimizer features of Megatron's launch scripts: --decoupled-lr on exactly the embedding and
output weights (against torch.optim.AdamW with two LR groups), low-precision optimizer state
(within tolerance of fp32 state; memory = theory), distributed-optimizer instances (= ZeRO-1)."""
import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.optim.distributed_optimizer import lr_group
from megatron_lite.optim.lr_scheduler import DECOUPLED_GROUP, DEFAULT_GROUP
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.optim.precision import OptimizerPrecision, StateStorage
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, assert_state_close, run_distributed
from megatron_lite.training.step import train_step
from models.gpt import build_model, gpt_forward_step
from test_zero import LR, MODEL, NORM, STEPS, assert_matches, full_params, make_batches, reference  # noqa: F401

UNTIED = dict(MODEL, untie_embeddings_and_output_weights=True)
DECOUPLED = {DEFAULT_GROUP: 2e-3, DECOUPLED_GROUP: 7e-3}


def _setup(stage, model=MODEL, dtype=torch.float32, precision=None, instances=1, clip=1.0, **pkw):
    dims = ParallelDims.from_world()
    cfg = ModelConfig(**model)
    chunks = build_model(cfg, dims, seed=5, params_dtype=dtype)
    tcfg = TrainingConfig(lr=LR, clip_grad=clip, bf16=dtype == torch.bfloat16)
    pcfg = ParallelConfig(zero_stage=stage, **pkw)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, pcfg, precision, instances)
    return dims, cfg, chunks, optimizer, sync


def _step(chunks, batches, dims, optimizer, sync, lr):
    """train_step of GPT's forward step, per-token loss, as test_zero's reference runs it."""
    return train_step(chunks, batches, dims, optimizer, sync, lr, gpt_forward_step, loss_normalizer=NORM)


# --- decoupled LR -----------------------------------------------------------------------------
def test_lr_groups_of_the_gpt_model():
    chunks = build_model(ModelConfig(**UNTIED), ParallelDims(), seed=5)
    decoupled = sorted(n for n, p in chunks[0].named_parameters() if lr_group(n, p) == DECOUPLED_GROUP)
    assert decoupled == ["embedding.word_embeddings.weight", "output_layer.weight"]  # not position embeddings


def _torch_adamw_reference(cfg, batches_of_step, lrs):
    """The same model trained by torch.optim.AdamW: embedding and output weights at the decoupled
    LR, 1-D params and biases without weight decay (Megatron's groups)."""
    model = build_model(cfg, ParallelDims(), seed=5)[0]
    groups = {}
    for n, p in model.named_parameters():
        wd = 0.0 if p.ndim == 1 or n.endswith(".bias") else 0.01
        groups.setdefault((lr_group(n, p), wd), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": lrs[g], "weight_decay": wd} for (g, wd), ps in groups.items()],
                            betas=(0.9, 0.999), eps=1e-8)
    for step in range(STEPS):
        batches = batches_of_step(step)
        tokens = sum(b["loss_mask"].sum() for b in batches)
        opt.zero_grad()
        for b in batches:
            output, loss_func = gpt_forward_step(b, model)
            (loss_func(output)[0] / tokens).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _decoupled_run(rank, world, stage):
    dims, cfg, chunks, optimizer, sync = _setup(stage, UNTIED, clip=0.0, ddp_bucket_size=3000)
    for step in range(STEPS):
        _step(chunks, make_batches(step, dims, 1, cfg.vocab_size), dims, optimizer, sync, DECOUPLED)
    ours = full_params(chunks, sync, dims)
    full_dp = ParallelDims()  # the reference sees the whole global batch
    ref = _torch_adamw_reference(cfg, lambda step: make_batches(step, full_dp, 1, cfg.vocab_size), DECOUPLED)
    return ours, ref


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 1)])
def test_decoupled_lr_equals_torch_adamw_with_two_groups(world, stage):
    """ZeRO-1 over 2 ranks with small buckets: shards cut through parameters and mix groups."""
    ours, ref = run_distributed(_decoupled_run, world, stage)[0]
    assert ours.keys() == ref.keys()
    for name in ref:
        # Adam turns the rounding differences of the two loss normalizations (sum / N vs sum / C
        # then x C / N) in tiny gradient elements into parameter differences of a few 1e-6.
        assert_close(ours[name], ref[name], rtol=2e-5, what=name)


def _which_params_move(rank, world, lrs):
    dims, cfg, chunks, optimizer, sync = _setup(1, UNTIED, ddp_bucket_size=3000)
    before = full_params(chunks, sync, dims)
    _step(chunks, make_batches(0, dims, 1, cfg.vocab_size), dims, optimizer, sync, lrs)
    after = full_params(chunks, sync, dims)
    return sorted(n for n in before if not torch.equal(before[n], after[n]))


def test_decoupled_lr_reaches_exactly_the_embedding_and_output_weights():
    moved = run_distributed(_which_params_move, 2, {DEFAULT_GROUP: 0.0, DECOUPLED_GROUP: 1e-2})[0]
    assert moved == ["embedding.word_embeddings.weight", "output_layer.weight"]
    still = run_distributed(_which_params_move, 2, {DEFAULT_GROUP: 1e-2, DECOUPLED_GROUP: 0.0})[0]
    assert "embedding.word_embeddings.weight" not in still and "output_layer.weight" not in still
    assert "embedding.position_embeddings.weight" in still and len(still) > 10


# --- low-precision optimizer state ---------------------------------------------------------------
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11),
                                        (torch.float8_e4m3fn, 2 ** -4)])
def test_state_storage_round_trip_keeps_relative_precision(dtype, rtol):
    """Scaled per segment, fp16 / fp8 keep tiny second moments (1e-12 underflows plain fp16 and
    fp8) to their mantissa's precision, over 3 decades (fp8 E4M3's normal range is 4.5)."""
    x = torch.cat([torch.logspace(-12, -9, 50), -torch.logspace(-3, 0, 50)])
    s = StateStorage(x, dtype, [(0, 50), (50, 100)])
    back = s.read_all()
    assert torch.all((back - x).abs() <= rtol * x.abs())
    assert s.nbytes == 100 * torch.empty(0, dtype=dtype).element_size() + (8 if dtype != torch.bfloat16 else 0)
    zeros = StateStorage(torch.zeros(10), torch.float16, [(0, 10)])
    assert torch.equal(zeros.read_all(), torch.zeros(10))


PRECISIONS = {
    "fp32": OptimizerPrecision(),
    "bf16 m, v": OptimizerPrecision(exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16),
    "fp16 m, v": OptimizerPrecision(exp_avg=torch.float16, exp_avg_sq=torch.float16),
    "fp16 main, bf16 m, v": OptimizerPrecision(main_params=torch.float16, exp_avg=torch.bfloat16,
                                              exp_avg_sq=torch.bfloat16),
    "fp8 m, bf16 v, bf16 grads": OptimizerPrecision(main_grads=torch.bfloat16, exp_avg=torch.float8_e4m3fn,
                                                    exp_avg_sq=torch.bfloat16),
}
BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}


def _precision_runs(rank, world):
    out = {}
    for what, precision in PRECISIONS.items():
        dims, cfg, chunks, optimizer, sync = _setup(1, dtype=torch.bfloat16, precision=precision, ddp_bucket_size=3000)
        psi = sum(b.numel for b in sync.buckets)  # every size is a multiple of 8: no padding
        segments = sum(len(b.shard_segments()) for b in sync.buckets)
        mem = optimizer.memory_bytes()
        losses = [_step(chunks, make_batches(step, dims, 1, cfg.vocab_size), dims, optimizer, sync, LR)["lm_loss"]
                  for step in range(STEPS)]
        out[what] = dict(losses=losses, mem=mem, psi=psi, segments=segments, params=full_params(chunks, sync, dims))
    return out


def test_low_precision_state_tracks_fp32_state_and_its_memory_is_theory():
    runs = run_distributed(_precision_runs, 2)[0]
    ref = runs["fp32"]
    for what, precision in PRECISIONS.items():
        r = runs[what]
        n = 2  # DP ranks: ZeRO-1 shards the states
        scaled = sum(d in (torch.float16, torch.float8_e4m3fn)
                     for d in (precision.main_params, precision.exp_avg, precision.exp_avg_sq))
        state = r["psi"] // n * (BYTES[precision.main_params] + BYTES[precision.exp_avg] + BYTES[precision.exp_avg_sq])
        assert r["mem"]["optimizer_state_bytes"] == state + 4 * r["segments"] * scaled, what
        assert r["mem"]["grad_bytes"] == r["psi"] * BYTES[precision.main_grads], what
        assert r["mem"]["param_bytes"] == r["psi"] * 2, what
        for a, b in zip(r["losses"], ref["losses"]):  # measured: within 3e-5 over the 5 steps
            assert abs(a - b) <= 2e-4 * b, f"{what}: loss {a} vs fp32 state {b}"
        # measured: 2e-3 to 5e-3 of each tensor's norm, 2e-2 with fp8 m (3 mantissa bits)
        assert_state_close(r["params"], ref["params"], rtol=5e-2 if "fp8" in what else 1e-2, what=what)


@pytest.mark.parametrize("flags,match", [
    (dict(exp_avg_dtype="bf16"), "needs --use-precision-aware-optimizer"),
    (dict(use_precision_aware_optimizer=True, distributed_optimizer=False), "distributed optimizer"),
    (dict(main_params_dtype="bf16", use_precision_aware_optimizer=True), "choose one of fp32, fp16"),
    (dict(main_grads_dtype="fp16", use_precision_aware_optimizer=True), "choose one of fp32, bf16"),
])
def test_precision_flag_rules(flags, match):
    from megatron_lite.errors import ConfigError
    args = dict(use_precision_aware_optimizer=False, main_params_dtype="fp32", main_grads_dtype="fp32",
                exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", distributed_optimizer=True)
    with pytest.raises(ConfigError, match=match):
        OptimizerPrecision.from_flags(**dict(args, **flags))
    assert OptimizerPrecision.from_flags(**dict(args, use_precision_aware_optimizer=True, exp_avg_dtype="fp8")) \
        .exp_avg == torch.float8_e4m3fn


# --- distributed-optimizer instances -------------------------------------------------------------
def _instances(rank, world, instances, stages, pkw):
    out = {}
    for stage in stages:
        dims, cfg, chunks, optimizer, sync = _setup(stage, instances=instances, **pkw)
        psi = sum(b.numel for b in sync.buckets)
        losses = [_step(chunks, make_batches(step, dims, 1, cfg.vocab_size), dims, optimizer, sync, LR)["lm_loss"]
                  for step in range(STEPS)]
        out[stage] = ((losses, full_params(chunks, sync, dims)),
                      dict(shard_ranks=sync.dp, replica_rank=sync.replica_rank, psi=psi,
                           state=optimizer.memory_bytes()["optimizer_state_bytes"]))
    return out


@pytest.mark.parametrize("instances,pkw", [(2, {}), (4, {}),
                                           (2, dict(overlap_grad_reduce=True, ddp_bucket_size=3000))])
def test_instances_equal_zero1_numerics(reference, instances, pkw):
    """4 DP ranks as 2 (or 4) optimizer instances: the same losses and parameters as one process."""
    results = run_distributed(_instances, 4, instances, [1, 2], pkw)
    for stage in (1, 2):
        assert_matches(results[0][stage][0], reference, f"{instances} instances zero-{stage}")
        for rank, r in enumerate(results):
            info = r[stage][1]
            per = 4 // instances
            assert (info["shard_ranks"], info["replica_rank"]) == (per, rank // per)
            assert info["state"] == 8 * info["psi"] // per  # fp32 params: m and v, sharded over one instance


# --- through the training loop's checkpoints -------------------------------------------------------
def test_checkpoint_resume_with_instances_and_low_precision_state(tmp_path):
    """4 ranks as 2 optimizer instances with fp16 main params and bf16 m, v: saved at 3 and resumed,
    the run continues as the uninterrupted one; the first instance alone writes each element once."""
    from test_checkpoint import assert_exact_coverage
    from training_utils import TINY, straight_and_resumed
    argv = TINY + ["--global-batch-size", "8", "--train-iters", "6", "--bf16", "--zero-stage", "1",
                   "--num-distributed-optimizer-instances", "2", "--use-precision-aware-optimizer",
                   "--main-params-dtype", "fp16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    straight, resumed = straight_and_resumed(argv, 4, tmp_path / "ckpt")
    assert resumed == pytest.approx(straight, rel=1e-6)
    assert_exact_coverage(str(tmp_path / "ckpt" / "iter_0000003"))
