"""LossNormalization, the one object that weighs every loss of a step, and ModelHooks, the registry
through which a model's parts act around each step (the trainer knows neither MoE nor its hooks)."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.transformer.loss_normalization import LossNormalization
from megatron_lite.transformer.moe import MoEStepHooks
from megatron_lite.transformer.spec import BuildContext
from megatron_lite.transformer.step_hooks import ModelHooks
from models.gpt import build_model


@pytest.mark.parametrize("mbs,seq,m,dp", [(1, 64, 3, 1), (2, 4096, 7, 3), (3, 100, 5, 6), (4, 8192, 11, 12)])
def test_per_token_aux_weight_is_the_micro_batch_token_share_bit_for_bit(mbs, seq, m, dp):
    """loss_scale / (M x D) equals the trainer's former loss_scale x (micro-batch tokens / global
    tokens) exactly (the same real quotient, rounded once), so MoE runs did not change."""
    gbs, ls = mbs * m * dp, 3.0 ** 7
    norm = LossNormalization(True, m, ls, float(gbs * seq), ParallelDims(dp=dp))
    assert norm.aux_weight == ls * (mbs * seq / (gbs * seq))
    assert LossNormalization(False, m, ls).aux_weight == ls * (1.0 / m)


def test_the_two_losses_weights_and_gradient_factors():
    dims = ParallelDims(dp=2)
    loss_sum, tokens = torch.tensor(12.0), torch.tensor(3.0)
    per_token = LossNormalization(True, 4, 8.0, 16.0, dims)
    assert per_token(loss_sum, tokens).item() == 12.0 * 8.0 / 16.0 and per_token.grad_factor(10.0) == 1.6
    mean = LossNormalization(False, 4, 8.0, 16.0, dims)
    assert mean(loss_sum, tokens).item() == 12.0 * 2.0 / 3.0 and mean.grad_factor(10.0) == 0.5
    assert mean(loss_sum, 0).item() == 12.0 * 2.0  # a micro-batch without loss-bearing tokens


class _Part:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def before_step(self, iteration):
        self.calls.append((self.name, "before", iteration))

    def after_update(self):
        self.calls.append((self.name, "after"))

    def metrics(self):
        return {self.name: len(self.calls)}


class _Other(_Part):
    pass


def test_model_hooks_build_each_kind_once_and_call_every_part_in_order():
    hooks, calls = ModelHooks(), []
    first = hooks.shared(_Part, "a", calls)
    assert hooks.shared(_Part, "ignored", []) is first  # later builders get the same part
    hooks.shared(_Other, "b", calls)
    hooks.before_step(7)
    hooks.after_update()
    assert calls == [("a", "before", 7), ("b", "before", 7), ("a", "after"), ("b", "after")]
    assert hooks.metrics() == {"a": 4, "b": 4}


def test_an_moe_model_registers_its_hooks_on_every_pipeline_stage():
    """Stage 0 holds only a dense layer, yet registers MoEStepHooks (its metrics are collective);
    each stage's hooks hold exactly its own routers."""
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                      moe=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_layer_freq="[0,1]"))
    routers = []
    for rank in range(2):
        ctx = BuildContext(ParallelDims(pp=2, rank=rank))
        chunks = build_model(cfg, ctx, materialize=False)
        moe = ctx.hooks.parts[MoEStepHooks]
        assert list(ctx.hooks.parts) == [MoEStepHooks] and moe.tracker.num_layers == 2
        routers.append(moe.routers)
        assert all(r.loss_normalization is ctx.loss_normalization for r in moe.routers)
    assert routers[0] == [] and routers[1] == [chunks[0].layers["1"].mlp.router]
    dense = BuildContext(ParallelDims())
    build_model(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64), dense,
                materialize=False)
    assert dense.hooks.parts == {}
