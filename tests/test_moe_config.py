"""MoEConfig.validate: every impossible combination is one line naming the value and the fix;
--moe-layer-freq parsing (ints, Megatron's list expressions, and what it refuses)."""
import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.transformer.moe.config import MoEConfig, parse_moe_layer_freq

BASE = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)


def test_megatron_flag_examples_validate():
    # Mixtral 8x7B, Qwen3-30B-A3B and a DeepSeek-V3-style block (research/megatron_flags.md).
    MoEConfig(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
              moe_token_dispatcher_type="alltoall").with_defaults(14336).validate(num_layers=32, ep=8)
    MoEConfig(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, moe_router_dtype="fp32",
              moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall").validate(num_layers=48, ep=8)
    MoEConfig(num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_router_score_function="sigmoid",
              moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
              moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
              moe_aux_loss_coeff=1e-4, moe_shared_expert_intermediate_size=2048,
              moe_layer_freq="[0]*3+[1]*58").validate(num_layers=61, ep=64, etp=1)


@pytest.mark.parametrize("changes,needle", [
    (dict(num_experts=None), "num_experts (None)"),
    (dict(moe_router_topk=9), "moe_router_topk (9) must be between 1 and num_experts (8)"),
    (dict(moe_router_score_function="tanh"), "moe_router_score_function ('tanh') is not one of softmax, sigmoid"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type ('sinkhorn')"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type ('flex')"),
    (dict(moe_token_drop_policy="random"), "moe_token_drop_policy ('random')"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype ('bf16')"),
    (dict(moe_router_topk=1), "add --moe-router-pre-softmax"),
    (dict(moe_router_norm_topk_prob=False), "moe_router_norm_topk_prob False needs scores over all experts"),
    (dict(moe_router_enable_expert_bias=True), "needs sigmoid scores"),
    (dict(moe_router_topk_scaling_factor=0.0), "moe_router_topk_scaling_factor (0.0) must be positive"),
    (dict(moe_input_jitter_eps=1.5), "moe_input_jitter_eps (1.5) must lie in (0, 1)"),
    (dict(moe_router_num_groups=4), "needs both moe_router_num_groups (4) and moe_router_group_topk (None)"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups (3) must divide num_experts (8)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "moe_router_group_topk (5) must be between 1"),
    (dict(moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2), "must be a multiple of"),
    (dict(moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=2), "exceeds the experts per group (2)"),
    (dict(moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff (-1.0) must be >= 0"),
    (dict(moe_z_loss_coeff=-1e-3), "moe_z_loss_coeff (-0.001) must be >= 0"),
    (dict(moe_router_bias_update_rate=0.0), "moe_router_bias_update_rate (0.0) must be positive"),
    (dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.1), "has no effect"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor (0.0) must be positive"),
    (dict(moe_pad_expert_input_to_capacity=True), "set --moe-expert-capacity-factor"),
    (dict(moe_ffn_hidden_size=None), "moe_ffn_hidden_size (None) is not set"),
    (dict(moe_ffn_hidden_size=30), "moe_ffn_hidden_size (30) must be divisible by the expert tensor parallel size (4)"),
    (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate needs a shared expert"),
    (dict(moe_layer_freq="[1]*3"), "has 3 entries for 4 layers"),
])
def test_invalid_configs_are_one_line_errors(changes, needle):
    cfg = MoEConfig(**{**BASE, **changes})
    with pytest.raises(ConfigError) as err:
        cfg.validate(num_layers=4, ep=2, etp=4 if "moe_ffn_hidden_size" in changes else 1)
    msg = str(err.value)
    assert needle in msg, msg
    assert "\n" not in msg


def test_num_experts_must_split_over_ep():
    with pytest.raises(ConfigError, match=r"num_experts \(8\) must be divisible by the expert model parallel size \(3\)"):
        MoEConfig(**BASE).validate(ep=3)


def test_with_defaults_takes_the_dense_ffn_size():
    assert MoEConfig(num_experts=4).with_defaults(96).moe_ffn_hidden_size == 96
    assert MoEConfig(num_experts=4, moe_ffn_hidden_size=8).with_defaults(96).moe_ffn_hidden_size == 8


@pytest.mark.parametrize("value,layers,expected", [
    (1, 3, [1, 1, 1]),
    (2, 5, [1, 0, 1, 0, 1]),
    ("3", 4, [1, 0, 0, 1]),
    ([0, 1, 1], 3, [0, 1, 1]),
    ("([0]*1+[1]*3)*2", 8, [0, 1, 1, 1, 0, 1, 1, 1]),
    ("[0]*3+[1]*2", 5, [0, 0, 0, 1, 1]),
])
def test_layer_freq(value, layers, expected):
    assert parse_moe_layer_freq(value, layers) == [bool(v) for v in expected]


@pytest.mark.parametrize("value,needle", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("[2]*4", "list of 0 (dense) and 1 (MoE)"),
    ("[1]*10**9", "BinOp is not allowed"),
    ("[1]*100000000", "longer than 100000 layers"),
    (0, "must be >= 1"),
    ("[1, 0", "is not an int or a list"),
    ([True, False, True, False], "list of 0 (dense) and 1 (MoE)"),
])
def test_layer_freq_refusals(value, needle):
    with pytest.raises(ConfigError) as err:
        parse_moe_layer_freq(value, 4)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
