"""Which token mixer fills each layer's attention slot, decided here and nowhere else.

Megatron-Core's flags: `--experimental-attention-variant gated_delta_net` with
`--linear-attention-freq` (an int N: every N-th layer, counting from 1, is full attention, the
others linear; or one entry per layer, 1 linear and 0 full, such as "[1,1,1,0]*2"). Ours:
`--linear-attention-type kda` makes the linear layers Kimi Delta Attention instead of Gated DeltaNet
(Megatron has no such flag). Multi-token prediction's layers take the last decoder layer's mixer,
as their specs do. Light on imports: the config checks use it while parsing flags.
"""
from __future__ import annotations

from typing import List

from ..errors import ConfigError
from .moe.config import layer_pattern_of_text

FULL_ATTENTION = "attention"
LINEAR_TYPES = ("gated_delta_net", "kda")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def parse_linear_attention_freq(value, num_layers: int) -> List[bool]:
    """Per layer, True where it is a linear-attention layer (see the module doc)."""
    given = value
    if isinstance(value, str):
        try:
            value = layer_pattern_of_text(value)
        except (SyntaxError, ValueError, TypeError) as e:
            raise ConfigError(f"--linear-attention-freq {given!r} is not an int or a list of 1 (linear) / 0 (full) "
                              f"such as '([1]*3+[0]*1)*2': {e}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        _require(value >= 1, f"--linear-attention-freq ({given!r}) must be >= 1: N makes every N-th layer full "
                             f"attention (1: all of them)")
        return [(i + 1) % value != 0 for i in range(num_layers)]
    _require(isinstance(value, list) and all(v in (0, 1) and not isinstance(v, bool) for v in value),
             f"--linear-attention-freq ({given!r}) must be an int or a list of 1 (linear) and 0 (full), one per layer")
    _require(len(value) == num_layers, f"--linear-attention-freq ({given!r}) has {len(value)} entries for "
                                       f"{num_layers} layers: give one 1/0 per layer")
    return [v == 1 for v in value]


def uses_linear_attention(cfg) -> bool:
    return getattr(cfg, "experimental_attention_variant", None) == "gated_delta_net"


def layer_mixers(cfg) -> List[str]:
    """The mixer of every decoder layer: FULL_ATTENTION or one of LINEAR_TYPES."""
    if not uses_linear_attention(cfg):
        return [FULL_ATTENTION] * cfg.num_layers
    linear = parse_linear_attention_freq(cfg.linear_attention_freq, cfg.num_layers)
    return [cfg.linear_attention_type if is_linear else FULL_ATTENTION for is_linear in linear]


def layer_mixer(cfg, layer_number: int) -> str:
    """Layer `layer_number`'s mixer (0-based; multi-token prediction's layers, numbered after the
    decoder's, take the last decoder layer's)."""
    return layer_mixers(cfg)[min(layer_number, cfg.num_layers - 1)]


def validate_linear_attention(cfg) -> None:
    """The --linear-* flags and --attention-output-gate (cfg: the model config): one ConfigError line each."""
    _require(not (cfg.attention_output_gate and cfg.multi_latent_attention),
             "--attention-output-gate gates standard attention's output; it is not built for "
             "--multi-latent-attention: drop one of them")
    if not uses_linear_attention(cfg):
        return
    _require(cfg.linear_attention_freq is not None,
             "--experimental-attention-variant gated_delta_net needs --linear-attention-freq (N: every N-th layer "
             "is full attention; or a 1/0 list per layer)")
    layer_mixers(cfg)
    for flag in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_chunk_size"):
        _require(getattr(cfg, flag) >= 1, f"--{flag.replace('_', '-')} ({getattr(cfg, flag)}) must be >= 1")
    _require(cfg.linear_attention_type in LINEAR_TYPES,
             f"--linear-attention-type ({cfg.linear_attention_type}) must be one of {', '.join(LINEAR_TYPES)}")
    if cfg.linear_attention_kernel == "fla":
        from ..kernels.fla_backend import missing_reason
        reason = missing_reason()
        _require(reason is None, f"--linear-attention-kernel fla: {reason}; or use --linear-attention-kernel torch")
    if cfg.linear_attention_type == "gated_delta_net":
        _require(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
                 f"--linear-num-value-heads ({cfg.linear_num_value_heads}) must be a multiple of "
                 f"--linear-num-key-heads ({cfg.linear_num_key_heads})")


def validate_linear_attention_layout(cfg, tp: int, cp: int) -> None:
    """Checks against the layout: heads divisible by TP (Megatron's rule), no CP yet."""
    if not uses_linear_attention(cfg) or not any(m != FULL_ATTENTION for m in layer_mixers(cfg)):
        return
    kda = cfg.linear_attention_type == "kda"
    heads = [("--linear-num-key-heads", cfg.linear_num_key_heads)]
    if not kda:
        heads.append(("--linear-num-value-heads", cfg.linear_num_value_heads))
    for flag, n in heads:
        _require(n % tp == 0, f"{flag} ({n}) must be divisible by --tensor-model-parallel-size ({tp}): the "
                              f"linear-attention heads are split over TP")
    _require(cp == 1, f"--context-parallel-size {cp} with {cfg.linear_attention_type} layers: context parallelism "
                      f"for linear-attention mixers is not built yet; use --context-parallel-size 1")
