"""Delayed and blockwise FP8 scaling at the layouts the current-scaling recipes run at (CP, MoE
with EP / TP / CP, grouped GEMM): each whole run equals the single-process FP8 run (losses,
gradient norms, and delayed scaling's recipe state, the experts' amax histories included);
blockwise's weight-gradient tiles of 128 tokens follow the single process's token order across
ranks (a CP chunk that is not whole tiles, an expert's tokens from several ranks); FP8 MLA at
TP2+SP."""
import pytest

from megatron_lite.testing import assert_same_run, assert_state_close, run_distributed
from test_fp8 import MOE, _argv as fp8_argv, _run as run_gathered, assert_fp8_gather_bytes
from test_fp8_recipes import LATER_AMAX_RTOL, _argv, _assert_same_state, _run
from test_mla import BASE as MLA_BASE, TP_SP
from training_utils import merged_params, records_of, train_and_gather

BLOCKWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]
ONE = ["--micro-batch-size", "1"]  # EP over DP ranks: each rank one of the reference's micro-batches
DELAYED_LAYOUTS = {  # name: (world, the model's flags, the layout's flags)
    "moe-ep2": (2, MOE + ONE, ["--expert-model-parallel-size", "2"]),
    "cp2": (2, [], ["--context-parallel-size", "2"]),
    "moe-tp2-sp": (2, MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "moe-cp2-ep2": (2, MOE, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "moe-grouped-tp2-etp2-sp": (2, MOE + ["--moe-grouped-gemm"], ["--tensor-model-parallel-size", "2",
                                "--sequence-parallel", "--expert-tensor-parallel-size", "2"]),
}


def _default_first(layouts):
    return [pytest.param(name, marks=() if i == 0 else pytest.mark.slow) for i, name in enumerate(layouts)]


@pytest.mark.parametrize("layout", _default_first(DELAYED_LAYOUTS))
def test_delayed_layout_equals_the_single_process(layout):
    world, model, extra = DELAYED_LAYOUTS[layout]
    ref, ref_state, _ = _run(1, _argv(model))
    got, state, _ = _run(world, _argv(model + extra))
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-5)
    if "--num-experts" in model:  # every global expert's GEMMs have their own history
        experts = [n for n in ref_state if ".experts.weight1." in n]
        assert len(experts) == 2 * 4 and all(ref_state[n]["amax_history"][0][0] > 0 for n in experts)
    dp = 2 if "--expert-model-parallel-size" in extra and "--context-parallel-size" not in extra else 1
    _assert_same_state(state, ref_state, rtol=1e-5, grad_factor=dp, steps=slice(2, 3))  # the first step's amaxes
    _assert_same_state(state, ref_state, rtol=LATER_AMAX_RTOL, grad_factor=dp)


# --- FP8 multi-latent attention at TP > 1 ---------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("delayed", marks=pytest.mark.slow),
                                    pytest.param("rowwise", marks=pytest.mark.slow)])
def test_mla_fp8_tp2_sp_equals_the_single_process(recipe):
    """MLA's down-projections are whole on every TP rank but see partial output gradients (this
    rank's heads): their FP8 GEMMs quantize the TP sum, as the single process, counted once; the
    up-projections are column-parallel (amaxes over TP). The first step to fp32 rounding."""
    argv = MLA_BASE + ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--train-iters", "3"]
    ref = run_distributed(train_and_gather, 1, argv)
    got = run_distributed(train_and_gather, 2, argv + TP_SP)
    assert_same_run(records_of([r[0] for r in ref]), records_of([r[0] for r in got]), rtol=1e-4,
                    grad_norm_rtol=1e-6)
    # The final weights to 1e-3 of the model's norm, not 1e-4: not a layout error but FP8's own
    # sensitivity (measured, delayed / rowwise): the first step's gradients agree tensor by tensor to
    # <= 6e-6 (every amax is the single process's: a wrong one re-rounds a whole tensor, ~1e-2); from
    # step 2 single elements of an operand, moved by fp32 summation order, cross an e4m3 / e5m2
    # rounding boundary (a 2^-4 / 2^-3 step; one flip changes a whole row of a weight gradient) and
    # Adam carries them: after 3 steps TP2+SP is 1.6e-4 / 1.3e-4 of the model's norm away, while the
    # single process against itself with its initial weights moved by one fp32 ulp (init std
    # x (1 - 1e-7)) is 8.5e-4 / 2.5e-3 away. test_fp8.py's layout runs use the same 1e-3.
    assert_state_close(merged_params(got), merged_params(ref), rtol=1e-3, what="parameters")


# --- blockwise: the weight gradient's 128-token tiles cut as the single process cuts them ---------
def test_token_tiles_follow_the_single_process_order():
    """An expert's rows in another order (EP) or a CP rank's zigzag part: each row quantized in its
    single-process tile gives the single process's blockwise weight gradient."""
    import torch
    from megatron_lite.parallel.fp8_blocks import blockwise_mm, token_tiled_weight_grad
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(300, 24, generator=gen) * 1e-3, torch.randn(300, 40, generator=gen)
    x[::37] *= 50  # outliers make every tile's scale its own
    dtypes = (torch.float8_e5m2, torch.float8_e4m3fn)
    ref = blockwise_mm(g.t(), x, dtypes, False, 0, torch.float32)
    perm = torch.randperm(300, generator=gen)
    got = token_tiled_weight_grad(g[perm], x[perm], perm // 128, 3, dtypes, 0, torch.float32)
    scale = g.abs().t() @ x.abs()  # fp32 summation in another order: within 1e-6 of the sum of magnitudes
    assert ((got - ref).abs() <= 1e-6 * scale).all()
    local = blockwise_mm(g[perm].t(), x[perm], dtypes, False, 0, torch.float32)  # tiles of the local order
    assert ((local - ref).abs() > 1e-3 * scale).any()


# 192 tokens a sequence: a CP2 zigzag chunk (48 positions x 2 sequences) is not a whole 128-token tile
LONG = ["--seq-length", "192"]
WIDE = ["--hidden-size", "128", "--num-attention-heads", "2", "--kv-channels", "128", "--ffn-hidden-size", "256",
        "--num-query-groups", "2"]  # TP2 shards of whole 128-blocks
BLOCKWISE_LAYOUTS = {  # name: (world, the model's flags, the layout's flags)
    "cp2": (2, LONG, ["--context-parallel-size", "2"]),
    "moe-cp2": (2, LONG + MOE, ["--context-parallel-size", "2"]),  # an expert's tokens routed by both CP ranks
    "moe-tp2-sp": (2, LONG + WIDE + MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "moe-cp2-ep2": (2, LONG + MOE, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "moe-ep2": (2, LONG + MOE + ONE, ["--expert-model-parallel-size", "2"]),
    "moe-allgather-cp2-ep2": (2, LONG + MOE + ["--moe-token-dispatcher-type", "allgather"], [
        "--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "moe-grouped-tp2-etp2-sp": (2, LONG + WIDE + MOE + ["--moe-grouped-gemm"], [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"]),
}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n == "moe-cp2" else pytest.mark.slow)
                                    for n in BLOCKWISE_LAYOUTS])
def test_blockwise_layout_equals_the_single_process(layout):
    world, model, extra = BLOCKWISE_LAYOUTS[layout]
    ref, _, _ = _run(1, _argv(model, iters=2, fp8=BLOCKWISE))
    got, _, _ = _run(world, _argv(model + extra, iters=2, fp8=BLOCKWISE))
    # fp32 summation order differs across ranks; at TP an input-gradient element may land on the other
    # side of an FP8 rounding boundary (test_fp8_recipes.test_blockwise_tp2_sp_...): 1e-4 there
    tp = "--tensor-model-parallel-size" in extra
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-4 if tp else 1e-5)


# --- --fp8-param-gather with delayed and blockwise scaling ---------------------------------------
PARAM_GATHER = [("delayed", 1, [], 2), ("blockwise", 3, [], 2), ("tensorwise", 1, [], 2), ("delayed", 3, [], 2),
                ("blockwise", 1, [], 2), ("delayed", 2, MOE, 2), ("blockwise", 1, MOE, 2),
                ("delayed", 1, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
                ("blockwise", 3, WIDE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4)]


@pytest.mark.parametrize("recipe,stage,extra,world", [pytest.param(*case, marks=() if i < 1 else pytest.mark.slow)
                                                      for i, case in enumerate(PARAM_GATHER)])
def test_fp8_param_gather_equals_the_plain_gather(recipe, stage, extra, world):
    """ZeRO gathers the FP8 GEMMs' weights as FP8 bytes (delayed: with the next step's scale from
    the history; blockwise: 128x128 block scales whose blocks ZeRO's shards cut) and the run is the
    plain gather's to the bit: the values written quantize to the same bytes with the same scales,
    and the gathered weights' amaxes are the true ones (the amax histories too). A quarter of the
    bytes of those weights at fp32 params."""
    argv = fp8_argv(recipe, extra + ["--zero-stage", str(stage), "--log-comm-volume", "--train-iters", "4"])
    ref, ref_params = run_gathered(world, argv)
    got, params = run_gathered(world, argv + ["--fp8-param-gather"])
    assert_same_run(ref, got, rtol=0, grad_norm_rtol=0, params=params, ref_params=ref_params)
    assert_fp8_gather_bytes(ref, got, ref_params, world, stage)


@pytest.mark.slow
@pytest.mark.parametrize("world,groups", [(2, "1"), (4, "2")])
def test_kv_groups_replicated_over_tp_quantize_their_whole_gradient(world, groups):
    """Fewer K/V groups than TP ranks: each group's projection sits on TP / groups ranks, each
    seeing a partial gradient (its query heads'): the FP8 GEMMs quantize the replicas' sum."""
    argv = fp8_argv("tensorwise", ["--num-query-groups", groups, "--tensor-model-parallel-size", str(world),
                                   "--sequence-parallel"])
    ref, _ = run_gathered(1, [a for a in argv if a not in ("--sequence-parallel",)][:-2])
    got, _ = run_gathered(world, argv)
    # quantizing the partial gradients instead: the first gradient norm 2.5e-4 (TP2) / 5.8e-4 (TP4) off
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-5)


def test_delayed_fp8_param_gather_resumes_bit_exact(tmp_path):
    """ZeRO-1 with --fp8-param-gather under delayed scaling: the fold before each gather moves the
    recipe state into the checkpoint as after_update would, and the resumed run (whose load gathers
    the weights exactly) continues the straight one bit for bit."""
    zero = ["--micro-batch-size", "1", "--zero-stage", "1", "--fp8-param-gather"]
    straight, state, _ = _run(2, _argv(zero, iters=3))
    first, saved, _ = _run(2, _argv(zero + ["--save", str(tmp_path), "--exit-interval", "2"], iters=3))
    second, resumed, loaded = _run(2, _argv(zero + ["--load", str(tmp_path)], iters=3))
    assert loaded == saved and resumed == state
    assert [(r["lm_loss"], r["grad_norm"]) for r in first + second] == [(r["lm_loss"], r["grad_norm"])
                                                                         for r in straight]
