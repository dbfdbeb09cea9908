"""The Hugging Face families megatron-lite converts: each maps an HF config to a ModelConfig of
the GPT model and back, and owns the table of its tensors (hf_conversion.Rule; names as
save_pretrained writes them, with transformers' in-memory fused expert tensors accepted too).

  gpt2       LayerNorm, learned positions, GELU, biases, Conv1D weights, tied embeddings
  llama      Llama 2 / 3 / 3.1 / 3.2: RMSNorm, RoPE (llama3 scaling), SwiGLU, GQA
  mistral    llama + sliding-window attention
  qwen2      llama + Q/K/V biases (Qwen2, Qwen2.5)
  qwen3      llama + q/k RMSNorm per head, explicit head_dim
  mixtral    mistral with top-k softmax MoE MLPs
  qwen2_moe  qwen2 with MoE MLPs, a gated shared expert, dense layers (mlp_only_layers)
  qwen3_moe  qwen3 with MoE MLPs
  glm4_moe   GLM-4.5: Q/K/V biases, partial RoPE, optional q/k norms per head, DeepSeek-V3's routing
             and shared experts after leading dense layers, MTP modules stored as DeepSeek-V3's
  olmoe      llama with top-k softmax MoE MLPs and q/k RMSNorm over all heads together (OLMoE)
  deepseek_v3  multi-latent attention (RoPE rows interleaved in HF), YaRN, sigmoid group-limited routing
             with expert bias and a scaling factor, shared experts, leading dense layers, the multi-token
             prediction modules (decoder layers num_hidden_layers.., which transformers ignores); also
             Kimi-K2 and Moonlight, which HF loads as deepseek_v3
  deepseek_v2  the same attention; softmax routing over all experts without renormalization (greedy)
  deepseek_v32 DeepSeek-V3.2: V3 plus DSA's lightning indexer in each layer (its rotated channels moved)
  gpt_oss    attention sinks and biases, sliding-window and full layers alternating, YaRN (unrounded ramp),
             top-k softmax MoE with router and expert biases, a clamped quick-GELU gated unit; the fused
             expert tensors stored [E, in, out] with gate and up columns interleaved (as save_pretrained
             writes them, or the Hub's MXFP4 blocks and scales, dequantized on the way in)
  nemotron_h Mamba-2 / attention / squared-ReLU MLP layers, one block each (hf_nemotron_h.py)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.transformer.moe import MoEConfig

from . import hf_nemotron_h
from .hf_rules import ConversionError, R, Rule

L = "model.layers.{i}."
_LLAMA_CORE = [
    R("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    R("layers.{i}.input_layernorm.weight", L + "input_layernorm.weight"),
    R("layers.{i}.self_attention.linear_q.weight", L + "self_attn.q_proj.weight"),
    R("layers.{i}.self_attention.linear_kv.weight", (L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"), "cat"),
    R("layers.{i}.self_attention.linear_q.bias", L + "self_attn.q_proj.bias", when="qkv_bias"),
    R("layers.{i}.self_attention.linear_kv.bias", (L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"), "cat",
      when="qkv_bias"),
    R("layers.{i}.self_attention.linear_proj.weight", L + "self_attn.o_proj.weight"),
    R("layers.{i}.self_attention.linear_proj.bias", L + "self_attn.o_proj.bias", when="bias"),
    R("layers.{i}.self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight", when="qk_norm"),
    R("layers.{i}.self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight", when="qk_norm"),
    R("layers.{i}.pre_mlp_layernorm.weight", L + "post_attention_layernorm.weight"),
    R("layers.{i}.mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "cat", when="dense"),
    R("layers.{i}.mlp.linear_fc2.weight", L + "mlp.down_proj.weight", when="dense"),
    R("layers.{i}.mlp.linear_fc1.bias", (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"), "cat",
      when=("dense", "bias")),
    R("layers.{i}.mlp.linear_fc2.bias", L + "mlp.down_proj.bias", when=("dense", "bias")),
    R("final_norm.weight", "model.norm.weight"),
    R("output_layer.weight", "lm_head.weight", when="untied"),
]
_QWEN_MOE = [  # Qwen2-MoE / Qwen3-MoE: experts under mlp.experts.{e}, router mlp.gate
    R("layers.{i}.mlp.router.weight", L + "mlp.gate.weight", when="moe"),
    R("layers.{i}.mlp.experts.weight1", (L + "mlp.experts.{e}.gate_proj.weight", L + "mlp.experts.{e}.up_proj.weight"),
      "experts", when="moe", fused_hf=L + "mlp.experts.gate_up_proj"),
    R("layers.{i}.mlp.experts.weight2", L + "mlp.experts.{e}.down_proj.weight", "experts", when="moe",
      fused_hf=L + "mlp.experts.down_proj"),
    R("layers.{i}.mlp.shared_experts.linear_fc1.weight",
      (L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"), "cat",
      when=("moe", "shared_expert")),
    R("layers.{i}.mlp.shared_experts.linear_fc2.weight", L + "mlp.shared_expert.down_proj.weight",
      when=("moe", "shared_expert")),
    R("layers.{i}.mlp.shared_experts.gate_weight", L + "mlp.shared_expert_gate.weight",
      when=("moe", "shared_expert", "shared_gate")),
]
A = L + "self_attn."
_MLA = [  # DeepSeek-V2/V3 attention; the rotated rows of Q and of the shared key are interleaved pairs in HF
    R("layers.{i}.self_attention.linear_q_proj.weight", A + "q_proj.weight", "rope_q", when="q_full"),
    R("layers.{i}.self_attention.linear_q_down_proj.weight", A + "q_a_proj.weight", when="q_lora"),
    R("layers.{i}.self_attention.q_layernorm.weight", A + "q_a_layernorm.weight", when="q_lora"),
    R("layers.{i}.self_attention.linear_q_up_proj.weight", A + "q_b_proj.weight", "rope_q", when="q_lora"),
    R("layers.{i}.self_attention.linear_kv_down_proj.weight", A + "kv_a_proj_with_mqa.weight", "rope_kv"),
    R("layers.{i}.self_attention.kv_layernorm.weight", A + "kv_a_layernorm.weight"),
    R("layers.{i}.self_attention.linear_kv_up_proj.weight", A + "kv_b_proj.weight"),
    R("layers.{i}.self_attention.linear_proj.weight", A + "o_proj.weight"),
]
_DEEPSEEK_MOE = [  # router mlp.gate (+ e_score_correction_bias: our expert-bias buffer), shared_experts
    R("layers.{i}.mlp.router.weight", L + "mlp.gate.weight", when="moe"),
    R("layers.{i}.mlp.router.expert_bias", L + "mlp.gate.e_score_correction_bias", when=("moe", "expert_bias")),
    R("layers.{i}.mlp.experts.weight1", (L + "mlp.experts.{e}.gate_proj.weight", L + "mlp.experts.{e}.up_proj.weight"),
      "experts", when="moe", fused_hf=L + "mlp.experts.gate_up_proj"),
    R("layers.{i}.mlp.experts.weight2", L + "mlp.experts.{e}.down_proj.weight", "experts", when="moe",
      fused_hf=L + "mlp.experts.down_proj"),
    R("layers.{i}.mlp.shared_experts.linear_fc1.weight",
      (L + "mlp.shared_experts.gate_proj.weight", L + "mlp.shared_experts.up_proj.weight"), "cat",
      when=("moe", "shared_expert")),
    R("layers.{i}.mlp.shared_experts.linear_fc2.weight", L + "mlp.shared_experts.down_proj.weight",
      when=("moe", "shared_expert")),
]
_GPT_OSS = _LLAMA_CORE + [
    R("layers.{i}.self_attention.softmax_offset", A + "sinks"),
    R("layers.{i}.mlp.router.weight", L + "mlp.router.weight", when="moe"),
    R("layers.{i}.mlp.router.bias", L + "mlp.router.bias", when="moe"),
    R("layers.{i}.mlp.experts.weight1", L + "mlp.experts.gate_up_proj", "glu_et", when="moe"),
    R("layers.{i}.mlp.experts.bias1", L + "mlp.experts.gate_up_proj_bias", "glu_et", when="moe"),
    R("layers.{i}.mlp.experts.weight2", L + "mlp.experts.down_proj", "et", when="moe"),
    R("layers.{i}.mlp.experts.bias2", L + "mlp.experts.down_proj_bias", when="moe"),
]
_DEEPSEEK_DECODER = [r for r in _LLAMA_CORE if ".self_attention." not in r.ours[0]] + _MLA + _DEEPSEEK_MOE


def _mtp_rules(decoder: List[Rule]) -> List[Rule]:
    """DeepSeek-V3's multi-token prediction modules as its HF checkpoints store them (transformers
    ignores them): depth d is decoder layer {n} = num_hidden_layers + d, a whole decoder layer plus
    enorm / hnorm / eh_proj, shared_head.norm (our final_layernorm) and copies of the embedding and
    the output layer (embed_tokens, shared_head.head)."""
    n, ours = "model.layers.{n}.", "mtp.layers.{d}."
    rules = [R(ours + "enorm.weight", n + "enorm.weight"), R(ours + "hnorm.weight", n + "hnorm.weight"),
             R(ours + "eh_proj.weight", n + "eh_proj.weight"),
             R(ours + "final_layernorm.weight", n + "shared_head.norm.weight"),
             R("embedding.word_embeddings.weight", n + "embed_tokens.weight", "dup"),
             R("output_layer.weight", n + "shared_head.head.weight", "dup", when="untied"),
             R("embedding.word_embeddings.weight", n + "shared_head.head.weight", "dup", when="tied")]
    for r in decoder:
        if all(t.startswith("layers.{i}.") for t in r.ours):
            rules.append(Rule(tuple(t.replace("layers.{i}.", ours + "transformer_layer.", 1) for t in r.ours),
                              tuple(t.replace(L, n) for t in r.hf), r.op, r.when,
                              tuple(t.replace(L, n) for t in r.fused_hf)))
    return rules


_DEEPSEEK = _DEEPSEEK_DECODER + _mtp_rules(_DEEPSEEK_DECODER)
_DSA_INDEXER = [  # deepseek_v32: DeepSeek-V3 plus a lightning indexer per layer (models/hf_dsa.py)
    R("layers.{i}.self_attention.indexer.linear_wq_b.weight", A + "indexer.wq_b.weight", "rope_indexer", when="dsa"),
    R("layers.{i}.self_attention.indexer.linear_wk.weight", A + "indexer.wk.weight", "rope_indexer", when="dsa"),
    R("layers.{i}.self_attention.indexer.k_norm.weight", A + "indexer.k_norm.weight", "rope_indexer", when="dsa"),
    R("layers.{i}.self_attention.indexer.k_norm.bias", A + "indexer.k_norm.bias", "rope_indexer", when="dsa"),
    R("layers.{i}.self_attention.indexer.linear_weights_proj.weight", A + "indexer.weights_proj.weight", when="dsa"),
]
_DEEPSEEK_V32 = _DEEPSEEK_DECODER + _DSA_INDEXER + _mtp_rules(_DEEPSEEK_DECODER + _DSA_INDEXER)
_GLM4_MOE = _LLAMA_CORE + _DEEPSEEK_MOE + _mtp_rules(_LLAMA_CORE + _DEEPSEEK_MOE)  # GLM-4.5 stores MTP as V3 does
M = "model.layers.{i}.block_sparse_moe."
_MIXTRAL_MOE = [  # Mixtral on disk: block_sparse_moe.gate, experts.{e}.w1 (gate) / w3 (up) / w2 (down)
    R("layers.{i}.mlp.router.weight", M + "gate.weight", when="moe"),
    R("layers.{i}.mlp.experts.weight1", (M + "experts.{e}.w1.weight", M + "experts.{e}.w3.weight"), "experts",
      when="moe", fused_hf=M + "experts.gate_up_proj"),
    R("layers.{i}.mlp.experts.weight2", M + "experts.{e}.w2.weight", "experts", when="moe",
      fused_hf=M + "experts.down_proj"),
]
H = "transformer.h.{i}."
_GPT2 = [
    R("embedding.word_embeddings.weight", "transformer.wte.weight"),
    R("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    R("layers.{i}.input_layernorm.weight", H + "ln_1.weight"),
    R("layers.{i}.input_layernorm.bias", H + "ln_1.bias"),
    R(("layers.{i}.self_attention.linear_q.weight", "layers.{i}.self_attention.linear_kv.weight"),
      H + "attn.c_attn.weight", "t_split"),  # Conv1D [h, 3h] -> [3h, h] = [Q; K; V]
    R(("layers.{i}.self_attention.linear_q.bias", "layers.{i}.self_attention.linear_kv.bias"), H + "attn.c_attn.bias",
      "t_split"),
    R("layers.{i}.self_attention.linear_proj.weight", H + "attn.c_proj.weight", "t"),
    R("layers.{i}.self_attention.linear_proj.bias", H + "attn.c_proj.bias"),
    R("layers.{i}.pre_mlp_layernorm.weight", H + "ln_2.weight"),
    R("layers.{i}.pre_mlp_layernorm.bias", H + "ln_2.bias"),
    R("layers.{i}.mlp.linear_fc1.weight", H + "mlp.c_fc.weight", "t"),
    R("layers.{i}.mlp.linear_fc1.bias", H + "mlp.c_fc.bias"),
    R("layers.{i}.mlp.linear_fc2.weight", H + "mlp.c_proj.weight", "t"),
    R("layers.{i}.mlp.linear_fc2.bias", H + "mlp.c_proj.bias"),
    R("final_norm.weight", "transformer.ln_f.weight"),
    R("final_norm.bias", "transformer.ln_f.bias"),
    R("output_layer.weight", "lm_head.weight", when="untied"),
]


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # HF config.model_type
    architecture: str  # the HF class save_pretrained names in config.json
    rules: List[Rule]
    to_ours: Callable  # HF config -> ModelConfig
    to_hf: Callable  # ModelConfig -> HF config
    ignored: Tuple[str, ...] = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry
    renames: Dict[str, str] = field(default_factory=dict)  # in-memory name fragment -> on-disk one

    @property
    def dropped(self) -> Tuple[str, ...]:
        return ("lm_head.weight",)  # tied models' copy of the embedding (untied ones read it by a rule)

    def normalize(self, sd: dict) -> dict:
        """On-disk names for an HF state dict that may use transformers' in-memory ones."""
        if self.name == "gpt2" and not any(k.startswith("transformer.") for k in sd):  # GPT2Model, not LMHead
            sd = {(k if k.startswith("lm_head.") else "transformer." + k): v for k, v in sd.items()}
        for old, new in self.renames.items():
            sd = {k.replace(old, new): v for k, v in sd.items()}
        return sd


def deinterleave_rope_rows(w, nope: int, rope: int):
    """DeepSeek's RoPE rows (in each block of `nope` plain rows then `rope` rotated ones, the rotated
    pairs interleaved: x0 x1, x2 x3, ...) in our half-split order (x0 x2 ... | x1 x3 ...): the same
    rotation, as transformers' apply_rotary_pos_emb_interleave computes it."""
    block = nope + rope
    blocks = w.reshape(-1, block, *w.shape[1:])
    r = blocks[:, nope:]
    return torch.cat([blocks[:, :nope], r[:, 0::2], r[:, 1::2]], dim=1).reshape(w.shape)


def interleave_rope_rows(w, nope: int, rope: int):
    """Inverse of deinterleave_rope_rows."""
    block = nope + rope
    blocks = w.reshape(-1, block, *w.shape[1:])
    half = rope // 2
    r = torch.stack([blocks[:, nope:nope + half], blocks[:, nope + half:]], dim=2).flatten(1, 2)
    return torch.cat([blocks[:, :nope], r], dim=1).reshape(w.shape)


_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 expert weights as the Hub stores them (`<name>_blocks` [E, out, G, 16] uint8, two
    e2m1 values a byte, the low nibble first; `<name>_scales` [E, out, G] uint8, a power-of-two
    exponent biased by 127 per 32 values) -> [E, in, out] bf16, the fused tensor's layout (exact)."""
    magnitudes = torch.tensor(_FP4_E2M1, dtype=torch.float32)
    lut = torch.cat([magnitudes, -magnitudes])  # bit 3: the sign
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [E, out, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's FP8 weights (`quantization_config: {quant_method: fp8, weight_block_size: [bo, bi]}`):
    a float8 [out, in] weight and its fp32 `weight_scale_inv` [ceil(out / bo), ceil(in / bi)], the factor
    each block is multiplied by (the last blocks may be partial) -> fp32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ConversionError(f"weight_scale_inv {tuple(scale_inv.shape)} does not match a [{rows}, {cols}] weight in "
                              f"{block[0]} x {block[1]} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def fp8_block_size(hf_config) -> Optional[Tuple[int, int]]:
    """The weight block of a block-scaled FP8 checkpoint (None: not one); other quantizations that no
    family's table reads are refused."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3" or q.get("scale_fmt") not in (None, "float"):
            raise ConversionError(f"FP8 quantization_config {q} is not supported (e4m3 weights with float block "
                                  f"scales are)")
        return tuple(q.get("weight_block_size") or (128, 128))
    if method == "mxfp4" and hf_config.model_type == "gpt_oss":  # its experts' blocks: the gpt_oss table
        return None
    raise ConversionError(f"quantization_config quant_method {method!r} is not supported (fp8 with block scales, "
                          f"and gpt-oss's mxfp4 experts, are): dequantize the checkpoint first")


# --- configs: HF -> ours ----------------------------------------------------------------------
def _rope(c) -> dict:
    params = dict(getattr(c, "rope_parameters", None) or {})
    if not params and getattr(c, "rope_scaling", None):
        params = dict(c.rope_scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    out = dict(rotary_base=float(theta if theta is not None else 10000.0))
    if kind == "llama3":
        out.update(rope_scaling_type="llama3", rope_scaling_factor=float(params["factor"]),
                   rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                   rope_scaling_original_max_position=int(params["original_max_position_embeddings"]))
    elif kind == "yarn":
        out.update(_yarn(c, params))
    elif kind != "default":
        raise ConversionError(f"rope_type {kind!r} (RoPE scaling) is not supported; supported: default, llama3, yarn")
    return out


def _yarn(c, p: dict) -> dict:
    """YaRN's parameters as transformers reads them (_compute_yarn_parameters, DeepSeek's softmax mscale)."""
    if not p.get("original_max_position_embeddings"):
        raise ConversionError("YaRN needs original_max_position_embeddings in rope_parameters")
    original = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or c.max_position_embeddings / original)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if p.get("attention_factor") is not None:
        raise ConversionError("YaRN attention_factor is not supported (DeepSeek's mscale and mscale_all_dim are)")
    if mscale_all_dim and not mscale:
        raise ConversionError("YaRN mscale_all_dim without mscale is not supported")
    both = bool(mscale and mscale_all_dim)  # else HF's cos/sin factor is mscale(factor, 1)
    return dict(rope_scaling_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                mscale=float(mscale) if both else 1.0, mscale_all_dim=float(mscale_all_dim) if both else 0.0,
                yarn_correction_range_round_to_int=p.get("truncate", True) is not False)


def _llama_like(c, **extra) -> ModelConfig:
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {c.hidden_act!r} is not supported (SwiGLU needs silu)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kw = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
              num_query_groups=c.num_key_value_heads or c.num_attention_heads, kv_channels=head_dim,
              ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size,
              max_position_embeddings=c.max_position_embeddings, normalization="RMSNorm", norm_epsilon=c.rms_norm_eps,
              position_embedding_type="rope", swiglu=True, add_bias_linear=False,
              untie_embeddings_and_output_weights=not c.tie_word_embeddings,
              attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0), hidden_dropout=0.0, **_rope(c))
    kw.update(extra)
    return ModelConfig(**kw)


def _llama_to_ours(c) -> ModelConfig:
    attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    if attn_bias != mlp_bias:  # our add_bias_linear puts biases on all linears or none
        raise ConversionError("Llama attention_bias and mlp_bias must be equal to convert")
    return _llama_like(c, add_bias_linear=attn_bias, family="llama")


def _mistral_to_ours(c) -> ModelConfig:
    return _llama_like(c, window_size=getattr(c, "sliding_window", None), family="mistral")


def _no_qwen_window(c) -> None:
    if getattr(c, "use_sliding_window", False):
        raise ConversionError("Qwen use_sliding_window (a window on some layers only) is not supported")


def _qwen2_to_ours(c) -> ModelConfig:
    _no_qwen_window(c)
    return _llama_like(c, add_qkv_bias=True, family="qwen2")


def _qwen3_to_ours(c) -> ModelConfig:
    _no_qwen_window(c)
    if getattr(c, "attention_bias", False):
        raise ConversionError("Qwen3 attention_bias=True is not supported")
    return _llama_like(c, qk_layernorm=True, family="qwen3")


def _moe_layers(c, n: int) -> Union[int, List[int]]:
    """Qwen-MoE's layer pattern: MoE every decoder_sparse_step-th layer, except mlp_only_layers."""
    step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    return 1 if all(pattern) else pattern  # 1: every layer (what --moe-layer-freq defaults to)


def _router(norm_topk_prob: bool) -> dict:
    # A softmax over the k chosen logits is the renormalized top-k; without renormalization the
    # weights are the top-k of the softmax over all experts.
    return {} if norm_topk_prob else dict(moe_router_pre_softmax=True)


def _mixtral_to_ours(c) -> ModelConfig:
    moe = MoEConfig(num_experts=c.num_local_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.intermediate_size,
                    moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0))
    return _llama_like(c, window_size=getattr(c, "sliding_window", None), moe=moe, family="mixtral")


def _qwen_moe(c, family: str, **extra) -> ModelConfig:
    _no_qwen_window(c)
    shared = getattr(c, "shared_expert_intermediate_size", None) or None
    moe = MoEConfig(num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.moe_intermediate_size, moe_shared_expert_intermediate_size=shared,
                    moe_shared_expert_gate=bool(shared), moe_layer_freq=_moe_layers(c, c.num_hidden_layers),
                    moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0),
                    **_router(bool(getattr(c, "norm_topk_prob", False))))
    return _llama_like(c, moe=moe, family=family, **extra)


def _olmoe_to_ours(c) -> ModelConfig:
    if getattr(c, "clip_qkv", None) is not None or getattr(c, "attention_bias", False):
        raise ConversionError("OLMoE clip_qkv / attention_bias are not supported")
    moe = MoEConfig(num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.intermediate_size,
                    moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0),
                    **_router(bool(getattr(c, "norm_topk_prob", False))))
    return _llama_like(c, qk_layernorm=True, qk_layernorm_full_width=True, moe=moe, family="olmoe")


def _gpt2_to_ours(c) -> ModelConfig:
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
        swiglu=False, activation=act, add_bias_linear=True, untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        attention_dropout=float(c.attn_pdrop), hidden_dropout=float(c.resid_pdrop), family="gpt2")


def _deepseek_to_ours(c, family: str) -> ModelConfig:
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ConversionError(f"{family} attention_bias / mlp_bias are not supported (biases on the down- and output "
                              f"projections only have no megatron-lite equivalent)")
    if family == "deepseek_v3" and not getattr(c, "rope_interleave", True):
        raise ConversionError("deepseek_v3 rope_interleave=False is not supported")
    if family == "deepseek_v2" and c.topk_method != "greedy":
        raise ConversionError(f"deepseek_v2 topk_method {c.topk_method!r} is not supported (greedy is)")
    mtp = getattr(c, "num_nextn_predict_layers", 0) or None  # V3's MTP modules (transformers ignores them)
    return _llama_like(c, multi_latent_attention=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                       qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim,
                       v_head_dim=c.v_head_dim, moe=_deepseek_moe(c, family), family=family, mtp_num_layers=mtp)


def _deepseek_v32_to_ours(c) -> ModelConfig:
    """DeepSeek-V3 with DSA: the indexer's heads, head size and top-k (its LayerNorm's eps is HF's 1e-6)."""
    if c.q_lora_rank is None or c.rms_norm_eps != 1e-6:
        raise ConversionError(f"deepseek_v32 needs a query latent (q_lora_rank, not {c.q_lora_rank}) and rms_norm_eps "
                              f"1e-6 (not {c.rms_norm_eps}: HF's indexer norm keeps 1e-6)")
    base = _deepseek_to_ours(c, "deepseek_v3")
    return dataclasses.replace(base, family="deepseek_v32", experimental_attention_variant="dsa",
                               dsa_indexer_n_heads=c.index_n_heads, dsa_indexer_head_dim=c.index_head_dim,
                               dsa_indexer_topk=c.index_topk)


def _deepseek_moe(c, family: str) -> MoEConfig:
    """DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores with an expert bias, group-limited
    top-k, a scaling factor; shared experts; the first first_k_dense_replace layers dense. V2: softmax."""
    n, dense = c.num_hidden_layers, c.first_k_dense_replace or 0
    router = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_norm_topk_prob=bool(c.norm_topk_prob))
    groups, group_topk = c.n_group or 1, c.topk_group or 1
    if family == "deepseek_v2":
        groups = group_topk = 1
        router = dict(moe_router_pre_softmax=True, moe_router_norm_topk_prob=False)
    elif groups > 1 and c.num_experts_per_tok != 2 * group_topk:
        raise ConversionError(f"{family} ranks expert groups by their top-2 scores: megatron-lite's "
                              f"group-limited routing needs num_experts_per_tok ({c.num_experts_per_tok}) = 2 x "
                              f"topk_group ({group_topk})")
    scaling = float(c.routed_scaling_factor)
    moe = MoEConfig(num_experts=c.n_routed_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.moe_intermediate_size,
                    moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts or None,
                    moe_router_num_groups=groups if groups > 1 else None,
                    moe_router_group_topk=group_topk if groups > 1 else None,
                    moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None, moe_router_dtype="fp32",
                    moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (n - dense), **router)
    return moe


def _glm4_moe_to_ours(c) -> ModelConfig:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    partial = float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)))
    return _llama_like(c, add_qkv_bias=bool(c.attention_bias), qk_layernorm=bool(c.use_qk_norm),
                       rotary_percent=partial, moe=_deepseek_moe(c, "glm4_moe"), family="glm4_moe",
                       mtp_num_layers=getattr(c, "num_nextn_predict_layers", 0) or None)


def _alternation(c) -> dict:
    """gpt-oss's layer_types as --window-size and --window-attn-skip-freq (every N-th layer full)."""
    kinds = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    if "sliding_attention" not in kinds:
        return {}
    for freq in [None] + list(range(1, len(kinds) + 1)):
        if kinds == ["full_attention" if freq and (i + 1) % freq == 0 else "sliding_attention"
                     for i in range(len(kinds))]:
            return dict(window_size=c.sliding_window, window_attn_skip_freq=freq)
    raise ConversionError(f"gpt_oss layer_types {kinds} are not every N-th layer full, the rest sliding: "
                          f"megatron-lite's --window-attn-skip-freq cannot represent them")


def _gpt_oss_to_ours(c) -> ModelConfig:
    if not getattr(c, "attention_bias", True):
        raise ConversionError("gpt_oss attention_bias=False is not supported (its experts and router keep biases: "
                              "megatron-lite's add_bias_linear is on all linears or none)")
    if float(c.swiglu_alpha) != 1.702:
        raise ConversionError(f"gpt_oss swiglu_alpha {c.swiglu_alpha} is not supported (quick-GELU's 1.702 is)")
    moe = MoEConfig(num_experts=c.num_local_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.intermediate_size,
                    moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0))
    return _llama_like(c, add_bias_linear=True, softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                       activation_func_clamp_value=float(c.swiglu_limit), moe=moe, family="gpt_oss",
                       **_alternation(c))


# --- configs: ours -> HF ----------------------------------------------------------------------
def _hf_config(class_name: str, **kw):
    import transformers  # optional dependency: import on use

    return getattr(transformers, class_name)(**kw)


def _rope_params(cfg: ModelConfig) -> dict:
    p = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_type == "llama3":
        p.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_scaling_low_freq_factor,
                 high_freq_factor=cfg.rope_scaling_high_freq_factor,
                 original_max_position_embeddings=cfg.rope_scaling_original_max_position)
    elif cfg.rope_scaling_type == "yarn":
        p.update(rope_type="yarn", factor=cfg.rotary_scaling_factor, beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow,
                 original_max_position_embeddings=cfg.original_max_position_embeddings)
        if not cfg.yarn_correction_range_round_to_int:
            p["truncate"] = False
        if cfg.mscale_all_dim:
            p.update(mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)
        elif cfg.mscale != 1.0:
            raise ConversionError(f"YaRN mscale {cfg.mscale} without mscale_all_dim has no Hugging Face equivalent")
    return p


def _llama_kw(cfg: ModelConfig, architecture: str) -> dict:
    if cfg.rotary_percent != 1.0 or cfg.apply_layernorm_1p:
        raise ConversionError("rotary_percent < 1 / apply_layernorm_1p have no Hugging Face Llama-family equivalent")
    return dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size,
                vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
                rms_norm_eps=cfg.norm_epsilon, rope_parameters=_rope_params(cfg), hidden_act="silu",
                attention_dropout=cfg.attention_dropout, tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                bos_token_id=None, eos_token_id=None, architectures=[architecture])


def _llama_to_hf(cfg):
    return _hf_config("LlamaConfig", attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                      **_llama_kw(cfg, "LlamaForCausalLM"))


def _mistral_to_hf(cfg):
    return _hf_config("MistralConfig", sliding_window=cfg.window_size, **_llama_kw(cfg, "MistralForCausalLM"))


def _qwen2_to_hf(cfg):
    return _hf_config("Qwen2Config", use_sliding_window=False, **_llama_kw(cfg, "Qwen2ForCausalLM"))


def _qwen3_to_hf(cfg):
    return _hf_config("Qwen3Config", use_sliding_window=False, attention_bias=False,
                      **_llama_kw(cfg, "Qwen3ForCausalLM"))


def _moe_hf_kw(cfg: ModelConfig) -> dict:
    m = cfg.moe
    return dict(num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff,
                norm_topk_prob=not m.moe_router_pre_softmax or bool(m.moe_router_norm_topk_prob))


def _mixtral_to_hf(cfg):
    kw = _llama_kw(cfg, "MixtralForCausalLM")
    kw["intermediate_size"] = cfg.moe.moe_ffn_hidden_size
    moe = _moe_hf_kw(cfg)
    moe.pop("norm_topk_prob")
    return _hf_config("MixtralConfig", num_local_experts=cfg.moe.num_experts, sliding_window=cfg.window_size, **moe,
                      **kw)


def _qwen_moe_to_hf(class_name: str, architecture: str, **extra):
    def to_hf(cfg):
        m = cfg.moe
        dense = [i for i, moe in enumerate(cfg.moe_layers()) if not moe]
        kw = dict(_llama_kw(cfg, architecture), num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size,
                  decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False, **_moe_hf_kw(cfg), **extra)
        if class_name == "Qwen2MoeConfig":
            kw["shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size or 0
        return _hf_config(class_name, **kw)
    return to_hf


def _olmoe_to_hf(cfg):
    kw = _llama_kw(cfg, "OlmoeForCausalLM")
    if kw.pop("head_dim") * cfg.num_attention_heads != cfg.hidden_size or cfg.moe is None \
            or not all(cfg.moe_layers()) or cfg.moe.moe_shared_expert_intermediate_size:
        raise ConversionError("OLMoE needs head_dim = hidden / heads and MoE on every layer without shared experts")
    kw["intermediate_size"] = cfg.moe.moe_ffn_hidden_size
    return _hf_config("OlmoeConfig", num_experts=cfg.moe.num_experts, attention_bias=False, clip_qkv=None,
                      **_moe_hf_kw(cfg), **kw)


def _gpt2_to_hf(cfg):
    special = 50256 if cfg.vocab_size > 50256 else None  # default ids outside a small vocabulary only warn
    return _hf_config("GPT2Config", n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                      n_inner=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
                      layer_norm_epsilon=cfg.norm_epsilon,
                      activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
                      tie_word_embeddings=not cfg.untie_embeddings_and_output_weights, attn_pdrop=cfg.attention_dropout,
                      resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, bos_token_id=special,
                      eos_token_id=special, architectures=["GPT2LMHeadModel"])


def _deepseek_moe_hf_kw(cfg: ModelConfig, family: str) -> dict:
    """DeepSeek-style MoE fields of an HF config (_deepseek_moe's inverse, V3's grouping)."""
    m = cfg.moe
    if m is None or not m.num_experts:
        raise ConversionError(f"{family} needs MoE layers")
    kinds = cfg.moe_layers()
    dense = kinds.index(True)
    shared = m.moe_shared_expert_intermediate_size or 0
    if any(not k for k in kinds[dense:]) or shared % m.moe_ffn_hidden_size or m.moe_shared_expert_gate:
        raise ConversionError(f"{family} needs its dense layers first, then MoE layers, and ungated shared experts "
                              f"of a multiple of the expert size")
    return dict(moe_intermediate_size=m.moe_ffn_hidden_size, n_routed_experts=m.num_experts,
                n_shared_experts=shared // m.moe_ffn_hidden_size, num_experts_per_tok=m.moe_router_topk,
                routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, first_k_dense_replace=dense,
                n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
                norm_topk_prob=m.normalizes_topk)


def _deepseek_to_hf(family: str):
    def to_hf(cfg):
        if not cfg.multi_latent_attention:
            raise ConversionError(f"{family} needs multi-latent attention")
        kw = dict(_llama_kw(cfg, "DeepseekV3ForCausalLM" if family == "deepseek_v3" else "DeepseekV2ForCausalLM"),
                  num_key_value_heads=cfg.num_attention_heads, head_dim=cfg.qk_pos_emb_head_dim,
                  q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                  qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, attention_bias=False,
                  **_deepseek_moe_hf_kw(cfg, family))
        if family == "deepseek_v2":
            if cfg.mtp_depth:
                raise ConversionError("deepseek_v2 has no multi-token prediction modules: convert with "
                                      "--family deepseek_v3, or train without --mtp-num-layers")
            for k in ("n_group", "topk_group", "norm_topk_prob"):
                del kw[k]
            return _hf_config("DeepseekV2Config", topk_method="greedy", norm_topk_prob=False, mlp_bias=False, **kw)
        return _hf_config("DeepseekV3Config", rope_interleave=True, num_nextn_predict_layers=cfg.mtp_depth, **kw)
    return to_hf


def _deepseek_v32_to_hf(cfg):
    if getattr(cfg, "experimental_attention_variant", None) != "dsa" or cfg.q_lora_rank is None \
            or cfg.norm_epsilon != 1e-6:
        raise ConversionError("deepseek_v32 needs --experimental-attention-variant dsa, --q-lora-rank and "
                              "--norm-epsilon 1e-6")
    kw = _deepseek_to_hf("deepseek_v3")(cfg).to_dict()
    keep = {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "hidden_act",
            "attention_dropout", "tie_word_embeddings", "bos_token_id", "eos_token_id", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias", "moe_intermediate_size",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor",
            "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob"}
    return _hf_config("DeepseekV32Config", architectures=["DeepseekV32ForCausalLM"], index_n_heads=cfg.dsa_indexer_n_heads,
                      index_head_dim=cfg.dsa_indexer_head_dim, index_topk=cfg.dsa_indexer_topk,
                      num_nextn_predict_layers=cfg.mtp_depth, **{k: v for k, v in kw.items() if k in keep})


def _glm4_moe_to_hf(cfg):
    if cfg.add_bias_linear:
        raise ConversionError("GLM-4.5 has Q/K/V biases only: use --add-qkv-bias without linear biases")
    kw = _llama_kw(dataclasses.replace(cfg, rotary_percent=1.0), "Glm4MoeForCausalLM")
    kw["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_percent
    return _hf_config("Glm4MoeConfig", attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm,
                      num_nextn_predict_layers=cfg.mtp_depth, **_deepseek_moe_hf_kw(cfg, "glm4_moe"), **kw)


def _gpt_oss_to_hf(cfg):
    m = cfg.moe
    if m is None or not all(cfg.moe_layers()) or m.moe_shared_expert_intermediate_size or m.moe_router_pre_softmax \
            or m.moe_router_score_function != "softmax":
        raise ConversionError("gpt_oss needs MoE on every layer, no shared expert, and top-k softmax routing")
    if not (cfg.add_bias_linear and cfg.softmax_type == "learnable" and cfg.quick_geglu and cfg.glu_linear_offset == 1.0
            and cfg.activation_func_clamp_value):
        raise ConversionError("gpt_oss needs --add-bias-linear, --softmax-type learnable, --quick-geglu, "
                              "--glu-linear-offset 1 and --activation-func-clamp-value")
    kw = dict(_llama_kw(cfg, "GptOssForCausalLM"), intermediate_size=m.moe_ffn_hidden_size)
    layer_types = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.num_layers)]
    return _hf_config("GptOssConfig", num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                      router_aux_loss_coef=m.moe_aux_loss_coeff, sliding_window=cfg.window_size,
                      layer_types=layer_types, swiglu_limit=cfg.activation_func_clamp_value, swiglu_alpha=1.702,
                      attention_bias=True, **kw)


FAMILIES: Dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "gpt2", "GPT2LMHeadModel", _GPT2, _gpt2_to_ours, _gpt2_to_hf,
           ignored=(".attn.bias", ".attn.masked_bias")),
    Family("llama", "llama", "LlamaForCausalLM", _LLAMA_CORE, _llama_to_ours, _llama_to_hf),
    Family("mistral", "mistral", "MistralForCausalLM", _LLAMA_CORE, _mistral_to_ours, _mistral_to_hf),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", _LLAMA_CORE, _qwen2_to_ours, _qwen2_to_hf),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", _LLAMA_CORE, _qwen3_to_ours, _qwen3_to_hf),
    Family("mixtral", "mixtral", "MixtralForCausalLM", _LLAMA_CORE + _MIXTRAL_MOE, _mixtral_to_ours, _mixtral_to_hf,
           renames={".mlp.gate.": ".block_sparse_moe.gate.", ".mlp.experts.": ".block_sparse_moe.experts."}),
    Family("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM", _LLAMA_CORE + _QWEN_MOE,
           lambda c: _qwen_moe(c, "qwen2_moe", add_qkv_bias=True),
           _qwen_moe_to_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM")),
    Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", _LLAMA_CORE + _QWEN_MOE,
           lambda c: _qwen_moe(c, "qwen3_moe", qk_layernorm=True),
           _qwen_moe_to_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", attention_bias=False)),
    Family("olmoe", "olmoe", "OlmoeForCausalLM", _LLAMA_CORE + _QWEN_MOE, _olmoe_to_ours, _olmoe_to_hf),
    Family("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM", _GLM4_MOE, _glm4_moe_to_ours, _glm4_moe_to_hf),
    Family("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM", _DEEPSEEK, lambda c: _deepseek_to_ours(c, "deepseek_v3"),
           _deepseek_to_hf("deepseek_v3")),
    Family("deepseek_v2", "deepseek_v2", "DeepseekV2ForCausalLM", _DEEPSEEK, lambda c: _deepseek_to_ours(c, "deepseek_v2"),
           _deepseek_to_hf("deepseek_v2")),
    Family("deepseek_v32", "deepseek_v32", "DeepseekV32ForCausalLM", _DEEPSEEK_V32, _deepseek_v32_to_ours,
           _deepseek_v32_to_hf),
    Family("gpt_oss", "gpt_oss", "GptOssForCausalLM", _GPT_OSS, _gpt_oss_to_ours, _gpt_oss_to_hf),
    Family("nemotron_h", "nemotron_h", "NemotronHForCausalLM", hf_nemotron_h.RULES, hf_nemotron_h.to_ours,
           hf_nemotron_h.to_hf, renames=hf_nemotron_h.RENAMES),
]}


def family_for_model_type(model_type: Optional[str]) -> Family:
    for f in FAMILIES.values():
        if f.model_type == model_type:
            return f
    raise ConversionError(f"unsupported model_type {model_type!r}; supported: "
                          f"{', '.join(f.model_type for f in FAMILIES.values())}")


def _infer(cfg: ModelConfig) -> str:
    """The family that can represent `cfg` exactly, for configs built from flags (no family)."""
    if cfg.hybrid_override_pattern is not None:
        return "nemotron_h"
    if cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute" and not cfg.swiglu:
        if not cfg.add_bias_linear or cfg.num_query_groups != cfg.num_attention_heads \
                or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConversionError("GPT-2 needs biases, plain multi-head attention and head_dim = hidden / heads")
        return "gpt2"
    if getattr(cfg, "experimental_attention_variant", None) == "dsa":
        return "deepseek_v32"
    if cfg.multi_latent_attention:
        return "deepseek_v2" if cfg.moe is not None and cfg.moe.moe_router_score_function == "softmax" else "deepseek_v3"
    if not (cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope" and cfg.swiglu):
        raise ConversionError("model is neither GPT-2-like (LayerNorm, learned positions, GELU) nor Llama-like "
                              "(RMSNorm, RoPE, SwiGLU)")
    if cfg.moe is not None:
        if cfg.softmax_type == "learnable":
            return "gpt_oss"
        if cfg.moe.moe_router_score_function == "sigmoid":
            return "glm4_moe"
        if cfg.moe.moe_shared_expert_intermediate_size:
            return "qwen2_moe"
        if cfg.qk_layernorm_full_width:
            return "olmoe"
        return "qwen3_moe" if cfg.qk_layernorm else "mixtral"
    if cfg.qk_layernorm:
        return "qwen3"
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "qwen2"
    return "mistral" if cfg.window_size else "llama"


def family_of(cfg: ModelConfig, name: Optional[str] = None) -> Family:
    """The family of `cfg`: `name`, else cfg.family, else inferred from its features."""
    own = cfg.family or _infer(cfg)
    if name is not None and name != own:
        raise ConversionError(f"model config is {own}-like, not {name}")
    name = own
    if name not in FAMILIES:
        raise ConversionError(f"unknown family {name!r}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    _check_representable(cfg, family)
    return family


def _check_representable(cfg: ModelConfig, family: Family) -> None:
    """A config that names a family must survive the trip through that family's HF config."""
    from megatron_lite.checkpoint.loader import config_diffs

    back = family.to_ours(family.to_hf(cfg))
    differ = config_diffs(dataclasses.asdict(cfg), dataclasses.asdict(back))
    if (cfg.moe is None) != (back.moe is None):
        differ.append(f"moe is {cfg.moe!r} here and {back.moe!r} there")
    if differ:
        raise ConversionError(f"model config names family {family.name!r}, which cannot represent it: "
                              + "; ".join(d.replace(" there and ", " in the model and ").replace(" here", f" in {family.name}")
                                          for d in differ))
