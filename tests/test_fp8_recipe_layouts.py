"""Delayed and blockwise FP8 scaling at the layouts the current-scaling recipes run at (CP, MoE
with EP / TP / CP, grouped GEMM): each whole run equals the single-process FP8 run (losses,
gradient norms, and delayed scaling's recipe state, the experts' amax histories included)."""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from test_fp8 import MOE
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
                    grad_norm_rtol=1e-6, params=merged_params(got), ref_params=merged_params(ref))
