#!/usr/bin/env python
"""Loss and perplexity of a training checkpoint, at any layout.

    python tools/evaluate.py --load ckpt                              # the run's own validation data
    torchrun --nproc_per_node=4 tools/evaluate.py --load ckpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --data-path data/corpus_text_document --json

This is pretrain_gpt.py's Trainer with no training iteration: the checkpoint's weights are loaded
as `--load ... --finetune` would load them (any TP / PP / CP / DP / EP layout), and the loss is
the one its validation lines print (the mean of the per-step losses over the loss-bearing
tokens). Megatron-LM does the same with `--skip-train`; a separate tool keeps pretrain_gpt.py's
flags Megatron's own.

Flags are pretrain_gpt.py's. The model comes from the checkpoint (model flags are refused, except
those that do not change the weights' meaning such as --attention-backend); so do the
tokenizer, data, sequence length, batch sizes, seed and precision unless given. Which samples:
- no --data-path: the run's own validation split, `--eval-iters` global batches of it (the
  run's), from its start: the numbers of the run's first validation line at these weights;
- --data-path: the whole of it (`--split` defaults to 0,1,0), one pass of as many full global
  batches as it holds, unless --eval-iters says how many (--mock-data: --eval-iters batches).
Prints one line (`--json`: one JSON object) from the rank that holds the loss. Errors are one line
on stderr, exit status 2. The trainer allocates the optimizer's state even though nothing is
trained: evaluating needs the memory of a training run at that layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_lite.errors import ConfigError  # noqa: E402

# What evaluation takes from the run that wrote the checkpoint, unless the command line says otherwise.
CARRIED_TRAINING = ("seq_length", "micro_batch_size", "global_batch_size", "eval_iters", "seed", "bf16", "fp16")


def build_parser():
    from megatron_lite.arguments import build_parser as pretrain_parser
    from models.zoo import zoo

    p = pretrain_parser(zoo())
    p.description = "Loss and perplexity of a megatron-lite training checkpoint"
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    return p


def _given(args, cls) -> dict:
    """The fields of config dataclass `cls` set on the command line (the parser's defaults are
    left unset)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _model_config(saved, args):
    """The checkpoint's model, with the given flags that do not change what its weights mean."""
    from megatron_lite.checkpoint.loader import FREE_FIELDS
    from megatron_lite.config import ModelConfig
    from megatron_lite.transformer.moe.config import MoEConfig

    given, moe_given = _given(args, ModelConfig), _given(args, MoEConfig)
    fixed = sorted((set(given) | set(moe_given)) - FREE_FIELDS) + (["model"] if args.model else [])
    if fixed:
        raise ConfigError(f"--{fixed[0].replace('_', '-')}: the model comes from the checkpoint; drop the model flags")
    model = dataclasses.replace(saved, **given)
    if moe_given and model.moe is None:
        raise ConfigError(f"--{next(iter(moe_given)).replace('_', '-')}: the checkpoint's model has no experts")
    if moe_given:
        model.moe = dataclasses.replace(model.moe, **moe_given)
    return model


def _training_config(saved, args):
    from megatron_lite.config import TrainingConfig

    carried = {k: getattr(saved, k) for k in CARRIED_TRAINING}
    given = _given(args, TrainingConfig)
    if "micro_batch_size" in given and "global_batch_size" not in given:
        carried.pop("global_batch_size")  # follows the new micro-batch: micro x DP
    # Weights only, from the start of the evaluation data; nothing trained, saved or logged.
    forced = dict(load=args.load, finetune=True, train_iters=0, save=None)
    return TrainingConfig(**{**carried, **given, **forced})


def _data_config(saved, args):
    given = _given(args, type(saved))
    if (given.get("data_path") or given.get("mock_data")) and "split" not in given:
        given["split"] = "0,1,0"  # another corpus: all of it is evaluation data
    return dataclasses.replace(saved, **given)


@dataclasses.dataclass
class Evaluation:
    cfg: object  # the Config evaluated with
    tokenizer: object
    whole_split: bool  # one pass over all the evaluation data (else --eval-iters global batches)
    iteration: int  # of the checkpoint
    as_json: bool


def resolve(argv: Optional[List[str]]) -> Evaluation:
    """Everything from the flags and the checkpoint, before any process group; raises ConfigError."""
    from megatron_lite.arguments import _parallel_config
    from megatron_lite.checkpoint.model_only import run_config
    from megatron_lite.config import Config
    from megatron_lite.data import build_tokenizer
    from megatron_lite.data.builder import check_data_paths

    args = build_parser().parse_args(argv)
    if not getattr(args, "load", None):
        raise ConfigError("--load CKPT is required: the checkpoint to evaluate")
    saved, meta = run_config(args.load)
    model = _model_config(saved.model, args)
    cfg = Config(model=model, parallel=_parallel_config(args, model), training=_training_config(saved.training, args),
                 data=_data_config(saved.data, args))
    d = cfg.data
    tokenizer = build_tokenizer(d.tokenizer_type, tokenizer_model=d.tokenizer_model, vocab_file=d.vocab_file,
                                merge_file=d.merge_file, vocab_size=d.vocab_size)
    if tokenizer.vocab_size != model.tokenizer_vocab:
        raise ConfigError(f"{tokenizer.name} has vocab {tokenizer.vocab_size} but the checkpoint's model "
                          f"{model.tokenizer_vocab}: pass the tokenizer it was trained with")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.finalize(world_size).validate(world_size)
    check_data_paths(d, tokenizer)
    whole_split = hasattr(args, "data_path") and not d.mock_data and not hasattr(args, "eval_iters")
    return Evaluation(cfg, tokenizer, whole_split, meta["iteration"], args.json)


class EvalDatasets:
    """pretrain_gpt's datasets provider, seen by the Trainer: the evaluation data is its
    validation split; with `whole_split` that split is built at its natural size (one epoch, or
    what a blend serves without repeating) instead of the requested samples. The Trainer also
    wants a training split, which evaluation never draws from: the validation split stands in
    when the training split is empty."""

    def __init__(self, whole_split: bool):
        self.whole_split, self.valid = whole_split, None

    def __call__(self, cfg, tokenizer, num_samples):
        from pretrain_gpt import datasets_provider

        train_n, valid_n, _ = num_samples
        train, valid, _ = datasets_provider(cfg, tokenizer, (train_n, 0 if self.whole_split else valid_n, 0))
        if valid is None:
            raise ConfigError(f"the validation split of the data is empty (--split {cfg.data.split}); with "
                              f"--data-path, --split 0,1,0 evaluates all of it")
        self.valid = valid
        return train if train is not None else valid, valid, None


def evaluate(ev: Evaluation, device) -> Optional[dict]:
    """Collective: the evaluation record on the rank that holds the loss, None elsewhere."""
    from megatron_lite.training.loop import Trainer
    from models.gpt import gpt_forward_step
    from pretrain_gpt import model_provider

    cfg, t = ev.cfg, ev.cfg.training
    data = EvalDatasets(ev.whole_split)
    # With --json, stdout carries the record only: the trainer's notes ("loaded weights ...") go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if ev.as_json else contextlib.nullcontext():
        trainer = Trainer(cfg, ev.tokenizer, device, model_provider=model_provider, datasets_provider=data,
                          forward_step=gpt_forward_step)
    if ev.whole_split:
        t.eval_iters = len(data.valid) // t.global_batch_size
        if t.eval_iters == 0:
            raise ConfigError(f"the evaluation data holds {len(data.valid)} samples of {t.seq_length} tokens, fewer "
                              f"than one global batch ({t.global_batch_size}): lower --global-batch-size")
    loss = trainer.evaluate()
    if not trainer.logs_here:
        return None
    samples = t.eval_iters * t.global_batch_size
    return {"checkpoint": t.load, "iteration": ev.iteration, "lm_loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else float("inf"), "samples": samples,
            "tokens": samples * t.seq_length, "seq_length": t.seq_length,
            "data": " ".join(cfg.data.data_path) or ("mock data" if cfg.data.mock_data else "built-in corpus"),
            "split": cfg.data.split}


def describe(rec: dict) -> str:
    return (f"> evaluation of {rec['checkpoint']} (iteration {rec['iteration']}) on {rec['data']} (split "
            f"{rec['split']}, validation part): {rec['samples']} samples x {rec['seq_length']} tokens | "
            f"lm loss: {rec['lm_loss']:.6E} | perplexity: {rec['perplexity']:.4f}")


def work(ev: Evaluation, device) -> None:
    rec = evaluate(ev, device)
    if rec is not None:
        print(json.dumps(rec) if ev.as_json else describe(rec), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_lite.launch import launch

    return launch(lambda: resolve(argv), lambda ev: ev.cfg.training.device, work)


if __name__ == "__main__":
    sys.exit(main())
