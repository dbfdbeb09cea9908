"""The MoE layer under EP 2 and 4 (EP 2 also with two expert-data-parallel copies), EP 2 x TP 2 (ETP 1 and 2, with and without SP) and EP 2 over
CP 2 equals the single-process layer with the same full weights: outputs, input gradients, the
input gradient of the auxiliary losses alone, every parameter gradient (rtol 1e-5), and the
logged statistics, where the reference runs each data-parallel replica's batch as one more
micro-batch (so DP x 1 micro-batch logs what 1 x DP micro-batches does)."""
import pytest
import torch

from megatron_lite.parallel.fp8 import Float8GemmPath
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, run_distributed
from tests.moe_helpers import build_layer, full_grads, full_state, load_full_state

S, B, H = 8, 2, 16
MIXTRAL_LIKE = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.01,
                    moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
DEEPSEEK_LIKE = dict(num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
                     moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0,
                     moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
                     moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=8)


def _replica_data(replica: int):
    gen = torch.Generator().manual_seed(1000 + replica)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def _local(t: torch.Tensor, cp: int, cp_rank: int, tp: int, tp_rank: int, sp: bool) -> torch.Tensor:
    """A rank's part of a replica's [S, B, H] tensor: its CP chunk, then its TP shard under SP."""
    t = t.chunk(cp)[cp_rank]
    return t.chunk(tp)[tp_rank] if sp else t


def _forward_backward(layer, x, probe):
    """Two passes: the auxiliary losses' input gradient alone (probe 0), then the whole layer;
    the parameter gradients are those of the second pass."""
    xa = x.clone().requires_grad_(True)
    y = layer(xa)
    y.backward(torch.zeros_like(y))
    for p in layer.parameters():
        p.grad = None
    xf = x.clone().requires_grad_(True)
    y = layer(xf)
    y.backward(probe)
    return y.detach(), xf.grad, xa.grad


def _gemm(dims, fp8):
    """The layer's GemmPath: FP8 (test_fp8) with `fp8` = (format, recipe), else the default."""
    return Float8GemmPath(dims, *fp8) if fp8 else None


def _reference(rank, world, cfg_kw, replicas, fp8=None):
    """EP 1 in one process; each replica's batch is one more micro-batch, gradients summed."""
    dims = ParallelDims().build_groups()
    layer, tracker = build_layer(cfg_kw, dims, H, gemm=_gemm(dims, fp8))
    load_full_state(layer, full_state(layer, seed=3))
    out, grads = [], {n: 0 for n, _ in layer.named_parameters()}
    for r in range(replicas):
        x, probe = _replica_data(r)
        out.append(_forward_backward(layer, x, probe))
        for n, p in layer.named_parameters():
            grads[n] = grads[n] + p.grad
    return out, grads, tracker.reduce(dims)


def _parallel(rank, world, cfg_kw, tp, cp, ep, etp, sp, fp8=None):
    dims = ParallelDims.from_world(tp=tp, cp=cp, ep=ep, etp=etp)
    layer, tracker = build_layer(cfg_kw, dims, H, sequence_parallel=sp, gemm=_gemm(dims, fp8))
    load_full_state(layer, full_state(layer, seed=3))
    x, probe = (_local(t, cp, dims.cp_rank, tp, dims.tp_rank, sp) for t in _replica_data(dims.dp_rank))
    y, x_grad, aux_x_grad = _forward_backward(layer, x, probe)
    return dict(y=y, x_grad=x_grad, aux_x_grad=aux_x_grad, grads=full_grads(layer, dims),
                metrics=tracker.reduce(dims), dp_rank=dims.dp_rank, cp_rank=dims.cp_rank, tp_rank=dims.tp_rank)


LAYOUTS = {  # name: (world, tp, cp, ep, etp, sp)
    "ep2": (2, 1, 1, 2, 1, False),
    "ep4": (4, 1, 1, 4, 1, False),
    "ep2-dp4": (4, 1, 1, 2, 1, False),  # two expert-data-parallel replicas of each expert
    "ep2-tp2-etp1-sp": (4, 2, 1, 2, 1, True),
    "ep2-tp2-etp1": (4, 2, 1, 2, 1, False),
    "ep2-tp2-etp2-sp": (4, 2, 1, 2, 2, True),
    "ep2-tp2-etp2": (4, 2, 1, 2, 2, False),
    "ep2-cp2": (2, 1, 2, 2, 1, False),  # EP over the two CP ranks of one replica
    # MoE parallel folding (Megatron-Core's expert grid): EP over TP (x CP) ranks, ETP inside TP or over DP
    "tp2-ep4-sp": (4, 2, 1, 4, 1, True),
    "tp2-ep4": (4, 2, 1, 4, 1, False),
    "tp2-cp2-ep4-sp": (4, 2, 2, 4, 1, True),
    "tp4-etp2-ep2-sp": (4, 4, 1, 2, 2, True),
    "dp4-etp2-ep2": (4, 1, 1, 2, 2, False),
}

_REFERENCES = {}


def _reference_run(cfg_kw, replicas, fp8=None):
    """The single-process run (expert loop, alltoall at EP 1), cached per config."""
    cfg_kw = dict(cfg_kw, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    key = (tuple(sorted(cfg_kw.items())), replicas, fp8)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_distributed(_reference, 1, cfg_kw, replicas, fp8)[0]
    return _REFERENCES[key]


def _check_metrics(got, ref):
    assert got["layers"].keys() == ref["layers"].keys()
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
        assert (key in got) == (key in ref)
        if key in ref:
            assert abs(got[key] - ref[key]) <= 1e-5 * abs(ref[key]), key
    for layer, entry in ref["layers"].items():
        assert torch.equal(got["layers"][layer]["tokens_per_expert"], entry["tokens_per_expert"])


SLOW_LAYOUTS = ("tp2-ep4", "tp2-cp2-ep4-sp", "dp4-etp2-ep2")  # folded cells beyond the default's two


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_LAYOUTS else ())
                                    for n in LAYOUTS])
@pytest.mark.parametrize("dispatcher,grouped", [("alltoall", True), ("allgather", False)])
def test_layer_matches_single_process(layout, dispatcher, grouped):
    cp = LAYOUTS[layout][2]
    # Under CP the DeepSeek-style router: per-sequence aux loss over the CP-split sequence.
    cfg_kw = dict(DEEPSEEK_LIKE if cp > 1 else MIXTRAL_LIKE, moe_token_dispatcher_type=dispatcher,
                  moe_grouped_gemm=grouped)
    check_layout(cfg_kw, LAYOUTS[layout])


def check_layout(cfg_kw, layout, fp8=None, rtol=1e-5):
    """Every rank's output, input gradients, parameter gradients and statistics at `layout` equal
    the single-process layer's (with the GemmPath of `fp8`, see _gemm)."""
    world, tp, cp, ep, etp, sp = layout
    ref_out, ref_grads, ref_metrics = _reference_run(cfg_kw, world // (tp * cp), fp8)
    for r in run_distributed(_parallel, world, cfg_kw, tp, cp, ep, etp, sp, fp8):
        y, x_grad, aux_x_grad = (_local(t, cp, r["cp_rank"], tp, r["tp_rank"], sp) for t in ref_out[r["dp_rank"]])
        assert_close(r["y"], y, rtol=rtol, what="output")
        assert_close(r["x_grad"], x_grad, rtol=rtol, what="input grad")
        assert aux_x_grad.abs().sum() > 0
        assert_close(r["aux_x_grad"], aux_x_grad, rtol=rtol, what="aux-loss input grad")
        for name, g in ref_grads.items():
            assert_close(r["grads"][name], g, rtol=rtol, what=f"grad {name}")
        _check_metrics(r["metrics"], ref_metrics)


def _pipeline_metrics(rank, world, pp, micro_batches):
    """Layers 0 and 1 on one stage (PP 1) or one per stage (PP 2), each running the same
    micro-batches: the reduced statistics must not depend on where the layers live."""
    dims = ParallelDims.from_world(pp=pp)
    tracker = None
    for layer_number in range(2):
        if pp > 1 and layer_number != dims.pp_rank:
            continue
        layer, own = build_layer(dict(MIXTRAL_LIKE), dims, H, tracker_layers=2)
        tracker = tracker or own
        layer.router.tracker, layer.router.layer_number = tracker, layer_number
        load_full_state(layer, full_state(layer, seed=10 + layer_number))
        for mb in range(micro_batches):
            x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(100 * layer_number + mb))
            layer(x.requires_grad_(True)).sum().backward()
    return tracker.reduce(dims)


def test_logged_statistics_do_not_depend_on_pipeline_stages():
    reference = run_distributed(_pipeline_metrics, 1, 1, 3)[0]
    assert set(reference["layers"]) == {0, 1} and "moe_aux_loss" in reference
    for got in run_distributed(_pipeline_metrics, 2, 2, 3):
        _check_metrics(got, reference)
        for layer in (0, 1):
            for key in ("load_balancing_loss", "z_loss", "max_load", "min_load"):
                assert abs(got["layers"][layer][key] - reference["layers"][layer][key]) <= 1e-6
