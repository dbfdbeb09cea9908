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


def resolve(argv=None) -> tuple:
    """Parse and validate; returns (config, tokenizer). Raises ConfigError on bad input."""
    from megatron_lite.checkpoint.manager import checkpoint_model_config, inherit_global_batch_size
    from megatron_lite.config import ModelConfig
    from megatron_lite.data.tokenizers import tokenizer_from_config
    from megatron_lite.data.builder import check_data_paths, parse_split

    from models.zoo import zoo

    cfg: Config = parse_args(argv, zoo())
    d = cfg.data
    tokenizer = tokenizer_from_config(d)
    saved_model = checkpoint_model_config(cfg.training)
    if saved_model is not None:  # --use-checkpoint-args: the checkpoint's shape, not the model flags
        cfg.model = ModelConfig(**saved_model)
    cfg.model.vocab_size = tokenizer.vocab_size
    inherited = inherit_global_batch_size(cfg.training)
    if inherited is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"> global batch size {inherited} from the checkpoint in --save (--global-batch-size not given)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.finalize(world_size).validate(world_size)
    check_data_paths(d, tokenizer)
    if cfg.training.train_iters > 0 and parse_split(d.split)[0] == 0:
        raise ConfigError(f"--split {d.split} leaves no training data; give the first (train) part a weight")
    return cfg, tokenizer


def model_provider(cfg: Config, ctx):
    """GPT's model chunks for this rank (one per virtual pipeline stage), parameters still on the
    meta device: the optimizer's gradient buffers give them storage and draw their initial values
    in place (at ZeRO-3 only this rank's shard), so no rank ever holds more than its own."""
    from models.gpt import build_model

    p = cfg.parallel
    return build_model(cfg.model, ctx, seed=cfg.training.seed, first_stage_layers=p.decoder_first_pipeline_num_layers,
                       last_stage_layers=p.decoder_last_pipeline_num_layers, materialize=False,
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
                   forward_step=gpt_forward_step)


def main(argv=None) -> int:
    from megatron_lite.launch import launch

    return launch(lambda: resolve(argv), lambda resolved: resolved[0].training.device,
                  lambda resolved, device: make_trainer(*resolved, device).train(),
                  timeout_of=lambda resolved: resolved[0].training.distributed_timeout_minutes)


if __name__ == "__main__":
    sys.exit(main())
