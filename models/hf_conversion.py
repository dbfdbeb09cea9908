"""Conversion between Hugging Face checkpoints (GPT-2, Llama) and megatron-lite weights.

The pure functions map FULL state dicts: unsharded, true vocabulary (no TP padding), named by
megatron-lite's layout-independent parameter names. Sharding to a TP layout and back is done
only by `load_full_state_dict_into_model` / `gather_full_state_dict`, using each parameter's
sharding metadata, so a converted checkpoint loads at any TP size.

Layout differences handled here:
- GPT-2 uses Conv1D: weights stored [in, out], the transpose of nn.Linear; its `c_attn` is one
  fused [Q | K | V] projection, which we split into linear_q and linear_kv ([K ; V]).
- Llama keeps q/k/v and gate/up separate; we fuse K;V and gate;up. RoPE needs no permutation:
  both sides use the rotate_half convention.
- Tied embeddings: we hold no output_layer; HF's lm_head is the embedding.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.sharding import gather_full, spec_of, stored_name
from models.gpt import WORD_EMBEDDINGS

StateDict = Dict[str, torch.Tensor]
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
OUTPUT_LAYER = "output_layer.weight"
# HF buffers that older checkpoints carry and that hold no weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class ConversionError(ValueError):
    """A checkpoint or config this converter cannot map exactly. The message says why."""


# --- configs ----------------------------------------------------------------------------------
def hf_config_to_model_config(hf_config) -> ModelConfig:
    """ModelConfig equivalent to a transformers GPT2Config or LlamaConfig."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return _gpt2_model_config(hf_config)
    if kind == "llama":
        return _llama_model_config(hf_config)
    raise ConversionError(f"unsupported architecture {kind!r}; supported: {', '.join(ARCHITECTURES)}")


def _gpt2_model_config(c) -> ModelConfig:
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(c.activation_function)
    if act is None:
        raise ConversionError(f"GPT-2 activation_function {c.activation_function!r} is not supported")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(c, "reorder_and_upcast_attn", False):
        raise ConversionError("GPT-2 scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not getattr(c, "scale_attn_weights", True):
        raise ConversionError("GPT-2 scale_attn_weights=False is not supported")
    return ModelConfig(
        num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
        ffn_hidden_size=c.n_inner or 4 * c.n_embd, vocab_size=c.vocab_size, max_position_embeddings=c.n_positions,
        normalization="LayerNorm", norm_epsilon=c.layer_norm_epsilon, position_embedding_type="learned_absolute",
        swiglu=False, activation=act, add_bias_linear=True,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        attention_dropout=float(c.attn_pdrop), hidden_dropout=float(c.resid_pdrop))


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ConversionError(f"Llama rope_type {kind!r} (RoPE scaling) is not supported")
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _llama_model_config(c) -> ModelConfig:
    if c.hidden_act != "silu":
        raise ConversionError(f"Llama hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")
    attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    if attn_bias != mlp_bias:  # our add_bias_linear puts biases on all linears or none
        raise ConversionError("Llama attention_bias and mlp_bias must be equal to convert")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return ModelConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads or c.num_attention_heads, kv_channels=head_dim,
        ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings, normalization="RMSNorm", norm_epsilon=c.rms_norm_eps,
        position_embedding_type="rope", rotary_base=_rope_theta(c), swiglu=True, add_bias_linear=attn_bias,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)), hidden_dropout=0.0)


def model_family(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama': the HF family that can represent `cfg` exactly."""
    if cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute" and not cfg.swiglu:
        if not cfg.add_bias_linear or cfg.num_query_groups != cfg.num_attention_heads \
                or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConversionError("GPT-2 needs biases, plain multi-head attention and head_dim = hidden / heads")
        return "gpt2"
    if cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope" and cfg.swiglu:
        if cfg.add_qkv_bias and not cfg.add_bias_linear:
            raise ConversionError("Llama has no QKV-only bias (add_qkv_bias); cannot convert")
        return "llama"
    raise ConversionError("model is neither GPT-2-like (LayerNorm, learned positions, GELU) "
                          "nor Llama-like (RMSNorm, RoPE, SwiGLU)")


def _check_family(cfg: ModelConfig, family: Optional[str]) -> str:
    inferred = model_family(cfg)
    if family is not None and family != inferred:
        raise ConversionError(f"model config is {inferred}-like, not {family}")
    return inferred


def model_config_to_hf_config(cfg: ModelConfig, family: Optional[str] = None):
    """The transformers config (GPT2Config / LlamaConfig) of `cfg`; family inferred when None."""
    from transformers import GPT2Config, LlamaConfig  # optional dependency: import on use

    family = _check_family(cfg, family)
    tied = not cfg.untie_embeddings_and_output_weights
    # Default special-token ids outside a small vocabulary only trigger warnings: drop them.
    if family == "gpt2":
        special = 50256 if cfg.vocab_size > 50256 else None
        return GPT2Config(
            n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
            n_inner=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_epsilon,
            activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            tie_word_embeddings=tied, attn_pdrop=cfg.attention_dropout, resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout, bos_token_id=special, eos_token_id=special,
            architectures=[ARCHITECTURES[family]])
    return LlamaConfig(
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        hidden_act="silu", attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
        attention_dropout=cfg.attention_dropout, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, architectures=[ARCHITECTURES[family]])


# --- weights: HF -> ours ----------------------------------------------------------------------
class _Source:
    """An HF state dict read once per key; leftover keys at the end are an error."""

    def __init__(self, sd: StateDict):
        self.sd, self.unused = sd, set(sd)

    def take(self, key: str) -> torch.Tensor:
        if key not in self.sd:
            raise ConversionError(f"HF checkpoint is missing {key!r}")
        self.unused.discard(key)
        return self.sd[key]

    def check_consumed(self) -> None:
        left = sorted(k for k in self.unused if not k.endswith(_IGNORED_SUFFIXES))
        if left:
            raise ConversionError(f"HF checkpoint has {len(left)} unexpected tensors, e.g. {left[:3]}")


def _normalize_gpt2_keys(sd: StateDict) -> StateDict:
    """Checkpoints saved from GPT2Model (e.g. the original `gpt2`) lack the `transformer.` prefix."""
    if any(k.startswith("transformer.") for k in sd):
        return sd
    return {(k if k.startswith("lm_head.") else "transformer." + k): v for k, v in sd.items()}


def hf_to_megatron_lite(hf_state_dict: StateDict, cfg: ModelConfig) -> StateDict:
    """Full megatron-lite state dict from a GPT2LMHeadModel / LlamaForCausalLM state dict."""
    family = model_family(cfg)
    if family == "gpt2":
        src = _Source(_normalize_gpt2_keys(hf_state_dict))
        out = _gpt2_to_ours(src, cfg)
    else:
        src = _Source(hf_state_dict)
        out = _llama_to_ours(src, cfg)
    if cfg.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = src.take("lm_head.weight")
    else:
        src.unused.discard("lm_head.weight")  # tied: a copy of the embedding, if present
    src.check_consumed()
    return out


def _gpt2_to_ours(src: _Source, cfg: ModelConfig) -> StateDict:
    h = cfg.hidden_size
    out = {WORD_EMBEDDINGS: src.take("transformer.wte.weight"),
           "embedding.position_embeddings.weight": src.take("transformer.wpe.weight")}
    for i in range(cfg.num_layers):
        hf, us = f"transformer.h.{i}.", f"layers.{i}."
        qkv_w = src.take(hf + "attn.c_attn.weight").t()  # Conv1D [h, 3h] -> [3h, h] = [Q; K; V]
        qkv_b = src.take(hf + "attn.c_attn.bias")
        out[us + "self_attention.linear_q.weight"] = qkv_w[:h].contiguous()
        out[us + "self_attention.linear_kv.weight"] = qkv_w[h:].contiguous()
        out[us + "self_attention.linear_q.bias"] = qkv_b[:h].clone()
        out[us + "self_attention.linear_kv.bias"] = qkv_b[h:].clone()
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            out[us + ours + ".weight"] = src.take(hf + theirs + ".weight").t().contiguous()
            out[us + ours + ".bias"] = src.take(hf + theirs + ".bias")
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for leaf in ("weight", "bias"):
                out[us + f"{ours}.{leaf}"] = src.take(hf + f"{theirs}.{leaf}")
    out["final_norm.weight"] = src.take("transformer.ln_f.weight")
    out["final_norm.bias"] = src.take("transformer.ln_f.bias")
    return out


def _llama_to_ours(src: _Source, cfg: ModelConfig) -> StateDict:
    leaves = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    out = {WORD_EMBEDDINGS: src.take("model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        for leaf in leaves:
            out[us + f"self_attention.linear_q.{leaf}"] = src.take(hf + f"self_attn.q_proj.{leaf}")
            out[us + f"self_attention.linear_kv.{leaf}"] = torch.cat(
                [src.take(hf + f"self_attn.k_proj.{leaf}"), src.take(hf + f"self_attn.v_proj.{leaf}")])
            out[us + f"self_attention.linear_proj.{leaf}"] = src.take(hf + f"self_attn.o_proj.{leaf}")
            out[us + f"mlp.linear_fc1.{leaf}"] = torch.cat(
                [src.take(hf + f"mlp.gate_proj.{leaf}"), src.take(hf + f"mlp.up_proj.{leaf}")])
            out[us + f"mlp.linear_fc2.{leaf}"] = src.take(hf + f"mlp.down_proj.{leaf}")
        out[us + "input_layernorm.weight"] = src.take(hf + "input_layernorm.weight")
        out[us + "pre_mlp_layernorm.weight"] = src.take(hf + "post_attention_layernorm.weight")
    out["final_norm.weight"] = src.take("model.norm.weight")
    return out


# --- weights: ours -> HF ----------------------------------------------------------------------
def megatron_lite_to_hf(state_dict: StateDict, cfg: ModelConfig, family: Optional[str] = None) -> StateDict:
    """HF state dict (as GPT2LMHeadModel / LlamaForCausalLM.state_dict() names it) from a full
    megatron-lite state dict. With tied embeddings lm_head.weight is the embedding tensor itself."""
    family = _check_family(cfg, family)
    sd = dict(state_dict)
    missing = [k for k in _expected_names(cfg) if k not in sd]
    if missing:
        raise ConversionError(f"megatron-lite state dict is missing {len(missing)} tensors, e.g. {missing[:3]}")
    out = _ours_to_gpt2(sd, cfg) if family == "gpt2" else _ours_to_llama(sd, cfg)
    out["lm_head.weight"] = sd[OUTPUT_LAYER] if cfg.untie_embeddings_and_output_weights else sd[WORD_EMBEDDINGS]
    return out


def _expected_names(cfg: ModelConfig):
    names = [WORD_EMBEDDINGS, "final_norm.weight"]
    if cfg.untie_embeddings_and_output_weights:
        names.append(OUTPUT_LAYER)
    if cfg.position_embedding_type == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    for i in range(cfg.num_layers):
        for m in ("self_attention.linear_q", "self_attention.linear_kv", "self_attention.linear_proj",
                  "mlp.linear_fc1", "mlp.linear_fc2"):
            names.append(f"layers.{i}.{m}.weight")
    return names


def _ours_to_gpt2(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out = {"transformer.wte.weight": sd[WORD_EMBEDDINGS],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"]}
    for i in range(cfg.num_layers):
        hf, us = f"transformer.h.{i}.", f"layers.{i}."
        q, kv = us + "self_attention.linear_q.", us + "self_attention.linear_kv."
        out[hf + "attn.c_attn.weight"] = torch.cat([sd[q + "weight"], sd[kv + "weight"]]).t().contiguous()
        out[hf + "attn.c_attn.bias"] = torch.cat([sd[q + "bias"], sd[kv + "bias"]])
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            out[hf + theirs + ".weight"] = sd[us + ours + ".weight"].t().contiguous()
            out[hf + theirs + ".bias"] = sd[us + ours + ".bias"]
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for leaf in ("weight", "bias"):
                out[hf + f"{theirs}.{leaf}"] = sd[us + f"{ours}.{leaf}"]
    out["transformer.ln_f.weight"] = sd["final_norm.weight"]
    out["transformer.ln_f.bias"] = sd["final_norm.bias"]
    return out


def _ours_to_llama(sd: StateDict, cfg: ModelConfig) -> StateDict:
    kv_size, f = cfg.num_query_groups * cfg.kv_channels, cfg.ffn_hidden_size
    leaves = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    out = {"model.embed_tokens.weight": sd[WORD_EMBEDDINGS]}
    for i in range(cfg.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        for leaf in leaves:
            out[hf + f"self_attn.q_proj.{leaf}"] = sd[us + f"self_attention.linear_q.{leaf}"]
            k, v = sd[us + f"self_attention.linear_kv.{leaf}"].split([kv_size, kv_size])
            out[hf + f"self_attn.k_proj.{leaf}"], out[hf + f"self_attn.v_proj.{leaf}"] = k.clone(), v.clone()
            out[hf + f"self_attn.o_proj.{leaf}"] = sd[us + f"self_attention.linear_proj.{leaf}"]
            gate, up = sd[us + f"mlp.linear_fc1.{leaf}"].split([f, f])
            out[hf + f"mlp.gate_proj.{leaf}"], out[hf + f"mlp.up_proj.{leaf}"] = gate.clone(), up.clone()
            out[hf + f"mlp.down_proj.{leaf}"] = sd[us + f"mlp.linear_fc2.{leaf}"]
        out[hf + "input_layernorm.weight"] = sd[us + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[us + "pre_mlp_layernorm.weight"]
    out["model.norm.weight"] = sd["final_norm.weight"]
    return out


# --- full <-> this rank's shards --------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict_into_model(model: nn.Module, full_state: StateDict, dims: ParallelDims) -> None:
    """Copy this TP rank's slice of every full tensor into `model` (one chunk), padding vocab rows
    to the layout's padded vocabulary. Extra entries (other pipeline stages' layers) are ignored."""
    missing = []
    for name, p in model.named_parameters():
        key, spec = stored_name(name, p), spec_of(p)
        if key not in full_state:
            missing.append(key)
            continue
        full = spec.pad(full_state[key])
        piece = spec.shard(full) if tuple(full.shape) == spec.full_shape else full
        if tuple(piece.shape) != tuple(p.shape):
            raise ConversionError(f"{key}: full tensor {tuple(full.shape)} does not fit parameter "
                                  f"(shard {tuple(piece.shape)} != {tuple(p.shape)})")
        p.copy_(piece)
    if missing:
        raise ConversionError(f"state dict is missing {len(missing)} tensors, e.g. {missing[:3]}")


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, dims: ParallelDims) -> StateDict:
    """Full (unsharded, true-vocab) CPU tensors of one model chunk. Collective over TP: every TP
    rank must call it. The last stage's copy of a tied embedding is left out."""
    out = {}
    for name, p in model.named_parameters():
        tie = spec_of(p).tie
        if tie is not None and not tie.primary:
            continue
        out[name] = gather_full(p.data, p, dims).cpu()
    return out
