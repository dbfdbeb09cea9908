"""The module class of a layer's attention slot: softmax attention (standard or MLA) or a linear-attention
mixer, as mixer_pattern.layer_mixer says for that layer."""
from __future__ import annotations

from .gated_delta_net import GatedDeltaNet, KimiDeltaAttention
from .mixer_pattern import FULL_ATTENTION, layer_mixer
from .mla import self_attention_class

LINEAR_MIXERS = {"gated_delta_net": GatedDeltaNet, "kda": KimiDeltaAttention}


def mixer_class(cfg, layer_number: int):
    """The attention-slot module of layer `layer_number` (multi-token prediction's: the last decoder layer's)."""
    mixer = layer_mixer(cfg, layer_number)
    return self_attention_class(cfg) if mixer == FULL_ATTENTION else LINEAR_MIXERS[mixer]
