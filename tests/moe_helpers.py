"""Shared by the MoE tests: full (layout-independent) weights for an MoELayer, loading them into
any layout through the ShardSpecs, and gathering full gradients back."""
import torch

from megatron_lite.parallel.sharding import gather_full, spec_of
from megatron_lite.transformer.loss_normalization import LossNormalization, LossNormalizationSlot
from megatron_lite.transformer.moe import MoEConfig, MoELayer, MoEMetricsTracker, is_expert_parameter


def full_state(layer: MoELayer, seed: int, std: float = 0.3) -> dict:
    """Random full tensors for every parameter of `layer` (drawn from the full shapes, so any
    layout gets the same weights)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(spec_of(p).full_shape, generator=gen) * std for n, p in layer.named_parameters()}


def load_full_state(module, state: dict) -> None:
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(spec_of(p).shard(state[n]))


def full_grads(module, dims) -> dict:
    """Collective: every parameter's gradient summed as training would (expert gradients over
    edp, dense ones over TP when sequence-partial and over DP x CP), gathered whole."""
    out = {}
    for n, p in module.named_parameters():
        g = p.grad.clone()
        spec = spec_of(p)
        if is_expert_parameter(p):
            dims.comm.all_reduce(g, dims.edp_group)
            g = dims.comm.gather_along(gather_full(g, p, dims), 0, dims.ep_group)
        else:
            if spec.sequence_parallel:
                dims.comm.all_reduce(g, dims.tp_group)
            dims.comm.all_reduce(g, dims.dp_cp_group)
            g = gather_full(g, p, dims)
        out[n] = g
    return out


def aux_weight(weight: float) -> LossNormalizationSlot:
    """Loss weights whose auxiliary-loss weight is `weight` (one micro-batch, loss scale `weight`)."""
    return LossNormalizationSlot(LossNormalization(loss_scale=weight))


def build_layer(cfg_kw: dict, dims, hidden: int, sequence_parallel: bool = False, tracker_layers: int = 1,
                scale: float = 1.0, **kw):
    cfg = MoEConfig(**cfg_kw)
    tracker = MoEMetricsTracker(tracker_layers, cfg.num_experts)
    layer = MoELayer(cfg, hidden, dims, layer_number=0, loss_normalization=aux_weight(scale), tracker=tracker,
                     sequence_parallel=sequence_parallel, **kw)
    return layer, tracker
