"""Megatron-LM-compatible command-line flags -> Config dataclasses.

Every field of the config dataclasses (config.py) is a flag named after it (`--num-layers` for
`num_layers`), with the field's doc as its help and the field's default as its default: the
dataclasses are the only source of defaults. A named `--model` (models/zoo.py) fills what the
command line leaves out; explicit flags always win. Without `--model`, a command line that gives
no model shape (--num-layers, --hidden-size, --num-attention-heads) runs the built-in default
(the zoo's DEFAULT_RUN preset); one that does gets the dataclass defaults, which are Megatron-LM's
where they change the numbers (dropout 0.1, linear LR decay, ...), so its launch scripts train as
they do there. Flags of Megatron-LM that are not fields are listed below,
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
# change the math. Grouped by the reason the start-up line gives for them.
COMPAT_NOOP = {
    "fused-kernel and legacy-path switches: the same math runs": [
        "--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
        "--no-async-tensor-model-parallel-allreduce", "--no-rope-fusion", "--bias-swiglu-fusion",
        "--no-bias-swiglu-fusion", "--no-create-attention-mask-in-dataloader", "--cross-entropy-loss-fusion",
        "--no-mmap-bin-files", "--no-persist-layer-norm", "--overlap-p2p-communication"],
    "logging switches: what they log is always logged here": [
        "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
        "--log-loss-scale-to-tensorboard", "--log-learning-rate-to-tensorboard", "--log-batch-size-to-tensorboard"],
    "torch.profiler is what --profile uses anyway; FSDP buffer placement (memory only)": [
        "--use-pytorch-profiler", "--fsdp-double-buffer", "--fsdp-manual-registration"],
    "parameters are initialized from their global names, wherever built": ["--init-model-with-meta-device"],
}
COMPAT_NOOP_FLAGS = [flag for flags in COMPAT_NOOP.values() for flag in flags]
COMPAT_VALUE = {
    "--distributed-backend": "gloo on CPU, NCCL on CUDA", "--timing-log-level": "step times are always logged",
    "--num-dataset-builder-threads": "indices are built by one thread and cached",
    "--data-impl": "the .bin is memory-mapped", "--tensorboard-log-interval": "TensorBoard gets every iteration",
    "--non-persistent-local-ckpt-algo": "each rank writes its local checkpoint atomically: staging, fsync, rename",
    "--tensorboard-queue-size": "the writer is flushed every iteration",
    "--straggler-ctrlr-port": "the straggler report is not toggled at run time: --log-straggler turns it on"}
COMPAT_VALUE_FLAGS = list(COMPAT_VALUE)
# Megatron-LM flags that would change training here but are not implemented: refused with one
# line rather than silently ignored.
UNSUPPORTED_FLAGS = {"--tp-comm-overlap": "Transformer Engine's userbuffers",
                     "--disable-straggler-on-startup": "a straggler report toggled on at run time (its controller "
                                                       "port); --log-straggler reports from the second step"}
# The FP8 recipe's parts not built yet (--fp8-format / --fp8-recipe / --fp8-margin are config fields).
FP8_NOT_YET: dict = {}  # (every FP8 flag of Megatron-LM is implemented)
UNSUPPORTED_FLAGS.update({flag: f"{what}, not implemented yet" for flag, what in FP8_NOT_YET.items()})
# Flags that need a package or a device megatron-lite does not use: one line naming what is missing.
NEEDS_PACKAGE_FLAGS = {
    "--fp4-format": "FP4 GEMMs need Transformer Engine on Blackwell GPUs",
    "--use-nccl-ub": "NCCL user-buffer registration needs NCCL (GPUs) and Megatron-FSDP's buffers",
    "--cuda-graph-impl": "CUDA graphs need CUDA and Transformer Engine's graph capture",
    "--cuda-graph-scope": "CUDA graphs need CUDA and Transformer Engine's graph capture",
    "--enable-cuda-graph": "CUDA graphs need CUDA and Transformer Engine's graph capture",
}
SHARDING_STRATEGIES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


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
        off = meta["store"] == "false"  # the flag turns off what the field's doc describes
        group.add_argument(flag, action=f"store_{meta['store']}", help=f"turn off (on by default): {doc}" if off
                           else doc, **kw)
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
    m, par = groups["model"], groups["parallel"]
    # Megatron's switches that set a field to a value, or read one only when given together.
    m.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups")
    m.add_argument("--no-bias-gelu-fusion", action="store_true",
                   help="exact GELU: without it a command line with a model shape gets Megatron-LM's default "
                        "fused bias-GELU, which is the tanh approximation (with biases, without --swiglu)")
    m.add_argument("--openai-gelu", action="store_const", const="gelu_tanh", dest="activation",
                   default=argparse.SUPPRESS, help="= --activation gelu_tanh")
    m.add_argument("--use-flash-attn", action="store_const", const="flash", dest="attention_backend",
                   default=argparse.SUPPRESS, help="= --attention-backend flash")
    m.add_argument("--use-rope-scaling", action="store_const", const="llama3", dest="rope_scaling_type",
                   default=argparse.SUPPRESS, help="= --rope-scaling-type llama3 (Llama-3.1)")
    m.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="yarn = --rope-scaling-type yarn (YaRN, with --rotary-scaling-factor, --mscale ...); rope: "
                        "plain RoPE (the default here, also with --multi-latent-attention)")
    par.add_argument("--use-distributed-optimizer", action="store_true", help="= --zero-stage 1")
    par.add_argument("--use-torch-fsdp2", action="store_true", help="= --zero-stage 3 (parameters sharded over DP)")
    par.add_argument("--use-megatron-fsdp", action="store_true",
                     help="= --zero-stage of --data-parallel-sharding-strategy")
    par.add_argument("--data-parallel-sharding-strategy", choices=list(SHARDING_STRATEGIES), default=None,
                     help="with --use-megatron-fsdp: no_shard, optim, optim_grads, optim_grads_params = ZeRO 0-3")
    m.add_argument("--use-rotary-position-embeddings", action="store_const", const="rope",
                   dest="position_embedding_type", default=argparse.SUPPRESS, help="= --position-embedding-type rope")
    m.add_argument("--no-position-embedding", action="store_true",
                   help="deprecated Megatron switch: accepted with --position-embedding-type rope (a no-op there)")
    for flag in list(UNSUPPORTED_FLAGS) + list(NEEDS_PACKAGE_FLAGS):
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


def _model_config(args: argparse.Namespace, preset: dict, notes: List[str]) -> ModelConfig:
    given = _given(args, ModelConfig)
    if getattr(args, "rope_type", None) == "yarn":
        given["rope_scaling_type"] = "yarn"
    elif getattr(args, "rope_type", None) == "rope" and given.get("rope_scaling_type") == "yarn":
        raise ConfigError("--rope-type rope contradicts --rope-scaling-type yarn: keep one of them")
    preset_moe = preset.pop("moe", None)
    moe = {**(preset_moe or {}), **_given(args, MoEConfig)}
    if moe.get("num_experts"):
        given["moe"] = moe
    elif moe:
        raise ConfigError(f"--{next(iter(moe)).replace('_', '-')} is an MoE setting: add --num-experts N")
    if not args.group_query_attention and "num_query_groups" in given and not preset:
        # Megatron-LM reads --num-query-groups only with --group-query-attention (a launch script
        # trains here what it trains there); over a --model preset the explicit flag wins, as all do.
        notes.append(f"--num-query-groups {given.pop('num_query_groups')} is dropped: Megatron-LM reads it only with "
                     f"--group-query-attention (add it for grouped-query attention)")
    if any(k in given for k in ("hidden_size", "num_attention_heads", "swiglu")):
        for k in ("kv_channels", "ffn_hidden_size"):  # derived sizes follow the new shape
            if k not in given:
                preset.pop(k, None)
        if "num_attention_heads" in given and "num_query_groups" not in given:
            preset.pop("num_query_groups", None)
    before = dict(preset, moe=preset_moe)
    if "family" not in given and any(k in given and given[k] != before.get(k, _DEFAULT_MODEL[k])
                                     for k in ARCHITECTURE_FIELDS):
        preset.pop("family", None)  # the flags made another architecture: conversion infers it
    return ModelConfig(**{**preset, **given})


# Flags that give a model's shape: with any of them (and no --model) no preset applies.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")

# Fields that decide which Hugging Face family can represent a model (see models/hf_families.py).
ARCHITECTURE_FIELDS = ("normalization", "position_embedding_type", "swiglu", "activation", "add_bias_linear",
                       "add_qkv_bias", "qk_layernorm", "qk_layernorm_full_width", "window_size", "window_attn_skip_freq", "moe",
                       "untie_embeddings_and_output_weights", "rotary_percent", "apply_layernorm_1p",
                       "multi_latent_attention")
_DEFAULT_MODEL = {f.name: f.default for f in fields(ModelConfig) if f.name in ARCHITECTURE_FIELDS}


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
    layout = given.get("pipeline_model_parallel_layout")
    if layout is not None:  # its stage count sets the virtual size, as in Megatron-LM
        from .parallel.pipeline.partition import parse_layout
        from .parallel.pipeline.schedules import V_SCHEDULES

        pp, stages = given.get("pipeline_model_parallel_size", 1), len(parse_layout(layout))
        if stages % pp:
            raise ConfigError(f"--pipeline-model-parallel-layout {layout!r} has {stages} stages, not a multiple of "
                              f"--pipeline-model-parallel-size ({pp}); give pp x virtual-stages stages separated by |")
        schedule = given.get("pipeline_schedule")
        if schedule in V_SCHEDULES and stages != 2 * pp:
            raise ConfigError(f"--pipeline-model-parallel-layout {layout!r} has {stages} stages but --pipeline-schedule "
                              f"{schedule} runs two chunks per rank (V: down the ranks and back up): give 2 x "
                              f"{pp} = {2 * pp} stages separated by |")
        vpp = given.get("virtual_pipeline_model_parallel_size")
        if vpp is not None and vpp != stages // pp:
            raise ConfigError(f"--pipeline-model-parallel-layout gives {stages // pp} virtual stages per rank but the "
                              f"virtual-stage flags {vpp}; drop --num-layers-per-virtual-pipeline-stage / "
                              f"--virtual-pipeline-model-parallel-size")
        given["virtual_pipeline_model_parallel_size"] = stages // pp
    if given.get("virtual_pipeline_model_parallel_size") == 1:  # (0 or less: refused by flag_rules)
        given.pop("virtual_pipeline_model_parallel_size", None)
    if args.data_parallel_sharding_strategy is not None and not args.use_megatron_fsdp:
        raise ConfigError("--data-parallel-sharding-strategy applies to --use-megatron-fsdp: add it (or give "
                          "--zero-stage 0-3 directly)")
    if "zero_stage" not in given:
        if args.use_megatron_fsdp:
            given["zero_stage"] = SHARDING_STRATEGIES[args.data_parallel_sharding_strategy or "no_shard"]
        elif args.use_torch_fsdp2:
            given["zero_stage"] = 3
        elif args.use_distributed_optimizer:
            given["zero_stage"] = 1
    return ParallelConfig(**given)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def refused(args: argparse.Namespace, unknown: List[str] = ()) -> List[str]:
    """One message per flag of the command line that megatron-lite refuses (all of them, so that a
    launch script is cleared in one run)."""
    out = [f"unrecognized arguments: {' '.join(unknown)} (see --help)"] if unknown else []
    for flag, what in UNSUPPORTED_FLAGS.items():
        if getattr(args, _dest(flag)) is not None:
            out.append(f"{flag} ({what}) is not supported by megatron-lite; remove it from the command line")
    for flag, what in NEEDS_PACKAGE_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is not None and value != ["none"]:
            out.append(f"{flag}: {what}, which megatron-lite does not use; remove the flag" + (
                " (bf16 is the fastest precision here)" if flag.startswith(("--fp8", "--fp4")) else ""))
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        from .transformer import te_backend  # imports torch: only when asked for
        if not te_backend.available():
            out.append(te_backend.MISSING)
    fmt = getattr(args, "ckpt_format", None)
    if fmt == "fsdp_dtensor":
        out.append(f"--ckpt-format {args.ckpt_format}: megatron-lite writes its own format (per-rank safetensors pieces + "
                   "metadata.json), not Megatron-LM's; drop the flag; tools/convert_checkpoint.py reads torch_dist "
                   "(megatron-to-ml) and writes it (ml-to-megatron --ckpt-format torch_dist)")
    elif fmt == "torch_dist" and getattr(args, "save", None):  # (read by --load; not written yet)
        out.append("--ckpt-format torch_dist: megatron-lite resumes Megatron-LM's torch_dist checkpoints (--load) "
                   "but saves its own format (per-rank safetensors pieces + metadata.json); with --save, replace the "
                   "flag with --auto-detect-ckpt-format (loads either format); tools/convert_checkpoint.py "
                   "ml-to-megatron --ckpt-format torch_dist writes Megatron-LM's weights")
    return out


def no_effect(args: argparse.Namespace, tp: int) -> List[str]:
    """The accepted flags of the command line that change nothing here, each with why."""
    out = [f"{', '.join(given)} ({why})" for why, flags in COMPAT_NOOP.items()
           if (given := [f for f in flags if getattr(args, _dest(f))])]
    out += [f"{flag} {getattr(args, _dest(flag))} ({why})" for flag, why in COMPAT_VALUE.items()
            if getattr(args, _dest(flag)) is not None]
    if getattr(args, "ckpt_format", None) not in (None, "torch_dist"):
        out.append(f"--ckpt-format {args.ckpt_format} (megatron-lite writes its own sharded safetensors format)")
    if getattr(args, "attention_backend", None) == "fused":
        out.append("--attention-backend fused (runs sdpa: PyTorch's fused attention)")
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if getattr(args, "fp8_param_gather", False) and getattr(args, "fp8_format", None) and recipe == "rowwise":
        out.append("--fp8-param-gather (FP8 weights are gathered with --fp8-recipe tensorwise, delayed or blockwise; "
                   "with rowwise the ZeRO all-gather moves the params dtype)")
    if getattr(args, "sequence_parallel", False) and tp == 1:
        out.append("--sequence-parallel (tensor parallel size is 1: nothing to split over)")
    return out


def config_from_args(args: argparse.Namespace, zoo: Zoo, unknown: List[str] = ()) -> Config:
    """Resolve flags (over the named model, over the defaults) into a Config. No validation yet."""
    problems = refused(args, unknown)
    if problems:
        raise ConfigError("; ".join(problems))
    # Without --model, the built-in default run applies only to a command line that names no model
    # shape: a launch script that gives the shape gets Megatron-LM's defaults for everything else.
    default_run = args.model is None and not any(hasattr(args, k) for k in SHAPE_FIELDS)
    named = zoo.model_config(args.model or zoo.default_run["model"]) if args.model or default_run else {}
    seq_length = named.pop("seq_length", None)
    notes: List[str] = []
    model = _model_config(args, named, notes)
    if not named and "activation" not in vars(args) and not model.swiglu and model.add_bias_linear \
            and not args.no_bias_gelu_fusion:
        # Megatron-LM's defaults: --bias-gelu-fusion is on, and its fused bias-GELU kernel is the
        # tanh approximation (--no-bias-gelu-fusion gives the exact GELU).
        model.activation = "gelu_tanh"
    if args.no_position_embedding and model.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding is deprecated (Megatron-LM accepts it only with rope); use "
                          "--position-embedding-type rope or none")
    training = _given(args, TrainingConfig)
    if seq_length is not None:
        training.setdefault("seq_length", seq_length)
    if default_run:
        training = {**_run_preset(zoo.default_run, training), **training}
    data = _given(args, DataConfig)
    if "tokenizer_type" not in data:
        if data.get("mock_data") and data.get("vocab_size"):
            data["tokenizer_type"] = "NullTokenizer"
        elif data.get("vocab_file"):  # Megatron-LM's pretrain_gpt.py default, with its files
            data["tokenizer_type"] = "GPT2BPETokenizer"
    cfg = Config(model=model, parallel=_parallel_config(args, model), training=TrainingConfig(**training),
                 data=DataConfig(**data))
    ignored = no_effect(args, cfg.parallel.tensor_model_parallel_size)
    if ignored:
        notes.append("accepted with no effect here: " + "; ".join(ignored))
    cfg.notes, cfg.model_flags, cfg.data_flags = notes, _given(args, ModelConfig), data
    return cfg


def parse_args(argv: Optional[List[str]], zoo: Zoo) -> Config:
    args, unknown = build_parser(zoo).parse_known_args(argv)
    return config_from_args(args, zoo, unknown)


__all__ = ["Zoo", "build_parser", "config_from_args", "parse_args", "COMPAT_NOOP_FLAGS", "COMPAT_VALUE_FLAGS",
           "NEEDS_PACKAGE_FLAGS", "UNSUPPORTED_FLAGS", "FP8_NOT_YET"]
