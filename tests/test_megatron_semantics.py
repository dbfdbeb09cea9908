"""Megatron-LM's training semantics, each against its definition and across layouts:

- loss normalization: the default mean of micro-batch token means (the gradient of exactly that
  objective, torch.optim.AdamW on it as the oracle) and --calculate-per-token-loss, each exact
  over TP / PP / DP / CP and different from each other when micro-batches hold different numbers
  of loss-bearing tokens;
- schedules by samples equal the schedules by iterations where the two coincide (also WSD);
- --rampup-batch-size: the global batch of every step as Megatron computes it, the same run at
  DP 1 and 2, and a run resumed mid-ramp equal to the uninterrupted one;
- --moe-layer-recompute changes nothing but memory; --use-megatron-fsdp maps onto ZeRO stages.
"""
import numpy as np
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.errors import ConfigError
from megatron_lite.testing import assert_same_run, assert_state_close, run_distributed
from models.zoo import zoo
from training_utils import TINY, records_of, train_in_process

STEPS = 3


# --- loss normalization: the definition ---------------------------------------------------------
def _objective_runs(rank, world, per_token):
    """(our parameters after STEPS updates, torch.optim.AdamW's on the objective written out)."""
    from megatron_lite.optim.optimizer import build_optimizer
    from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
    from megatron_lite.parallel.state import ParallelDims
    from megatron_lite.training.step import train_step
    from models.gpt import build_model, gpt_forward_step
    from test_zero import MODEL, NORM, full_params, make_batches

    dims = ParallelDims.from_world()
    cfg = ModelConfig(**MODEL)
    chunks = build_model(cfg, dims, seed=5)
    optimizer, sync = build_optimizer(chunks, dims, TrainingConfig(lr=3e-3, clip_grad=0.0), ParallelConfig())
    ref = build_model(cfg, ParallelDims(), seed=5)[0]
    groups = {}
    for n, p in ref.named_parameters():
        groups.setdefault(0.0 if p.ndim == 1 or n.endswith(".bias") else 0.01, []).append(p)
    adamw = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()], lr=3e-3)
    for step in range(STEPS):
        batches = make_batches(step, dims, 2, cfg.vocab_size)  # 4 micro-batches of 2 samples
        train_step(chunks, batches, dims, optimizer, sync, 3e-3, gpt_forward_step, loss_normalizer=NORM,
                   per_token_loss=per_token)
        adamw.zero_grad()
        sums = []
        for b in batches:
            out, loss_func = gpt_forward_step(b, ref)
            sums.append(loss_func(out)[:2])
        if per_token:
            loss = sum(s for s, _ in sums) / sum(n for _, n in sums)
        else:  # Megatron's default: the mean over micro-batches of each one's token mean
            loss = sum(s / n for s, n in sums) / len(sums)
        loss.backward()
        adamw.step()
    return full_params(chunks, sync, dims), {n: p.detach() for n, p in ref.named_parameters()}


def test_loss_modes_are_the_gradients_of_their_objectives():
    (mb, mb_ref), (tok, tok_ref) = (run_distributed(_objective_runs, 1, per_token)[0] for per_token in (False, True))
    assert_state_close(mb, mb_ref, rtol=2e-5, what="per micro-batch")
    assert_state_close(tok, tok_ref, rtol=2e-5, what="per token")
    # ... and the two objectives move the weights apart far beyond that tolerance
    apart = sum((mb[n] - tok[n]).norm() ** 2 for n in mb) ** 0.5 / sum(p.norm() ** 2 for p in tok.values()) ** 0.5
    assert apart > 1e-3


# --- loss normalization: every layout ---------------------------------------------------------
@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Documents of 3-40 tokens: with --eod-mask-loss the micro-batches hold different numbers of
    loss-bearing tokens, so the two normalizations differ."""
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path_factory.mktemp("short_docs") / "docs")
    rng = np.random.default_rng(0)
    w = IndexedDatasetWriter(prefix)
    for _ in range(400):
        n = int(rng.integers(3, 40))
        w.add_document(np.append(rng.integers(0, 256, n), 256))  # byte tokens, then EOD (256)
    w.finalize()
    return prefix


LOSS_BASE = TINY + ["--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
                    "--train-iters", "3", "--eod-mask-loss", "--split", "1,0,0", "--normalization", "RMSNorm",
                    "--position-embedding-type", "rope", "--disable-bias-linear"]
LOSS_LAYOUTS = {"tp2": (2, ["--tensor-model-parallel-size", "2"]),
                "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
                "dp2": (2, []),
                "cp2": (2, ["--context-parallel-size", "2"]),
                "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])}
MODES = {"per-microbatch": [], "per-token": ["--calculate-per-token-loss"]}
_REFS = {}


def _single_process(argv):
    key = tuple(argv)
    if key not in _REFS:
        _REFS[key] = records_of(run_distributed(train_in_process, 1, argv))
    return _REFS[key]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layout", sorted(LOSS_LAYOUTS))
def test_each_loss_mode_is_exact_across_layouts(short_docs, mode, layout):
    world, extra = LOSS_LAYOUTS[layout]
    base = LOSS_BASE + ["--data-path", short_docs]
    reference = _single_process(base + MODES[mode])
    other_mode = _single_process(base + MODES["per-token" if mode == "per-microbatch" else "per-microbatch"])
    # The two objectives differ on these batches: a test that could not tell them apart proves nothing.
    assert abs(reference[0]["grad_norm"] - other_mode[0]["grad_norm"]) > 1e-4 * reference[0]["grad_norm"]
    assert_same_run(reference, records_of(run_distributed(train_in_process, world, base + MODES[mode] + extra)),
                    rtol=1e-5, grad_norm_rtol=1e-6, what=f"{mode} {layout}")


# --- schedules by samples ---------------------------------------------------------------------
NO_LENGTH = [a for i, a in enumerate(TINY) if "--train-iters" not in TINY[max(0, i - 1):i + 1]]
SCHED = NO_LENGTH + ["--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "3e-3", "--min-lr", "3e-4"]


@pytest.mark.parametrize("by_iters,by_samples", [
    (["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5", "--lr-decay-style", "cosine"],
     ["--train-samples", "24", "--lr-warmup-samples", "8", "--lr-decay-samples", "20", "--lr-decay-style", "cosine"]),
    (["--train-iters", "6", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3", "--lr-wsd-decay-style", "linear",
      "--lr-warmup-init", "1e-4", "--lr-warmup-iters", "1"],
     ["--train-samples", "24", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "12", "--lr-wsd-decay-style",
      "linear", "--lr-warmup-init", "1e-4", "--lr-warmup-samples", "4"]),
], ids=["cosine", "wsd"])
def test_schedule_by_samples_equals_schedule_by_iterations(by_iters, by_samples):
    a = records_of(run_distributed(train_in_process, 1, SCHED + by_iters))
    b = records_of(run_distributed(train_in_process, 1, SCHED + by_samples))
    assert [r["lr"] for r in a] == pytest.approx([r["lr"] for r in b], rel=1e-12)
    assert len(set(round(r["lr"], 12) for r in a)) >= 4  # the schedule moves
    assert_same_run(a, b, rtol=1e-7)


def test_flag_mode_rules():
    for argv, match in ((["--train-iters", "5", "--train-samples", "20"], "exclusive"),
                        (["--train-samples", "20", "--lr-decay-iters", "3"], "--lr-\\*-samples"),
                        (["--train-iters", "5", "--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
                        (["--train-iters", "5", "--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "exclusive")):
        from pretrain_gpt import resolve
        with pytest.raises(ConfigError, match=match):
            resolve(NO_LENGTH + argv)


# --- batch-size ramp-up -----------------------------------------------------------------------
RAMP_BATCH = ["--micro-batch-size", "1", "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8"]
RAMP = NO_LENGTH + RAMP_BATCH + ["--train-samples", "40", "--lr-warmup-samples", "4"]


def test_rampup_batch_sizes_data_and_resume(tmp_path):
    """START 2, INCR 2 over 8 samples to 6: one increment per 4 samples, by the samples consumed
    before each step: 0 2 -> 2; 4 -> 4; 8 -> 6 (8 is not > 8: int(8/4) = 2 increments); 14 on -> 6;
    then (40 - 14) // 6 = 4 full steps after the ramp's 4. DP 2 trains the same run; a run stopped
    mid-ramp and resumed continues it exactly."""
    straight = records_of(run_distributed(train_in_process, 1, RAMP))
    assert [r["global_batch_size"] for r in straight] == [2, 2, 4, 6, 6, 6, 6, 6]
    assert [r["consumed_samples"] for r in straight] == [2, 4, 8, 14, 20, 26, 32, 38]
    assert_same_run(straight, records_of(run_distributed(train_in_process, 2, RAMP)), rtol=1e-5, grad_norm_rtol=1e-6,
                    what="ramp-up at DP 2")
    ckpt = str(tmp_path / "ckpt")
    first = records_of(run_distributed(train_in_process, 2, RAMP + ["--save", ckpt, "--exit-interval", "2"]))
    second = records_of(run_distributed(train_in_process, 2, RAMP + ["--save", ckpt, "--load", ckpt]))
    assert len(first) == 2 and [r["global_batch_size"] for r in second] == [4, 6, 6, 6, 6, 6]
    assert_same_run(straight, first + second, rtol=1e-6, what="resumed mid-ramp")


def test_rampup_by_iterations_is_refused_as_in_megatron(monkeypatch, capsys):
    """Megatron-LM asserts 'expected no batch-size rampup for iteration-based training': one line, exit 2."""
    import pretrain_gpt

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_gpt.main(NO_LENGTH + RAMP_BATCH + ["--train-iters", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --rampup-batch-size with --train-iters: Megatron-LM expects no batch-size rampup for "
                   "iteration-based training; give the length with --train-samples instead"), err


# --- flags that map onto what exists ------------------------------------------------------------
MOE = TINY + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--train-iters", "3",
              "--global-batch-size", "4", "--micro-batch-size", "1"]


@pytest.mark.parametrize("world,extra", [(1, []), (2, ["--expert-model-parallel-size", "2"])], ids=["ep1", "ep2"])
def test_moe_layer_recompute_changes_nothing(world, extra):
    plain = records_of(run_distributed(train_in_process, world, MOE + extra))
    again = records_of(run_distributed(train_in_process, world, MOE + extra + ["--moe-layer-recompute"]))
    assert_same_run(plain, again, rtol=1e-7, what="--moe-layer-recompute")
    assert [r["moe_aux_loss"] for r in plain] == pytest.approx([r["moe_aux_loss"] for r in again], rel=1e-7)


def test_megatron_fsdp_strategies_and_deprecated_switches():
    for strategy, stage in (("no_shard", 0), ("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3)):
        cfg = parse_args(TINY + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy], zoo())
        assert cfg.parallel.zero_stage == stage
    with pytest.raises(ConfigError, match="applies to --use-megatron-fsdp"):
        parse_args(TINY + ["--data-parallel-sharding-strategy", "optim"], zoo())
    with pytest.raises(ConfigError, match="--no-position-embedding is deprecated"):
        parse_args(TINY + ["--no-position-embedding"], zoo())
    cfg = parse_args(TINY + ["--use-rotary-position-embeddings", "--no-position-embedding"], zoo())
    assert cfg.model.position_embedding_type == "rope"
    for flag in (["--fp4-format", "e2m1"], ["--use-nccl-ub"], ["--cuda-graph-impl", "local"]):
        with pytest.raises(ConfigError, match=f"^{flag[0]}: .*does not use"):
            parse_args(TINY + flag, zoo())
    parse_args(TINY + ["--cuda-graph-impl", "none"], zoo())  # the default value asks for nothing
