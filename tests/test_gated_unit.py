"""gpt-oss's gated MLP (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7, Megatron's
flags): the activation and its gradient equal Hugging Face gpt_oss's experts' (which interleave gate
and up); dense and MoE models with it train at TP2 + SP and EP2 like the single process; the flags
without a gated MLP, and conversions that cannot carry them, are refused with one line."""
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.testing import assert_close, assert_same_run, run_distributed  # noqa: E402
from megatron_lite.transformer.mlp import GatedUnit  # noqa: E402
from training_utils import (LLAMA_SWITCHES, TINY, assert_conversions_refuse, records_of,  # noqa: E402
                            train_in_process)

GPT_OSS = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"]


def test_gated_unit_equals_hf_gpt_oss_experts_activation():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    h = (torch.randn(64, 2 * 16, generator=torch.Generator().manual_seed(0)) * 5).requires_grad_(True)  # past 7
    interleaved = torch.stack(h.chunk(2, dim=-1), dim=-1).reshape(64, 32)  # HF: gate, up, gate, up, ...
    ref = GptOssExperts._apply_gate(types.SimpleNamespace(limit=7.0, alpha=1.702), interleaved)
    out = GatedUnit(quick_gelu=True, linear_offset=1.0, clamp=7.0)(h)
    assert_close(out, ref, rtol=1e-6)
    g = torch.randn(out.shape)
    assert_close(torch.autograd.grad(out, h, g)[0], torch.autograd.grad(ref, h, g)[0], rtol=1e-6)
    assert (h.abs() > 7).any()  # the clamp is exercised


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "32",
       "--moe-layer-freq", "([0]*1+[1]*1)"]


@pytest.mark.parametrize("base,extra", [
    (TINY + LLAMA_SWITCHES + GPT_OSS, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    pytest.param(TINY + LLAMA_SWITCHES + GPT_OSS + MOE, ["--expert-model-parallel-size", "2"], marks=pytest.mark.slow)],
    ids=["dense-tp2-sp", "moe-ep2"])
def test_gpt_oss_mlp_trains_like_single_process(base, extra):
    ref = records_of(run_distributed(train_in_process, 1, base))
    plain = records_of(run_distributed(train_in_process, 1, [a for a in base if a not in GPT_OSS[1:]]))
    assert abs(plain[0]["lm_loss"] - ref[0]["lm_loss"]) > 1e-6  # the offset and clamp change the model
    out = records_of(run_distributed(train_in_process, 2, base + extra))
    assert_same_run(ref, out, grad_norm_rtol=1e-6, what=" ".join(extra))


def test_gated_flags_need_a_gated_mlp_and_are_not_converted():
    for kw in ({"glu_linear_offset": 1.0}, {"activation_func_clamp_value": 7.0}):
        with pytest.raises(ConfigError, match="shape a gated MLP: add --swiglu"):
            ModelConfig(**kw).validate(64)
    with pytest.raises(ConfigError, match="--activation-func-clamp-value"):
        ModelConfig(swiglu=True, activation_func_clamp_value=-1.0).validate(64)
    assert ModelConfig(quick_geglu=True).swiglu  # --quick-geglu alone makes the MLP gated
    cfg = ModelConfig(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, glu_linear_offset=1.0)
    assert_conversions_refuse(cfg, "glu_linear_offset", "GLU linear offset")
