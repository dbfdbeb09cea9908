"""The vocabulary of the conversion tables (hf_families.py, megatron_conversion.py): a `Rule` maps our
tensors to a checkpoint's under a transform (OPS, described in hf_conversion.py) and conditions on the
config (CONDITIONS). A leaf, so that the tables and the engine that runs them need not import each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from megatron_lite.model_config import ModelConfig

OPS = ("copy", "t", "cat", "t_split", "experts", "qkv", "rope_q", "rope_kv", "et", "glu_et", "dup", "rope_indexer")


class ConversionError(ValueError):
    """A checkpoint or config this converter cannot map exactly. The message says why."""


@dataclass(frozen=True)
class Rule:
    ours: Tuple[str, ...]
    hf: Tuple[str, ...]
    op: str = "copy"
    when: Tuple[str, ...] = ()  # conditions (CONDITIONS), all must hold
    fused_hf: Tuple[str, ...] = ()  # experts: transformers' fused in-memory form, used when the per-expert one is absent

    def __post_init__(self):
        assert self.op in OPS, self.op
        for c in self.when:
            assert c in CONDITIONS, c


def R(ours, hf, op="copy", when=(), fused_hf=()) -> Rule:
    """A Rule from strings or tuples (tables read better without the tuple noise)."""
    as_tuple = (lambda x: (x,) if isinstance(x, str) else tuple(x))
    return Rule(as_tuple(ours), as_tuple(hf), op, as_tuple(when), as_tuple(fused_hf))


# Conditions on the config (and, for {i} rules, on the layer: dense or MoE MLP).
CONDITIONS: Dict[str, Callable[[ModelConfig, Optional[int]], bool]] = {
    "bias": lambda c, i: c.add_bias_linear,
    "qkv_bias": lambda c, i: c.add_bias_linear or c.add_qkv_bias,
    "layernorm": lambda c, i: c.normalization == "LayerNorm",
    "learned_pos": lambda c, i: c.position_embedding_type == "learned_absolute",
    "untied": lambda c, i: c.untie_embeddings_and_output_weights,
    "tied": lambda c, i: not c.untie_embeddings_and_output_weights,
    "qk_norm": lambda c, i: c.qk_layernorm,
    "dense": lambda c, i: i is None or not c.moe_layers()[i],
    "moe": lambda c, i: i is not None and c.moe_layers()[i],
    "shared_expert": lambda c, i: c.moe is not None and bool(c.moe.moe_shared_expert_intermediate_size),
    "shared_gate": lambda c, i: c.moe is not None and c.moe.moe_shared_expert_gate,
    "mla": lambda c, i: c.multi_latent_attention,
    "mha": lambda c, i: not c.multi_latent_attention,
    "q_lora": lambda c, i: c.q_lora_rank is not None,
    "q_full": lambda c, i: c.q_lora_rank is None,
    "expert_bias": lambda c, i: c.moe is not None and c.moe.moe_router_enable_expert_bias,
    # hybrid patterns (--hybrid-override-pattern): the one block of layer i
    "mamba_layer": lambda c, i: _hybrid_letter(c, i) == "M",
    "attention_layer": lambda c, i: _hybrid_letter(c, i) == "*",
    "mixer_layer": lambda c, i: _hybrid_letter(c, i) in ("M", "*"),
    "mlp_layer": lambda c, i: _hybrid_letter(c, i) == "-",
    "dsa": lambda c, i: getattr(c, "experimental_attention_variant", None) == "dsa",
}


def _hybrid_letter(cfg: ModelConfig, layer: Optional[int]) -> Optional[str]:
    pattern = cfg.hybrid_override_pattern
    return pattern[layer] if pattern is not None and layer is not None else None
