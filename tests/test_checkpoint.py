"""Checkpoints through the real training loop (forked gloo ranks): bit-exact resume, resharding
on load, precision changes, weights-only loading, async saves and pruning, the offline tools, and
the errors a broken or foreign checkpoint gives.

A run "saved at 5" is the same command with `--save DIR --exit-interval 5`; its continuation is
a new set of processes with `--load DIR` (and the same --train-iters, so the LR schedule agrees)."""
import json
import math
import os
import shutil
import sys

import pytest
import torch

from megatron_lite.checkpoint import CheckpointReader, read_metadata, read_tracker
from megatron_lite.parallel.sharding import gather_full
from megatron_lite.testing import assert_same_run, WorkerError, run_distributed
from training_utils import LLAMA_SWITCHES, ROOT, TINY, losses_of, merged_params, train_and_gather, train_in_process

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # exercises the RNG states


def run(world, argv):
    return losses_of(run_distributed(train_in_process, world, argv))


def save_then_resume(world, argv, ckpt, at, save_flags=()):
    """Losses of the first `at` iterations (then save and exit) and of the resumed rest."""
    first = run(world, argv + ["--save", str(ckpt), "--exit-interval", str(at), *save_flags])
    second = run(world, argv + ["--save", str(ckpt), "--load", str(ckpt), *save_flags])
    return first, second


def assert_rel_close(actual, expected, rtol=1e-5):
    assert_same_run(expected, actual, rtol=rtol)


def assert_exact_coverage(ckpt_dir):
    """Every stored tensor's pieces add up to exactly its elements (each written once)."""
    reader = CheckpointReader(ckpt_dir, read_metadata(ckpt_dir))
    for key, pieces in reader.pieces.items():
        total = sum(math.prod(n for _, n in p.box) for p in pieces)
        assert total == math.prod(reader.shapes[key]), f"{key}: {total} elements in pieces"


# --- bit-exact resume at the same layout ------------------------------------------------------
@pytest.mark.parametrize("world,flags,save_flags", [
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"] + DROPOUT, []),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
         "--micro-batch-size", "1"] + DROPOUT, []),
    (2, ["--bf16", "--zero-stage", "2"], ["--async-save", "--save-interval", "2"]),
    (2, ["--fp16", "--zero-stage", "3", "--initial-loss-scale", "1024"], []),
], ids=["tp2-sp-dp2-zero1", "pp2-virtual", "bf16-zero2-async", "fp16-zero3"])
def test_resume_is_bit_exact(tmp_path, world, flags, save_flags):
    argv = TINY + ["--train-iters", "10"] + flags
    straight = run(world, argv)
    first, second = save_then_resume(world, argv, tmp_path / "ckpt", 5, save_flags)
    assert first + second == straight  # exact equality of every lm_loss
    assert read_tracker(str(tmp_path / "ckpt")) == 10  # the final save at the end of training


def test_resume_without_rng_states_differs_with_dropout(tmp_path):
    """The RNG states matter (so the bit-exact test above does test them)."""
    argv = TINY + ["--train-iters", "4"] + DROPOUT
    straight = run(1, argv)
    run(1, argv + ["--save", str(tmp_path), "--exit-interval", "2"])
    second = run(1, argv + ["--load", str(tmp_path), "--no-load-rng"])
    assert second != straight[2:]


def test_exit_duration_saves_and_stops(tmp_path):
    argv = TINY + ["--train-iters", "50", "--save", str(tmp_path), "--exit-duration-in-mins", "1e-6"]
    assert len(run(2, argv)) == 1  # past the budget after the first iteration: save, stop
    assert read_tracker(str(tmp_path)) == 1


# --- resharding on load -----------------------------------------------------------------------
RESHARD = TINY + LLAMA_SWITCHES + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
                                   "--train-iters", "8"]
TP2_PP2_DP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def llama_reference():
    return run(1, RESHARD)


@pytest.fixture(scope="module")
def tp2_pp2_dp2_checkpoint(tmp_path_factory, llama_reference):
    """Saved at iteration 5 by TP2 x PP2 x DP2 with ZeRO-1 (llama: GQA, SwiGLU, untied), with the
    full parameters at that point."""
    ckpt = tmp_path_factory.mktemp("tp2pp2dp2")
    results = run_distributed(train_and_gather, 8, RESHARD + TP2_PP2_DP2 + ["--save", str(ckpt), "--exit-interval", "5"])
    assert_rel_close(losses_of([r[0] for r in results]), llama_reference[:5])
    return ckpt, merged_params(results)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "1", "--use-distributed-optimizer"],
                                    ["--tensor-model-parallel-size", "4"]], ids=["tp1-dp4", "tp4-dp1"])
def test_load_at_another_layout(tp2_pp2_dp2_checkpoint, llama_reference, layout):
    ckpt, _ = tp2_pp2_dp2_checkpoint
    assert_exact_coverage(os.path.join(ckpt, "iter_0000005"))
    assert_rel_close(run(4, RESHARD + layout + ["--load", str(ckpt)]), llama_reference[5:])


def test_zero3_and_zero0_reshard_into_each_other(tmp_path):
    """GPT-2 (tied embedding): ZeRO-3 -> ZeRO-0 with a pipeline (the last stage's copy of the
    embedding is read from the embedding), and ZeRO-0 with a pipeline -> ZeRO-3."""
    argv = TINY + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "8"]
    ref = run(1, argv)
    zero3 = ["--zero-stage", "3", "--tensor-model-parallel-size", "2"]
    zero0_pp = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    for saver, loader, name in ((zero3, zero0_pp, "z3"), (zero0_pp, ["--zero-stage", "3"], "z0")):
        ckpt = tmp_path / name
        assert_rel_close(run(4, argv + saver + ["--save", str(ckpt), "--exit-interval", "5"]), ref[:5])
        assert_rel_close(run(4, argv + loader + ["--load", str(ckpt)]), ref[5:])


@pytest.mark.slow
def test_zero3_pipeline_layout_checkpoint_loads_elsewhere(tmp_path):
    """Saved by ZeRO-3 x PP2 x DP2 with the layout "E|tt|tt|L" (embedding and loss stages without
    layers, interleaved), resumed by ZeRO-1 x DP4: the single-process run, continued."""
    argv = TINY + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "8"]
    ref = run(1, argv)
    ckpt = tmp_path / "z3pp"
    saver = ["--zero-stage", "3", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
             "E|tt|tt|L", "--save", str(ckpt), "--exit-interval", "5"]
    assert_rel_close(run(4, argv + saver), ref[:5])
    assert_rel_close(run(4, argv + ["--zero-stage", "1", "--load", str(ckpt)]), ref[5:])


# --- what is loaded ---------------------------------------------------------------------------
def _loaded_state(rank, world, argv):
    """Build a trainer (which loads) and report what it holds, without training."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    params = {}
    with trainer.grad_sync.gathered_params():
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                params[name] = gather_full(p.data, p, trainer.dims).float()
    exp_avg = sum(s["exp_avg"].abs().sum().item() for _, s in trainer.optimizer.shard_tensors())
    return trainer.iteration, trainer.consumed_samples, params, exp_avg


def test_precision_change_and_weights_only_loading(tmp_path):
    argv = TINY + ["--train-iters", "3"]
    run(1, argv + ["--bf16", "--save", str(tmp_path)])
    ckpt = os.path.join(tmp_path, "iter_0000003")
    reader = CheckpointReader(ckpt, read_metadata(ckpt))
    assert reader.dtype("model/final_norm.weight") == torch.bfloat16
    assert reader.dtype("optim/final_norm.weight/main") == torch.float32

    it, consumed, params, exp_avg = run_distributed(_loaded_state, 1, argv + ["--load", str(tmp_path)])[0]
    assert (it, consumed) == (3, 12) and exp_avg > 0
    for name, value in params.items():  # fp32 run from a bf16 checkpoint: the fp32 main params
        assert torch.equal(value, reader.read_full(f"optim/{name}/main")), name

    for flag in ("--no-load-optim", "--finetune"):
        it, consumed, params, exp_avg = run_distributed(_loaded_state, 1, argv + ["--load", str(tmp_path), flag])[0]
        assert exp_avg == 0.0
        assert (it, consumed) == ((3, 12) if flag == "--no-load-optim" else (0, 0))
        for name, value in params.items():  # the stored (bf16) weights
            assert torch.equal(value, reader.read_full(f"model/{name}").float()), name


def test_async_saves_prune_and_record_the_layout(tmp_path):
    argv = TINY + ["--train-iters", "6", "--use-distributed-optimizer"]
    straight = run(2, argv)
    saved = run(2, argv + ["--save", str(tmp_path), "--save-interval", "1", "--keep-last", "2", "--async-save"])
    assert saved == straight
    assert sorted(os.listdir(tmp_path)) == ["iter_0000005", "iter_0000006", "latest_checkpointed_iteration.txt"]
    meta = read_metadata(os.path.join(tmp_path, "iter_0000006"))
    assert (meta["iteration"], meta["consumed_samples"]) == (6, 24)
    assert {k: meta["layout"][k] for k in ("tp", "pp", "dp", "zero_stage")} == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1}
    assert sorted(meta["files"]) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    for name, entry in meta["files"].items():
        assert os.path.getsize(os.path.join(tmp_path, "iter_0000006", name)) == entry["bytes"]
    keys = {k for entry in meta["files"].values() for k, *_ in entry["pieces"].values()}
    assert "optim/final_norm.weight/exp_avg_sq" in keys and not any(k.endswith("/main") for k in keys)
    assert {k for k in keys if k.startswith("rng/")} >= {"rng/tp0_cp0_dp0_pp0/cpu", "rng/tp0_cp0_dp1_pp0/cpu"}
    assert_exact_coverage(os.path.join(tmp_path, "iter_0000006"))


# --- offline tools ----------------------------------------------------------------------------
def _tool():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import convert_checkpoint
    finally:
        sys.path.pop(0)
    return convert_checkpoint


def test_consolidate_and_reshard_tools(tp2_pp2_dp2_checkpoint, llama_reference, tmp_path):
    from safetensors.torch import load_file

    tool = _tool()
    ckpt, params = tp2_pp2_dp2_checkpoint
    assert tool.main(["consolidate", "--load", str(ckpt), "--out", str(tmp_path / "full")]) == 0
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert sorted(full) == sorted(params)
    for name, value in full.items():
        assert torch.equal(value, params[name]), name
    assert json.load(open(tmp_path / "full" / "config.json"))["num_query_groups"] == 2
    assert tool.main(["ml-to-hf", "--ml-dir", str(tmp_path / "full"), "--out", str(tmp_path / "hf")]) == 0

    out = tmp_path / "tp4"
    assert tool.main(["reshard", "--load", str(ckpt), "--out", str(out), "--tensor-model-parallel-size", "4",
                      "--data-parallel-size", "2"]) == 0
    meta = read_metadata(os.path.join(out, "iter_0000005"))
    assert (meta["layout"]["tp"], meta["layout"]["dp"], len(meta["files"])) == (4, 2, 8)
    assert_exact_coverage(os.path.join(out, "iter_0000005"))
    assert_rel_close(run(4, RESHARD + ["--tensor-model-parallel-size", "4", "--load", str(out)]), llama_reference[5:])
    assert tool.main(["reshard", "--load", str(ckpt), "--out", str(tmp_path / "bad"),
                      "--tensor-model-parallel-size", "3"]) == 2


# --- errors -----------------------------------------------------------------------------------
ERR_ARGV = TINY + ["--train-iters", "2"]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("small")
    run(1, ERR_ARGV + ["--save", str(ckpt)])
    return ckpt


def _load_error(ckpt, extra=()):
    with pytest.raises(WorkerError) as e:
        run(1, ERR_ARGV + ["--load", str(ckpt), *extra])
    return str(e.value).strip().splitlines()[-1]


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, os.path.join(dst, "iter_0000002", "shard_00000.safetensors")


def test_truncated_shard_is_named(small_checkpoint, tmp_path):
    ckpt, shard = _copy(small_checkpoint, tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    assert "shard_00000.safetensors has" in _load_error(ckpt) and "truncated" in _load_error(ckpt)


def test_missing_shard_is_named(small_checkpoint, tmp_path):
    ckpt, shard = _copy(small_checkpoint, tmp_path)
    os.remove(shard)
    assert "shard_00000.safetensors is missing" in _load_error(ckpt)


def test_corrupted_header_is_named(small_checkpoint, tmp_path):
    ckpt, shard = _copy(small_checkpoint, tmp_path)
    with open(shard, "r+b") as f:
        f.write(b"\xff" * 16)  # same size, garbage header length and JSON
    assert "shard_00000.safetensors cannot be read" in _load_error(ckpt)


def test_foreign_model_config_names_the_field(small_checkpoint):
    msg = _load_error(small_checkpoint, ["--num-layers", "3"])
    assert "num_layers is 2 there and 3 here" in msg


def test_incomplete_checkpoint_is_refused(small_checkpoint, tmp_path):
    ckpt, _ = _copy(small_checkpoint, tmp_path)
    os.remove(os.path.join(ckpt, "iter_0000002", "metadata.json"))
    assert "incomplete: metadata.json is missing" in _load_error(ckpt)


@pytest.mark.parametrize("argv,message", [
    (["--keep-last", "2"], "--keep-last needs --save DIR"),
    (["--async-save"], "--async-save needs --save DIR"),
    (["--finetune"], "--finetune needs --load DIR"),
    (["--finetune", "--load", "/nonexistent/ckpt"], "--load directory /nonexistent/ckpt does not exist"),
    (["--save", "x", "--keep-last", "0"], "--keep-last (0) must be >= 1"),
])
def test_checkpoint_flag_validation(argv, message):
    from megatron_lite.errors import ConfigError
    from pretrain_gpt import resolve
    with pytest.raises(ConfigError) as e:
        resolve(TINY + argv)
    assert message in str(e.value)
