"""Mixture of experts: router, token dispatchers over EP, grouped experts, the MoE layer.

Only the config is imported eagerly: `megatron_lite.config` (flag parsing) imports this package, and
a config error or `--help` must not wait for the model stack; the rest loads on first use."""
import importlib

from .config import MoEConfig, parse_moe_layer_freq

_HOME = {"GroupedExperts": "experts", "SharedExpertMLP": "experts", "is_expert_parameter": "experts",
         "MoELayer": "layer", "MoEStepHooks": "layer", "TopKRouter": "router",
         "update_expert_bias": "router", "MoEMetricsTracker": "tracker"}

__all__ = ["MoEConfig", "parse_moe_layer_freq", *_HOME]


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
