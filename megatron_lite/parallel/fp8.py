"""FP8 GEMMs without Transformer Engine: a GemmPath (gemm.py) whose primitives quantize both
operands with current scaling and multiply them with torch._scaled_mm (fp32 accumulation, output
in the operands' dtype; on the CPU the equivalent fp32 GEMM of the dequantised operands, `scaled_mm`).

Scale = fp8 max / amax / 2^margin per tensor (`tensorwise`), or per row of the left operand and
per column of the right one, along the contracted dimension (`rowwise`, scales [M,1] x [1,N]).
`--fp8-format hybrid` quantizes output gradients to e5m2, everything else to e4m3. An amax over a
dimension split across ranks is MAX-all-reduced over those ranks, so the layout does not change the
numerics: the features over TP (row-parallel inputs and weights, column-parallel gradients; an
expert's ffn slice over ETP), the tokens over CP (an expert's tokens over EDP: every rank routes
its own tokens, and those of one micro-batch for expert e reach the ranks holding e, whatever
the folded expert grid). The per-tensor amax is reduced over all of them (a replicated tensor keeps
its value). An expert's rows carry their micro-batch (the data-parallel rank they came from, the
call's `batches`): each micro-batch's rows get their own scale, as in the single-process run. Only the layers built with the path are FP8 (attention and MLP linears, experts, shared
experts), less a weight marked `keep_precision` (the output layer, and with --first-last-layers-bf16
those layers' weights); the embedding, norms and router are not built with it. The experts' grouped GEMM is the loop of dense FP8 GEMMs over the experts
(torch._scaled_grouped_mm has no CPU kernel in torch 2.13).

`delayed` (fp8_delayed.py) scales each tensor by a scale from its amax history, a recipe state
keyed by the weight's global name (`bind`); `blockwise` (fp8_blocks.py) scales 1x128 tiles of
activations and gradients and 128x128 blocks of weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .fp8_blocks import blockwise_mm, check_tp_blocks
from .fp8_delayed import DelayedScaling
from .gemm import GemmPath, keep_precision

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(t: torch.Tensor, dtype: torch.dtype, dim=None, margin: int = 0, reduce=None, scale=None):
    """(q, inverse scale): t scaled into fp8 `dtype` by its amax over all elements (dim None) or
    over `dim` (kept); reduce(amax) makes the amax that of the whole tensor across ranks. A given
    `scale` (delayed scaling's) is used as it is: values beyond fp8 max / scale saturate."""
    fmax = torch.finfo(dtype).max
    t = t.float()
    if scale is not None:
        return (t * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()
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
    """FP8 GEMMs by `recipe`; `dims`: the layout whose groups reduce split amaxes. Delayed scaling's
    history length and amax algorithm, and the device its state lives on, are its last arguments."""

    def __init__(self, dims=None, fmt: str = "e4m3", recipe: str = "tensorwise", margin: int = 0,
                 deferrable: bool = False, amax_history_len: int = 1, amax_compute_algo: str = "most_recent",
                 device=None):
        super().__init__(deferrable)
        assert fmt in ("e4m3", "hybrid") and recipe in ("tensorwise", "rowwise", "delayed", "blockwise"), (fmt, recipe)
        self.dims, self.recipe, self.margin = dims, recipe, margin
        self.grad_dtype = FORMATS["e5m2" if fmt == "hybrid" else "e4m3"]
        self.delayed = None  # the recipe state of delayed scaling (its step hooks too)
        if recipe == "delayed":
            dtypes = {"input": FORMATS["e4m3"], "weight": FORMATS["e4m3"], "grad": self.grad_dtype}
            self.delayed = DelayedScaling(dtypes, amax_history_len, amax_compute_algo, margin, dims, device)
        self.bf16_layers: tuple = ()  # (start, end): layers kept in the params dtype (describe)

    def bind(self, chunks, first_last_bf16=None, num_layers: int = 0) -> None:
        """Name each weight for the recipe state (its global parameter name), mark the weights of the
        first / last (start, end) layers `keep_precision`, and check that TP shards keep whole
        blocks (blockwise)."""
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                p.fp8_name = name
                layer = _layer_of(name)
                if first_last_bf16 and layer is not None and (
                        layer < first_last_bf16[0] or layer >= num_layers - first_last_bf16[1]):
                    keep_precision(p)
            if self.recipe == "blockwise" and self.dims is not None and self.dims.tp > 1:
                for module in chunk.modules():  # the weights of this path's GEMMs
                    for p in module.parameters(recurse=False) if getattr(module, "gemm", None) is self else ():
                        if p.dim() >= 2 and not getattr(p, "keep_precision", False):
                            check_tp_blocks(p.fp8_name, p, self.dims.tp)
        if first_last_bf16:
            self.bf16_layers = (first_last_bf16[0], first_last_bf16[1], num_layers)

    def describe(self, params_dtype, moe_layers=(), mla: bool = False) -> str:
        """The start-up line; `moe_layers`: per layer, whether its MLP is an MoE layer; `mla`: multi-latent
        attention's projections instead of QKV."""
        fmt = "e4m3" if self.grad_dtype == FORMATS["e4m3"] else "hybrid: e4m3 forward, e5m2 gradients"
        gemms = ("Q, KV down- and up-projections" if mla else "QKV") + ", projection"
        gemms += (", fc1, fc2" if not all(moe_layers) else "") + (", experts" if any(moe_layers) else "")
        dtype = str(params_dtype).replace('torch.', '')
        recipe = {"tensorwise": "tensorwise current scaling", "rowwise": "rowwise current scaling",
                  "blockwise": "blockwise scaling in 1x128 activation / gradient tiles and 128x128 weight blocks"}.get(
            self.recipe, f"delayed scaling from a {self.delayed and self.delayed.history_len}-step amax history "
                         f"({self.delayed and self.delayed.algo})")
        layers = ""
        if self.bf16_layers:
            start, end, n = self.bf16_layers
            fp8 = [i + 1 for i in range(start, n - end)]
            layers = (f" of layers {fp8[0]}-{fp8[-1]} of {n} (first {start} and last {end} in {dtype})" if fp8
                      else f" of no layer (all {n} in {dtype})")
        return (f"{recipe} ({fmt}, margin {self.margin}) in the attention and MLP linears "
                f"({gemms}){layers}; embedding, output layer, norms and router in {dtype}")

    # the experts' GEMMs run as the loop over experts (experts.py), one dense FP8 GEMM each
    grouped_kernel = False

    def new_call(self, batches=None):
        # forward records where the GEMM's dimensions are split, and whether it stays plain
        return {"batches": batches}

    def _splits(self, w):
        """(the dimension of the 2-D weight `w` that TP splits or None, the groups splitting its
        features, the groups splitting the tokens), from w's ShardSpec or that of the stacked
        experts' weight it is one expert of."""
        spec, shift = getattr(w, "shard_spec", None), 0
        if spec is None and w._base is not None:
            spec, shift = getattr(w._base, "shard_spec", None), w._base.dim() - w.dim()
        split = next((s.dim - shift for s in spec.splits if s.axis == "tp"), None) if spec else None
        d = self.dims
        if d is None:
            return split, [], []
        if spec is not None and spec.split("ep") is not None:
            # An expert's ffn slice is over ETP; its rows of one micro-batch (every rank routes its own
            # tokens) lie on the ranks holding the expert, EDP, kept apart by micro-batch (`batches`).
            shared = d.edp > 1 and d.edp_shares_micro_batches  # else each micro-batch's rows are on one copy
            return split, [d.etp_group] if d.etp > 1 else [], [d.edp_group] if shared else []
        return split, [d.tp_group] if d.tp > 1 else [], [d.cp_group] if d.cp > 1 else []

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

    def _mm(self, a, b, dtypes, k_groups, out_dtype, call, roles=("input", "weight")):
        """a [M,K] @ b [K,N] in fp8; k_groups: the groups splitting K (a rowwise amax spans them); a
        tensorwise amax spans every group splitting any dimension of the GEMM. roles: which of the
        GEMM's tensors a and b are (delayed scaling's histories, blocks)."""
        if self.recipe == "blockwise":  # blocks hold whole in a TP shard (bind): no amax spans ranks
            return blockwise_mm(a, b, dtypes, roles[1] == "weight", self.margin, out_dtype)
        rowwise = self.recipe == "rowwise"
        tp = call["features"]
        reduce = self._reducer(k_groups if rowwise else tp + call["tokens"])
        if call["batches"] is not None and not rowwise:
            # an expert's rows (tokens) of several micro-batches: one scale per micro-batch, as in
            # the single-process run, which quantizes one micro-batch at a time
            qa, sa = quantize(a, dtypes[0], 1, self.margin, self._by_batch(call["batches"], tp + call["tokens"]))
            qb, sb = quantize(b, dtypes[1], None, self.margin, reduce)
            return scaled_mm(qa, qb, sa, sb.expand(1, b.shape[1]), out_dtype)
        qa, sa = self._quantize(a, dtypes[0], 1 if rowwise else None, reduce, call, roles[0])
        qb, sb = self._quantize(b, dtypes[1], 0 if rowwise else None, reduce, call, roles[1])
        return scaled_mm(qa, qb, sa, sb, out_dtype)

    def _quantize(self, t, dtype, dim, reduce, call, role):
        """quantize(); under delayed scaling by the recipe state's scale, recording the amax."""
        if self.delayed is None:
            return quantize(t, dtype, dim, self.margin, reduce)
        name = call["name"]
        self.delayed.observe(name, role, t.abs().amax() if t.numel() else t.new_zeros(()))
        scale = self.delayed.scale_of(name, role)
        return quantize(t, dtype, None, self.margin, reduce if scale is None else None, scale)


    def forward(self, call, x, w, bias=None):
        # an expert's weight is a view of the stacked parameter (a parameter may be a view of a buffer)
        param = w if isinstance(w, torch.nn.Parameter) or w._base is None else w._base
        call["plain"] = getattr(param, "keep_precision", False)
        if call["plain"]:
            return super().forward(call, x, w, bias)
        if self.delayed is not None:
            call["name"] = getattr(w, "fp8_name", None)
            assert call["name"] is not None, "delayed scaling: bind() the model to the GEMM path first"
        (w if w._base is None else w._base).fp8_gemm = True  # its ZeRO gathers may move FP8 (fp8_param_gather.py)
        call["split"], call["features"], call["tokens"] = self._splits(w)
        k_split = call["features"] if call["split"] == 1 else []  # row parallel: x and W split along K
        e4m3 = FORMATS["e4m3"]
        y = self._mm(x.reshape(-1, x.shape[-1]), w.t(), (e4m3, e4m3), k_split, x.dtype, call)
        y = y.reshape(*x.shape[:-1], w.shape[0]).detach()  # not a view: callers may modify it in place
        return y if bias is None else y + bias

    def input_grad(self, call, g, w):
        if call["plain"]:
            return super().input_grad(call, g, w)
        n_split = call["features"] if call["split"] == 0 else []  # column parallel: g and W split along N
        g2 = self._mm(g.reshape(-1, g.shape[-1]), w, (self.grad_dtype, FORMATS["e4m3"]), n_split, g.dtype, call,
                      ("grad", "weight"))
        return g2.reshape(*g.shape[:-1], w.shape[1])

    def weight_grad(self, call, g, x):
        if call["plain"]:
            return super().weight_grad(call, g, x)
        # contracted over the tokens (SP inputs are gathered again, CP's stay split)
        g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if call["batches"] is None:
            return self._mm(g.t(), x, (self.grad_dtype, FORMATS["e4m3"]), call["tokens"], g.dtype, call,
                            ("grad", "input"))
        (rows, n), one = call["batches"], dict(call, batches=None)  # each micro-batch quantized alone, summed
        present = range(n) if call["tokens"] else rows.unique().tolist()  # (no amax shared: skip absent ones)
        return sum((self._mm(g[rows == i].t(), x[rows == i], (self.grad_dtype, FORMATS["e4m3"]), call["tokens"],
                             g.dtype, one, ("grad", "input")) for i in present),
                   g.new_zeros((g.shape[1], x.shape[1])))


def _layer_of(name: str):
    """The global (0-based) transformer layer a parameter name belongs to, or None."""
    parts = name.split(".")
    return next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()), None)
