"""Another Megatron-Core release (the newest: 0.19.2 needs Python >= 3.12, so it lives in its own
environment): it loads ml-to-megatron's checkpoints strictly with our logits, and megatron-to-ml
reads the checkpoints it saves (0.19's torch_dist keeps the args inside the .distcp files; its
legacy files hold classes 0.16 did not have) with its logits.

Runs where MEGATRON_CORE_PYTHON names that environment's python (with torch, megatron-core, psutil,
pytest and safetensors installed, e.g. `python3.12 -m venv v && v/bin/pip install torch==2.13.0
megatron-core==0.19.2 psutil pytest safetensors`); skipped with that reason elsewhere. The ranks run in
that interpreter (this repository on its path); the checkpoints and our logits come from this one.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_megatron_checkpoints import PADDED, SHAPES, _batch, _convert

PYTHON = os.environ.get("MEGATRON_CORE_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="MEGATRON_CORE_PYTHON (a Python with another megatron-core "
                                                   "release) is not set")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOADER = """
import sys, torch
from mcore_cpu import import_mcore
core = import_mcore()
from megatron_lite.testing import run_distributed
import test_megatron_moe_checkpoints as moe
shape, tp, pp, root, fmt, out = torch.load(sys.argv[1])
logits = next(r for r in run_distributed(moe._megatron_loads, tp * pp * shape.get("ep", 1), root, shape, tp, pp, fmt,
                                         daemon=False) if r is not None)
torch.save({"logits": logits, "version": __import__("megatron.core.package_info").core.package_info.__version__}, out)
"""


def _ml_checkpoint(tmp_path, shape):
    """A random model of `shape` as a full (ml-dir) checkpoint, and our logits on the batch."""
    from test_megatron_moe_checkpoints import random_ml_checkpoint

    model = random_ml_checkpoint(tmp_path / "ml", shape)
    with torch.no_grad():
        return tmp_path / "ml", model(_batch(PADDED)[0])


@pytest.mark.parametrize("kind,fmt,tp,pp,ep", [("dense", "torch", 2, 2, 1), ("dense", "torch_dist", 2, 2, 1),
                                               ("moe", "torch", 2, 1, 2), ("moe", "torch_dist", 2, 1, 2)])
def test_newest_megatron_core_loads_ml_to_megatron(tmp_path, kind, fmt, tp, pp, ep):
    from test_megatron_moe_checkpoints import SHAPE as MOE

    shape = dict(SHAPES["llama"], vocab=PADDED) if kind == "dense" else dict(MOE, ep=ep)
    ml, ours = _ml_checkpoint(tmp_path, shape)
    out = tmp_path / "megatron"
    assert _convert("ml-to-megatron", "--ml-dir", ml, "--out", out, "--ckpt-format", fmt, "--tensor-model-parallel-size",
                    tp, "--pipeline-model-parallel-size", pp, "--expert-model-parallel-size", ep) == 0
    job, result = tmp_path / "job.pt", tmp_path / "logits.pt"
    torch.save((shape, tp, pp, str(out), fmt, str(result)), job)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools")]))
    run = subprocess.run([PYTHON, "-c", _LOADER, str(job)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(result)
    print(f"megatron-core {theirs['version']}: {kind} {fmt} tp={tp} pp={pp} ep={ep}", file=sys.stderr)
    torch.testing.assert_close(theirs["logits"], ours, rtol=1e-5, atol=1e-5)


_SAVER = """
import sys, torch
from mcore_cpu import import_mcore
core = import_mcore()
from megatron_lite.testing import run_distributed
import test_megatron_checkpoints as dense
import test_megatron_moe_checkpoints as moe
kind, root, out = sys.argv[1:]
if kind == "dense":
    results = run_distributed(dense._megatron_world, 4, "llama", root, daemon=False)
else:
    results = [run_distributed(moe._megatron_world, 4, root + "/" + fmt, dict(moe.SHAPE, ep=2), 2, 1, fmt, daemon=False)
               for fmt in ("torch", "torch_dist")][0]
torch.save(next(r for r in results if r is not None), out)
"""


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_to_ml_reads_the_newest_megatron_cores_checkpoints(tmp_path, kind):
    from test_megatron_checkpoints import _our_logits

    root, result = tmp_path / "megatron", tmp_path / "logits.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools")]))
    run = subprocess.run([PYTHON, "-c", _SAVER, kind, str(root), str(result)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(result)
    for fmt in ("legacy", "torch_dist") if kind == "dense" else ("torch", "torch_dist"):
        ckpt = tmp_path / f"ml-{fmt}"
        assert _convert("megatron-to-ml", "--load", root / fmt, "--out", ckpt) == 0
        ours, cfg = _our_logits(ckpt, _batch(theirs.shape[-1] if kind == "moe" else 200)[0])
        vocab = ours.shape[-1]
        assert cfg.hidden_dropout == 0.0  # (the run's args were found: their dropout, not the default 0.1)
        assert (ours - theirs[..., :vocab]).abs().max().item() < 1e-4
