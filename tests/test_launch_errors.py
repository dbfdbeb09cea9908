"""Under torchrun a start-up error is printed by rank 0 every time, even though every rank finds it
and rank 1 may find it first (megatron_lite/launch.py); an error only a non-zero rank finds is
printed by that rank."""
import os
import subprocess
import sys

import pytest

from megatron_lite import launch
from tests.test_validation import BASE
from tests.training_utils import ROOT

BAD = BASE + ["--pipeline-model-parallel-layout", "garbage!!"]


# rank 0 reaches the flags a second after rank 1 (a loaded node): torchrun's race, made certain
RANK0_LATE = ("import os, sys, time; sys.argv[0] = 'pretrain_gpt.py'; os.environ['RANK'] == '0' and time.sleep(1); "
              "import pretrain_gpt; sys.exit(pretrain_gpt.main())")


def _launches(n, script=(os.path.join(ROOT, "pretrain_gpt.py"),)):
    """n torchrun launches of 2 ranks, all at once (what one launch costs is importing torch)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               *script, *BAD], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert p.returncode != 0 and len(lines) == 1 and "garbage!!" in lines[0], err[-3000:]
        assert "exitcode  : 2" in err, err[-3000:]  # rank 0's own exit status, not a kill


def test_a_start_up_error_under_torchrun_is_printed_when_rank_1_finds_it_first():
    _launches(1, ("--no-python", sys.executable, "-c", RANK0_LATE))


@pytest.mark.slow
def test_a_start_up_error_under_torchrun_is_printed_in_20_launches_of_20():
    for _ in range(4):
        _launches(5)


def test_an_error_only_a_non_zero_rank_finds_is_printed_by_it(monkeypatch, capsys):
    import pretrain_gpt
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(launch, "UNEVEN_ERROR_WAIT_S", 0.0)  # (rank 0, which did not find it, is not here)
    assert pretrain_gpt.main(BASE + ["--seq-length", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: [rank 1] seq_length (0)") and "\n" not in err, err
