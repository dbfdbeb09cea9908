"""Hybrid layer patterns (Nemotron-H; Megatron-Core's MambaStack and --hybrid-override-pattern).

One letter per layer: M a Mamba-2 mixer, * self-attention, - an MLP, E an MoE layer. Each layer is
that ONE block behind its own pre-norm and residual (x + block(norm(x))): a mixer-only or an
MLP-only layer, as Megatron's MambaStack and Hugging Face's nemotron_h build them. Pipeline splits
and layout strings count each layer whatever its kind.
"""
from __future__ import annotations

from typing import List, Optional

from ..errors import ConfigError


MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
SYMBOLS = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}
MIXERS = (MAMBA, ATTENTION)  # the letters whose block fills the attention slot


def layer_types(pattern: Optional[str], num_layers: int) -> Optional[List[str]]:
    """The letter of each layer (None without a pattern: every layer attention + MLP)."""
    if pattern is None:
        return None
    unknown = sorted(set(pattern) - set(SYMBOLS))
    if unknown:
        raise ConfigError(f"--hybrid-override-pattern {pattern!r} has unknown letters {' '.join(unknown)}: use "
                          + ", ".join(f"{k} ({v})" for k, v in SYMBOLS.items()))
    if len(pattern) != num_layers:
        raise ConfigError(f"--hybrid-override-pattern has {len(pattern)} letters but --num-layers is {num_layers}: "
                          f"give one letter per layer")
    return list(pattern)


def validate_hybrid(cfg) -> None:
    """The Mamba / hybrid flags against each other and the layout: one line per problem."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    types = layer_types(m.hybrid_override_pattern, m.num_layers) or []
    if m.squared_relu:
        if m.swiglu or (m.moe is not None and m.moe.num_experts):
            raise ConfigError("--squared-relu is the activation of a plain MLP: drop --swiglu / --num-experts "
                              "(squared-ReLU experts are not implemented)")
    if MOE in types and not (m.moe is not None and m.moe.num_experts):
        raise ConfigError("--hybrid-override-pattern has MoE layers (E): give --num-experts")
    if "mamba" in (t.recompute_modules or ()) and MAMBA not in types:
        raise ConfigError("--recompute-modules mamba needs Mamba layers (M in --hybrid-override-pattern): drop it")
    if types and m.experimental_attention_variant is not None:
        raise ConfigError(f"--hybrid-override-pattern with --experimental-attention-variant "
                          f"{m.experimental_attention_variant}: a hybrid pattern's layers are Mamba-2, attention or "
                          f"MLP; drop one of them")
    if MAMBA not in types:
        return
    from .mamba import MambaConfig
    MambaConfig.from_model(m).check(p.tp)
    if p.cp > 1:
        raise ConfigError(f"context parallelism (--context-parallel-size {p.cp}) with Mamba layers is not "
                          f"implemented yet: use --context-parallel-size 1")
    if m.mtp_depth:
        raise ConfigError("--mtp-num-layers with --hybrid-override-pattern is not implemented: drop one of them")
    if t.transformer_impl == "transformer_engine":
        raise ConfigError("--transformer-impl transformer_engine has no Mamba layers: use --transformer-impl local")
