"""Conversion between Hugging Face checkpoints and megatron-lite weights: one family per HF model
type, each a configuration of the GPT model plus a declarative table (hf_families.py).

The engine here maps FULL tensors (unsharded, true vocabulary), one rule at a time, so that a
converter can stream a checkpoint tensor by tensor. A `Rule` names our tensors and HF's (name
templates with {i} for the layer and {e} for the expert) and the transform between them:

  copy     one tensor each side
  t        transposed (GPT-2's Conv1D stores [in, out])
  cat      several HF tensors concatenated along dim 0 into one of ours ([K ; V], [gate ; up])
  t_split  one HF tensor, transposed, split along dim 0 into several of ours (GPT-2's c_attn)
  experts  one HF tensor per expert (several: concatenated along dim 0) stacked into ours [E, ...]
  qkv      Megatron-Core's fused linear_qkv (per query group: its query heads, then K, then V) split
           into our linear_q [Q] and linear_kv [K ; V]
  rope_q   MLA's query projection, per head [nope ; rope] rows, the rope rows' pairs interleaved in HF
  rope_kv  MLA's KV down-projection [latent ; rope], the same
  et       stacked expert weights HF stores [E, in, out] (gpt-oss): transposed per expert
  glu_et   gpt-oss's fused expert [gate | up]: gate and up columns interleaved (g0 u0 g1 u1 ...), in
           the [E, H, 2F] weight (also transposed per expert) and the [E, 2F] bias
           (et / glu_et weights also read from the Hub's MXFP4 `_blocks` / `_scales`, dequantized)
  dup      an HF copy of one of our tensors (DeepSeek-V3's MTP layer repeats the embedding and the
           output layer): written from ours, read and dropped on the way in
  rope_indexer  DSA's indexer (deepseek_v32): per indexer head, the rotated channels first in HF, last
           in ours (models/hf_dsa.py)

Multi-token prediction depths: rules with `{d}` (our depth) and `{n}` (HF's layer number of that depth,
num_layers + d: DeepSeek-V3 stores its MTP module as one more decoder layer) apply once per depth,
with the conditions of the last decoder layer (whose spec the MTP layers take).

The same engine maps Megatron-Core's names (models/megatron_conversion.py: its table puts
Megatron-Core's full-tensor names where an HF table has HF's).

`when` says for which configs (and layers) a rule applies. Sharding to a TP/PP/EP layout and
back goes through each parameter's ShardSpec only (`load_full_state_dict_into_model`,
`gather_full_state_dict`), so a converted checkpoint loads at any layout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from megatron_lite.checkpoint.plan import persistent_buffers
from megatron_lite.config import ModelConfig
from megatron_lite.parallel.sharding import gather_full, spec_of, stored_name
from megatron_lite.parallel.state import ParallelDims

from .hf_families import dequantize_mxfp4, deinterleave_rope_rows, family_for_model_type, family_of, \
    interleave_rope_rows
from .hf_dsa import indexer_rope_first, indexer_rope_last
from .hf_rules import CONDITIONS, OPS, ConversionError, R, Rule  # noqa: F401  (R, OPS: re-exported)

StateDict = Dict[str, torch.Tensor]
Getter = Callable[[str], torch.Tensor]
def _rope_blocks(rule: Rule, cfg: ModelConfig) -> Tuple[int, int]:
    """(plain rows, rotated rows) of each block of an MLA rope_q / rope_kv tensor."""
    nope = cfg.qk_head_dim if rule.op == "rope_q" else cfg.kv_lora_rank
    return nope, cfg.qk_pos_emb_head_dim


def _applies(rule: Rule, cfg: ModelConfig, layer: Optional[int]) -> bool:
    return all(CONDITIONS[c](cfg, layer) for c in rule.when)


def _instances(rule: Rule, cfg: ModelConfig) -> Iterator[Tuple[Optional[int], Rule]]:
    """(layer, rule) for every layer a {i} rule applies to; (None, rule) for global rules; (None, the
    rule at depth d) for every MTP depth of a {d} / {n} rule."""
    if any("{d}" in t or "{n}" in t for t in rule.ours + rule.hf):
        for d in range(cfg.mtp_depth if _applies(rule, cfg, cfg.num_layers - 1) else 0):
            def at(ts, d=d):
                return tuple(t.replace("{d}", str(d)).replace("{n}", str(cfg.num_layers + d)) for t in ts)
            yield None, Rule(at(rule.ours), at(rule.hf), rule.op, rule.when, at(rule.fused_hf))
        return
    layered = any("{i}" in t for t in rule.ours + rule.hf)
    for i in (range(cfg.num_layers) if layered else [None]):
        if _applies(rule, cfg, i):
            yield i, rule


def _fmt(templates: Tuple[str, ...], layer: Optional[int], expert: Optional[int] = None) -> List[str]:
    return [t.format(i=layer, e=expert) for t in templates]


def _num_experts(cfg: ModelConfig) -> int:
    return cfg.moe.num_experts if cfg.moe is not None else 0


def _qkv_groups(cfg: ModelConfig, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V rows of a fused QKV weight or bias laid out per query group as [its q heads; k; v]."""
    ng, d = cfg.num_query_groups, cfg.kv_channels
    per, rest = cfg.num_attention_heads // ng, tuple(fused.shape[1:])
    if fused.shape[0] != ng * (per + 2) * d:
        raise ConversionError(f"fused QKV has {fused.shape[0]} rows, not {ng * (per + 2) * d} = num_query_groups "
                              f"({ng}) x (heads per group ({per}) + 2) x kv_channels ({d})")
    q, k, v = fused.reshape(ng, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _fuse_qkv(cfg: ModelConfig, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Inverse of _qkv_groups: our [Q] and [K ; V] as one fused tensor, per query group [q heads; k; v]."""
    ng, rest = cfg.num_query_groups, tuple(q.shape[1:])
    k, v = kv.chunk(2)
    groups = [t.reshape(ng, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def _per_expert_t(t: torch.Tensor) -> torch.Tensor:
    """[E, a, b] -> [E, b, a]; an [E, n] bias as it is."""
    return t.transpose(1, 2) if t.dim() == 3 else t


def _glu_halves(t: torch.Tensor) -> torch.Tensor:
    """Last dim (g0 u0 g1 u1 ...) -> (g0 g1 ... | u0 u1 ...)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _glu_interleaved(t: torch.Tensor) -> torch.Tensor:
    """Inverse of _glu_halves."""
    return torch.stack(t.chunk(2, dim=-1), dim=-1).flatten(-2)


def _gpt_oss_expert_tensor(name: str, get: Getter, has: Callable[[str], bool]) -> torch.Tensor:
    """A gpt-oss fused expert tensor, or its MXFP4 `_blocks` / `_scales` pair (the Hub's) dequantized."""
    if has(name) or not has(name + "_blocks"):
        return get(name)
    return dequantize_mxfp4(get(name + "_blocks"), get(name + "_scales"))


# --- HF -> ours --------------------------------------------------------------------------------
def _to_ours(rule: Rule, layer, get: Getter, has: Callable[[str], bool], cfg: ModelConfig,
             sizes: Dict[str, int]) -> Iterator[Tuple[str, torch.Tensor]]:
    ours = _fmt(rule.ours, layer)
    if rule.op == "dup":  # a copy of a tensor another rule reads: read (so it counts as read) and dropped
        get(_fmt(rule.hf, layer)[0])
    elif rule.op == "copy":
        yield ours[0], get(_fmt(rule.hf, layer)[0])
    elif rule.op == "t":
        yield ours[0], get(_fmt(rule.hf, layer)[0]).t().contiguous()
    elif rule.op == "cat":
        yield ours[0], torch.cat([get(n) for n in _fmt(rule.hf, layer)])
    elif rule.op == "t_split":
        full = get(_fmt(rule.hf, layer)[0]).t()
        for name, piece in zip(ours, full.split([sizes[n] for n in ours])):
            yield name, piece.contiguous()
    elif rule.op in ("rope_q", "rope_kv"):
        yield ours[0], deinterleave_rope_rows(get(_fmt(rule.hf, layer)[0]), *_rope_blocks(rule, cfg))
    elif rule.op == "rope_indexer":
        yield ours[0], indexer_rope_last(get(_fmt(rule.hf, layer)[0]), cfg)
    elif rule.op in ("et", "glu_et"):
        w = _gpt_oss_expert_tensor(_fmt(rule.hf, layer)[0], get, has)
        yield ours[0], _per_expert_t(_glu_halves(w) if rule.op == "glu_et" else w).contiguous()
    elif rule.op == "qkv":
        q, k, v = _qkv_groups(cfg, get(_fmt(rule.hf, layer)[0]))
        yield ours[0], q.contiguous()
        yield ours[1], torch.cat([k, v])
    else:  # experts
        first = _fmt(rule.hf, layer, 0)[0]
        if not has(first) and rule.fused_hf:
            yield ours[0], get(_fmt(rule.fused_hf, layer)[0])
            return
        yield ours[0], torch.stack([torch.cat([get(n) for n in _fmt(rule.hf, layer, e)])
                                    for e in range(_num_experts(cfg))])


def hf_to_ours_stream(get: Getter, has: Callable[[str], bool], cfg: ModelConfig, rules: List[Rule],
                      sizes: Dict[str, int]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Our full tensors from HF ones, rule by rule (`get` may read lazily from files). `sizes`:
    our tensors' dim-0 sizes (for split rules)."""
    for rule in rules:
        for layer, r in _instances(rule, cfg):
            yield from _to_ours(r, layer, get, has, cfg, sizes)


# --- ours -> HF --------------------------------------------------------------------------------
def _to_hf(rule: Rule, layer, get: Getter, cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    hf = _fmt(rule.hf, layer)
    if rule.op in ("copy", "dup"):
        yield hf[0], get(_fmt(rule.ours, layer)[0])
    elif rule.op == "t":
        yield hf[0], get(_fmt(rule.ours, layer)[0]).t().contiguous()
    elif rule.op == "cat":
        for name, piece in zip(hf, get(_fmt(rule.ours, layer)[0]).chunk(len(hf))):
            yield name, piece.contiguous()
    elif rule.op == "t_split":
        yield hf[0], torch.cat([get(n) for n in _fmt(rule.ours, layer)]).t().contiguous()
    elif rule.op in ("rope_q", "rope_kv"):
        yield hf[0], interleave_rope_rows(get(_fmt(rule.ours, layer)[0]), *_rope_blocks(rule, cfg))
    elif rule.op == "rope_indexer":
        yield hf[0], indexer_rope_first(get(_fmt(rule.ours, layer)[0]), cfg)
    elif rule.op == "et":
        yield hf[0], _per_expert_t(get(_fmt(rule.ours, layer)[0])).contiguous()
    elif rule.op == "glu_et":
        yield hf[0], _glu_interleaved(_per_expert_t(get(_fmt(rule.ours, layer)[0]))).contiguous()
    elif rule.op == "qkv":
        yield hf[0], _fuse_qkv(cfg, *(get(n) for n in _fmt(rule.ours, layer)))
    else:  # experts: one HF tensor (or several, split) per expert, as save_pretrained writes them
        stacked = get(_fmt(rule.ours, layer)[0])
        for e in range(_num_experts(cfg)):
            names = _fmt(rule.hf, layer, e)
            for name, piece in zip(names, stacked[e].chunk(len(names))):
                yield name, piece.contiguous()


def ours_to_hf_stream(get: Getter, cfg: ModelConfig, rules: List[Rule]) -> Iterator[Tuple[str, torch.Tensor]]:
    for rule in rules:
        for layer, r in _instances(rule, cfg):
            yield from _to_hf(r, layer, get, cfg)


def hf_names(cfg: ModelConfig, rules: List[Rule]) -> List[str]:
    """Every HF tensor name the table reads for this config (per-expert form)."""
    out = []
    for rule in rules:
        for layer, r in _instances(rule, cfg):
            experts = range(_num_experts(cfg)) if r.op == "experts" else [None]
            out += [n for e in experts for n in _fmt(r.hf, layer, e)]
    return out


def our_names(cfg: ModelConfig, rules: List[Rule]) -> List[str]:
    """Every tensor of ours the table yields from HF's, in stream order."""
    return [n for rule in rules for layer, r in _instances(rule, cfg) if r.op != "dup" for n in _fmt(r.ours, layer)]


# --- whole state dicts (in memory) ---------------------------------------------------------------
class _Source:
    """An HF state dict read once per key; leftover keys at the end are an error."""

    def __init__(self, sd: StateDict, ignored: Tuple[str, ...] = ()):
        self.sd, self.unused, self.ignored = sd, set(sd), ignored

    def has(self, key: str) -> bool:
        return key in self.sd

    def take(self, key: str) -> torch.Tensor:
        if key not in self.sd:
            raise ConversionError(f"HF checkpoint is missing {key!r}")
        self.unused.discard(key)
        return self.sd[key]

    def check_consumed(self) -> None:
        left = sorted(k for k in self.unused if not k.endswith(self.ignored))
        if left:
            raise ConversionError(f"HF checkpoint has {len(left)} unexpected tensors, e.g. {left[:3]}")


def our_sizes(cfg: ModelConfig) -> Dict[str, int]:
    """Dim-0 sizes of our full tensors, from the model built on the meta device."""
    from models.gpt import build_model
    from megatron_lite.transformer.spec import BuildContext

    model = build_model(cfg, BuildContext(ParallelDims()), materialize=False)[0]
    return {n: spec_of(p).stored_shape[0] for n, p in model.named_parameters() if spec_of(p).stored_shape}


def hf_to_megatron_lite(hf_state_dict: StateDict, cfg: ModelConfig, family=None) -> StateDict:
    """Full megatron-lite state dict from an HF model's state dict (in-memory or on-disk names)."""

    fam = family_of(cfg, family)
    src = _Source(fam.normalize(hf_state_dict), fam.ignored)
    out = dict(hf_to_ours_stream(src.take, src.has, cfg, fam.rules, our_sizes(cfg)))
    for name in fam.dropped:  # HF copies of tied weights
        src.unused.discard(name)
    src.check_consumed()
    return out


def megatron_lite_to_hf(state_dict: StateDict, cfg: ModelConfig, family=None, tied_lm_head: bool = True) -> StateDict:
    """HF state dict (the names save_pretrained writes) from a full megatron-lite state dict. With
    tied embeddings, `tied_lm_head` adds lm_head.weight as the embedding tensor itself (what
    model.state_dict() holds; save_pretrained leaves it out)."""

    fam = family_of(cfg, family)
    missing = [n for n in our_names(cfg, fam.rules) if n not in state_dict]
    if missing:
        raise ConversionError(f"megatron-lite state dict is missing {len(missing)} tensors, e.g. {missing[:3]}")
    out = dict(ours_to_hf_stream(state_dict.__getitem__, cfg, fam.rules))
    if tied_lm_head and not cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state_dict["embedding.word_embeddings.weight"]
    return out


def without_absent_mtp(cfg: ModelConfig, has: Callable[[str], bool]) -> ModelConfig:
    """`cfg` without multi-token prediction when the checkpoint lacks its modules: transformers keeps
    num_nextn_predict_layers in the configs it saves but drops the MTP layers' tensors."""
    if cfg.mtp_depth and not has(f"model.layers.{cfg.num_layers}.eh_proj.weight"):
        return dataclasses.replace(cfg, mtp_num_layers=None)
    return cfg


def hf_config_to_model_config(hf_config) -> ModelConfig:

    return family_for_model_type(getattr(hf_config, "model_type", None)).to_ours(hf_config)


def model_config_to_hf_config(cfg: ModelConfig, family=None):

    return family_of(cfg, family).to_hf(cfg)


def model_family(cfg: ModelConfig) -> str:

    return family_of(cfg).name


# --- full <-> this rank's shards --------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict_into_model(model: nn.Module, full_state: StateDict, dims: ParallelDims) -> None:
    """Copy this rank's piece of every full tensor into `model` (one chunk), padding vocab rows
    to the layout's padded vocabulary. Extra entries (other pipeline stages' layers) are ignored."""
    missing = []
    for name, buffer in persistent_buffers([model]):  # whole on every rank (MoE expert biases)
        if name not in full_state:
            missing.append(name)
        else:
            buffer.copy_(full_state[name])
    for name, p in model.named_parameters():
        key, spec = stored_name(name, p), spec_of(p)
        if key not in full_state:
            missing.append(key)
            continue
        full = spec.pad(full_state[key])
        piece = spec.shard(full) if tuple(full.shape) == spec.full_shape else full
        if tuple(piece.shape) != tuple(p.shape):
            raise ConversionError(f"{key}: full tensor {tuple(full.shape)} does not fit parameter "
                                  f"(shard {tuple(piece.shape)} != {tuple(p.shape)})")
        p.copy_(piece)
    if missing:
        raise ConversionError(f"state dict is missing {len(missing)} tensors, e.g. {missing[:3]}")


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, dims: ParallelDims) -> StateDict:
    """Full (unsharded, true-vocab) CPU tensors of one model chunk. Collective over TP: every TP
    rank must call it. The last stage's copy of a tied embedding is left out. (Experts split over
    EP: see checkpoint/ for a layout-independent gather.)"""
    out = {}
    for name, p in model.named_parameters():
        tie = spec_of(p).tie
        if tie is not None and not tie.primary:
            continue
        out[name] = gather_full(p.data, p, dims).cpu()
    out.update((name, buffer.detach().cpu().clone()) for name, buffer in persistent_buffers([model]))
    return out
