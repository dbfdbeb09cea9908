"""ZeRO-Infinity parameter offload (--param-offload-nvme-path, ZeRO-3): bitwise the in-memory ZeRO-3
run (losses, grad norms, final params) at DP2 and TP2 x DP2, alone and with the optimizer's NVMe
offload; no param shard is held in memory (the staging buffers are, as the accounting says); bytes
read and written per step = each unit's span read once per gather (two gathers a micro-batch) and
every shard written once by the step; checkpoints save from and load into the file and move
between NVMe and in-memory runs; a full directory and the refused combinations are one line."""
import os
import types

import pytest
import torch

import megatron_lite.parallel.nvme_file as nvme_file
from megatron_lite.config import ParallelConfig, TrainingConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.bucket_plan import param_region_bytes, param_spans
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import run_distributed
from tests.test_nvme_offload import build_model_for
from tests.test_zero import LR, MODEL, full_params, make_batches, run_step
from training_utils import TINY, assert_one_line_error, losses_of, train_in_process

STEPS = 3
MICRO_BATCHES = 4  # test_zero's global batch of 8 over DP2, one sample a micro-batch


def _run(tp, param_dir, optimizer_dir, bf16, reshard=True):
    dims = ParallelDims.from_world(tp=tp)
    chunks = build_model_for(dims, torch.bfloat16 if bf16 else torch.float32)
    tcfg = TrainingConfig(lr=LR, clip_grad=1.0, bf16=bf16, param_offload_nvme_path=param_dir,
                          optimizer_offload_nvme_path=optimizer_dir)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, ParallelConfig(tensor_model_parallel_size=tp, zero_stage=3,
                                                                      reshard_after_forward=reshard))
    spill = sync.param_home if sync.param_home.nvme else None
    records, io, resident = [], [], []
    for step in range(STEPS):
        out = run_step(chunks, make_batches(step, dims, 1, MODEL["vocab_size"]), dims, optimizer, sync)
        records.append((out["lm_loss"], out["grad_norm"]))
        if spill is not None:
            spill.drain()
            io.append((spill.file.bytes_read, spill.file.bytes_written))
            # what holds parameter values between steps: the params' own storage and the shards
            resident.append(sum(p.untyped_storage().nbytes() for c in chunks for p in c.parameters())
                            + sum(b.param_shard.nbytes for b in sync.buckets if b.param_shard is not None))
    expected = None
    if spill is not None:
        f = spill.file_bytes
        assert f == sum(param_region_bytes(b) for b in sync.plans) == os.path.getsize(spill.path)
        largest = max(sum(param_region_bytes(sync.plans[j]) for j in span) for span in param_spans(sync.plans))
        assert spill.staging_bytes == 2 * largest
        # start-up: every shard written once, read once by the optimizer (its main params); then per
        # step two gathers of every unit a micro-batch (--no-reshard-after-forward: one a step), and
        # the update's write-back
        gathers = 2 * MICRO_BATCHES if reshard else 1
        expected = [(f + (k + 1) * gathers * f, f + (k + 1) * f) for k in range(STEPS)]
    out = records, full_params(chunks, sync, dims), optimizer.memory_bytes(), optimizer.held_bytes(), io, \
        expected, resident
    if spill is not None:  # (GradientSync lives as long as its autograd hooks: the file goes at exit, or here)
        spill.close()
    return out


def _both(rank, world, tp, param_dir, optimizer_dir, bf16, reshard):
    return _run(tp, None, None, bf16, reshard), _run(tp, param_dir, optimizer_dir, bf16, reshard)


def _check(tmp_path, world, tp, bf16=False, optimizer_nvme=False, reshard=True):
    param_dir = str(tmp_path / "params")
    ref, got = run_distributed(_both, world, tp, param_dir, param_dir if optimizer_nvme else None, bf16, reshard)[0]
    what = f"tp{tp} dp{world // tp} param nvme{' + optimizer nvme' if optimizer_nvme else ''}"
    assert got[0] == ref[0], f"{what}: losses / grad norms {got[0]} != {ref[0]}"  # bitwise
    for name in ref[1]:
        assert torch.equal(got[1][name], ref[1][name]), f"{what}: {name} differs"
    mem, held, io, expected, resident = got[2:]
    assert mem == held, f"{what}: accounting {mem} vs measured {held}"
    assert mem["param_bytes"] == 0 and mem["param_staging_bytes"] > 0 and ref[2]["param_bytes"] > 0
    assert resident == [0] * STEPS, f"{what}: parameter storage held between steps {resident}"
    assert io == expected, f"{what}: bytes (read, written) per step {io} != {expected}"
    assert not os.listdir(tmp_path / "params"), "the files outlive their runs"


def test_param_offload_is_bitwise_in_memory_zero3(tmp_path):
    _check(tmp_path, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp,world,bf16,optimizer_nvme", [(2, 4, True, False), (1, 2, False, True),
                                                          (2, 4, False, True), (1, 2, True, False)])
def test_param_offload_is_bitwise_in_memory_zero3_more_layouts(tmp_path, tp, world, bf16, optimizer_nvme):
    _check(tmp_path, world, tp, bf16, optimizer_nvme)


@pytest.mark.slow
def test_param_offload_without_reshard_after_forward(tmp_path):
    _check(tmp_path, 2, 1, reshard=False)


Z3 = TINY + ["--zero-stage", "3"]


def test_checkpoints_save_from_and_load_into_the_param_file(tmp_path):
    nvme, ckpt = ["--param-offload-nvme-path", str(tmp_path / "nvme")], str(tmp_path / "ckpt")

    def run(extra):
        return losses_of(run_distributed(train_in_process, 2, Z3 + extra))

    straight = run([])
    assert run(nvme + ["--save", ckpt, "--exit-interval", "3"]) == straight[:3]
    assert run(nvme + ["--load", ckpt]) == straight[3:]  # resumed from the file's shards
    assert run(["--load", ckpt]) == straight[3:]  # an NVMe run's checkpoint into memory
    plain = str(tmp_path / "plain")
    run(["--save", plain, "--exit-interval", "3"])
    assert run(nvme + ["--load", plain]) == straight[3:]  # and an in-memory run's into the file


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--pipeline-model-parallel-size", "2", "--no-reshard-after-forward"], ["--mtp-num-layers", "1"],
    ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ["--untie-embeddings-and-output-weights", "--bf16"]])
def test_param_offload_combinations_are_the_in_memory_run(tmp_path, extra):
    """Pipeline stages, MTP, experts (a unit's dense and expert buckets: one span), recomputation
    (gathers inside backward), untied output layer: losses bitwise those of in-memory ZeRO-3."""
    plain = losses_of(run_distributed(train_in_process, 2, Z3 + extra))
    nvme = ["--param-offload-nvme-path", str(tmp_path)]
    assert losses_of(run_distributed(train_in_process, 2, Z3 + nvme + extra)) == plain


def test_a_full_directory_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_file.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=4096))
    dims = ParallelDims.from_world()
    tcfg = TrainingConfig(lr=LR, param_offload_nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"--param-offload-nvme-path .* has 0.0 MiB free but this rank's parameter "
                                          r"shards needs .* MiB there"):
        build_optimizer(build_model_for(dims), dims, tcfg, ParallelConfig(zero_stage=3))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("flags,fragment", [
    (["--param-offload-nvme-path", "/proc/version/x", "--zero-stage", "3"], "/proc/version is not a directory"),
    (["--param-offload-nvme-path", "", "--zero-stage", "3"], "--param-offload-nvme-path is empty"),
    (["--param-offload-nvme-path", "/tmp", "--zero-stage", "2"], "add --zero-stage 3"),
    (["--param-offload-nvme-path", "/tmp", "--zero-stage", "3", "--zeropp-quantized-weights"],
     "with --zeropp-quantized-weights is not implemented"),
    (["--param-offload-nvme-path", "/tmp", "--zero-stage", "3", "--qk-clip"], None),
])
def test_refused_param_offload_flags_are_one_line(flags, fragment, monkeypatch, capsys):
    assert_one_line_error(TINY + flags, fragment or "--param-offload-nvme-path", monkeypatch, capsys)


def test_hpz_with_param_offload_is_refused():
    from megatron_lite.config import Config
    from megatron_lite.feature_checks import validate_param_offload
    from megatron_lite.model_config import ModelConfig
    cfg = Config(model=ModelConfig(**MODEL), parallel=ParallelConfig(zero_stage=3, zeropp_hpz_partition_size=2),
                 training=TrainingConfig(lr=LR, param_offload_nvme_path="/tmp"))
    with pytest.raises(ConfigError, match="--param-offload-nvme-path with --zeropp-hpz-partition-size is not "
                                          "implemented"):
        validate_param_offload(cfg)


def test_virtual_pipeline_chunks_without_params_of_their_own_are_the_in_memory_run(tmp_path):
    """PP2 x VPP2 over 4 layers: the middle chunks own no parameters outside their layers (no span
    in the file), which once crashed at start-up; losses bitwise those of in-memory ZeRO-3."""
    argv = [a if a != "2" or TINY[i - 1] != "--num-layers" else "4" for i, a in enumerate(TINY)]
    argv += ["--zero-stage", "3", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
             "1", "--train-iters", "3"]
    plain = losses_of(run_distributed(train_in_process, 2, argv))
    nvme = ["--param-offload-nvme-path", str(tmp_path)]
    assert losses_of(run_distributed(train_in_process, 2, argv + nvme)) == plain


def _memory_with_host_optimizer(rank, world, directory):
    dims = ParallelDims.from_world(tp=1)
    chunks = build_model_for(dims, torch.float32)
    tcfg = TrainingConfig(lr=LR, clip_grad=1.0, param_offload_nvme_path=directory, optimizer_cpu_offload=True)
    opt, sync = build_optimizer(chunks, dims, tcfg, ParallelConfig(zero_stage=3))
    run_step(chunks, make_batches(0, dims, 1, MODEL["vocab_size"]), dims, opt, sync)
    out = opt.memory_bytes(), opt.held_bytes()
    sync.param_home.close()
    return out


def test_with_the_optimizer_on_the_host_the_fp32_main_params_are_counted_there_only(tmp_path):
    """fp32 params in the file and --optimizer-cpu-offload: the main params are the host's copy
    (optimizer_host_bytes), not a second device copy: the memory line equals what is held."""
    accounted, held = run_distributed(_memory_with_host_optimizer, 2, str(tmp_path), timeout=240)[0]
    assert accounted["optimizer_host_bytes"] > 0
    for key in ("optimizer_state_bytes", "optimizer_host_bytes", "param_bytes", "param_staging_bytes"):
        assert accounted.get(key) == held.get(key), (key, accounted.get(key), held.get(key))


def test_a_checkpoint_of_the_param_file_loads_at_another_dp_size(tmp_path):
    """Saved from the file at DP2, loaded at DP4 (micro-batches of 1, the same global batch): into
    the file, the losses are bitwise those of loading the same checkpoint into memory at DP4."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_in_process, 2, Z3 + ["--param-offload-nvme-path", str(tmp_path / "a"), "--save", ckpt,
                                                "--exit-interval", "3"])
    dp4 = Z3 + ["--micro-batch-size", "1", "--load", ckpt]
    in_memory = losses_of(run_distributed(train_in_process, 4, dp4))
    assert len(in_memory) == 2
    assert losses_of(run_distributed(train_in_process, 4, dp4 + ["--param-offload-nvme-path", str(tmp_path / "b")])) \
        == in_memory
