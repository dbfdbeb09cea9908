"""The fused tensor-parallel paths give the numbers of the plain ones.

- Cross entropy: in place (on logits the caller gives up) and out of place give the same loss
  and logits gradient, bitwise, as the former algorithm (three all-reduces, out of place); the
  caller's logits are left untouched unless it gives them up.
- Column-parallel layers whose backward all-reduces (SP: reduce-scatters) the input gradient
  asynchronously behind the weight-gradient GEMMs give, bitwise, the input and weight gradients
  of the separate TP region + linear layers, at TP 2 and 4, with and without SP, one or two
  layers over one input, weight gradients deferred (zero-bubble W pass) or not, accumulated over
  two micro-batches in param.grad or in main_grad (GradientSync's hooks), under recomputation;
  with the same collectives and bytes.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_lite.config import ModelConfig
from megatron_lite.parallel import comm
from megatron_lite.parallel.data_parallel import GradientSync
from megatron_lite.parallel.gemm import GemmPath
from megatron_lite.parallel.random import RNGStatesTracker, recompute
from megatron_lite.parallel.state import ParallelDims, group_rank
from megatron_lite.parallel.tensor_parallel import (
    column_parallel_linear, linear, vocab_parallel_cross_entropy)
from megatron_lite.testing import assert_same_run, run_distributed
from models.gpt import build_model
from training_utils import LLAMA_SWITCHES, merged_params, records_of, train_and_gather


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
    dims.comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
    shifted = logits - logits_max.unsqueeze(-1)
    local_t = target - vocab_start
    ignored = target == ignore_index
    in_range = (local_t >= 0) & (local_t < per_rank) & ~ignored
    predicted = shifted.gather(-1, local_t.masked_fill(~in_range, 0).unsqueeze(-1)).squeeze(-1)
    predicted = predicted.masked_fill(~in_range, 0.0)
    dims.comm.all_reduce(predicted, group)
    sum_exp = shifted.exp().sum(dim=-1)
    dims.comm.all_reduce(sum_exp, group)
    return (sum_exp.log() - predicted).masked_fill(ignored, 0.0)


def ce_inputs(tp, vocab, padded, dtype, seed=5, rows=6, scale=3.0):
    """(dims, this TP rank's logits [rows, 3, padded / tp], targets, loss weights): one target
    ignored, one outside the vocabulary but not ignore_index (no rank holds it)."""
    dims = ParallelDims.from_world(tp=tp)
    gen = torch.Generator().manual_seed(seed)
    full = (scale * torch.randn(rows, 3, padded, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (rows, 3), generator=gen)
    target[0, 1] = -100
    target[rows - 2, 2] = -1
    weights = torch.rand(rows, 3, generator=gen)
    return dims, full.chunk(tp, dim=-1)[dims.tp_rank], target, weights


def _ce_variants(rank, world, tp, vocab, padded, dtype):
    dims, local, target, weights = ce_inputs(tp, vocab, padded, dtype)
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


# --- column-parallel layers with the overlapped input-gradient collective ---------------------
IN, OUTS, S, B = 16, (8, 12), 8, 2  # output features and sequence divisible by TP 4


def _column_grads(rank, world, sp, n_layers, mode, fused):
    """Two micro-batches through `n_layers` column-parallel layers over one input (the first with
    a bias); returns the input gradients, the accumulated weight gradients and the bytes moved.
    mode: "autograd" (param.grad), "deferred" (a deferrable GemmPath, flushed after each backward),
    "main_grad" (GradientSync's hooks and buffers), "deferred+main_grad", "recompute"
    (activation recomputation around the layers, weight gradients deferred)."""
    dims = ParallelDims.from_world(tp=world)
    dims.comm_counter = comm.CommCounter()
    gen = torch.Generator().manual_seed(0)
    params = []
    for i, out in enumerate(OUTS[:n_layers]):
        w = nn.Parameter(torch.randn(out, IN, generator=gen).chunk(world)[rank].clone())
        b = nn.Parameter(torch.randn(out, generator=gen).chunk(world)[rank].clone()) if i == 0 else None
        params.append((w, b))
    holder = nn.Module()
    holder.params = nn.ParameterList([p for pair in params for p in pair if p is not None])
    store = GemmPath(deferrable=True) if "deferred" in mode or mode == "recompute" else None
    sync = GradientSync([holder], dims) if "main_grad" in mode else None
    if sync is not None:
        sync.start_step(2)

    def layers(x):
        if fused:
            return column_parallel_linear(x, params, dims, sp, store)
        group = dims.tp_group
        x = dims.comm.gather_from_sp(x, group) if sp else dims.comm.copy_to_tp(x, group)
        return tuple(linear(x, w, b, store) for w, b in params)

    input_grads = []
    for _ in range(2):
        x_full = torch.randn(S, B, IN, generator=gen)
        out_grads = [torch.randn(S, B, out, generator=gen).chunk(world, dim=-1)[rank] for out in OUTS[:n_layers]]
        x = (x_full.chunk(world)[rank] if sp else x_full).clone().requires_grad_(True)
        ys = recompute(layers, RNGStatesTracker(), x) if mode == "recompute" else layers(x)
        if store is not None:
            store.deferring = True
        torch.autograd.backward(ys, out_grads)
        if store is not None:
            store.deferring = False
            store.flush()
        input_grads.append(x.grad)
    if sync is not None:
        sync.finish()
    grads = [(p.main_grad if sync is not None else p.grad).clone() for p in holder.params]
    return input_grads, grads, dims.comm_counter.reset()


MODES = ["autograd", "deferred", "main_grad", "deferred+main_grad", "recompute"]


def _both_paths(rank, world, sp, n_layers):
    return {(mode, fused): _column_grads(rank, world, sp, n_layers, mode, fused)
            for mode in MODES for fused in (True, False)}


@pytest.mark.parametrize("tp,sp,n_layers", [(2, True, 2), (4, False, 1)] + [
    pytest.param(tp, sp, n, marks=pytest.mark.slow) for tp in (2, 4) for sp in (False, True) for n in (1, 2)
    if (tp, sp, n) not in ((2, True, 2), (4, False, 1))])
def test_overlapped_column_parallel_backward_is_bitwise_the_synchronous_one(tp, sp, n_layers):
    for rank, runs in enumerate(run_distributed(_both_paths, tp, sp, n_layers)):
        for mode in MODES:
            (xg, wg, moved), (ref_xg, ref_wg, ref_moved) = runs[mode, True], runs[mode, False]
            what = f"rank {rank} {mode}"
            for mb, (a, b) in enumerate(zip(xg, ref_xg)):
                assert torch.equal(a, b), f"{what} micro-batch {mb}: input gradient"
            assert len(wg) == len(ref_wg) == n_layers + 1
            for i, (a, b) in enumerate(zip(wg, ref_wg)):
                assert torch.equal(a, b), f"{what}: gradient of parameter {i}"
            # The deferred weight gradients (queued, run in the W pass) are those computed in backward.
            direct = runs[mode.replace("deferred+", "").replace("deferred", "autograd"), True]
            if mode != "recompute":
                assert all(torch.equal(a, b) for a, b in zip(xg + wg, direct[0] + direct[1])), what
            # One collective per micro-batch for all the layers, in both: the bytes of [S, B, IN]
            # fp32 (SP: all-gathered forward, again in recomputation, reduce-scattered backward);
            # the fused path under SP keeps only the shard and gathers it once more in backward.
            full = 2 * S * B * IN * 4
            forwards = 2 if mode == "recompute" else 1
            assert ref_moved == ({"all_gather": forwards * full, "reduce_scatter": full} if sp
                                 else {"all_reduce": full})
            assert moved == ({"all_gather": (forwards + 1) * full, "reduce_scatter": full} if sp
                             else {"all_reduce": full}), what


# --- in the model -----------------------------------------------------------------------------
def _gpt_step_bytes(rank, world, sp):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      vocab_size=256, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0)
    dims = ParallelDims.from_world(tp=world)
    dims.comm_counter = comm.CommCounter()
    model = build_model(cfg, dims, seed=7, sequence_parallel=sp)[0]
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    return dims.comm_counter.reset()


@pytest.mark.parametrize("sp", [False, True])
def test_gpt_step_moves_the_same_collectives(sp):
    """One GPT forward/backward at TP 2 counts what the separate TP regions counted (plus, under
    SP, the backward re-gather of each column-parallel input, as Megatron-LM does): per layer
    two forward collectives (attention and MLP outputs) and two backward ones (the input gradient
    of Q with K;V, and of fc1), one each for the embedding and the output layer, and the
    cross entropy's three [s, b] fp32 statistics."""
    counted = run_distributed(_gpt_step_bytes, 2, sp)[0]
    layers, act, stats = 2, 16 * 2 * 64 * 4, 3 * 16 * 2 * 4
    per_direction = (2 * layers + 1) * act
    if sp:  # all-gathers forward become reduce-scatters backward and the other way round; each
        # column-parallel input is gathered again in backward (only its shard is kept)
        assert counted == {"all_gather": 3 * per_direction, "reduce_scatter": 2 * per_direction, "all_reduce": stats}
    else:
        assert counted == {"all_reduce": 2 * per_direction + stats}


RECOMPUTE_ZB = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--device", "cpu",
                "--lr", "3e-3", "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0"] + LLAMA_SWITCHES


def test_tp2_zero_bubble_with_recomputation_matches_single_process():
    """TP 2 with SP under zb-h1 (weight gradients deferred past the recomputed forward of the
    overlapped column-parallel layers) and full recomputation: the single-process run."""
    ref = run_distributed(train_and_gather, 1, RECOMPUTE_ZB)
    argv = RECOMPUTE_ZB + ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2",
                           "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]
    results = run_distributed(train_and_gather, 4, argv)
    assert_same_run(records_of([r[0] for r in ref]), records_of([r[0] for r in results]), rtol=1e-5,
                    params=merged_params(results), ref_params=merged_params(ref))


def test_shared_input_runs_each_layers_forward_hooks():
    """Q and K;V go through one column-parallel call, but through each module's call too, so that
    their forward pre-hooks (GradientSync's wait for --overlap-param-gather) still run."""
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model(cfg, ParallelDims().build_groups(), seed=1)[0]
    attention = model.layers["0"].self_attention
    calls = []
    for name in ("linear_q", "linear_kv", "linear_proj"):
        getattr(attention, name).register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
    model(torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long))
    assert calls == ["linear_q", "linear_kv", "linear_proj"]
