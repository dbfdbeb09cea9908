"""flash-linear-attention's Triton kernels for the gated delta rule (an optional path, CUDA only),
behind the interface of gated_delta.chunked_gated_delta_rule; the plain-torch path is the reference.

Picked at build time by --linear-attention-kernel fla; a missing package is one line naming it,
only where it was asked for (`missing_reason`). Imported lazily: nothing here loads without it.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional, Tuple

import torch

PACKAGE = "flash-linear-attention"


def missing_reason() -> Optional[str]:
    """Why the fla path cannot run here (None when it can)."""
    if importlib.util.find_spec("fla") is None:
        return f"{PACKAGE} is not installed (pip install {PACKAGE}; its Triton kernels run on CUDA)"
    if not torch.cuda.is_available():
        return f"{PACKAGE}'s Triton kernels need a CUDA device, and there is none here"
    return None


@functools.cache
def _kernels():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore
    from fla.ops.kda import chunk_kda  # type: ignore
    return chunk_gated_delta_rule, chunk_kda


def fla_gated_delta_rule(q, k, v, g, beta, initial_state: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """As chunked_gated_delta_rule (q, k already L2-normalised; g [b, s, h] per head or [b, s, h, dk]
    per channel), on fla's kernels: (outputs in v's dtype, final state in float32)."""
    gdn, kda = _kernels()
    fn = kda if g.dim() == 4 else gdn
    state = None if initial_state is None else initial_state.float()
    out, final = fn(q.to(v.dtype), k.to(v.dtype), v, g=g.float(), beta=beta.to(v.dtype), scale=scale,
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out.to(v.dtype), final.float()
