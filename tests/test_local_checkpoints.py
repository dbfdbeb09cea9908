"""Non-persistent checkpoints. Local (--non-persistent-ckpt-type local): every rank writes its own
state every step, the global checkpoint every 4; a run killed at any point resumes the newest
checkpoint complete on every rank and continues the uninterrupted run bit for bit. Global: a
layout-independent checkpoint every step into its own directory, only the newest kept."""
import os
import shutil

import pytest

from megatron_lite.checkpoint import read_tracker
from megatron_lite.checkpoint.directory import complete_iterations
from megatron_lite.errors import ConfigError
from megatron_lite.testing import WorkerError, run_distributed
from test_checkpoint_faults import _main_with_file_size_limit
from training_utils import TINY, losses_of, train_in_process

LAYOUTS = {"dp2-zero1": ["--use-distributed-optimizer"], "tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}


def run(world, argv):
    return losses_of(run_distributed(train_in_process, world, argv))


def flags(tmp_path, layout, iters=8):
    return TINY + LAYOUTS.get(layout, []) + [
        "--train-iters", str(iters), "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
        "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(tmp_path / "local"),
        "--non-persistent-save-interval", "1"]


def local_iterations(tmp_path, rank):
    return sorted(os.listdir(tmp_path / "local" / str(rank)))


def killed(monkeypatch, fault, world, argv):
    monkeypatch.setenv("MEGATRON_LITE_FAULT", fault)
    with pytest.raises(WorkerError):
        run(world, argv)
    monkeypatch.delenv("MEGATRON_LITE_FAULT")


@pytest.mark.parametrize("layout", ["dp2-zero1", "tp2", pytest.param("pp2", marks=pytest.mark.slow)])
def test_a_run_killed_while_writing_a_local_checkpoint_resumes_the_newest_complete_one(tmp_path, monkeypatch, layout):
    straight = run(2, TINY + LAYOUTS[layout] + ["--train-iters", "8"])
    argv = flags(tmp_path, layout)
    killed(monkeypatch, "local:6:1", 2, argv)  # rank 1 dies with its file of iteration 6 half written
    assert read_tracker(str(tmp_path / "ckpt")) == 4
    assert local_iterations(tmp_path, 1) == ["iter_0000005", "iter_0000006.staging"]
    resumed = run(2, argv)
    assert resumed == straight[5:]  # iteration 5 is local: newer than the global 4; bit for bit
    assert local_iterations(tmp_path, 0) == local_iterations(tmp_path, 1) == ["iter_0000007"]
    assert read_tracker(str(tmp_path / "ckpt")) == 8


def test_a_rank_without_its_local_directory_sends_every_rank_to_the_global_checkpoint(tmp_path, monkeypatch, capfd):
    straight = run(2, TINY + LAYOUTS["dp2-zero1"] + ["--train-iters", "8"])
    argv = flags(tmp_path, "dp2-zero1")
    killed(monkeypatch, "iteration:7:0", 2, argv)  # both ranks hold iteration 6 locally (rank 1 also its 7)
    assert "iter_0000006" in local_iterations(tmp_path, 1)
    shutil.rmtree(tmp_path / "local" / "1")  # its node's disk is gone
    capfd.readouterr()
    assert run(2, argv) == straight[4:]
    assert "is complete on every rank" in capfd.readouterr().out


def test_a_damaged_local_file_falls_back_to_the_global_checkpoint(tmp_path, monkeypatch):
    straight = run(1, TINY + ["--train-iters", "7"])
    argv = flags(tmp_path, "one rank", iters=7)
    killed(monkeypatch, "iteration:7:0", 1, argv)
    shard = tmp_path / "local" / "0" / "iter_0000006" / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte: the piece fails its checksum
    shard.write_bytes(bytes(data))
    assert run(1, argv) == straight[4:]


def test_a_local_checkpoint_resumes_only_at_its_layout(tmp_path, monkeypatch):
    argv = flags(tmp_path, "dp2-zero1")
    killed(monkeypatch, "iteration:6:0", 2, argv)
    with pytest.raises(WorkerError, match="resumes only at its own layout"):
        run(1, argv)


def test_non_persistent_global_checkpoints_keep_the_newest_only_and_resume_at_any_layout(tmp_path, monkeypatch):
    straight = run(2, TINY + ["--train-iters", "8"])
    np_dir = tmp_path / "np"
    argv = TINY + ["--train-iters", "8", "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
                   "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", str(np_dir),
                   "--non-persistent-save-interval", "1"]
    killed(monkeypatch, "iteration:6:1", 2, argv + ["--use-distributed-optimizer"])
    assert read_tracker(str(tmp_path / "ckpt")) == 4 and read_tracker(str(np_dir)) == 5
    assert complete_iterations(str(np_dir)) == [5]
    resumed = run(1, argv)  # DP1, no ZeRO: a global checkpoint reshards
    assert resumed == pytest.approx(straight[5:], rel=1e-5)
    assert read_tracker(str(tmp_path / "ckpt")) == 8  # the end of training still saves to --save


def test_a_local_save_into_a_full_disk_is_one_line_and_leaves_no_staging_directory(tmp_path):
    local = tmp_path / "local"
    flags = TINY + ["--train-iters", "2", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                    str(local), "--non-persistent-save-interval", "1"]
    run(2, TINY + ["--train-iters", "1"])  # (the data's index cache is written here, under no limit)
    results = run_distributed(_main_with_file_size_limit, 2, flags, 64 << 10)
    assert [code for code, _ in results] == [2, 2], results
    err = results[0][1].strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"error: [rank 0] saving local checkpoint iteration 1 to {local}/0 failed: File too large"), err
    assert err.endswith("free space there or give --non-persistent-local-ckpt-dir another directory"), err
    assert os.listdir(local / "0") == os.listdir(local / "1") == []


def test_megatrons_local_checkpoint_algorithm_flag_is_accepted_and_said_to_change_nothing(capsys):
    from pretrain_gpt import resolve
    resolve(TINY + ["--non-persistent-local-ckpt-algo", "fully_parallel"])
    assert "--non-persistent-local-ckpt-algo fully_parallel (each rank writes" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--non-persistent-ckpt-type", "in_memory", "--non-persistent-local-ckpt-dir", "x"], "in_memory is not supported"),
    (["--non-persistent-ckpt-type", "global"], "global needs --save DIR"),
    (["--non-persistent-global-ckpt-dir", "x"], "needs --non-persistent-ckpt-type global"),
    (["--non-persistent-ckpt-type", "local"], "needs --non-persistent-local-ckpt-dir"),
    (["--non-persistent-save-interval", "2"], "needs --non-persistent-ckpt-type local"),
    (["--non-persistent-local-ckpt-dir", "x"], "needs --non-persistent-ckpt-type local"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "x",
      "--non-persistent-save-interval", "0"], "must be >= 1"),
])
def test_bad_non_persistent_flags_are_one_line(extra, message):
    from pretrain_gpt import resolve
    with pytest.raises(ConfigError, match=message):
        resolve(TINY + extra)


def test_a_damaged_local_file_without_a_global_checkpoint_stops_with_one_line(tmp_path, monkeypatch):
    """As the README says: nothing to fall back to, so the run stops with the damaged file's line
    rather than train from scratch."""
    argv = flags(tmp_path, "one rank", iters=7)
    argv[argv.index("--save-interval") + 1] = "100"  # no global checkpoint yet
    killed(monkeypatch, "iteration:5:0", 1, argv)
    assert read_tracker(str(tmp_path / "ckpt")) is None
    shard = tmp_path / "local" / "0" / "iter_0000004" / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = r"CheckpointError: checkpoint file \S*/local/0/iter_0000004/\S* is corrupted: .* fails its checksum"
    with pytest.raises(WorkerError, match=damaged):
        run(1, argv)
