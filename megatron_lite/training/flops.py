"""Model FLOPs for throughput and MFU (PaLM appendix B convention)."""
from __future__ import annotations

from ..config import ModelConfig

# Dense bf16 peak of known accelerators (TFLOP/s); MFU is reported only when the device is known.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6N + 12 * L * H * Q * T, with N the parameters a token uses
    excluding the input embedding (the output layer counted; of an MoE layer only the router, the
    k experts it is sent to and the shared expert), L layers, H heads, Q head dim, T the keys a
    query sees (the sequence, or the sliding window). The attention term is not halved for
    causality."""
    n = cfg.num_parameters(include_embedding=False, active=True)
    if not cfg.untie_embeddings_and_output_weights:
        n += cfg.vocab_size * cfg.hidden_size  # the tied output projection still does its GEMM
    keys = min(seq_length, cfg.window_size) if cfg.window_size else seq_length
    attn = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * keys
    return 6.0 * n + attn


def device_peak_tflops(device) -> float:
    try:
        import torch
        if device.type != "cuda":
            return 0.0
        name = torch.cuda.get_device_name(device)
    except Exception:
        return 0.0
    for key, peak in PEAK_TFLOPS.items():
        if key in name:
            return peak
    return 0.0
