"""The run-time choice of fast paths (torch.compile per layer, the chunked cross entropy) and
the start-up line that names every fast path a run took, so that a user sees on the first
lines of the log whether a slow fallback is in use."""
from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Optional

import torch
import torch.nn as nn

CHUNK_BYTES = 256 * 2 ** 20  # the cross entropy's fp32 working set per chunk in the automatic mode


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def compile_problem(device=None) -> Optional[str]:
    """What TorchInductor lacks on this device (None: --compile can run): a C++ compiler on the
    CPU, Triton on CUDA. Found before the run, not as a stack trace at the first forward."""
    if _device_type(device) == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "TorchInductor on CUDA needs the triton package (pip install triton)"
        return None
    compilers = [os.environ.get("CXX"), "g++", "clang++", "c++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "TorchInductor on the CPU needs a C++ compiler (g++ or clang++ on PATH, or $CXX)"
    return None


def compile_layer(layer: nn.Module) -> None:
    """Run one transformer layer's forward through torch.compile (transformer/block.py: one
    compiled function for every layer, selected by a flag). The module's own call (and with it its
    hooks: ZeRO-3's parameter gathering) stays eager, its parameter names stay as they are
    (checkpoints do not see the compile), deepcopy and pickle keep working; collectives inside the
    layer, and the zero-bubble schedules' deferred weight gradients, are graph breaks."""
    layer.compiled = True


def cross_entropy_chunk_tokens(setting: Optional[int], logits_dtype: torch.dtype, vocab_per_rank: int) -> int:
    """Tokens per chunk of the vocab-parallel cross entropy; 0: the whole micro-batch at once.
    `setting` None (automatic): chunk bf16/fp16 logits so that a chunk's fp32 copy stays near
    CHUNK_BYTES; fp32 logits are worked on in place already and need no chunks."""
    if setting is not None:
        return setting
    if logits_dtype == torch.float32:
        return 0
    return max(1, CHUNK_BYTES // (4 * vocab_per_rank))


def describe_fast_paths(*, device, params_dtype: torch.dtype, compile: bool, chunk_setting: Optional[int],
                        vocab_per_rank: int, normalization: str, fused_adamw: bool) -> str:
    """The start-up line's fast paths after the attention kernel: norm, compile, cross entropy, AdamW."""
    norm = "F.rms_norm" if normalization == "RMSNorm" else "F.layer_norm"
    chunk = cross_entropy_chunk_tokens(chunk_setting, params_dtype, vocab_per_rank)
    ce = f"chunked ({chunk} tokens)" if chunk else "whole micro-batch"
    comp = "per layer (inductor)" if compile else "off (eager)"
    adam = "fused kernel" if fused_adamw else "formula over slices (no fused kernel in this build)"
    return f"norm {norm} | compile {comp} | cross entropy {ce} | AdamW {adam} ({_device_type(device)})"
