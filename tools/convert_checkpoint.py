#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron-lite.

    python tools/convert_checkpoint.py hf-to-ml --hf-dir gpt2-local/ --out ml-ckpt/
    python tools/convert_checkpoint.py ml-to-hf --ml-dir ml-ckpt/ --out hf-out/ [--family llama]
    python tools/convert_checkpoint.py consolidate --load ckpts/ --out ml-ckpt/ [--iteration N]
    python tools/convert_checkpoint.py reshard --load ckpts/ --out ckpts-tp4/ --tensor-model-parallel-size 4

A megatron-lite "full" checkpoint is a directory with `model.safetensors` (unsharded weights,
true vocabulary, layout-independent names) and `config.json` (our ModelConfig fields); it loads
at any TP size through models.hf_conversion.load_full_state_dict_into_model. HF directories are
what `save_pretrained` writes and `from_pretrained` reads (GPT2LMHeadModel, LlamaForCausalLM).
A training checkpoint (`--save` of pretrain_gpt.py, megatron_lite/checkpoint) loads at any layout
as it is; `consolidate` turns it into a full checkpoint (for ml-to-hf), `reshard` rewrites its
files as the ranks of another TP x PP x DP layout would have written them.

Weights are read with safetensors, or torch.load(weights_only=True) for `.bin` files: nothing
is unpickled. Errors (missing directory, unsupported architecture, ...) print one line and
exit with status 2. New subcommands: add a `_add_<name>` parser builder and list it in PARSERS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from models.hf_conversion import (ConversionError, hf_config_to_model_config, hf_to_megatron_lite,  # noqa: E402
                                  megatron_lite_to_hf, model_config_to_hf_config, model_family)

ML_WEIGHTS, ML_CONFIG = "model.safetensors", "config.json"
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Failures caused by the user's input: reported in one line, exit status 2.
USER_ERRORS = (ConversionError, ConfigError, OSError, ValueError, KeyError, TypeError, SafetensorError)


class CLIError(ValueError):
    pass


# --- file formats -----------------------------------------------------------------------------
def _require_dir(path: str, what: str) -> None:
    if not os.path.isdir(path):
        raise CLIError(f"{what} {path!r} is not a directory")


def read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory: single or sharded safetensors, else .bin."""
    for index_name, loader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = os.path.join(hf_dir, index_name)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            out: Dict[str, torch.Tensor] = {}
            for name in files:
                out.update(loader(os.path.join(hf_dir, name)))
            return out
    for name, loader in (("model.safetensors", load_file), ("pytorch_model.bin", _load_bin)):
        path = os.path.join(hf_dir, name)
        if os.path.exists(path):
            return loader(path)
    raise CLIError(f"no model.safetensors or pytorch_model.bin (or their index) in {hf_dir!r}")


def _load_bin(path: str) -> Dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _cast(sd: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    # safetensors refuses views and shared storage: write contiguous, independent tensors.
    return {k: (v if dtype is None or not v.is_floating_point() else v.to(dtype)).contiguous().clone()
            for k, v in sd.items()}


def read_ml_checkpoint(ml_dir: str):
    """(ModelConfig, full state dict) of a megatron-lite full checkpoint directory."""
    _require_dir(ml_dir, "megatron-lite checkpoint")
    with open(os.path.join(ml_dir, ML_CONFIG)) as f:
        fields = json.load(f)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CLIError(f"{ML_CONFIG} has fields ModelConfig does not know: {unknown}")
    return ModelConfig(**fields), load_file(os.path.join(ml_dir, ML_WEIGHTS))


def write_ml_checkpoint(out_dir: str, cfg: ModelConfig, state: Dict[str, torch.Tensor],
                        dtype: Optional[torch.dtype] = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file(_cast(state, dtype), os.path.join(out_dir, ML_WEIGHTS), metadata={"format": "megatron-lite"})
    with open(os.path.join(out_dir, ML_CONFIG), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2, sort_keys=True)
        f.write("\n")


# --- subcommands ------------------------------------------------------------------------------
def cmd_hf_to_ml(args) -> None:
    from transformers import AutoConfig

    _require_dir(args.hf_dir, "HF model directory")
    cfg = hf_config_to_model_config(AutoConfig.from_pretrained(args.hf_dir, local_files_only=True))
    state = hf_to_megatron_lite(read_hf_weights(args.hf_dir), cfg)
    write_ml_checkpoint(args.out, cfg, state, DTYPES[args.dtype])
    print(f"wrote megatron-lite {model_family(cfg)} checkpoint ({len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()):,} parameters) to {args.out}")


def cmd_ml_to_hf(args) -> None:
    cfg, state = read_ml_checkpoint(args.ml_dir)
    family = args.family or model_family(cfg)
    hf_config = model_config_to_hf_config(cfg, family)
    hf_state = megatron_lite_to_hf(state, cfg, family)
    if not cfg.untie_embeddings_and_output_weights:
        del hf_state["lm_head.weight"]  # tied: save_pretrained stores only the embedding
    os.makedirs(args.out, exist_ok=True)
    hf_config.save_pretrained(args.out)
    save_file(_cast(hf_state, DTYPES[args.dtype]), os.path.join(args.out, "model.safetensors"),
              metadata={"format": "pt"})
    print(f"wrote HF {hf_config.architectures[0]} ({len(hf_state)} tensors) to {args.out}")


def _add_hf_to_ml(sub) -> None:
    p = sub.add_parser("hf-to-ml", help="HF save_pretrained directory -> megatron-lite full checkpoint")
    p.add_argument("--hf-dir", required=True, help="directory with config.json and model weights")
    p.add_argument("--out", required=True, help="output directory (model.safetensors + config.json)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="cast floating tensors")
    p.set_defaults(func=cmd_hf_to_ml)


def _add_ml_to_hf(sub) -> None:
    p = sub.add_parser("ml-to-hf", help="megatron-lite full checkpoint -> HF save_pretrained directory")
    p.add_argument("--ml-dir", required=True, help="directory with model.safetensors + config.json")
    p.add_argument("--out", required=True, help="output HF model directory")
    p.add_argument("--family", choices=("gpt2", "llama"), default=None,
                   help="HF architecture (default: inferred from the config)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="cast floating tensors")
    p.set_defaults(func=cmd_ml_to_hf)


def cmd_consolidate(args) -> None:
    from megatron_lite.checkpoint.offline import full_weights, open_checkpoint

    dtype = DTYPES[args.dtype]
    with open_checkpoint(args.load, args.iteration, args.verify_checkpoint) as reader:
        cfg = ModelConfig(**reader.meta["model_config"])
        state = full_weights(reader, fp32_from_main=dtype == torch.float32)
        iteration = reader.meta["iteration"]
    write_ml_checkpoint(args.out, cfg, state, dtype)
    print(f"wrote full weights of {reader.dir} (iteration {iteration}; {len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()):,} parameters) to {args.out}")


def _target_ranks(cfg: ModelConfig, tp: int, pp: int, dp: int, vpp: int):
    """(dims, model chunks on the meta device) of every rank of the target layout, one at a time."""
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model

    for rank in range(tp * pp * dp):
        dims = ParallelDims(tp=tp, dp=dp, pp=pp, vpp=vpp, rank=rank)
        with torch.device("meta"):  # shapes and sharding metadata only: no memory, no init
            chunks = build_model(cfg, dims)
        yield dims, chunks  # outside the device context, which a suspended generator would leak


def cmd_reshard(args) -> None:
    from megatron_lite.checkpoint.offline import open_checkpoint, reshard
    from megatron_lite.config import ParallelConfig

    tp, pp, dp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    with open_checkpoint(args.load, args.iteration, args.verify_checkpoint) as reader:
        cfg = ModelConfig(**reader.meta["model_config"])
        vpp = 1
        if args.num_layers_per_virtual_pipeline_stage:
            vpp = cfg.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
        pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        pcfg.validate(tp * pp * dp, cfg, seq_length=1)
        layout = {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "vpp": vpp, "world_size": tp * pp * dp, "zero_stage": None}
        final = reshard(reader, args.out, _target_ranks(cfg, tp, pp, dp, vpp), layout)
    print(f"wrote {reader.dir} resharded for tp={tp} pp={pp} vpp={vpp} dp={dp} ({tp * pp * dp} files) to {final}")


def _add_checkpoint_source(p) -> None:
    p.add_argument("--load", required=True, help="checkpoint root (its latest) or an iter_* directory")
    p.add_argument("--iteration", type=int, default=None, help="this iteration instead of the latest")
    p.add_argument("--no-verify-checkpoint", action="store_false", dest="verify_checkpoint",
                   help="do not check the checkpoint's checksums")


def _add_consolidate(sub) -> None:
    p = sub.add_parser("consolidate", help="sharded training checkpoint -> megatron-lite full checkpoint")
    _add_checkpoint_source(p)
    p.add_argument("--out", required=True, help="output directory (model.safetensors + config.json)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep",
                   help="cast floating tensors (fp32 takes the fp32 main params of bf16/fp16 training)")
    p.set_defaults(func=cmd_consolidate)


def _add_reshard(sub) -> None:
    p = sub.add_parser("reshard", help="training checkpoint -> the same, written as by another layout")
    _add_checkpoint_source(p)
    p.add_argument("--out", required=True, help="output checkpoint root")
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--data-parallel-size"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.set_defaults(func=cmd_reshard)


PARSERS: List[Callable] = [_add_hf_to_ml, _add_ml_to_hf, _add_consolidate, _add_reshard]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except USER_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"convert_checkpoint.py {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
