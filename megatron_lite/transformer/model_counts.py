"""The decoder's counts: what its layer types report (counts.py), laid out as models/gpt.py builds
them (each layer two norms, self-attention and an MLP slot, MoE where --moe-layer-freq says so; or
under --hybrid-override-pattern one norm and one block), and
the multi-token prediction modules on the last stage."""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from .counts import Counts, MicroBatch, weights
from .fast_paths import cross_entropy_chunk_tokens
from .mixers import has_mlp, mixer_class
from .mlp import MLP
from .moe import MoELayer
from .norm import norm_counts


class ModelCounts(NamedTuple):
    embedding: Counts  # word (and learned position) embeddings
    layers: List[Counts]
    final_norm: Counts
    output: Counts  # the output layer and the loss
    mtp: Counts = Counts()  # the multi-token prediction modules (--mtp-num-layers), with their output GEMMs

    @property
    def total(self) -> Counts:
        return sum(self.layers, self.embedding + self.final_norm + self.output + self.mtp)


def model_counts(cfg, mb: MicroBatch = MicroBatch()) -> ModelCounts:
    kinds = [(moe, cfg.layer_window(i), mixer_class(cfg, i), has_mlp(cfg, i)) for i, moe in enumerate(cfg.moe_layers())]
    layer = {kind: layer_counts(cfg, mb, *kind) for kind in set(kinds)}
    mtp_layers = [layer_counts(cfg, mb, kinds[-1][0], cfg.layer_window(cfg.num_layers + k), *kinds[-1][2:])
                  for k in range(cfg.mtp_depth)]
    return ModelCounts(embedding_counts(cfg, mb), [layer[kind] for kind in kinds], norm_counts(cfg, mb),
                       output_counts(cfg, mb), mtp_counts(cfg, mb, mtp_layers))


def mtp_counts(cfg, mb: MicroBatch, layers: List[Counts]) -> Counts:
    """Each depth: its enorm, hnorm and final norm, the 2h -> h projection, its layer (`layers`, of the
    last decoder layer's kind), and an output GEMM and loss over the shared output weight (FLOPs, no
    parameters)."""
    norm, h, output = norm_counts(cfg, mb), cfg.hidden_size, output_counts(cfg, mb)
    depth = norm + norm + norm + weights(2 * h * h, act_bytes=2 * mb.a * h * mb.tokens) + Counts(
        flops=output.flops, act_bytes=output.act_bytes)
    return sum(layers, Counts(*(len(layers) * x for x in depth)))


_LAYER_ZERO = "layer 0's mixer"  # layer_counts' default mixer


def layer_counts(cfg, mb: MicroBatch, moe: bool, window=None, mixer=_LAYER_ZERO, mlp: bool = True) -> Counts:
    """One pre-norm layer: each of its blocks with its norm, and per block the residual stream's sum,
    a h per residual-stream token, with hidden dropout its mask, a byte per element. `mixer`: the
    attention slot's class (default: layer 0's; None: an MLP-only layer); `mlp` False: a mixer-only layer
    (a hybrid pattern's, transformer/mixers.py)."""
    h, norm = cfg.hidden_size, norm_counts(cfg, mb)
    mixer = mixer_class(cfg, 0) if mixer is _LAYER_ZERO else mixer
    blocks = ([mixer.counts(cfg, mb, window)] if mixer is not None else []) + \
        ([(MoELayer if moe else MLP).counts(cfg, mb)] if mlp else [])
    residual = Counts(act_bytes=(mb.a * h + (h if cfg.hidden_dropout > 0 else 0)) * mb.residual_tokens)
    return sum((norm + block + residual for block in blocks), Counts())


def embedding_counts(cfg, mb: MicroBatch) -> Counts:
    """Lookups: no FLOPs. Under TP it keeps the masked ids and the mask, 9 bytes per token."""
    n = cfg.vocab_size * cfg.hidden_size
    if cfg.position_embedding_type == "learned_absolute":
        n += cfg.max_position_embeddings * cfg.hidden_size
    return Counts(n, n, act_bytes=9 * mb.tokens if mb.tp > 1 else 0)


def loss_chunk_tokens(a: int, vocab: int) -> int:
    """Tokens per chunk of the cross entropy over `vocab` logits per rank (automatic; 0: unchunked)."""
    return cross_entropy_chunk_tokens(None, torch.float32 if a == 4 else torch.bfloat16, vocab)


def output_counts(cfg, mb: MicroBatch) -> Counts:
    """The output GEMM over the true vocabulary (its weight here only when untied). Kept for the loss:
    the fp32 softmax over this rank's padded vocabulary in the logits' buffer, 4 V (chunked bf16 cross
    entropy: the logits a V and 8 bytes of max and exp sum), and 14 bytes of targets and masks."""
    vh = cfg.vocab_size * cfg.hidden_size
    n = vh if cfg.untie_embeddings_and_output_weights else 0
    vocab = cfg.padded_vocab_size(mb.tp) // mb.tp
    kept = mb.a * vocab + 8 if loss_chunk_tokens(mb.a, vocab) else 4 * vocab
    return Counts(n, n, 2 * vh, 0, (kept + 14) * mb.tokens)
