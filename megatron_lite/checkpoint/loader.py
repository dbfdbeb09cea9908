"""Loading a checkpoint into a trainer of any layout: each rank reads the boxes it holds.

Each rank fills its shard of every bucket (plan.fill_range) from the stored full tensors, then
ZeRO 1-2 all-gather the shards into the full parameters as after an update. Precision follows
the run: params are cast to its dtype; fp32 values come from the fp32 main params when the
checkpoint has them (a bf16/fp16 checkpoint), else from the stored params.

What is restored:
- always: the weights; unless --finetune: the values registered for the progress (state.py: the
  iteration, consumed samples, the LR schedule's position);
- unless --finetune / --no-load-optim: the update rule's states, fp32 main params, and the values
  registered for the optimizer: the update count and (fp16 to fp16) the loss scaler; the LR
  schedule is that of this run's flags at the loaded position (the same as the checkpoint's
  unless they changed: a note says what changed);
- unless --finetune / --no-load-rng, and only at the writing layout: every rank's RNG states.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from ..config import ModelConfig
from ..errors import agree_on_errors
from ..optim.feedback_state import FEEDBACK, restore_own_errors
from ..parallel.compression import OPTIONAL_STATES
from . import directory, rng
from .files import CheckpointError
from .foreign import foreign_checkpoint
from .plan import MODEL, buffer_key, bucket_sources, fill_range, model_key, optim_key, persistent_buffers, regions
from .reader import CheckpointReader
from .saver import layout_of, world_rank
from .state import TrainState

# ModelConfig fields that do not change the stored tensors or what they compute with.
FREE_FIELDS = {"attention_dropout", "hidden_dropout", "init_method_std", "attention_backend",
               "make_vocab_size_divisible_by", "family",
               # MoE: how tokens are exchanged and balanced, not the experts' weights
               "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_aux_loss_coeff", "moe_z_loss_coeff",
               "moe_router_bias_update_rate", "moe_input_jitter_eps", "moe_router_load_balancing_type",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
               "moe_router_dtype", "moe_layer_recompute",
               "mtp_loss_scaling_factor",
               "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_dense_warmup_iters",  # DSA's training
               "tokenizer_vocab_size"}  # the MTP loss's weight: training, not the weights


def config_diffs(saved: dict, current: dict, prefix: str = "") -> List[str]:
    """'field is X there and Y here' for each model-defining field in which two configs differ."""
    out = []
    for name, value in current.items():
        if name in FREE_FIELDS or name not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[name], dict):
            out += config_diffs(saved[name], value, f"{prefix}{name}.")
        elif saved[name] != value:
            hint = (" (a shape command line now gets Megatron's tanh GELU: add --activation gelu or "
                    "--no-bias-gelu-fusion for the exact one)" if name == "activation" else "")
            hint = vocab_hint(saved[name]) if name == "vocab_size" and not prefix else hint
            out.append(f"{prefix}{name} is {saved[name]!r} there and {value!r} here{hint}")
    return out


def vocab_hint(saved_vocab: int, use_checkpoint_args: bool = False) -> str:
    """What to pass when the tokenizer's vocabulary is not the checkpoint's."""
    take = "" if use_checkpoint_args else "pass --use-checkpoint-args to take the checkpoint's tokenizer, or "
    return (f" (the vocabulary is the tokenizer's: {take or 'pass '}the --tokenizer-type / --tokenizer-model it was "
            f"trained with; NullTokenizer: --vocab-size {saved_vocab - 1})")


def check_model_config(saved: dict, current: ModelConfig, where: str) -> None:
    """Raise naming every field in which the checkpoint's model differs from this one."""
    diffs = config_diffs(saved, dataclasses.asdict(current))
    if diffs:
        raise CheckpointError(f"checkpoint {where} was written by a different model: {'; '.join(diffs)}")


def _source_keys(kind: str, name: str, load_optim: bool, dtype: torch.dtype) -> Optional[List[str]]:
    """Stored keys to fill a tensor from, by preference; None: leave it as it is."""
    if kind == MODEL:
        fp32_first = load_optim and dtype == torch.float32
        return ([optim_key(name, "main")] if fp32_first else []) + [model_key(name)]
    if kind == "main":
        return ([optim_key(name, "main")] if load_optim else []) + [model_key(name)]
    return [optim_key(name, kind)] if load_optim else None


@torch.no_grad()
def fill_tensors(state: TrainState, reader: CheckpointReader, load_optim: bool) -> None:
    """Every rank: its shard of every bucket's params and optimizer state, from the checkpoint.
    Local (no collective): the caller all-gathers the parameters once every rank succeeded."""
    for bucket, sources in bucket_sources(state.optimizer, for_loading=True):
        lo, hi = fill_range(bucket)
        for region in regions(bucket, lo, hi, state.dims, writers_only=False):
            runs = region.runs()
            for kind, (flat, base) in sources.items():
                keys = _source_keys(kind, region.name, load_optim, flat.dtype)
                if keys is None or (kind in OPTIONAL_STATES and not reader.has(keys[0])):
                    continue  # (written without compression: no residual, zeros)
                key = reader.pick(keys, region.spec.stored_shape)
                for run in runs:
                    reader.read_into(key, run.full, run.view(flat, region.start - base))
    state.optimizer.commit_loaded_state()  # low-precision states: store what was filled in fp32


def _restore_own_errors(state: TrainState, reader: CheckpointReader, meta: dict) -> None:
    """At the writing layout, this rank's own compression errors replace the folded residuals just
    filled (optim/feedback_state.py): the resumed run continues bit-exactly."""
    prefix = rng.rank_prefix(state.dims, FEEDBACK) + "/"
    keys = [k for k in reader.pieces if k.startswith(prefix)]
    if keys and meta["layout"] == layout_of(state):
        restore_own_errors(state.optimizer, {k[len(prefix):]: reader.read_full(k) for k in keys})


def _same_layout(saved: dict, dims) -> bool:
    return all(saved.get(k) == getattr(dims, k) for k in ("tp", "pp", "dp", "cp"))


class Loaded:
    """What a load found; restore_rng() is left to the caller so that it can come after every
    other use of the RNG while setting up (a DataLoader iterator draws a seed from it)."""

    def __init__(self, ckpt_dir: str, meta: dict, rng_states: Optional[Dict[str, torch.Tensor]], notes: List[str]):
        self.dir, self.meta, self.rng_states, self.notes = ckpt_dir, meta, rng_states, notes

    def restore_rng(self, state: TrainState) -> None:
        if self.rng_states:
            rng.restore(self.rng_states, state.dims, state.tracker)


def _read_local(state: TrainState, path: str, load_optim: bool, load_rng: bool, iteration: Optional[int],
                verify: bool):
    """This rank's reads: metadata, its shards of the tensors, its RNG states (no collective)."""
    t = state.cfg.training
    foreign = None if iteration is not None else \
        foreign_checkpoint(path, state.formats, t.ckpt_format, t.auto_detect_ckpt_format)
    notes, rng_states = [], None
    if foreign is not None:  # (Megatron-LM's RNG states are its CUDA generators': not ours to restore)
        fmt, ckpt_dir = foreign
        meta, reader = fmt.open(ckpt_dir, state.cfg.model, load_optim)
        load_rng = False
    else:
        ckpt_dir, _ = directory.resolve(path, iteration)
        meta = directory.read_metadata(ckpt_dir, verify)
        reader = CheckpointReader(ckpt_dir, meta, verify)
    check_model_config(meta["model_config"], state.cfg.model, ckpt_dir)
    if meta.get("weights_only"):  # converted (Hugging Face, Megatron-LM): the weights are all there is
        load_optim = load_rng = False
        notes.append("a weights-only checkpoint: optimizer, schedule and data position start fresh")
    with reader:
        reader.verify_files()
        fill_tensors(state, reader, load_optim)
        if load_optim:
            _restore_own_errors(state, reader, meta)
        for name, buf in persistent_buffers(state.chunks):  # e.g. MoE expert biases
            if reader.has(buffer_key(name)):
                buf.copy_(reader.read_full(buffer_key(name)))
        if load_rng:
            prefix = rng.rank_prefix(state.dims) + "/"
            keys = [k for k in reader.pieces if k.startswith(prefix)]
            if _same_layout(meta["layout"], state.dims) and keys:
                rng_states = {k: reader.read_full(k) for k in keys}
            else:
                notes.append("RNG states not restored (written at another layout): dropout streams start "
                             "from the seed")
    return ckpt_dir, meta, rng_states, notes


def load_checkpoint(state: TrainState, path: str, *, load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False, iteration: Optional[int] = None, verify: bool = True) -> Loaded:
    """Collective: load checkpoint `path` (a root: its latest, or `iteration`; or an iter_* dir).
    `verify`: check the checksums of metadata.json and of every piece read. An error on any rank
    (a missing, truncated or corrupted file) is raised on every rank, naming that rank."""
    load_optim = load_optim and not finetune
    ckpt_dir, meta, rng_states, notes = agree_on_errors(
        lambda: _read_local(state, path, load_optim, load_rng and not finetune, iteration, verify), state.device)
    if meta.get("weights_only"):
        finetune, load_optim = True, False
    sync = state.optimizer.sync
    sync.gather_params()  # ZeRO 1-2: every rank's filled shard into the full params
    sync.wait_param_gather()
    if not finetune:
        notes += state.restore(meta, "progress")
    if load_optim:
        notes += state.restore(meta, "optimizer")
    if world_rank() == 0:
        what = "weights" if finetune or not load_optim else "model and optimizer"
        print(f"> loaded {what} from {ckpt_dir} (iteration {meta['iteration']})"
              + "".join(f"; {n}" for n in notes), flush=True)
    return Loaded(ckpt_dir, meta, rng_states, notes)
