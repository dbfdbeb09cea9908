"""ZB-V and DualPipe-V (two chunks per rank on the V placement, B split from W): the action lists
are complete and deadlock-free for every p >= 2 and m >= the schedule's minimum, reach the lower
bound of the makespan at F = B = W from m = 2p - 1 (bubble (p - 1) / 6m, half of ZB-H1's, -> 0)
at 1F1B's peak of activations (zb-v: counted until W), and whole training runs match the
single-process run for tied (GPT-2, both ends on rank 0) and untied (Llama) embeddings, with
recomputation, uneven stages, MoE at EP2, CP2, ZeRO-1/2 and a checkpoint across layouts."""
import subprocess
import sys

import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import build_schedule, validate_schedule_args
from megatron_lite.parallel.pipeline.simulator import check_schedule, simulate
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import (LLAMA_SWITCHES, ROOT, losses_of, merged_params, records_of, single_process_reference,
                            train_and_gather, train_in_process)


def _v(p):
    return StagePlacement(p, 2, "V")


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_lists_are_complete_and_deadlock_free_for_every_m(p):
    for m in range(p, 3 * p + 1):
        lists = build_schedule("zb-v", p, m)
        check_schedule(lists, _v(p))  # each F before its B before its W; FIFO pairs; both comm styles
        assert sum(a.kind == "B" for lst in lists for a in lst) == 2 * p * m
        # the turn (stage p-1 -> p) is a hand-off on the last rank: no message about chunk 0 leaves it forward
        assert not any(a.kind == "SEND_F" and a.chunk == 0 for a in lists[p - 1])


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8, 16])
def test_bubble_reaches_the_lower_bound(p):
    """At F = B = W = 1 per chunk every rank is busy 6m; the last rank cannot start before p - 1
    forwards have reached it, so 6m + p - 1 is the least makespan: ZB-V reaches it for m >= 2p - 1
    (lazy and blocking executors alike) and keeps it near: bubble (p - 1) / 6m, half of ZB-H1's
    (p - 1) / 3m at the same per-layer costs, going to 0 as m grows."""
    for m in (2 * p - 1, 2 * p, 3 * p, 4 * p):
        lists = build_schedule("zb-v", p, m)
        for comm in ("lazy", "blocking"):
            res = simulate(lists, costs=(1, 1, 1), comm=comm, placement=_v(p))
            assert res.busy == [6.0 * m] * p
            assert res.makespan == 6 * m + p - 1, (m, comm)
            assert res.bubble == pytest.approx([(p - 1) / (6 * m)] * p)
    zb_h1 = simulate(build_schedule("zb-h1", p, 4 * p))  # whole stages: F = B = W = 2 chunk units
    assert zb_h1.bubble[0] == pytest.approx(2 * res.bubble[0])
    big = simulate(build_schedule("zb-v", p, 64), placement=_v(p))
    assert max(big.bubble) == pytest.approx((p - 1) / (6 * 64)) and max(big.bubble) < 0.04


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_never_worse_than_zb_h1_and_memory_of_1f1b(p):
    """Peak in-flight activations per rank, in half-stage chunks: the busiest rank holds 1F1B's
    peak of min(p, m) whole stages (F started, B not done), and no rank holds more counting
    them until their W (ZB-H1's measure: the weight-gradient GEMMs keep their inputs)."""
    for m in range(p, 3 * p + 1):
        res = simulate(build_schedule("zb-v", p, m), placement=_v(p))
        one_f_one_b = simulate(build_schedule("1f1b", p, m)).peak_in_flight[0]
        assert max(res.peak_in_flight) == 2 * one_f_one_b == 2 * p, m
        for tl in res.timelines:
            marks = sorted([(s, 1) for s, _, a in tl if a.kind == "F"] + [(e, -1) for _, e, a in tl if a.kind == "W"])
            assert max(sum(d for _, d in marks[: i + 1]) for i in range(len(marks))) <= 2 * p
        assert res.makespan <= simulate(build_schedule("zb-h1", p, m), costs=(2, 2, 2)).makespan


@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1.2, 0.8), (2, 1, 1), (1, 1, 0.5), (1, 2, 1)])
def test_other_costs_replay_without_deadlock(costs):
    """The lists are fixed (made at unit costs). Near F = B = W they beat 1F1B and ZB-H1 with
    comm costs too; with B = 2F (a backward much heavier than W) ZB-H1 wins: the greedy's order
    assumed B's would come back sooner."""
    p, m = 4, 16
    res = simulate(build_schedule("zb-v", p, m), costs=costs, comm_cost=0.1, placement=_v(p))
    whole = tuple(2 * c for c in costs)  # a whole stage is two chunks
    assert res.busy == pytest.approx([2 * m * sum(costs)] * p)
    if costs[1] <= 1.2 * costs[0]:
        for other in ("1f1b", "zb-h1"):
            assert res.makespan < simulate(build_schedule(other, p, m), costs=whole, comm_cost=0.1).makespan, other


@pytest.mark.parametrize("args,match", [
    (("zb-v", 1, 4, 1), r"'zb-v' needs pipeline_model_parallel_size >= 2 \(got 1\)"),
    (("zb-v", 4, 8, 3), r"'zb-v' runs exactly two model chunks per rank \(got virtual pipeline size 3\)"),
    (("zb-v", 4, 3, 2), r"'zb-v' needs at least 4 micro-batches with 4 pipeline ranks \(got 3\)"),
    (("dualpipe-v", 4, 6, 2), r"'dualpipe-v' needs at least 7 micro-batches with 4 pipeline ranks \(got 6\)"),
    (("dualpipe-v", 1, 6, 2), r"'dualpipe-v' needs pipeline_model_parallel_size >= 2"),
])
def test_validation_errors(args, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_schedule_args(*args)
    assert "\n" not in str(err.value)
    validate_schedule_args("zb-v", 4, 4, None, num_layers=10)  # vpp implied; 10 layers over 8 stages: the partition


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipe_v_lists_bubble_and_memory(p):
    """DualPipe-V with its F/B pairs serialized (backward first): complete and deadlock-free lists
    for m >= 2p - 1, the same least makespan 6m + p - 1 as zb-v at F = B = W, and at most 2p
    chunk activations per rank (1F1B's p whole stages; DeepSeek's table gives one more for
    overlapped pairs, whose forward allocates before their backward frees)."""
    for m in range(2 * p - 1, 3 * p + 1):
        lists = build_schedule("dualpipe-v", p, m)
        check_schedule(lists, _v(p))
        kinds = [a.kind for lst in lists for a in lst]
        assert kinds.count("F") == 2 * p * m and kinds.count("B") == kinds.count("W") > 0 and "BW" in kinds
        res = simulate(lists, placement=_v(p))
        assert res.makespan == 6 * m + p - 1 and max(res.peak_in_flight) == 2 * p, m


def test_uneven_ends_under_the_v_placement():
    """Under V the first and last virtual stages both sit on rank 0: --decoder-first/last-pipeline-
    num-layers size those two stages; under the loop placement they size ranks (Megatron's rule)."""
    from megatron_lite.parallel.pipeline.partition import LayerSplit, stage_layer_ranges
    assert stage_layer_ranges(6, 2, 2, LayerSplit(1, 1), "V") == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert _v(2).rank_chunks(0, 6, LayerSplit(1, 1)) == [((0, 1), True, False), ((5, 6), False, True)]
    with pytest.raises(ConfigError, match="remaining pipeline stages"):
        stage_layer_ranges(6, 2, 2, LayerSplit(1, 1), "loop")  # rank 0 holds 1, rank 1 holds 1: 4 left over


# ---------------------------------------------------------------- whole training runs
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--device", "cpu",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "3e-3", "--eval-iters", "0"]
ZBV = ["--pipeline-schedule", "zb-v"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
def _assert_like_single_process(base, world, extra, trace=False, keep=lambda name: True, schedule="zb-v"):
    """Losses (1e-5), grad norms (1e-6) and the final parameters whose names `keep` accepts."""
    ref, ref_params = single_process_reference(base)
    results = run_distributed(train_and_gather, world, base + ["--pipeline-schedule", schedule] + extra, trace)
    params = {k: v for k, v in merged_params(results).items() if keep(k)}
    assert_same_run(ref, records_of([r[0] for r in results]), rtol=1e-5, grad_norm_rtol=1e-6, params=params,
                    ref_params={k: v for k, v in ref_params.items() if keep(k)}, what=" ".join(extra))
    return results


def test_gpt2_tied_pp2_matches_single_process_in_schedule_order():
    """GPT-2's tied embedding: under V the embedding (chunk 0) and the output layer's copy
    (chunk 1) are both on rank 0, their gradients summed there. Each rank runs exactly its
    list, every step (so the p2p order is the one the simulator checked), under a 15 s
    collective timeout that any rank waiting on a mismatched collective would hit."""
    results = _assert_like_single_process(BASE, 2, ["--pipeline-model-parallel-size", "2",
                                                     "--distributed-timeout-minutes", "0.25"], trace=True)
    for _, _, trace, pp_rank in results:
        assert trace == build_schedule("zb-v", 2, 4)[pp_rank] * 3


def test_dualpipe_v_gpt2_tied_pp2_matches_single_process_in_schedule_order():
    results = _assert_like_single_process(BASE, 2, ["--pipeline-model-parallel-size", "2"], trace=True,
                                          schedule="dualpipe-v")
    for _, _, trace, pp_rank in results:
        assert trace == build_schedule("dualpipe-v", 2, 4)[pp_rank] * 3


LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8"]),
    "pp4-dp2": (8, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--global-batch-size", "8"]),
    "pp2-uneven": (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                       "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]),
    "pp2-dp2-zero1": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--global-batch-size", "8"]),
    "pp2-cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "pp2-dp2-zero2-overlap": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "2", "--overlap-grad-reduce",
                                  "--global-batch-size", "8"]),  # the tied buckets wait for the local sum
    # ZeRO-3 gathers each chunk's units on their own (root + layers per chunk): rank 0's two ends too
    "pp2-dp2-zero3": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--global-batch-size", "8"]),
    "pp2-dp2-zero3-keep": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--no-reshard-after-forward",
                               "--global-batch-size", "8"]),
    # the layout's stages in virtual-stage order: under V stage 1 is rank 1's chunk 0, stage 2 its chunk 1
    "pp2-layout": (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                       "--pipeline-model-parallel-layout", "Et|ttt|tt|L"]),
}
RECOMPUTE = {"none": [], "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"], "selective": ["--recompute-granularity", "selective"]}


def _base(family, layout_extra):
    base = BASE + (LLAMA_SWITCHES if family == "llama" else [])
    for flag in ("--num-layers", "--global-batch-size"):  # the reference runs the same model and batch
        if flag in layout_extra:
            i = layout_extra.index(flag)
            base = base + layout_extra[i:i + 2]
    return base


# Every layout without recomputation; recomputation (full, selective) with the plain pipelines.
CASES = [(family, layout, "none") for family in ("gpt2", "llama") for layout in LAYOUTS] + [
    (family, layout, r) for family in ("gpt2", "llama") for layout in ("pp2", "pp4") for r in ("full", "selective")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,family,layout", [("zb-v", "gpt2", "pp2-dp2-zero3"),
                                                     ("dualpipe-v", "llama", "pp2-layout")])
def test_zero3_and_layout_under_v(schedule, family, layout):
    """ZeRO-3 (tied GPT-2: both embedding copies sharded and gathered on rank 0) and a
    --pipeline-model-parallel-layout placed on the V; more cells in the matrices below."""
    world, extra = LAYOUTS[layout]
    _assert_like_single_process(_base(family, extra), world, extra, schedule=schedule)


@pytest.mark.slow
@pytest.mark.parametrize("family,layout,recompute", CASES)
def test_zb_v_layouts_match_single_process(family, layout, recompute):
    world, extra = LAYOUTS[layout]
    _assert_like_single_process(_base(family, extra), world, extra + RECOMPUTE[recompute])


DUALPIPE_LAYOUTS = {**LAYOUTS, "pp4-m8": (4, LAYOUTS["pp4"][1] + ["--global-batch-size", "8"])}  # m >= 2p - 1


@pytest.mark.slow
@pytest.mark.parametrize("family,layout,recompute", [("llama", "pp2", "none"), ("gpt2", "pp4-m8", "none"),
                                                     ("llama", "pp4-m8", "selective"), ("gpt2", "pp2", "full"),
                                                     ("llama", "pp2-dp2-zero1", "none"), ("gpt2", "pp2-cp2", "none"),
                                                     ("gpt2", "pp2-dp2-zero3", "none"),
                                                     ("llama", "pp2-dp2-zero3-keep", "full"),
                                                     ("gpt2", "pp2-layout", "selective")])
def test_dualpipe_v_layouts_match_single_process(family, layout, recompute):
    world, extra = DUALPIPE_LAYOUTS[layout]
    _assert_like_single_process(_base(family, extra), world, extra + RECOMPUTE[recompute], schedule="dualpipe-v")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_zb_v_with_experts_at_ep2_defers_their_weight_gradients(family):
    """MoE at PP2 x EP2, zb-v and dualpipe-v: the experts' weight GEMMs queue in B and run in W through the GemmPath.
    The final weights compared are the dense ones (each EP rank holds half the experts, which
    the harness does not gather); the experts' show in the losses and grad norms."""
    extra = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--global-batch-size", "8"]
    for schedule in ("zb-v", "dualpipe-v"):
        _assert_like_single_process(_base(family, extra) + MOE, 4, extra, keep=lambda name: ".experts." not in name,
                                    schedule=schedule)


def test_cli_compares_every_schedule_and_draws_each(tmp_path):
    out = subprocess.run([sys.executable, "tools/pipeline_schedule.py", "--pp", "2", "--microbatches", "4",
                          "--schedule", "all", "--png", str(tmp_path / "t.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("\n\n")[0]
    assert "zb-v           2       12.5      0.0417  2" in table  # 6m + p - 1 at half-stage chunk costs
    assert "dualpipe-v     2       12.5      0.0417  2" in table
    assert "1f1b           1         15      0.2500  2" in table
    assert "(p-1)/(6m) = 0.0417" in out.stdout and "F3.1" in out.stdout
    pytest.importorskip("matplotlib")
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"):
        assert (tmp_path / f"t-{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoint_of_zb_v_loads_at_pp1_and_back(tmp_path):
    """GPT-2 (tied): a zb-v PP2 checkpoint (both embedding copies on rank 0) resumes on one
    process, and a one-process checkpoint resumes under zb-v, each continuing the straight run."""
    argv = BASE + ["--train-iters", "6"]
    ref = single_process_reference(argv)[0]
    pp2 = ["--pipeline-model-parallel-size", "2"] + ZBV
    for saver, world_s, loader, world_l, name in ((pp2, 2, [], 1, "v"), ([], 1, pp2, 2, "one")):
        ckpt = str(tmp_path / name)
        first = losses_of(run_distributed(train_in_process, world_s, argv + saver + ["--save", ckpt,
                                                                                  "--exit-interval", "3"]))
        second = losses_of(run_distributed(train_in_process, world_l, argv + loader + ["--load", ckpt]))
        assert_same_run([{"lm_loss": r["lm_loss"]} for r in ref], [{"lm_loss": x} for x in first + second],
                        rtol=1e-5, what=name)
