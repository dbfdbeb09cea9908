"""Checkpoint geometry: flat ranges -> boxes -> full-tensor boxes, over random layouts.

Round trip: every rank of a random layout (TP with fused segments, replicated K/V groups,
vocabulary padding; ZeRO-like flat cuts over DP) writes its pieces; after dedup the union covers
every stored element of the full tensor exactly once, and every rank reads its local tensor back."""
import math
import random

import pytest
import torch

from megatron_lite.checkpoint.geometry import flat_range_to_boxes, flat_range_to_full, intersect, relative_slices
from megatron_lite.parallel.sharding import ShardSpec, Split


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


def _random_layout(rng):
    """(stored full tensor, [(spec, writes)] for every rank) of a random layout: TP with fused
    segments, replicated K/V groups and a padded vocabulary, sometimes a second dimension split
    over EP (stacked experts), or a tensor every rank holds whole."""
    ndim = rng.randint(1, 3)
    shape = [rng.randint(1, 4) for _ in range(ndim)]
    tp = rng.choice([1, 2, 4, 8])
    if rng.random() < 0.15:  # replicated on every TP rank (norms, row-parallel biases)
        full = torch.randn(shape)
        return full, [(ShardSpec(tuple(shape)), r == 0) for r in range(tp)]
    replicas = rng.choice([r for r in (1, 2, 4) if tp % r == 0])
    shards = tp // replicas
    dim = rng.randrange(ndim)
    segments = tuple(shards * rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
    shape[dim] = sum(segments)
    ep, ep_dim = 1, None
    if ndim > 1 and rng.random() < 0.3:
        ep_dim = rng.choice([d for d in range(ndim) if d != dim])
        ep = rng.choice([2, 3])
        shape[ep_dim] = ep * rng.randint(1, 2)
    rows = rng.randint(1, shape[0]) if dim == 0 and len(segments) == 1 and ep_dim != 0 and rng.random() < 0.5 else None
    full = torch.randn(shape)
    if rows is not None:
        full[rows:] = 0.0  # padding rows are not stored: a reader leaves them as they were (0 here)
    layout = []
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            splits = (Split(dim, "tp", shards, tp_rank // replicas, segments, replicas),)
            if ep_dim is not None:
                splits += (Split(ep_dim, "ep", ep, ep_rank, (shape[ep_dim],)),)
            layout.append((ShardSpec(tuple(shape), splits, stored_rows=rows), tp_rank % replicas == 0))
    return full, layout


def _cuts(rng, n, parts):
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return list(zip([0] + points, points + [n]))


@pytest.mark.parametrize("seed", range(80))
def test_every_stored_element_is_written_once_and_read_back(seed):
    rng = random.Random(seed)
    full, layout = _random_layout(rng)
    dp = rng.randint(1, 3)
    spec0 = layout[0][0]
    stored = spec0.trim(full) if full.dim() else full
    written = torch.zeros_like(stored)
    count = torch.zeros(stored.shape, dtype=torch.int64)
    for rank, (spec, writer) in enumerate(layout):
        local = spec.shard(full).contiguous()
        assert tuple(local.shape) == spec.local_shape
        flat = local.reshape(-1)
        back = torch.zeros_like(flat)
        for lo, hi in _cuts(rng, flat.numel(), dp):  # a ZeRO-like split of the local tensor over DP
            for run in flat_range_to_full(spec, lo, hi):
                target = relative_slices(run.full, tuple((0, k) for k in stored.shape))
                if writer:
                    written[target] = run.view(flat)
                    count[target] += 1
                run.view(back).copy_(stored[target])
        assert torch.equal(back.view(local.shape), local), f"rank {rank} did not read its tensor back"
    assert torch.equal(count, torch.ones_like(count)), "an element was written zero or several times"
    assert torch.equal(written, stored)


def test_unshard_inverts_shard():
    spec = ShardSpec((12, 3), (Split(0, "tp", 2, 0, (4, 8), replicas=2),))
    full = torch.randn(12, 3)
    pieces = [ShardSpec((12, 3), (Split(0, "tp", 2, r // 2, (4, 8), replicas=2),)).shard(full) for r in range(4)]
    assert torch.equal(spec.unshard(pieces), full)


def test_run_view_with_offset_reads_a_shard_of_a_bucket():
    spec = ShardSpec((4, 3))
    bucket = torch.arange(20.0)  # the param sits at bucket positions 5..16; the shard holds 8..19
    shard = bucket[8:]
    runs = flat_range_to_full(spec, 3, 12)  # param elements 3..11 = bucket 8..16
    got = torch.cat([r.view(shard, 5 - 8).reshape(-1) for r in runs])
    assert got.tolist() == list(range(8, 17))
