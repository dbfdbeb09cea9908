"""Checkpoint geometry: flat ranges -> boxes -> full-tensor boxes, over random layouts.

Round trip: every rank of a random layout (TP with fused segments, replicated K/V groups,
vocabulary padding; ZeRO-like flat cuts over DP) writes its pieces; after dedup the union covers
every stored element of the full tensor exactly once, and every rank reads its local tensor back."""
import math
import random

import pytest
import torch
import torch.nn as nn

from megatron_lite.checkpoint.geometry import (flat_range_to_boxes, flat_range_to_full, intersect, relative_slices,
                                               spec_of)
from megatron_lite.parallel.tensor_parallel import set_replicated_meta, set_tp_meta, shard_tensor


@pytest.mark.parametrize("seed", range(20))
def test_flat_range_boxes_are_contiguous_runs_covering_the_range(seed):
    rng = random.Random(seed)
    shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    n = math.prod(shape)
    lo = rng.randint(0, n - 1)
    hi = rng.randint(lo + 1, n)
    index = torch.arange(n).view(shape)
    covered = []
    for start, box in flat_range_to_boxes(shape, lo, hi):
        values = index[relative_slices(box, tuple((0, k) for k in shape))].reshape(-1)
        assert values.tolist() == list(range(start, start + values.numel())), (shape, box)
        covered += values.tolist()
    assert covered == list(range(lo, hi))
    assert len(flat_range_to_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_intersect():
    assert intersect(((0, 4), (2, 2)), ((3, 5), (0, 3))) == ((3, 1), (2, 1))
    assert intersect(((0, 4),), ((4, 2),)) is None


def _random_param(rng):
    """(full tensor, parameter with TP metadata, tp) of a random layout."""
    tp = rng.choice([1, 2, 4, 8])
    ndim = rng.randint(1, 3)
    if rng.random() < 0.15:  # replicated on every TP rank (norms, row-parallel biases)
        shape = [rng.randint(1, 6) for _ in range(ndim)]
        p = nn.Parameter(torch.empty(shape))
        set_replicated_meta(p)
        return torch.randn(shape), p, tp
    replicas = rng.choice([r for r in (1, 2, 4) if tp % r == 0])
    shards = tp // replicas
    dim = rng.randrange(ndim)
    segments = [shards * rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    shape = [rng.randint(1, 4) for _ in range(ndim)]
    shape[dim] = sum(segments)
    vocab_rows = None
    if dim == 0 and len(segments) == 1 and rng.random() < 0.5:  # a padded vocabulary
        vocab_rows = rng.randint(1, shape[0])
    p = nn.Parameter(torch.empty([s // shards if i == dim else s for i, s in enumerate(shape)]))
    set_tp_meta(p, dim, shape, segments, replicas)
    full = torch.randn(shape)
    if vocab_rows is not None:
        p.vocab_rows = vocab_rows
        full[vocab_rows:] = 0.0  # padding rows are not stored: a reader leaves them as they were (0 here)
    return full, p, tp


def _cuts(rng, n, parts):
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return list(zip([0] + points, points + [n]))


@pytest.mark.parametrize("seed", range(60))
def test_every_stored_element_is_written_once_and_read_back(seed):
    rng = random.Random(seed)
    full, p, tp = _random_param(rng)
    dp = rng.randint(1, 3)
    stored = full[: getattr(p, "vocab_rows", None) or full.shape[0]] if full.dim() else full
    written = torch.zeros_like(stored)
    count = torch.zeros(stored.shape, dtype=torch.int64)
    for tp_rank in range(tp):
        local = shard_tensor(full, p, tp_rank, tp).contiguous()
        spec = spec_of(p, local.shape, tp_rank, tp)
        replicas = getattr(p, "tp_replicas", 1) if getattr(p, "tensor_model_parallel", False) else tp
        writer = tp_rank % replicas == 0
        flat = local.reshape(-1)
        back = torch.zeros_like(flat)
        for lo, hi in _cuts(rng, flat.numel(), dp):  # a ZeRO-like split of the local tensor over DP
            for run in flat_range_to_full(spec, lo, hi):
                target = relative_slices(run.full, tuple((0, k) for k in stored.shape))
                if writer:
                    written[target] = run.view(flat)
                    count[target] += 1
                run.view(back).copy_(stored[target])
        assert torch.equal(back.view(local.shape), local), f"rank {tp_rank} did not read its tensor back"
    assert torch.equal(count, torch.ones_like(count)), "an element was written zero or several times"
    assert torch.equal(written, stored)


def test_run_view_with_offset_reads_a_shard_of_a_bucket():
    p = nn.Parameter(torch.empty(4, 3))
    set_replicated_meta(p)
    spec = spec_of(p, (4, 3), 0, 1)
    bucket = torch.arange(20.0)  # the param sits at bucket positions 5..16; the shard holds 8..19
    shard = bucket[8:]
    runs = flat_range_to_full(spec, 3, 12)  # param elements 3..11 = bucket 8..16
    got = torch.cat([r.view(shard, 5 - 8).reshape(-1) for r in runs])
    assert got.tolist() == list(range(8, 17))
