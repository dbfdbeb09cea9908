#!/usr/bin/env python
"""Convert checkpoints between Hugging Face, megatron-lite training checkpoints and layouts.

    python tools/convert_checkpoint.py hf-to-ml --hf-dir llama-hf/ --out ckpt/ --tensor-model-parallel-size 2
    python tools/convert_checkpoint.py megatron-to-ml --load megatron-run/ --out ckpt/ [--iteration N]
    python tools/convert_checkpoint.py ml-to-megatron --load ckpt/ --out megatron-run/ --tensor-model-parallel-size 2
    python tools/convert_checkpoint.py ml-to-hf --load ckpt/ --out llama-hf2/ [--tokenizer-model llama-hf/]
    python tools/convert_checkpoint.py consolidate --load ckpt/ --out full/ [--iteration N]
    python tools/convert_checkpoint.py reshard --load ckpt/ --out ckpt-tp4/ --tensor-model-parallel-size 4

`hf-to-ml` writes a weights-only training checkpoint (what `pretrain_gpt.py --save` writes, at
iteration 0, without optimizer state) at the given TP / PP / EP layout, streaming tensor by tensor
from (sharded) safetensors, so peak memory stays near one tensor, and copies a HF tokenizer found
beside the weights into OUT/tokenizer, recorded as the checkpoint's tokenizer; `pretrain_gpt.py --load ckpt/
--use-checkpoint-args` trains from it at any layout. `ml-to-hf` writes a save_pretrained directory
(config.json and generation_config.json with bos / eos / pad ids, sharded model*.safetensors with an
index, the run's tokenizer where it has a HF form) from
any training checkpoint (any layout, any precision) or a full checkpoint (`--ml-dir`: the
`model.safetensors` + `config.json` that `consolidate` writes), streaming too: the conversion runs
on the meta device first, so every file's header is written before its tensors, each as it is read.
Families: models/hf_families.py.
`megatron-to-ml` does what hf-to-ml does for a Megatron-LM `--save` directory of a GPT model
(torch_dist or legacy per-rank files, any TP / PP / virtual PP layout), its model config from the
checkpoint's args (models/megatron_conversion.py, models/megatron_checkpoint.py); `ml-to-megatron`
goes back: a dense GPT model as Megatron-LM's legacy per-rank files (`--ckpt-format torch`) at a
given TP / PP, or Megatron-Core's torch_dist checkpoint, through the same name table and TP split
(megatron-to-ml reads either back bit for bit).

Weights are read with safetensors, torch.distributed.checkpoint, or torch.load(weights_only=True)
for `.bin` / `.pt` files: nothing is unpickled beyond tensors (and, for Megatron-LM's files, an
allow-list of the classes they pickle). Errors print one line and exit with status 2. New subcommands: add a `_add_<name>`
parser builder and list it in PARSERS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import struct
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from models.hf_conversion import (ConversionError, hf_config_to_model_config, hf_names,  # noqa: E402
                                  hf_to_ours_stream, model_config_to_hf_config, our_names, our_sizes,
                                  ours_to_hf_stream, without_absent_mtp)
from models.hf_families import FAMILIES, family_of, fp8_block_size  # noqa: E402
from models.hf_tokenizers import hf_tokenizer  # noqa: E402

ML_WEIGHTS, ML_CONFIG = "model.safetensors", "config.json"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Failures caused by the user's input: reported in one line, exit status 2.
USER_ERRORS = (ConversionError, ConfigError, OSError, ValueError, KeyError, TypeError, SafetensorError)


class CLIError(ValueError):
    pass


# --- Hugging Face weights, read lazily --------------------------------------------------------
class HFWeights:
    """The tensors of a save_pretrained directory (single or sharded safetensors, else .bin), read
    one at a time when asked for; `unused()` lists the ones never read."""

    def __init__(self, hf_dir: str, fp8_block: Optional[Tuple[int, int]] = None):
        self.dir, self.where, self.handles, self.read = hf_dir, {}, {}, set()
        self.fp8_block = fp8_block  # FP8 weights' scale blocks: dequantized when read
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(hf_dir, index_name)
            if os.path.exists(path):
                with open(path) as f:
                    self.where = dict(json.load(f)["weight_map"])
                break
        else:
            for name in (ML_WEIGHTS, "pytorch_model.bin"):
                if os.path.exists(os.path.join(hf_dir, name)):
                    self.where = {key: name for key in self._keys_of(name)}
                    break
        if not self.where:
            raise CLIError(f"no model.safetensors or pytorch_model.bin (or their index) in {hf_dir!r}")
        for fname in set(self.where.values()):
            if not os.path.exists(os.path.join(hf_dir, fname)):
                raise CLIError(f"{os.path.join(hf_dir, fname)} (named by the index) is missing")

    def _handle(self, fname: str):
        if fname not in self.handles:
            path = os.path.join(self.dir, fname)
            if fname.endswith(".safetensors"):
                self.handles[fname] = _SafetensorsFile(path)
            else:  # memory-mapped, tensors only: nothing else is unpickled
                try:
                    self.handles[fname] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except pickle.UnpicklingError as e:
                    raise ConversionError(f"{path}: refused (torch.load weights_only=True unpickles tensors only): "
                                          f"{str(e).splitlines()[0]}") from e
        return self.handles[fname]

    def _keys_of(self, fname: str) -> List[str]:
        h = self._handle(fname)
        return list(h.keys())

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise ConversionError(f"HF checkpoint {self.dir} is missing {key!r}")
        self.read.add(key)
        h = self._handle(self.where[key])
        t = h.get_tensor(key) if hasattr(h, "get_tensor") else h[key]
        if t.dtype in FP8_DTYPES:
            scale = key + "_scale_inv"
            if self.fp8_block is None or scale not in self.where:
                raise ConversionError(f"{key} is {t.dtype} without {scale} and a block-scaled FP8 "
                                      f"quantization_config in config.json: cannot dequantize it")
            from models.hf_families import dequantize_fp8_blocks
            t = dequantize_fp8_blocks(t, self.get(scale), self.fp8_block)
        return t

    def dtype(self) -> torch.dtype:
        """The dtype the weights were saved in (that of the first floating tensor)."""
        for key in sorted(k for k in self.where if not k.endswith("_scale_inv")):
            h = self._handle(self.where[key])
            dtype = h.dtype(key) if isinstance(h, _SafetensorsFile) else h[key].dtype
            if dtype.is_floating_point and dtype not in FP8_DTYPES:
                return dtype
        return torch.float32

    def unused(self, ignored) -> List[str]:
        return sorted(k for k in self.where if k not in self.read and not k.endswith(ignored))


class _SafetensorsFile:
    """Tensors of a safetensors file read with plain reads into fresh memory, one at a time (a
    memory map would keep every page read resident, i.e. the whole model by the end)."""

    def __init__(self, path: str):
        from megatron_lite.checkpoint.files import read_header
        from megatron_lite.checkpoint.reader import CODE_DTYPES

        self.path, self.codes = path, CODE_DTYPES
        try:
            self.start, self.entries = read_header(path)
        except (ValueError, OverflowError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} is not a readable safetensors file: {e}") from e
        self.entries.pop("__metadata__", None)

    def keys(self) -> List[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.codes[self.entries[key]["dtype"]]

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        lo, hi = entry["data_offsets"]
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start + lo)
            f.readinto(buf.numpy())
        return buf.view(self.dtype(key)).view(entry["shape"])


# --- megatron-lite full checkpoints (model.safetensors + config.json) ---------------------------
def _require_dir(path: str, what: str) -> None:
    if not os.path.isdir(path):
        raise CLIError(f"{what} {path!r} is not a directory")


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


# --- layouts ----------------------------------------------------------------------------------
def _target_ranks(cfg: ModelConfig, tp: int, pp: int, dp: int, vpp: int, ep: int = 1, etp: int = 1):
    """(dims, model chunks on the meta device) of every rank of the target layout, one at a time."""
    from megatron_lite.parallel.state import ParallelDims
    from megatron_lite.transformer.spec import BuildContext
    from models.gpt import build_model

    for rank in range(tp * pp * dp):
        dims = ParallelDims(tp=tp, dp=dp, pp=pp, vpp=vpp, ep=ep, etp=etp, rank=rank)
        # Shapes and sharding metadata only: parameters left on the meta device (build_model
        # materializes and initializes them otherwise, whatever device context it is called in).
        chunks = build_model(cfg, BuildContext(dims), materialize=False)
        yield dims, chunks


def _layout(args, cfg: ModelConfig) -> Tuple[int, int, int, int, int]:
    """(tp, pp, dp, vpp, ep) of the target layout, validated; DP is the smallest EP allows."""
    from megatron_lite.config import ParallelConfig

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1)
    dp = max(getattr(args, "data_parallel_size", 1), ep)
    vpp = 1
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        vpp = cfg.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    pcfg.validate(tp * pp * dp, cfg, seq_length=1)
    return tp, pp, dp, vpp, ep


def _layout_meta(tp, pp, dp, vpp, ep) -> dict:
    return {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": ep, "etp": 1, "vpp": vpp, "world_size": tp * pp * dp,
            "zero_stage": None}


# --- subcommands ------------------------------------------------------------------------------
def _write_converted(args, cfg: ModelConfig, stream, names: List[str], dtype: torch.dtype, source: str,
                     data: Optional[dict] = None):
    """Write the stream of our full tensors (in the order `names`) as a weights-only training
    checkpoint at the layout of the flags (`data`: the tokenizer settings to record); returns (its
    directory, the layout)."""
    from megatron_lite.checkpoint.directory import VERSION
    from megatron_lite.checkpoint.files import FORMAT
    from megatron_lite.checkpoint.offline import write_weights_checkpoint

    tp, pp, dp, vpp, ep = layout = _layout(args, cfg)
    meta = {"format": FORMAT, "version": VERSION, "model_config": dataclasses.asdict(cfg),
            "config": {"model": dataclasses.asdict(cfg), **({"data": data} if data else {})},
            "layout": _layout_meta(tp, pp, dp, vpp, ep),
            "lr_scheduler": {}, "optimizer": None, "source": source}
    final = write_weights_checkpoint(args.out, meta, _target_ranks(cfg, tp, pp, dp, vpp, ep), stream, names, dtype)
    return final, layout


def cmd_hf_to_ml(args) -> None:
    from transformers import AutoConfig

    _require_dir(args.hf_dir, "HF model directory")
    hf_config = AutoConfig.from_pretrained(args.hf_dir, local_files_only=True)
    declared = hf_config_to_model_config(hf_config)
    weights = HFWeights(args.hf_dir, fp8_block_size(hf_config))
    cfg = without_absent_mtp(declared, weights.has)
    if cfg.mtp_depth != declared.mtp_depth:
        print(f"note: the config declares {declared.mtp_depth} multi-token prediction layers but the weights hold "
              f"none (transformers drops them): converted without them")
    fam = family_of(cfg)
    _layout(args, cfg)  # a bad layout fails before anything is read
    dtype = DTYPES[args.dtype] or weights.dtype()
    stream = hf_to_ours_stream(weights.get, weights.has, cfg, fam.rules, our_sizes(cfg))
    tokenizer = copy_hf_tokenizer(args.hf_dir, os.path.join(args.out, TOKENIZER_DIR))
    data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer} if tokenizer else None
    final, (tp, pp, dp, _, ep) = _write_converted(args, cfg, stream, our_names(cfg, fam.rules), dtype,
                                                  f"hf-to-ml {os.path.abspath(args.hf_dir)}", data)
    left = [k for k in weights.unused(fam.ignored) if k not in fam.dropped]
    if left:
        raise ConversionError(f"HF checkpoint has {len(left)} tensors no {fam.name} rule reads, e.g. {left[:3]}")
    print(f"wrote {fam.name} weights ({cfg.num_parameters():,} parameters, {dtype}) from {args.hf_dir} as a "
          f"training checkpoint for tp={tp} pp={pp} ep={ep} ({tp * pp * dp} files) to {final}")
    print(f"the tokenizer beside the weights copied to {tokenizer}: the default tokenizer of runs from this checkpoint"
          if tokenizer else f"no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...) in {args.hf_dir}: runs from this "
          f"checkpoint need --tokenizer-type / --tokenizer-model (a vocabulary of {cfg.vocab_size})")


# What a HF tokenizer directory may hold (AutoTokenizer reads these; weights and model config are apart).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")
TOKENIZER_DIR = "tokenizer"


def copy_hf_tokenizer(hf_dir: str, dest: str) -> Optional[str]:
    """Copy the HF tokenizer files found in hf_dir to dest; returns dest's absolute path, or None if
    there were none. A tokenizer_config.json alone (no vocabulary) is not a tokenizer."""
    import shutil

    found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if not set(found) - {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}:
        return None
    os.makedirs(dest, exist_ok=True)
    for f in found:
        shutil.copyfile(os.path.join(hf_dir, f), os.path.join(dest, f))
    return os.path.abspath(dest)


# Megatron-LM's model flags (its names and meanings), for checkpoints whose args lack them or to
# override them: (flag, type or an argparse action).
MEGATRON_MODEL_FLAGS = [
    ("--num-layers", int), ("--hidden-size", int), ("--ffn-hidden-size", int), ("--num-attention-heads", int),
    ("--num-query-groups", int), ("--kv-channels", int), ("--max-position-embeddings", int),
    ("--normalization", str), ("--norm-epsilon", float), ("--position-embedding-type", str), ("--rotary-base", int),
    ("--rotary-percent", float), ("--rope-scaling-factor", float), ("--padded-vocab-size", int),
    ("--make-vocab-size-divisible-by", int),
    ("--group-query-attention", "store_true"), ("--swiglu", "store_true"), ("--openai-gelu", "store_true"),
    ("--disable-bias-linear", "store_false"), ("--add-qkv-bias", "store_true"), ("--qk-layernorm", "store_true"),
    ("--apply-layernorm-1p", "store_true"), ("--untie-embeddings-and-output-weights", "store_true"),
    ("--use-rope-scaling", "store_true"), ("--no-bias-gelu-fusion", "store_false"),
]


def _megatron_flag_dest(flag: str) -> str:
    return {"--disable-bias-linear": "add_bias_linear", "--no-bias-gelu-fusion": "bias_gelu_fusion"}.get(
        flag, flag[2:].replace("-", "_"))


def _megatron_model(src, args) -> ModelConfig:
    """Our model config of a Megatron checkpoint: its args, with the model flags given over them. The
    vocabulary: every stored row, as Megatron's softmax has them (the tokenizer's from --vocab-size or
    NullTokenizer's args recorded apart), or only the tokenizer's under --trim-padded-vocab."""
    from models.megatron_conversion import model_config_from_megatron_args, true_vocab_size

    given = {}
    for flag, _ in MEGATRON_MODEL_FLAGS:
        dest = _megatron_flag_dest(flag)
        if hasattr(args, dest):
            given[dest] = getattr(args, dest)
    if not src.args and not given:
        raise CLIError(f"{src.dir} holds no args: give the model flags (--num-layers, --hidden-size, "
                       f"--num-attention-heads, ...)")
    margs = {**src.args, **given}
    rows = src.rows("embedding.word_embeddings.weight")
    tokenizer_vocab = true_vocab_size(margs, args.vocab_size)
    if args.trim_padded_vocab and tokenizer_vocab is None:
        raise CLIError("--trim-padded-vocab needs the tokenizer's vocabulary, which the checkpoint's args do not "
                       "say: give --vocab-size")
    vocab = tokenizer_vocab if args.trim_padded_vocab else margs.get("padded_vocab_size") or rows
    if rows is not None and max(vocab, tokenizer_vocab or 0) > rows:
        raise CLIError(f"vocabulary size {max(vocab, tokenizer_vocab)} exceeds the {rows} rows of the checkpoint's "
                       f"word embeddings")
    cfg = model_config_from_megatron_args(margs, vocab)
    if tokenizer_vocab is not None and tokenizer_vocab < vocab:
        cfg = dataclasses.replace(cfg, tokenizer_vocab_size=tokenizer_vocab)
    return cfg


def cmd_megatron_to_ml(args) -> None:
    from models.megatron_checkpoint import open_megatron_checkpoint
    from models.megatron_conversion import MEGATRON_RULES

    src = open_megatron_checkpoint(args.load, args.iteration)
    cfg = _megatron_model(src, args)
    if src.format == "legacy" and cfg.moe is not None and cfg.moe.moe_grouped_gemm:
        raise ConversionError("legacy checkpoints of grouped-GEMM experts (--moe-grouped-gemm: GroupedMLP / "
                              "TEGroupedMLP tensors) are not read yet: convert the run's torch_dist checkpoint")
    src.configure(cfg.vocab_size, cfg.swiglu)
    _layout(args, cfg)  # a bad layout fails before anything is read
    wanted = hf_names(cfg, MEGATRON_RULES)
    missing = [n for n in wanted if not src.has(n)]
    if missing:
        raise ConversionError(f"Megatron checkpoint {src.dir} lacks {len(missing)} tensors this model needs, "
                              f"e.g. {missing[:3]}")
    tied_copy = set() if cfg.untie_embeddings_and_output_weights else {"output_layer.weight"}  # the last stage's
    left = sorted(set(src.names()) - set(wanted) - tied_copy)
    if left:
        raise ConversionError(f"Megatron checkpoint has {len(left)} tensors no rule reads, e.g. {left[:3]}")
    dtype = DTYPES[args.dtype] or src.dtype()
    stream = hf_to_ours_stream(src.get, src.has, cfg, MEGATRON_RULES, our_sizes(cfg))
    final, (tp, pp, dp, _, _) = _write_converted(
        args, cfg, stream, our_names(cfg, MEGATRON_RULES), dtype,
        f"megatron-to-ml {os.path.abspath(src.dir)} ({src.format}, iteration {src.iteration})")
    rows = src.rows("embedding.word_embeddings.weight")
    padding = " (the tokenizer's: --trim-padded-vocab)" if cfg.vocab_size < rows else \
        f" (Megatron's padded rows, in the softmax as Megatron has them; the tokenizer's {cfg.tokenizer_vocab_size})" \
        if cfg.tokenizer_vocab_size else " (Megatron's padded rows, in the softmax as Megatron has them)"
    print(f"wrote Megatron-Core GPT weights ({cfg.num_parameters():,} parameters, {dtype}, vocabulary "
          f"{cfg.vocab_size}{padding}) from {src.dir} ({src.format}, iteration {src.iteration}) as a training "
          f"checkpoint for tp={tp} pp={pp} ({tp * pp * dp} files) to {final}")


def cmd_ml_to_megatron(args) -> None:
    from models.megatron_checkpoint import TRACKER
    from models.megatron_conversion import MEGATRON_RULES, VOCAB_TENSORS, megatron_args_of_config
    from models.megatron_writer import local_names, pad_vocab, write_legacy, write_torch_dist

    cfg, get, _, close, ckpt_meta = _ours_from(args)
    try:
        tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
        experts = cfg.moe.num_experts if cfg.moe is not None and cfg.moe.num_experts else 0
        if tp < 1 or pp < 1 or cfg.num_attention_heads % tp or cfg.num_query_groups % tp or cfg.num_layers % pp:
            raise CLIError(f"tp={tp} pp={pp} does not divide the model's {cfg.num_attention_heads} heads, "
                           f"{cfg.num_query_groups} query groups and {cfg.num_layers} layers")
        if ep < 1 or (experts or 1) % ep:
            raise CLIError(f"expert_model_parallel_size ({ep}) must divide the model's "
                           f"{experts or 'no'} experts" + ("" if experts else ": leave it at 1 for a dense model"))
        margs = megatron_args_of_config(cfg, tp, pp, ep)
        data = (ckpt_meta.get("config") or {}).get("data") or {}
        if data.get("tokenizer_type") == "NullTokenizer":  # Megatron's NullTokenizer adds the end of document
            margs.update(tokenizer_type="NullTokenizer", vocab_size=cfg.tokenizer_vocab - 1)
        dtype = DTYPES[args.dtype]
        release = os.path.join(args.out, "release")
        stream = ((n, t if dtype is None or not t.is_floating_point() else t.to(dtype))
                  for n, t in ours_to_hf_stream(get, cfg, MEGATRON_RULES))
        stream = ((n, pad_vocab(t, margs["padded_vocab_size"]) if n in VOCAB_TENSORS else t) for n, t in stream)
        if args.ckpt_format == "torch_dist":
            # Megatron-Core names a layer's tensors per layer when dense and MoE layers may mix
            per_layer = experts and (isinstance(cfg.moe.moe_layer_freq, (list, str)) or cfg.moe.moe_layer_freq > 1)
            if cfg.multi_latent_attention:  # MLA's layer spec keeps the norms' own names in its sharded keys
                stream = ((local_names(n), t) for n, t in stream)
            params = write_torch_dist(release, stream, cfg.num_layers, experts, margs, per_layer)
        else:
            params = write_legacy(release, stream, cfg, margs, tp, pp, ep, experts)
        with open(os.path.join(args.out, TRACKER), "w") as f:
            f.write("release")
    finally:
        close()
    what = "torch_dist checkpoint" if args.ckpt_format == "torch_dist" else \
        f"legacy per-rank (torch) checkpoint for tp={tp} pp={pp}" + (f" ep={ep}" if ep > 1 else "") + \
        f" ({tp * pp * ep} files)"
    print(f"wrote a Megatron-LM {what} ({cfg.num_parameters():,} parameters, {params}, padded vocabulary "
          f"{margs['padded_vocab_size']}) to {release}: Megatron-LM loads it with --load {args.out} --ckpt-format "
          f"{args.ckpt_format} --use-checkpoint-args")


def _ours_from(args):
    """(ModelConfig, getter of our full tensors by stored name, getter of the same on the meta
    device (shape and dtype, nothing read), closer) of --load or --ml-dir."""
    if args.ml_dir:
        cfg, state = read_ml_checkpoint(args.ml_dir)
        return cfg, state.__getitem__, lambda name: torch.empty_like(state[name], device="meta"), lambda: None, {}
    from megatron_lite.checkpoint.offline import open_checkpoint
    from megatron_lite.checkpoint.plan import buffer_key

    reader = open_checkpoint(args.load, args.iteration, args.verify_checkpoint)
    cfg = ModelConfig(**reader.meta["model_config"])

    def key_of(name: str) -> str:  # fp32 main params where bf16/fp16 training kept them; buffers (expert biases)
        for key in (f"optim/{name}/main", buffer_key(name)):
            if reader.has(key):
                return key
        return f"model/{name}"

    def meta(name: str) -> torch.Tensor:
        key = key_of(name)
        return torch.empty(reader.shapes[key], dtype=reader.dtype(key), device="meta")

    return cfg, (lambda name: reader.read_full(key_of(name))), meta, reader.close, reader.meta


def _shards(plan: List[Tuple[str, Tuple[int, ...], torch.dtype]], max_bytes: int):
    """Groups of (name, shape, dtype) of at most max_bytes of data (a tensor larger than that alone)."""
    group, size = [], 0
    for entry in plan:
        n = _nbytes(entry)
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(entry)
        size += n
    if group:
        yield group


def _nbytes(entry) -> int:
    _, shape, dtype = entry
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _write_safetensors_stream(path: str, plan, tensors: Iterator[Tuple[str, torch.Tensor]]) -> None:
    """The tensors `plan` lists (name, shape, dtype) as one safetensors file, its header written first
    and then each tensor as `tensors` (a stream in plan order) yields it: one tensor in memory."""
    from megatron_lite.checkpoint.files import _header

    header = _header(plan, {"format": "pt"})
    tmp = path + ".tmp"  # renamed into place once complete: a crash never leaves a truncated file
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, shape, dtype in plan:
            got, t = next(tensors)
            if (got, tuple(t.shape), t.dtype) != (name, tuple(shape), dtype):
                raise ConversionError(f"{got} {tuple(t.shape)} {t.dtype} arrived where {name} {shape} {dtype} "
                                      f"was planned")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cmd_ml_to_hf(args) -> None:
    cfg, get, meta, close, ckpt_meta = _ours_from(args)
    try:
        fam = family_of(cfg, args.family)
        hf_config = model_config_to_hf_config(cfg, fam.name)
        os.makedirs(args.out, exist_ok=True)
        dtype = DTYPES[args.dtype]

        def converted(getter):
            return ((n, (t if dtype is None else t.to(dtype)).contiguous()) for n, t in
                    ours_to_hf_stream(getter, cfg, fam.rules))

        # The same conversion on the meta device first: every file's header (names, shapes, dtypes)
        # is known before any data is read, so each tensor is written as it arrives.
        plan = [(n, tuple(t.shape), t.dtype) for n, t in converted(meta)]
        stream = converted(get)
        files, weight_map = [], {}
        for i, group in enumerate(_shards(plan, int(args.max_shard_size_gb * 2**30))):
            fname = f"model-{i + 1:05d}.safetensors"
            _write_safetensors_stream(os.path.join(args.out, fname), group, stream)
            files.append(fname)
            weight_map.update({n: fname for n, _, _ in group})
        total = sum(_nbytes(e) for e in plan)
    finally:
        close()
    _name_shards(args.out, files, weight_map, total)
    data = dict((ckpt_meta.get("config") or {}).get("data") or {})
    if args.tokenizer_model:
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": args.tokenizer_model}
    tokenizer, why_not = hf_tokenizer(data)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # HF generate stops at eos
            setattr(hf_config, key, getattr(tokenizer, key))
    hf_config.save_pretrained(args.out)
    _generation_config(hf_config).save_pretrained(args.out)
    print(f"wrote HF {hf_config.architectures[0]} ({len(weight_map)} tensors in {len(files)} files) to {args.out}"
          + (f" with its {data['tokenizer_type']} as a HF tokenizer (eos id {tokenizer.eos_token_id})" if tokenizer
             else f"; no tokenizer: {why_not} (--tokenizer-model DIR adds a HF one)"))


def _name_shards(out: str, files: List[str], weight_map: Dict[str, str], total: int) -> None:
    """HF's names: model.safetensors alone, or model-0000i-of-0000n.safetensors with an index."""
    if len(files) == 1:
        os.replace(os.path.join(out, files[0]), os.path.join(out, ML_WEIGHTS))
        return
    n = len(files)
    final = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in final.items():
        os.replace(os.path.join(out, old), os.path.join(out, new))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}},
                  f, indent=2, sort_keys=True)


def _generation_config(hf_config):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
                            pad_token_id=hf_config.pad_token_id)


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


def cmd_reshard(args) -> None:
    from megatron_lite.checkpoint.offline import open_checkpoint, reshard

    with open_checkpoint(args.load, args.iteration, args.verify_checkpoint) as reader:
        cfg = ModelConfig(**reader.meta["model_config"])
        tp, pp, dp, vpp, ep = _layout(args, cfg)
        final = reshard(reader, args.out, _target_ranks(cfg, tp, pp, dp, vpp, ep), _layout_meta(tp, pp, dp, vpp, ep))
    print(f"wrote {reader.dir} resharded for tp={tp} pp={pp} vpp={vpp} dp={dp} ep={ep} ({tp * pp * dp} files) "
          f"to {final}")


# --- parsers ----------------------------------------------------------------------------------
def _add_layout(p, data_parallel: bool) -> None:
    flags = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"]
    for flag in flags + (["--data-parallel-size"] if data_parallel else []):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)


def _add_checkpoint_source(p, required: bool = True) -> None:
    p.add_argument("--load", required=required, help="checkpoint root (its latest) or an iter_* directory")
    p.add_argument("--iteration", type=int, default=None, help="this iteration instead of the latest")
    p.add_argument("--no-verify-checkpoint", action="store_false", dest="verify_checkpoint",
                   help="do not check the checkpoint's checksums")


def _add_hf_to_ml(sub) -> None:
    p = sub.add_parser("hf-to-ml", help="HF save_pretrained directory -> weights-only training checkpoint")
    p.add_argument("--hf-dir", required=True, help="directory with config.json and model weights")
    p.add_argument("--out", required=True, help="output checkpoint root (what --load takes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="stored dtype (keep: the HF weights')")
    _add_layout(p, data_parallel=False)
    p.set_defaults(func=cmd_hf_to_ml)


def _add_megatron_to_ml(sub) -> None:
    p = sub.add_parser("megatron-to-ml", help="Megatron-LM checkpoint (torch_dist or legacy) of a GPT model -> "
                                              "weights-only training checkpoint")
    p.add_argument("--load", required=True, help="Megatron-LM --save directory (its latest) or an iteration directory")
    p.add_argument("--iteration", type=int, default=None, help="this iteration instead of the latest")
    p.add_argument("--out", required=True, help="output checkpoint root (what --load takes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="stored dtype (keep: the checkpoint's)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (default: NullTokenizer's from the args): rows past it are "
                        "Megatron's padding, kept as logits in the softmax as Megatron-LM has them")
    p.add_argument("--trim-padded-vocab", action="store_true",
                   help="drop Megatron's padding rows: the model's vocabulary is the tokenizer's, which runs pad "
                        "again per --make-vocab-size-divisible-by x TP, outside the softmax (the loss then differs "
                        "from Megatron's)")
    _add_layout(p, data_parallel=False)
    g = p.add_argument_group("model (Megatron-LM's flags: for checkpoints without args, or to override theirs)")
    for flag, kind in MEGATRON_MODEL_FLAGS:
        kw = dict(action=kind) if isinstance(kind, str) else dict(type=kind)
        g.add_argument(flag, dest=_megatron_flag_dest(flag), default=argparse.SUPPRESS, **kw)
    p.set_defaults(func=cmd_megatron_to_ml)


def _add_ml_to_hf(sub) -> None:
    p = sub.add_parser("ml-to-hf", help="training (or full) checkpoint -> HF save_pretrained directory")
    _add_checkpoint_source(p, required=False)
    p.add_argument("--ml-dir", default=None, help="a full checkpoint (consolidate's output) instead of --load")
    p.add_argument("--out", required=True, help="output HF model directory")
    p.add_argument("--family", choices=sorted(FAMILIES), default=None, help="HF family (default: the model's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="cast floating tensors")
    p.add_argument("--tokenizer-model", default=None, help="a HF tokenizer directory to save beside the weights")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors file (GB)")
    p.set_defaults(func=cmd_ml_to_hf)


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
    _add_layout(p, data_parallel=True)
    p.set_defaults(func=cmd_reshard)


def _add_ml_to_megatron(sub) -> None:
    p = sub.add_parser("ml-to-megatron", help="training (or full) checkpoint of a GPT model -> Megatron-LM checkpoint "
                                              "(legacy per-rank format)")
    _add_checkpoint_source(p, required=False)
    p.add_argument("--ml-dir", default=None, help="a full checkpoint (consolidate's output) instead of --load")
    p.add_argument("--out", required=True, help="Megatron-LM checkpoint root (what its --load takes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="keep", help="cast floating tensors")
    p.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="torch: Megatron-LM's legacy per-rank files; torch_dist: Megatron-Core's distributed "
                        "checkpoint (one layout for any TP / PP)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="layers split evenly over the stages")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="legacy format: experts split evenly over EP ranks (files mp_rank_TT[_PPP]_EEE)")
    p.set_defaults(func=cmd_ml_to_megatron)


PARSERS: List[Callable] = [_add_hf_to_ml, _add_megatron_to_ml, _add_ml_to_megatron, _add_ml_to_hf, _add_consolidate,
                           _add_reshard]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("ml-to-hf", "ml-to-megatron") and not (args.load or args.ml_dir):
            raise CLIError("give the checkpoint to convert: --load CKPT (training) or --ml-dir DIR (full)")
        if getattr(args, "load", None) and getattr(args, "out", None) and \
                os.path.realpath(args.load) == os.path.realpath(args.out):
            raise CLIError(f"--out {args.out} is the --load checkpoint: writing it would replace its own input; "
                           f"give another --out directory")
        args.func(args)
    except USER_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"convert_checkpoint.py {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

