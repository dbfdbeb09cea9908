"""Megatron-LM drop-in (issue 28 point 2): every refused flag of a command line in one error, one
start-up line naming the accepted flags that change nothing here, --ckpt-format torch_dist refused with --save
(it is read by --load: test_megatron_torch_dist.py)."""
import os
import re
import shlex

import pytest

import pretrain_gpt
from training_utils import TINY


def _error(capsys, argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_every_refused_flag_is_in_one_error(capsys, monkeypatch):
    err = _error(capsys, TINY + ["--tp-comm-overlap", "--no-such-flag", "3",
                                 "--transformer-impl", "transformer_engine", "--ckpt-format", "torch_dist",
                                 "--save", "unused"], monkeypatch)
    assert err == (
        "error: unrecognized arguments: --no-such-flag 3 (see --help); --tp-comm-overlap (Transformer Engine's "
        "userbuffers) is not supported by megatron-lite; remove it from the command line; --transformer-impl "
        "transformer_engine needs Transformer Engine (not importable here): pip install --no-build-isolation "
        "'transformer_engine[pytorch]' on a CUDA machine, or use an NGC PyTorch container (nvcr.io/nvidia/pytorch); "
        "or drop the flag (--transformer-impl local, the native layers); "
        "--ckpt-format torch_dist: megatron-lite resumes Megatron-LM's torch_dist checkpoints (--load) but saves its "
        "own format (per-rank safetensors pieces + metadata.json); with --save, replace the flag with "
        "--auto-detect-ckpt-format (loads either format); tools/convert_checkpoint.py ml-to-megatron --ckpt-format "
        "torch_dist writes Megatron-LM's weights")


def test_ckpt_format_torch_dist_alone_is_refused_with_save(capsys, monkeypatch):
    err = _error(capsys, TINY + ["--ckpt-format", "torch_dist", "--save", "unused"], monkeypatch)
    assert err.startswith("error: --ckpt-format torch_dist: megatron-lite resumes") and "with --save" in err
    err = _error(capsys, TINY + ["--ckpt-format", "fsdp_dtensor"], monkeypatch)
    assert err.startswith("error: --ckpt-format fsdp_dtensor: megatron-lite writes its own format")


def test_flags_with_no_effect_are_named_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    pretrain_gpt.resolve(TINY + ["--no-masked-softmax-fusion", "--log-throughput", "--no-rope-fusion",
                                 "--attention-backend", "fused", "--sequence-parallel", "--ckpt-format", "torch"])
    assert capsys.readouterr().out.splitlines() == [
        "> note: accepted with no effect here: --no-masked-softmax-fusion, --no-rope-fusion (fused-kernel and "
        "legacy-path switches: the same math runs); --log-throughput (logging switches: what they log is always "
        "logged here); --ckpt-format torch (megatron-lite writes its own sharded safetensors format); "
        "--attention-backend fused (runs sdpa: PyTorch's fused attention); --sequence-parallel (tensor parallel "
        "size is 1: nothing to split over)"]
    pretrain_gpt.resolve(TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "1"])
    assert "no effect" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    pretrain_gpt.resolve(TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "2"])
    assert capsys.readouterr().out == ""


def test_wandb_needs_a_run_name_and_lands_under_save(tmp_path, capsys, monkeypatch):
    """Megatron-LM's rules: --wandb-exp-name is required; the files go to --wandb-save-dir, else
    <--save>/wandb (wandb adds its own wandb/ inside)."""
    from megatron_lite.config import TrainingConfig
    from megatron_lite.training.metrics import _start_wandb

    err = _error(capsys, TINY + ["--wandb-project", "p"], monkeypatch)
    assert err == "error: --wandb-project needs --wandb-exp-name NAME: the run's name (Megatron-LM requires it too)"
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = _start_wandb(TrainingConfig(save=str(tmp_path / "ckpt"), wandb_project="p", wandb_exp_name="n"), {})
    try:
        assert run.name == "n" and run.dir.startswith(str(tmp_path / "ckpt" / "wandb" / "wandb" / "offline-run-"))
    finally:
        run.finish()
    assert capsys.readouterr().out.startswith(f"> wandb: run n of project p, offline, in {tmp_path}/ckpt/wandb/wandb/")


def test_a_rerun_of_a_finished_job_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = TINY + ["--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    assert pretrain_gpt.main(argv) == 0
    assert "the run is finished" not in capsys.readouterr().out
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert ("> the run is finished: iteration 2 of 2 already done (the checkpoint loaded); give a larger "
            "--train-iters or --train-samples to train on") in out.splitlines()
    assert "iteration      " not in out  # no training line


README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_console_examples_print_what_they_show(capsys, monkeypatch):
    """Each ```console block of the README: `$ python pretrain_gpt.py ...` and its exact stderr."""
    blocks = re.findall(r"```console\n\$ python pretrain_gpt.py ([^\n]*)\n(.*?)\n```", open(README).read(), re.S)
    assert blocks
    monkeypatch.setenv("WORLD_SIZE", "1")
    for command, shown in blocks:
        assert pretrain_gpt.main(shlex.split(command)) == 2
        assert capsys.readouterr().err.strip() == shown


def test_readme_checkpoints_are_made_before_they_are_read():
    """Read top to bottom, every checkpoint a README command reads (--load, --ml-dir) was written
    (--save, --out) by a command above it."""
    made, text = set(), open(README).read()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for flag, path in re.findall(r"--(load|ml-dir|save|out) (\S+)", block.replace("\\\n", " ")):
            path = path.rstrip("/")
            if flag in ("save", "out"):
                made.add(path)
            else:
                assert path in made, f"--{flag} {path} before a command writes it"


def test_step_batch_size_schedule_trains_the_same_over_dp_and_pp():
    """--step-batch-size-schedule "0:2 128:8" at seq 64: 2 samples in step 1, then 8 (from 128 tokens = 2
    samples); DP 2 and PP 2 (micro-batch counts 2 and 8 in one run) reproduce the single process. The
    LR schedule's lengths in iterations count the schedule's last batch, so they do not depend on DP
    (Megatron-LM's micro_batch_size x DP would decay twice as slowly at DP 2)."""
    from megatron_lite.testing import assert_same_run, run_distributed
    from training_utils import records_of, train_in_process

    i = TINY.index("--global-batch-size")
    argv = TINY[:i] + TINY[i + 2:] + [
        "--micro-batch-size", "1", "--train-iters", "3", "--step-batch-size-schedule", "0:2 128:8"]
    ref = records_of(run_distributed(train_in_process, 1, argv))
    assert [r["global_batch_size"] for r in ref] == [2, 8, 8] and ref[-1]["consumed_samples"] == 18
    assert [r["lr"] for r in ref] == pytest.approx([3e-3, 3e-3 * (1 - 2 / 24), 3e-3 * (1 - 10 / 24)])
    for world, layout in ((2, []), (2, ["--pipeline-model-parallel-size", "2"])):
        assert_same_run(ref, records_of(run_distributed(train_in_process, world, argv + layout)), what=str(layout))
