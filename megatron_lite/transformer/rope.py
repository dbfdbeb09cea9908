"""Rotary position embeddings (RoPE), in the half-split convention of Llama / Hugging Face, with
Llama-3.1's frequency scaling and partial rotation (--rotary-percent)."""
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


def rope_inv_freq(cfg, device="cpu") -> torch.Tensor:
    """The rotation frequencies of the model config, one per rotated pair of each head's first
    channels; on the CPU unless told (a model built under torch.device("meta") still needs real
    values). As Megatron-Core's RotaryEmbedding (and Hugging Face's partial_rotary_factor): for the
    n = int(kv_channels * rotary_percent) channels asked, base^(-2i / n) for i < ceil(n / 2), so an
    odd n rotates n + 1 channels."""
    n = int(cfg.kv_channels * cfg.rotary_percent)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, n, 2, dtype=torch.float32, device=device) / n))
    if cfg.rope_scaling_type == "llama3":
        inv_freq = llama3_scaled(inv_freq, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                                 cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_position)
    return inv_freq


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple:
    """position_ids [b, s] -> cos, sin shaped [s, b, 1, rotary dim] for [s, b, heads, d] tensors."""
    freqs = position_ids.t().float().unsqueeze(-1) * inv_freq.to(position_ids.device)  # [s, b, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of each head (all of them unless partial)."""
    dim = cos.shape[-1]
    rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)


