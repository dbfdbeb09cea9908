"""Mixture of experts: router, token dispatchers over EP, grouped experts, the MoE layer."""
from .config import MoEConfig, parse_moe_layer_freq

__all__ = ["MoEConfig", "parse_moe_layer_freq"]
