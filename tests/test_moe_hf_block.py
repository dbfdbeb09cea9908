"""One MoELayer against Hugging Face's own sparse MoE blocks with the same weights:
MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock (shared expert with its sigmoid gate) and
DeepseekV3MoE (sigmoid routing with expert bias, groups, scaling, shared experts). Outputs to
1e-5, router / expert / shared-expert gradients to 1e-5 relative; grouped GEMM and the expert
loop, both dispatchers."""
import pytest
import torch

from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close
from tests.moe_helpers import build_layer, load_full_state

H, F_EXPERT, F_SHARED = 16, 8, 12
S, B = 6, 3


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=8,
                                             num_experts_per_tok=2))
    ours = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=F_EXPERT)
    return hf, ours, {"router.weight": "gate.weight"}


def _qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, num_experts=8,
                                               num_experts_per_tok=4, norm_topk_prob=False,
                                               shared_expert_intermediate_size=F_SHARED))
    ours = dict(num_experts=8, moe_router_topk=4, moe_router_pre_softmax=True, moe_ffn_hidden_size=F_EXPERT,
                moe_shared_expert_intermediate_size=F_SHARED, moe_shared_expert_gate=True)
    return hf, ours, {"router.weight": "gate.weight", "shared_experts.gate_weight": "shared_expert_gate.weight",
                      "shared": "shared_expert"}


def _deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    hf = DeepseekV3MoE(DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=16,
                                        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True))
    ours = dict(num_experts=16, moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                moe_router_dtype="fp32", moe_ffn_hidden_size=F_EXPERT,
                moe_shared_expert_intermediate_size=2 * F_EXPERT)
    return hf, ours, {"router.weight": "gate.weight", "shared": "shared_experts"}


def _hf_state(hf, names):
    """Our full parameter names -> HF tensors (transformers 5 keeps experts fused: the same layout)."""
    sd = dict(hf.named_parameters())
    state = {"router.weight": sd[names["router.weight"]], "experts.weight1": sd["experts.gate_up_proj"],
             "experts.weight2": sd["experts.down_proj"]}
    if "shared" in names:
        p = names["shared"]
        state["shared_experts.linear_fc1.weight"] = torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])
        state["shared_experts.linear_fc2.weight"] = sd[f"{p}.down_proj.weight"]
    if "shared_experts.gate_weight" in names:
        state["shared_experts.gate_weight"] = sd[names["shared_experts.gate_weight"]]
    return state


def _grad_of(hf, name, names):
    sd = dict(hf.named_parameters())
    if name == "shared_experts.linear_fc1.weight":
        p = names["shared"]
        return torch.cat([sd[f"{p}.gate_proj.weight"].grad, sd[f"{p}.up_proj.weight"].grad])
    hf_name = {"experts.weight1": "experts.gate_up_proj", "experts.weight2": "experts.down_proj",
               "shared_experts.linear_fc2.weight": f"{names.get('shared')}.down_proj.weight"}.get(name, names.get(name))
    return sd[hf_name].grad


@pytest.mark.parametrize("family", [_mixtral, _qwen2_moe, _deepseek_v3], ids=["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("grouped_gemm,dispatcher", [(False, "alltoall"), (True, "alltoall"), (True, "allgather")])
def test_block_matches_hf(family, grouped_gemm, dispatcher):
    torch.manual_seed(0)
    hf, ours_kw, names = family()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if hasattr(hf.gate, "e_score_correction_bias"):
        hf.gate.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.05)
    dims = ParallelDims().build_groups()
    layer, _ = build_layer(dict(ours_kw, moe_grouped_gemm=grouped_gemm, moe_token_dispatcher_type=dispatcher),
                           dims, H, swiglu=True)
    load_full_state(layer, {k: v.detach() for k, v in _hf_state(hf, names).items()})
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)

    x = torch.randn(B, S, H, generator=gen)
    probe = torch.randn(B, S, H, generator=gen)
    x_hf = x.clone().requires_grad_(True)
    y_hf = hf(x_hf)
    (y_hf * probe).sum().backward()
    x_ours = x.transpose(0, 1).contiguous().requires_grad_(True)  # [s, b, h]
    y = layer(x_ours)
    (y * probe.transpose(0, 1)).sum().backward()

    assert (y.transpose(0, 1) - y_hf).abs().max() < 1e-5
    assert_close(x_ours.grad.transpose(0, 1), x_hf.grad, rtol=1e-5, what="input grad")
    for name, p in layer.named_parameters():
        assert_close(p.grad, _grad_of(hf, name, names), rtol=1e-5, what=name)
