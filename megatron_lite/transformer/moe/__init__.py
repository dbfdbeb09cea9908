"""Mixture of experts: router, token dispatchers over EP, grouped experts, the MoE layer."""
from .config import MoEConfig, parse_moe_layer_freq
from .losses import AuxLossScale
from .router import TopKRouter, update_expert_bias
from .tracker import MoEMetricsTracker

__all__ = ["MoEConfig", "parse_moe_layer_freq", "AuxLossScale", "TopKRouter", "update_expert_bias",
           "MoEMetricsTracker"]
