"""Routed experts stacked in two weights, and the shared expert.

`GroupedExperts` holds this rank's E_local = E / EP experts (E_local consecutive global experts
starting at ep_rank * E_local) as
  weight1 [E_local, 2F/ETP, H]  SwiGLU: this rank's slice of [gate | up] (or [E_local, F/ETP, H] GELU)
  weight2 [E_local, H, F/ETP]
(the layout of transformers' fused Mixtral/Qwen/DeepSeek experts `gate_up_proj` / `down_proj`).
With `bias` (--add-bias-linear with MoE, gpt-oss) also bias1 [E_local, 2F] and bias2 [E_local, H],
added to each expert's rows before the routing weight; refused with ETP > 1 (the output is then
a partial sum that a replicated bias2 cannot join).
Their ShardSpecs: full shapes [E, 2F, H] and [E, H, F]; Split(0, "ep", EP, ep_rank, (E,)) always
(so every expert parameter is recognisable, `is_expert_parameter`); with ETP > 1 also a "tp"
split of the ffn dimension over the expert TP group (dim 1 of weight1 in two segments [F, F],
dim 2 of weight2; ETP pieces, this rank's etp_rank).
Expert gradients are summed over the expert-data-parallel group, not dp_cp, and in the global
grad norm every rank counts all of its expert elements, all-reduced over `expert_mp`.

Input: tokens [N, H] sorted by local expert with the count per expert. Both projections go
through the layer's GemmPath (parallel/gemm.py). With moe_grouped_gemm each is one grouped GEMM
(by default one `torch._grouped_mm` call: fp32 on CPU, bf16 on CUDA; rows must be
16-byte aligned: H and F/ETP multiples of 4 fp32 / 8 bf16 elements); otherwise a loop over the
experts (the reference path). With ETP > 1 the output is this rank's partial sum.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...errors import ConfigError
from ...parallel.gemm import GemmPath, apply as gemm_apply
from ...parallel.random import recomputed_when_saved
from ...parallel.sharding import ShardSpec, Split, replicated, set_spec, spec_of
from ...parallel.state import ParallelDims
from ...parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..mlp import GatedUnit

ACTIVATIONS = ("gelu", "gelu_tanh")


def activation_fn(h: torch.Tensor, swiglu: bool, activation: str, glu: Optional[GatedUnit] = None) -> torch.Tensor:
    """`swiglu`: a gated unit, `glu` (None: SwiGLU); else `activation`."""
    if swiglu:
        return (glu or GatedUnit())(h)
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


def is_expert_parameter(param: nn.Parameter) -> bool:
    """True for parameters split over experts (reduced over edp, normed over expert_mp)."""
    return spec_of(param).split("ep") is not None


class _ExpertsLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] @ w[e]^T for stacked w [E, out, in] through `gemm`: one
    grouped GEMM per pass, or the dense GEMM per expert (the reference loop). The weight
    gradient may be deferred (zero-bubble's W pass)."""

    @staticmethod
    def forward(ctx, x, w, gemm, tokens_per_expert, grouped, batches, orders):
        ctx.save_for_backward(x, w)
        ctx.gemm, ctx.weight, ctx.sizes, ctx.grouped = gemm, w, tokens_per_expert, grouped
        if grouped:
            ctx.offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
            ctx.call = gemm.new_call()
            return gemm.grouped_forward(ctx.call, x, w, ctx.offs)
        rows = batches[0].split(tokens_per_expert) if batches else [None] * len(tokens_per_expert)
        order = orders[0].split(tokens_per_expert) if orders else [None] * len(tokens_per_expert)
        ctx.calls = [gemm.new_call(batches and (r, batches[1]), orders and (o, orders[1]))
                     for r, o in zip(rows, order)]
        return torch.cat([gemm.forward(c, xe, w[e]) for e, (c, xe) in enumerate(zip(ctx.calls, x.split(ctx.sizes)))])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gemm, need, grad_x = ctx.gemm, ctx.needs_input_grad, None
        if ctx.grouped:
            g, call, offs = g.contiguous(), ctx.call, ctx.offs  # _grouped_mm rejects expanded gradients
            grad_x = gemm.grouped_input_grad(call, g, w, offs) if need[0] else None

            def weight_grad():
                return (gemm.grouped_weight_grad(call, g, x, offs),)
        else:
            pieces = list(zip(ctx.calls, g.split(ctx.sizes), x.split(ctx.sizes)))
            if need[0]:
                grad_x = torch.cat([gemm.input_grad(c, ge, w[e]) for e, (c, ge, _) in enumerate(pieces)])

            def weight_grad():
                return (torch.stack([gemm.weight_grad(c, ge, xe) for c, ge, xe in pieces]),)
        grad_w, = gemm.param_grads((ctx.weight,), weight_grad) if need[1] else (None,)
        return grad_x, grad_w, None, None, None, None, None


def experts_linear(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: List[int], gemm: GemmPath,
                   grouped: bool, batches=None, orders=None) -> torch.Tensor:
    """`batches`: (the micro-batch of each row of x, how many) where EP brings rows of several;
    `orders`: (each row's place among its expert's rows in the single process, tokens), see GemmPath.new_call."""
    return gemm_apply(_ExpertsLinear, gemm, x, w, gemm, tokens_per_expert, grouped and gemm.grouped_kernel, batches,
                      orders)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, dims: ParallelDims,
                 swiglu: bool = True, activation: str = "gelu", grouped_gemm: bool = False, dtype=torch.float32,
                 gemm: Optional[GemmPath] = None, glu: Optional[GatedUnit] = None, bias: bool = False,
                 recompute_act: bool = False):
        """`recompute_act` (--recompute-modules moe_act): the activation's output, fc2's input, is
        not kept for backward but computed again from fc1's output there."""
        super().__init__()
        self.recompute_act = recompute_act
        if bias and dims.etp > 1:
            raise ConfigError("expert biases (--add-bias-linear with MoE) need expert tensor parallel size 1: "
                              "drop --expert-tensor-parallel-size or add --disable-bias-linear")
        if not swiglu and activation not in ACTIVATIONS:
            raise ConfigError(f"expert activation {activation!r} is not one of {', '.join(ACTIVATIONS)}: "
                              f"pick one of those or use SwiGLU experts")
        self.swiglu, self.activation, self.grouped_gemm, self.glu = swiglu, activation, grouped_gemm, glu
        self.gemm = gemm if gemm is not None else GemmPath()
        self.num_local_experts = num_experts // dims.ep
        self.local_expert_start = dims.ep_rank * self.num_local_experts
        ep_split = Split(0, "ep", dims.ep, dims.ep_rank, (num_experts,))
        f, h = ffn_hidden_size, hidden_size
        fc1_rows, fc1_segments = (2 * f, (f, f)) if swiglu else (f, (f,))
        fc1_splits, fc2_splits = (ep_split,), (ep_split,)
        if dims.etp > 1:  # the ffn dimension over the expert TP group (the "tp" axis, ETP pieces)
            fc1_splits += (Split(1, "tp", dims.etp, dims.etp_rank, fc1_segments),)
            fc2_splits += (Split(2, "tp", dims.etp, dims.etp_rank, (f,)),)
        spec1 = ShardSpec((num_experts, fc1_rows, h), fc1_splits, init="normal")
        spec2 = ShardSpec((num_experts, h, f), fc2_splits, init="normal_scaled")
        self.weight1 = set_spec(nn.Parameter(torch.empty(spec1.local_shape, dtype=dtype)), spec1)
        self.weight2 = set_spec(nn.Parameter(torch.empty(spec2.local_shape, dtype=dtype)), spec2)
        self.bias1 = self.bias2 = None
        if bias:
            self.bias1 = self._bias((num_experts, fc1_rows), ep_split, dtype)
            self.bias2 = self._bias((num_experts, h), ep_split, dtype)
        if grouped_gemm:
            self._check_grouped_gemm(dtype)

    @staticmethod
    def _bias(full_shape, ep_split: Split, dtype) -> nn.Parameter:
        spec = ShardSpec(full_shape, (ep_split,), init="zeros")
        return set_spec(nn.Parameter(torch.empty(spec.local_shape, dtype=dtype)), spec)

    def _check_grouped_gemm(self, dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"moe_grouped_gemm runs in float32, bfloat16 or float16, not {dtype}: "
                              f"drop --moe-grouped-gemm or change the parameter dtype")
        align = 16 // torch.empty((), dtype=dtype).element_size()
        for name, size in (("hidden size", self.weight1.shape[2]), ("expert ffn size per ETP rank", self.weight2.shape[2])):
            if size % align:
                raise ConfigError(f"moe_grouped_gemm needs the {name} ({size}) to be a multiple of {align} for "
                                  f"{dtype} (16-byte rows): change it or drop --moe-grouped-gemm")

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int], batches=None, orders=None) -> torch.Tensor:
        """x [N, H] sorted by local expert, tokens_per_expert [E_local] -> [N, H]; `batches`, `orders`:
        see experts_linear (the dispatcher's)."""
        rows = None if self.bias1 is None else torch.tensor(tokens_per_expert, device=x.device)

        def linear(inp, w, b):
            y = experts_linear(inp, w, tokens_per_expert, self.gemm, self.grouped_gemm, batches, orders)
            return y if b is None else y + b.repeat_interleave(rows, dim=0, output_size=y.shape[0])
        h1 = linear(x, self.weight1, self.bias1)
        h = self._activation(h1)
        if not (self.recompute_act and self.training and torch.is_grad_enabled()):
            return linear(h, self.weight2, self.bias2)
        with recomputed_when_saved(h, self._activation, h1):
            return linear(h, self.weight2, self.bias2)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        return activation_fn(h, self.swiglu, self.activation, self.glu)


class SharedExpertMLP(nn.Module):
    """The shared expert every token goes through: a dense TP MLP (column- then row-parallel, so
    its input and output follow the layer's SP layout), optionally scaled by
    sigmoid(x . gate_weight) per token (Qwen2-MoE). gate_weight [1, H] is whole on every rank
    (partial gradients under SP, like a norm weight)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dims: ParallelDims, sequence_parallel: bool,
                 swiglu: bool = True, activation: str = "gelu", gate: bool = False, dtype=torch.float32,
                 gemm: Optional[GemmPath] = None, glu: Optional[GatedUnit] = None):
        super().__init__()
        self.dims, self.sequence_parallel = dims, sequence_parallel
        self.swiglu, self.activation, self.glu = swiglu, activation, glu
        i = intermediate_size
        self.linear_fc1 = ColumnParallelLinear(hidden_size, 2 * i if swiglu else i, dims, bias=False,
                                               sequence_parallel=sequence_parallel,
                                               segments=[i, i] if swiglu else None, dtype=dtype, gemm=gemm)
        self.linear_fc2 = RowParallelLinear(i, hidden_size, dims, bias=False, sequence_parallel=sequence_parallel,
                                            dtype=dtype, gemm=gemm)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
            set_spec(self.gate_weight, replicated((1, hidden_size), sequence_parallel=sequence_parallel))
        else:
            self.register_parameter("gate_weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc2(activation_fn(self.linear_fc1(x), self.swiglu, self.activation, self.glu))
        if self.gate_weight is not None:  # a [1, H] GEMV: not worth a recipe or a deferral
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
