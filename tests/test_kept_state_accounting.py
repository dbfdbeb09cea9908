"""What compression, ZeRO++ and 1-bit Adam keep on a rank, three ways equal: the tensors the running
reducer / optimizer / ZeRO-3 gatherer really hold after two steps (error feedback: every worker and
server error; hpZ: the most secondary partitions held at once), the trainer's accounting
(DistributedOptimizer.memory_bytes(), the start-up "> memory on this rank:" line) and the
planner's figure for the same flags. And the planner's NVMe offload step time: the file's I/O at
the disk's rate where it exceeds the compute, nothing where it does not."""
import pytest

from megatron_lite.testing import run_distributed
from tests.planner_harness import GBS8, MODEL_A, MODEL_B, measure_layouts, predict

# (name, world size, flags, the keys the feature must add)
FEEDBACK, HPZ = "error_feedback_bytes", "hpz_secondary_bytes"
ZERO3_PLUS = ("A  DP2 ZeRO-3 qgZ + qwZ + hpZ2, 2 micro-batches", 2, MODEL_A + [
    "--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-qgz-error-feedback", "--zeropp-quantized-weights",
    "--zeropp-hpz-partition-size", "2"] + GBS8, (FEEDBACK, HPZ))
QGZ_NO_EF = ("A  DP2 ZeRO-3 qgZ without error feedback + hpZ2 keeps no error", 2, MODEL_A + [
    "--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-hpz-partition-size", "2"] + GBS8, (HPZ,))
CELLS = [
    ("A  DP2 ZeRO-0 grads as bf16 (worker + server errors)", 2, MODEL_A + ["--zero-stage", "0", "--grad-comm-dtype",
                                                                           "bf16"], (FEEDBACK,)),
    ("B  DP2 ZeRO-1 grads as fp8-e4m3", 2, MODEL_B + ["--zero-stage", "1", "--grad-comm-dtype", "fp8-e4m3"],
     (FEEDBACK,)),
    ("A  DP2 adam-1bit after its freeze", 2, MODEL_A + ["--optimizer", "adam-1bit", "--freeze-step", "1"],
     (FEEDBACK,)),
    ("A  DP2 ZeRO-3 qwZ alone keeps nothing", 2, MODEL_A + ["--zero-stage", "3", "--zeropp-quantized-weights"], ()),
    ("B  DP4 ZeRO-3 qgZ with error feedback + hpZ2", 4, MODEL_B + ["--zero-stage", "3", "--zeropp-quantized-gradients",
                                                                   "--zeropp-qgz-error-feedback",
                                               "--zeropp-hpz-partition-size", "2"] + GBS8, (FEEDBACK, HPZ)),
    ("B  DP4 ZeRO-3 two-hop qgZ without error feedback", 4, MODEL_B + [
        "--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-hpz-partition-size", "2"] + GBS8, (HPZ,)),
    ("B  DP4 adam-1bit after its freeze, odd vocabulary (padded rows)", 4, MODEL_B + [
        "--vocab-size", "999", "--optimizer", "adam-1bit", "--freeze-step", "1"], (FEEDBACK,)),
    ("B  DP4 MoE EP2 ZeRO-2 grads as fp8-e5m2 (expert buckets over EDP2)", 4, MODEL_B + [
        "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--zero-stage", "2",
        "--grad-comm-dtype", "fp8-e5m2"], (FEEDBACK,)),
]


def _check(cells):
    for world in sorted({c[1] for c in cells}):
        chosen = [c for c in cells if c[1] == world]
        per_rank = run_distributed(measure_layouts, world, [argv for _, _, argv, _ in chosen], timeout=300)
        for i, (name, _, argv, keys) in enumerate(chosen):
            for rank_results in per_rank:
                got = rank_results[i]
                planned = predict(argv, world, got["pp_rank"], got["tp_rank"])["accounted"]
                where = f"{name}, rank pp{got['pp_rank']} tp{got['tp_rank']}"
                assert got["held"] == got["accounted"] == planned, (where, got["held"], got["accounted"], planned)
                assert all(got["held"].get(k, 0) > 0 for k in keys), (where, keys, got["held"])
                assert not {FEEDBACK, HPZ} - set(keys) & set(got["held"]), (where, "a key it should not add")


def test_compression_and_zeropp_state_is_counted_as_held():
    _check([ZERO3_PLUS, QGZ_NO_EF])


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[c[0] for c in CELLS])
def test_every_kept_feature_is_counted_as_held(cell):
    _check([cell])


def test_nvme_step_time_is_the_optimizer_phase_io_as_nvme_store_runs_it():
    """Llama-3 8B at TP8 ZeRO-1, optimizer on NVMe. The I/O of a step (every region read and written
    once, the bytes test_nvme_offload measures) waits for the gradients: on a disk far slower than
    the host update the step grows by that I/O less the last write-back (behind the next step's
    compute) and less the update it runs beside; on a disk far faster it grows by the first read only."""
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel.bucket_plan import nvme_bytes_per_step, region_bytes
    from megatron_lite.planning.hardware import GPUS
    from megatron_lite.planning.layout import Layout
    from megatron_lite.planning.state import rank_buckets
    from megatron_lite.planning.timing import step_time
    from models.gpt_inventory import GPTInventory
    from models.zoo import zoo

    m = parse_args(["--model", "llama3-8b", "--bf16"], zoo()).model
    hw, inventory = GPUS["H100"], GPTInventory(m, torch.bfloat16).chunk
    lay = Layout(tp=8, zero_stage=1, sequence_parallel=True, seq_length=8192, global_batch_size=128,
                 optimizer_offload_nvme=True)
    shards = [b.shard_numel for b in rank_buckets(m.num_layers, lay, 0, inventory)]
    io_bytes = nvme_bytes_per_step(shards, 3)
    base = step_time(m, lay, hw, inventory)
    assert base.detail["nvme_io_s"] == pytest.approx(io_bytes / (hw.nvme_gbps * 1e9))

    slow_rate = io_bytes / (3 * base.compute_s)  # the I/O is 3x the compute: far beyond the host update
    slow = step_time(m, lay, hw.with_(nvme_gbps=slow_rate / 1e9), inventory)
    assert slow.detail["nvme_io_s"] == pytest.approx(3 * slow.compute_s)
    last_write = region_bytes(shards[-1], 3) / slow_rate
    assert last_write < slow.compute_s and slow.optimizer_s < slow.detail["nvme_io_s"] - last_write
    assert slow.nvme_s == pytest.approx(slow.detail["nvme_io_s"] - last_write - slow.optimizer_s)

    fast = step_time(m, lay, hw.with_(nvme_gbps=1e6), inventory)  # 1 PB/s: I/O hides behind the update
    assert fast.nvme_s == pytest.approx(region_bytes(shards[0], 3) / 1e15)
    in_memory = step_time(m, lay.with_(optimizer_offload_nvme=False), hw, inventory)
    assert "nvme_io_s" not in in_memory.detail and in_memory.nvme_s == 0.0


def test_plan_takes_the_disk_rate_and_the_nvme_flag():
    from tools.plan import plan_of

    ev, hw = plan_of(["--model", "llama3-8b", "--world-size", "8", "--tensor-model-parallel-size", "8",
                      "--use-distributed-optimizer", "--optimizer-offload-nvme-path", "/nvme", "--nvme-gbps", "1.5"])
    assert hw.nvme_gbps == 1.5 and ev.layout.optimizer_offload_nvme
    assert ev.time.detail["nvme_io_s"] > 0 and ev.ranks[0].state["optimizer_staging_bytes"] > 0


def test_param_nvme_step_time_is_the_gathers_reads_and_the_write_back_beyond_the_compute():
    """--param-offload-nvme-path at ZeRO-3: a step reads every unit's shards at each gather (forward
    and backward of each micro-batch) and writes them once; the planner charges what the compute
    does not hide, and nothing on a disk fast enough."""
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel.bucket_plan import param_region_bytes
    from megatron_lite.planning.hardware import GPUS
    from megatron_lite.planning.layout import Layout
    from megatron_lite.planning.state import rank_buckets
    from megatron_lite.planning.timing import step_time
    from models.gpt_inventory import GPTInventory
    from models.zoo import zoo

    m = parse_args(["--model", "llama3-8b", "--bf16"], zoo()).model
    hw, inventory = GPUS["H100"], GPTInventory(m, torch.bfloat16).chunk
    lay = Layout(dp=8, zero_stage=3, seq_length=4096, global_batch_size=32, param_offload_nvme=True)
    micro = lay.num_microbatches
    file_bytes = sum(param_region_bytes(b) for b in rank_buckets(m.num_layers, lay, 0, inventory))
    base = step_time(m, lay, hw, inventory)
    assert base.detail["param_nvme_io_s"] == pytest.approx((2 * micro + 1) * file_bytes / (hw.nvme_gbps * 1e9))
    slow = step_time(m, lay, hw.with_(nvme_gbps=(2 * micro + 1) * file_bytes / (2 * base.compute_s) / 1e9), inventory)
    assert slow.nvme_s == pytest.approx(slow.compute_s)  # I/O of twice the compute: one compute's worth waits
    fast = step_time(m, lay, hw.with_(nvme_gbps=1e6), inventory)
    assert fast.nvme_s == 0.0 and fast.total_s == pytest.approx(slow.total_s - slow.compute_s)
    once = step_time(m, lay.with_(reshard_after_forward=False), hw, inventory)
    assert once.detail["param_nvme_io_s"] == pytest.approx(2 * file_bytes / (hw.nvme_gbps * 1e9))
