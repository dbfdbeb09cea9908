"""The fused tensor-parallel paths give the numbers of the plain ones.

- Cross entropy: in place (on logits the caller gives up) and out of place give the same loss
  and logits gradient, bitwise, as the former algorithm (three all-reduces, out of place); the
  caller's logits are left untouched unless it gives them up.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_lite.parallel import comm
from megatron_lite.parallel.state import ParallelDims, group_rank
from megatron_lite.parallel.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.testing import run_distributed


# --- cross entropy ----------------------------------------------------------------------------
def _former_ce_loss(logits, target, dims, vocab_size, ignore_index=-100):
    """The loss as computed before the in-place version: out of place, all-reduces of the max,
    the target logit (sum over ranks, zero where a rank does not hold it) and the exp sum."""
    group = dims.tp_group
    per_rank = logits.shape[-1]
    vocab_start = group_rank(group) * per_rank
    logits = logits.float().clone()
    logits[..., max(0, min(per_rank, vocab_size - vocab_start)):] = float("-inf")
    logits_max = logits.max(dim=-1)[0]
    comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
    shifted = logits - logits_max.unsqueeze(-1)
    local_t = target - vocab_start
    ignored = target == ignore_index
    in_range = (local_t >= 0) & (local_t < per_rank) & ~ignored
    predicted = shifted.gather(-1, local_t.masked_fill(~in_range, 0).unsqueeze(-1)).squeeze(-1)
    predicted = predicted.masked_fill(~in_range, 0.0)
    comm.all_reduce(predicted, group)
    sum_exp = shifted.exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group)
    return (sum_exp.log() - predicted).masked_fill(ignored, 0.0)


def _ce_variants(rank, world, tp, vocab, padded, dtype):
    dims = ParallelDims.from_world(tp=tp)
    gen = torch.Generator().manual_seed(5)
    full = (3 * torch.randn(6, 3, padded, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (6, 3), generator=gen)
    target[0, 1] = -100  # ignored
    target[4, 2] = -1  # outside the vocabulary but not ignore_index: no rank holds it
    weights = torch.rand(6, 3, generator=gen)
    local = full.chunk(tp, dim=-1)[dims.tp_rank]
    out = {"former": _former_ce_loss(local.clone(), target, dims, vocab)}
    for inplace in (False, True):
        logits = local.clone().requires_grad_(True)
        given = logits.detach().clone()
        loss = vocab_parallel_cross_entropy(logits, target, dims, vocab, inplace=inplace)
        after_forward = logits.detach().clone()
        (loss * weights).sum().backward()
        out[inplace] = dict(loss=loss.detach(), grad=logits.grad, untouched=torch.equal(after_forward, given)
                            and torch.equal(logits.detach(), given))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab,padded", [(64, 64), (37, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_in_place_is_bitwise_the_out_of_place_one(tp, vocab, padded, dtype):
    for r in run_distributed(_ce_variants, tp, tp, vocab, padded, dtype):
        copy, inplace = r[False], r[True]
        assert torch.equal(copy["loss"], r["former"]), "one MAX all-reduce of [max; target logit] must be exact"
        assert torch.equal(inplace["loss"], copy["loss"])
        assert torch.equal(inplace["grad"], copy["grad"])
        assert torch.isfinite(copy["loss"]).all()
        assert copy["untouched"], "without inplace the caller's logits must not change"
        # Given up, fp32 logits are overwritten (other dtypes are converted into a copy first).
        assert inplace["untouched"] == (dtype != torch.float32)


def _ce_counted(rank, world, inplace):
    dims = ParallelDims.from_world(tp=world)
    dims.comm_counter = comm.CommCounter()
    logits = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    target = torch.randint(0, 16 * world, (8, 2), generator=torch.Generator().manual_seed(9))
    vocab_parallel_cross_entropy(logits, target, dims, 16 * world, inplace=inplace).sum().backward()
    return dims.comm_counter.reset()


@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_moves_the_bytes_of_three_all_reduces_in_two(inplace):
    counted = run_distributed(_ce_counted, 2, inplace)[0]
    assert counted == {"all_reduce": 3 * 8 * 2 * 4}  # max, target logit, exp sum: [8, 2] fp32 each
