"""Gated DeltaNet and Kimi Delta Attention in the attention slot (transformer/gated_delta_net.py):
forward equal to Hugging Face's own layers (qwen3_next, kimi_linear, torch fallbacks) with their
weights copied in; packed documents equal to running the documents apart."""
import types

import pytest
import torch

from megatron_lite.transformer.core_attention import PackedSeq
from megatron_lite.transformer.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig, KimiDeltaAttention
from megatron_lite.transformer.spec import BuildContext

HIDDEN = 32


def gdn_config(**kw):
    return GatedDeltaNetConfig(**{**dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
                                         conv_kernel=4, chunk_size=5), **kw})


def kda_config(**kw):
    return GatedDeltaNetConfig(**{**dict(num_key_heads=3, num_value_heads=3, key_head_dim=8, value_head_dim=8,
                                         conv_kernel=3, chunk_size=4, per_channel_decay=True), **kw})


def build(cls, config, seed=0):
    torch.manual_seed(seed)
    layer = cls(types.SimpleNamespace(hidden_size=HIDDEN), BuildContext(), 0, config=config)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    return layer


def hf_gdn_weights_into(ours: GatedDeltaNet, hf) -> None:
    """Hugging Face's in_proj_qkvz / in_proj_ba interleave q, k, v, z (b, a) per key-head group;
    Megatron-Core's in_proj concatenates [q | k | v | z | b | a] over all heads."""
    c, h = ours.config, HIDDEN
    r = c.num_value_heads // c.num_key_heads
    dk, dv = c.key_head_dim, c.value_head_dim
    qkvz = hf.in_proj_qkvz.weight.view(c.num_key_heads, 2 * dk + 2 * r * dv, h)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = hf.in_proj_ba.weight.view(c.num_key_heads, 2 * r, h).split([r, r], dim=1)
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([x.reshape(-1, h) for x in (q, k, v, z, b, a)]))
        ours.conv1d.weight.copy_(hf.conv1d.weight)
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.out_norm.weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)


def hf_kda_weights_into(ours: KimiDeltaAttention, hf) -> None:
    """One to one, but Hugging Face's forget gate lives in a submodule and its A_log is [1, 1, H, 1]."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj"):
            getattr(ours, name).weight.copy_(getattr(hf, name).weight)
        ours.f_a_proj.weight.copy_(hf.forget_gate.f_a_proj.weight)
        ours.f_b_proj.weight.copy_(hf.forget_gate.f_b_proj.weight)
        ours.dt_bias.copy_(hf.forget_gate.dt_bias)
        ours.A_log.copy_(hf.forget_gate.A_log.flatten())
        ours.conv1d.weight.copy_(hf.conv1d.weight)
        ours.out_norm.weight.copy_(hf.o_norm.weight)
        ours.out_proj.weight.copy_(hf.o_proj.weight)


def randomize(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))


def test_gated_delta_net_equals_hugging_face_qwen3_next():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    c = gdn_config()
    hf_cfg = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=c.num_key_heads,
                             linear_num_value_heads=c.num_value_heads, linear_key_head_dim=c.key_head_dim,
                             linear_value_head_dim=c.value_head_dim, linear_conv_kernel_dim=c.conv_kernel,
                             num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0)
    randomize(hf, 1)
    ours = build(GatedDeltaNet, c)
    hf_gdn_weights_into(ours, hf)
    x = torch.randn(2, 23, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours(x.transpose(0, 1)).transpose(0, 1), hf(x), rtol=1e-5, atol=1e-5)


def test_kimi_delta_attention_equals_hugging_face_kimi_linear():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    c = kda_config()
    hf_cfg = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=64, pad_token_id=0,
                              rms_norm_eps=1e-6, linear_attn_config={
                                  "head_dim": c.key_head_dim, "num_heads": c.num_key_heads,
                                  "short_conv_kernel_size": c.conv_kernel, "kda_layers": [1], "full_attn_layers": []})
    hf = KimiLinearDeltaAttention(hf_cfg, 0)
    randomize(hf, 2)
    ours = build(KimiDeltaAttention, c)
    hf_kda_weights_into(ours, hf)
    x = torch.randn(2, 19, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours(x.transpose(0, 1)).transpose(0, 1), hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls,config", [(GatedDeltaNet, gdn_config()), (KimiDeltaAttention, kda_config())],
                         ids=["gdn", "kda"])
def test_packed_documents_restart_conv_and_state(cls, config):
    """Two rows of packed documents equal each document run on its own (outputs and input gradients)."""
    layer = build(cls, config)
    lengths = [[5, 9, 3], [11, 6]]
    docs = [torch.randn(n, 1, HIDDEN, requires_grad=True) for row in lengths for n in row]
    alone = [layer(d) for d in docs]
    x = torch.cat([torch.cat(docs[:3]), torch.cat(docs[3:])], dim=1)  # [17, 2, h]
    ids = torch.tensor([sum([[i] * n for i, n in enumerate(row)], []) for row in lengths])
    packed = layer(x, None, PackedSeq(ids))
    torch.testing.assert_close(packed[:, 0], torch.cat(alone[:3])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 1], torch.cat(alone[3:])[:, 0], rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(packed)
    grads = torch.autograd.grad((packed * weights).sum(), docs)
    w_rows = [weights[:, 0], weights[:, 1]]
    splits = [torch.split(w_rows[0], lengths[0]), torch.split(w_rows[1], lengths[1])]
    want = torch.autograd.grad(sum((a[:, 0] * w).sum() for a, w in zip(alone, splits[0] + splits[1])), docs)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_gated_attention_equals_hugging_face_qwen3_next_attention():
    """--attention-output-gate with Qwen3-Next's attention (zero-centred q/k norms, partial RoPE, GQA):
    Hugging Face interleaves [q | gate] per head in q_proj, ours holds [Q | gate] in linear_q."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding
    from megatron_lite.config import ModelConfig
    from megatron_lite.transformer.attention import SelfAttention
    from megatron_lite.transformer.core_attention import SDPAAttention
    from megatron_lite.transformer.rope import rope_cos_sin, rope_inv_freq
    heads, groups, d = 4, 2, 16
    hf_cfg = Qwen3NextConfig(hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=groups, head_dim=d,
                             partial_rotary_factor=0.25, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["full_attention"])
    hf_cfg._attn_implementation = "eager"
    hf = Qwen3NextAttention(hf_cfg, 0)
    randomize(hf, 3)
    cfg = ModelConfig(hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups, kv_channels=d,
                      normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope", rotary_percent=0.25,
                      rotary_base=hf_cfg.rope_parameters["rope_theta"], add_bias_linear=False, qk_layernorm=True,
                      apply_layernorm_1p=True, attention_output_gate=True, attention_dropout=0.0)
    ours = SelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention)
    q, gate = hf.q_proj.weight.view(heads, 2, d, HIDDEN).unbind(1)
    with torch.no_grad():
        ours.linear_q.weight.copy_(torch.cat([q.reshape(-1, HIDDEN), gate.reshape(-1, HIDDEN)]))
        ours.linear_kv.weight.copy_(torch.cat([hf.k_proj.weight, hf.v_proj.weight]))
        ours.linear_proj.weight.copy_(hf.o_proj.weight)
        ours.q_layernorm.weight.copy_(hf.q_norm.weight)
        ours.k_layernorm.weight.copy_(hf.k_norm.weight)
    x = torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, -1)
    mask = torch.full((24, 24), float("-inf")).triu(1).expand(2, 1, 24, 24)
    with torch.no_grad():
        expected = hf(x, Qwen3NextRotaryEmbedding(hf_cfg)(x, pos), mask)[0]
        got = ours(x.transpose(0, 1), rope_cos_sin(pos, rope_inv_freq(cfg), x.dtype)).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- generation: the recurrent cache (conv history + state) through the KV cache ----------------------
def _decoding_worker(rank, world, linear_type):
    from megatron_lite.config import ModelConfig
    from megatron_lite.inference import KVCache, kv_cache_bytes_per_token
    from megatron_lite.inference.kv_cache import recurrent_state_bytes
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model
    from test_generate import PROMPTS, _recomputation_gap
    cfg = ModelConfig(num_layers=3, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm", swiglu=True,
                      position_embedding_type="rope", add_bias_linear=False, attention_dropout=0.0,
                      hidden_dropout=0.0, init_method_std=0.2, experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=[1, 0, 1], linear_attention_type=linear_type, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                      linear_conv_kernel_dim=4, linear_chunk_size=4, attention_output_gate=True)
    model = build_model(cfg, ParallelDims.from_world(tp=world), seed=7)[0].eval()
    gap = max(_recomputation_gap(model), _recomputation_gap(model, [PROMPTS[0], PROMPTS[0][::-1]]))
    cache = KVCache.for_model(model, batch_size=1, max_length=1)
    assert cache.nbytes() == kv_cache_bytes_per_token(model) + recurrent_state_bytes(model)
    return gap, kv_cache_bytes_per_token(model), recurrent_state_bytes(model)


@pytest.mark.parametrize("linear_type,tp", [("gated_delta_net", 1), ("kda", 2)])
def test_decoding_with_the_recurrent_cache_equals_recomputation(linear_type, tp):
    """Greedy decoding of left-padded prompts, the linear layers continuing from their cached conv history
    and state, gives every step the logits of a full forward of each sequence alone; the linear layers
    cache a fixed size per sequence, only the full-attention layer caches per token."""
    from megatron_lite.testing import run_distributed
    for gap, per_token, per_sequence in run_distributed(_decoding_worker, tp, linear_type):
        assert gap < 5e-5, f"cached logits differ from recomputation by {gap:.2e}"
        assert per_token == 2 * (4 // tp) * 8 * 4  # the one attention layer: K and V of its heads, fp32
        channels, heads, dk, dv = ((2 * 16 + 24, 4, 8, 6) if linear_type == "gated_delta_net" else (3 * 16, 2, 8, 8))
        assert per_sequence == 2 * 4 * (3 * channels + heads * dk * dv) // tp
