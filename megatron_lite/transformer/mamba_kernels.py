"""The optional CUDA kernels of the Mamba-2 mixer (--mamba-impl mamba_ssm): `mamba-ssm`'s chunked SSD
scan and `causal-conv1d`'s depthwise conv, picked at build time like the Transformer Engine backend.
The plain-torch path (ssd.py, mamba.DepthwiseConv) is the reference they are checked against; a
missing package is one line naming it. Packed documents reach both kernels as `seq_idx` (the
document index of each token), where they restart the conv window and the state.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from ..errors import ConfigError

PACKAGES = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}


def check_available() -> None:
    """One line naming the first missing package."""
    for module, package in PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--mamba-impl mamba_ssm needs the {package} package (CUDA only): pip install "
                              f"{' '.join(PACKAGES.values())}, or use --mamba-impl torch")


@functools.cache
def _ops():
    check_available()
    from causal_conv1d import causal_conv1d_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return causal_conv1d_fn, mamba_chunk_scan_combined


def _seq_idx(docs):
    return None if docs is None else (docs - docs[:, :1]).to(torch.int32).contiguous()


def conv(x: torch.Tensor, weight: torch.Tensor, bias, docs) -> torch.Tensor:
    """silu(causal depthwise conv(x)), x [b, s, c], weight [c, 1, k] (no cache: training, prefill)."""
    causal_conv1d_fn, _ = _ops()
    out = causal_conv1d_fn(x.transpose(1, 2), weight[:, 0], bias, seq_idx=_seq_idx(docs), activation="silu")
    return out.transpose(1, 2)


def scan(x, dt, A, B, C, chunk_size: int, docs):
    """The SSD scan from a zero state: (y [b, s, H, p] fp32, final state), dt already through softplus."""
    _, chunk_scan = _ops()
    y, state = chunk_scan(x, dt, A, B, C, chunk_size, seq_idx=_seq_idx(docs), return_final_states=True)
    return y.float(), state.float()
