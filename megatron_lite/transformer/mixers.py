"""Each decoder layer's blocks, decided here and nowhere else: the module class of its attention slot
(softmax attention, standard or MLA; a linear-attention mixer as mixer_pattern.layer_mixer says; a
Mamba-2 mixer) and whether it has an MLP slot. Under --hybrid-override-pattern (transformer/hybrid.py)
each layer is one block: a mixer-only layer (M, *) or an MLP-only one (-, E)."""
from __future__ import annotations

from typing import Optional

from .gated_delta_net import GatedDeltaNet, KimiDeltaAttention
from .hybrid import MAMBA, MIXERS, layer_types
from .mamba import MambaMixer
from .mixer_pattern import FULL_ATTENTION, layer_mixer
from .attention import SelfAttention
from .dsa import DSASelfAttention
from .mla import MLASelfAttention

LINEAR_MIXERS = {"gated_delta_net": GatedDeltaNet, "kda": KimiDeltaAttention}


def self_attention_class(cfg):
    """The softmax attention module of a layer's slot: MLA with --multi-latent-attention (DSA's with
    --experimental-attention-variant dsa), else standard."""
    if getattr(cfg, "experimental_attention_variant", None) == "dsa":
        return DSASelfAttention
    return MLASelfAttention if getattr(cfg, "multi_latent_attention", False) else SelfAttention


def _hybrid_letter(cfg, layer_number: int) -> Optional[str]:
    letters = layer_types(getattr(cfg, "hybrid_override_pattern", None), cfg.num_layers)
    return None if letters is None else letters[min(layer_number, cfg.num_layers - 1)]


def mixer_class(cfg, layer_number: int):
    """The attention-slot module of layer `layer_number` (multi-token prediction's: the last decoder
    layer's); None for an MLP-only layer of a hybrid pattern."""
    letter = _hybrid_letter(cfg, layer_number)
    if letter is not None:
        return (MambaMixer if letter == MAMBA else self_attention_class(cfg)) if letter in MIXERS else None
    mixer = layer_mixer(cfg, layer_number)
    return self_attention_class(cfg) if mixer == FULL_ATTENTION else LINEAR_MIXERS[mixer]


def has_mlp(cfg, layer_number: int) -> bool:
    """Whether layer `layer_number` has an MLP slot (every layer but a hybrid pattern's mixer-only ones)."""
    letter = _hybrid_letter(cfg, layer_number)
    return letter is None or letter not in MIXERS
