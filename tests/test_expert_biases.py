"""gpt-oss's biased MoE (--add-bias-linear with MoE, as Megatron-Core: a bias on the router's linear and
per expert on both projections): a gpt-oss-shaped model (sinks, alternating windows, the clamped gated
unit) trains at EP2 x TP2 + SP and with the grouped GEMM like the single process, the biases moving
the run; expert tensor parallelism with biases, and Megatron-LM checkpoints of them (not written yet),
are refused with one line."""
from dataclasses import replace

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_same_run, run_distributed
from megatron_lite.transformer.moe import GroupedExperts, MoEConfig
from models.hf_conversion import ConversionError
from models.megatron_conversion import megatron_args_of_config, model_config_from_megatron_args
from training_utils import LLAMA_SWITCHES, TINY, records_of, train_in_process

GPT_OSS = (TINY + [a for a in LLAMA_SWITCHES if a != "--disable-bias-linear"]
           + ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
              "--softmax-type", "learnable", "--window-size", "8", "--window-attn-skip-freq", "2",
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--lr", "1e-2"])


@pytest.mark.parametrize("extra", [
    ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    pytest.param(["--moe-grouped-gemm", "--expert-model-parallel-size", "2"], marks=pytest.mark.slow)],
    ids=["ep2-tp2-sp", "grouped-ep2"])
def test_biased_moe_trains_like_single_process(extra):
    ref = records_of(run_distributed(train_in_process, 1, GPT_OSS))
    unbiased = records_of(run_distributed(train_in_process, 1, GPT_OSS + ["--disable-bias-linear"]))
    # biases start at 0 (the same first loss), then learn and change the run
    assert abs(unbiased[-1]["lm_loss"] - ref[-1]["lm_loss"]) > 1e-5
    world = 4 if "--tensor-model-parallel-size" in extra else 2
    assert_same_run(ref, records_of(run_distributed(train_in_process, world, GPT_OSS + extra)), grad_norm_rtol=1e-6,
                    what=" ".join(extra))


def test_grouped_gemm_with_biases_equals_the_loop():
    torch.manual_seed(0)
    dims = ParallelDims().build_groups()
    loop, grouped = (GroupedExperts(4, 8, 4, dims, grouped_gemm=g, bias=True) for g in (False, True))
    for m in (loop, grouped):
        for p in m.parameters():
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(10, 8, requires_grad=True)
    counts = [3, 0, 5, 2]  # an expert without tokens keeps a zero bias gradient
    outs = [m(x, counts) for m in (loop, grouped)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for m, out in zip((loop, grouped), outs):
        out.square().sum().backward()
        assert m.bias1.grad[1].abs().max() == 0 and m.bias2.grad[0].abs().min() > 0
    for a, b in zip(loop.parameters(), grouped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_expert_biases_refuse_expert_tensor_parallelism_and_a_biased_shared_expert_in_megatron_checkpoints():
    """(Expert and router biases themselves convert: tests/test_megatron_moe_checkpoints.py)"""
    dims = ParallelDims(tp=2, etp=2)  # no process group needed: refused while building
    with pytest.raises(ConfigError, match="expert biases .* need expert tensor parallel size 1"):
        GroupedExperts(4, 8, 4, dims, bias=True)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                      moe=MoEConfig(num_experts=4, moe_shared_expert_intermediate_size=32))
    with pytest.raises(ConversionError, match="a shared expert with --add-bias-linear.* add --disable-bias-linear"):
        megatron_args_of_config(cfg, 1, 1)
    with pytest.raises(ConversionError, match="a shared expert with add_bias_linear=True"):
        model_config_from_megatron_args(dict(megatron_args_of_config(replace(cfg, add_bias_linear=False), 1, 1),
                                             add_bias_linear=True), 100)
