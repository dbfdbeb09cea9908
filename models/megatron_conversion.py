"""Megatron-Core GPT models in megatron-lite terms: the model config from a Megatron-LM run's args,
the table of Megatron-Core's full-tensor names (hf_conversion's Rule engine), and how Megatron-LM
splits each tensor over tensor-parallel ranks (to merge the per-rank files of legacy checkpoints).

Names are those of Megatron-Core's distributed checkpoints (also the Transformer Engine spec's):
the pre-attention and pre-MLP norms are `self_attention.linear_qkv.layer_norm_*` and
`mlp.linear_fc1.layer_norm_*`; the local spec's state dict calls them `input_layernorm.*` and
`pre_mlp_layernorm.*` (ALIASES). A full tensor is what every TP rank's piece makes together:
`linear_qkv` per query group [its query heads; k; v], SwiGLU's `linear_fc1` [gate; up], the
vocabulary padded (readers trim it to the true vocabulary).

Anything in the args the GPT model cannot compute the same way is a ConversionError naming it.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.transformer.moe import MoEConfig

from .hf_conversion import ConversionError, R

D = "decoder.layers.{i}."
MEGATRON_RULES = [
    R("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    R("embedding.position_embeddings.weight", "embedding.position_embeddings.weight", when="learned_pos"),
    R("layers.{i}.input_layernorm.weight", D + "self_attention.linear_qkv.layer_norm_weight"),
    R("layers.{i}.input_layernorm.bias", D + "self_attention.linear_qkv.layer_norm_bias", when="layernorm"),
    R(("layers.{i}.self_attention.linear_q.weight", "layers.{i}.self_attention.linear_kv.weight"),
      D + "self_attention.linear_qkv.weight", "qkv", when="mha"),
    R(("layers.{i}.self_attention.linear_q.bias", "layers.{i}.self_attention.linear_kv.bias"),
      D + "self_attention.linear_qkv.bias", "qkv", when=("mha", "qkv_bias")),
    R("layers.{i}.self_attention.linear_proj.weight", D + "self_attention.linear_proj.weight"),
    # multi-latent attention: Megatron-Core's names are ours; its RoPE rows are interleaved pairs, as
    # DeepSeek's (its MLA de-interleaves them before rotating), ours in half-split order
    *[R(f"layers.{{i}}.self_attention.{n}.weight", D + f"self_attention.{n}.weight", op, when=("mla",) + extra)
      for n, op, extra in (("linear_q_proj", "rope_q", ("q_full",)), ("linear_q_down_proj", "copy", ("q_lora",)),
                           ("q_layernorm", "copy", ("q_lora",)), ("linear_q_up_proj", "rope_q", ("q_lora",)),
                           ("linear_kv_down_proj", "rope_kv", ()), ("kv_layernorm", "copy", ()),
                           ("linear_kv_up_proj", "copy", ()))],
    R("layers.{i}.self_attention.linear_proj.bias", D + "self_attention.linear_proj.bias", when="bias"),
    R("layers.{i}.self_attention.q_layernorm.weight", D + "self_attention.q_layernorm.weight", when="qk_norm"),
    R("layers.{i}.self_attention.q_layernorm.bias", D + "self_attention.q_layernorm.bias", when=("qk_norm", "layernorm")),
    R("layers.{i}.self_attention.k_layernorm.weight", D + "self_attention.k_layernorm.weight", when="qk_norm"),
    R("layers.{i}.self_attention.k_layernorm.bias", D + "self_attention.k_layernorm.bias", when=("qk_norm", "layernorm")),
    R("layers.{i}.pre_mlp_layernorm.weight", D + "mlp.linear_fc1.layer_norm_weight"),
    R("layers.{i}.pre_mlp_layernorm.bias", D + "mlp.linear_fc1.layer_norm_bias", when="layernorm"),
    R("layers.{i}.mlp.linear_fc1.weight", D + "mlp.linear_fc1.weight", when="dense"),
    R("layers.{i}.mlp.linear_fc1.bias", D + "mlp.linear_fc1.bias", when=("dense", "bias")),
    R("layers.{i}.mlp.linear_fc2.weight", D + "mlp.linear_fc2.weight", when="dense"),
    R("layers.{i}.mlp.linear_fc2.bias", D + "mlp.linear_fc2.bias", when=("dense", "bias")),
    # MoE layers (SequentialMLP: one MLP per expert, `{e}` the global expert number)
    R("layers.{i}.mlp.router.weight", D + "mlp.router.weight", when="moe"),
    R("layers.{i}.mlp.router.expert_bias", D + "mlp.router.expert_bias", when=("moe", "expert_bias")),
    R("layers.{i}.mlp.router.bias", D + "mlp.router.bias", when=("moe", "bias")),
    R("layers.{i}.mlp.experts.weight1", D + "mlp.experts.local_experts.{e}.linear_fc1.weight", "experts", when="moe"),
    R("layers.{i}.mlp.experts.weight2", D + "mlp.experts.local_experts.{e}.linear_fc2.weight", "experts", when="moe"),
    R("layers.{i}.mlp.experts.bias1", D + "mlp.experts.local_experts.{e}.linear_fc1.bias", "experts",
      when=("moe", "bias")),
    R("layers.{i}.mlp.experts.bias2", D + "mlp.experts.local_experts.{e}.linear_fc2.bias", "experts",
      when=("moe", "bias")),
    R("layers.{i}.mlp.shared_experts.linear_fc1.weight", D + "mlp.shared_experts.linear_fc1.weight",
      when=("moe", "shared_expert")),
    R("layers.{i}.mlp.shared_experts.linear_fc2.weight", D + "mlp.shared_experts.linear_fc2.weight",
      when=("moe", "shared_expert")),
    R("layers.{i}.mlp.shared_experts.gate_weight", D + "mlp.shared_experts.gate_weight",
      when=("moe", "shared_expert", "shared_gate")),
    R("final_norm.weight", "decoder.final_layernorm.weight"),
    R("final_norm.bias", "decoder.final_layernorm.bias", when="layernorm"),
    R("output_layer.weight", "output_layer.weight", when="untied"),
]
# Local-spec state-dict names of the norms that the distributed checkpoint (and TE) fold into the
# next linear layer: canonical fragment -> the local one.
ALIASES = {".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
           ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm."}
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
IGNORED = ("_extra_state",)  # Transformer Engine's FP8 metadata (None in the local spec)


# --- tensor parallelism of Megatron-LM's per-rank tensors ---------------------------------------
# split along dim 0 (weight and bias); MLA's down-projections too (Megatron-Core's local spec makes them
# column-parallel and gathers their output)
_COLUMN = ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer", "linear_q_proj", "linear_q_down_proj",
           "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
_ROW = ("linear_proj", "linear_fc2")  # weight split along dim 1, bias whole


def tp_split(name: str) -> Tuple[Optional[int], bool]:
    """(dim along which TP ranks hold pieces, or None if each holds it whole; whether it is an MLP's
    first linear, whose pieces under SwiGLU are [gate piece; up piece]) of a Megatron-Core name."""
    parts = name.split(".")
    module, param = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if param not in ("weight", "bias"):  # layer_norm_weight / layer_norm_bias inside a fused linear: whole
        return None, False
    if module in _COLUMN:
        return 0, module == "linear_fc1"
    if module in _ROW and param == "weight":
        return 1, False
    return None, False


def merge_tp(name: str, pieces, swiglu: bool) -> torch.Tensor:
    """The full tensor from every TP rank's piece of `name` (in TP rank order)."""
    dim, fc1 = tp_split(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if fc1 and swiglu:  # each rank holds [its gate rows; its up rows]
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(pieces), dim=dim)


def split_tp(name: str, full: torch.Tensor, tp: int, swiglu: bool) -> list:
    """Every TP rank's piece of the full tensor `name` (merge_tp's inverse)."""
    dim, fc1 = tp_split(name)
    if dim is None or tp == 1:
        return [full] * tp
    if fc1 and swiglu:  # rank r holds [its gate rows; its up rows]
        gate, up = (h.chunk(tp, dim=0) for h in full.chunk(2, dim=0))
        return [torch.cat([g, u]) for g, u in zip(gate, up)]
    return list(full.chunk(tp, dim=dim))


def megatron_args_of_config(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> Dict[str, Any]:
    """The model-defining fields of the args Megatron-LM saves (model_config_from_megatron_args'
    inverse); a ConversionError naming what Megatron-Core's GPT cannot express."""
    if cfg.experimental_attention_variant or cfg.attention_output_gate:
        raise ConversionError("linear-attention layers and the attention output gate are not converted to Megatron-LM "
                              "checkpoints yet (the Gated DeltaNet conversion tables come next)")
    if cfg.hybrid_override_pattern is not None:
        raise ConversionError("Mamba hybrids (--hybrid-override-pattern) are not converted to Megatron-LM yet "
                              "(Megatron-Core's MambaModel names): use the HF nemotron_h conversion")
    if cfg.window_size:
        raise ConversionError(f"window_size={cfg.window_size} (sliding-window attention) has no Megatron-LM flag")
    if cfg.qk_layernorm_full_width:
        raise ConversionError("q/k norms over all heads (--qk-layernorm-full-width, OLMoE) have no Megatron-Core "
                              "equivalent (its --qk-layernorm normalizes each head)")
    if cfg.quick_geglu or cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None:
        raise ConversionError("quick-GeGLU / a GLU linear offset / a clamped activation are not written to "
                              "Megatron-LM yet")
    if cfg.mtp_depth:
        raise ConversionError(f"multi-token prediction layers (mtp_num_layers={cfg.mtp_num_layers}) are not written "
                              f"to Megatron-LM yet")
    if cfg.rope_scaling_type == "llama3" and (cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
                                  cfg.rope_scaling_original_max_position) != (1.0, 4.0, 8192):
        raise ConversionError("Llama-3.1 RoPE scaling other than factors 1 / 4 at 8192 positions has no "
                              "Megatron-LM flag")
    if cfg.moe is not None and cfg.moe.num_experts and cfg.add_bias_linear and tp > 1:
        raise ConversionError("MoE with biases at tp > 1: Megatron-Core takes expert biases at expert tensor parallel "
                              "size 1 only, and the experts here would be split over TP; write at "
                              "--tensor-model-parallel-size 1")
    gqa = cfg.num_query_groups != cfg.num_attention_heads
    tanh = cfg.activation == "gelu_tanh" and not cfg.swiglu
    return dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
                num_attention_heads=cfg.num_attention_heads, group_query_attention=gqa,
                num_query_groups=cfg.num_query_groups if gqa else 1, kv_channels=cfg.kv_channels,
                max_position_embeddings=cfg.max_position_embeddings,
                position_embedding_type=cfg.position_embedding_type,
                add_position_embedding=cfg.position_embedding_type == "learned_absolute",
                rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
                rotary_percent=cfg.rotary_percent, use_rope_scaling=cfg.rope_scaling_type == "llama3",
                rope_scaling_factor=cfg.rope_scaling_factor, normalization=cfg.normalization,
                norm_epsilon=cfg.norm_epsilon, swiglu=cfg.swiglu, openai_gelu=tanh, bias_gelu_fusion=False,
                add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias, qk_layernorm=cfg.qk_layernorm,
                apply_layernorm_1p=cfg.apply_layernorm_1p,
                untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
                hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                init_method_std=cfg.init_method_std, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                padded_vocab_size=cfg.padded_vocab_size(tp), tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, use_legacy_models=False,
                **mla_args_of_config(cfg),
                transformer_impl="local", **(moe_args_of_config(cfg, ep) or {"num_experts": None}))


# Multi-latent attention and its YaRN RoPE: Megatron-LM's args of the same names as our config's fields
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_YARN_FIELDS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim")


def mla_args_of_config(cfg: ModelConfig) -> Dict[str, Any]:
    if not cfg.multi_latent_attention:
        if cfg.rope_scaling_type == "yarn":
            raise ConversionError("YaRN RoPE without multi-latent attention has no Megatron-LM GPT flag")
        return {"multi_latent_attention": False}
    yarn = cfg.rope_scaling_type == "yarn"
    if yarn and not cfg.yarn_correction_range_round_to_int:
        raise ConversionError("YaRN without rounded correction-range ends (--no-yarn-correction-range-round-to-int) "
                              "is not written to Megatron-LM checkpoints yet")
    return dict({k: getattr(cfg, k) for k in _MLA_FIELDS + (_YARN_FIELDS if yarn else ())},
                multi_latent_attention=True, rope_type="yarn" if yarn else "rope")


def mla_config_from_megatron_args(a: Mapping[str, Any]) -> Dict[str, Any]:
    """Our config fields of a Megatron-LM MLA run's args (Megatron-LM's MLA takes YaRN unless
    --rope-type rope)."""
    if not a.get("multi_latent_attention"):
        return {}
    kw = {k: a[k] for k in _MLA_FIELDS if a.get(k) is not None}
    if (a.get("rope_type") or "yarn") == "yarn":
        kw.update({k: float(a[k]) if k != "original_max_position_embeddings" else int(a[k])
                   for k in _YARN_FIELDS if a.get(k) is not None}, rope_scaling_type="yarn")
    return dict(kw, multi_latent_attention=True)


# Our MoEConfig fields that are Megatron-LM args of the same name and meaning (the others: ours only)
_MOE_OURS_ONLY = ("moe_router_norm_topk_prob",)


def moe_args_of_config(cfg: ModelConfig, ep: int) -> Dict[str, Any]:
    """The MoE args Megatron-LM saves (its MoEConfig fields have Megatron's names), experts as
    SequentialMLP (one MLP per expert: --moe-grouped-gemm off); {} for a dense model."""
    moe = cfg.moe
    if moe is None or not moe.num_experts:
        return {}
    if moe.moe_router_norm_topk_prob is not None and moe.moe_router_norm_topk_prob != replace(
            moe, moe_router_norm_topk_prob=None).normalizes_topk:
        raise ConversionError(f"moe_router_norm_topk_prob={moe.moe_router_norm_topk_prob} (from a HF config) differs "
                              f"from Megatron-LM's rule for {moe.moe_router_score_function} scores: no Megatron-LM "
                              f"flag expresses it")
    if cfg.add_bias_linear and moe.moe_shared_expert_intermediate_size:
        raise ConversionError("a shared expert with --add-bias-linear: Megatron-Core's has biases, ours has none; "
                              "add --disable-bias-linear")
    out = {f.name: getattr(moe, f.name) for f in fields(moe) if f.name not in _MOE_OURS_ONLY}
    return dict(out, moe_grouped_gemm=False, expert_tensor_parallel_size=None)


# --- model config from Megatron-LM's args ---------------------------------------------------------
# Megatron-LM settings the GPT model here cannot compute the same way: the arg -> (what it is, the
# values that are fine: its defaults).
_OFF = (None, False, 0)
_UNSUPPORTED = {
    "use_legacy_models": ("legacy (pre-Megatron-Core) models", _OFF),
    "mtp_num_layers": ("multi-token prediction layers", _OFF),
    "rotary_interleaved": ("interleaved RoPE", _OFF),
    "rotary_seq_len_interpolation_factor": ("RoPE position interpolation", _OFF + (1, 1.0)),
    "qk_l2_norm": ("L2 norm of queries and keys", _OFF),
    "squared_relu": ("squared-ReLU MLP activation", _OFF),
    "quick_geglu": ("quick-GeGLU MLP activation", _OFF),
    "glu_linear_offset": ("an offset in the GLU", _OFF + (0.0,)),
    "activation_func_clamp_value": ("clamped MLP activations", _OFF),
    "apply_residual_connection_post_layernorm": ("residual connections after the norm", _OFF),
    "window_size": ("sliding-window attention", _OFF),
    "yarn_correction_range_round_to_int": ("YaRN without rounded correction-range ends", (None, True)),
    "softmax_scale": ("a custom attention softmax scale", _OFF),
    "softmax_type": ("attention sinks (a softmax other than vanilla)", _OFF + ("vanilla",)),
    "no_rope_freq": ("layers without RoPE", _OFF),
    "attention_output_gate": ("gated attention output", _OFF),
    "experimental_attention_variant": ("an experimental attention variant", _OFF),
    "heterogeneous_layers_config_path": ("heterogeneous layers", _OFF),
    "heterogeneous_layers_config_encoded_json": ("heterogeneous layers", _OFF),
}


def true_vocab_size(a: Mapping[str, Any], given: Optional[int]) -> Optional[int]:
    """The tokenizer's vocabulary: `given`, else what Megatron-LM's NullTokenizer has (vocab_size
    ids + its end of document), else None (keep every row of the padded vocabulary)."""
    if given is not None:
        return given
    if a.get("tokenizer_type") == "NullTokenizer" and a.get("vocab_size"):
        return int(a["vocab_size"]) + 1
    return None


def model_config_from_megatron_args(a: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    """Our GPT config of a Megatron-LM run's args (a dict of its Namespace, flags merged in)."""
    for key, (what, fine) in _UNSUPPORTED.items():
        if a.get(key) not in fine:
            raise ConversionError(f"{key}={a[key]!r} ({what}) is not supported")
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if not a.get(key):
            raise ConversionError(f"the checkpoint's args lack {key}: give --{key.replace('_', '-')}")
    norm = a.get("normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise ConversionError(f"normalization {norm!r} is not supported; supported: LayerNorm, RMSNorm")
    position = a.get("position_embedding_type", "learned_absolute")
    if a.get("use_rotary_position_embeddings"):  # Megatron-LM's older switch
        position = "rope"
    elif position == "learned_absolute" and a.get("add_position_embedding") is False:
        position = "none"
    if position not in ("learned_absolute", "rope", "none"):
        raise ConversionError(f"position_embedding_type {position!r} is not supported; supported: "
                              f"learned_absolute, rope, none")
    swiglu, bias = bool(a.get("swiglu")), a.get("add_bias_linear", True)
    # Megatron-Core's fused bias-GELU (--bias-gelu-fusion, on by default) is the tanh approximation.
    tanh = a.get("openai_gelu") or (a.get("bias_gelu_fusion") and bias)
    heads = a["num_attention_heads"]
    kw = dict(num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=heads,
              num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else heads,
              ffn_hidden_size=a.get("ffn_hidden_size"), kv_channels=a.get("kv_channels"), vocab_size=vocab_size,
              max_position_embeddings=a.get("max_position_embeddings") or a.get("seq_length") or 1024,
              normalization=norm, norm_epsilon=float(a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5))),
              position_embedding_type=position, rotary_base=float(a.get("rotary_base", 10000)),
              rotary_percent=float(a.get("rotary_percent", 1.0)), swiglu=swiglu,
              activation="gelu_tanh" if tanh and not swiglu else "gelu", add_bias_linear=bool(bias),
              add_qkv_bias=bool(a.get("add_qkv_bias", False)), qk_layernorm=bool(a.get("qk_layernorm", False)),
              apply_layernorm_1p=bool(a.get("apply_layernorm_1p", False)),
              untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights", False)),
              attention_dropout=float(a.get("attention_dropout", 0.1)), hidden_dropout=float(a.get("hidden_dropout", 0.1)),
              init_method_std=float(a.get("init_method_std", 0.02)),
              make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by"))
    if a.get("use_rope_scaling"):
        kw.update(rope_scaling_type="llama3", rope_scaling_factor=float(a.get("rope_scaling_factor", 8.0)))
    if a.get("num_experts"):
        kw["moe"] = moe_config_from_megatron_args(a)
    kw.update(mla_config_from_megatron_args(a))
    return ModelConfig(**{k: v for k, v in kw.items() if v is not None})


def moe_config_from_megatron_args(a: Mapping[str, Any]) -> MoEConfig:
    """Our MoEConfig of a Megatron-LM MoE run's args (same names; Megatron's defaults where absent)."""
    if a.get("add_bias_linear", True) and a.get("moe_shared_expert_intermediate_size"):
        raise ConversionError("a shared expert with add_bias_linear=True: Megatron-Core's has biases, the shared "
                              "expert here has none")
    names = {f.name for f in fields(MoEConfig)} - set(_MOE_OURS_ONLY)
    return MoEConfig(**{k: a[k] for k in names if a.get(k) is not None})


def layout_of_args(a: Mapping[str, Any]) -> Dict[str, int]:
    """The TP / PP / EP sizes the checkpoint was written with (1 where the args do not say)."""
    return {"tp": int(a.get("tensor_model_parallel_size") or 1), "pp": int(a.get("pipeline_model_parallel_size") or 1),
            "ep": int(a.get("expert_model_parallel_size") or 1)}
