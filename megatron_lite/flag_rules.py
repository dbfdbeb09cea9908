"""Flags that only mean something with a partner flag, and values that cannot train, checked from
tables before any work starts (`Config.validate` calls `check_values` first and `check` last; `cfg`
is always the run's megatron_lite.config.Config, not imported here: config.py imports this module).

The partner table is keyed by the prefix of a field's one-line doc ("YaRN: ...", "with
--cpu-offloading: ...") or by a field name: every field whose doc starts with a listed prefix is
refused, when set away from its default, unless its partner is on. A new flag documented as
"YaRN: ..." is therefore checked without anyone touching this file, and tests/test_flag_rules.py
fails on a doc prefix that is in neither table, so the next such flag cannot be forgotten.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import tempfile
from dataclasses import MISSING, fields
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

from .errors import ConfigError



class Partner(NamedTuple):
    on: Callable[[object], bool]  # is the partner given?
    needs: str  # what to add, as the error line says it


def _yarn(c) -> bool:
    return c.model.rope_scaling_type == "yarn"


def _rope(c) -> bool:  # MLA always rotates its decoupled key part
    return c.model.position_embedding_type == "rope" or c.model.multi_latent_attention


def _fp8_delayed(c) -> bool:
    return c.training.fp8_format is not None and c.training.fp8_recipe in (None, "delayed")


PARTNERS: Dict[str, Partner] = {
    # by doc prefix: every field documented "<prefix>: ..."
    "YaRN": Partner(_yarn, "--rope-type yarn"),
    "MLA": Partner(lambda c: c.model.multi_latent_attention, "--multi-latent-attention"),
    "RoPE frequency scaling": Partner(_rope, "--position-embedding-type rope (or --multi-latent-attention)"),
    "gated MLP": Partner(lambda c: c.model.swiglu, "--swiglu"),
    "with --qk-layernorm": Partner(lambda c: c.model.qk_layernorm, "--qk-layernorm"),
    "with --window-size": Partner(lambda c: c.model.window_size is not None, "--window-size"),
    "aux-loss-free balancing": Partner(lambda c: c.model.moe.moe_router_score_function == "sigmoid",
                                       "--moe-router-score-function sigmoid"),
    "Qwen2-MoE": Partner(lambda c: bool(c.model.moe.moe_shared_expert_intermediate_size),
                         "--moe-shared-expert-intermediate-size"),
    "ZeRO-2/3": Partner(lambda c: c.parallel.zero_stage >= 2, "--zero-stage 2 or 3"),
    "ZeRO-3": Partner(lambda c: c.parallel.zero_stage == 3, "--zero-stage 3"),
    "WSD": Partner(lambda c: c.training.lr_decay_style == "WSD", "--lr-decay-style WSD"),
    "1-bit Adam": Partner(lambda c: c.training.optimizer == "adam-1bit", "--optimizer adam-1bit"),
    "0/1 Adam": Partner(lambda c: c.training.optimizer == "adam-01", "--optimizer adam-01"),
    "Muon": Partner(lambda c: c.training.optimizer == "muon", "--optimizer muon"),
    "QK-clip": Partner(lambda c: c.training.qk_clip, "--qk-clip"),
    "with --optimizer-cpu-offload": Partner(lambda c: c.training.optimizer_cpu_offload, "--optimizer-cpu-offload"),
    "delayed scaling": Partner(_fp8_delayed, "--fp8-format e4m3|hybrid with --fp8-recipe delayed"),
    "FP8": Partner(lambda c: c.training.fp8_format is not None, "--fp8-format e4m3|hybrid"),
    "FP8 scaling": Partner(lambda c: c.training.fp8_format is not None, "--fp8-format e4m3|hybrid"),
    "with --first-last-layers-bf16": Partner(lambda c: c.training.first_last_layers_bf16,
                                             "--first-last-layers-bf16"),
    "full recomputation": Partner(lambda c: c.training.recompute_granularity == "full",
                                  "--recompute-granularity full"),
    "selective recomputation": Partner(lambda c: c.training.recompute_granularity == "selective",
                                       "--recompute-granularity selective"),
    "with --cpu-offloading": Partner(lambda c: c.training.cpu_offloading, "--cpu-offloading"),
    "with --log-straggler": Partner(lambda c: c.training.log_straggler, "--log-straggler"),
    "Mamba-2": Partner(lambda c: "M" in (c.model.hybrid_override_pattern or ""),
                       "--hybrid-override-pattern with Mamba layers (M)"),
    "Mamba-2 kernels in training": Partner(lambda c: "M" in (c.model.hybrid_override_pattern or ""),
                                           "--hybrid-override-pattern with Mamba layers (M)"),
    "DSA": Partner(lambda c: c.model.experimental_attention_variant == "dsa", "--experimental-attention-variant dsa"),
    "linear attention": Partner(lambda c: c.model.experimental_attention_variant == "gated_delta_net",
                                "--experimental-attention-variant gated_delta_net"),
    # by field name: partners that no doc prefix says
    "fp8_param_gather": Partner(lambda c: c.training.fp8_format is not None, "--fp8-format e4m3|hybrid"),
    "mtp_loss_scaling_factor": Partner(lambda c: bool(c.model.mtp_num_layers), "--mtp-num-layers N"),
    "rotary_base": Partner(_rope, "--position-embedding-type rope (or --multi-latent-attention)"),
    "rotary_percent": Partner(_rope, "--position-embedding-type rope (or --multi-latent-attention)"),
    "rope_scaling_factor": Partner(lambda c: c.model.rope_scaling_type == "llama3", "--use-rope-scaling"),
    "memory_snapshot_path": Partner(lambda c: c.training.record_memory_history, "--record-memory-history"),
    "wandb_exp_name": Partner(lambda c: bool(c.training.wandb_project), "--wandb-project NAME"),
    "wandb_save_dir": Partner(lambda c: bool(c.training.wandb_project), "--wandb-project NAME"),
}
# Doc prefixes that name what a flag is, not a partner it needs (the flag itself turns the feature on).
NOT_PARTNERS = frozenset({"ZeRO stage", "adam", "core attention", "sliding-window attention", "attention softmax",
                          "multi-token prediction", "router scores", "dualpipe-v", "START INCR SAMPLES", "local",
                          "zero-centred norm weights", "a watchdog thread per rank", "every --log-interval",
                          "full attention", "torch_dist"})
# Partners left unchecked on purpose: Megatron-LM's own launch scripts give these without their
# partner (the Llama-3 scripts pass --tiktoken-pattern with other tokenizers), and it ignores them.
TOLERATED = frozenset({"TikTokenizer", "TikTokenizer split pattern"})
_PREFIX = re.compile(r"^([\w\-./ ]{1,30}?):\s")


def doc_prefix(help_text: str) -> Optional[str]:
    m = _PREFIX.match(help_text)
    return m.group(1) if m else None


def _sections(cfg) -> Iterator[object]:
    yield from (cfg.model, cfg.parallel, cfg.training, cfg.data)
    if cfg.model.moe is not None:
        yield cfg.model.moe


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _flag(f) -> str:
    flag = f.metadata.get("flag", f"--{f.name.replace('_', '-')}")
    return flag or f.name


def _given(section) -> Iterator[Tuple[object, object]]:
    """(field, value) of the fields set away from their defaults."""
    for f in fields(section):
        value = getattr(section, f.name)
        if value != _default(f):
            yield f, value


def check_partners(cfg) -> None:
    for section in _sections(cfg):
        for f, value in _given(section):
            key = f.name if f.name in PARTNERS else doc_prefix(f.metadata.get("help", ""))
            rule = PARTNERS.get(key)
            if rule is not None and not rule.on(cfg):
                shown = _flag(f) + ("" if isinstance(value, bool) else f" {value}")
                raise ConfigError(f"{shown} only means something with {rule.needs}: add it, or drop {_flag(f)}")


# --- values ------------------------------------------------------------------------------------
POSITIVE = ("init_method_std", "rotary_base", "rotary_scaling_factor", "muon_extra_scale_factor")
AT_LEAST_ONE = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
PATHS = ("save", "load", "metrics_file", "tensorboard_dir", "wandb_save_dir", "memory_snapshot_path")


def check_values(cfg) -> None:
    """Every float finite (a NaN or inf reaches the loss at the first step), and the fields whose
    only meaningful values are positive."""
    for section in _sections(cfg):
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{_flag(f)} ({value}) must be a finite number")
            if f.name in POSITIVE and value is not None and value <= 0:
                raise ConfigError(f"{_flag(f)} ({value}) must be > 0")
            if f.name in AT_LEAST_ONE and value is not None and value < 1:
                raise ConfigError(f"{_flag(f)} ({value}) must be >= 1 (or unset)")
            if f.name in PATHS and value == "":
                raise ConfigError(f"{_flag(f)} is empty: give a path, or drop the flag")
    t = cfg.training
    if t.cpu_offloading:
        _at_least(t.cpu_offloading_num_layers, 1, "--cpu-offloading-num-layers",
                  "--cpu-offloading with 0 layers offloads nothing")


def _at_least(value, least, flag: str, why: str) -> None:
    if value < least:
        raise ConfigError(f"{flag} ({value}) must be >= {least}: {why}")


# --- outputs -----------------------------------------------------------------------------------
def writable_file(path: str, flag: str) -> None:
    """A file the run will create (and its missing parent directories): refused now if it names a
    directory or its nearest existing parent cannot take a new file."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ConfigError(f"{flag} {path} is a directory: give a file path")
    writable_dir(os.path.dirname(full), flag, path)


def writable_dir(path: str, flag: str, shown: Optional[str] = None) -> None:
    """A directory the run will write into (created if missing)."""
    shown = shown or path
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {shown}: {parent} is not a directory")
    try:  # a real probe: os.access says yes to root under /proc and on read-only mounts
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write_probe"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {shown}: cannot write under {parent} ({e.strerror}): give a writable "
                          f"location") from None


EXTRAS = {"tensorboard": "megatron-lite[logging] (or pip install tensorboard)",
          "wandb": "megatron-lite[logging] (or pip install wandb)"}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # (a module set to None in sys.modules: ValueError)
        return False


def check_outputs(cfg) -> None:
    """The files and packages the run's outputs need, before the model is built."""
    t = cfg.training
    if t.metrics_file:
        writable_file(t.metrics_file, "--metrics-file")
    if t.record_memory_history:
        writable_file(t.memory_snapshot_path, "--memory-snapshot-path")
    for flag, given, module, directory in (("--tensorboard-dir", t.tensorboard_dir, "tensorboard", t.tensorboard_dir),
                                           ("--wandb-project", t.wandb_project, "wandb", t.wandb_save_dir)):
        if not given:
            continue
        if not installed(module):
            raise ConfigError(f"{flag} needs the {module} package, which is not installed: install "
                              f"{EXTRAS[module]}, or drop {flag}")
        if directory:
            writable_dir(directory, "--wandb-save-dir" if module == "wandb" else flag)


def check(cfg) -> None:
    """Config.validate's last step (check_values is its first)."""
    check_partners(cfg)
    check_outputs(cfg)
