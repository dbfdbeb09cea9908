"""What checkpoints save besides the tensors (checkpoint/state.py): the values components register
are saved under their names and restored at their moments (progress, optimizer) in registration
order, with their notes and a default for a value an older checkpoint lacks; a checkpoint holds the
format's metadata keys and tensor families; and one as an older megatron-lite wrote it (no
checksum, no consumed_valid_samples, an LR schedule counting updates) still loads."""
import json
import os
import types

import pytest
import torch

from megatron_lite.checkpoint import CheckpointReader, read_metadata
from megatron_lite.checkpoint.state import TrainState
from megatron_lite.testing import run_distributed
from training_utils import TINY, train_in_process


def test_values_save_and_restore_at_their_moments():
    state = TrainState(cfg=None, dims=None, device=None, chunks=[], optimizer=None, tracker=None)
    owner, seen = types.SimpleNamespace(iteration=7, samples=3), []
    state.register_attribute(owner, "iteration")
    state.register_attribute(owner, "samples", default=-1)
    state.register("schedule", lambda: {"position": 5}, progress=lambda saved, meta: seen.append(saved),
                   optimizer=lambda saved, meta: ["schedule note"])
    state.register("optimizer", lambda: {"updates": 2}, optimizer=lambda saved, meta: ["optimizer note"])
    meta = {name: save() for name, save in state.saves.items()}
    assert meta == {"iteration": 7, "samples": 3, "schedule": {"position": 5}, "optimizer": {"updates": 2}}
    assert state.value("iteration") == 7
    del meta["samples"]  # an older checkpoint without it
    owner.iteration = owner.samples = 0
    assert state.restore(meta, "progress") == [] and seen == [{"position": 5}]
    assert (owner.iteration, owner.samples) == (7, -1)
    assert state.restore(meta, "optimizer") == ["schedule note", "optimizer note"]
    with pytest.raises(AssertionError, match="registered twice"):
        state.register("schedule", dict)


def _loaded(rank, world, argv):
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    t = make_trainer(cfg, tokenizer, torch.device("cpu"))
    return t.iteration, t.consumed_samples, t.consumed_valid_samples, t.lr_schedule.num_steps, t.optimizer.num_updates


def test_format_keys_and_an_older_checkpoint(tmp_path):
    argv = TINY + ["--train-iters", "3", "--eval-iters", "1", "--eval-interval", "2"]
    run_distributed(train_in_process, 1, argv + ["--save", str(tmp_path)])
    ckpt = tmp_path / "iter_0000003"
    meta = read_metadata(str(ckpt))
    assert set(meta) == {"format", "version", "iteration", "consumed_samples", "consumed_valid_samples",
                         "model_config", "config", "layout", "lr_scheduler", "optimizer", "files", "checksum"}
    assert (meta["iteration"], meta["consumed_samples"], meta["consumed_valid_samples"]) == (3, 12, 8)
    assert set(meta["optimizer"]) == {"num_updates", "loss_scaler", "loss_scaler_state"}
    assert (meta["lr_scheduler"]["step_unit"], meta["lr_scheduler"]["num_steps"]) == ("samples", 12)
    families = {k.split("/")[0] if not k.startswith("optim/") else "optim/*/" + k.rsplit("/", 1)[1]
                for k in CheckpointReader(str(ckpt), meta).pieces}
    assert families == {"model", "optim/*/exp_avg", "optim/*/exp_avg_sq", "rng"}
    assert run_distributed(_loaded, 1, argv + ["--load", str(tmp_path)])[0] == (3, 12, 8, 12, 3)

    older = {k: v for k, v in meta.items() if k not in ("checksum", "consumed_valid_samples")}
    older["lr_scheduler"] = {"num_steps": 3}  # it counted updates: 3 x the global batch of 4 samples
    (ckpt / "metadata.json").write_text(json.dumps(older))
    assert run_distributed(_loaded, 1, argv + ["--load", str(tmp_path)])[0] == (3, 12, 0, 12, 3)
