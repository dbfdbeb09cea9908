"""Mixture of experts: router, token dispatchers over EP, grouped experts, the MoE layer."""
from .config import MoEConfig, parse_moe_layer_freq
from .experts import GroupedExperts, SharedExpertMLP, is_expert_parameter
from .layer import MoELayer, MoEStepHooks
from .router import TopKRouter, update_expert_bias
from .tracker import MoEMetricsTracker

__all__ = ["MoEConfig", "parse_moe_layer_freq", "GroupedExperts", "SharedExpertMLP", "is_expert_parameter",
           "MoELayer", "MoEStepHooks", "TopKRouter", "update_expert_bias", "MoEMetricsTracker"]
