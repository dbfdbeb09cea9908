"""Model FLOPs for throughput and MFU (PaLM appendix B convention)."""
from __future__ import annotations

from ..config import ModelConfig
from ..transformer.model_counts import MicroBatch, model_counts

# Dense bf16 peak of known accelerators (TFLOP/s); MFU is reported only when the device is known.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token, 3 x the forward its layer types report: 6N + 12 * L * H * Q * T,
    with N the weights a token uses excluding the input embedding (the output layer counted, tied or
    not; of an MoE layer only the router, the k experts it is sent to and the shared expert), L
    layers, H heads, Q head dim, T the keys a query sees (the sequence, or the sliding window). The
    attention term is not halved for causality."""
    return 3.0 * model_counts(cfg, MicroBatch(seq_length=seq_length)).total.flops


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
