"""Elastic restarts: a job relaunched on fewer or more ranks resumes its last checkpoint, resharded
over the new data-parallel size, with the same global batch, and continues the uninterrupted
run's losses: in forked worlds, and (slow) through real `torchrun --nnodes 1:2` agents that lose a
node and gain one."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from test_checkpoint_faults import _worker_pids
from training_utils import ROOT, TINY, losses_of, read_metrics, train_in_process


@pytest.mark.parametrize("worlds, explicit_global_batch", [((4, 2, 4), True), ((4, 2, 4), False), ((2, 1, 2), True)])
def test_shrunk_and_regrown_runs_continue_the_uninterrupted_run(tmp_path, worlds, explicit_global_batch):
    base = TINY[:TINY.index("--global-batch-size")] + TINY[TINY.index("--global-batch-size") + 2:]
    base += ["--train-iters", "9", "--use-distributed-optimizer"]
    batch = ["--global-batch-size", "8"]
    straight = losses_of(run_distributed(train_in_process, worlds[0], base + batch))
    # Without --global-batch-size the first launch's is micro-batch (2) x DP (4) = 8 as well; the
    # relaunches at DP=2 must keep 8 (from the checkpoint), not take 2 x 2. At DP1 a step is 4
    # micro-batches, at DP2 2.
    flags = base + (batch if explicit_global_batch else []) + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3"]
    pieces = []
    for world in worlds:
        histories = run_distributed(train_in_process, world, flags)
        pieces += [r for h in histories[:1] for r in h]
        assert all(r["global_batch_size"] == 8 for r in histories[0])
    assert_same_run(straight, [r["lm_loss"] for r in pieces], rtol=1e-6)


# torch's agents share one TCP store across rendezvous rounds by default, and then the rank-0 node
# of a later round does not publish its address: a node that joins later waits for it until it
# times out. Without the sharing every round publishes it (README, "Elastic membership").
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(paths):
    return [r for p in paths if os.path.exists(p) for r in read_metrics(p)]


def _worker_of(agent):
    """The pid of an agent's one worker (in a session of its own: killing the agent leaves it)."""
    (pid,) = _worker_pids(agent.pid).values()
    return pid


def _wait(what, condition, procs, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        logs = "".join(f"\n--- {p.args[-1]}.log ---\n" + open(p.args[-1] + ".log").read()[-3000:] for p in procs)
        assert time.monotonic() < deadline, f"timed out waiting for {what}{logs}"
        assert all(p.poll() is None for p in procs), f"an agent exited while waiting for {what}{logs}"
        time.sleep(0.1)


@pytest.mark.slow
def test_torchrun_elastic_agents_lose_a_node_and_regain_it(tmp_path):
    """Two `torchrun --nnodes 1:2` agents (one rank each) on localhost with the c10d rendezvous: one
    agent is killed, the other restarts at DP1 from the last checkpoint; a third agent joins and
    the run grows back to DP2. Every logged loss (repeated iterations included) is the
    uninterrupted DP2 run's."""
    args = TINY + ["--train-iters", "100", "--use-distributed-optimizer"]
    straight = losses_of(run_distributed(train_in_process, 2, args))
    port, ckpt = _free_port(), tmp_path / "ckpt"
    metrics = {name: tmp_path / f"{name}.jsonl" for name in "abc"}

    def agent(name):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
               "--rdzv-conf", "last_call_timeout=10,join_timeout=120", "--max-restarts", "3",
               "--monitor-interval", "0.5", os.path.join(ROOT, "pretrain_gpt.py"), *args, "--save", str(ckpt),
               "--save-interval", "3", "--metrics-file", str(metrics[name])]
        with open(f"{metrics[name]}.log", "w") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                    env=dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO", **NO_SHARED_STORE))

    a = agent("a")
    time.sleep(3)  # a hosts the rendezvous store (it must survive); b joins its first round
    b = agent("b")
    procs = [a, b]
    try:
        # Each phase ends with a's worker stopped (SIGSTOP) until the next event is under way, so
        # that the run cannot finish first however fast the steps are.
        _wait("DP2 steps", lambda: len(_records(metrics.values())) >= 8, procs)
        worker = _worker_of(a)
        os.kill(worker, signal.SIGSTOP)
        lost = _worker_of(b)
        os.killpg(b.pid, signal.SIGKILL)  # the node is lost: its agent and its worker (own session)
        os.kill(lost, signal.SIGKILL)
        b.wait()
        os.kill(worker, signal.SIGCONT)  # it finds its peer gone; a's agent restarts it alone
        sizes = lambda: re.findall(r"group_world_size=(\d+)", open(f"{metrics['a']}.log").read())
        _wait("a's DP1 rendezvous", lambda: sizes()[-1] == "1", [a])
        logged = len(_records(metrics.values()))  # the DP1 worker has not trained yet (it imports torch)
        _wait("DP1 steps", lambda: len(_records(metrics.values())) >= logged + 4, [a])  # and a DP1 checkpoint
        worker = _worker_of(a)
        os.kill(worker, signal.SIGSTOP)
        c = agent("c")
        procs = [a, c]
        try:
            _wait("c to join", lambda: "new nodes" in open(f"{metrics['a']}.log").read(), procs)
        finally:
            os.kill(worker, signal.SIGCONT)
        _wait("the end", lambda: a.poll() is not None and c.poll() is not None, [], timeout=300)
        assert a.returncode == 0 and c.returncode == 0, open(f"{metrics['a']}.log").read()[-4000:]
    finally:
        for p in (a, b, *procs):
            if p.poll() is None:
                for pid in _worker_pids(p.pid).values():
                    os.kill(pid, signal.SIGKILL)
                os.killpg(p.pid, signal.SIGKILL)
    assert sizes() == ["2", "1", "2"]  # a's worker groups: DP2, DP1, DP2 again
    records = _records(metrics.values())
    assert max(r["iteration"] for r in records) == 100
    for r in records:
        assert r["lm_loss"] == pytest.approx(straight[r["iteration"] - 1], rel=1e-5), r["iteration"]
