"""Saving a checkpoint leaves the run that saves bit-identical to one that does not, with the
optimizers whose state includes compression errors (optim/feedback_state.py); resuming from it
continues bit-exactly too (0/1 Adam's local steps pending at the save included), and the folded
residual still loads at another DP size."""
import pytest
import torch

from megatron_lite.testing import run_distributed
from tests.training_utils import TINY, losses_of, train_and_gather, train_in_process

RUN = TINY + ["--train-iters", "6"]
CASES = {
    "1-bit Adam": RUN + ["--optimizer", "adam-1bit", "--freeze-step", "2"],
    "0/1 Adam": RUN + ["--optimizer", "adam-01", "--var-freeze-step", "2", "--var-update-scaler", "1",
                       "--local-step-scaler", "1", "--local-step-clipper", "1"],  # (synchronises every step)
    "qgZ": RUN + ["--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-qgz-error-feedback"],
    "fp8 gradients": RUN + ["--zero-stage", "1", "--grad-comm-dtype", "fp8-e4m3"],
}


def _run(argv):
    """(losses, final full params) of a DP2 run of argv."""
    results = run_distributed(train_and_gather, 2, argv, timeout=240)
    return losses_of([r[0] for r in results]), results[0][1]


def _assert_identical(a, b):
    assert a[0] == b[0], (a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# (the default suite keeps 1-bit Adam, and 0/1 Adam by the pending case below, the harder one)
SLOW = {"qgZ", "fp8 gradients", "0/1 Adam"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_a_save_leaves_the_run_bit_identical(name, tmp_path):
    argv = CASES[name]
    plain = _run(argv)
    saving = _run(argv + ["--save", str(tmp_path / "a"), "--save-interval", "3"])
    _assert_identical(saving, plain)


@pytest.mark.slow  # (resume == the saving run: test_compression / test_zero_one_adam, in the default suite)
def test_a_resume_continues_bit_exactly_as_the_run_that_did_not_save(tmp_path):
    """1-bit Adam DP2: stopped after the save at 3 and resumed, the losses and final weights are the
    uninterrupted run's (each rank's own errors come back, not their mean)."""
    argv, ckpt = CASES["1-bit Adam"], str(tmp_path / "b")
    plain = _run(argv)
    first = losses_of(run_distributed(train_in_process, 2, argv + ["--save", ckpt, "--exit-interval", "3"]))
    resumed = _run(argv + ["--save", ckpt, "--load", ckpt])
    _assert_identical((first + resumed[0], resumed[1]), plain)


# local steps from 2, synchronised at 2 and 4 (the interval 1, 2, 4, ...): step 3 is pending at the save
PENDING = RUN + ["--optimizer", "adam-01", "--var-freeze-step", "1", "--var-update-scaler", "1",
                 "--local-step-scaler", "1", "--local-step-clipper", "4"]


def test_a_save_with_local_steps_pending_leaves_the_run_and_resumes_bit_exactly(tmp_path):
    """0/1 Adam DP2 saved at 3, whose local step is not yet synchronised: the run that saves is
    the run that does not, bit for bit (the checkpoint's synchronised state is computed on
    copies); resumed from that checkpoint at the same layout, each rank takes back its own params,
    momentum, anchor, LR sums and errors, and the sync at 4 and the rest are the same again."""
    plain = _run(PENDING)
    saving = _run(PENDING + ["--save", str(tmp_path / "a"), "--save-interval", "3"])
    _assert_identical(saving, plain)
    resumed = _run(PENDING + ["--load", str(tmp_path / "a" / "iter_0000003")])
    _assert_identical((plain[0][:3] + resumed[0], resumed[1]), plain)
