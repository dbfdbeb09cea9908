"""The planner prices compressed data-parallel communication (planning/dp_traffic.py): its bytes per
step per collective kind are the bytes the trainer counts with --log-comm-volume (forked gloo
ranks, the second step; a default cell for qgZ + qwZ, a slow matrix for the other schemes), and
the bytes the codecs produce when they really encode the planner's buckets; and where DP
communication is exposed the step time falls by the bytes saved on each link at its bandwidth."""
import os
from unittest import mock

import pytest
import torch

from megatron_lite.parallel.compression import ErrorFeedbackExchange
from megatron_lite.parallel.compression import codec as make_codec
from megatron_lite.planning.dp_traffic import dp_bytes_per_step, encoded_bytes
from megatron_lite.planning.hardware import GPUS
from megatron_lite.planning.layout import from_config
from megatron_lite.planning.state import rank_bucket_params, rank_buckets
from megatron_lite.planning.timing import step_time
from megatron_lite.testing import run_distributed
from tests.planner_harness import GBS8, MODEL_A, MODEL_B, measure_layouts

ZERO3 = ["--zero-stage", "3"] + GBS8
QGZ, QWZ = ["--zeropp-quantized-gradients"], ["--zeropp-quantized-weights"]
# (name, world size, flags): every scheme the planner prices
SCHEMES = [
    ("A  DP2 ZeRO-3 qgZ + qwZ, 2 micro-batches", 2, MODEL_A + ZERO3 + QGZ + QWZ),
    ("A  DP2 ZeRO-0 grads as bf16", 2, MODEL_A + ["--zero-stage", "0", "--grad-comm-dtype", "bf16"]),
    ("B  DP2 ZeRO-1 grads as fp8-e4m3", 2, MODEL_B + ["--zero-stage", "1", "--grad-comm-dtype", "fp8-e4m3"]),
    ("A  DP2 adam-1bit after its freeze", 2, MODEL_A + ["--optimizer", "adam-1bit", "--freeze-step", "1"]),
    ("A  DP2 adam-01 after its variance freeze", 2, MODEL_A + ["--optimizer", "adam-01", "--var-freeze-step", "1"]),
    ("B  DP4 ZeRO-3 two-hop qgZ + qwZ + hpZ2", 4, MODEL_B + ZERO3 + QGZ + QWZ + ["--zeropp-hpz-partition-size", "2"]),
]
# (planner only: the trainer's count mixes the MoE dispatcher's all-to-alls with the gradients')
MOE_FP8 = ("B  DP4 MoE EP2 ZeRO-2 grads as fp8-e5m2, 2 micro-batches", 4, MODEL_B + [
    "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--zero-stage", "2",
    "--grad-comm-dtype", "fp8-e5m2", "--global-batch-size", "16"])
# Kinds DP communication uses besides the all-reduce (which the loss and norms' scalars share).
DP_KINDS = ("reduce_scatter", "all_gather", "all_gather_hpz", "all_to_all", "all_to_all_intra_node",
            "all_to_all_inter_node")
SCALARS = 1024  # bytes of a step's scalar all-reduces (loss, token count, gradient norm) at most


def planned(argv, world, local_world_size=None):
    """(the planner's DP bytes of a step on pipeline rank 0 in nodes of `local_world_size`, the
    layout, the model config, its inventory), from the config pretrain_gpt.py resolves on `world`
    ranks (e.g. its positions for the sequence)."""
    from models.gpt_inventory import GPTInventory
    from pretrain_gpt import resolve
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world)}):
        cfg = resolve(argv)[0]
    lay = from_config(cfg, world)
    inventory = GPTInventory(cfg.model, lay.params_dtype).chunk
    return dp_bytes_per_step(cfg.model.num_layers, lay, 0, inventory, local_world_size), lay, cfg.model, inventory


def _check_against_trainer(schemes):
    for world in sorted({w for _, w, _ in schemes}):
        chosen = [(name, argv) for name, w, argv in schemes if w == world]
        per_rank = run_distributed(measure_layouts, world, [argv for _, argv in chosen], timeout=300)
        for i, (name, argv) in enumerate(chosen):
            want = planned(argv, world)[0]
            for rank_results in per_rank:
                got = rank_results[i]["comm"]
                assert {k: got[k] for k in DP_KINDS if k in got} == {k: want[k] for k in DP_KINDS if k in want}, \
                    (name, got, want)
                assert 0 <= got.get("all_reduce", 0) - want.get("all_reduce", 0) < SCALARS, (name, got, want)
                assert set(want) - {"all_reduce"}, name  # (the scheme moved something through a DP kind)


def test_planned_dp_bytes_are_what_the_trainer_counts_for_qgz_and_qwz():
    _check_against_trainer(SCHEMES[:1])


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES[1:], ids=[s[0] for s in SCHEMES[1:]])
def test_planned_dp_bytes_are_what_the_trainer_counts(scheme):
    _check_against_trainer([scheme])


def _encoded(fmt, numel, ranks, rows=None):
    """Bytes the codec really produces for a tensor of `numel` cut in `ranks` rows (the first `rows`)."""
    rows_of = ErrorFeedbackExchange(None, fmt, error_feedback=False).to_rows(torch.zeros(numel), ranks)
    return make_codec(fmt).encode(rows_of[:rows])[0].numel()


def _encoded_signs(sizes, numel, ranks):
    """Bytes the sign codec really produces for a bucket of tensors of `sizes`: a scale per tensor
    and row, as 1-bit / 0/1 Adam send it (OneBitAdam.compressed_sum_)."""
    ex = ErrorFeedbackExchange(None, "sign", error_feedback=False)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    ex.scale_per_tensor(0, list(zip([0] + ends[:-1], ends)), numel, ranks)
    return make_codec("sign").encode(ex.to_rows(torch.zeros(numel), ranks), ex.runs[0])[0].numel()


def test_planned_dp_bytes_are_the_codecs_encodings_of_the_buckets():
    """For every scheme, the planner's bytes are those of the buckets' rows encoded by the codec
    (scales and block padding included): signs both ways for 1-bit / 0/1 Adam, bf16 rows both ways at
    ZeRO 0, fp8 rows one way at ZeRO 1-2 beside the param gather (MoE: the expert buckets' rows over
    their expert-data-parallel pairs, every micro-batch at ZeRO-2), and at DP4 with hpZ2 two int4
    hops (4 rows inside the node, 2 across), int8 forward gathers and exact backward ones in pairs."""
    for name, world, argv in SCHEMES + [MOE_FP8]:
        got, lay, model, inventory = planned(argv, world)
        buckets = rank_buckets(model.num_layers, lay, 0, inventory)
        n, m = lay.dp, lay.num_microbatches
        a = torch.empty((), dtype=lay.params_dtype).element_size()

        def each(fmt, rows=None):
            return sum(_encoded(fmt, b.numel, lay.edp if b.expert else n, rows) for b in buckets)
        params = sum(b.numel for b in buckets) * a
        if lay.optimizer != "adam":
            signs = sum(_encoded_signs([p.numel for p in params], b.numel, n)
                        for b, params in rank_bucket_params(model.num_layers, lay, 0, inventory))
            want = {"all_to_all": signs, "all_gather": signs}
        elif lay.zero_stage == 0:
            want = {"all_to_all": each("bf16"), "all_gather": each("bf16")}
        elif lay.zero_stage in (1, 2):
            rounds = m if lay.zero_stage == 2 else 1
            want = {"all_to_all": rounds * each(lay.grad_comm_dtype), "all_gather": params}
        elif n == 2:
            want = {"all_to_all": m * each("int4-blocks"), "all_gather": 2 * m * each("int8-blocks")}
        else:
            want = {"all_to_all_intra_node": m * each("int4-blocks"), "all_to_all_inter_node": m * each("int4-blocks", 2),
                    "all_gather": m * each("int8-blocks"), "all_gather_hpz": m * params}
        assert got == want, (name, got, want)
    # per element, at whole blocks: the values' bits and one fp32 scale a block (fp8: a row; signs: a row)
    for fmt, per_element in (("int4-blocks", 0.5 + 4 / 256), ("int8-blocks", 1 + 4 / 256), ("bf16", 2),
                             ("fp8-e5m2", 1 + 4 / 1024), ("sign", 1 / 8 + 4 / 1024)):
        assert encoded_bytes(fmt, 4 * 1024, 4) / (4 * 1024) == per_element, fmt


def _plain_and(argv, world, flags, hw):
    """The planner's step times without and with `flags`, and the layout without."""
    _, lay, model, inventory = planned(argv, world)
    comp = planned(argv + flags, world)[1]
    return step_time(model, lay, hw, inventory), step_time(model, comp, hw, inventory), lay


def test_where_dp_comm_is_exposed_compression_saves_its_bytes_at_the_links_rate():
    """ZeRO-1 DP8 in one node, nothing overlapped: bf16 gradients shorten the step by the
    reduce-scatter's bytes saved, (N - 1) / N of them at NVLink's rate. ZeRO-3 DP16 over two nodes
    of 8 on a slow network (its collectives far longer than compute, NVLink free): two-hop qgZ
    turns the ring reduce-scatter over 8 NICs into an int4 hop inside the node (free) and one across
    it, half of its 2 rows on this GPU's NIC, every micro-batch."""
    hw = GPUS["H100"]
    argv = MODEL_B + ["--zero-stage", "1", "--global-batch-size", "16"]
    plain, bf16, _ = _plain_and(argv, 8, ["--grad-comm-dtype", "bf16"], hw)
    saved = planned(argv, 8)[0]["reduce_scatter"] - planned(argv + ["--grad-comm-dtype", "bf16"], 8)[0]["all_to_all"]
    assert saved > 0 and bf16.compute_s == plain.compute_s
    assert plain.total_s - bf16.total_s == pytest.approx(7 / 8 * saved / (hw.nvlink_gbps * 1e9), rel=1e-9)

    slow = hw.with_(nvlink_gbps=1e9, network_gbps=0.01)
    argv = MODEL_B + ["--zero-stage", "3", "--global-batch-size", "64"]
    plain, qgz, lay = _plain_and(argv, 16, QGZ, slow)
    m = lay.num_microbatches
    ring = planned(argv, 16)[0]["reduce_scatter"] / m * 15 / 16 / (8 * slow.network_gbps * 1e9)
    hop = planned(argv + QGZ, 16, 8)[0]["all_to_all_inter_node"] / m / 2 / (slow.network_gbps * 1e9)
    assert qgz.dp_s < plain.dp_s and qgz.compute_s == plain.compute_s
    assert plain.total_s - qgz.total_s == pytest.approx(m * (ring - hop), rel=1e-6)
