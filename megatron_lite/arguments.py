"""Megatron-LM-compatible command-line flags -> Config dataclasses.

Every field of the config dataclasses (config.py) is a flag named after it (`--num-layers` for
`num_layers`), with the field's doc as its help and the field's default as its default: the
dataclasses are the only source of defaults. A named `--model` (models/zoo.py) fills what the
command line leaves out; explicit flags always win. Without `--model` the built-in default run
(the zoo's DEFAULT_RUN preset) is used. Flags of Megatron-LM that are not fields are listed below,
each with what it does here.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Callable, Dict, List, NamedTuple, Optional

from .config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from .errors import ConfigError
from .transformer.moe.config import MoEConfig

SECTIONS = (("model", ModelConfig), ("moe", MoEConfig), ("parallel", ParallelConfig), ("training", TrainingConfig),
            ("data", DataConfig))

# Switches of Megatron-LM that select fused kernels or legacy code paths we do not have, or whose
# behaviour is always on here: accepted so that existing launch scripts run unchanged; they do not
# change the math.
COMPAT_NOOP_FLAGS = [
    "--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--no-async-tensor-model-parallel-allreduce", "--use-rotary-position-embeddings", "--no-rope-fusion",
    "--bias-swiglu-fusion", "--no-bias-swiglu-fusion", "--no-create-attention-mask-in-dataloader",
    # logging extras and allocator/IO hints: what they control is either always on here or moot
    "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
    "--log-loss-scale-to-tensorboard", "--log-learning-rate-to-tensorboard", "--log-batch-size-to-tensorboard",
    "--manual-gc", "--cross-entropy-loss-fusion", "--no-mmap-bin-files",
    "--no-persist-layer-norm", "--overlap-p2p-communication",
]
COMPAT_VALUE_FLAGS = ["--distributed-backend", "--timing-log-level", "--distributed-timeout-minutes",
                      "--num-dataset-builder-threads", "--data-impl", "--tensorboard-log-interval", "--ckpt-format",
                      "--manual-gc-interval", "--tensorboard-queue-size"]
# Megatron-LM flags that would change training here but are not implemented: refused with one
# line rather than silently ignored.
UNSUPPORTED_FLAGS = {"--rampup-batch-size": "batch-size ramp-up", "--train-samples": "sample-based training length",
                     "--lr-warmup-samples": "sample-based warmup", "--lr-decay-samples": "sample-based decay",
                     "--lr-warmup-init": "a non-zero warmup start", "--use-checkpoint-args": "model shape from a checkpoint",
                     "--tp-comm-overlap": "Transformer Engine's userbuffers"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (no usage dump), exit code 2."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation: str):
    """int / float / str of an annotation such as "int", "Optional[float]", "List[int]"."""
    inner = annotation.replace("Optional[", "").replace("List[", "").rstrip("]")
    return {"int": int, "float": float, "str": str}.get(inner, str)


def _add_field(group, f) -> None:
    meta = f.metadata
    flag = meta.get("flag", _flag(f.name))
    if flag is None:
        return
    default = f.default if f.default is not MISSING else f.default_factory()
    doc = meta.get("help", "")
    kw = dict(dest=f.name, default=argparse.SUPPRESS)
    if meta.get("store") in ("true", "false"):
        group.add_argument(flag, action=f"store_{meta['store']}", help=doc, **kw)
        return
    kw.update(type=_scalar_type(f.type), help=f"{doc} (default: {default})")
    if meta.get("choices"):
        kw["choices"] = meta["choices"]
    else:
        kw["metavar"] = f.name.upper()
    if meta.get("nargs"):
        kw["nargs"] = meta["nargs"]
    group.add_argument(flag, *meta.get("aliases", ()), **kw)


class Zoo(NamedTuple):
    """Named configurations, from the entry point (megatron_lite/ does not import models/):
    `model_config(name)` -> ModelConfig fields (and seq_length); `default_run` -> the preset of a
    run without --model ({"model": name, "training": {...}, "unless": {...}}, see models/zoo.py)."""
    model_config: Callable[[str], dict]
    default_run: dict


def _run_preset(run: dict, given: dict) -> dict:
    """The training values of a run preset that the flags in `given` leave standing (a value is
    dropped when the command line gives one of the flags it depends on)."""
    return {k: v for k, v in run["training"].items() if not any(u in given for u in run["unless"].get(k, ()))}


def build_parser(zoo: Zoo) -> argparse.ArgumentParser:
    p = _Parser(description="Pretrain a GPT model (megatron-lite)", allow_abbrev=False)
    p.add_argument("--model", default=None,
                   help=f"named config from models/zoo.py (default {zoo.default_run['model']})")
    groups = {name: p.add_argument_group(name) for name, _ in SECTIONS}
    for name, cls in SECTIONS:
        for f in fields(cls):
            _add_field(groups[name], f)
    m, par, t = groups["model"], groups["parallel"], groups["training"]
    # Megatron's switches that set a field to a value, or read one only when given together.
    m.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups")
    m.add_argument("--openai-gelu", action="store_const", const="gelu_tanh", dest="activation",
                   default=argparse.SUPPRESS, help="= --activation gelu_tanh")
    m.add_argument("--use-flash-attn", action="store_const", const="flash", dest="attention_backend",
                   default=argparse.SUPPRESS, help="= --attention-backend flash")
    par.add_argument("--use-distributed-optimizer", action="store_true", help="= --zero-stage 1")
    par.add_argument("--use-torch-fsdp2", action="store_true", help="= --zero-stage 3 (parameters sharded over DP)")
    par.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                     help="local; transformer_engine needs Transformer Engine, which megatron-lite does not use yet")
    t.add_argument("--optimizer", choices=["adam"], default="adam", help="AdamW (decoupled weight decay)")
    for flag in UNSUPPORTED_FLAGS:
        p.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    compat = p.add_argument_group("accepted for compatibility with Megatron-LM launch scripts (no effect)")
    for flag in COMPAT_NOOP_FLAGS:
        compat.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in COMPAT_VALUE_FLAGS:
        compat.add_argument(flag, default=None, help=argparse.SUPPRESS)
    return p


def _given(args: argparse.Namespace, cls) -> Dict[str, object]:
    """The fields of `cls` set on the command line."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def _model_config(args: argparse.Namespace, preset: dict) -> ModelConfig:
    given = _given(args, ModelConfig)
    moe = {**(preset.pop("moe", None) or {}), **_given(args, MoEConfig)}
    if moe.get("num_experts"):
        given["moe"] = moe
    elif moe:
        raise ConfigError(f"--{next(iter(moe)).replace('_', '-')} is an MoE setting: add --num-experts N")
    if not args.group_query_attention:  # Megatron reads --num-query-groups only with it
        given.pop("num_query_groups", None)
    if any(k in given for k in ("hidden_size", "num_attention_heads", "swiglu")):
        for k in ("kv_channels", "ffn_hidden_size"):  # derived sizes follow the new shape
            if k not in given:
                preset.pop(k, None)
        if "num_attention_heads" in given and "num_query_groups" not in given:
            preset.pop("num_query_groups", None)
    return ModelConfig(**{**preset, **given})


def _parallel_config(args: argparse.Namespace, model: ModelConfig) -> ParallelConfig:
    given = _given(args, ParallelConfig)
    per_chunk = given.get("num_layers_per_virtual_pipeline_stage")
    if per_chunk is not None:
        if per_chunk < 1:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({per_chunk}) must be >= 1")
        per_pp = model.num_layers // max(1, given.get("pipeline_model_parallel_size", 1))
        if per_pp % per_chunk:
            raise ConfigError(f"layers per pipeline stage ({per_pp}) must be divisible by "
                              f"--num-layers-per-virtual-pipeline-stage ({per_chunk})")
        given["virtual_pipeline_model_parallel_size"] = per_pp // per_chunk
    if (given.get("virtual_pipeline_model_parallel_size") or 1) <= 1:
        given.pop("virtual_pipeline_model_parallel_size", None)
    if "zero_stage" not in given:
        if args.use_torch_fsdp2:
            given["zero_stage"] = 3
        elif args.use_distributed_optimizer:
            given["zero_stage"] = 1
    return ParallelConfig(**given)


def config_from_args(args: argparse.Namespace, zoo: Zoo) -> Config:
    """Resolve flags (over the named model, over the defaults) into a Config. No validation yet."""
    for flag, what in UNSUPPORTED_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            raise ConfigError(f"{flag} ({what}) is not supported by megatron-lite; remove it from the command line")
    if args.transformer_impl == "transformer_engine":
        raise ConfigError("--transformer-impl transformer_engine: megatron-lite's layers are its own (local); "
                          "drop the flag or use --transformer-impl local")
    named = zoo.model_config(args.model or zoo.default_run["model"])
    seq_length = named.pop("seq_length", None)
    model = _model_config(args, named)
    training = _given(args, TrainingConfig)
    if seq_length is not None:
        training.setdefault("seq_length", seq_length)
    if args.model is None:
        training = {**_run_preset(zoo.default_run, training), **training}
    data = _given(args, DataConfig)
    if "tokenizer_type" not in data and data.get("mock_data") and data.get("vocab_size"):
        data["tokenizer_type"] = "NullTokenizer"
    return Config(model=model, parallel=_parallel_config(args, model), training=TrainingConfig(**training),
                  data=DataConfig(**data))


def parse_args(argv: Optional[List[str]], zoo: Zoo) -> Config:
    return config_from_args(build_parser(zoo).parse_args(argv), zoo)


__all__ = ["Zoo", "build_parser", "config_from_args", "parse_args", "COMPAT_NOOP_FLAGS", "COMPAT_VALUE_FLAGS",
           "UNSUPPORTED_FLAGS"]
