"""Hugging Face checkpoints in and out of training, through tools/convert_checkpoint.py.

For every family: save_pretrained -> hf-to-ml at TP1, at TP2 x PP2 (and EP2 for MoE) -> the
training run started from that checkpoint has the first-iteration loss of HF's own model on the
same tokens; -> ml-to-hf -> from_pretrained (no missing or unexpected keys) gives back the
original tensors. Conversion streams: peak memory stays near the largest tensor (no target rank's
model is materialized; ml-to-hf writes each tensor before it reads the next). Unsupported or
broken inputs are one-line errors."""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megatron_lite.data.gpt_dataset import MockGPTDataset, SampleOptions  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from test_hf_parity import MOE, NAMES, VOCAB, hf_model  # noqa: E402
from training_utils import ROOT, records_of, train_in_process  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint as tool  # noqa: E402

SEQ, BATCH, SEED = 16, 4, 1234
RUN = ["--mock-data", "--vocab-size", str(VOCAB - 1), "--seq-length", str(SEQ), "--micro-batch-size", "2",
       "--global-batch-size", str(BATCH), "--train-iters", "1", "--eval-iters", "0", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
       "--use-checkpoint-args", "--seed", str(SEED)]  # NullTokenizer: VOCAB - 1 ids + its end of document
LAYOUTS = {"tp1": ([], 1), "tp2pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4),
           "ep2": (["--expert-model-parallel-size", "2"], 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> a save_pretrained directory of the tiny HF model."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in NAMES:
        hf_model(name).save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf_first_loss(name) -> float:
    """HF's loss on the first global batch the run trains on (the mock samples 0..BATCH-1)."""
    data = MockGPTDataset(VOCAB, SEQ, BATCH, SEED, SampleOptions(eod=VOCAB - 1))
    tokens = torch.stack([data[i]["tokens"] for i in range(BATCH)])
    labels = torch.stack([data[i]["labels"] for i in range(BATCH)])
    with torch.no_grad():
        logits = hf_model(name)(tokens).logits.float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


def _convert(*args) -> int:
    return tool.main([str(a) for a in args])


def _cases():
    for name in NAMES:
        for layout in ("tp1", "tp2pp2") + (("ep2",) if name in MOE else ()):
            yield name, layout


@pytest.mark.parametrize("name,layout", list(_cases()))
def test_training_starts_from_the_converted_checkpoint(saved, tmp_path, name, layout):
    flags, world = LAYOUTS[layout]
    ckpt = tmp_path / "ckpt"
    assert _convert("hf-to-ml", "--hf-dir", saved[name], "--out", ckpt, *flags) == 0
    meta = json.load(open(ckpt / "iter_0000000" / "metadata.json"))
    assert meta["weights_only"] and meta["layout"]["world_size"] == world and len(meta["files"]) == world
    first = records_of(run_distributed(train_in_process, world, RUN + flags + ["--load", str(ckpt)]))[0]
    assert abs(first["lm_loss"] - _hf_first_loss(name)) < 1e-4, (first["lm_loss"], _hf_first_loss(name))


def _disk_state(path):
    from safetensors.torch import load_file
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


@pytest.mark.parametrize("name", NAMES)
def test_ml_to_hf_gives_back_the_original_tensors(saved, tmp_path, name, caplog):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert _convert("hf-to-ml", "--hf-dir", saved[name], "--out", ckpt, "--tensor-model-parallel-size", "2") == 0
    assert _convert("ml-to-hf", "--load", ckpt, "--out", back, "--max-shard-size-gb", "0.0001") == 0
    assert (back / "model.safetensors.index.json").exists() and (back / "generation_config.json").exists()
    original = _disk_state(saved[name])
    converted = _disk_state(back)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], original[k]) for k in original)
    with caplog.at_level(logging.WARNING, logger="transformers"):
        reloaded = type(hf_model(name)).from_pretrained(back)
    assert not [r for r in caplog.records if "missing" in r.message.lower() or "unexpected" in r.message.lower()]
    tokens = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(reloaded.eval()(tokens).logits, hf_model(name)(tokens).logits, atol=1e-5)


def _peak_rss_mb(argv) -> float:
    """Peak resident memory (MiB) of the converter run in a fresh process, above its start."""
    code = ("import resource, sys; sys.path.insert(0, {tools!r}); import convert_checkpoint as t, transformers; "
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; rc = t.main({argv!r}); "
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code.format(tools=os.path.join(ROOT, "tools"), argv=argv)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_conversion_streams_tensor_by_tensor(tmp_path):
    """A model of many tensors (~150 MB): peak memory < 1.5 x the largest tensor (8 MB) + a constant
    (the same conversion of a model 30x smaller measures the constant)."""
    sizes = {}
    for name, layers, hidden in (("big", 12, 512), ("small", 1, 128)):
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=4 * hidden, vocab_size=4096,
                                       tie_word_embeddings=False)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        model.to_empty(device="cpu")
        model.save_pretrained(tmp_path / name, max_shard_size="40MB")
        del model
        peak = _peak_rss_mb(["hf-to-ml", "--hf-dir", str(tmp_path / name), "--out", str(tmp_path / f"{name}-ml")])
        sizes[name] = peak
    largest = 4096 * 512 * 4 / 2**20
    assert sizes["big"] < sizes["small"] + 1.5 * largest + 16, sizes


@pytest.mark.parametrize("name", ["llama_gqa", "mixtral"])
def test_layout_conversions_never_draw_initial_weights(saved, tmp_path, monkeypatch, name):
    """hf-to-ml and reshard build every target rank's model for its shapes and shard specs only: the
    parameters stay on the meta device (a materialized model per rank held the whole model)."""
    from megatron_lite.parallel.tiled_init import TiledInit

    def refuse(*args, **kwargs):
        raise AssertionError("a conversion drew initial weights")

    monkeypatch.setattr(TiledInit, "fill_local", refuse)
    monkeypatch.setattr(TiledInit, "fill_box", refuse)
    ckpt, flags = tmp_path / "ckpt", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert _convert("hf-to-ml", "--hf-dir", saved[name], "--out", ckpt, *flags) == 0
    assert _convert("reshard", "--load", ckpt, "--out", tmp_path / "tp1") == 0


def test_ml_to_hf_writes_each_tensor_before_reading_the_next(saved, tmp_path, monkeypatch):
    """One file of everything (the default 5 GB shards): still, whenever ml-to-hf reads a tensor,
    every tensor it read before is already in the output file (a few KiB of buffered writes aside)."""
    from megatron_lite.checkpoint.reader import CheckpointReader

    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert _convert("hf-to-ml", "--hf-dir", saved["llama_gqa"], "--out", ckpt, "--tensor-model-parallel-size", "2") == 0
    read_full, pending = CheckpointReader.read_full, []

    def on_disk() -> int:
        return sum(f.stat().st_size for f in back.glob("*.safetensors*")) if back.exists() else 0  # .tmp while written

    def watched(self, key, dtype=None):
        pending.append(watched.read - on_disk())  # bytes read before this call, not yet written
        out = read_full(self, key, dtype)
        watched.read += out.numel() * out.element_size()
        return out

    watched.read = 0
    monkeypatch.setattr(CheckpointReader, "read_full", watched)
    assert _convert("ml-to-hf", "--load", ckpt, "--out", back) == 0
    assert len(pending) > 10 and watched.read > 100_000, (len(pending), watched.read)
    assert max(pending) <= 16 * 1024, max(pending)


def test_bad_inputs_are_one_line_errors(saved, tmp_path, capsys):
    assert _convert("hf-to-ml", "--hf-dir", tmp_path / "nope", "--out", tmp_path / "o") == 2
    transformers.BertConfig().save_pretrained(tmp_path / "bert")
    assert _convert("hf-to-ml", "--hf-dir", tmp_path / "bert", "--out", tmp_path / "o") == 2
    yarn = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                    vocab_size=10, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    transformers.LlamaForCausalLM(yarn).save_pretrained(tmp_path / "yarn")
    assert _convert("hf-to-ml", "--hf-dir", tmp_path / "yarn", "--out", tmp_path / "o") == 2
    sharded = tmp_path / "sharded"
    hf_model("llama_gqa").save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(sharded) if f.startswith("model-"))
    os.remove(sharded / shards[-1])
    assert _convert("hf-to-ml", "--hf-dir", sharded, "--out", tmp_path / "o") == 2
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    hf_model("llama_gqa").config.save_pretrained(pickled)
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "evil": argparse.Namespace()}, pickled / "pytorch_model.bin")
    assert _convert("hf-to-ml", "--hf-dir", pickled, "--out", tmp_path / "o") == 2
    # (transformers' save_pretrained writes progress bars to stderr too)
    err = [line for line in capsys.readouterr().err.splitlines() if "Writing model shards" not in line and line.strip()]
    assert len(err) == 5, err
    for line, fragment in zip(err, ["not a directory", "model_type 'bert'", "rope_type 'dynamic'", "missing",
                                    "weights_only"]):
        assert line.startswith("convert_checkpoint.py hf-to-ml: error: ") and fragment in line, line


def test_a_header_claiming_a_terabyte_is_one_line(tmp_path, capsys):
    """Issue 26: a safetensors header whose length field says 10^12 bytes was a MemoryError."""
    import struct

    hf = tmp_path / "hf"
    hf_model("llama_gqa").save_pretrained(hf)
    with open(hf / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 10 ** 12))
    size = os.path.getsize(hf / "model.safetensors")
    capsys.readouterr()
    assert _convert("hf-to-ml", "--hf-dir", hf, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"convert_checkpoint.py hf-to-ml: error: {hf / 'model.safetensors'} is not a readable safetensors "
                   f"file: the header claims {10 ** 12} bytes but the file has {size}"), err
    assert not (tmp_path / "o").exists()


def test_a_tensor_claiming_a_terabyte_is_one_line(tmp_path, capsys):
    """Issue 39: a valid header whose one tensor's data_offsets claim 10^12 bytes was an allocation failure."""
    import json
    import struct

    hf = tmp_path / "hf"
    hf_model("llama_gqa").save_pretrained(hf)
    path = hf / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10 ** 12]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    capsys.readouterr()
    assert _convert("hf-to-ml", "--hf-dir", hf, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"convert_checkpoint.py hf-to-ml: error: {path} is not a readable safetensors file: tensor "
                          f"{name} claims bytes [0, {10 ** 12})") and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_a_conversion_onto_its_own_input_is_one_line(tmp_path, capsys):
    """Issue 39: reshard --load X --out X rewrote its own input in place."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "keep").write_text("x")
    for command in ("reshard", "consolidate"):
        assert _convert(command, "--load", ckpt, "--out", str(ckpt) + "/") == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"convert_checkpoint.py {command}: error: --out {ckpt}/ is the --load checkpoint: writing it "
                       f"would replace its own input; give another --out directory"), err
    assert os.listdir(ckpt) == ["keep"]


# --- tokenizers: HF fine-tuning without guesses (issue 28, point 4) ----------------------------
def _word_tokenizer(n: int):
    """A HF fast tokenizer of exactly n ids (w0 .. w{n-2}, then </s> as eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n - 1)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="w0")


FT = ["--pretrained-checkpoint", None, "--use-checkpoint-args", "--mock-data", "--seq-length", str(SEQ),
      "--micro-batch-size", "2", "--train-iters", "1", "--device", "cpu"]


def _finetune_args(ckpt, *extra):
    return [str(ckpt) if a is None else a for a in FT] + list(extra)


def test_hf_to_ml_copies_the_tokenizer_and_fine_tuning_takes_it(saved, tmp_path):
    from pretrain_gpt import resolve

    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(saved["llama_gqa"], hf)
    _word_tokenizer(VOCAB).save_pretrained(hf)
    ckpt = tmp_path / "ckpt"
    assert _convert("hf-to-ml", "--hf-dir", hf, "--out", ckpt) == 0
    assert (ckpt / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    meta = json.load(open(ckpt / "iter_0000000" / "metadata.json"))
    assert meta["config"]["data"] == {"tokenizer_type": "HuggingFaceTokenizer",
                                      "tokenizer_model": str((ckpt / "tokenizer").resolve())}
    cfg, tokenizer = resolve(_finetune_args(ckpt))  # no tokenizer flag: the checkpoint's, no guess
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eod) == ("HuggingFaceTokenizer", VOCAB, VOCAB - 1)
    assert cfg.model.vocab_size == VOCAB and cfg.data.tokenizer_model == str((ckpt / "tokenizer").resolve())
    assert any("from the checkpoint (--use-checkpoint-args)" in n for n in cfg.notes)
    cfg, tokenizer = resolve(_finetune_args(ckpt, "--vocab-size", str(VOCAB - 1)))  # explicit flags win
    assert tokenizer.name == "NullTokenizer" and cfg.model.vocab_size == VOCAB
    # A training checkpoint carries its run's tokenizer (NullTokenizer's --vocab-size too) and padding.
    run = tmp_path / "run"
    run_distributed(train_in_process, 1, ["--model", "llama-tiny", "--mock-data", "--vocab-size", "99", "--seq-length",
                                          str(SEQ), "--micro-batch-size", "2", "--train-iters", "1", "--device", "cpu",
                                          "--make-vocab-size-divisible-by", "32", "--save", str(run)])
    cfg, tokenizer = resolve(["--load", str(run), "--use-checkpoint-args"] + FT[3:] + ["--train-iters", "2"])
    assert (tokenizer.name, tokenizer.vocab_size, cfg.model.vocab_size) == ("NullTokenizer", 100, 100)
    assert cfg.model.make_vocab_size_divisible_by == 32 and not [n for n in cfg.notes if "overridden" in n]


def test_a_vocabulary_mismatch_names_the_flag_to_pass(saved, tmp_path):
    from megatron_lite.errors import ConfigError
    from pretrain_gpt import resolve

    ckpt = tmp_path / "ckpt"  # no tokenizer beside the weights: nothing recorded
    assert _convert("hf-to-ml", "--hf-dir", saved["llama_gqa"], "--out", ckpt) == 0
    assert "data" not in json.load(open(ckpt / "iter_0000000" / "metadata.json"))["config"]
    with pytest.raises(ConfigError) as e:
        resolve(_finetune_args(ckpt))  # ByteTokenizer's 257 against the model's 100
    assert "vocab_size is 100 and ByteTokenizer's 257" in str(e.value) and "--vocab-size 99" in str(e.value)
    assert "--tokenizer-type / --tokenizer-model" in str(e.value) and "\n" not in str(e.value)
    from megatron_lite.checkpoint.loader import config_diffs  # without --use-checkpoint-args: the load says
    assert config_diffs({"vocab_size": 100}, {"vocab_size": 257}) == [
        "vocab_size is 100 there and 257 here (the vocabulary is the tokenizer's: pass --use-checkpoint-args to take "
        "the checkpoint's tokenizer, or the --tokenizer-type / --tokenizer-model it was trained with; NullTokenizer: "
        "--vocab-size 99)"]


def test_ml_to_hf_writes_a_byte_level_tokenizer_equal_to_ours_and_keeps_eos(saved, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from megatron_lite.data.tokenizers import ByteTokenizer

    run, back = tmp_path / "run", tmp_path / "back"
    run_distributed(train_in_process, 1, ["--model", "llama-tiny", "--mock-data", "--seq-length", str(SEQ),
                                          "--micro-batch-size", "2", "--train-iters", "1", "--device", "cpu",
                                          "--save", str(run)])
    assert _convert("ml-to-hf", "--load", run, "--out", back) == 0
    config = json.load(open(back / "config.json"))
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (256, None, None)
    assert GenerationConfig.from_pretrained(back).eos_token_id == 256  # HF generate stops there
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(back).generation_config.eos_token_id == 256
    hf, ours = AutoTokenizer.from_pretrained(back), ByteTokenizer()
    assert (len(hf), hf.eos_token_id) == (257, 256)
    for text in ["def f(x):\n    return x  # ü€😀", "  two  spaces\t", "<|endoftext|> is bytes too", ""]:
        ids = hf(text)["input_ids"]
        assert ids == ours.tokenize(text)
        assert hf.decode(ids) == ours.detokenize(ids) == text
    assert hf.decode([104, 105, 256], skip_special_tokens=True) == ours.detokenize([104, 105, 256]) == "hi"
    assert hf.decode([0xC3, 104]) == ours.detokenize([0xC3, 104])  # a broken UTF-8 sequence: U+FFFD both ways
