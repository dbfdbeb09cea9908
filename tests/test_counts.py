"""What each layer type reports from the config alone (megatron_lite/transformer/counts.py, summed by
model_counts.py) against the single-process model it builds, for dense GPT-2, Llama with GQA, q/k
norms with Q/K/V biases (per head, and over all heads as OLMoE's), and MoE layers with shared experts
(gated or not, after a dense layer, GELU experts beside biased dense linears), and hybrids of Gated
DeltaNet / KDA layers beside (gated) full attention:
  - the parameters of every part (embedding, each layer, final norm, output layer) and the total
    (ModelConfig.num_parameters, what the start-up line prints) equal the built modules' numel;
  - an MoE layer's active count is what one token touches: every parameter of the layer but the
    experts it is not routed to (seen in the experts' tokens_per_expert);
  - the forward FLOPs per token (the MFU convention) equal what torch's FlopCounterMode counts in a
    real forward with the math attention kernel, plus 2 per norm and bias weight (the convention
    counts every weight; the counter sees only the GEMMs)."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.training.flops import flops_per_token
from megatron_lite.transformer.model_counts import MicroBatch, model_counts
from megatron_lite.transformer.moe import GroupedExperts
from models import zoo
from models.gpt import build_model

LINEAR = dict(experimental_attention_variant="gated_delta_net", linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3)
MOE_GELU = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64)
CONFIGS = {
    "gpt2": ("gpt2-tiny", {}),
    "llama-gqa": ("llama-tiny", {}),
    "qk-norm-qkv-bias": ("llama-tiny", dict(qk_layernorm=True, add_qkv_bias=True)),
    "moe-gated-shared-expert": ("qwen2-moe-tiny", {}),
    "moe-full-width-qk-norm": ("olmoe-tiny", {}),
    "moe-after-dense-layer": ("deepseek-v3-routing-tiny", {}),
    "moe-gelu-with-biases": ("gpt2-tiny", dict(moe=MOE_GELU)),
    "gated-delta-net-hybrid": ("llama-tiny", dict(LINEAR, linear_attention_freq=2, attention_output_gate=True)),
    "kda-hybrid": ("llama-tiny", dict(LINEAR, linear_attention_freq=[1, 0], linear_attention_type="kda")),
    "gdn-with-biases": ("gpt2-tiny", dict(LINEAR, linear_attention_freq=2)),
    "kda-with-biases": ("gpt2-tiny", dict(LINEAR, linear_attention_freq=2, linear_attention_type="kda")),
}
HYBRID = ("gated-delta-net-hybrid", "kda-hybrid", "gdn-with-biases", "kda-with-biases")  # the rule's FLOPs are an estimate: not checked by the counter


def _model(name):
    preset, over = CONFIGS[name]
    kw = {k: v for k, v in zoo.get_model_config(preset).items() if k != "seq_length"}
    # A vocabulary of whole padding multiples: the built embedding has exactly vocab_size rows.
    kw.update(over, vocab_size=256, attention_backend="sdpa", hidden_dropout=0.0, attention_dropout=0.0)
    cfg = ModelConfig(**kw)
    return cfg, build_model(cfg, ParallelDims(), seed=3)[0].eval()


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_of_every_part_equal_the_built_model(name):
    cfg, model = _model(name)
    counts = model_counts(cfg)
    assert counts.embedding.params == _numel(model.embedding)
    assert [c.params for c in counts.layers] == [_numel(layer) for layer in model.layers.values()]
    assert counts.final_norm.params == _numel(model.final_norm)
    tied = not cfg.untie_embeddings_and_output_weights
    assert counts.output.params == (0 if tied else model.output_layer.weight.numel())
    assert cfg.num_parameters() == counts.total.params == _numel(model)
    assert cfg.num_parameters(include_embedding=False) == _numel(model) - _numel(model.embedding)


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if n.startswith("moe")))
def test_an_moe_layers_active_count_is_what_one_token_touches(name):
    cfg, model = _model(name)
    routed = {}  # experts module -> experts that received the token

    def seen(module, args):
        routed[module] = sum(1 for n in args[1] if n > 0)

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    handles = [m.register_forward_pre_hook(seen) for m in experts]
    with torch.no_grad():
        model(torch.tensor([[7]]))
    for h in handles:
        h.remove()
    counts = model_counts(cfg)
    for i, layer in model.layers.items():
        mine = [m for m in experts if any(m is x for x in layer.modules())]
        untouched = sum((m.num_local_experts - routed[m]) * _numel(m) // m.num_local_experts for m in mine)
        assert counts.layers[int(i)].active == _numel(layer) - untouched, i
        assert not mine or routed[mine[0]] == cfg.moe.moe_router_topk
    assert any(c.active < c.params for c in counts.layers)
    assert cfg.num_parameters(active=True) == counts.total.active


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(HYBRID)))
def test_forward_flops_equal_a_flop_counter(name):
    cfg, model = _model(name)
    b, s = 2, 32
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (b, s)))
    not_gemm = sum(p.numel() for n, p in model.named_parameters()
                   if (n.endswith("bias") or "norm" in n) and not n.startswith("embedding"))
    # expert biases (add_bias_linear with MoE): a token adds those of its k experts
    not_gemm += sum(p.numel() * cfg.moe.moe_router_topk // cfg.moe.num_experts for n, p in model.named_parameters()
                    if n.endswith((".bias1", ".bias2")))
    counts = model_counts(cfg, MicroBatch(seq_length=s)).total
    assert counts.flops == counter.get_total_flops() / (b * s) + 2 * not_gemm
    assert flops_per_token(cfg, s) == 3 * counts.flops
