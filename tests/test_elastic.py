"""Elastic restarts: a job relaunched on fewer or more ranks resumes its last checkpoint, resharded
over the new data-parallel size, with the same global batch, and continues the uninterrupted
run's losses."""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import TINY, losses_of, train_in_process


@pytest.mark.parametrize("explicit_global_batch", [True, False])
def test_dp4_dp2_dp4_continues_the_uninterrupted_run(tmp_path, explicit_global_batch):
    base = TINY[:TINY.index("--global-batch-size")] + TINY[TINY.index("--global-batch-size") + 2:]
    base += ["--train-iters", "9", "--use-distributed-optimizer"]
    batch = ["--global-batch-size", "8"]
    straight = losses_of(run_distributed(train_in_process, 4, base + batch))
    # Without --global-batch-size the first launch's is micro-batch (2) x DP (4) = 8 as well; the
    # relaunches at DP=2 must keep 8 (from the checkpoint), not take 2 x 2.
    flags = base + (batch if explicit_global_batch else []) + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3"]
    pieces = []
    for world in (4, 2, 4):
        histories = run_distributed(train_in_process, world, flags)
        pieces += [r for h in histories[:1] for r in h]
        assert all(r["global_batch_size"] == 8 for r in histories[0])
    assert_same_run(straight, [r["lm_loss"] for r in pieces], rtol=1e-6)
