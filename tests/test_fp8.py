"""FP8 GEMMs without Transformer Engine (megatron_lite/parallel/fp8.py): scales against hand-computed
values, zero tensors and saturation; each GEMM equals the fp32 GEMM of its dequantised operands and
is within e4m3 / e5m2 rounding of the fp32 GEMM; the CPU product equals torch._scaled_mm's; only
the layers' linears and experts are FP8 (not the output layer); a TP2+SP run and a zero-bubble PP2
run equal the single-process FP8 run, and so does activation recomputation (also under delayed
scaling, whose recomputed forward records its amaxes again); the command line trains with it and
names what it does not do yet. The recipes with state or blocks: test_fp8_recipes.py."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.parallel.fp8 import Float8GemmPath, quantize, scaled_mm
from megatron_lite.testing import assert_same_run, assert_state_close, run_distributed
from training_utils import (LLAMA_SWITCHES, ROOT, TINY, merged_params, records_of, single_process_reference,
                            train_and_gather)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_scales_by_hand_zero_and_saturation():
    x = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    q, inv = quantize(x, E4M3)
    assert torch.equal(inv, torch.tensor(112.0).reciprocal()) and torch.equal(q.float(), x * 112)  # exact in e4m3
    q, inv = quantize(x, E4M3, margin=1)
    assert torch.equal(inv, torch.tensor(56.0).reciprocal()) and torch.equal(q.float(), x * 56)
    q, inv = quantize(x, E4M3, dim=1)  # per row: amax 2 and 4
    assert torch.equal(inv, torch.tensor([[224.0], [112.0]]).reciprocal()) and torch.equal(q.float()[0], x[0] * 224)
    q, inv = quantize(x, E5M2, dim=0)  # per column: amax 4 and 2
    assert torch.equal(inv, torch.tensor([[57344 / 4, 57344 / 2]]).reciprocal())
    q, inv = quantize(torch.zeros(3, 2), E4M3)  # nothing to scale: scale 1, zeros
    assert inv.item() == 1.0 and not q.float().any()
    q, _ = quantize(torch.zeros(0, 2), E4M3, dim=0)  # an expert with no tokens
    assert q.shape == (0, 2)
    q, _ = quantize(x, E4M3, margin=-1)  # scale 2 x fp8 max / amax: the largest values saturate at 448
    assert q.float()[1, 0].item() == 448.0 and q.float()[0, 1].item() == -448.0


def _operands(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1, torch.randn(m, n, generator=g)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_each_gemm_is_the_fp32_gemm_of_its_dequantised_operands(recipe, fmt):
    x, w, g = _operands(24, 40, 16)
    path = Float8GemmPath(fmt=fmt, recipe=recipe, margin=0)
    gdt = E5M2 if fmt == "hybrid" else E4M3
    rows, cols = (1, 0) if recipe == "rowwise" else (None, None)

    def deq(t, dtype, dim):
        q, inv = quantize(t, dtype, dim)
        return q.float() * inv

    call = path.new_call()
    cases = [(path.forward(call, x, w), x, w.t(), E4M3),  # y = x W^T, contracted over the input features
             (path.input_grad(call, g, w), g, w, gdt),  # g W, over the output features
             (path.weight_grad(call, g, x), g.t(), x, gdt)]  # g^T x, over the tokens
    for got, a, b, adt in cases:
        exact = deq(a, adt, rows) @ deq(b, E4M3, cols)
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
        # within the formats' rounding (half an ulp: 2^-4 for e4m3, 2^-3 for e5m2) of the fp32 GEMM
        ua, ub = (0.125 if adt == E5M2 else 0.0625), 0.0625
        bound = (ua + ub + ua * ub) * (a.abs() @ b.abs())
        assert ((got - a @ b).abs() <= bound + 1e-6).all()
        assert not torch.equal(got, a @ b)  # it did quantize


@pytest.mark.parametrize("rowwise", [False, True])
def test_cpu_product_equals_torch_scaled_mm(rowwise):
    a, b, _ = _operands(16, 32, 16, seed=1)
    qa, sa = quantize(a, E4M3, 1 if rowwise else None)
    qb, sb = quantize(b.t(), E5M2 if rowwise else E4M3, 0 if rowwise else None)
    ref = torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    torch.testing.assert_close(scaled_mm(qa, qb, sa, sb, torch.float32), ref, rtol=1e-6, atol=1e-6)


class _Seen(Float8GemmPath):
    """Records the weight of each GEMM it runs in FP8."""

    def __init__(self):
        super().__init__(fmt="hybrid")
        self.seen = []

    def forward(self, call, x, w, bias=None):
        y = super().forward(call, x, w, bias)
        if not call["plain"]:
            self.seen.append(w)
        return y


def test_fp8_gemms_are_the_layers_linears_and_experts_not_the_output_layer():
    from test_gemm_path import GEMM_WEIGHTS, _backward, _moe_model
    gemm = _Seen()
    model = _moe_model(gemm, grouped=False)
    _backward(model)
    params = dict(model.named_parameters())
    names = {n for n, p in params.items() if any(w is p or w._base is p for w in gemm.seen)}
    assert names == GEMM_WEIGHTS - {"output_layer.weight"}
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values() if p.requires_grad)


# --- whole runs ---------------------------------------------------------------------------------
def _argv(recipe, extra=()):
    return TINY[:TINY.index("--train-iters")] + ["--train-iters", "3"] + TINY[TINY.index("--train-iters") + 2:] \
        + LLAMA_SWITCHES + ["--fp8-format", "hybrid", "--fp8-recipe", recipe] + list(extra)


def _run(world, argv):
    if world == 1:  # the single-process references, shared by every cell that compares against one
        return single_process_reference(argv)
    results = run_distributed(train_and_gather, world, argv)
    return records_of([r[0] for r in results]), merged_params(results)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp2_sp_equals_the_single_process_fp8_run(recipe):
    ref, ref_params = _run(1, _argv(recipe))
    plain, _ = _run(1, _argv(recipe)[:-4])
    assert plain[0]["lm_loss"] != ref[0]["lm_loss"]  # FP8 changes the numerics ...
    got, params = _run(2, _argv(recipe, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]))
    # ... the layout does not: the first step's loss to fp32 rounding, its gradient norm to 1e-5 and later
    # steps to 1e-4: TP's different fp32 summation order can put an element on the other side of an
    # fp8 rounding boundary (a 2^-4 relative step in that element, which elements depends on the CPU's
    # fp32 kernels), which Adam then carries.
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-5, params=params, ref_params=ref_params)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
RUN_LAYOUTS = {  # name: (world, the model's flags, the layout's flags)
    "cp2": (2, [], ["--context-parallel-size", "2"]),
    "dp2-zero1": (2, [], ["--zero-stage", "1"]),  # each rank one of the reference's two micro-batches
    "dp2-zero3": (2, [], ["--zero-stage", "3"]),  # the GEMMs see the gathered weight: its scale is the full one's
    "moe-tp2-sp": (2, MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "moe-grouped-tp2-etp2-sp": (2, MOE + ["--moe-grouped-gemm"], ["--tensor-model-parallel-size", "2",
                                "--sequence-parallel", "--expert-tensor-parallel-size", "2"]),
    "selective-recompute": (1, [], ["--recompute-granularity", "selective"]),
    "moe-layer-recompute": (1, MOE, ["--moe-layer-recompute"]),
    "moe-ep2": (2, MOE, ["--expert-model-parallel-size", "2"]),  # each expert's rows of two micro-batches
    "moe-tp2-ep2-folded": (4, MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--expert-model-parallel-size", "2"]),  # EP over TP; rows meet over EDP
    "moe-zb-h1-pp2": (2, MOE + ["--num-layers", "4", "--global-batch-size", "8", "--micro-batch-size", "1"],
                      ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),  # deferred W GEMMs
}


def _one_recipe_each(layouts, slow_layouts=()):
    """(layout, recipe) for each layout and recipe; the default suite runs one recipe per layout
    (none of `slow_layouts`)."""
    return [pytest.param(name, recipe, marks=() if (i + j) % 2 == 0 and name not in slow_layouts else pytest.mark.slow)
            for i, name in enumerate(layouts) for j, recipe in enumerate(["tensorwise", "rowwise"])]


@pytest.mark.parametrize("layout,recipe", _one_recipe_each(RUN_LAYOUTS))
def test_each_layout_equals_the_single_process_fp8_run(layout, recipe):
    world, model, extra = RUN_LAYOUTS[layout]
    ref, ref_params = _run(1, _argv(recipe, model))
    got, params = _run(world, _argv(recipe, model + extra))
    if "--expert-model-parallel-size" in extra:  # the gathered parameters hold this rank's experts only:
        params = ref_params = None  # the losses and the gradient norm (all experts' gradients) say it
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-5)
    if params is not None:  # an element flipped across an FP8 rounding boundary moves by Adam's step (lr):
        assert_state_close(params, ref_params, rtol=1e-3, what="parameters")  # which ones is CPU-dependent


@pytest.mark.parametrize("stage,extra,world", [(1, [], 2), (2, ["--overlap-param-gather"], 2), (1, MOE, 2), (3, [], 2),
                                               pytest.param(1, ["--tensor-model-parallel-size", "2",
                                                                "--sequence-parallel"], 4, marks=pytest.mark.slow)])
def test_fp8_param_gather_moves_fp8_bytes_and_equals_the_plain_gather(stage, extra, world):
    """DP2 ZeRO-1/2/3 (+ overlapped gather, + MoE: experts gathered over DP too): the gathered FP8
    weights give the run of the plain gather to fp32 rounding (the parameters read back are the
    owners' exact ones), and the parameter all-gathers move one byte per element of an FP8 GEMM's
    weight instead of four (fp32 params), the other parameters as before."""
    argv = _argv("tensorwise", extra + ["--zero-stage", str(stage), "--log-comm-volume"])
    ref, ref_params = _run(world, argv)
    got, params = _run(world, argv + ["--fp8-param-gather"])
    assert_same_run(ref, got, rtol=1e-5, grad_norm_rtol=1e-5, params=params, ref_params=ref_params)
    assert_fp8_gather_bytes(ref, got, ref_params, world, stage)


def assert_fp8_gather_bytes(ref, got, ref_params, world, stage):
    """The last step's parameter all-gathers moved 3 bytes less per element of an FP8 GEMM's weight
    (fp32 params, DP2; ZeRO-3 gathers twice), less what padding each bucket's uneven parts costs."""
    fp8_numel = sum(v.numel() for k, v in ref_params.items()
                    if k.endswith(("linear_q.weight", "linear_kv.weight", "linear_proj.weight", "linear_fc1.weight",
                                   "linear_fc2.weight", "experts.weight1", "experts.weight2")))
    fp8_numel //= world // 2  # a TP rank gathers its slices (the norms whole)
    saved = ref[-1]["comm_bytes"]["all_gather"] - got[-1]["comm_bytes"]["all_gather"]
    most = 3 * fp8_numel * (2 if stage == 3 else 1)
    assert 0.98 * most <= saved <= most, (saved, most)


def test_zero_bubble_pp2_equals_the_single_process_fp8_run():
    extra = ["--num-layers", "4", "--global-batch-size", "8", "--micro-batch-size", "1"]
    ref, ref_params = _run(1, _argv("tensorwise", extra))
    got, params = _run(2, _argv("tensorwise", extra + ["--pipeline-model-parallel-size", "2",
                                                       "--pipeline-schedule", "zb-h1"]))
    assert_same_run(ref, got, rtol=1e-5, params=params, ref_params=ref_params)


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_recomputed_fp8_layers_equal_the_stored_run(recipe):
    ref, ref_params = _run(1, _argv(recipe))
    got, params = _run(1, _argv(recipe, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "1"]))
    assert_same_run(ref, got, rtol=1e-6, params=params, ref_params=ref_params)


def _cli(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model", "llama-tiny",
                           "--device", "cpu", *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_cli_trains_in_fp8_and_says_so(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _cli("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--train-iters", "12", "--eval-iters", "0",
                "--metrics-file", str(metrics))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("> fp8: tensorwise current scaling (hybrid: e4m3 forward, e5m2 gradients, margin 0) in the attention "
            "and MLP linears (QKV, projection, fc1, fc2); embedding") in proc.stdout
    import json
    losses = [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3


@pytest.mark.parametrize("flags,line", [
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
     "error: --fp8-recipe mxfp8 needs Blackwell (sm100) GPUs and Transformer Engine's MXFP8 kernels: use tensorwise, "
     "rowwise, delayed or blockwise"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
     "error: --fp8-param-gather needs --use-distributed-optimizer or --zero-stage 1|2|3 (at --zero-stage 0 nothing "
     "is gathered)"),
])
def test_refused_fp8_flags_give_one_line(flags, line):
    proc = _cli(*flags, "--train-iters", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line and "Traceback" not in proc.stderr


def test_fp8_param_gather_with_another_recipe_is_a_no_effect_note():
    """With the rowwise recipe --fp8-param-gather is accepted, said to do nothing (the weight's two
    GEMMs scale it along different dimensions), and the run trains."""
    proc = _cli("--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-param-gather", "--use-distributed-optimizer",
                "--train-iters", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("--fp8-param-gather (FP8 weights are gathered with --fp8-recipe tensorwise, delayed or blockwise; with "
            "rowwise the ZeRO all-gather moves the params dtype)") in proc.stdout


# --- MoE: the experts' GEMMs in FP8 at every layout ----------------------------------------------
FP8_MOE_LAYOUTS = {  # name: (world, tp, cp, ep, etp, sp): each rank's share of one replica's tokens
    "tp2-etp1-sp": (2, 2, 1, 1, 1, True),  # whole experts, each TP rank routing its own tokens
    "tp2-etp1": (2, 2, 1, 1, 1, False),
    "tp2-etp2-sp": (2, 2, 1, 1, 2, True),  # experts split over TP, tokens gathered
    "cp2": (2, 1, 2, 1, 1, False),  # whole experts, each CP rank routing its chunk
    "ep2-cp2": (2, 1, 2, 2, 1, False),  # EP over the CP ranks: an expert's tokens on its owner
    # EP over DP: an expert's rows of two micro-batches, quantized one micro-batch at a time
    "ep2": (2, 1, 1, 2, 1, False),
    "ep4": (4, 1, 1, 4, 1, False),
    "ep2-dp4": (4, 1, 1, 2, 1, False),
    "ep2-tp2-etp1-sp": (4, 2, 1, 2, 1, True),
    "ep2-tp2-etp2-sp": (4, 2, 1, 2, 2, True),
    "ep2-cp2-dp2": (4, 1, 2, 2, 1, False),
    # MoE parallel folding: EP over the TP (and CP) ranks, ETP inside TP or over DP; an expert's rows
    # of one micro-batch meet over EDP
    "tp2-ep4-sp": (4, 2, 1, 4, 1, True),
    "tp2-cp2-ep4-sp": (4, 2, 2, 4, 1, True),
    "tp4-etp2-ep2-sp": (4, 4, 1, 2, 2, True),
    "dp4-etp2-ep2": (4, 1, 1, 2, 2, False),
    "ep2-cp4": (4, 1, 4, 2, 1, False),  # EP not a multiple of CP
}


@pytest.mark.parametrize("layout,recipe", _one_recipe_each(FP8_MOE_LAYOUTS, ("tp2-cp2-ep4-sp", "dp4-etp2-ep2", "ep2-cp4")))
def test_fp8_moe_layer_at_each_layout_equals_the_single_process_layer(layout, recipe):
    """Experts (grouped GEMM: the FP8 loop), shared expert and its gate; the router stays precise."""
    from test_moe_parallel import DEEPSEEK_LIKE, MIXTRAL_LIKE, check_layout
    cp = FP8_MOE_LAYOUTS[layout][2]
    cfg_kw = dict(DEEPSEEK_LIKE if cp > 1 else MIXTRAL_LIKE, moe_grouped_gemm=True)
    check_layout(cfg_kw, FP8_MOE_LAYOUTS[layout], fp8=("hybrid", recipe), rtol=1e-4)
