"""--transformer-impl transformer_engine (megatron_lite/transformer/te_backend.py). Here: the one-line
error where Transformer Engine is missing. Where TE is installed (with a CUDA device): TE's recipe
objects for our FP8 flags, and a small model whose layers are TE's trains like the local layers
(without FP8 to bf16 rounding; with each FP8 recipe, finite and falling losses). Not exercised in
CI: TE does not install on the CPU machines the tests run on."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.transformer import te_backend
from training_utils import LLAMA_SWITCHES, ROOT, TINY

NO_TE = "Transformer Engine is not installed (pip install transformer_engine[pytorch], or an NGC PyTorch container)"
needs_te = pytest.mark.skipif(not te_backend.available() or not torch.cuda.is_available(),
                              reason=NO_TE + " or no CUDA device")


def _cli(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.skipif(te_backend.available(), reason="Transformer Engine is installed here")
def test_missing_transformer_engine_is_one_line_naming_the_fix(capsys, monkeypatch):
    import pretrain_gpt
    from megatron_lite.errors import ConfigError
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_gpt.main(TINY + ["--transformer-impl", "transformer_engine"]) == 2
    assert capsys.readouterr().err.strip() == "error: " + te_backend.MISSING
    with pytest.raises(ConfigError, match=r"^--transformer-impl transformer_engine needs Transformer Engine"):
        te_backend.te_pytorch()  # (the check at build time, for a config made in code)


@needs_te
def test_te_recipes_for_our_flags():
    from transformer_engine.common import recipe as r
    delayed = te_backend.te_recipe("hybrid", "delayed", margin=1, history_len=16, algo="max")
    assert isinstance(delayed, r.DelayedScaling) and delayed.fp8_format == r.Format.HYBRID
    assert (delayed.margin, delayed.amax_history_len, delayed.amax_compute_algo) == (1, 16, "max")
    assert isinstance(te_backend.te_recipe("e4m3", "tensorwise"), r.Float8CurrentScaling)
    assert isinstance(te_backend.te_recipe("e4m3", "blockwise"), r.Float8BlockScaling)


def _train(tmp_path, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    argv = [a if a != "cpu" else "cuda" for a in TINY] + LLAMA_SWITCHES + ["--hidden-size", "128",
                                                                       "--ffn-hidden-size", "256", "--bf16"]
    proc = _cli(*argv, "--train-iters", "8", "--metrics-file", str(metrics), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()], proc.stdout


@needs_te
def test_te_layers_train_like_the_local_layers(tmp_path):
    local, _ = _train(tmp_path, "local")
    te, out = _train(tmp_path, "te", "--transformer-impl", "transformer_engine")
    assert "> transformer impl: Transformer Engine's LayerNormLinear / Linear / DotProductAttention" in out
    assert abs(te[0] - local[0]) < 2e-2 * local[0]  # the same initial weights (our init), bf16 kernels
    assert abs(te[-1] - local[-1]) < 5e-2 * local[-1]


@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_te_fp8_recipes_train(tmp_path, recipe):
    losses, out = _train(tmp_path, recipe, "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
                         "--fp8-recipe", recipe)
    assert f"fp8: TE {recipe} recipe (hybrid)" in out
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-2:]) < sum(losses[:2])
