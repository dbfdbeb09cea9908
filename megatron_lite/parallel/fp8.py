"""FP8 GEMMs without Transformer Engine: a GemmPath (gemm.py) whose primitives quantize both
operands with current scaling and multiply them with torch._scaled_mm (fp32 accumulation, output
in the operands' dtype; on the CPU the equivalent fp32 GEMM of the dequantised operands, `scaled_mm`).

Scale = fp8 max / amax / 2^margin per tensor (`tensorwise`), or per row of the left operand and
per column of the right one, along the contracted dimension (`rowwise`, scales [M,1] x [1,N]).
`--fp8-format hybrid` quantizes output gradients to e5m2, everything else to e4m3. An amax over a
dimension split across ranks is MAX-all-reduced over those ranks, so the layout does not change the
numerics: the features over TP (row-parallel inputs and weights, column-parallel gradients, an
expert's ffn slice at ETP = TP), the tokens over CP (and an expert's tokens over the TP ranks that
each route their own share at ETP = 1; over CP unless EP hands every CP rank's tokens to the
expert's one owner). The per-tensor amax is reduced over all of them (a replicated tensor keeps its
value). Where EP over data-parallel ranks hands an expert the tokens of several micro-batches (the
call's `batches`), each micro-batch's rows get their own scale, as in the single-process run. Only the layers built with the path are FP8 (attention and MLP linears, experts, shared
experts), less a weight marked `keep_precision` (the output layer); the embedding, norms and router
are not built with it. The experts' grouped GEMM is the loop of dense FP8 GEMMs over the experts
(torch._scaled_grouped_mm has no CPU kernel in torch 2.13).
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

    def describe(self, params_dtype, moe_layers=()) -> str:
        """The start-up line; `moe_layers`: per layer, whether its MLP is an MoE layer."""
        fmt = "e4m3" if self.grad_dtype == FORMATS["e4m3"] else "hybrid: e4m3 forward, e5m2 gradients"
        gemms = "QKV, projection" + (", fc1, fc2" if not all(moe_layers) else "") + (", experts" if any(moe_layers) else "")
        return (f"{self.recipe} current scaling ({fmt}, margin {self.margin}) in the attention and MLP linears "
                f"({gemms}); embedding, output layer, norms and router in {str(params_dtype).replace('torch.', '')}")

    # the experts' GEMMs run as the loop over experts (experts.py), one dense FP8 GEMM each
    grouped_kernel = False

    def new_call(self, batches=None):
        # forward records where the GEMM's dimensions are split, and whether it stays plain
        return {"batches": batches}

    def _splits(self, w):
        """(the dimension of the 2-D weight `w` that TP splits or None, the groups splitting the tokens),
        from w's ShardSpec or that of the stacked experts' weight it is one expert of."""
        spec, shift = getattr(w, "shard_spec", None), 0
        if spec is None and w._base is not None:
            spec, shift = getattr(w._base, "shard_spec", None), w._base.dim() - w.dim()
        split = next((s.dim - shift for s in spec.splits if s.axis == "tp"), None) if spec else None
        d = self.dims
        if d is None:
            return split, []
        expert = spec is not None and spec.split("ep") is not None
        tokens = [d.cp_group] if d.cp > 1 and not (expert and d.ep > 1) else []  # EP % CP == 0 (config)
        if expert and d.tp > 1 and d.etp == 1:
            tokens.append(d.tp_group)  # every TP rank routes its share of the tokens to whole experts
        return split, tokens

    def _reducer(self, groups):
        def reduce(amax):
            for group in groups:  # MAX over each in turn: the MAX over all of them
                self.dims.comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        return reduce if groups else None

    def _by_batch(self, batches, groups):
        """reduce(amax [M,1] per row): each row's amax becomes its micro-batch's (over `groups` too)."""
        rows, n = batches

        def reduce(amax):
            per_batch = amax.new_zeros(n).scatter_reduce(0, rows, amax.view(-1), "amax")
            if groups:
                self._reducer(groups)(per_batch)
            amax.copy_(per_batch[rows].view_as(amax))
        return reduce

    def _mm(self, a, b, dtypes, k_groups, out_dtype, call):
        """a [M,K] @ b [K,N] in fp8; k_groups: the groups splitting K (a rowwise amax spans them);
        a tensorwise amax spans every group splitting any dimension of the GEMM."""
        rowwise = self.recipe == "rowwise"
        tp = [self.dims.tp_group] if self.dims is not None and self.dims.tp > 1 else []
        reduce = self._reducer(k_groups if rowwise else tp + call["tokens"])
        if call["batches"] is not None and not rowwise:
            # an expert's rows (tokens) of several micro-batches: one scale per micro-batch, as in
            # the single-process run, which quantizes one micro-batch at a time
            qa, sa = quantize(a, dtypes[0], 1, self.margin, self._by_batch(call["batches"], tp + call["tokens"]))
            qb, sb = quantize(b, dtypes[1], None, self.margin, reduce)
            return scaled_mm(qa, qb, sa, sb.expand(1, b.shape[1]), out_dtype)
        qa, sa = quantize(a, dtypes[0], 1 if rowwise else None, self.margin, reduce)
        qb, sb = quantize(b, dtypes[1], 0 if rowwise else None, self.margin, reduce)
        return scaled_mm(qa, qb, sa, sb, out_dtype)

    def _tp_if(self, split):
        return [self.dims.tp_group] if split and self.dims is not None and self.dims.tp > 1 else []

    def forward(self, call, x, w, bias=None):
        call["plain"] = getattr(w, "keep_precision", False)
        if call["plain"]:
            return super().forward(call, x, w, bias)
        (w if w._base is None else w._base).fp8_gemm = True  # its ZeRO gathers may move FP8 (fp8_param_gather.py)
        call["split"], call["tokens"] = self._splits(w)
        k_split = self._tp_if(call["split"] == 1)  # row parallel: x and W split along the contracted dimension
        e4m3 = FORMATS["e4m3"]
        y = self._mm(x.reshape(-1, x.shape[-1]), w.t(), (e4m3, e4m3), k_split, x.dtype, call)
        y = y.reshape(*x.shape[:-1], w.shape[0]).detach()  # not a view: callers may modify it in place
        return y if bias is None else y + bias

    def input_grad(self, call, g, w):
        if call["plain"]:
            return super().input_grad(call, g, w)
        n_split = self._tp_if(call["split"] == 0)  # column parallel: g and W split along the output features
        g2 = self._mm(g.reshape(-1, g.shape[-1]), w, (self.grad_dtype, FORMATS["e4m3"]), n_split, g.dtype, call)
        return g2.reshape(*g.shape[:-1], w.shape[1])

    def weight_grad(self, call, g, x):
        if call["plain"]:
            return super().weight_grad(call, g, x)
        # contracted over the tokens (SP inputs are gathered again, CP's stay split)
        g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if call["batches"] is None:
            return self._mm(g.t(), x, (self.grad_dtype, FORMATS["e4m3"]), call["tokens"], g.dtype, call)
        (rows, n), one = call["batches"], dict(call, batches=None)  # each micro-batch quantized alone, summed
        return sum(self._mm(g[rows == i].t(), x[rows == i], (self.grad_dtype, FORMATS["e4m3"]), call["tokens"],
                            g.dtype, one) for i in range(n))
