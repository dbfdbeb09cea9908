"""Megatron-LM's torch_dist checkpoints as a training format: resuming a run that Megatron-LM saved.

A torch_dist iteration directory (`.metadata`, `__R_N.distcp`, `common.pt`, `metadata.json`) holds
the model under Megatron-Core's global names (megatron_checkpoint.TorchDistCheckpoint reads them),
each optimizer state under the same names behind a prefix (`optimizer.state.exp_avg.`, `exp_avg_sq`,
`fp32_param`: the fp32 main params of bf16 / fp16 training; the layouts of Megatron-Core's plain
optimizer and of its distributed optimizer saved `fully_reshardable`), and in `common.pt` the
args (consumed samples among them), the iteration, the Adam step, the LR schedule's state and the
loss scaler's.

`TorchDistFormat.open` gives what the checkpoint package's loader needs (megatron_lite/checkpoint/
foreign.py): the metadata in megatron-lite's terms and a reader with CheckpointReader's interface
whose keys (`model/<name>`, `optim/<name>/<state>`) are our layout-independent names, each full
tensor converted from Megatron-Core's by the conversion table (MEGATRON_RULES: the fused QKV per
query group, SwiGLU's fc1) the first time a rank asks for it, then cut to the boxes the rank holds.
A rank reads through torch.distributed.checkpoint only the layers (boxes of the stacked tensors) it
needs, but each whole: it holds one full layer tensor at a time beside its own shards. So any
layout resumes any other; Megatron-LM's RNG states (CUDA generators) are not read.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple

import torch

from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ModelConfig

from .hf_conversion import ConversionError, _fmt, _instances, _to_ours, hf_names, our_sizes
from .megatron_checkpoint import TorchDistCheckpoint, iteration_dir
from .megatron_conversion import MEGATRON_RULES, model_config_from_megatron_args, true_vocab_size

# our optimizer state -> Megatron-Core's names of it (the prefix `optimizer.state.<name>.`): the fp32
# main params are `fp32_param` in its plain optimizer, `param` in its distributed one
OPTIMIZER_STATES = {"exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",), "main": ("fp32_param", "param")}
_DP_RESHARDABLE = "dp_reshardable"
BUFFERS = (".mlp.router.expert_bias",)  # Megatron-Core's model tensors that are buffers: no optimizer state


def is_torch_dist(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, ".metadata"))


def _open(ckpt_dir: str, prefix: str = "") -> TorchDistCheckpoint:
    try:
        return TorchDistCheckpoint(ckpt_dir, prefix)
    except ConversionError as e:
        raise CheckpointError(f"torch_dist checkpoint {ckpt_dir}: {e}") from e


def model_config_of(src: TorchDistCheckpoint) -> ModelConfig:
    """Our model of the checkpoint's args: every stored vocabulary row (Megatron's softmax has
    them all), the tokenizer's vocabulary recorded apart where the args say it."""
    if not src.args:
        raise CheckpointError(f"torch_dist checkpoint {src.dir} holds no args (common.pt): it was not saved by "
                              f"Megatron-LM's training loop")
    rows = src.rows("embedding.word_embeddings.weight")
    vocab = src.args.get("padded_vocab_size") or rows
    try:
        cfg = model_config_from_megatron_args(src.args, vocab)
    except ConversionError as e:
        raise CheckpointError(f"torch_dist checkpoint {src.dir}: {e}") from e
    tokenizer_vocab = true_vocab_size(src.args, None)
    if tokenizer_vocab is not None and tokenizer_vocab < vocab:
        cfg = dataclasses.replace(cfg, tokenizer_vocab_size=tokenizer_vocab)
    return cfg


def _tokenizer_of(args: dict) -> dict:
    """The run's tokenizer flags as megatron-lite's data config names them (what --use-checkpoint-args takes)."""
    out = {k: args[k] for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file") if args.get(k)}
    if args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size"):
        out["vocab_size"] = int(args["vocab_size"])
    return out


def _find(tree, key: str):
    """The first value stored under `key` anywhere in a nest of dicts and lists (None if none)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        values = tree.values()
    elif isinstance(tree, (list, tuple)):
        values = tree
    else:
        return None
    return next((v for v in map(lambda t: _find(t, key), values) if v is not None), None)


def _scalar(value) -> Optional[float]:
    return None if value is None else float(value.item() if isinstance(value, torch.Tensor) else value)


def _optimizer_scalars(common: dict) -> dict:
    """Our optimizer's scalar state: the update count (Adam's step, which Megatron-Core saves as a
    step common to every parameter) and the loss scaler (fp16's dynamic one, else a constant 1)."""
    optimizer = common.get("optimizer") or {}
    step = _find(optimizer, "common_step")
    if step is None:
        groups = _find(optimizer, "param_groups") or []
        step = next((g["step"] for g in groups if isinstance(g, dict) and "step" in g), 0)
    scaler = _find(optimizer, "grad_scaler")
    if isinstance(scaler, dict) and "scale" in scaler:
        state = {"scale": _scalar(scaler["scale"])}
        if "growth_tracker" in scaler:
            state.update(_clean_steps=int(scaler["growth_tracker"]), _hysteresis_left=int(scaler["hysteresis_tracker"]))
        kind = "DynamicLossScaler" if "growth_tracker" in scaler else "ConstantLossScaler"
    else:
        kind, state = "ConstantLossScaler", {"scale": 1.0}
    return {"num_updates": int(_scalar(step)), "loss_scaler": kind, "loss_scaler_state": state}


def _lr_schedule(common: dict, consumed_samples: int) -> dict:
    """Megatron-LM's OptimizerParamScheduler state in our scheduler's terms (both count samples;
    without one, the position is the samples consumed)."""
    s = common.get("opt_param_scheduler")
    if not s:
        return {"step_unit": "samples", "num_steps": consumed_samples}
    keys = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
            "wd_incr_steps", "wd_incr_style")
    return {"step_unit": "samples", "num_steps": int(s["num_steps"]), **{k: s[k] for k in keys if k in s}}


class TorchDistFormat:
    """Megatron-LM's torch_dist, for the checkpoint package's loader (foreign.py's protocol)."""

    name = "torch_dist"

    def detect(self, ckpt_dir: str) -> bool:
        return is_torch_dist(ckpt_dir)

    def iteration_dir(self, path: str) -> str:
        try:
            return iteration_dir(path)
        except ConversionError as e:
            raise CheckpointError(str(e)) from e

    def run_config(self, ckpt_dir: str) -> dict:
        """What --use-checkpoint-args takes: the model and the tokenizer of the saved run."""
        src = _open(ckpt_dir)
        cfg = model_config_of(src)
        return {"model_config": dataclasses.asdict(cfg), "config": {"data": _tokenizer_of(src.args)}}

    def open(self, ckpt_dir: str, model: ModelConfig, load_optim: bool) -> Tuple[dict, "TorchDistReader"]:
        """(metadata as megatron-lite's loader reads it, the reader of the tensors)."""
        src = _open(ckpt_dir)
        saved = model_config_of(src)
        args, common = src.args, src.common
        consumed = int(args.get("consumed_train_samples") or 0)
        meta = {"iteration": int(src.iteration or 0), "model_config": dataclasses.asdict(saved),
                "consumed_samples": consumed, "consumed_valid_samples": int(args.get("consumed_valid_samples") or 0),
                "lr_scheduler": _lr_schedule(common, consumed), "optimizer": _optimizer_scalars(common),
                "config": {"training": {"global_batch_size": args.get("global_batch_size")}},
                "format": self.name}
        states = {}
        if load_optim:
            sharding = _find(common.get("optimizer") or {}, "param_state_sharding_type")
            if sharding == _DP_RESHARDABLE:
                raise CheckpointError(
                    f"torch_dist checkpoint {ckpt_dir}: its distributed optimizer state is saved dp_reshardable "
                    f"(Megatron-Core's flat buffers, readable only by its own layout); save it in Megatron-LM with "
                    f"--dist-ckpt-optim-fully-reshardable, or load the weights only with --no-load-optim")
            for ours, names in OPTIMIZER_STATES.items():
                stored = (state for state in (_open(ckpt_dir, f"optimizer.state.{n}.") for n in names) if state.index)
                states[ours] = next(stored, None)
            states = {k: v for k, v in states.items() if v is not None}
        return meta, TorchDistReader(ckpt_dir, model, src, states)


class TorchDistReader:
    """CheckpointReader's interface over a torch_dist directory: our full tensors by our keys,
    converted from Megatron-Core's stored ones (per source, the last rule's outputs kept: the loader
    asks for a parameter's model tensor and states in turn, and one rule gives both q and kv)."""

    def __init__(self, ckpt_dir: str, cfg: ModelConfig, model: TorchDistCheckpoint,
                 states: Dict[str, TorchDistCheckpoint]):
        self.dir, self.cfg = ckpt_dir, cfg
        self.sources = {"model": model, **states}
        for src in self.sources.values():
            src.configure(cfg.vocab_size, cfg.swiglu)
        self.rules = {name: (layer, r) for rule in MEGATRON_RULES for layer, r in _instances(rule, cfg)
                      for name in _fmt(r.ours, layer)}
        self.pieces: Dict[str, list] = {}  # (no per-rank pieces: RNG states are not read from here)
        self._sizes: Optional[Dict[str, int]] = None
        self._cached: Dict[str, Tuple[tuple, Dict[str, torch.Tensor]]] = {}  # kind -> (rule, its outputs)

    def verify_files(self) -> None:
        """Every tensor this model needs is stored (one line naming the first missing ones)."""
        for kind, src in self.sources.items():
            missing = [n for n in hf_names(self.cfg, MEGATRON_RULES)
                       if not src.has(n) and (kind == "model" or not n.endswith(BUFFERS))]
            if missing:
                what = "model" if kind == "model" else f"optimizer state {kind}"
                raise CheckpointError(f"torch_dist checkpoint {self.dir} lacks {len(missing)} {what} tensors this "
                                      f"model needs, e.g. {', '.join(missing[:3])}")

    @staticmethod
    def _split(key: str) -> Tuple[str, str]:
        """(source kind, our name) of a stored key."""
        if key.startswith("model/"):
            return "model", key[len("model/"):]
        if key.startswith("optim/"):
            name, state = key[len("optim/"):].rsplit("/", 1)
            return state, name
        if key.startswith("buffer/"):  # (the MoE router's expert bias: a model tensor in Megatron-Core's checkpoint)
            return "model", key[len("buffer/"):]
        return "", key

    def has(self, key: str) -> bool:
        kind, name = self._split(key)
        return kind in self.sources and name in self.rules

    def pick(self, keys, shape) -> str:
        key = next((k for k in keys if self.has(k)), keys[-1])
        if self.has(key) and tuple(self._full(key).shape) != tuple(shape):
            raise CheckpointError(f"torch_dist checkpoint {self.dir}: {key!r} has shape {list(self._full(key).shape)},"
                                  f" this model needs {list(shape)}")
        return key

    def _full(self, key: str) -> torch.Tensor:
        kind, name = self._split(key)
        if not self.has(key):
            raise CheckpointError(f"torch_dist checkpoint {self.dir} has no tensor for {key!r}")
        layer, rule = self.rules[name]
        if kind not in self._cached or self._cached[kind][0] != (layer, rule):
            src = self.sources[kind]
            if self._sizes is None:
                self._sizes = our_sizes(self.cfg)
            try:
                out = dict(_to_ours(rule, layer, src.get, src.has, self.cfg, self._sizes))
            except ConversionError as e:
                raise CheckpointError(f"torch_dist checkpoint {self.dir}: {e}") from e
            self._cached[kind] = ((layer, rule), out)
        return self._cached[kind][1][name]

    def read_into(self, key: str, box, out: torch.Tensor) -> None:
        out.copy_(self._full(key)[tuple(slice(s, s + n) for s, n in box)])

    def read_full(self, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        full = self._full(key)
        return full.to(dtype) if dtype is not None else full.clone()

    def close(self) -> None:
        self._cached = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
