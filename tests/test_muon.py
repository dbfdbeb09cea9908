"""--optimizer muon: the single process equals a plain reference written here (Muon on the hidden
weight matrices, torch.optim.AdamW on the rest); ZeRO-1 over DP2 and TP2 (SwiGLU: fused gate-up and
KV matrices reassembled whole), and with MoE (experts one matrix each) EP2, EP2 x expert-TP2 ZeRO-1
and PP2 equal the single process; the momentum resumes bit-exactly from a checkpoint; unsupported
combinations are one-line errors."""
import math

import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, run_distributed
from megatron_lite.training.step import train_step
from models.gpt import build_model, gpt_forward_step
from test_zero import MODEL, NORM, full_params, make_batches

SWIGLU = dict(MODEL, swiglu=True, untie_embeddings_and_output_weights=True)
STEPS, LR, WD, MOMENTUM = 4, 3e-3, 0.1, 0.9
ADAM_ONLY = ("embedding", "output_layer")


def _muon_config(**kw):
    return TrainingConfig(lr=LR, clip_grad=0.0, weight_decay=WD, optimizer="muon", muon_momentum=MOMENTUM,
                          muon_use_nesterov=True, muon_extra_scale_factor=0.2, **kw)


def _train(rank, world, tp, stage, grads=None, split_qkv=True):
    """Losses and final full params of STEPS Muon steps (per-token loss over the global batch).
    `grads` (a single process): filled with the gradient of each parameter the rule saw, per step."""
    dims = ParallelDims.from_world(tp=tp)
    cfg = ModelConfig(**SWIGLU)
    chunks = build_model(cfg, dims, seed=5)
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, zero_stage=stage, ddp_bucket_size=6000)
    optimizer, sync = build_optimizer(chunks, dims, _muon_config(muon_split_qkv=split_qkv), pcfg)
    if grads is not None:
        update = optimizer.rule.update_shard_

        def spy(s, grad, *args, **kw):
            b = s.bucket
            grads.setdefault(optimizer.num_updates, {}).update(
                {b.names[i]: grad[lo:hi].view(b.shapes[i]).clone() for i, lo, hi in s.segment_params})
            return update(s, grad, *args, **kw)
        optimizer.rule.update_shard_ = spy
    losses = [train_step(chunks, make_batches(step, dims, 1, cfg.vocab_size), dims, optimizer, sync, LR,
                         gpt_forward_step, loss_normalizer=NORM)["lm_loss"] for step in range(STEPS)]
    return losses, full_params(chunks, sync, dims), grads


def _reference_newton_schulz(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _reference_update(name, m, split_qkv):
    """Newton-Schulz scaled by 0.2 sqrt(max(m, n)); K and V of linear_kv [K; V] each on their own."""
    if split_qkv and name.endswith("linear_kv.weight"):
        return torch.cat([_reference_update("", part, False) for part in m.chunk(2)])
    return 0.2 * math.sqrt(max(m.shape)) * _reference_newton_schulz(m)


def _reference(grads, split_qkv):
    """Muon (Nesterov, decoupled decay, update scale 0.2 sqrt(max(m, n))) on every 2-D weight but
    the embedding and output layer; torch.optim.AdamW on those and on norms; from the same initial
    parameters and per-step gradients `grads` (the rule is under test here, not the gradients:
    Adam's first steps would turn their rounding noise into lr-sized differences)."""
    model = build_model(ModelConfig(**SWIGLU), ParallelDims(), seed=5)[0]
    named = dict(model.named_parameters())
    muon = {n: p for n, p in named.items() if p.ndim == 2 and not n.startswith(ADAM_ONLY)}
    adam = [{"params": [p for n, p in named.items() if n not in muon and p.ndim == 2], "weight_decay": WD},
            {"params": [p for n, p in named.items() if n not in muon and p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(adam, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    momentum = {n: torch.zeros_like(p) for n, p in muon.items()}
    for step in range(STEPS):
        for n, p in named.items():
            p.grad = grads[step + 1][n]
        opt.step()
        with torch.no_grad():
            for n, p in muon.items():
                momentum[n] = MOMENTUM * momentum[n] + (1 - MOMENTUM) * p.grad
                nesterov = (1 - MOMENTUM) * p.grad + MOMENTUM * momentum[n]
                p.mul_(1 - LR * WD).sub_(LR * _reference_update(n, nesterov, split_qkv))
    return {n: p.detach() for n, p in named.items()}, sorted(muon)


@pytest.mark.parametrize("split_qkv", [True, False])
def test_single_process_equals_the_reference(split_qkv):
    (_, ours, grads), = run_distributed(_train, 1, 1, 0, {}, split_qkv)
    assert sorted(grads) == list(range(1, STEPS + 1))
    ref, muon_names = _reference(grads, split_qkv)
    assert len(muon_names) == 2 * 5  # per layer: Q, KV, attention out, fc1 (gate-up), fc2
    for name, want in ref.items():
        torch.testing.assert_close(ours[name], want, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("world,tp,stage", [(2, 1, 1), (2, 1, 2), (2, 2, 0)])
def test_dp2_zero1_zero2_and_tp2_equal_the_single_process(world, tp, stage):
    """ZeRO-1 with small buckets: shards cut through matrices, whose momentum is gathered whole."""
    base_losses, base, _ = run_distributed(_train, 1, 1, 0)[0]
    losses, params, _ = run_distributed(_train, world, tp, stage)[0]
    assert losses == pytest.approx(base_losses, rel=1e-5)
    for name, want in base.items():
        assert_close(params[name], want, what=name)


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """ZeRO-1 over 2 ranks: saved at 3 and resumed, the Muon run continues exactly as the straight one."""
    from training_utils import TINY, straight_and_resumed
    argv = TINY + ["--train-iters", "6", "--zero-stage", "1", "--optimizer", "muon", "--muon-use-nesterov",
                   "--swiglu", "--untie-embeddings-and-output-weights"]
    straight, resumed = straight_and_resumed(argv, 2, tmp_path / "ckpt")
    assert resumed == straight


@pytest.mark.parametrize("flags,match", [
    (["--zero-stage", "3"], "--optimizer muon needs whole matrices"),
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
    (["--zero-stage", "1", "--use-precision-aware-optimizer"], "--use-precision-aware-optimizer"),
    (["--muon-momentum", "1.0"], "--muon-momentum"),
    (["--muon-tp-mode", "blockwise"], "--muon-tp-mode: invalid choice: 'blockwise'"),
])
def test_unsupported_combinations_are_one_line_errors(flags, match):
    from pretrain_gpt import resolve
    from training_utils import TINY
    with pytest.raises(ConfigError, match=match) as e:
        resolve(TINY + ["--optimizer", "muon"] + flags)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--muon-use-nesterov needs --optimizer muon"):
        resolve(TINY + ["--muon-use-nesterov"])


def test_stacked_experts_are_orthogonalized_one_matrix_each():
    from megatron_lite.optim.muon import newton_schulz
    g = torch.randn(3, 24, 16, generator=torch.Generator().manual_seed(0))
    g[1] *= 50.0  # each expert normalized by its own norm
    torch.testing.assert_close(newton_schulz(g, 5), torch.stack([_reference_newton_schulz(m) for m in g]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-tensor-parallel-size", "2", "--zero-stage", "1", "--moe-token-dispatcher-type", "alltoall"]),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
    (2, ["--context-parallel-size", "2", "--zero-stage", "1"]),
    pytest.param(4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
                     "--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                 marks=pytest.mark.slow),  # folded: expert pieces gathered over ETP 2 inside TP 4
], ids=["ep2", "ep2-etp2-tp2-zero1", "pp2", "cp2-zero1", "folded-tp4-etp2-ep2"])
def test_moe_layouts_equal_the_single_process(world, extra):
    """Stacked expert weights [E, out, in]: whole experts on each EP rank, expert-TP pieces gathered;
    pipeline stages each step their own matrices."""
    from test_moe_training import BASE, _assert_like_single_process
    _assert_like_single_process(BASE + ["--optimizer", "muon"], world, extra)
