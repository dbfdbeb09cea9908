"""Every pipeline schedule with every activation-recomputation granularity and method reproduces
the single-process run without recomputation: losses, grad norms and final parameters, for tied
(GPT-2) and untied (Llama) embeddings. (zb-h1 defers weight gradients past the recomputed
forward, where the saved tensors are detached copies of the parameters.)"""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, merged_params, records_of, train_and_gather

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--lr", "3e-3", "--eval-iters", "0"]
SCHEDULES = {"gpipe": ["--pipeline-schedule", "gpipe"], "1f1b": ["--pipeline-schedule", "1f1b"],
             "zb-h1": ["--pipeline-schedule", "zb-h1"],
             "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"]}
# (granularity, method); layers per model chunk: 2, or 1 with interleaving.
RECOMPUTE = [("full", "uniform"), ("full", "block"), ("selective", None)]

_REFS = {}


def _reference(family):
    if family not in _REFS:
        argv = BASE + (LLAMA_SWITCHES if family == "llama" else [])
        results = run_distributed(train_and_gather, 1, argv)
        _REFS[family] = records_of([r[0] for r in results]), merged_params(results)
    return _REFS[family]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("granularity,method", RECOMPUTE)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_with_recomputation_matches_single_process(family, schedule, granularity, method):
    ref, ref_params = _reference(family)
    recompute = ["--recompute-granularity", granularity]
    if method is not None:
        per_chunk = 1 if schedule == "interleaved" else 2
        recompute += ["--recompute-method", method, "--recompute-num-layers", str(per_chunk if method == "uniform" else 1)]
    argv = BASE + (LLAMA_SWITCHES if family == "llama" else []) + SCHEDULES[schedule] + recompute + [
        "--pipeline-model-parallel-size", "2"]
    results = run_distributed(train_and_gather, 2, argv)
    assert_same_run(ref, records_of([r[0] for r in results]), rtol=1e-5, params=merged_params(results),
                    ref_params=ref_params, what=f"{family} {schedule} {granularity} {method}")
