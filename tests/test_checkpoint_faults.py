"""Failures around checkpoints, with real processes: SIGTERM (preemption), SIGKILL in the middle
of a save, and a killed rank under `torchrun --max-restarts`. Deaths at a precise point come from
MEGATRON_LITE_FAULT (megatron_lite/checkpoint/faults.py); the losses after a recovery are compared
with an uninterrupted run in forked ranks (same math, bit for bit)."""
import os
import signal
import subprocess
import time

import pytest

from megatron_lite.checkpoint import read_tracker
from megatron_lite.testing import WorkerError, run_distributed
from training_utils import ROOT, TINY, losses_of, read_metrics, torchrun, torchrun_command, train_in_process


def run(world, argv):
    return losses_of(run_distributed(train_in_process, world, argv))


def _worker_pids(launcher_pid):
    """{global rank: pid} of the training processes torchrun started."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid:
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                children[int(rank[0])] = int(pid)
    return children


def _wait_for_records(path, n, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(read_metrics(path)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} metrics records in {timeout} s (exit code {proc.poll()})")


def test_sigterm_saves_at_the_end_of_the_iteration_and_exits_0(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    flags = TINY + ["--train-iters", "10000"]  # SIGTERM comes long before the end
    cmd = torchrun_command(2, flags + ["--save", str(ckpt), "--exit-signal-handler"], metrics)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _wait_for_records(metrics, 3, proc)
        os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)  # one rank is enough: the ranks agree
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    records = read_metrics(metrics)
    stopped = records[-1]["iteration"]
    assert stopped < 10000 and read_tracker(str(ckpt)) == stopped
    assert "SIGTERM received" in out

    until = ["--exit-interval", str(stopped + 2)]  # the uninterrupted run, cut short the same way
    straight = run(2, flags + until)
    assert [r["lm_loss"] for r in records] == straight[:stopped]
    assert run(2, flags + until + ["--load", str(ckpt)]) == straight[stopped:]


def test_sigkill_while_saving_leaves_latest_at_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "6", "--save", str(ckpt), "--save-interval", "2"]
    proc = torchrun(2, argv, tmp_path / "m.jsonl", check=False, env={"MEGATRON_LITE_FAULT": "save:4:1"})
    assert proc.returncode != 0
    assert read_tracker(str(ckpt)) == 2
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004.staging", "latest_checkpointed_iteration.txt"]

    straight = run(2, TINY + ["--train-iters", "6"])
    assert run(2, argv + ["--load", str(ckpt)]) == straight[2:]  # resumes from iteration 2
    assert read_tracker(str(ckpt)) == 6
    assert not os.path.exists(ckpt / "iter_0000004.staging")  # the new save of iteration 4 replaced it


def test_sigkill_between_commit_and_tracker_update(tmp_path, monkeypatch):
    """A complete checkpoint that the tracker does not name yet is simply not the latest."""
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"]
    monkeypatch.setenv("MEGATRON_LITE_FAULT", "commit:4:0")
    with pytest.raises(WorkerError, match="exit code -9"):
        run(1, argv)
    assert read_tracker(str(ckpt)) == 2 and os.path.isfile(ckpt / "iter_0000004" / "metadata.json")
    monkeypatch.delenv("MEGATRON_LITE_FAULT")
    assert run(1, argv) == run(1, TINY + ["--train-iters", "4"])[2:]


def test_torchrun_max_restarts_resumes_from_the_latest_checkpoint(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = TINY + ["--train-iters", "8", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3"]
    torchrun(2, argv, metrics, launcher=["--max-restarts", "1"], env={"MEGATRON_LITE_FAULT": "iteration:5:1"})
    iterations = [r["iteration"] for r in read_metrics(metrics)]
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    assert iterations[restart:] == [4, 5, 6, 7, 8]  # resumed after the save at 3
    straight = run(2, TINY + ["--train-iters", "8"])
    for rec in read_metrics(metrics):  # before and after the crash: the uninterrupted run's losses
        assert rec["lm_loss"] == straight[rec["iteration"] - 1], rec["iteration"]
    assert read_tracker(str(ckpt)) == 8


def _main_with_file_size_limit(rank, world, argv, limit):
    """pretrain_gpt.main(argv) on this forked rank with files limited to `limit` bytes (as a full
    disk: writes beyond it fail, EFBIG): (exit status, stderr)."""
    import contextlib
    import io
    import resource

    import pretrain_gpt

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    os.environ["WORLD_SIZE"] = str(world)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue()


def test_a_save_into_a_full_file_system_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Issue 26: a full disk during a save was a RuntimeError traceback (exit 1) that left
    iter_*.staging behind. Now: every rank exits 2 with one line naming the directory and the space
    the save needs; no staging directory is left; the previous checkpoint loads."""
    ckpt = str(tmp_path / "ckpt")
    flags = TINY + ["--save", ckpt, "--save-interval", "2"]
    run(2, flags + ["--train-iters", "4", "--exit-interval", "2"])  # (the data's index cache is written here)
    assert read_tracker(ckpt) == 2
    results = run_distributed(_main_with_file_size_limit, 2, flags + ["--train-iters", "4", "--load", ckpt], 64 << 10)
    assert [code for code, _ in results] == [2, 2], results
    err = results[0][1].strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"error: [rank 0] saving checkpoint iteration 4 to {ckpt} failed: File too large "
                          f"({ckpt}/iter_0000004.staging/shard_00000.safetensors); it needs "), err
    assert "MiB and" in err and "MiB are free there" in err and "give --save another directory" in err, err
    assert err.endswith("; checkpoint iteration 2 stays the latest"), err
    assert results[1][1] == ""  # one line, from rank 0
    assert read_tracker(ckpt) == 2 and sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert len(run(2, flags + ["--train-iters", "3", "--load", ckpt])) == 1  # iteration 3 from the kept checkpoint


def _main_with_a_late_rank(rank, world, argv, port, late_s):
    """pretrain_gpt.main(argv) in a world it joins itself (env://, as under torchrun); rank 1 sleeps
    `late_s` before training. (exit status, stderr, timeouts of the world and the TP group)."""
    import contextlib
    import io
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import pretrain_gpt

    dist.destroy_process_group()  # the harness's world: main joins its own, with the flag's timeout
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    make_trainer, seen = pretrain_gpt.make_trainer, {}

    def late_trainer(cfg, tokenizer, device):
        trainer = make_trainer(cfg, tokenizer, device)
        timeout = (lambda g: g._get_backend(torch.device("cpu")).options._timeout / timedelta(seconds=1))
        seen.update(world=timeout(dist.group.WORLD), tp=timeout(trainer.dims.groups["tp"]))
        if rank == 1:
            time.sleep(late_s)
        return trainer

    pretrain_gpt.make_trainer = late_trainer
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue(), seen


def test_distributed_timeout_minutes_sets_every_group_and_a_late_peer_is_one_line():
    """Issue 26: --distributed-timeout-minutes was accepted and ignored. Now the world and every
    group time out after it; a collective that waits longer ends each rank with one error line
    (exit 1, for torchrun to restart), not a gloo traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = TINY + ["--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.05"]
    results = run_distributed(_main_with_a_late_rank, 2, argv, port, 4.5, timeout=120)
    for rank, (code, err, seen) in enumerate(results):
        assert seen == {"world": 3.0, "tp": 3.0}, seen
        assert code == 1, (code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: [rank {rank}] a collective failed: all_reduce over "
                                                       f"the tp group (ranks 0-1) failed: "), err
        assert lines[0].endswith("; restart from the last checkpoint"), err
    # rank 0 gave up before the late rank 1 entered the collective: it names rank 1
    assert "Timed out waiting 3000ms" in results[0][1], results[0][1]
    assert ": rank 1 of the group did not answer in time (dead, or hung past --distributed-timeout-minutes)" \
        in results[0][1], results[0][1]
    assert "every other rank of the group entered it in time and failed too" in results[1][1], results[1][1]
