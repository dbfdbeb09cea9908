"""Rotary position embeddings (RoPE), in the half-split convention of Llama / Hugging Face, with
Llama-3.1's and YaRN's frequency scaling and partial rotation (--rotary-percent)."""
from __future__ import annotations

import math
import torch


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position: int) -> torch.Tensor:
    """Llama-3.1's RoPE scaling: wavelengths longer than original / low_freq_factor are stretched by
    `factor`, those shorter than original / high_freq_factor kept, and the band between blended."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_max_position / low_freq_factor, original_max_position / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaled(inv_freq: torch.Tensor, dim: int, base: float, factor: float, original_max_position: int,
                beta_fast: float, beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN (Peng et al., 2023): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by `factor`), those turning more than beta_fast times kept, and
    a linear ramp over the channel index blends the band between (its ends floored / ceiled unless
    not `round_to_int`: gpt-oss, HF's truncate=False)."""
    def channel(rotations):  # the channel pair whose frequency turns `rotations` times over the context
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = channel(beta_fast), channel(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_dim(cfg) -> int:
    """The channels RoPE rotates per head: MLA's decoupled RoPE part, else a fraction of the head."""
    if getattr(cfg, "multi_latent_attention", False):
        return cfg.qk_pos_emb_head_dim
    return int(cfg.kv_channels * cfg.rotary_percent)


def rope_attention_factor(cfg) -> float:
    """What cos and sin are multiplied by: YaRN's mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) (as Megatron-Core's YarnRotaryEmbedding and Hugging Face's DeepSeek), else 1."""
    if cfg.rope_scaling_type != "yarn":
        return 1.0
    f = cfg.rotary_scaling_factor
    return yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim)


def softmax_scale_factor(cfg) -> float:
    """The softmax scale over 1/sqrt(head size): YaRN's mscale(factor, mscale_all_dim)^2 (DeepSeek)."""
    if cfg.rope_scaling_type != "yarn":
        return 1.0
    return yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2


def rope_inv_freq(cfg, device="cpu") -> torch.Tensor:
    """The rotation frequencies of the model config, one per rotated pair of each head's first
    channels; on the CPU unless told (a model built under torch.device("meta") still needs real
    values). As Megatron-Core's RotaryEmbedding (and Hugging Face's partial_rotary_factor): for the
    n = int(kv_channels * rotary_percent) channels asked, base^(-2i / n) for i < ceil(n / 2), so an
    odd n rotates n + 1 channels."""
    n = rope_dim(cfg)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, n, 2, dtype=torch.float32, device=device) / n))
    if cfg.rope_scaling_type == "llama3":
        inv_freq = llama3_scaled(inv_freq, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                                 cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_position)
    elif cfg.rope_scaling_type == "yarn":
        inv_freq = yarn_scaled(inv_freq, n, cfg.rotary_base, cfg.rotary_scaling_factor,
                               cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow,
                               cfg.yarn_correction_range_round_to_int)
    return inv_freq


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype, scale: float = 1.0) -> tuple:
    """position_ids [b, s] -> cos, sin shaped [s, b, 1, rotary dim] for [s, b, heads, d] tensors,
    multiplied by `scale` (YaRN's attention factor)."""
    freqs = position_ids.t().float().unsqueeze(-1) * inv_freq.to(position_ids.device)  # [s, b, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of each head (all of them unless partial)."""
    dim = cos.shape[-1]
    rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)


