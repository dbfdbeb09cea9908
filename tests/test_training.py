"""The real training loop: TP layouts reproduce TP=1 losses, the CLI works end to end, the
built-in default learns, and wandb / TensorBoard record what the metrics file records."""
import glob
import re
import struct

import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, TINY, read_metrics, records_of, torchrun, train_in_process


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tp_layouts_reproduce_single_process_losses(family):
    argv = TINY + (LLAMA_SWITCHES if family == "llama" else [])
    ref = records_of(run_distributed(train_in_process, 1, argv))
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"], "the reference run should learn"
    for tp, sp in ((2, []), (2, ["--sequence-parallel"]), (4, ["--sequence-parallel"])):
        out = records_of(run_distributed(train_in_process, tp, argv + ["--tensor-model-parallel-size", str(tp)] + sp))
        assert_same_run(ref, out, grad_norm_rtol=1e-6, what=f"tp{tp} {sp}")


@pytest.mark.slow  # torchrun twice (~30 s); TP/SP parity runs in fork worlds in test_tensor_parallel.py
def test_cli_tp2_sequence_parallel_matches_tp1(tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0"]
    torchrun(1, base, tmp_path / "tp1.jsonl")
    proc = torchrun(2, base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path / "tp2.jsonl")
    assert re.search(r"iteration\s+5/5 \|.*lm loss: [0-9.E+-]+ \|.*tokens/s: \d+", proc.stdout), proc.stdout
    ref, out = read_metrics(tmp_path / "tp1.jsonl"), read_metrics(tmp_path / "tp2.jsonl")
    for rec in out:
        for key in ("iteration", "lm_loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"):
            assert key in rec, key
    assert_same_run(ref, out, grad_norm_rtol=1e-6)


def test_default_run_learns(tmp_path):
    """The README's default command (shortened): loss falls well below its start."""
    torchrun(2, ["--train-iters", "60"], tmp_path / "m.jsonl")
    recs = read_metrics(tmp_path / "m.jsonl")
    assert len(recs) == 60
    first, last = recs[0]["lm_loss"], sum(r["lm_loss"] for r in recs[-5:]) / 5
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}: the default run did not learn"
    assert recs[-1].get("val_lm_loss") is not None and recs[-1]["val_lm_loss"] < 0.7 * first


def _wandb_history(run_dir, key):
    """lm_loss per step from an offline wandb run file (LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(glob.glob(f"{run_dir}/**/run-*.wandb", recursive=True)[0], "rb").read()
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    out = {}
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            if key in items:
                out[int(items["_step"])] = float(items[key])
    return out


def test_wandb_offline_and_tensorboard_record_the_metrics(tmp_path, monkeypatch, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    argv = TINY + ["--metrics-file", str(tmp_path / "m.jsonl"), "--tensorboard-dir", str(tmp_path / "tb"),
                   "--wandb-project", "ml-test", "--wandb-exp-name", "t", "--wandb-save-dir", str(tmp_path / "wb")]
    run_distributed(train_in_process, 1, argv)
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(tmp_path / "m.jsonl")}
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("lm loss")}  # Megatron-LM's tag names
    assert tb.keys() == expected.keys()
    for step, v in expected.items():
        assert abs(tb[step] - v) <= 1e-6 * abs(v)  # TensorBoard stores float32
    samples = {r["consumed_samples"]: r for r in read_metrics(tmp_path / "m.jsonl")}
    for tag, key in (("lm loss vs samples", "lm_loss"), ("learning-rate vs samples", "lr"),
                     ("batch-size vs samples", "global_batch_size"), ("grad-norm vs samples", "grad_norm")):
        series = {e.step: e.value for e in acc.Scalars(tag)}
        assert series == pytest.approx({c: r[key] for c, r in samples.items()}, rel=1e-6), tag
    tags = acc.Tags()
    assert {"learning-rate", "batch-size", "grad-norm", "iteration-time", "throughput"} <= set(tags["scalars"])
    assert "lm_loss" not in tags["scalars"] and "lr" not in tags["scalars"]
    text = {t[:-len("/text_summary")]: acc.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in tags["tensors"]}
    assert (text["num_layers"], text["micro_batch_size"], text["wandb_exp_name"]) == ("2", "2", "t")  # the arguments
    assert _wandb_history(tmp_path / "wb", "lm loss") == expected
    run_dir = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))  # Megatron-LM's layout
    assert len(run_dir) == 1
    assert (f"> wandb: run t of project ml-test, offline, in {run_dir[0]} (upload it with: wandb sync {run_dir[0]})"
            in capfd.readouterr().out.splitlines())
