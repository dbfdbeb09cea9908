"""NVMe offload of the optimizer (--optimizer-offload-nvme-path): bitwise the in-memory run (losses,
grad norms, final params) at ZeRO-1/2/3, DP2 and TP2 x DP2; the state really is in the file (no
copy in memory: the staging buffers are what is held, as the planner's accounting says); bytes
read and written per step = the file's regions; checkpoints save from and load into the file
(resume equals the straight run); a kill -9 mid-run leaves the last checkpoint loadable; a full
or unwritable directory is one line."""
import os
import signal
import subprocess

import pytest
import torch

import megatron_lite.parallel.nvme_file as nvme_file
from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.parallel.bucket_plan import nvme_bytes_per_step, region_bytes
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_same_run, run_distributed
from tests.test_zero import LR, MODEL, full_params, make_batches, run_step
from training_utils import ROOT, TINY, assert_one_line_error, losses_of, torchrun_command, train_in_process

STEPS = 3


def _run(tp, stage, nvme_dir, bucket_size, bf16=False):
    dims = ParallelDims.from_world(tp=tp)
    chunks = build_model_for(dims, torch.bfloat16 if bf16 else torch.float32)
    tcfg = TrainingConfig(lr=LR, clip_grad=1.0, optimizer_offload_nvme_path=nvme_dir, bf16=bf16)
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, zero_stage=stage, ddp_bucket_size=bucket_size)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, pcfg)
    records, io = [], []
    for step in range(STEPS):
        out = run_step(chunks, make_batches(step, dims, 1, MODEL["vocab_size"]), dims, optimizer, sync)
        records.append((out["lm_loss"], out["grad_norm"]))
        if optimizer.placement.nvme:
            optimizer.placement.drain()
            io.append((optimizer.placement.bytes_read, optimizer.placement.bytes_written))
    expected_io = None
    if optimizer.placement.nvme:
        per_step = sum(region_bytes(s.bucket.shard_numel, 3) for s in optimizer.shards)
        largest = max(s.bucket.shard_numel for s in optimizer.shards)  # two buffers: its main, m, v and grad
        assert optimizer.held_bytes()["optimizer_staging_bytes"] == 2 * (region_bytes(largest, 3) + 4 * largest)
        # the initial state written once at start-up, then each step reads and writes every region once
        expected_io = [(per_step * (k + 1), per_step * (k + 2)) for k in range(STEPS)]
        moved = sum(io[-1]) - sum(io[-2])  # one step's reads and writes: what the planner prices at the disk's rate
        assert moved == nvme_bytes_per_step([s.bucket.shard_numel for s in optimizer.shards], 3)
        assert os.path.getsize(optimizer.placement.path) == per_step
        assert optimizer.placement.direct == bool(getattr(os, "O_DIRECT", 0)), "ext4 takes O_DIRECT"
    return records, full_params(chunks, sync, dims), optimizer.memory_bytes(), optimizer.held_bytes(), io, expected_io


def build_model_for(dims, dtype=torch.float32):
    from models.gpt import build_model
    return build_model(ModelConfig(**MODEL), dims, seed=5, params_dtype=dtype)


def _both(rank, world, tp, stage, nvme_dir, bucket_size, bf16):
    return _run(tp, stage, None, bucket_size, bf16), _run(tp, stage, nvme_dir, bucket_size, bf16)


def _check(tmp_path, world, tp, stage, bucket_size, bf16=False):
    ref, got = run_distributed(_both, world, tp, stage, str(tmp_path / "nvme"), bucket_size, bf16)[0]
    what = f"tp{tp} dp{world // tp} zero-{stage} nvme"
    assert got[0] == ref[0], f"{what}: losses / grad norms {got[0]} != {ref[0]}"  # bitwise
    for name in ref[1]:
        assert torch.equal(got[1][name], ref[1][name]), f"{what}: {name} differs"
    mem, held, io, expected_io = got[2], got[3], got[4], got[5]
    assert mem == held, f"{what}: accounting {mem} vs measured {held}"
    assert mem["optimizer_state_bytes"] == 0 and "optimizer_host_bytes" not in mem
    assert io == expected_io, f"{what}: bytes (read, written) per step {io} != {expected_io}"
    assert not os.listdir(tmp_path / "nvme"), "the optimizer files outlive their optimizers"


@pytest.mark.parametrize("tp,world,stage,bucket_size", [(1, 2, 2, 3000), (2, 4, 3, None)])
def test_nvme_offload_is_bitwise_the_in_memory_run(tmp_path, tp, world, stage, bucket_size):
    _check(tmp_path, world, tp, stage, bucket_size)


@pytest.mark.slow
def test_without_o_direct_buffered_writes_give_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)  # a file system without direct I/O (tmpfs)
    _check(tmp_path, 2, 1, 2, 3000)


@pytest.mark.slow
@pytest.mark.parametrize("tp,world,stage,bucket_size,bf16", [
    (1, 2, 1, None, False), (1, 2, 3, 3000, False), (2, 4, 1, 3000, False), (2, 4, 2, None, False),
    (1, 1, 0, 3000, False), (1, 2, 1, 3000, True), (1, 2, 3, None, True)])
def test_nvme_offload_is_bitwise_the_in_memory_run_more_layouts(tmp_path, tp, world, stage, bucket_size, bf16):
    _check(tmp_path, world, tp, stage, bucket_size, bf16)


NVME_TINY = TINY + ["--use-distributed-optimizer", "--ddp-bucket-size", "20000"]


def test_checkpoints_save_from_and_load_into_the_file(tmp_path):
    nvme, ckpt = ["--optimizer-offload-nvme-path", str(tmp_path / "nvme")], str(tmp_path / "ckpt")

    def run(extra):
        return losses_of(run_distributed(train_in_process, 2, NVME_TINY + extra))

    straight = run([])
    first = run(nvme + ["--save", ckpt, "--exit-interval", "3"])
    resumed = run(nvme + ["--save", ckpt + "-more", "--load", ckpt])
    assert first + resumed == straight
    assert run(["--load", ckpt, "--train-iters", "5"]) == straight[3:]  # the file's state is the in-memory one's
    resharded = losses_of(run_distributed(train_in_process, 1, NVME_TINY + nvme + ["--load", ckpt]))
    assert_same_run(straight[3:], resharded, rtol=1e-5, what="DP2 checkpoint into one rank's file")
    plain = str(tmp_path / "plain")
    run(["--save", plain, "--exit-interval", "3"])
    assert run(nvme + ["--load", plain]) == straight[3:]  # and an in-memory run's checkpoint fills the file


def test_kill_9_mid_run_leaves_the_last_checkpoint_loadable(tmp_path):
    from megatron_lite.checkpoint import read_tracker
    from test_checkpoint_faults import _wait_for_records, _worker_pids
    ckpt, metrics, nvme = tmp_path / "ckpt", tmp_path / "m.jsonl", str(tmp_path / "nvme")
    argv = NVME_TINY + ["--optimizer-offload-nvme-path", nvme, "--save", str(ckpt), "--save-interval", "2"]
    argv += ["--train-iters", "10000"]
    proc = subprocess.Popen(torchrun_command(2, argv, metrics), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    workers = {}
    try:
        _wait_for_records(metrics, 3, proc)
        workers = _worker_pids(proc.pid)
        os.kill(workers[1], signal.SIGKILL)  # most of a rank's time is in its steps: the kill lands in one
        proc.wait(timeout=120)
    finally:
        for pid in [proc.pid, *workers.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    saved = read_tracker(str(ckpt))
    assert saved is not None and saved >= 2
    until = ["--exit-interval", str(saved + 2)]  # the uninterrupted run, cut short the same way
    straight = losses_of(run_distributed(train_in_process, 2, NVME_TINY + ["--train-iters", "10000"] + until))
    assert losses_of(run_distributed(train_in_process, 2, argv + until + ["--load", str(ckpt)])) == straight[saved:]


def _build(rank, world, nvme_dir):
    dims = ParallelDims.from_world()
    build_optimizer(build_model_for(dims), dims, TrainingConfig(lr=LR, optimizer_offload_nvme_path=nvme_dir),
                    ParallelConfig(zero_stage=1))


def test_a_full_directory_is_one_line_on_every_rank(tmp_path, monkeypatch):
    class Usage:
        free = 4096
    monkeypatch.setattr(nvme_file.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ConfigError, match=r"has 0.0 MiB free but this rank's optimizer state needs .* MiB there"):
        _build(0, 1, str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("flags,fragment", [
    (["--optimizer-offload-nvme-path", "/proc/version/x"], "/proc/version is not a directory"),
    (["--optimizer-offload-nvme-path", "/tmp", "--optimizer-cpu-offload"], "are exclusive"),
    (["--optimizer-offload-nvme-path", "/tmp", "--optimizer", "muon"], "--optimizer muon is not implemented"),
])
def test_bad_nvme_flags_are_one_line(flags, fragment, monkeypatch, capsys):
    assert_one_line_error(TINY + flags, fragment, monkeypatch, capsys)


@pytest.mark.slow  # (the default cells already hold memory_bytes(), the planner's function, to the tensors)
@pytest.mark.parametrize("flags,offloaded,staging", [
    (["--zero-stage", "1", "--optimizer-offload-nvme-path"], "optimizer_state_bytes", "optimizer_staging_bytes"),
    (["--zero-stage", "3", "--param-offload-nvme-path"], "param_bytes", "param_staging_bytes")])
def test_the_planner_counts_the_staging_buffers_and_the_file(tmp_path, flags, offloaded, staging):
    from tests.planner_harness import MODEL_A, measure_layouts, predict
    argv = MODEL_A + ["--ddp-bucket-size", "40000"] + flags + [str(tmp_path)]
    for rank in run_distributed(measure_layouts, 2, [argv]):
        got = rank[0]
        planned = predict(argv, 2, got["pp_rank"], got["tp_rank"])["accounted"]
        assert got["accounted"] == got["held"] == planned, (got["accounted"], got["held"], planned)
        assert planned[offloaded] == 0 and planned[staging] > 0


def _hold_nvme_file(directory, ready, done):
    from megatron_lite.parallel.nvme_file import NvmeFile

    held = NvmeFile(directory, "optimizer-state", 0, 4096, "--optimizer-offload-nvme-path", "optimizer state")
    ready.set()
    done.wait(60)
    held.close()


def test_a_second_job_on_the_same_directory_is_refused_until_the_first_is_gone(tmp_path):
    """Two jobs given one --optimizer-offload-nvme-path (or --param-offload-nvme-path) would open the
    same rank file and train on each other's state: the second is refused in one line while the
    first runs; once the first is killed (-9: its lock goes with it) the directory is free again."""
    import multiprocessing as mp

    from megatron_lite.errors import ConfigError
    from megatron_lite.parallel.nvme_file import NvmeFile

    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    first = ctx.Process(target=_hold_nvme_file, args=(str(tmp_path), ready, done))
    first.start()
    try:
        assert ready.wait(60)
        with pytest.raises(ConfigError, match="in use by another running job: give each job its own directory"):
            NvmeFile(str(tmp_path), "optimizer-state", 0, 4096, "--optimizer-offload-nvme-path", "optimizer state")
    finally:
        first.kill()
        first.join()
    again = NvmeFile(str(tmp_path), "optimizer-state", 0, 4096, "--optimizer-offload-nvme-path", "optimizer state")
    again.close()
