"""Named model configurations (`--model NAME`). Explicit command-line flags override them.

Real shapes follow the published configurations; the tiny ones are for tests and laptops.
"""
from __future__ import annotations

from typing import Dict

from megatron_lite.errors import ConfigError

_GPT2 = dict(family="gpt2", normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
             activation="gelu_tanh", add_bias_linear=True, untie_embeddings_and_output_weights=False,
             vocab_size=50257, max_position_embeddings=1024, seq_length=1024, norm_epsilon=1e-5)
_LLAMA = dict(family="llama", normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
              untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0)
_LLAMA2 = dict(_LLAMA, vocab_size=32000, max_position_embeddings=4096, seq_length=4096, norm_epsilon=1e-5,
               rotary_base=10000.0)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, max_position_embeddings=8192, seq_length=8192, norm_epsilon=1e-5,
               rotary_base=500000.0)
# Llama 3.1 / 3.2: 128k context through Llama-3.1 RoPE frequency scaling.
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling_type="llama3", rope_scaling_factor=8.0,
                rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                rope_scaling_original_max_position=8192)
_LLAMA32 = dict(_LLAMA31, rope_scaling_factor=32.0, untie_embeddings_and_output_weights=False)
_MISTRAL = dict(_LLAMA, family="mistral", vocab_size=32000, max_position_embeddings=32768, seq_length=4096,
                norm_epsilon=1e-5, rotary_base=10000.0, num_query_groups=8)
# Qwen2.5: Q/K/V biases, RMSNorm eps 1e-6, theta 1e6; the small ones tie their embeddings.
_QWEN25 = dict(_LLAMA, family="qwen2", add_qkv_bias=True, vocab_size=152064, max_position_embeddings=32768,
               seq_length=4096, norm_epsilon=1e-6, rotary_base=1000000.0)
_QWEN25_SMALL = dict(_QWEN25, vocab_size=151936, untie_embeddings_and_output_weights=False)
# Qwen3: per-head RMSNorm on Q and K, 128-channel heads, no biases.
_QWEN3 = dict(_LLAMA, family="qwen3", qk_layernorm=True, kv_channels=128, vocab_size=151936,
              max_position_embeddings=40960, seq_length=4096, norm_epsilon=1e-6, rotary_base=1000000.0)
_QWEN3_SMALL = dict(_QWEN3, untie_embeddings_and_output_weights=False)
_MIXTRAL = dict(_MISTRAL, family="mixtral", rotary_base=1000000.0)


# gpt-oss (OpenAI's config.json): attention sinks and biases, 128-token windows on every other layer
# (the first sliding), YaRN x32 from 4096 positions without rounding, top-4 experts with router and
# expert biases, the clamped quick-GELU gated unit. The router's aux-loss coefficient is ours (0).
_GPT_OSS = dict(_LLAMA, family="gpt_oss", add_bias_linear=True, softmax_type="learnable", quick_geglu=True,
                glu_linear_offset=1.0, activation_func_clamp_value=7.0, window_size=128, window_attn_skip_freq=2,
                num_attention_heads=64, num_query_groups=8, kv_channels=64, hidden_size=2880, ffn_hidden_size=2880,
                vocab_size=201088, max_position_embeddings=131072, seq_length=4096, norm_epsilon=1e-5,
                rotary_base=150000.0, rope_scaling_type="yarn", rotary_scaling_factor=32.0,
                original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                yarn_correction_range_round_to_int=False)


def _shape(layers, hidden, heads, **kw):
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, **kw)


_YARN = dict(rope_scaling_type="yarn", rotary_base=10000.0, original_max_position_embeddings=4096, beta_fast=32.0,
             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _deepseek(layers, hidden, heads, ffn, *, rope, moe_layer_freq, experts, topk, shared=1, scaling=None,
              groups=None, router=None, family="deepseek_v3", q_lora_rank=None, norm_epsilon=1e-6, **kw):
    """A DeepSeek-V2/V3-architecture model as its HF config converts: MLA (512-rank latent, 128 + 64
    channel query/key heads, 128-channel values), 2048-wide experts, the dense MLP first."""
    expert = 1408 if hidden == 2048 else 2048
    router = router or dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_router_norm_topk_prob=True)
    moe = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert,
               moe_shared_expert_intermediate_size=shared * expert, moe_router_topk_scaling_factor=scaling,
               moe_router_num_groups=groups and groups[0], moe_router_group_topk=groups and groups[1],
               moe_router_dtype="fp32", moe_layer_freq=moe_layer_freq, **router)
    return dict(_LLAMA, family=family, **_shape(layers, hidden, heads), ffn_hidden_size=ffn, seq_length=4096,
                norm_epsilon=norm_epsilon, multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=512,
                qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, moe=moe, **rope, **kw)


def _glm(layers, hidden, ffn, expert, *, experts, dense, scaling, qk_norm):
    """GLM-4.5 (its MTP layer not included): 96 query heads and 8 K/V groups of 128 channels with Q/K/V
    biases, RoPE on half of each head, DeepSeek-V3's routing (sigmoid, expert bias, top-8, one shared
    expert) after `dense` dense layers."""
    moe = dict(num_experts=experts, moe_router_topk=8, moe_ffn_hidden_size=expert,
               moe_shared_expert_intermediate_size=expert, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_norm_topk_prob=True, moe_router_dtype="fp32",
               moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
               moe_layer_freq=[0] * dense + [1] * (layers - dense))
    return dict(_LLAMA, family="glm4_moe", **_shape(layers, hidden, 96), num_query_groups=8, kv_channels=128,
                ffn_hidden_size=ffn, add_qkv_bias=True, qk_layernorm=qk_norm, rotary_percent=0.5,
                rotary_base=1000000.0, vocab_size=151552, max_position_embeddings=131072, seq_length=4096,
                norm_epsilon=1e-5, moe=moe)


MODELS: Dict[str, dict] = {
    # Tiny sizes: unit tests, the built-in default, laptops.
    "gpt2-tiny": dict(_GPT2, **_shape(2, 64, 4), vocab_size=257, max_position_embeddings=256, seq_length=128),
    # The built-in default (no --model): Megatron-LM's GPT defaults (exact GELU, biases, tied
    # embeddings) but no dropout, so that every parallel layout reproduces the same losses.
    "gpt2-small-cpu": dict(_GPT2, **_shape(4, 256, 4), activation="gelu", vocab_size=257,
                           max_position_embeddings=256, seq_length=128, attention_dropout=0.0, hidden_dropout=0.0),
    "llama-tiny": dict(_LLAMA, **_shape(2, 64, 4), num_query_groups=2, ffn_hidden_size=176, vocab_size=257,
                       max_position_embeddings=256, seq_length=128),
    "llama-20m": dict(_LLAMA, **_shape(6, 512, 8), num_query_groups=4, ffn_hidden_size=1408, vocab_size=2048,
                      max_position_embeddings=512, seq_length=256),
    # GPT-2 family (OpenAI shapes).
    "gpt2-124m": dict(_GPT2, **_shape(12, 768, 12)),
    "gpt2-355m": dict(_GPT2, **_shape(24, 1024, 16)),
    "gpt2-774m": dict(_GPT2, **_shape(36, 1280, 20)),
    "gpt2-1.5b": dict(_GPT2, **_shape(48, 1600, 25)),
    # Llama 2 and Llama 3 (Meta shapes).
    "llama2-7b": dict(_LLAMA2, **_shape(32, 4096, 32), ffn_hidden_size=11008),
    "llama2-13b": dict(_LLAMA2, **_shape(40, 5120, 40), ffn_hidden_size=13824),
    "llama2-70b": dict(_LLAMA2, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672),
    "llama3-8b": dict(_LLAMA3, **_shape(32, 4096, 32), num_query_groups=8, ffn_hidden_size=14336),
    "llama3-70b": dict(_LLAMA3, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672),
    "llama3.1-8b": dict(_LLAMA31, **_shape(32, 4096, 32), num_query_groups=8, ffn_hidden_size=14336),
    "llama3.1-70b": dict(_LLAMA31, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672),
    "llama3.1-405b": dict(_LLAMA31, **_shape(126, 16384, 128), num_query_groups=8, ffn_hidden_size=53248),
    "llama3.2-1b": dict(_LLAMA32, **_shape(16, 2048, 32), num_query_groups=8, ffn_hidden_size=8192),
    "llama3.2-3b": dict(_LLAMA32, **_shape(28, 3072, 24), num_query_groups=8, ffn_hidden_size=8192),
    # Mistral 7B: v0.1 attends through a 4096-token sliding window; v0.3 has full attention.
    "mistral-7b": dict(_MISTRAL, **_shape(32, 4096, 32), ffn_hidden_size=14336, window_size=4096),
    "mistral-7b-v0.3": dict(_MISTRAL, **_shape(32, 4096, 32), ffn_hidden_size=14336, vocab_size=32768,
                            rotary_base=1000000.0),
    # Qwen2.5.
    "qwen2.5-0.5b": dict(_QWEN25_SMALL, **_shape(24, 896, 14), num_query_groups=2, ffn_hidden_size=4864),
    "qwen2.5-1.5b": dict(_QWEN25_SMALL, **_shape(28, 1536, 12), num_query_groups=2, ffn_hidden_size=8960),
    "qwen2.5-3b": dict(_QWEN25_SMALL, **_shape(36, 2048, 16), num_query_groups=2, ffn_hidden_size=11008),
    "qwen2.5-7b": dict(_QWEN25, **_shape(28, 3584, 28), num_query_groups=4, ffn_hidden_size=18944),
    "qwen2.5-14b": dict(_QWEN25, **_shape(48, 5120, 40), num_query_groups=8, ffn_hidden_size=13824),
    "qwen2.5-32b": dict(_QWEN25, **_shape(64, 5120, 40), num_query_groups=8, ffn_hidden_size=27648),
    "qwen2.5-72b": dict(_QWEN25, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=29568),
    # Qwen3 dense.
    "qwen3-0.6b": dict(_QWEN3_SMALL, **_shape(28, 1024, 16), num_query_groups=8, ffn_hidden_size=3072),
    "qwen3-1.7b": dict(_QWEN3_SMALL, **_shape(28, 2048, 16), num_query_groups=8, ffn_hidden_size=6144),
    "qwen3-4b": dict(_QWEN3_SMALL, **_shape(36, 2560, 32), num_query_groups=8, ffn_hidden_size=9728),
    "qwen3-8b": dict(_QWEN3, **_shape(36, 4096, 32), num_query_groups=8, ffn_hidden_size=12288),
    "qwen3-14b": dict(_QWEN3, **_shape(40, 5120, 40), num_query_groups=8, ffn_hidden_size=17408),
    "qwen3-32b": dict(_QWEN3, **_shape(64, 5120, 64), num_query_groups=8, ffn_hidden_size=25600),
    # Mixture of experts. Tiny ones first (tests, laptops), then published shapes.
    "mixtral-tiny": dict(_MIXTRAL, **_shape(2, 64, 4), num_query_groups=2, ffn_hidden_size=128, vocab_size=257,
                         max_position_embeddings=256, seq_length=128,
                         moe=dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)),
    "qwen2-moe-tiny": dict(_QWEN25, family="qwen2_moe", **_shape(2, 64, 4), num_query_groups=2, ffn_hidden_size=128,
                           vocab_size=257, max_position_embeddings=256, seq_length=128,
                           moe=dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                                    moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
                                    moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001)),
    # DeepSeek-V3's routing (sigmoid scores, group-limited top-k, aux-loss-free expert bias, a
    # shared expert, a dense first layer) on ordinary GQA attention: megatron-lite has no MLA.
    "deepseek-v3-routing-tiny": dict(_LLAMA, family=None, **_shape(3, 64, 4), num_query_groups=2, ffn_hidden_size=192,
                                     vocab_size=257, max_position_embeddings=256, seq_length=128,
                                     moe=dict(num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=32,
                                              moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                              moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                                              moe_router_enable_expert_bias=True,
                                              moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                                              moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1])),
    # OLMoE-1B-7B: Q and K each RMS-normalized over all heads at once (--qk-layernorm-full-width),
    # 64 experts, top-8 of a softmax without renormalization. It was trained with a z-loss too, which
    # HF configs do not record: add --moe-z-loss-coeff 0.001 to train as AllenAI did.
    "olmoe-tiny": dict(_LLAMA, family="olmoe", **_shape(2, 64, 4), num_query_groups=2, qk_layernorm=True,
                       qk_layernorm_full_width=True, ffn_hidden_size=32, vocab_size=257, max_position_embeddings=256,
                       seq_length=128, rotary_base=10000.0,
                       moe=dict(num_experts=8, moe_router_topk=2, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01)),
    "olmoe-1b-7b": dict(_LLAMA, family="olmoe", **_shape(16, 2048, 16), qk_layernorm=True, qk_layernorm_full_width=True,
                        ffn_hidden_size=1024, vocab_size=50304, max_position_embeddings=4096, seq_length=4096,
                        rotary_base=10000.0, moe=dict(num_experts=64, moe_router_topk=8, moe_router_pre_softmax=True,
                                                      moe_aux_loss_coeff=0.01)),
    # DeepSeek-V3 (671B, 37B active; its MTP module not included): MLA with YaRN, 3 dense layers, then
    # 256 routed experts (top-8 of 8 groups, 4 groups per token, sigmoid scores, expert bias) and one
    # shared expert per layer. Kimi-K2 (1.04T, 32B active) and Moonlight-16B-A3B are the same
    # architecture (HF loads them as deepseek_v3); DeepSeek-V2-Lite (15.7B, 2.4B active) routes by softmax.
    "deepseek-v3": _deepseek(61, 7168, 128, 18432, vocab_size=129280, q_lora_rank=1536, max_position_embeddings=163840,
                             rope=dict(_YARN, rotary_scaling_factor=40.0), moe_layer_freq=[0] * 3 + [1] * 58,
                             experts=256, topk=8, groups=(8, 4), scaling=2.5),
    "kimi-k2": _deepseek(61, 7168, 64, 18432, vocab_size=163840, q_lora_rank=1536, max_position_embeddings=131072,
                         rope=dict(_YARN, rotary_scaling_factor=32.0, rotary_base=50000.0, beta_fast=1.0),
                         moe_layer_freq=[0] + [1] * 60, experts=384, topk=8, scaling=2.827),
    "moonlight-16b-a3b": _deepseek(27, 2048, 16, 11264, vocab_size=163840, max_position_embeddings=8192,
                                   rope=dict(rotary_base=50000.0), norm_epsilon=1e-5, moe_layer_freq=[0] + [1] * 26,
                                   experts=64, topk=6, shared=2, scaling=2.446),
    "deepseek-v2-lite": _deepseek(27, 2048, 16, 10944, family="deepseek_v2", vocab_size=102400,
                                  max_position_embeddings=163840,
                                  rope=dict(_YARN, rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707),
                                  moe_layer_freq=[0] + [1] * 26, experts=64, topk=6, shared=2,
                                  router=dict(moe_router_pre_softmax=True, moe_router_norm_topk_prob=False)),
    "glm-4.5-air": _glm(46, 4096, 10944, 1408, experts=128, dense=1, scaling=1.0, qk_norm=False),
    "glm-4.5": _glm(92, 5120, 12288, 1536, experts=160, dense=3, scaling=2.5, qk_norm=True),
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, moe=dict(num_experts=32, moe_router_topk=4, moe_ffn_hidden_size=2880)),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36,
                         moe=dict(num_experts=128, moe_router_topk=4, moe_ffn_hidden_size=2880)),
    "mixtral-8x7b": dict(_MIXTRAL, **_shape(32, 4096, 32), ffn_hidden_size=14336,
                         moe=dict(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.02)),
    "mixtral-8x22b": dict(_MIXTRAL, **_shape(56, 6144, 48), ffn_hidden_size=16384, vocab_size=32768,
                          max_position_embeddings=65536,
                          moe=dict(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.001)),
    "qwen1.5-moe-a2.7b": dict(_QWEN25, family="qwen2_moe", **_shape(24, 2048, 16), num_query_groups=16,
                              ffn_hidden_size=5632, vocab_size=151936, max_position_embeddings=8192,
                              moe=dict(num_experts=60, moe_router_topk=4, moe_ffn_hidden_size=1408,
                                       moe_shared_expert_intermediate_size=5632, moe_shared_expert_gate=True,
                                       moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001)),
    "qwen3-30b-a3b": dict(_QWEN3, family="qwen3_moe", **_shape(48, 2048, 32), num_query_groups=4,
                          ffn_hidden_size=6144,
                          moe=dict(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                                   moe_aux_loss_coeff=0.001)),
    "qwen3-235b-a22b": dict(_QWEN3, family="qwen3_moe", **_shape(94, 4096, 64), num_query_groups=4,
                            ffn_hidden_size=12288,
                            moe=dict(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536,
                                     moe_aux_loss_coeff=0.001)),
    # Nemotron-H-8B-Base-8K (8,100,852,736 parameters): 24 Mamba-2, 4 attention (GQA, no positions)
    # and 24 squared-ReLU MLP layers, one block each; HF's dt floor (time_step_min) kept.
    "nemotron-h-8b": dict(family="nemotron_h", num_layers=52, hidden_size=4096, num_attention_heads=32,
                          num_query_groups=8, kv_channels=128, ffn_hidden_size=21504, vocab_size=131072,
                          max_position_embeddings=8192, seq_length=8192, normalization="RMSNorm", norm_epsilon=1e-5,
                          position_embedding_type="none", add_bias_linear=False, squared_relu=True,
                          untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
                          hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                          mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, mamba_num_heads=128,
                          mamba_time_step_min=0.001),
}
MODELS["deepseek-v3-shaped"] = MODELS["deepseek-v3"]  # its former name (standard attention then; MLA now)
# DeepSeek-V3.2 (671B + 0.85B of indexers; its MTP module not included): DeepSeek-V3 with DSA, a
# lightning indexer (64 heads of 128 channels, top-2048 keys) in every layer.
MODELS["deepseek-v3.2"] = dict(MODELS["deepseek-v3"], family="deepseek_v32", experimental_attention_variant="dsa",
                               dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=2048)


# The built-in default run (`torchrun pretrain_gpt.py` with no --model): the model above, and its
# schedule. A preset value is dropped when the command line gives one of the flags it depends on.
DEFAULT_RUN = {"model": "gpt2-small-cpu",
               "training": {"train_iters": 300, "min_lr": 1e-4, "lr_warmup_iters": 20, "lr_decay_style": "cosine"},
               "unless": {"train_iters": ("train_samples",), "min_lr": ("lr",),
                          "lr_warmup_iters": ("train_iters", "train_samples", "lr_warmup_fraction",
                                              "lr_warmup_samples")}}


def get_model_config(name: str) -> dict:
    """The named configuration as flag-name -> value (ModelConfig fields plus seq_length)."""
    if name not in MODELS:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(sorted(MODELS))}")
    return dict(MODELS[name])


def zoo():
    """The zoo as the command line reads it (megatron_lite.arguments.Zoo)."""
    from megatron_lite.arguments import Zoo
    return Zoo(get_model_config, DEFAULT_RUN)
