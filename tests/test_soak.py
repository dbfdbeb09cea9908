"""Soak (slow, not in the default suite; run with `pytest -m slow tests/test_soak.py`): 300
iterations of a tiny model on 4 ranks under `torchrun --max-restarts`, asynchronous saves every 20
iterations, and a SIGKILL of a random rank about every 70 iterations; every iteration's loss, first
run or re-run after a restart, equals the uninterrupted run's bit for bit."""
import os
import random
import signal
import subprocess
import time

import pytest

from megatron_lite.checkpoint import read_tracker
from megatron_lite.testing import run_distributed
from test_checkpoint_faults import _worker_pids
from training_utils import ROOT, TINY, losses_of, read_metrics, torchrun_command, train_in_process

ITERS, SAVE_EVERY, KILL_EVERY = 300, 20, 70


@pytest.mark.slow
def test_random_kills_under_torchrun_recover_bit_for_bit(tmp_path):
    argv = TINY + ["--global-batch-size", "8", "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
                   "--log-interval", "50"]
    straight = losses_of(run_distributed(train_in_process, 4, argv))
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    flags = argv + ["--save", str(ckpt), "--save-interval", str(SAVE_EVERY), "--async-save"]
    cmd = torchrun_command(4, flags, metrics, launcher=["--max-restarts", "10"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    rng, kills, next_kill = random.Random(0), [], KILL_EVERY + random.Random(1).randint(-10, 10)
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            records = read_metrics(metrics) if os.path.exists(metrics) else []
            if records and records[-1]["iteration"] >= next_kill and len(kills) < ITERS // KILL_EVERY:
                workers = _worker_pids(proc.pid)
                if len(workers) == 4:
                    rank = rng.randrange(4)
                    os.kill(workers[rank], signal.SIGKILL)
                    kills.append((records[-1]["iteration"], rank))
                    next_kill += KILL_EVERY + rng.randint(-10, 10)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert len(kills) >= 3, kills
    records = read_metrics(metrics)
    assert max(r["iteration"] for r in records) == ITERS
    for rec in records:  # before and after every kill: the uninterrupted run's loss, exactly
        assert rec["lm_loss"] == straight[rec["iteration"] - 1], (rec["iteration"], kills)
    assert read_tracker(str(ckpt)) == ITERS
