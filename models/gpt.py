"""GPT: one decoder-only family covering GPT-2 (LayerNorm, learned positions, GELU, biases, tied
embeddings) and Llama (RMSNorm, RoPE, SwiGLU, GQA, no biases, untied output) by configuration.

A GPTModel instance is one pipeline chunk: it holds layers [start, end) (named by their global
index, so parameter names do not depend on the layout), each built from `gpt_layer_spec`, plus
the embedding on the first stage (`pre_process`) and the final norm, output layer and loss on the
last (`post_process`), with the multi-token prediction modules when --mtp-num-layers is set
(transformer/multi_token_prediction.py). Activations flow as [s, b, h], split along s across TP under sequence
parallelism. `gpt_forward_step` is the forward-step protocol of megatron_lite.training.step.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_lite import config as C
from megatron_lite.errors import ConfigError
from megatron_lite.parallel.gemm import keep_precision
from megatron_lite.parallel.pipeline.partition import LayerSplit
from megatron_lite.parallel.random import recompute
from megatron_lite.parallel.sharding import replicated, set_spec, with_tie
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.tiled_init import TiledInit, defer_, materialize_, materialize_buffers_
from megatron_lite.parallel.tensor_parallel import (
    VocabParallelEmbedding, column_parallel_linear, vocab_parallel_cross_entropy, vocab_parallel_weight)
from megatron_lite.transformer.block import TransformerLayer
from megatron_lite.transformer.core_attention import ContextParallelAttention, PackedSeq, core_attention_class
from megatron_lite.transformer.fast_paths import compile_layer, cross_entropy_chunk_tokens
from megatron_lite.transformer.loss_normalization import attach_loss
from megatron_lite.transformer.mixers import has_mlp, mixer_class
from megatron_lite.transformer.mlp import MLP, GatedUnit
from megatron_lite.transformer.moe import MoELayer, MoEStepHooks
from megatron_lite.transformer.multi_token_prediction import MultiTokenPrediction, shifted_inputs
from megatron_lite.transformer.norm import build_norm
from megatron_lite.transformer.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from megatron_lite.transformer.spec import BuildContext, TransformerLayerSpec

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"


def moe_hooks(cfg: C.ModelConfig, ctx: BuildContext) -> MoEStepHooks:
    """The model's one MoEStepHooks (statistics, expert-bias updates), registered in ctx.hooks."""
    return ctx.hooks.shared(MoEStepHooks, cfg.num_layers + cfg.mtp_depth, cfg.moe.num_experts, ctx.dims, ctx.device)


def moe_mlp(cfg: C.ModelConfig, ctx: BuildContext, layer_number: int) -> MoELayer:
    """The MLP slot of an MoE layer (experts over EP), built from the model's MoE config."""
    hooks = moe_hooks(cfg, ctx)
    layer = MoELayer(cfg.moe, cfg.hidden_size, ctx.dims, layer_number=layer_number,
                     loss_normalization=ctx.loss_normalization, tracker=hooks.tracker,
                     sequence_parallel=ctx.sequence_parallel, swiglu=cfg.swiglu, activation=cfg.activation,
                     glu=GatedUnit.of(cfg), bias=cfg.add_bias_linear,
                     dtype=ctx.params_dtype, recompute_tracker=ctx.tracker, gemm=ctx.gemm,
                     recompute=tuple(m for m in ("moe", "shared_experts", "moe_act") if ctx.recomputes(m)))
    hooks.routers.append(layer.router)
    return layer


def gpt_layer_spec(cfg: C.ModelConfig, ctx: BuildContext, layer_number: int) -> TransformerLayerSpec:
    """The submodules of GPT layer `layer_number`: the norms of the config, self-attention over the
    configured core-attention backend (wrapped for context parallelism when cp > 1), a dense MLP
    or, where --moe-layer-freq says so, an MoE layer."""
    if ctx.te is not None:  # --transformer-impl transformer_engine (dense layers: te_backend.check_supported)
        from megatron_lite.transformer import te_backend
        return TransformerLayerSpec(input_layernorm=te_backend.fused_norm, self_attention=te_backend.TESelfAttention,
                                    core_attention=None, pre_mlp_layernorm=te_backend.fused_norm, mlp=te_backend.TEMLP)
    core = ContextParallelAttention if ctx.dims.cp > 1 else core_attention_class(cfg.attention_backend)
    # standard attention, MLA, a linear or Mamba-2 mixer (each builds its own config), or None; no MLP in a
    # hybrid pattern's mixer-only layers (transformer/mixers.py decides)
    attention = mixer_class(cfg, layer_number)
    mlp = (moe_mlp if cfg.moe_layers()[layer_number] else MLP) if has_mlp(cfg, layer_number) else None
    return TransformerLayerSpec(input_layernorm=build_norm, self_attention=attention, core_attention=core,
                                pre_mlp_layernorm=build_norm, mlp=mlp)


class GPTModel(nn.Module):
    def __init__(self, cfg: C.ModelConfig, ctx: BuildContext, *, layer_range: Optional[Tuple[int, int]] = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_spec: Callable[[C.ModelConfig, BuildContext, int], TransformerLayerSpec] = gpt_layer_spec):
        super().__init__()
        dims = ctx.dims
        self.cfg, self.ctx, self.dims = cfg, ctx, dims
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel, self.tracker = ctx.sequence_parallel, ctx.tracker
        self.input_tensor: Optional[torch.Tensor] = None  # a later pipeline stage's input (set_input_tensor)
        self.inv_freq = rope_inv_freq(cfg) if cfg.position_embedding_type == "rope" else None
        self.padded_vocab = cfg.padded_vocab_size(dims.tp)
        start, end = layer_range or (0, cfg.num_layers)
        dt, tied = ctx.params_dtype, not cfg.untie_embeddings_and_output_weights
        # Multi-token prediction embeds the shifted tokens on the last stage: with a pipeline, that
        # stage holds a copy of the embedding, tied to the first stage's (as Megatron-Core does).
        self.mtp_process = post_process and cfg.mtp_depth > 0
        if pre_process or self.mtp_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, dims, dt,
                                                                    cfg.vocab_size)
            if cfg.position_embedding_type == "learned_absolute":
                # _weight: no default init (on meta it would pull in the decompositions, seconds)
                self.embedding.position_embeddings = nn.Embedding(
                    cfg.max_position_embeddings, cfg.hidden_size,
                    _weight=torch.empty(cfg.max_position_embeddings, cfg.hidden_size, dtype=dt))
                set_spec(self.embedding.position_embeddings.weight,
                         replicated((cfg.max_position_embeddings, cfg.hidden_size)))
            # Copies on the first and the last stage (the tied output layer, or MTP's embedding):
            # stored under one name, their gradients summed over the embedding group.
            copies = {WORD_EMBEDDINGS: tied or cfg.mtp_depth > 0, POSITION_EMBEDDINGS: cfg.mtp_depth > 0}
            if pre_process != post_process:
                for name, p in self.embedding.named_parameters(prefix="embedding"):
                    if copies[name]:
                        with_tie(p, name, primary=pre_process)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ctx, i, layer_spec(cfg, ctx, i))
                                     for i in range(start, end)})
        if ctx.compile:
            for layer in self.layers.values():
                compile_layer(layer)
        if self.mtp_process:  # the last decoder layer's spec (dense or MoE), as Megatron-Core
            self.mtp = MultiTokenPrediction(cfg, ctx, layer_spec(cfg, ctx, cfg.num_layers - 1))
        self.mtp_logs: dict = {}  # the last training forward's MTP losses (the loss function logs them)
        if post_process:
            self.final_norm = build_norm(cfg, ctx)
            if not tied or not hasattr(self, "embedding"):
                # Untied output, or the last pipeline stage's copy of the tied embedding (kept equal
                # to the first stage's by summing their gradients over the embedding group).
                self.output_layer = nn.Module()
                self.output_layer.weight, _ = vocab_parallel_weight(self.padded_vocab, cfg.hidden_size, dims, dt,
                                                                    cfg.vocab_size)
                if tied:
                    with_tie(self.output_layer.weight, WORD_EMBEDDINGS, primary=False)
            keep_precision(self.output_weight())  # logits: not FP8 (as Megatron / Transformer Engine)

    # --- the pipeline and ZeRO-3 protocols -----------------------------------------------------
    def set_input_tensor(self, x: Optional[torch.Tensor]) -> None:
        """The hidden states [s, b, h] from the previous pipeline stage (not for the first)."""
        self.input_tensor = x

    def pipeline_input_spec(self, batch: dict) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of what set_input_tensor takes for this micro-batch: the hidden states
        [s, b, h] of this rank's part of the sequence (the batch is CP's already; SP splits it over TP)."""
        b, s = batch["tokens"].shape
        s //= self.dims.tp if self.sequence_parallel else 1
        return [((s, b, self.cfg.hidden_size), self.ctx.params_dtype)]

    def sharding_units(self) -> List[nn.Module]:
        """ZeRO-3 gathers and frees the parameters of each of these modules together."""
        return list(self.layers.values()) + (list(self.mtp.layers) if self.mtp_process else [])

    # --- forward -------------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def _embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        group, comm = self.dims.tp_group, self.dims.comm
        x = self.embedding.word_embeddings(tokens)  # partial sums over TP, [s, b, h]
        pos = None
        if self.cfg.position_embedding_type == "learned_absolute":
            pos = self.embedding.position_embeddings(position_ids).transpose(0, 1)
        if self.sequence_parallel:
            x = comm.reduce_scatter_to_sp(x, group)
            if pos is not None:
                x = x + comm.scatter_to_sp(pos, group)
        else:
            x = comm.reduce_from_tp(x, group)
            if pos is not None:
                x = x + pos
        p = self.cfg.hidden_dropout if self.training else 0.0
        if p > 0:
            if self.sequence_parallel:
                with self.tracker.fork():
                    x = F.dropout(x, p, True)
            else:
                x = F.dropout(x, p, True)
        return x

    def _run_layers(self, x: torch.Tensor, rope, packed) -> torch.Tensor:
        layers = list(self.layers.values())
        ctx = self.ctx
        if not (ctx.recompute_granularity == "full" and self.training):
            for layer in layers:
                x = layer(x, rope, packed)
            return x
        n = max(1, ctx.recompute_num_layers)

        def run(group):
            def fn(y):
                for layer in group:
                    y = layer(y, rope, packed)
                return y
            return fn

        # Megatron's full recomputation: "uniform" checkpoints groups of recompute_num_layers
        # consecutive layers; "block" checkpoints only the first recompute_num_layers layers.
        if ctx.recompute_method == "block":
            x = recompute(run(layers[:n]), self.tracker, x) if layers[:n] else x
            return run(layers[n:])(x)
        for i in range(0, len(layers), n):
            x = recompute(run(layers[i:i + n]), self.tracker, x)
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits, = column_parallel_linear(h, [(self.output_weight(), None)], self.dims, self.sequence_parallel,
                                         self.ctx.gemm)
        return logits  # [s, b, padded_vocab / tp]

    def _token_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] (fp32) of hidden states h [s, b, h] through the output layer."""
        logits = self._logits(h)
        # The logits feed only the loss (the output GEMM saved its input and weight, not them):
        # the cross entropy may overwrite them.
        chunk = cross_entropy_chunk_tokens(self.ctx.cross_entropy_chunk_size, logits.dtype, logits.shape[-1])
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.dims, self.cfg.vocab_size, inplace=True,
                                            chunk_tokens=chunk)
        return loss.t()

    def _with_mtp_loss(self, loss: torch.Tensor, h: torch.Tensor, tokens, position_ids, labels, loss_mask, rope,
                       packed) -> torch.Tensor:
        """The main token losses carrying the weighted MTP losses into backward; logs them."""
        mask = loss_mask if loss_mask is not None else torch.ones_like(labels, dtype=torch.float32)
        inputs = shifted_inputs(self.cfg.mtp_depth, tokens, labels, mask, position_ids,
                                packed.document_ids if packed is not None else None, self.dims)
        mtp_loss, self.mtp_logs = self.mtp(h, self._embed, inputs, rope, packed, self._token_loss)
        return attach_loss(loss, mtp_loss)

    def forward(self, tokens: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, packed: Optional[PackedSeq] = None,
                kv_cache=None, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens/position_ids/labels [b, s]; `packed`: document ids (tokens attend only within
        their document). A later pipeline stage reads its input from set_input_tensor.
        `kv_cache` (megatron_lite.inference.KVCache): generation (in eval mode); `tokens` follow those
        already cached, and only the last position's logits [b, 1, vocab] are computed.

        `loss_mask` [b, s]: which labels count, for multi-token prediction's shifted losses (None: all).

        Returns per-token loss [b, s] (fp32) on the last stage when labels are given, full logits
        [b, s, vocab] when they are not, else the hidden states [s, b, h] for the next stage."""
        if position_ids is None:
            assert self.dims.cp == 1, "context parallelism needs the position ids of the zigzag chunks"
            ref = tokens if tokens is not None else labels
            start = kv_cache.offset if kv_cache is not None else 0  # the tokens come after the cached ones
            position_ids = torch.arange(start, start + ref.shape[1], device=ref.device).unsqueeze(0).expand(
                ref.shape[0], -1)
        x = self._embed(tokens, position_ids) if self.pre_process else self.input_tensor
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rope_cos_sin(position_ids, self.inv_freq, x.dtype, rope_attention_factor(self.cfg))
        with kv_cache.attached(self) if kv_cache is not None else contextlib.nullcontext():
            x = self._run_layers(x, rope, packed)
        if not self.post_process:
            return x
        if kv_cache is not None:
            x = x[-1:]  # the next token's logits are all generation needs
        h = self.final_norm(x)
        if labels is None:
            full = self.dims.comm.gather_from_tp(self._logits(h), self.dims.tp_group)
            return full[..., : self.cfg.vocab_size].transpose(0, 1).float()
        loss = self._token_loss(h, labels)
        self.mtp_logs = {}
        if self.mtp_process and self.training and kv_cache is None:  # evaluation: the LM loss alone
            loss = self._with_mtp_loss(loss, h, tokens, position_ids, labels, loss_mask, rope, packed)
        return loss


# --- the forward-step protocol ---------------------------------------------------------------
def gpt_loss_func(loss_mask: torch.Tensor, token_loss: torch.Tensor, logs: Optional[dict] = None):
    """(sum of the masked token losses, number of loss-bearing tokens, logs) of a micro-batch;
    `logs`: name -> (sum, count) from the forward (multi-token prediction's losses)."""
    return (token_loss * loss_mask).sum(), loss_mask.sum(), logs or {}


def gpt_forward_step(batch: dict, model: GPTModel):
    """One micro-batch through one model chunk: (output, loss function over that output)."""
    packed = PackedSeq(batch["document_ids"]) if "document_ids" in batch else None
    output = model(batch["tokens"], batch.get("position_ids"), batch["labels"], packed, loss_mask=batch["loss_mask"])
    return output, functools.partial(gpt_loss_func, batch["loss_mask"], logs=getattr(model, "mtp_logs", None))


# --- initialization --------------------------------------------------------------------------
def weight_init(cfg: C.ModelConfig, seed: int, draw_device=None) -> TiledInit:
    """The model's initial weights, defined tile by tile (parallel/tiled_init.py): normal with
    init_method_std; projections into the residual stream ("normal_scaled") get std / sqrt(2 *
    num_layers), as in Megatron-LM / GPT-2. `draw_device`: where tiles are drawn (the CPU under
    --use-cpu-initialization; None: each rank's own device)."""
    std = cfg.init_method_std
    return TiledInit(seed, {"normal": std, "normal_scaled": std / math.sqrt(2.0 * cfg.num_layers)},
                     draw_device=torch.device(draw_device) if draw_device is not None else None)


def build_model(cfg: C.ModelConfig, ctx, *, seed: int = 1234, device=None, first_stage_layers: Optional[int] = None,
                last_stage_layers: Optional[int] = None, split: Optional[LayerSplit] = None, materialize: bool = True,
                cpu_initialization: bool = False, **context) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), initialized layout-independently.
    `ctx`: a BuildContext, or a ParallelDims with the BuildContext fields as keyword arguments.
    `split`: the layers of each virtual pipeline stage when not even (`first_stage_layers` /
    `last_stage_layers`: the uneven first / last stage alone).

    Each chunk is built on the meta device, then each parameter gets its storage on `device` (or
    ctx.device, else the CPU) and only this rank's tiles of its full tensor. `materialize=False`
    leaves the parameters on meta, each with the DeferredInit that GradientSync fills straight into
    its buffers (at ZeRO-3 only the rank's flat shard is ever drawn). `cpu_initialization`: draw
    the tiles on the CPU and copy them to the device (Megatron's --use-cpu-initialization)."""
    if isinstance(ctx, ParallelDims):
        ctx = BuildContext(ctx, **context)
    dims = ctx.dims
    first_rank, last_rank = dims.placement.end_ranks()
    if cfg.mtp_depth and dims.placement.num_stages > 1 and first_rank == last_rank:
        # Two chunks of one rank would hold the embedding and MTP's copy of it on the last stage, and
        # nothing sums their gradients there: the copies would drift apart. (A tied output layer's
        # copies on one rank are summed: grads.sum_local_tie_copies.)
        raise ConfigError(f"--mtp-num-layers (the embedding on the last stage) needs the first and last pipeline "
                          f"stages on different ranks; the {dims.placement.kind} placement puts both on rank "
                          f"{first_rank}: use a placement that is not V-shaped")
    if any(cfg.moe_layers()):  # on every rank, MoE layers on its stages or not: the metrics are collective
        moe_hooks(cfg, ctx)
    device = torch.device(device if device is not None else ctx.device if ctx.device is not None else "cpu")
    init = weight_init(cfg, seed, "cpu" if cpu_initialization else None)
    chunks = []
    split = split or LayerSplit(first_stage_layers, last_stage_layers)
    for layer_range, first, last in dims.placement.rank_chunks(dims.pp_rank, cfg.num_layers, split):
        with torch.device("meta"):
            m = GPTModel(cfg, ctx, layer_range=layer_range, pre_process=first, post_process=last)
        defer_(m, init, device)
        if materialize:
            materialize_(m)
        else:
            materialize_buffers_(m, device)
        chunks.append(m)
    return chunks
