"""What a transformer layer is built from: a spec of submodule constructors, and the build context.

A `TransformerLayerSpec` names the constructor of each submodule (norms, self-attention, its core
attention, the MLP slot), in the manner of Megatron-Core's ModuleSpec but as a plain dataclass.
Every constructor is called as `ctor(cfg, ctx, layer_number)`; the self-attention constructor also
gets `core_attention=` (a constructor of the same kind). A model picks a spec per layer: standard
attention or MLA (mla.py; what any module of that slot provides is in attention.py), a dense MLP or an
MoE layer, local SDPA / flash-attn / a context-parallel wrapper as the core attention.

`BuildContext` carries what every layer needs besides the model config, explicitly: the layout,
whether activations are sequence-parallel, the parameter dtype, the RNG streams, the GEMM path
of every weight (precision recipe, zero-bubble's deferral of weight gradients), the
recomputation settings, the loss weights and the step hooks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple, Union

import torch

from ..parallel.gemm import GemmPath
from ..parallel.offload import ActivationOffloader
from ..parallel.random import RNGStatesTracker
from ..parallel.state import ParallelDims
from .loss_normalization import LossNormalizationSlot
from .step_hooks import ModelHooks


@dataclass
class BuildContext:
    dims: ParallelDims = field(default_factory=ParallelDims)
    sequence_parallel: bool = False  # activations split along the sequence over TP (tp > 1 only)
    params_dtype: torch.dtype = torch.float32
    tracker: RNGStatesTracker = field(default_factory=RNGStatesTracker)
    gemm: GemmPath = field(default_factory=GemmPath)  # every weight GEMM; deferrable for zero-bubble schedules
    recompute_granularity: Optional[str] = None  # full | selective
    recompute_method: str = "uniform"  # full: uniform groups of recompute_num_layers, or the first ones
    recompute_num_layers: int = 1
    recompute_modules: Tuple[str, ...] = ("core_attn",)  # selective: Megatron's --recompute-modules
    offloader: Optional[ActivationOffloader] = None  # --cpu-offloading: for layers below offloaded_layers
    offloaded_layers: int = 0
    device: Optional[torch.device] = None  # where the built model goes (built on the CPU, then moved)
    cp_comm_type: Union[str, List[str]] = "p2p"  # context parallelism: one type, or one per layer
    loss_normalization: LossNormalizationSlot = field(default_factory=LossNormalizationSlot)  # set every step
    hooks: ModelHooks = field(default_factory=ModelHooks)  # the model's parts register their step hooks here
    compile: bool = False  # torch.compile each transformer layer (--compile)
    cross_entropy_chunk_size: Optional[int] = None  # tokens per cross-entropy chunk; 0: none; None: automatic
    te: Optional[object] = None  # --transformer-impl transformer_engine: te_backend.TEContext (recipe, amax group)

    def __post_init__(self):
        self.sequence_parallel = self.sequence_parallel and self.dims.tp > 1

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation covers `module` (a --recompute-modules name)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules


@dataclass(frozen=True)
class RecurrentState:
    """A recurrent mixer's cache entry (Mamba-2, Gated DeltaNet, KDA): a fixed size per sequence, not
    per token, whatever the length: the shape of each state tensor (kept in fp32)."""
    shapes: Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class TransformerLayerSpec:
    """self_attention or mlp None: a one-block layer (hybrid patterns, transformer/hybrid.py), which
    has neither that block nor its norm."""
    input_layernorm: Callable
    self_attention: Optional[Callable]
    core_attention: Callable
    pre_mlp_layernorm: Callable
    mlp: Optional[Callable]
