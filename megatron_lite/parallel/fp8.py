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
call's `batches`): each micro-batch's rows get their own scale, as in the single-process run.
A weight replicated over TP ranks whose output gradient is partial on each (MLA's down-projections,
K/V groups fewer than TP ranks) has its backward GEMMs run on the replicas' sum of the gradient,
counted by the first replica. Only the layers built with the path are FP8 (attention and MLP linears, experts, shared
experts), less a weight marked `keep_precision` (the output layer, and with --first-last-layers-bf16
those layers' weights); the embedding, norms and router are not built with it. The experts' grouped GEMM is the loop of dense FP8 GEMMs over the experts
(torch._scaled_grouped_mm has no CPU kernel in torch 2.13).

`delayed` (fp8_delayed.py) scales each tensor by a scale from its amax history, a recipe state
keyed by the weight's global name (`bind`); `blockwise` (fp8_blocks.py) scales 1x128 tiles of
activations and gradients and 128x128 blocks of weights. Its weight gradient tiles the tokens:
where they are split over ranks (CP's zigzag parts, an expert's tokens from several TP / CP
ranks) or reordered (EP), each row goes into the tile of the single process's order (the call's
`order`: the MoE layer's dispatcher supplies an expert's, a dense layer under CP has its zigzag
positions) and a tile's amax is MAX-reduced over the ranks holding its rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .context_parallel import zigzag_indices
from .fp8_blocks import BLOCK, blockwise_mm, check_tp_blocks, token_tiled_weight_grad
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
    # the CUDA kernel takes a row-major left operand and a column-major right one (the weight
    # gradient's left operand is a transposed gradient: found by tools/fake_cuda_dry_run.py)
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


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
        # blockwise tiles the weight gradient's tokens: the MoE layer then gives each expert row's place
        self.token_order = recipe == "blockwise"

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
            if self.delayed is not None:  # every rank of the amax group folds the same GEMMs (all experts)
                self.delayed.expect(name for p in self._gemm_weights(chunk) for name in _gemm_names(p))
            if self.recipe == "blockwise" and self.dims is not None and self.dims.tp > 1:
                for p in self._gemm_weights(chunk):
                    check_tp_blocks(p.fp8_name, p, self.dims.tp)
        if first_last_bf16:
            self.bf16_layers = (first_last_bf16[0], first_last_bf16[1], num_layers)

    def _gemm_weights(self, chunk):
        """The weights of this path's FP8 GEMMs in `chunk` (not those kept in precision)."""
        for module in chunk.modules():
            for p in module.parameters(recurse=False) if getattr(module, "gemm", None) is self else ():
                if p.dim() >= 2 and not getattr(p, "keep_precision", False):
                    yield p

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

    def new_call(self, batches=None, order=None):
        # forward records where the GEMM's dimensions are split, and whether it stays plain
        return {"batches": batches, "order": order}

    def _splits(self, w):
        """(the dimension of the 2-D weight `w` that TP splits or None, the groups splitting its
        features, the groups splitting the tokens), from w's ShardSpec or that of the stacked
        experts' weight it is one expert of."""
        spec, shift = getattr(w, "shard_spec", None), 0
        if spec is None and w._base is not None:
            spec, shift = getattr(w._base, "shard_spec", None), w._base.dim() - w.dim()
        # (a weight replicated over TP, shards 1, is not split: its GEMMs see partial gradients, see _partial)
        split = next((s.dim - shift for s in spec.splits if s.axis == "tp" and s.shards > 1), None) if spec else None
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
            # an expert's rows (tokens) of several micro-batches: one current scale per micro-batch,
            # as in the single-process run, which quantizes one micro-batch at a time (delayed
            # scaling's one scale serves them all)
            by_batch = self._by_batch(call["batches"], tp + call["tokens"])
            qa, sa = self._quantize(a, dtypes[0], 1, by_batch, call, roles[0])
            qb, sb = self._quantize(b, dtypes[1], None, reduce, call, roles[1])
            return scaled_mm(qa, qb, sa.expand(a.shape[0], 1), sb.expand(1, b.shape[1]), out_dtype)
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
        return quantize(t, dtype, dim, self.margin, reduce if scale is None else None, scale)


    def forward(self, call, x, w, bias=None):
        # an expert's weight is a view of the stacked parameter (a parameter may be a view of a buffer)
        param = w if isinstance(w, torch.nn.Parameter) or w._base is None else w._base
        call["plain"] = getattr(param, "keep_precision", False)
        if call["plain"]:
            return super().forward(call, x, w, bias)
        if self.delayed is not None:
            call["name"] = _gemm_name(w)
            assert call["name"] is not None, "delayed scaling: bind() the model to the GEMM path first"
        (w if w._base is None else w._base).fp8_gemm = True  # its ZeRO gathers may move FP8 (fp8_param_gather.py)
        call["split"], call["features"], call["tokens"] = self._splits(w)
        call["partial"] = self._partial(w)
        if self.token_order and call["order"] is None and call["tokens"] and x.dim() == 3:
            call["order"] = self._sequence_order(x)  # a dense layer's tokens split over CP
        k_split = call["features"] if call["split"] == 1 else []  # row parallel: x and W split along K
        e4m3 = FORMATS["e4m3"]
        y = self._mm(x.reshape(-1, x.shape[-1]), w.t(), (e4m3, e4m3), k_split, x.dtype, call)
        y = y.reshape(*x.shape[:-1], w.shape[0]).detach()  # not a view: callers may modify it in place
        return y if bias is None else y + bias

    def _partial(self, w):
        """The replicas (TP ranks) of w's shard where each one's output gradient is only a partial
        sum (MLA's down-projections, whole on every rank, whose outputs feed this rank's heads; K/V
        groups replicated over TP ranks): the GEMMs then quantize the gradient summed over them, as
        the single process, and the first replica alone contributes. None for other weights."""
        spec = getattr(w, "shard_spec", None)
        split = spec.split("tp") if spec is not None else None
        return split.replicas if split is not None and split.replicas > 1 and self.dims.tp > 1 else None

    def _whole_grad(self, call, g):
        """The replicas' sum of a partial output gradient (once per call: the weight gradient reuses it)."""
        if call.get("whole_grad") is None:
            whole = g.contiguous().clone()
            self.dims.comm.all_reduce(whole, self.dims.tp_replica_group(call["partial"]))
            call["whole_grad"] = whole
        return call["whole_grad"]

    def _rank0(self, call, t):
        """t on the first replica, zeros on the others: the TP sum that follows counts it once."""
        return t if self.dims.tp_rank % call["partial"] == 0 else torch.zeros_like(t)

    def input_grad(self, call, g, w):
        if call["plain"]:
            return super().input_grad(call, g, w)
        if call["partial"]:
            return self._rank0(call, self._input_grad(call, self._whole_grad(call, g), w))
        return self._input_grad(call, g, w)

    def _input_grad(self, call, g, w):
        n_split = call["features"] if call["split"] == 0 else []  # column parallel: g and W split along N
        g2 = self._mm(g.reshape(-1, g.shape[-1]), w, (self.grad_dtype, FORMATS["e4m3"]), n_split, g.dtype, call,
                      ("grad", "weight"))
        return g2.reshape(*g.shape[:-1], w.shape[1])

    def weight_grad(self, call, g, x):
        if call["plain"]:
            return super().weight_grad(call, g, x)
        if call["partial"]:
            whole = self._whole_grad(call, g)
            call["whole_grad"] = None  # the last use of it
            return self._rank0(call, self._weight_grad(call, whole, x))
        return self._weight_grad(call, g, x)

    def _weight_grad(self, call, g, x):
        # contracted over the tokens (SP inputs are gathered again, CP's stay split)
        g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if call["batches"] is None:
            return self._token_mm(call, g, x)
        (rows, n), order = call["batches"], call["order"]  # each micro-batch quantized alone, summed
        present = range(n) if call["tokens"] else rows.unique().tolist()  # (no amax shared: skip absent ones)
        return sum((self._token_mm(dict(call, batches=None, order=order and (order[0][rows == i], order[1])),
                                   g[rows == i], x[rows == i]) for i in present),
                   g.new_zeros((g.shape[1], x.shape[1])))

    def _token_mm(self, call, g, x):
        """g^T x, contracted over tokens; blockwise tiles them in the single process's order."""
        dtypes = (self.grad_dtype, FORMATS["e4m3"])
        if self.recipe == "blockwise" and call["order"] is not None:
            order, n = call["order"]
            return token_tiled_weight_grad(g, x, order // BLOCK, -(-n // BLOCK), dtypes, self.margin, g.dtype,
                                           self._reducer(call["tokens"]))
        assert self.recipe != "blockwise" or not call["tokens"], "blockwise: tokens split over ranks need their order"
        return self._mm(g.t(), x, dtypes, call["tokens"], g.dtype, call, ("grad", "input"))

    def _sequence_order(self, x):
        """(each row's index in the single-process micro-batch [s, b], their number) for x [s, b, ...]
        holding this CP rank's zigzag part of the sequence (context_parallel.py)."""
        s, b, d = x.shape[0], x.shape[1], self.dims
        pos = zigzag_indices(s * d.cp, d.cp, d.cp_rank, x.device)
        return (pos[:, None] * b + torch.arange(b, device=x.device)).reshape(-1), s * d.cp * b


def _layer_of(name: str):
    """The global (0-based) transformer layer a parameter name belongs to, or None."""
    parts = name.split(".")
    return next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()), None)


def _gemm_names(p):
    """The recipe-state names of weight p's GEMMs: its global name; one per global expert
    (`<name>.<expert>`) for the stacked experts' weight, whose experts are spread over EP."""
    spec = getattr(p, "shard_spec", None)
    ep = spec.split("ep") if spec is not None else None
    if ep is None:
        return [p.fp8_name]
    return [f"{p.fp8_name}.{e}" for e in range(spec.full_shape[ep.dim])]


def local_gemm_names(p, local_experts: int):
    """_gemm_names of this rank's part of p: its `local_experts` experts only."""
    spec = getattr(p, "shard_spec", None)
    ep = spec.split("ep") if spec is not None else None
    if ep is None:
        return [p.fp8_name]
    return [f"{p.fp8_name}.{e}" for e in range(ep.index * local_experts, (ep.index + 1) * local_experts)]


def _gemm_name(w):
    """The recipe-state name of the GEMM with weight w: a parameter's, or an expert's (w = stacked[e])."""
    base = w._base
    if base is None or base.dim() == w.dim():
        return getattr(w if base is None else base, "fp8_name", None)
    local = (w.storage_offset() - base.storage_offset()) // base.stride(0)
    ep = base.shard_spec.split("ep") if getattr(base, "shard_spec", None) is not None else None
    return f"{base.fp8_name}.{local + (ep.index * base.shape[0] if ep is not None else 0)}"
