"""Pipeline parallelism: every schedule reproduces the single-process run (losses and final
parameters), and the executor runs exactly the action lists the simulator replays."""
import pytest

from megatron_lite.parallel.pipeline.schedules import build_schedule
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, merged_params, records_of, train_and_gather

PP_BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--lr", "3e-3", "--eval-iters", "1", "--eval-interval", "5"]

LAYOUTS = [  # (pp, extra flags)
    (2, ["--pipeline-schedule", "gpipe"]),
    (2, ["--pipeline-schedule", "1f1b"]),
    (2, ["--pipeline-schedule", "zb-h1"]),
    (2, ["--num-layers-per-virtual-pipeline-stage", "1"]),
    (4, ["--pipeline-schedule", "1f1b"]),
    (4, ["--pipeline-schedule", "zb-h1"]),
    (4, ["--pipeline-schedule", "gpipe"]),
    (4, ["--virtual-pipeline-model-parallel-size", "2", "--num-layers", "8"]),
]


def _argv(family, extra):
    argv = PP_BASE + (LLAMA_SWITCHES if family == "llama" else [])
    return argv + extra


_REFS = {}


def _reference(family, extra):
    key = (family, "--num-layers" in extra and extra[extra.index("--num-layers") + 1])
    if key not in _REFS:
        flags = [f for f in extra if f in ("--num-layers",)]
        layers = ["--num-layers", extra[extra.index("--num-layers") + 1]] if flags else []
        results = run_distributed(train_and_gather, 1, _argv(family, layers))
        _REFS[key] = (records_of([r[0] for r in results]), merged_params(results))
    return _REFS[key]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("pp,extra", LAYOUTS)
def test_pipeline_matches_single_process(family, pp, extra):
    ref, ref_params = _reference(family, extra)
    results = run_distributed(train_and_gather, pp, _argv(family, extra + ["--pipeline-model-parallel-size", str(pp)]))
    assert_same_run(ref, records_of([r[0] for r in results]), grad_norm_rtol=1e-6, params=merged_params(results),
                    ref_params=ref_params)
    val = [r[0][-1].get("val_lm_loss") for r in results if r[0][-1].get("val_lm_loss") is not None]
    assert val and abs(val[0] - ref[-1]["val_lm_loss"]) <= 1e-5 * ref[-1]["val_lm_loss"], val


@pytest.mark.parametrize("pp,extra,schedule,vpp", [
    (4, ["--pipeline-schedule", "zb-h1"], "zb-h1", 1),
    (2, ["--num-layers-per-virtual-pipeline-stage", "1"], "interleaved", 2),
])
def test_executor_runs_the_simulated_action_lists(pp, extra, schedule, vpp):
    argv = _argv("gpt2", extra + ["--pipeline-model-parallel-size", str(pp), "--train-iters", "1"])
    results = run_distributed(train_and_gather, pp, argv, True)
    expected = build_schedule(schedule, pp, 8, vpp)
    for _, _, trace, pp_rank in results:
        # the training step's list, then evaluation's forward-only subset of it
        train_part = trace[:len(expected[pp_rank])]
        assert train_part == expected[pp_rank]
        eval_part = trace[len(expected[pp_rank]):]
        assert eval_part == [a for a in expected[pp_rank] if a.kind in ("F", "SEND_F", "RECV_F")]


@pytest.mark.parametrize("schedule", [["--pipeline-schedule", "1f1b"], ["--pipeline-schedule", "zb-h1"],
                                      ["--num-layers-per-virtual-pipeline-stage", "1"]])
def test_tp2_pp2_dp2_zero1_on_8_ranks_matches_single_process(schedule):
    ref, ref_params = _reference("llama", [])
    argv = _argv("llama", schedule + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--zero-stage", "1", "--sequence-parallel"])
    results = run_distributed(train_and_gather, 8, argv)
    assert_same_run(ref, records_of([r[0] for r in results]), grad_norm_rtol=1e-6, params=merged_params(results),
                    ref_params=ref_params)
