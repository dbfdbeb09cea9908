"""Hugging Face `nemotron_h` (Nemotron-H): Mamba-2, attention and squared-ReLU MLP layers, one block
each (--hybrid-override-pattern), as a declarative table and the config mapping both ways.

HF names each layer's one norm `backbone.layers.{i}.norm` (`model.` in memory) and its block `mixer` whatever its kind: ours
are the input norm and self-attention slot of an M / * layer, the pre-MLP norm and MLP slot of a -
layer. The Mamba-2 tensors keep their names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
Attention has no position embedding, no biases, grouped K/V heads. MoE layers (E) are not mapped yet.
"""
from __future__ import annotations

from megatron_lite.config import ModelConfig

from .hf_rules import ConversionError, R

L = "backbone.layers.{i}."  # on disk (save_pretrained, the Hub); in memory transformers says model.
_MAMBA = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
RULES = [
    R("embedding.word_embeddings.weight", "backbone.embeddings.weight"),
    R("layers.{i}.input_layernorm.weight", L + "norm.weight", when="mixer_layer"),
    *[R(f"layers.{{i}}.self_attention.{n}", L + f"mixer.{n}", when="mamba_layer") for n in _MAMBA],
    R("layers.{i}.self_attention.linear_q.weight", L + "mixer.q_proj.weight", when="attention_layer"),
    R("layers.{i}.self_attention.linear_kv.weight", (L + "mixer.k_proj.weight", L + "mixer.v_proj.weight"), "cat",
      when="attention_layer"),
    R("layers.{i}.self_attention.linear_proj.weight", L + "mixer.o_proj.weight", when="attention_layer"),
    R("layers.{i}.pre_mlp_layernorm.weight", L + "norm.weight", when="mlp_layer"),
    R("layers.{i}.mlp.linear_fc1.weight", L + "mixer.up_proj.weight", when="mlp_layer"),
    R("layers.{i}.mlp.linear_fc2.weight", L + "mixer.down_proj.weight", when="mlp_layer"),
    R("final_norm.weight", "backbone.norm_f.weight"),
    R("output_layer.weight", "lm_head.weight", when="untied"),
]
RENAMES = {"model.": "backbone."}  # transformers' in-memory prefix -> the on-disk one
_LETTER = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def to_ours(c) -> ModelConfig:
    pattern = "".join(_LETTER[t] for t in c.layer_types)
    if "E" in pattern:
        raise ConversionError("nemotron_h MoE layers (E) are not converted yet: a dense Nemotron-H only")
    checks = {"mlp_hidden_act relu2": c.mlp_hidden_act == "relu2", "mamba_hidden_act silu": c.mamba_hidden_act == "silu",
              "no biases": not (c.use_bias or c.mlp_bias or c.attention_bias or c.mamba_proj_bias),
              "use_conv_bias": c.use_conv_bias, "conv_kernel 4": c.conv_kernel == 4}
    missing = [what for what, ok in checks.items() if not ok]
    if missing:
        raise ConversionError(f"nemotron_h config needs {', '.join(missing)}")
    return ModelConfig(
        num_layers=len(pattern), hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings, normalization="RMSNorm",
        norm_epsilon=c.layer_norm_epsilon, position_embedding_type="none", add_bias_linear=False,
        squared_relu=True, untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        attention_dropout=float(c.attention_dropout or 0.0), hidden_dropout=0.0, family="nemotron_h",
        hybrid_override_pattern=pattern, mamba_state_dim=c.ssm_state_size, mamba_head_dim=c.mamba_head_dim,
        mamba_num_groups=c.n_groups, mamba_num_heads=c.mamba_num_heads, mamba_chunk_size=c.chunk_size,
        mamba_time_step_min=c.time_step_min)


def to_hf(cfg: ModelConfig):
    import transformers  # optional dependency: import on use

    if not cfg.hybrid_override_pattern or "E" in cfg.hybrid_override_pattern:
        raise ConversionError("nemotron_h needs --hybrid-override-pattern of M, * and - layers (no E yet)")
    types = {v: k for k, v in _LETTER.items()}
    heads = cfg.mamba_num_heads or 2 * cfg.hidden_size // cfg.mamba_head_dim
    return transformers.NemotronHConfig(
        layer_types=[types[k] for k in cfg.hybrid_override_pattern], hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_epsilon,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights, attention_dropout=cfg.attention_dropout,
        ssm_state_size=cfg.mamba_state_dim, mamba_head_dim=cfg.mamba_head_dim, n_groups=cfg.mamba_num_groups,
        mamba_num_heads=heads, chunk_size=cfg.mamba_chunk_size, time_step_min=cfg.mamba_time_step_min,
        mlp_hidden_act="relu2", use_bias=False, mlp_bias=False, attention_bias=False, mamba_proj_bias=False,
        use_conv_bias=True, conv_kernel=4, architectures=["NemotronHForCausalLM"])
