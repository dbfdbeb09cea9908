"""Pretrain a GPT model. Launch with torchrun; flags follow Megatron-LM.

    torchrun --nproc_per_node=2 pretrain_gpt.py            # the built-in default, on CPU or GPU
    torchrun --nproc_per_node=8 pretrain_gpt.py --model llama3-8b --tensor-model-parallel-size 8 ...

Configuration errors are reported as one line on stderr with exit code 2, before any process
group is created.
"""
from __future__ import annotations

import os
import sys

from megatron_lite.arguments import parse_args
from megatron_lite.config import Config
from megatron_lite.errors import ConfigError

# Model fields that are the run's, not the architecture's: --use-checkpoint-args keeps these flags.
RUN_MODEL_FIELDS = ("attention_dropout", "hidden_dropout", "init_method_std", "attention_backend")


def resolve(argv=None) -> tuple:
    """Parse and validate; returns (config, tokenizer). Raises ConfigError on bad input. Torch and
    the model stack are not imported here unless a checkpoint must be read, so that `--help` and a
    configuration error take a second, not the import of the model stack."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.data.tokenizers import tokenizer_from_config

    from models.zoo import zoo

    cfg: Config = parse_args(argv, zoo())
    d, t = cfg.data, cfg.training
    saved = None
    if t.use_checkpoint_args or (t.global_batch_size is None and t.step_batch_size_schedule is None and t.save):  # the checkpoint's model / batch
        from megatron_lite.checkpoint.foreign import foreign_run_config
        from megatron_lite.checkpoint.manager import checkpoint_run_config, inherit_global_batch_size

        saved = foreign_run_config(t, checkpoint_formats()) if t.use_checkpoint_args else None
        saved = saved or checkpoint_run_config(t)
        if saved is not None:  # --use-checkpoint-args: the checkpoint's architecture and tokenizer, the run's flags
            cfg.model = ModelConfig(**_with_run_flags(saved["model_config"], cfg))
            _take_checkpoint_tokenizer(saved, cfg)
        inherited = inherit_global_batch_size(t)
        if inherited is not None and int(os.environ.get("RANK", "0")) == 0:
            print(f"> global batch size {inherited} from the checkpoint in --save (--global-batch-size not given)")
    tokenizer = tokenizer_from_config(d)
    # the checkpoint's model may have more rows than its tokenizer (Megatron-LM's padded vocabulary)
    vocab = cfg.model.tokenizer_vocab if saved is not None else tokenizer.vocab_size
    if vocab != tokenizer.vocab_size:
        from megatron_lite.checkpoint.loader import vocab_hint

        what = "tokenizer_vocab_size" if saved is not None and cfg.model.tokenizer_vocab_size else "vocab_size"
        raise ConfigError(f"--use-checkpoint-args: the checkpoint's {what} is {vocab} and {tokenizer.name}'s "
                          f"{tokenizer.vocab_size}{vocab_hint(vocab, use_checkpoint_args=True)}")
    if saved is None:
        cfg.model.vocab_size = tokenizer.vocab_size
    from megatron_lite.data.default_corpus import default_corpus_note

    cfg.notes += filter(None, [default_corpus_note(d, t)])
    if int(os.environ.get("RANK", "0")) == 0:
        for note in cfg.notes:
            print(f"> note: {note}", flush=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.finalize(world_size).validate(world_size)
    from megatron_lite.data.builder import check_data_paths, parse_split

    check_data_paths(d, tokenizer)
    if t.train_iters > 0 and parse_split(d.split)[0] == 0:
        raise ConfigError(f"--split {d.split} leaves no training data; give the first (train) part a weight")
    return cfg, tokenizer


def _with_run_flags(saved: dict, cfg: Config) -> dict:
    """The checkpoint's model config with the run's own model flags given on the command line
    (dropout, init, attention backend: Megatron-LM's load_args_from_checkpoint takes only the
    architecture); an architecture flag that the checkpoint overrides gets a note."""
    for k, v in cfg.model_flags.items():
        if k not in RUN_MODEL_FIELDS + ("vocab_size",) and k in saved and saved[k] != v:  # vocab: the tokenizer's
            cfg.notes.append(f"--{k.replace('_', '-')} {v} is overridden by --use-checkpoint-args: the checkpoint's "
                             f"{saved[k]}")
    return {**saved, **{k: v for k, v in cfg.model_flags.items() if k in RUN_MODEL_FIELDS}}


def _take_checkpoint_tokenizer(saved: dict, cfg: Config) -> None:
    """--use-checkpoint-args without tokenizer flags: the tokenizer the checkpoint records (its
    run's, or the HF tokenizer hf-to-ml copied), so the vocabulary matches without a guess."""
    from megatron_lite.data.tokenizers import TOKENIZER_FIELDS

    data = (saved.get("config") or {}).get("data") or {}
    if "tokenizer_type" not in data or any(k in cfg.data_flags for k in TOKENIZER_FIELDS):
        return
    changed = {k: data[k] for k in TOKENIZER_FIELDS if k in data and getattr(cfg.data, k) != data[k]}
    for k, v in changed.items():
        setattr(cfg.data, k, v)
    if changed:  # a note only where the default would have been another tokenizer
        model = f" {data['tokenizer_model']}" if data.get("tokenizer_model") else ""
        cfg.notes.append(f"tokenizer {data['tokenizer_type']}{model} from the checkpoint (--use-checkpoint-args)")


def model_provider(cfg: Config, ctx):
    """GPT's model chunks for this rank (one per virtual pipeline stage), parameters still on the
    meta device: the optimizer's gradient buffers give them storage and draw their initial values
    in place (at ZeRO-3 only this rank's shard), so no rank ever holds more than its own."""
    from models.gpt import build_model

    from megatron_lite.parallel.pipeline.partition import LayerSplit

    return build_model(cfg.model, ctx, seed=cfg.training.seed, split=LayerSplit.of(cfg.parallel), materialize=False,
                       cpu_initialization=cfg.training.use_cpu_initialization)


def datasets_provider(cfg: Config, tokenizer, num_samples):
    """The GPT train / valid / test datasets (Megatron .bin/.idx, blends, mock, the built-in corpus)."""
    from megatron_lite.data import build_train_valid_test_datasets

    return build_train_valid_test_datasets(cfg.data, tokenizer, cfg.training.seq_length, cfg.training.seed,
                                           num_samples)


def make_trainer(cfg: Config, tokenizer, device):
    """The Trainer of a GPT run: GPT's model, datasets and forward step."""
    from megatron_lite.training.loop import Trainer
    from models.gpt import gpt_forward_step

    return Trainer(cfg, tokenizer, device, model_provider=model_provider, datasets_provider=datasets_provider,
                   forward_step=gpt_forward_step, checkpoint_formats=checkpoint_formats())


def checkpoint_formats() -> tuple:
    """The foreign checkpoint formats --load reads (--ckpt-format / --auto-detect-ckpt-format)."""
    from models.megatron_torch_dist import TorchDistFormat

    return (TorchDistFormat(),)


def main(argv=None) -> int:
    from megatron_lite.launch import launch

    return launch(lambda: resolve(argv), lambda resolved: resolved[0].training.device,
                  lambda resolved, device: make_trainer(*resolved, device).train(),
                  timeout_of=lambda resolved: resolved[0].training.distributed_timeout_minutes)


if __name__ == "__main__":
    sys.exit(main())
