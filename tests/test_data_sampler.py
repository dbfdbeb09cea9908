"""The DP-aware sampler: same global batches for any DP size, exact resume."""
import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.data import build_pretraining_data_loader
from megatron_lite.data.sampler import PretrainingBatchSampler


class Counting(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i]), "loss_mask": torch.ones(2)}


def global_batches(dataset, consumed, mbs, gbs, dp, steps, num_workers=0):
    """Reassemble the global batches the DP ranks see, from each rank's own loader."""
    iters = [iter(build_pretraining_data_loader(dataset, consumed, mbs, gbs, r, dp, num_workers)) for r in range(dp)]
    micro_per_rank = gbs // (mbs * dp)
    out = []
    for _ in range(steps):
        batch = []
        for it in iters:  # rank r holds the r-th contiguous chunk of the global batch
            for _ in range(micro_per_rank):
                mb = next(it)
                assert mb["tokens"].shape == (mbs, 2)
                batch += mb["tokens"][:, 0].tolist()
        out.append(batch)
    return out


def test_global_batches_do_not_depend_on_dp_size():
    ds = Counting(1000)
    ref = global_batches(ds, 0, 2, 16, 1, 10)
    assert ref[0] == list(range(16)) and ref[3] == list(range(48, 64))
    assert global_batches(ds, 0, 2, 16, 2, 10) == ref
    assert global_batches(ds, 0, 4, 16, 4, 10) == ref
    assert global_batches(ds, 0, 1, 16, 4, 10) == ref


def test_rank_takes_its_contiguous_chunk():
    s = PretrainingBatchSampler(1000, 32, micro_batch_size=2, global_batch_size=16, dp_rank=1, dp_size=2)
    it = iter(s)
    assert [next(it) for _ in range(5)] == [[40, 41], [42, 43], [44, 45], [46, 47], [56, 57]]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_equals_uninterrupted_stream(dp):
    ds = Counting(500)
    full = global_batches(ds, 0, 2, 8, dp, 40)  # runs past the end: the stream wraps around
    for k in (0, 1, 7, 39):
        assert global_batches(ds, k * 8, 2, 8, dp, 40 - k) == full[k:]
    assert full[-1] == [i % 500 for i in range(39 * 8, 40 * 8)]


def test_worker_processes_keep_the_order():
    ds = Counting(200)
    assert global_batches(ds, 16, 2, 8, 2, 6, num_workers=2) == global_batches(ds, 16, 2, 8, 2, 6)


@pytest.mark.parametrize("kw,match", [
    (dict(consumed_samples=5), "multiple of global_batch_size"),
    (dict(global_batch_size=10, dp_size=4), "divisible"),
    (dict(dp_rank=2, dp_size=2), "dp_rank"),
])
def test_bad_sampler_arguments(kw, match):
    args = dict(consumed_samples=0, micro_batch_size=1, global_batch_size=8, dp_rank=0, dp_size=2)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        build_pretraining_data_loader(Counting(10), **args)
