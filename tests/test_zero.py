"""ZeRO stages 0-3 composed with TP: parity with the single-process run, memory and
communication against their theory, fp16 overflow skipping.

Each forked world trains several stages one after another (starting worlds costs more than
these tiny models)."""
import math

import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel import comm
from megatron_lite.parallel.gemm import GemmPath
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.sharding import gather_full
from megatron_lite.testing import assert_close, assert_same_run, run_distributed
from megatron_lite.training.step import forward_backward_no_pipelining, train_step
from models.gpt import build_model, gpt_forward_step

# GPT-2 style (LayerNorm, learned positions, tied embeddings) without linear biases: the key bias
# has a zero gradient in exact arithmetic, and Adam would turn its rounding noise into O(lr)
# layout-dependent updates. Norm biases are kept. Every size is a multiple of 8, so buckets need
# no padding and Psi is exactly the parameter count.
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
             make_vocab_size_divisible_by=16, max_position_embeddings=16, add_bias_linear=False,
             hidden_dropout=0.0, attention_dropout=0.0)
SEQ, GLOBAL_BATCH, STEPS, LR = 16, 8, 5, 3e-3
NORM = float(SEQ * GLOBAL_BATCH)  # train_step's loss normalizer: about the global token count


def make_batches(step, dims, micro_batch, vocab, global_batch=GLOBAL_BATCH):
    """This DP rank's micro-batches of global batch `step`: the same global data whatever the layout."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, SEQ + 1), generator=gen)
    mask = (torch.rand(global_batch, SEQ, generator=gen) > 0.2).float()
    per_rank = global_batch // dims.dp
    lo = dims.dp_rank * per_rank
    return [{"tokens": tokens[i:i + micro_batch, :-1], "labels": tokens[i:i + micro_batch, 1:],
             "loss_mask": mask[i:i + micro_batch]} for i in range(lo, lo + per_rank, micro_batch)]


def setup(tp, stage, dtype=torch.float32, model=MODEL, sp=False, fp16=False, recompute=None, recompute_layers=1,
          gemm=None, **pkw):
    dims = ParallelDims.from_world(tp=tp)
    cfg = ModelConfig(**model)
    chunks = build_model(cfg, dims, seed=5, sequence_parallel=sp, params_dtype=dtype, gemm=gemm or GemmPath(),
                         recompute_granularity=recompute, recompute_num_layers=recompute_layers)
    num_params = sum(p.numel() for p in chunks[0].parameters())  # Psi on this rank, before ZeRO-3 shards it
    tcfg = TrainingConfig(lr=LR, clip_grad=1.0, bf16=dtype == torch.bfloat16, fp16=fp16, initial_loss_scale=1024.0,
                          hysteresis=1)
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, zero_stage=stage, sequence_parallel=sp, **pkw)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, pcfg)
    return dims, cfg, chunks, optimizer, sync, num_params


def run_step(chunks, batches, dims, optimizer, sync, forward_backward=forward_backward_no_pipelining):
    """train_step of GPT's forward step, as the trainer calls it."""
    return train_step(chunks, batches, dims, optimizer, sync, LR, gpt_forward_step, forward_backward,
                      loss_normalizer=NORM)


def full_params(chunks, sync, dims):
    with sync.gathered_params():
        return {n: gather_full(p, p, dims) for n, p in chunks[0].named_parameters()}


def _train_stages(rank, world, tp, stages, pkw, micro_batch=1, sp=False):
    """Per stage: 5 losses and the final full parameters (returned by rank 0)."""
    out = {}
    for stage in stages:
        dims, cfg, chunks, optimizer, sync, _ = setup(tp, stage, sp=sp, **pkw)
        losses = []
        for step in range(STEPS):
            batches = make_batches(step, dims, micro_batch, cfg.vocab_size)
            losses.append(run_step(chunks, batches, dims, optimizer, sync)["lm_loss"])
        out[stage] = (losses, full_params(chunks, sync, dims))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train_stages, 1, 1, [0], {})[0][0]


def assert_matches(result, reference, what):
    losses, params = result
    ref_losses, ref_params = reference
    assert_same_run(ref_losses, losses, rtol=1e-5, what=what)
    assert params.keys() == ref_params.keys()
    for name in ref_params:  # after 5 Adam steps, which amplify the rounding noise of tiny gradients
        assert_close(params[name], ref_params[name], rtol=2e-5, atol=0.0, what=f"{what}: {name}")


# Overlap flags and small buckets (several per model, some params straddling shard boundaries)
# are exercised on half of the layouts; the defaults (one bucket, synchronous) on the others.
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=3000)


@pytest.mark.parametrize("tp,dp,pkw,sp", [
    (1, 2, {}, False), (1, 4, OVERLAP, False), (2, 2, OVERLAP, True), (2, 4, {}, False)])
def test_zero_stages_match_single_process(reference, tp, dp, pkw, sp):
    stages = [0, 1, 2, 3]
    if pkw.get("overlap_param_gather"):
        results = run_distributed(_train_stages, tp * dp, tp, [1, 2, 3], pkw, 1, sp)[0]
        results.update(run_distributed(_train_stages, tp * dp, tp, [0], dict(pkw, overlap_param_gather=False),
                                       1, sp)[0])
    else:
        results = run_distributed(_train_stages, tp * dp, tp, stages, pkw, 1, sp)[0]
    for stage in stages:
        assert_matches(results[stage], reference, f"tp{tp} dp{dp} zero-{stage}")


def _live_units(rank, world):
    """Units gathered at once during ZeRO-3 steps of a 4-layer model, with full recomputation."""
    dims, cfg, chunks, optimizer, sync, _ = setup(1, 3, model=dict(MODEL, num_layers=4), recompute="full")
    z3, live, peak = sync.zero3, set(), [0]
    gather, release = z3._gather, z3._release

    def tracked_gather(u):
        gather(u)
        if any(part.full is not None for part in u.parts):
            live.add(u)
        peak[0] = max(peak[0], len(live))

    def tracked_release(u, **kwargs):
        release(u, **kwargs)
        live.discard(u)

    z3._gather, z3._release = tracked_gather, tracked_release
    for step in range(2):
        run_step(chunks, make_batches(step, dims, 1, cfg.vocab_size), dims, optimizer, sync)
        assert not live, "units left gathered after a step"
    return peak[0]


def test_zero3_holds_at_most_the_root_and_two_layers():
    assert run_distributed(_live_units, 2)[0] == 3  # root + the running layer + the prefetched one


@pytest.mark.parametrize("layers_per_checkpoint", [1, 2])
def test_zero3_with_full_recomputation_matches_single_process(reference, layers_per_checkpoint):
    """Recomputation replays layers inside backward: they must be gathered then, and not freed."""
    pkw = {"recompute": "full", "recompute_layers": layers_per_checkpoint, "overlap_grad_reduce": True}
    assert_matches(run_distributed(_train_stages, 2, 1, [3], pkw)[0][3], reference, "zero-3 with recomputation")


def test_bf16_stages_track_the_fp32_run(reference):
    """bf16 params, fp32 main params and grads (or bf16 grads): not bitwise, but close to fp32."""
    runs = run_distributed(_train_stages, 2, 1, [0, 1, 2, 3], {"dtype": torch.bfloat16})[0]
    runs["bf16 reduce"] = run_distributed(_train_stages, 2, 1, [1], {"dtype": torch.bfloat16,
                                                                      "grad_reduce_in_bf16": True})[0][1]
    for what, (losses, _) in runs.items():
        assert_same_run(reference[0], losses, rtol=1e-2, what=f"bf16 {what} vs fp32")


def test_gradient_accumulation_matches_data_parallel(reference):
    """Global batch 8: 8 micro-batches on 1 rank == 2 ranks x 4 micro-batches (== 2 ranks x 2 of 2)."""
    assert_matches(run_distributed(_train_stages, 2, 1, [0], {})[0][0], reference, "2 ranks x 4 micro-batches")
    assert_matches(run_distributed(_train_stages, 2, 1, [2], {}, 2)[0][2], reference, "2 ranks x 2 micro-batches of 2")


def _sharded_grad_modes(reference, modes):
    """ZeRO-2/3 at DP2 with 4 micro-batches per rank, buckets of 3000 elements, per (once per step,
    overlap) mode: the same run as the single process, and as the first mode."""
    runs = {}
    for once, overlap in modes:
        pkw = dict(grad_reduce_once_per_step=once, overlap_grad_reduce=overlap, ddp_bucket_size=3000)
        runs[once, overlap] = run_distributed(_train_stages, 2, 1, [2, 3], pkw)[0]
    for (once, overlap), result in runs.items():
        for stage in (2, 3):
            what = f"zero-{stage} {'once per step' if once else 'per micro-batch'}{' overlap' if overlap else ''}"
            assert_matches(result[stage], reference, what)
            assert_matches(result[stage], runs[modes[0]][stage], f"{what} vs {modes[0]}")


def test_sharded_gradients_per_micro_batch_match_single_process_and_once_per_step(reference):
    """Reduce-scattered in every micro-batch's backward as buckets complete (the default, here with
    --overlap-grad-reduce) == once per step (--grad-reduce-once-per-step) == one process."""
    _sharded_grad_modes(reference, [(True, False), (False, True)])


@pytest.mark.slow
def test_sharded_gradient_modes_all_match(reference):
    _sharded_grad_modes(reference, [(True, False), (True, True), (False, False), (False, True)])


# --- memory ----------------------------------------------------------------------------------
def _memory(rank, world, dtype):
    out = {}
    for stage in range(4):
        dims, cfg, chunks, optimizer, sync, psi = setup(1, stage, dtype)
        before = optimizer.memory_bytes()
        run_step(chunks, make_batches(0, dims, 1, cfg.vocab_size), dims, optimizer, sync)
        kept_full_grads = any(b.grad_data is not None for b in sync.buckets)
        full_params_left = sum(p.numel() for p in chunks[0].parameters())
        out[stage] = (psi, before, optimizer.memory_bytes(), kept_full_grads, full_params_left)
    return out


def theory(stage, psi, n, dtype):
    """Bytes per rank: params, grads (fp32), optimizer state (fp32 main params unless the params are
    fp32, Adam m and v), each sharded over the n DP ranks from the stage on which ZeRO shards it."""
    p, g, o = (2, 4, 12) if dtype == torch.bfloat16 else (4, 4, 8)
    return {"param_bytes": p * psi / (n if stage >= 3 else 1), "grad_bytes": g * psi / (n if stage >= 2 else 1),
            "optimizer_state_bytes": o * psi / (n if stage >= 1 else 1)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_memory_per_rank_matches_theory(dtype):
    n = 4
    for stage, (psi, before, after, kept_full_grads, full_params_left) in run_distributed(_memory, n, dtype)[0].items():
        expected = theory(stage, psi, n, dtype)
        for key, value in expected.items():
            assert abs(before[key] - value) <= 0.05 * value, f"zero-{stage} {key}: {before[key]} vs theory {value}"
        assert after == before, f"zero-{stage}: memory held changed over a step"
        assert kept_full_grads == (stage <= 1), f"zero-{stage}: full gradient storage kept across the step"
        assert (full_params_left == 0) == (stage == 3), f"zero-{stage}: {full_params_left} full param elements"


# --- communication ---------------------------------------------------------------------------
def _comm(rank, world, dtype, micro_batches, once):
    out = {}
    for stage in range(4):
        dims, cfg, chunks, optimizer, sync, psi = setup(1, stage, dtype, grad_reduce_once_per_step=once,
                                                         ddp_bucket_size=3000)
        batches = make_batches(0, dims, 1, cfg.vocab_size, global_batch=world * micro_batches)
        dims.comm_counter = comm.CommCounter()
        run_step(chunks, batches, dims, optimizer, sync)
        out[stage] = (psi, dims.comm_counter.reset())
    return out


@pytest.mark.parametrize("dtype,micro_batches,once", [(torch.float32, 1, False), (torch.bfloat16, 1, False),
                                                      (torch.bfloat16, 2, True), (torch.float32, 4, False)])
def test_communication_per_step_matches_theory(dtype, micro_batches, once):
    """Bytes of the full logical buffers per step and rank: stage 0 all-reduces every gradient;
    1-2 reduce-scatter them and all-gather the params; 3 all-gathers the params twice per
    micro-batch (forward, backward) and reduce-scatters the gradients. Stages 2-3 reduce-scatter
    every micro-batch's gradients (once per step with --grad-reduce-once-per-step). Besides: the
    token count and the loss (4 bytes each), and the squared grad norm with the non-finite-loss
    flag, summed over the whole world (two float64: 16 bytes). Several buckets (3000 elements)."""
    elt = 2 if dtype == torch.bfloat16 else 4
    for stage, (psi, measured) in run_distributed(_comm, 4, dtype, micro_batches, once)[0].items():
        grads, params = 4 * psi, elt * psi
        sharded_grads = grads * (1 if once else micro_batches)
        scalars = 8 + 16
        expected = {0: {"all_reduce": grads + scalars},
                    1: {"all_reduce": scalars, "reduce_scatter": grads, "all_gather": params},
                    2: {"all_reduce": scalars, "reduce_scatter": sharded_grads, "all_gather": params},
                    3: {"all_reduce": scalars, "reduce_scatter": sharded_grads,
                        "all_gather": 2 * micro_batches * params}}
        assert measured == expected[stage], f"zero-{stage}: measured {measured} != theory {expected[stage]}"


def _zero3_gathers(rank, world, reshard, micro_batches):
    dims, cfg, chunks, optimizer, sync, psi = setup(1, 3, reshard_after_forward=reshard, recompute="full")
    batches = make_batches(0, dims, 1, cfg.vocab_size, global_batch=world * micro_batches)
    dims.comm_counter = comm.CommCounter()
    run_step(chunks, batches, dims, optimizer, sync)
    left = sum(p.numel() for p in chunks[0].parameters())  # the full params are freed after the step
    return psi, dims.comm_counter.reset()["all_gather"], left


def test_zero3_without_reshard_after_forward_gathers_once_per_step():
    """ZeRO-3 all-gathers every unit twice per micro-batch (forward, backward; recomputation reuses
    the backward's), or once per step with --no-reshard-after-forward; both free them at the end."""
    for reshard, expected in ((True, 2 * 2), (False, 1)):
        psi, gathered, left = run_distributed(_zero3_gathers, 2, reshard, 2)[0]
        assert gathered == expected * 4 * psi and left == 0, (reshard, gathered / (4 * psi), left)


# --- fp16 loss scaling -----------------------------------------------------------------------
def _fp16_skip(rank, world):
    out = {}
    for stage in range(4):
        dims, cfg, chunks, optimizer, sync, _ = setup(1, stage, torch.float16, fp16=True)
        victim = chunks[0].layers["1"].mlp.linear_fc1.weight

        def poisoned(*args, **kw):  # one element of one rank's local gradient becomes inf
            loss = forward_backward_no_pipelining(*args, **kw)
            if rank == world - 1:
                if victim.main_grad is not None:
                    victim.main_grad.view(-1)[3] = float("inf")
                else:  # stages 2-3 reduced it during backward: poison this rank's reduced shard instead
                    sync.bucket_of[victim].grad_shard[3] = float("inf")
            return loss

        before = full_params(chunks, sync, dims)
        scale = optimizer.loss_scale
        r1 = run_step(chunks, make_batches(0, dims, 1, cfg.vocab_size), dims, optimizer, sync, poisoned)
        after = full_params(chunks, sync, dims)
        r2 = run_step(chunks, make_batches(1, dims, 1, cfg.vocab_size), dims, optimizer, sync)
        changed = full_params(chunks, sync, dims)
        out[stage] = dict(skipped=not r1["update_successful"], scale=(scale, r1["loss_scale"], optimizer.loss_scale),
                          unchanged=all(torch.equal(before[k], after[k]) for k in before),
                          second_ok=r2["update_successful"] and math.isfinite(r2["grad_norm"]),
                          moved=any(not torch.equal(after[k], changed[k]) for k in after))
    return out


def test_fp16_overflow_skips_the_step_on_every_rank():
    for rank, result in enumerate(run_distributed(_fp16_skip, 2)):
        for stage, r in result.items():
            what = f"rank {rank} zero-{stage}"
            assert r["skipped"], f"{what}: the step with an inf gradient was not skipped"
            assert r["scale"] == (1024.0, 1024.0, 512.0), f"{what}: loss scale {r['scale']}"
            assert r["unchanged"], f"{what}: the skipped step changed the parameters"
            assert r["second_ok"] and r["moved"], f"{what}: the next step did not update"
