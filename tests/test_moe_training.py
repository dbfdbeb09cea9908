"""Mixture of experts in whole training runs (dropless): every expert layout trains exactly like
the single-process run (losses, grad norms, logged aux loss per iteration), composed with DP, TP
(expert TP 1 and TP), PP (1f1b, interleaved; zb-h1 with a shared expert), CP and ZeRO-1/3, grouped
GEMM on and off; and an EP=2 checkpoint (optimizer state and the aux-loss-free expert bias
included) loads at EP 1 and 4."""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, TINY, records_of, train_in_process

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
BASE = TINY + LLAMA_SWITCHES + MOE + ["--global-batch-size", "8", "--train-iters", "5"]
EP2 = ["--expert-model-parallel-size", "2"]
A2A = ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
_REFS = {}


def _reference(argv):
    key = tuple(argv)
    if key not in _REFS:
        _REFS[key] = records_of(run_distributed(train_in_process, 1, argv))
    return _REFS[key]


def _assert_like_single_process(argv, world, extra):
    ref = _reference(argv)
    out = records_of(run_distributed(train_in_process, world, argv + extra))
    assert_same_run(ref, out, grad_norm_rtol=1e-6, what=" ".join(extra))
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):  # the logged router statistics too
        if key not in ref[0]:
            continue
        assert_same_run([{"lm_loss": r[key]} for r in ref], [{"lm_loss": r[key]} for r in out], rtol=1e-5,
                        what=f"{key} {' '.join(extra)}")


@pytest.mark.parametrize("world,extra", [
    (2, EP2), (4, EP2), (4, ["--expert-model-parallel-size", "4"] + A2A), (4, EP2 + A2A),
    (4, EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, EP2 + A2A + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"]),
    (4, EP2 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
    (4, EP2 + A2A + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                     "--num-layers", "4"]),
    (4, EP2 + ["--context-parallel-size", "2"]),
    (4, EP2 + A2A + ["--zero-stage", "1"]),
    (4, EP2 + ["--zero-stage", "3"]),
], ids=["ep2", "ep2-dp2", "ep4-a2a-grouped", "ep2-dp2-a2a-grouped", "ep2-tp2-sp-etp1", "ep2-tp2-sp-etp2",
        "ep2-pp2-1f1b", "ep2-pp2-interleaved", "ep2-cp2", "ep2-zero1", "ep2-zero3"])
def test_expert_layouts_train_like_single_process(world, extra):
    argv = BASE + (["--num-layers", "4"] if "--num-layers" in extra else [])
    _assert_like_single_process(argv, world, extra)


BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "1e-2"]


def test_expert_bias_balancing_composes_with_ep():
    _assert_like_single_process(BASE + BIAS, 4, EP2 + A2A)


@pytest.mark.parametrize("dispatch", [[], A2A], ids=["loop", "a2a-grouped"])
def test_zero_bubble_defers_the_expert_weight_gradients_like_single_process(dispatch):
    """zb-h1 at PP2 x EP2: the routed experts (loop, grouped) and a gated shared expert queue their
    weight gradients in B and run them in W (tests/test_gemm_path.py counts them), as the single
    process computes them in its one backward."""
    shared = ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
    _assert_like_single_process(BASE + shared, 4, EP2 + dispatch + ["--pipeline-model-parallel-size", "2",
                                                                     "--pipeline-schedule", "zb-h1"])


@pytest.mark.parametrize("resume", [["--expert-model-parallel-size", "1"], ["--expert-model-parallel-size", "4"],
                                    EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                           "--expert-tensor-parallel-size", "2"]],
                         ids=["ep1", "ep4", "ep2-etp2"])
def test_ep2_checkpoint_resumes_at_other_expert_layouts(tmp_path, resume):
    argv = BASE + BIAS + ["--use-distributed-optimizer", "--train-iters", "6", "--lr-decay-iters", "6"]
    straight = _reference(argv)
    flags = argv + ["--save", str(tmp_path / "ckpt")]
    first = records_of(run_distributed(train_in_process, 4, flags + EP2 + ["--exit-interval", "3"]))
    second = records_of(run_distributed(train_in_process, 4, flags + resume))
    assert [r["iteration"] for r in first + second] == list(range(1, 7))
    assert_same_run(straight, first + second, rtol=1e-5)
