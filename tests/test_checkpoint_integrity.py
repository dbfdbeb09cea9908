"""A checkpoint that was damaged after it was written never loads silently, and an error that one
rank finds after the process group exists is reported once, by every rank, naming that rank."""
import json
import os

import pytest

from megatron_lite.checkpoint.directory import check_save_dir
from megatron_lite.checkpoint.files import read_header
from megatron_lite.errors import ConfigError
from megatron_lite.testing import run_distributed
from training_utils import TINY, torchrun, train_in_process

TINY = TINY + ["--global-batch-size", "8"]


def _train_or_error(rank, world, argv):
    """This rank's history, or the message of the ConfigError it raised."""
    try:
        return train_in_process(rank, world, argv)
    except ConfigError as e:
        return str(e)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DP=4 ZeRO-1 checkpoint after 2 iterations (4 shard files)."""
    ckpt = str(tmp_path_factory.mktemp("integrity") / "ckpt")
    run_distributed(train_in_process, 4, TINY + ["--train-iters", "2", "--save", ckpt, "--use-distributed-optimizer"])
    return ckpt


def _copy(saved, tmp_path):
    import shutil
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst, os.path.join(dst, "iter_0000002")


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _resume(ckpt, extra=()):
    return TINY + ["--train-iters", "3", "--load", ckpt, "--use-distributed-optimizer", *extra]


def test_a_flipped_byte_is_found_on_load_and_named(saved, tmp_path):
    ckpt, it = _copy(saved, tmp_path)
    shard = os.path.join(it, "shard_00001.safetensors")
    start, entries = read_header(shard)
    name, entry = next((n, e) for n, e in entries.items() if n.startswith("model/"))
    lo, hi = entry["data_offsets"]
    size = os.path.getsize(shard)
    _flip(shard, start + (lo + hi) // 2)
    assert os.path.getsize(shard) == size  # same size: the old size check could not see it
    messages = run_distributed(_train_or_error, 4, _resume(ckpt))
    assert all(isinstance(m, str) for m in messages), "a corrupted checkpoint loaded"
    assert len(set(messages)) == 1, messages  # every rank raises the same error
    msg = messages[0]
    assert "shard_00001.safetensors" in msg and "fails its checksum" in msg and name.split("@")[0] in msg, msg
    assert msg.startswith("[rank "), msg
    # --no-verify-checkpoint loads it anyway (the user's explicit choice)
    histories = run_distributed(_train_or_error, 4, _resume(ckpt, ["--no-verify-checkpoint"]))
    assert all(isinstance(h, list) and len(h) == 1 for h in histories), histories


def test_edited_metadata_is_refused(saved, tmp_path):
    ckpt, it = _copy(saved, tmp_path)
    path = os.path.join(it, "metadata.json")
    meta = json.load(open(path))
    meta["consumed_samples"] += 4
    json.dump(meta, open(path, "w"))
    messages = run_distributed(_train_or_error, 4, _resume(ckpt))
    assert all(isinstance(m, str) and "metadata.json is corrupted" in m for m in messages), messages


def test_corrupt_header_on_one_rank_is_one_line_from_every_rank(saved, tmp_path):
    ckpt, it = _copy(saved, tmp_path)
    with open(os.path.join(it, "shard_00002.safetensors"), "r+b") as f:
        f.seek(9)
        f.write(b"}}}}")  # the JSON header no longer parses
    proc = torchrun(4, _resume(ckpt), tmp_path / "m.jsonl", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: [rank 2] ") and "shard_00002" in errors[0], proc.stderr
    assert "Connection closed" not in proc.stderr and "megatron_lite/" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode != 0
    # torchrun stops the other workers as soon as one has exited: each exits 2 or dies by that SIGTERM
    codes = [line.split(":")[1].split()[0] for line in proc.stderr.splitlines() if line.strip().startswith("exitcode")]
    assert codes and set(codes) <= {"2", "-15"} and "2" in codes, proc.stderr[-3000:]
    assert run_distributed(_main, 4, _resume(ckpt)) == [2, 2, 2, 2]  # every rank's own exit code


def _main(rank, world, argv):
    os.environ["WORLD_SIZE"] = str(world)
    import pretrain_gpt
    return pretrain_gpt.main(argv)


def test_unwritable_save_is_found_at_start_up(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    messages = run_distributed(_train_or_error, 2, TINY + ["--save", str(blocker / "ckpt"), "--save-interval", "1"])
    assert all(isinstance(m, str) and "cannot be created" in m and "a_file" in m for m in messages), messages


def test_low_free_space_warns(tmp_path, capsys):
    check_save_dir(str(tmp_path / "ckpt"), expected_bytes=1 << 62, rank=0)
    assert "less than one checkpoint" in capsys.readouterr().err
