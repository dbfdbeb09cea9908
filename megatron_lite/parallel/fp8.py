"""FP8 GEMMs without Transformer Engine: a GemmPath (gemm.py) whose primitives quantize both
operands with current scaling and multiply them with torch._scaled_mm (fp32 accumulation, output
in the operands' dtype; on the CPU the equivalent fp32 GEMM of the dequantised operands, `scaled_mm`).

Scale = fp8 max / amax / 2^margin per tensor (`tensorwise`), or per row of the left operand and
per column of the right one, along the contracted dimension (`rowwise`, scales [M,1] x [1,N]).
`--fp8-format hybrid` quantizes output gradients to e5m2, everything else to e4m3. An amax over a
dimension split across TP ranks (row-parallel inputs and weights, column-parallel gradients,
sequence-parallel activations) is MAX-all-reduced over the TP group, so the layout does not change
the numerics. The per-tensor amax is reduced for every tensor (a replicated one keeps its value).
Only the layers built with the path are FP8 (attention and MLP linears, experts), less a weight
marked `keep_precision` (the output layer); the embedding, norms and router are not built with it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .gemm import GemmPath

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(t: torch.Tensor, dtype: torch.dtype, dim=None, margin: int = 0, reduce=None):
    """(q, inverse scale): t scaled into fp8 `dtype` by its amax over all elements (dim None) or
    over `dim` (kept); reduce(amax) makes the amax that of the whole tensor across ranks."""
    fmax = torch.finfo(dtype).max
    t = t.float()
    a = t.abs()
    if dim is None:
        amax = a.amax() if a.numel() else a.sum()  # the sum of nothing: a zero of the right shape
    else:
        amax = a.amax(dim, keepdim=True) if a.shape[dim] else a.sum(dim, keepdim=True)
    if reduce is not None:
        reduce(amax)
    scale = torch.where(amax > 0, fmax / amax / 2.0 ** margin, torch.ones_like(amax))
    return (t * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def scaled_mm(qa, qb, sa, sb, out_dtype):
    """(qa sa) @ (qb sb) with fp32 accumulation: torch._scaled_mm on a GPU. Its CPU reference kernel
    runs at about 40 MFLOP/s (a 1024^3 GEMM: 50 s on this machine), so on the CPU the same product
    is the fp32 GEMM of the dequantised operands (equal up to fp32 summation order). The GPU branch
    has not run yet (no device was lent to the change that wrote it)."""
    if qa.device.type == "cpu":
        return ((qa.float() * sa) @ (qb.float() * sb)).to(out_dtype)
    return torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class Float8GemmPath(GemmPath):
    """FP8 current scaling; `dims`: the layout whose TP group reduces split amaxes."""

    def __init__(self, dims=None, fmt: str = "e4m3", recipe: str = "tensorwise", margin: int = 0,
                 deferrable: bool = False):
        super().__init__(deferrable)
        assert fmt in ("e4m3", "hybrid") and recipe in ("tensorwise", "rowwise"), (fmt, recipe)
        self.dims, self.recipe, self.margin = dims, recipe, margin
        self.grad_dtype = FORMATS["e5m2" if fmt == "hybrid" else "e4m3"]

    def describe(self, params_dtype, moe_layers=(), mla: bool = False) -> str:
        """The start-up line; `moe_layers`: per layer, whether its MLP is an MoE layer; `mla`: multi-latent
        attention's projections instead of QKV."""
        fmt = "e4m3" if self.grad_dtype == FORMATS["e4m3"] else "hybrid: e4m3 forward, e5m2 gradients"
        gemms = ("Q, KV down- and up-projections" if mla else "QKV") + ", projection"
        gemms += (", fc1, fc2" if not all(moe_layers) else "") + (", experts" if any(moe_layers) else "")
        return (f"{self.recipe} current scaling ({fmt}, margin {self.margin}) in the attention and MLP linears "
                f"({gemms}); embedding, output layer, norms and router in {str(params_dtype).replace('torch.', '')}")

    def new_call(self):
        return {}  # forward records which dimension of the weight TP splits, and whether it stays plain

    def _reduce(self, amax):
        self.dims.comm.all_reduce(amax, self.dims.tp_group, op=dist.ReduceOp.MAX)

    def _mm(self, a, b, dtypes, reduce, out_dtype):
        """a [M,K] @ b [K,N] in fp8; reduce[i]: operand i's amax spans ranks (split K, or tensorwise)."""
        rowwise = self.recipe == "rowwise"
        split = self.dims is not None and self.dims.tp > 1
        qa, sa = quantize(a, dtypes[0], 1 if rowwise else None, self.margin,
                          self._reduce if split and (reduce[0] or not rowwise) else None)
        qb, sb = quantize(b, dtypes[1], 0 if rowwise else None, self.margin,
                          self._reduce if split and (reduce[1] or not rowwise) else None)
        return scaled_mm(qa, qb, sa, sb, out_dtype)

    def forward(self, call, x, w, bias=None):
        call["plain"] = getattr(w, "keep_precision", False)
        if call["plain"]:
            return super().forward(call, x, w, bias)
        spec = getattr(w, "shard_spec", None)
        call["split"] = next((s.dim for s in spec.splits if s.axis == "tp"), None) if spec else None
        k_split = call["split"] == 1  # row parallel: x and W split along the contracted dimension
        e4m3 = FORMATS["e4m3"]
        y = self._mm(x.reshape(-1, x.shape[-1]), w.t(), (e4m3, e4m3), (k_split, k_split), x.dtype)
        y = y.reshape(*x.shape[:-1], w.shape[0]).detach()  # not a view: callers may modify it in place
        return y if bias is None else y + bias

    def input_grad(self, call, g, w):
        if call["plain"]:
            return super().input_grad(call, g, w)
        n_split = call["split"] == 0  # column parallel: g and W split along the output features
        g2 = self._mm(g.reshape(-1, g.shape[-1]), w, (self.grad_dtype, FORMATS["e4m3"]), (n_split, n_split), g.dtype)
        return g2.reshape(*g.shape[:-1], w.shape[1])

    def weight_grad(self, call, g, x):
        if call["plain"]:
            return super().weight_grad(call, g, x)
        # contracted over the tokens, which every TP rank holds whole (SP inputs are gathered)
        return self._mm(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]),
                        (self.grad_dtype, FORMATS["e4m3"]), (False, False), g.dtype)

    def grouped_forward(self, call, x, w, offs):
        raise NotImplementedError("FP8 grouped GEMM")  # refused at configuration (--moe-grouped-gemm)

    grouped_input_grad = grouped_weight_grad = grouped_forward
