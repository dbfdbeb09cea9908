"""DualPipe-V's overlapped step (--overlap-moe-expert-parallel-comm): each paired backward and
forward of two micro-batches run as interleaved pieces (parallel/overlap.py), every MoE all-to-all
of one in flight while the other computes. The paired lists are deadlock-free; a run records that
an all-to-all started, the other micro-batch computed up to its own all-to-all, and only then the
first was waited for; the order is the same on both ranks of each EP group; the losses, grad
norms and weights equal the single-process run and the serialized dualpipe-v run."""
import os
import threading

import pytest
import torch

from megatron_lite.parallel.overlap import Interleaver
from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import build_schedule, compute_orders, overlapped_pairs
from megatron_lite.parallel.pipeline.simulator import check_schedule, simulate
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import merged_params, records_of, single_process_reference


@pytest.mark.parametrize("p", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_paired_lists_are_deadlock_free(p):
    """Each pair (a BW followed by an F in DualPipe-V's compute order) adjacent: its F input
    received before it, the BW's gradient sent after it. Complete and deadlock-free for every
    m >= 2p - 1; run serialized it costs p - 1 units more than the unpaired lists (each pair's send
    waits for its F), at the same peak of 2p chunk activations."""
    for m in range(2 * p - 1, 3 * p + 1):
        lists = build_schedule("dualpipe-v", p, m, overlap=True)
        check_schedule(lists, StagePlacement(p, 2, "V"))
        for order, lst in zip(compute_orders("dualpipe-v", p, m), lists):
            want = sum(a.kind == "BW" and b.kind == "F" for a, b in zip(order, order[1:]))
            assert len(overlapped_pairs(lst)) == want > 0
        res = simulate(lists, placement=StagePlacement(p, 2, "V"))
        assert res.makespan == 6 * m + 2 * (p - 1) and max(res.peak_in_flight) == 2 * p, m


def test_interleaver_alternates_at_switch_points_and_reraises():
    """The two callables run one at a time, changing hands only at switch(): backward first, then
    the forward up to its switch, and so on; when one ends the other runs on alone."""
    seen, log = [], []
    lock_free = threading.Lock()

    def piece(name, n):
        def run():
            for i in range(n):
                assert lock_free.acquire(blocking=False)  # never two at once
                seen.append(f"{name}{i}")
                lock_free.release()
                inter.switch()
        return run

    inter = Interleaver(log)
    inter.run(piece("b", 3), piece("f", 1))
    assert seen == ["b0", "f0", "b1", "b2"]
    assert log[:3] == [("first", "start"), ("second", "start"), ("first", "resume")]
    assert inter.switch() is False  # off the two threads: nothing to hand over

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Interleaver().run(piece("b", 2), fail)


BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3", "--device", "cpu",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "3e-3", "--eval-iters", "0",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
PP2_EP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
           "--pipeline-schedule", "dualpipe-v"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "alltoall"]


def _train_logged(rank, world, argv):
    """(records, final params, executed actions, pp rank, the pairs' event log, ep rank)."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.parallel.sharding import gather_full, spec_of
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    executor = trainer.forward_backward.executor
    executor.trace, log = [], []
    if executor.interleaver is not None:
        executor.interleaver.log = log
    history = trainer.train()
    params = {}
    with trainer.grad_sync.gathered_params():  # ZeRO-3 keeps only shards between steps
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                tied_copy = spec_of(p).tie is not None and not chunk.pre_process  # the loss end's copy
                if ".experts." not in name and not tied_copy:  # each EP rank holds half the experts: see the losses
                    params[name] = gather_full(p.data, p, trainer.dims).float()
    return history, params, executor.trace, trainer.dims.pp_rank, log, trainer.dims.ep_rank


def _overlaps(log):
    """Pieces of one role whose all-to-all stayed in flight while the other role ran up to its own
    all-to-all: `start` of X, then `start` of Y, then `wait` of X."""
    hits = 0
    for i, (role, event) in enumerate(log):
        if event != "start":
            continue
        rest = log[i + 1:]
        waited = next((j for j, e in enumerate(rest) if e == (role, "wait")), None)
        if waited is not None and any(r != role and e == "start" for r, e in rest[:waited]):
            hits += 1
    return hits


def _run(base, extra, world):
    """The run of base + extra on `world` ranks, checked against the single-process run of base."""
    ref, ref_params = single_process_reference(base)
    results = run_distributed(_train_logged, world, base + extra)
    params = merged_params([r[:4] for r in results])
    assert_same_run(ref, records_of([r[0] for r in results]), rtol=1e-5, grad_norm_rtol=1e-6, params=params,
                    ref_params={k: v for k, v in ref_params.items() if k in params}, what=" ".join(extra))
    return results


def test_overlapped_pairs_at_pp2_ep2_match_single_process_and_serialized():
    """PP2 x EP2 MoE (4 ranks): overlapped and serialized dualpipe-v both match the single process;
    the overlapped run executes the paired list, its all-to-alls overlap the other micro-batch's
    compute in both directions (a backward's hides a forward and the reverse), and the two EP
    ranks of each stage log the same order of pieces (hence of collectives)."""
    serial = _run(BASE, PP2_EP2 + OVERLAP[1:], 4)
    overlapped = _run(BASE, PP2_EP2 + OVERLAP + ["--distributed-timeout-minutes", "0.25"], 4)  # a mismatch: 15 s
    for (h1, *_), (h2, *_) in zip(serial, overlapped):
        assert [r["lm_loss"] for r in h1] == [r["lm_loss"] for r in h2]  # the same arithmetic, reordered
    logs = {}
    for _, _, trace, pp_rank, log, ep_rank in overlapped:
        assert trace == build_schedule("dualpipe-v", 2, 4, overlap=True)[pp_rank] * 3
        assert _overlaps(log) >= 3 * len(overlapped_pairs(trace[: len(trace) // 3]))  # >= one per pair
        assert any(r == "first" and e == "start" for r, e in log) and any(r == "second" and e == "start" for r, e in log)
        logs.setdefault(pp_rank, []).append(log)
    for pp_rank, (a, b) in logs.items():
        assert a == b, pp_rank


COMBINATIONS = {
    "full-recompute": (4, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
    "moe-layer-recompute": (4, ["--moe-layer-recompute"]),
    "selective-recompute": (4, ["--recompute-granularity", "selective"]),
    "zero3-no-reshard": (4, ["--zero-stage", "3", "--no-reshard-after-forward"]),
    "zero1-overlap-grad-reduce": (4, ["--zero-stage", "1", "--overlap-grad-reduce"]),
    "cp2-ep2": (4, ["--context-parallel-size", "2", "--global-batch-size", "4"]),  # ring attention inside pairs
    "pp4-ep2": (8, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--global-batch-size", "16"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_overlapped_pairs_combined_match_single_process(name):
    """Recomputation (whose replayed forward inside a backward is no switch point: it swaps the RNG
    state), ZeRO-3 with parameters kept for the step, ZeRO-1 with gradient buckets reduced from the
    backward thread, CP2 (EP over the CP ranks), and PP4 x EP2, each overlapped like the single process."""
    world, extra = COMBINATIONS[name]
    base = BASE + [x for i, flag in enumerate(extra) if flag in ("--num-layers", "--global-batch-size")
                   for x in extra[i:i + 2]]
    results = _run(base, PP2_EP2 + OVERLAP + extra, world)
    assert all(_overlaps(r[4]) > 0 for r in results)
