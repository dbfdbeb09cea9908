"""Start-up: `--help` and a configuration error come before torch is imported; torch._dynamo only
with --compile; a slow start-up phase says how long it took. (Timed in benchmarks/bench_startup.py.)"""
import os
import subprocess
import sys

import pretrain_gpt
from megatron_lite.training import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--device", "cpu"]

CONFIG_ERROR = """
import sys
import pretrain_gpt
rc = pretrain_gpt.main({flags!r} + ["--train-iters", "2", "--tensor-model-parallel-size", "3"])
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("models.gpt"))
print(rc, heavy)
import torch
from models.gpt import build_model
import megatron_lite.training.loop, megatron_lite.parallel.tensor_parallel
print("torch._dynamo" in sys.modules)
"""


def test_config_error_imports_no_torch_and_the_model_stack_no_dynamo():
    out = subprocess.run([sys.executable, "-c", CONFIG_ERROR.format(flags=FLAGS)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "1"})
    assert out.stdout.splitlines() == ["2 []", "False"], out.stdout + out.stderr
    assert out.stderr.strip() == ("error: world size (1) must be divisible by tensor_model_parallel_size (3) x "
                                  "pipeline_model_parallel_size (1) x context_parallel_size (1) = 3; change "
                                  "--nproc_per_node or the parallel sizes"), out.stderr


def test_slow_start_up_phases_say_their_time(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(loop, "SLOW_PHASE_S", -1.0)  # every phase counts as slow
    assert pretrain_gpt.main(FLAGS + ["--train-iters", "2", "--eval-iters", "0"]) == 0
    lines = [ln.split(" took ")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("> start-up:")]
    assert lines == ["> start-up: model build", "> start-up: data", "> start-up: checkpoint load",
                     "> start-up: first step"]
    monkeypatch.setattr(loop, "SLOW_PHASE_S", 1e9)
    assert pretrain_gpt.main(FLAGS + ["--train-iters", "2", "--eval-iters", "0"]) == 0
    assert "> start-up:" not in capsys.readouterr().out


def test_load_without_data_path_says_it_trains_on_the_built_in_corpus(monkeypatch, capsys, tmp_path):
    """A fine-tune that names a checkpoint but no data is told, at start-up, where its tokens come from."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = FLAGS + ["--train-iters", "2", "--load", str(tmp_path)]
    pretrain_gpt.resolve(run)
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("> note:")]
    assert notes == [f"> note: --load {tmp_path} without --data-path: training on the built-in corpus (the Python "
                     "standard library's source files); give --data-path PREFIX to train on your own data"]
    cfg, _ = pretrain_gpt.resolve(run + ["--mock-data"])  # data named: no note
    assert not any("built-in corpus" in n for n in cfg.notes)
    from megatron_lite.config import DataConfig, TrainingConfig
    from megatron_lite.data.default_corpus import default_corpus_note

    assert default_corpus_note(DataConfig(data_path=["corpus"]), TrainingConfig(load=str(tmp_path))) is None
    assert default_corpus_note(DataConfig(), TrainingConfig()) is None  # from scratch: the default is the point
    assert "--pretrained-checkpoint w" in default_corpus_note(DataConfig(), TrainingConfig(pretrained_checkpoint="w"))
