"""Configuration dataclasses and their validation.

Every impossible combination is caught here, before any process group exists, and reported
as a `ConfigError` whose message names the values and the fix. `pretrain_gpt.py` turns a
`ConfigError` into one line on stderr and exit code 2.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional

from . import feature_checks, flag_rules
from .options import arg
from .model_config import ModelConfig, _require  # noqa: F401  (re-exported: megatron_lite.config.ModelConfig)
from .transformer.mixer_pattern import validate_linear_attention_layout
from .transformer.hybrid import validate_hybrid



@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = arg(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = arg(1, "pipeline-parallel size (PP)")
    context_parallel_size: int = arg(1, "context-parallel size (CP)")
    expert_model_parallel_size: int = arg(1, "expert-parallel size (EP): each MoE layer's experts spread over "
                                             "this many ranks of a pipeline stage (TP ranks first when ETP < TP)")
    expert_tensor_parallel_size: int = arg(1, "tensor parallelism inside each expert (ETP); ETP x EP must divide "
                                                 "TP x CP x DP (the expert grid folds over the attention grid)")
    virtual_pipeline_model_parallel_size: Optional[int] = arg(None, "model chunks per pipeline rank (interleaving)")
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(None, "layers per model chunk (sets the virtual size)")
    decoder_first_pipeline_num_layers: Optional[int] = arg(None, "layers of the first pipeline stage (uneven split)")
    decoder_last_pipeline_num_layers: Optional[int] = arg(None, "layers of the last pipeline stage (uneven split)")
    pipeline_model_parallel_layout: Optional[str] = arg(
        None, "every virtual pipeline stage's layers, e.g. 'Et*3|(tt|)*29,m|L': | between the pp x vpp stages, "
              "E embedding, t transformer layer, L loss (m, MTP, is not implemented), (...)*n and x*n repeat; "
              "sets the virtual pipeline size")
    account_for_embedding_in_pipeline_split: bool = arg(
        False, "count the embedding as a layer of the even pipeline split (the first stage gets one layer fewer)",
        store="true")
    account_for_loss_in_pipeline_split: bool = arg(
        False, "count the loss as a layer of the even pipeline split (the last stage gets one layer fewer)",
        store="true")
    pipeline_schedule: Optional[str] = arg(None, "pipeline schedule; None: 1f1b, or interleaved with virtual stages; "
                                                 "zb-v: zero-bubble V, dualpipe-v: DualPipe-V (two chunks per rank, "
                                                 "V placement)",
                                           choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"])
    overlap_moe_expert_parallel_comm: bool = arg(
        False, "dualpipe-v: run each paired forward and backward of two micro-batches as interleaved pieces, each "
               "MoE all-to-all of one in flight while the other computes (needs MoE at EP > 1)", store="true")
    sequence_parallel: bool = arg(False, "split norms and dropout along the sequence over TP", store="true")
    zero_stage: int = arg(0, "ZeRO stage: 1 shards the optimizer state over DP, 2 also the gradients, 3 also "
                             "the parameters (--use-distributed-optimizer: 1)", choices=[0, 1, 2, 3])
    ddp_bucket_size: Optional[int] = arg(None, "elements per gradient bucket; None: max(40M, 1M x DP)")
    overlap_grad_reduce: bool = arg(False, "reduce gradient buckets while backward goes on", store="true")
    grad_reduce_once_per_step: bool = arg(
        False, "ZeRO-2/3: keep full gradient buckets across the micro-batches and reduce-scatter them once per "
               "step (1/m of the traffic, but no gradient memory sharded during the step) instead of each "
               "micro-batch's buckets as soon as they are complete (the default, as DeepSpeed and FSDP: only "
               "the buckets being filled are full); ZeRO-0/1 always reduce once per step", store="true")
    overlap_param_gather: bool = arg(False, "all-gather updated parameters during the next forward", store="true")
    reshard_after_forward: bool = arg(
        True, "ZeRO-3: keep each unit's gathered parameters from its first use to the end of the step (one "
              "all-gather per step instead of two per micro-batch, but the full parameters held through the "
              "step), instead of freeing them after each forward and backward", flag="--no-reshard-after-forward",
        store="false")
    grad_reduce_in_bf16: bool = arg(False, "reduce gradients in bf16", store="true")
    grad_comm_dtype: Optional[str] = arg(
        None, "send DP gradient reductions in this format (fp8: one scale per shard), summed in fp32 where they "
              "land, with error feedback (each rank's compression error joins its next gradient); None: as the "
              "buffers are", choices=["bf16", "fp8-e4m3", "fp8-e5m2"])
    zeropp_quantized_weights: bool = arg(
        False, "ZeRO-3: all-gather parameters as int8 blocks of 256 with fp32 scales (ZeRO++'s qwZ); forward and "
               "backward compute with the dequantized weights, the shards stay exact", store="true")
    zeropp_quantized_gradients: bool = arg(
        False, "ZeRO-3: reduce-scatter gradients as int4 blocks of 256 (fp32 scales) by all-to-all, summed in fp32 "
               "(ZeRO++'s qgZ; no error feedback unless --zeropp-qgz-error-feedback); two hops when DP spans nodes",
        store="true")
    zeropp_qgz_error_feedback: bool = arg(
        False, "--zeropp-quantized-gradients with error feedback at both hops: each rank's int4 rounding joins its "
               "next gradient, at the cost of an fp32 error per bucket (4 bytes a parameter); off: DeepSpeed's qgZ",
        store="true")
    zeropp_hpz_partition_size: int = arg(
        1, "ZeRO-3: after each forward keep a secondary partition of the parameters within groups of this many "
           "consecutive DP ranks (a node), from which backward re-gathers them (ZeRO++'s hpZ); 1: off")
    num_distributed_optimizer_instances: int = arg(1, "shard the distributed optimizer inside this many groups of "
                                                      "DP ranks (gradients summed across them)")
    cp_comm_type: List[str] = arg(help="context-parallel attention, one value or one per layer: p2p (ring), a2a "
                                       "(Ulysses), all_gather (allgather), a2a+p2p (with "
                                       "--hierarchical-context-parallel-sizes)", factory=lambda: ["p2p"], nargs="+")
    hierarchical_context_parallel_sizes: Optional[List[int]] = arg(
        None, "a2a+p2p: the all-to-all group size and the ring size (their product is the CP size)", nargs=2)

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (the V schedules imply two)."""
        from .parallel.pipeline.schedules import schedule_vpp
        return schedule_vpp(self.pipeline_schedule, self.virtual_pipeline_model_parallel_size)

    @property
    def pp_placement(self) -> str:
        """Which pipeline rank runs each virtual stage (parallel/pipeline/placement.py)."""
        from .parallel.pipeline.schedules import schedule_placement
        return schedule_placement(self.pipeline_schedule)

    def cp_a2a_size(self) -> int:
        """The all-to-all group size of hierarchical CP (a2a+p2p), 0 without it."""
        sizes = self.hierarchical_context_parallel_sizes
        return sizes[0] if sizes and "a2a+p2p" in self.cp_comm_type else 0

    def _validate_context_parallel(self, model: ModelConfig, seq_length: int) -> None:
        cp, tp, types = self.cp, self.tp, self.cp_comm_type
        for t in types:
            _require(t in CP_COMM_TYPES, f"--cp-comm-type {t!r} is not one of {', '.join(CP_COMM_TYPES)}")
        _require(len(types) in (1, model.num_layers),
                 f"--cp-comm-type takes one value or one per layer ({model.num_layers}), got {len(types)}")
        _require(self.hierarchical_context_parallel_sizes is None or "a2a+p2p" in types,
                 "--hierarchical-context-parallel-sizes applies to --cp-comm-type a2a+p2p: add it, or drop the sizes")
        if cp == 1:
            return
        _require(seq_length % (2 * cp) == 0,
                 f"seq_length ({seq_length}) must be divisible by 2 x context_parallel_size ({cp}) = {2 * cp}: "
                 f"each CP rank holds two of 2 x cp equal chunks (load balance)")
        _require(model.attention_dropout == 0,
                 f"--attention-dropout {model.attention_dropout} with context parallelism is not supported; use 0")
        _require(model.softmax_type == "vanilla",
                 f"--softmax-type {model.softmax_type} with context parallelism is not implemented yet (the merged "
                 f"log-sum-exp of the CP exchange has no gradient path): use --context-parallel-size 1")
        heads, groups = model.num_attention_heads // tp, max(1, model.num_query_groups // tp)
        sizes = self.hierarchical_context_parallel_sizes
        if "a2a+p2p" in types:
            _require(sizes is not None and sizes[0] * sizes[1] == cp,
                     f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B with A x B = "
                     f"context_parallel_size ({cp}), got {sizes}")
        for t, n in (("a2a", cp), ("a2a+p2p", sizes[0] if sizes else cp)):
            if t not in types:
                continue
            _require(heads % n == 0,
                     f"--cp-comm-type {t} splits the {heads} attention heads per TP rank over {n} ranks: they must "
                     f"divide; use --cp-comm-type p2p or all_gather" + ("" if t == "a2a+p2p" else ", or a2a+p2p"))
            _require(groups % n == 0 or n % groups == 0,
                     f"--cp-comm-type {t}: the {groups} K/V heads per TP rank must divide by {n} or divide it "
                     f"(then they are replicated); use --cp-comm-type p2p or all_gather")

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def validate_sizes(self) -> None:
        """The parallel sizes are >= 1 (checked before anything divides by them)."""
        for name, v in (("tensor_model_parallel_size", self.tp), ("pipeline_model_parallel_size", self.pp),
                        ("context_parallel_size", self.cp),
                        ("expert_model_parallel_size", self.expert_model_parallel_size),
                        ("expert_tensor_parallel_size", self.expert_tensor_parallel_size)):
            _require(v >= 1, f"{name} ({v}) must be >= 1")

    def validate(self, world_size: int, model: ModelConfig, seq_length: int) -> None:
        tp, pp, cp = self.tp, self.pp, self.cp
        self.validate_sizes()
        _require(world_size % (tp * pp * cp) == 0,
                 f"world size ({world_size}) must be divisible by tensor_model_parallel_size ({tp}) x "
                 f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = {tp * pp * cp}; "
                 f"change --nproc_per_node or the parallel sizes")
        _require(model.num_attention_heads % tp == 0,
                 f"num_attention_heads ({model.num_attention_heads}) must be divisible by "
                 f"tensor_model_parallel_size ({tp})")
        ng = model.num_query_groups
        _require(ng % tp == 0 or tp % ng == 0,
                 f"num_query_groups ({ng}) and tensor_model_parallel_size ({tp}) must divide one another "
                 f"(each rank holds whole K/V groups, or a group is replicated on tp / groups ranks)")
        _require(model.ffn_hidden_size % tp == 0,
                 f"ffn_hidden_size ({model.ffn_hidden_size}) must be divisible by tensor_model_parallel_size ({tp})")
        if self.sequence_parallel:
            _require(seq_length % (tp * cp) == 0,
                     f"seq_length ({seq_length}) must be divisible by tensor_model_parallel_size ({tp})"
                     + (f" x context_parallel_size ({cp})" if cp > 1 else "")
                     + " when --sequence-parallel is on")
        _require(self.zero_stage in (0, 1, 2, 3), f"zero_stage ({self.zero_stage}) must be 0, 1, 2 or 3")
        _require(self.reshard_after_forward or self.zero_stage == 3,
                 "--no-reshard-after-forward applies to --zero-stage 3 (sharded parameters): add it or drop the flag")
        _require(not (self.overlap_param_gather and self.zero_stage == 0),
                 "--overlap-param-gather needs the distributed optimizer: --zero-stage 1, 2 or 3 "
                 "(or --use-distributed-optimizer)")
        _require(not self.zeropp_quantized_weights or self.zero_stage == 3,
                 "--zeropp-quantized-weights quantizes ZeRO-3's parameter all-gather: add --zero-stage 3")
        _require(not self.zeropp_quantized_gradients or self.zero_stage == 3,
                 "--zeropp-quantized-gradients quantizes ZeRO-3's gradient reduce-scatter: add --zero-stage 3")
        _require(not self.zeropp_qgz_error_feedback or self.zeropp_quantized_gradients,
                 "--zeropp-qgz-error-feedback adds error feedback to qgZ: add --zeropp-quantized-gradients")
        _require(not (self.zeropp_quantized_gradients and (self.grad_comm_dtype or self.grad_reduce_in_bf16)),
                 "--zeropp-quantized-gradients sends fp32 gradient buffers as int4: drop --grad-comm-dtype and "
                 "--grad-reduce-in-bf16")
        hpz = self.zeropp_hpz_partition_size
        if hpz != 1:
            dp_cp = world_size // (tp * pp)
            _require(hpz >= 1, f"--zeropp-hpz-partition-size ({hpz}) must be >= 1 (1: no secondary partition)")
            _require(dp_cp % hpz == 0, f"--zeropp-hpz-partition-size ({hpz}) must divide the "
                                                    f"data-parallel x context-parallel ranks ({dp_cp})")
            _require(self.zero_stage == 3 and self.reshard_after_forward and self.num_distributed_optimizer_instances
                     == 1, "--zeropp-hpz-partition-size re-gathers ZeRO-3's parameters for backward: it needs "
                           "--zero-stage 3, without --no-reshard-after-forward or "
                           "--num-distributed-optimizer-instances")
        _require(self.grad_comm_dtype is None or not self.grad_reduce_in_bf16,
                 f"--grad-comm-dtype {self.grad_comm_dtype} compresses fp32 gradient buffers: drop "
                 f"--grad-reduce-in-bf16 (or --grad-comm-dtype)")
        n = self.num_distributed_optimizer_instances
        if n != 1:
            dp_cp = world_size // (tp * pp)
            _require(n >= 1 and self.zero_stage >= 1,
                     f"--num-distributed-optimizer-instances ({n}) needs the distributed optimizer "
                     f"(--use-distributed-optimizer or --zero-stage >= 1) and must be >= 1")
            _require(dp_cp % n == 0, f"--num-distributed-optimizer-instances ({n}) must divide the data-parallel "
                                     f"x context-parallel ranks ({dp_cp})")
        self._validate_context_parallel(model, seq_length)
        self._validate_experts(world_size, model)
        validate_linear_attention_layout(model, tp, cp)

    def _validate_moe_overlap(self, model: ModelConfig) -> None:
        if not self.overlap_moe_expert_parallel_comm:
            return
        ep, flag = self.expert_model_parallel_size, "--overlap-moe-expert-parallel-comm"
        _require(self.pipeline_schedule == "dualpipe-v",
                 f"{flag} overlaps DualPipe-V's forward/backward pairs: add --pipeline-schedule dualpipe-v or drop it")
        _require(model.moe is not None and bool(model.moe.num_experts) and ep > 1,
                 f"{flag} hides MoE all-to-alls, which need an MoE model (--num-experts) with "
                 f"--expert-model-parallel-size > 1 (got {ep}); add them or drop the flag")
        dispatcher = model.moe.moe_token_dispatcher_type
        _require(dispatcher == "alltoall", f"{flag} overlaps the all-to-all token dispatcher's exchanges (got "
                                           f"--moe-token-dispatcher-type {dispatcher}); add "
                                           f"--moe-token-dispatcher-type alltoall")
        _require(self.zero_stage < 3 or not self.reshard_after_forward,
                 f"{flag} with --zero-stage 3 needs --no-reshard-after-forward: a paired backward would free the "
                 f"parameters of a layer its forward still uses")

    def _validate_experts(self, world_size: int, model: ModelConfig) -> None:
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        self._validate_moe_overlap(model)
        if model.moe is None or not model.moe.num_experts:
            _require(ep == 1 and etp == 1, f"expert_model_parallel_size ({ep}) / expert_tensor_parallel_size ({etp}) "
                                           f"> 1 need an MoE model: add --num-experts")
            return
        stage = world_size // self.pp if world_size % self.pp == 0 else 0  # ranks of one pipeline stage
        _require(ep >= 1 and etp >= 1 and stage > 0 and stage % (etp * ep) == 0,
                 f"expert grid does not fit: expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) "
                 f"must divide the {stage} ranks of a pipeline stage (ETP x EP x EDP = TP x CP x DP, Megatron-Core's "
                 f"MoE parallel folding): pick sizes whose product divides {stage}")
        model.moe.validate(num_layers=model.num_layers, ep=ep, etp=etp)


CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "allgather", "a2a+p2p")
# Megatron-LM's --recompute-modules: core_attn, mlp, moe, shared_experts are checkpointed (only their
# input kept); layernorm, moe_act, mla_up_proj drop their outputs, recomputed when backward needs them.
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "moe_act", "layernorm", "mla_up_proj",
                     "linear_attn", "mamba")


@dataclass
class DataConfig:
    data_path: List[str] = arg(help="dataset prefix, or weight prefix weight prefix ... (blend)", factory=list,
                               nargs="+")
    split: str = arg("969,30,1", "train,valid,test weights")
    data_cache_path: Optional[str] = arg(None, "where index caches go (default: next to the data)")
    mock_data: bool = arg(False, "random tokens (with --vocab-size: NullTokenizer)", store="true")
    tokenizer_type: str = arg("ByteTokenizer", "ByteTokenizer (NullTokenizer with --mock-data --vocab-size, "
                                               "GPT2BPETokenizer with --vocab-file), NullTokenizer, "
                                               "SentencePieceTokenizer (alias GPTSentencePieceTokenizer, "
                                               "Llama2Tokenizer), HuggingFaceTokenizer, GPT2BPETokenizer, TikTokenizer")
    tokenizer_model: Optional[str] = arg(None, "tokenizer model file or directory")
    vocab_file: Optional[str] = arg(None, "GPT-2 BPE vocabulary")
    merge_file: Optional[str] = arg(None, "GPT-2 BPE merges")
    vocab_size: Optional[int] = arg(None, "vocabulary of NullTokenizer")
    reset_position_ids: bool = arg(False, "positions restart after each end-of-document token", store="true")
    reset_attention_mask: bool = arg(False, "tokens attend only within their document", store="true")
    eod_mask_loss: bool = arg(False, "no loss on end-of-document tokens", store="true")
    num_workers: int = arg(0, "data-loader worker processes")
    tiktoken_pattern: Optional[str] = arg(None, "TikTokenizer split pattern: v1 or v2")
    tiktoken_num_special_tokens: int = arg(1000, "TikTokenizer: ids reserved for special tokens")
    tiktoken_special_tokens: Optional[List[str]] = arg(None, "TikTokenizer: the named special tokens", nargs="+")
    legacy_tokenizer: bool = arg(False, "TikTokenizer: Megatron-LM's legacy tokenizer (no special-token parsing)",
                                 store="true")


@dataclass
class TrainingConfig:
    micro_batch_size: int = arg(8, "samples per micro-batch and DP rank")
    global_batch_size: Optional[int] = arg(None, "samples per step; None: micro_batch_size x DP")
    seq_length: int = arg(128, "tokens per sample (a named --model sets its own)")
    train_iters: Optional[int] = arg(None, "training steps (or --train-samples)")
    train_samples: Optional[int] = arg(None, "training length in samples; the LR schedule counts samples either way")
    rampup_batch_size: Optional[List[int]] = arg(None, "START INCR SAMPLES: the global batch grows from START by INCR "
                                                       "over SAMPLES samples (with --train-samples)", nargs=3)
    step_batch_size_schedule: Optional[str] = arg(None, "\"THRESHOLD:BS ...\" (Megatron-LM's): the global batch BS from "
                                                        "THRESHOLD tokens on (K/M/B/T suffixes), e.g. \"0:16 2.4B:320\"")
    decrease_batch_size_if_needed: bool = arg(False, "round each global batch down to a multiple of micro-batch x DP",
                                              store="true")
    lr: float = arg(1e-3, "peak learning rate")
    min_lr: float = arg(0.0, "learning rate at the end of the decay")
    lr_warmup_init: float = arg(0.0, "learning rate the warmup starts from")
    lr_warmup_iters: int = arg(0, "linear warmup steps")
    lr_warmup_samples: int = arg(0, "linear warmup samples (training by samples)")
    lr_warmup_fraction: Optional[float] = arg(None, "warmup as a fraction of the decay length")
    lr_decay_iters: Optional[int] = arg(None, "decay steps; None: train_iters")
    lr_decay_samples: Optional[int] = arg(None, "decay samples; None: train_samples")
    lr_decay_style: str = arg("linear", "decay after warmup",
                              choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_wsd_decay_style: str = arg("exponential", "WSD: shape of the final anneal",
                                  choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: Optional[int] = arg(None, "WSD: steps of the final anneal (training by iterations)")
    lr_wsd_decay_samples: Optional[int] = arg(None, "WSD: samples of the final anneal (training by samples)")
    decoupled_lr: Optional[float] = arg(None, "separate peak LR of the word embedding and output layer")
    decoupled_min_lr: Optional[float] = arg(None, "separate final LR of the word embedding and output layer")
    weight_decay: float = arg(0.01, "decoupled weight decay (not on biases and norms)")
    apply_wd_to_qk_layernorm: bool = arg(False, "weight decay on the q/k norm weights too (Megatron-Core's rule for "
                                                "Qwen3-Next, with --apply-layernorm-1p: towards a gain of 1)",
                                         store="true")
    start_weight_decay: Optional[float] = arg(None, "weight decay at the start (with --weight-decay-incr-style)")
    end_weight_decay: Optional[float] = arg(None, "weight decay at the end (with --weight-decay-incr-style)")
    weight_decay_incr_style: str = arg("constant", "weight decay schedule over training",
                                       choices=["constant", "linear", "cosine"])
    calculate_per_token_loss: bool = arg(False, "loss = mean over every loss-bearing token of the global batch; "
                                                "default (Megatron's): mean of the micro-batches' token means",
                                         store="true")
    adam_beta1: float = arg(0.9, "Adam beta1")
    adam_beta2: float = arg(0.999, "Adam beta2")
    adam_eps: float = arg(1e-8, "Adam epsilon")
    optimizer: str = arg("adam", "adam: AdamW (decoupled weight decay); muon: Muon for the hidden weight matrices, "
                                 "AdamW for embeddings, output layer, router, norms and biases; adam-1bit: "
                                 "DeepSpeed's 1-bit Adam (AdamW for --freeze-step steps, then frozen variance and "
                                 "sign-compressed momentum); adam-01: DeepSpeed's 0/1 Adam (see README)",
                           choices=["adam", "muon", "adam-1bit", "adam-01"])
    freeze_step: int = arg(100000, "1-bit Adam: warm-up steps of exact AdamW before the variance is frozen and the "
                                   "momentum is sent compressed (DeepSpeed's freeze_step and default)")
    var_freeze_step: int = arg(100000, "0/1 Adam: the last step that may update the variance (DeepSpeed's)")
    var_update_scaler: int = arg(16, "0/1 Adam: variance updates at each interval before it doubles (from 1)")
    local_step_scaler: int = arg(32678, "0/1 Adam: local steps at each sync interval before it doubles (from 1)")
    local_step_clipper: int = arg(16, "0/1 Adam: the largest interval between syncs of the local steps")
    muon_momentum: float = arg(0.9, "Muon: momentum of its internal SGD")
    muon_use_nesterov: bool = arg(False, "Muon: Nesterov-style momentum", store="true")
    muon_num_ns_steps: int = arg(5, "Muon: Newton-Schulz iterations")
    muon_tp_mode: str = arg("duplicated", "Muon: Newton-Schulz of a TP-split matrix on the whole matrix, gathered "
                                          "and computed on every rank of the TP group (blockwise and distributed "
                                          "are not implemented)", choices=["duplicated"])
    muon_split_qkv: bool = arg(True, "Muon: orthogonalize K and V (of linear_kv) as separate matrices, as Q is",
                               flag="--muon-no-split-qkv", store="false")
    muon_scale_mode: str = arg("spectral", "Muon: update scale, spectral sqrt(max(m, n)), unit_rms_norm sqrt(m/n), "
                                           "shape_scaling sqrt(max(1, m/n))",
                               choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_extra_scale_factor: float = arg(1.0, "Muon: factor on the update scale (0.2 with spectral: Moonlight's "
                                              "AdamW-matched RMS)")
    qk_clip: bool = arg(False, "QK-clip (Kimi-K2's MuonClip): after each update, scale the query and key weights of "
                               "each head whose largest attention logit exceeded --qk-clip-threshold", store="true")
    qk_clip_threshold: float = arg(100.0, "QK-clip: the largest attention logit a head may keep (tau)")
    qk_clip_alpha: float = arg(0.5, "QK-clip: the query takes eta^alpha of the scale, the key eta^(1 - alpha)")
    log_max_attention_logit: bool = arg(False, "record the step's largest attention logit (max_attention_logit) "
                                               "in the metrics", store="true")
    optimizer_cpu_offload: bool = arg(False, "keep the fp32 main params and Adam state in (pinned) host memory and "
                                             "step them there with the fused CPU Adam", store="true")
    optimizer_offload_fraction: float = arg(1.0, "with --optimizer-cpu-offload: the fraction of each rank's "
                                                 "optimizer shard kept on the host (the rest stays on the device)")
    optimizer_offload_nvme_path: Optional[str] = arg(None, "keep every bucket shard's fp32 main params and optimizer "
                                                           "state in one file per rank under this directory, read into "
                                                           "two staging buffers around each bucket's update")
    param_offload_nvme_path: Optional[str] = arg(None, "ZeRO-3: keep this rank's parameter shards in one file per "
                                                       "rank under this directory, read into two staging buffers "
                                                       "ahead of each unit's all-gather (ZeRO-Infinity)")
    use_cpu_initialization: bool = arg(False, "draw the initial weights on the CPU and copy them to the device "
                                              "(the same weights as a CPU run)", store="true")
    clip_grad: float = arg(1.0, "clip the global gradient norm to this (0: no clipping)")
    bf16: bool = arg(False, "bf16 parameters and compute, fp32 main params and gradients", store="true")
    fp16: bool = arg(False, "fp16 parameters and compute with loss scaling", store="true")
    fp8_format: Optional[str] = arg(None, "FP8 GEMMs in the attention and MLP linears (torch._scaled_mm): e4m3, "
                                          "or hybrid (e5m2 gradients)", choices=["e4m3", "hybrid"])
    fp8_recipe: Optional[str] = arg(None, "FP8 scaling: delayed (the default with --fp8-format: scales from an "
                                          "amax history), tensorwise / rowwise (current scaling per tensor / row), "
                                          "blockwise (1x128 tiles, 128x128 weight blocks); mxfp8: Blackwell only",
                                    choices=["tensorwise", "rowwise", "delayed", "blockwise", "mxfp8"])
    fp8_margin: int = arg(0, "FP8 scale = fp8 max / amax / 2^margin")
    fp8_amax_history_len: int = arg(1, "delayed scaling: steps of amax history per FP8 tensor")
    fp8_amax_compute_algo: str = arg("most_recent", "delayed scaling: the amax of the history its scale uses",
                                     choices=["most_recent", "max"])
    transformer_impl: str = arg("local", "the layers' modules: local (megatron-lite's, the native FP8 recipes), or "
                                         "transformer_engine (Transformer Engine's linears and attention, where "
                                         "installed; not exercised in CI)", choices=["local", "transformer_engine"])
    first_last_layers_bf16: bool = arg(False, "FP8: keep the GEMMs of the first and last layers in the params dtype",
                                       store="true")
    num_layers_at_start_in_bf16: int = arg(1, "with --first-last-layers-bf16: first layers kept out of FP8")
    num_layers_at_end_in_bf16: int = arg(1, "with --first-last-layers-bf16: last layers kept out of FP8")
    fp8_param_gather: bool = arg(False, "ZeRO-1/2/3 all-gather the FP8 GEMMs' updated weights in FP8 (half of "
                                        "bf16's bytes); main params stay fp32", store="true")
    loss_scale: Optional[float] = arg(None, "constant fp16 loss scale; None: dynamic")
    initial_loss_scale: float = arg(2.0 ** 32, "first dynamic fp16 loss scale")
    min_loss_scale: float = arg(1.0, "smallest dynamic fp16 loss scale")
    loss_scale_window: int = arg(1000, "clean steps before the dynamic loss scale grows")
    hysteresis: int = arg(2, "overflows before the dynamic loss scale shrinks")
    seed: int = arg(1234, "random seed (weights, data order, dropout)")
    eval_interval: int = arg(100, "steps between evaluations")
    eval_iters: int = arg(4, "steps of each evaluation")
    log_interval: int = arg(10, "steps between console lines")
    recompute_granularity: Optional[str] = arg(None, "activation recomputation", choices=["full", "selective"])
    recompute_method: str = arg("uniform", "full recomputation: uniform groups of --recompute-num-layers, or block "
                                           "(only the first ones)", choices=["uniform", "block"])
    recompute_num_layers: int = arg(1, "layers per recomputed group (uniform) or recomputed layers (block)")
    cpu_offloading: bool = arg(False, "keep the saved activations of the first --cpu-offloading-num-layers layers "
                                      "of each model chunk in (pinned) host memory until backward", store="true")
    cpu_offloading_num_layers: int = arg(0, "with --cpu-offloading: layers whose activations are offloaded "
                                            "(0 to num_layers - 1)")
    cpu_offloading_activations: bool = arg(True, "with --cpu-offloading: offload activations (the default)",
                                           store="true")
    cpu_offloading_weights: bool = arg(False, "with --cpu-offloading: offload weights (not implemented: refused)",
                                       store="true")
    recompute_modules: Optional[List[str]] = arg(
        None, "selective recomputation: the submodules recomputed in backward (default core_attn: in linear-attention "
              "layers the conv and the delta rule; linear_attn: all between their projections); layernorm, "
              "moe_act and mla_up_proj drop their outputs only", nargs="+", choices=list(RECOMPUTE_MODULES))
    device: Optional[str] = arg(None, "cpu or cuda; None: cuda when available", choices=["cpu", "cuda"])
    distributed_timeout_minutes: float = arg(10, "timeout of every process group (gloo and NCCL): a collective that "
                                                 "waits longer for a peer fails")
    hang_detection_factor: Optional[float] = arg(
        None, "a watchdog thread per rank: a step that runs longer than this many times the median step so far "
              "dumps every thread's Python stack to <--save or .>/hang-rank<R>.txt and exits 1 (torchrun restarts)")
    hang_detection_warmup_steps: int = arg(10, "steps timed before --hang-detection-factor arms")
    log_straggler: bool = arg(False, "every --log-interval: each rank's step time (data wait, forward-backward, "
                                     "optimizer, blocked in collectives) gathered, the slowest ranks and their ratio "
                                     "to the median printed and in the metrics", store="true")
    straggler_minmax_count: int = arg(1, "with --log-straggler: how many slowest and fastest ranks to name")
    compile: bool = arg(False, "torch.compile each transformer layer (fuses norms, RoPE, SwiGLU; compile time "
                               "bounded by the layer, not the model)", store="true")
    cross_entropy_chunk_size: Optional[int] = arg(
        None, "tokens per chunk of the vocab-parallel cross entropy (only a chunk's fp32 logits exist at a time); "
              "0: unchunked; None: chunks of 256 MiB of fp32 logits when they are bf16/fp16, else unchunked")
    metrics_file: Optional[str] = arg(None, "JSON Lines, one record per iteration")
    log_comm_volume: bool = arg(False, "bytes moved per collective kind, in the metrics", store="true")
    tensorboard_dir: Optional[str] = arg(None, "TensorBoard logs")
    wandb_project: Optional[str] = arg(None, "Weights & Biases project (offline without an API key)")
    wandb_exp_name: Optional[str] = arg(None, "Weights & Biases run name")
    wandb_save_dir: Optional[str] = arg(None, "Weights & Biases directory")
    save: Optional[str] = arg(None, "checkpoint directory (a run restarted with it resumes)")
    load: Optional[str] = arg(None, "checkpoint to start from")
    ckpt_format: Optional[str] = arg(None, "torch_dist: --load reads Megatron-LM's torch_dist checkpoints (model, "
                                           "optimizer, schedule, position); megatron-lite writes its own format")
    auto_detect_ckpt_format: bool = arg(False, "--load reads a checkpoint in either format (Megatron-LM's torch_dist "
                                               "or megatron-lite's)", store="true")
    save_interval: Optional[int] = arg(None, "steps between checkpoints")
    async_save: bool = arg(False, "write checkpoints in the background", store="true")
    keep_last: Optional[int] = arg(None, "keep only the newest N checkpoints")
    non_persistent_save_interval: Optional[int] = arg(
        None, "steps between non-persistent checkpoints (--non-persistent-ckpt-type), at iterations with no "
              "--save checkpoint due")
    non_persistent_ckpt_type: Optional[str] = arg(
        None, "local: each rank writes its own state to --non-persistent-local-ckpt-dir; global: a global checkpoint "
              "into --non-persistent-global-ckpt-dir, only the newest kept (in_memory is not supported)",
        choices=["global", "local", "in_memory"])
    non_persistent_global_ckpt_dir: Optional[str] = arg(
        None, "directory of the non-persistent global checkpoints; None: --save/non_persistent")
    non_persistent_local_ckpt_dir: Optional[str] = arg(
        None, "node-local directory of the local checkpoints (one subdirectory per rank); a restart resumes the "
              "newest checkpoint complete on every rank, local or --save/--load")
    finetune: bool = arg(False, "load only the weights from --load; iteration and consumed samples start at 0",
                         store="true")
    no_load_optim: bool = arg(False, "do not load optimizer state or LR schedule", store="true")
    pretrained_checkpoint: Optional[str] = arg(None, "weights to start from when --save / --load hold no checkpoint "
                                                     "(iteration 0, fresh optimizer)")
    use_checkpoint_args: bool = arg(False, "take the model's shape from the checkpoint (--load, else "
                                           "--pretrained-checkpoint) instead of the model flags", store="true")
    no_load_rng: bool = arg(False, "do not load RNG states", store="true")
    verify_checkpoint: bool = arg(True, "check the checkpoint's checksums on load", flag="--no-verify-checkpoint",
                                  store="false")
    exit_signal_handler: bool = arg(False, "on SIGTERM, save after the current iteration and exit 0", store="true")
    exit_duration_in_mins: Optional[float] = arg(None, "save and exit after this many minutes")
    exit_interval: Optional[int] = arg(None, "save and exit at an iteration multiple of this")
    check_for_nan_in_loss_and_grad: bool = arg(True, "stop on a non-finite loss, gradient or fp16 parameter",
                                               flag="--no-check-for-nan-in-loss-and-grad", store="false")
    use_precision_aware_optimizer: bool = arg(False, "keep main params, gradients and Adam states in the dtypes "
                                                     "below (distributed optimizer)", store="true")
    main_params_dtype: str = arg("fp32", "main (master) parameters", choices=["fp32", "fp16"])
    main_grads_dtype: str = arg("fp32", "gradient buffers", choices=["fp32", "bf16"])
    exp_avg_dtype: str = arg("fp32", "Adam first moment", choices=["fp32", "fp16", "bf16", "fp8"])
    exp_avg_sq_dtype: str = arg("fp32", "Adam second moment", choices=["fp32", "fp16", "bf16", "fp8"])
    profile: bool = arg(False, "trace steps profile_step_start+1 .. profile_step_end with torch.profiler",
                        store="true")
    profile_step_start: int = arg(10, "steps done when the trace starts")
    profile_step_end: int = arg(12, "steps done when the trace stops")
    profile_ranks: List[int] = arg(help="ranks that trace (none given: every rank)", factory=lambda: [0], nargs="*")
    record_memory_history: bool = arg(False, "CUDA allocator history, dumped by the last rank", store="true")
    memory_snapshot_path: str = arg("snapshot.pickle", "where --record-memory-history dumps its snapshot")
    empty_unused_memory_level: int = arg(0, "empty the CUDA cache after forward-backward (1) and the optimizer (2)",
                                         choices=[0, 1, 2])
    manual_gc: bool = arg(False, "disable Python's automatic GC; collect every --manual-gc-interval steps",
                          store="true")
    manual_gc_interval: int = arg(0, "steps between collections with --manual-gc (0: only at the start)")
    logging_level: Optional[int] = arg(None, "Python logging level (20 = INFO)")

    def finalize(self, dp: int) -> None:
        """The default global batch, the iterations of a run given by --train-samples, and the FP8 recipe."""
        if self.step_batch_size_schedule is not None:  # Megatron-LM's refusals
            from .training.microbatches import parse_step_schedule

            last = parse_step_schedule(self.step_batch_size_schedule, self.seq_length)[-1][1]
            # Megatron-LM refuses any --global-batch-size here, though its own GPT-3 script passes
            # the schedule's last batch: that one is accepted, as it changes nothing. The nominal
            # batch (lengths in iterations, evaluation) is that last batch: Megatron-LM's
            # micro_batch_size x DP would make the LR schedule depend on the layout.
            for flag, given in (("--global-batch-size", self.global_batch_size not in (None, last)),
                                ("--rampup-batch-size", self.rampup_batch_size is not None),
                                ("--decrease-batch-size-if-needed", self.decrease_batch_size_if_needed)):
                _require(not given, f"--step-batch-size-schedule and {flag} are exclusive: the schedule gives every "
                                    f"step's global batch; drop {flag}")
            self.global_batch_size = last
        if self.global_batch_size is None and dp >= 1:
            self.global_batch_size = self.micro_batch_size * dp
        if self.train_samples is not None:
            _require(self.train_iters is None, "--train-iters and --train-samples are exclusive; choose one")
            self.train_iters = self.batch_schedule(dp).train_iters(self.train_samples)
        else:
            _require(self.train_iters is not None, "give the training length: --train-iters N or --train-samples N")
            _require(self.rampup_batch_size is None, "--rampup-batch-size with --train-iters: Megatron-LM expects no "
                                                     "batch-size rampup for iteration-based training; give the "
                                                     "length with --train-samples instead")
        if self.fp8_format is not None:
            self.fp8_recipe = self.fp8_recipe or "delayed"  # Megatron-LM's default recipe
            # rowwise scales the weight per GEMM along the contracted dimension, which its two GEMMs cut
            # differently: --fp8-param-gather does nothing then (the start-up note says so)
            self.fp8_param_gather = self.fp8_param_gather and self.fp8_recipe != "rowwise"

    def batch_schedule(self, dp: int):
        """The global batch and micro-batches of every step (training/microbatches.py)."""
        from .training.microbatches import BatchSchedule

        from .training.microbatches import parse_step_schedule

        steps = self.step_batch_size_schedule
        return BatchSchedule(self.global_batch_size, self.micro_batch_size, dp, self.rampup_batch_size,
                             self.decrease_batch_size_if_needed,
                             None if steps is None else parse_step_schedule(steps, self.seq_length))

    def param_scheduler(self):
        """The LR / weight-decay schedule, counting samples (optim/lr_scheduler.py)."""
        from .optim.lr_scheduler import SCHEDULE_FLAGS, build_param_scheduler

        kw = {k: getattr(self, k) for k in SCHEDULE_FLAGS}
        if self.train_samples is not None:
            kw["train_iters"] = None  # derived by finalize(): the schedule reads the samples
        return build_param_scheduler(**kw)

    def optimizer_precision(self):
        from .optim.precision import OptimizerPrecision

        return OptimizerPrecision.from_flags(
            use_precision_aware_optimizer=self.use_precision_aware_optimizer, main_params_dtype=self.main_params_dtype,
            main_grads_dtype=self.main_grads_dtype, exp_avg_dtype=self.exp_avg_dtype,
            exp_avg_sq_dtype=self.exp_avg_sq_dtype, distributed_optimizer=True)

    def validate(self, dp: int, zero_stage: int = 1) -> None:
        _require(self.micro_batch_size >= 1, f"micro_batch_size ({self.micro_batch_size}) must be >= 1")
        _require(self.global_batch_size is not None, "global_batch_size is unset: call Config.finalize first")
        _require(self.global_batch_size >= 1, f"global_batch_size ({self.global_batch_size}) must be >= 1")
        _require(self.train_iters is not None and self.train_iters >= 0,
                 f"train_iters ({self.train_iters}) must be >= 0")
        _require(self.train_samples is None or self.train_samples >= 0,
                 f"train_samples ({self.train_samples}) must be >= 0")
        self.batch_schedule(dp).microbatch_counts(self.train_iters)
        _require(not self.wandb_project or self.wandb_exp_name, "--wandb-project needs --wandb-exp-name NAME: the "
                                                                "run's name (Megatron-LM requires it too)")
        _require(self.seq_length >= 1, f"seq_length ({self.seq_length}) must be >= 1")
        _require(self.eval_iters >= 0, f"eval_iters ({self.eval_iters}) must be >= 0")
        _require(0 <= self.seed < 2 ** 32, f"seed ({self.seed}) must lie in [0, 2**32)")
        _require(self.loss_scale is None or self.loss_scale > 0, f"loss_scale ({self.loss_scale}) must be positive")
        _require(self.lr >= 0 and self.min_lr >= 0 and self.min_lr <= self.lr,
                 f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are exclusive; choose one")
        self._validate_optimizer(zero_stage)
        self.param_scheduler()  # the schedule's own checks (modes, warmup < decay, WSD length, ...)
        if self.use_precision_aware_optimizer:
            _require(zero_stage >= 1, "--use-precision-aware-optimizer needs the distributed optimizer "
                                      "(--use-distributed-optimizer or --zero-stage >= 1)")
        self.optimizer_precision()
        self._validate_nvme_offload(zero_stage)
        self._validate_qk_clip()
        _require(not (self.optimizer_cpu_offload and self.use_precision_aware_optimizer),
                 "--optimizer-cpu-offload keeps fp32 state in host memory: drop --use-precision-aware-optimizer "
                 "(or the offload)")
        if self.profile:
            _require(0 <= self.profile_step_start < self.profile_step_end,
                     f"--profile-step-start ({self.profile_step_start}) must be >= 0 and below --profile-step-end "
                     f"({self.profile_step_end})")
        _require(self.manual_gc_interval >= 0, f"--manual-gc-interval ({self.manual_gc_interval}) must be >= 0")
        _require(self.cross_entropy_chunk_size is None or self.cross_entropy_chunk_size >= 0,
                 f"--cross-entropy-chunk-size ({self.cross_entropy_chunk_size}) must be >= 0 (0: unchunked)")
        if self.compile:
            from .transformer.fast_paths import compile_problem

            problem = compile_problem(self.device)
            _require(problem is None, f"--compile: {problem}; install it or drop --compile")
        _require(self.recompute_granularity in (None, "full", "selective"),
                 f"recompute_granularity ({self.recompute_granularity}) must be full or selective")
        _require(self.recompute_modules is None or self.recompute_granularity == "selective",
                 "--recompute-modules needs --recompute-granularity selective")
        _require(self.device in (None, "cpu", "cuda"), f"device ({self.device}) must be cpu or cuda")
        _require(self.log_interval >= 1, f"log_interval ({self.log_interval}) must be >= 1")
        _require(self.distributed_timeout_minutes > 0,
                 f"--distributed-timeout-minutes ({self.distributed_timeout_minutes}) must be positive")
        _require(self.hang_detection_factor is None or self.hang_detection_factor > 1,
                 f"--hang-detection-factor ({self.hang_detection_factor}) must be > 1 (a multiple of the median step "
                 f"time)")
        _require(self.hang_detection_warmup_steps >= 1,
                 f"--hang-detection-warmup-steps ({self.hang_detection_warmup_steps}) must be >= 1")
        _require(self.straggler_minmax_count >= 1,
                 f"--straggler-minmax-count ({self.straggler_minmax_count}) must be >= 1")
        _require(self.eval_interval >= 1, f"eval_interval ({self.eval_interval}) must be >= 1")
        self._validate_checkpointing()

    def _validate_qk_clip(self) -> None:
        if not self.qk_clip:
            _require(self.qk_clip_threshold == 100.0 and self.qk_clip_alpha == 0.5,
                     "--qk-clip-threshold and --qk-clip-alpha need --qk-clip")
            return
        _require(self.qk_clip_threshold > 0, f"--qk-clip-threshold ({self.qk_clip_threshold}) must be > 0")
        _require(0.0 < self.qk_clip_alpha < 1.0, f"--qk-clip-alpha ({self.qk_clip_alpha}) must lie in (0, 1)")
        _require(not self.use_precision_aware_optimizer and not self.optimizer_offload_nvme_path,
                 "--qk-clip scales fp32 main params in memory: drop --use-precision-aware-optimizer and "
                 "--optimizer-offload-nvme-path")

    def _validate_nvme_offload(self, zero_stage: int) -> None:
        path, flag = self.optimizer_offload_nvme_path, "--optimizer-offload-nvme-path"
        if path is None:
            return
        feature_checks.require_nvme_dir(path, flag)
        _require(not self.optimizer_cpu_offload, f"{flag} and --optimizer-cpu-offload are exclusive: the state lives "
                                                 f"in the file or in host memory; choose one")
        _require(not self.use_precision_aware_optimizer, f"{flag} keeps fp32 state: drop "
                                                         f"--use-precision-aware-optimizer (or the offload)")
        _require(self.optimizer != "muon", f"{flag} with --optimizer muon is not implemented: use --optimizer adam")

    def _validate_muon(self, zero_stage: int) -> None:
        if self.optimizer != "muon":
            changed = [f for f, v, d in (("--muon-momentum", self.muon_momentum, 0.9),
                                         ("--muon-use-nesterov", self.muon_use_nesterov, False),
                                         ("--muon-num-ns-steps", self.muon_num_ns_steps, 5),
                                         ("--muon-no-split-qkv", self.muon_split_qkv, True),
                                         ("--muon-scale-mode", self.muon_scale_mode, "spectral"),
                                         ("--muon-extra-scale-factor", self.muon_extra_scale_factor, 1.0)) if v != d]
            _require(not changed, f"{changed[0] if changed else ''} needs --optimizer muon")
            return
        _require(0.0 <= self.muon_momentum < 1.0, f"--muon-momentum ({self.muon_momentum}) must lie in [0, 1)")
        _require(self.muon_num_ns_steps >= 1, f"--muon-num-ns-steps ({self.muon_num_ns_steps}) must be >= 1")
        _require(zero_stage <= 2, "--optimizer muon needs whole matrices, which --zero-stage 3 does not keep: use "
                                  "--zero-stage 0-2")
        _require(not self.use_precision_aware_optimizer and not self.optimizer_cpu_offload,
                 "--optimizer muon keeps fp32 state on the device: drop --use-precision-aware-optimizer and "
                 "--optimizer-cpu-offload")

    def _validate_optimizer(self, zero_stage: int) -> None:
        self._validate_muon(zero_stage)
        feature_checks.validate_compressed_adam(self, zero_stage)
        for flag, v in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            _require(0.0 <= v < 1.0, f"{flag} ({v}) must lie in [0, 1)")
        _require(self.adam_eps > 0, f"--adam-eps ({self.adam_eps}) must be positive")
        _require(0.0 <= self.optimizer_offload_fraction <= 1.0,
                 f"--optimizer-offload-fraction ({self.optimizer_offload_fraction}) must lie in [0, 1]")
        _require(self.weight_decay >= 0, f"--weight-decay ({self.weight_decay}) must be >= 0")
        _require(self.clip_grad >= 0, f"--clip-grad ({self.clip_grad}) must be >= 0 (0 disables clipping)")
        for flag, v in (("--lr", self.lr), ("--min-lr", self.min_lr)):
            _require(math.isfinite(v), f"{flag} ({v}) must be finite")
        _require(self.initial_loss_scale > 0 and self.min_loss_scale > 0,
                 f"--initial-loss-scale ({self.initial_loss_scale}) and --min-loss-scale ({self.min_loss_scale}) "
                 f"must be positive")
        _require(self.loss_scale_window >= 1, f"--loss-scale-window ({self.loss_scale_window}) must be >= 1")
        _require(self.hysteresis >= 1, f"--hysteresis ({self.hysteresis}) must be >= 1")
        _require(self.recompute_num_layers >= 1, f"--recompute-num-layers ({self.recompute_num_layers}) must be >= 1")

    def _validate_checkpointing(self) -> None:
        # (--save-interval alone saves nothing, as in Megatron-LM, whose model configs carry one)
        for flag, value in (("--async-save", self.async_save), ("--keep-last", self.keep_last)):
            _require(not value or self.save, f"{flag} needs --save DIR (where checkpoints go)")
        for flag, value in (("--save-interval", self.save_interval), ("--keep-last", self.keep_last),
                            ("--exit-interval", self.exit_interval)):
            _require(value is None or value >= 1, f"{flag} ({value}) must be >= 1")
        self._validate_non_persistent()
        _require(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins ({self.exit_duration_in_mins}) must be positive")
        # --no-load-optim / --no-load-rng without --load: nothing to skip (Megatron-LM accepts them)
        _require(not self.finetune or self.load, "--finetune needs --load DIR (the checkpoint to load)")
        if self.finetune:
            _require(os.path.isdir(self.load), f"--finetune: --load directory {self.load} does not exist")
        for flag, path in (("--save", self.save), ("--load", self.load)):
            _require(not path or not os.path.exists(path) or os.path.isdir(path),
                     f"{flag} {path} exists and is not a directory")

    def _validate_non_persistent(self) -> None:
        kind, interval, local_dir = (self.non_persistent_ckpt_type, self.non_persistent_save_interval,
                                     self.non_persistent_local_ckpt_dir)
        _require(kind != "in_memory", "--non-persistent-ckpt-type in_memory is not supported by megatron-lite; use "
                                      "local (each rank's own state on node-local disk) or global")
        _require(interval is None or interval >= 1, f"--non-persistent-save-interval ({interval}) must be >= 1")
        _require(interval is None or kind, "--non-persistent-save-interval needs --non-persistent-ckpt-type local "
                                           "(or global)")
        _require(kind != "local" or local_dir, "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir "
                                               "DIR (node-local disk)")
        _require(not local_dir or kind == "local",
                 "--non-persistent-local-ckpt-dir needs --non-persistent-ckpt-type local")
        global_dir = self.non_persistent_global_ckpt_dir
        _require(kind != "global" or global_dir or self.save, "--non-persistent-ckpt-type global needs --save DIR "
                                                              "(it writes to DIR/non_persistent) or "
                                                              "--non-persistent-global-ckpt-dir DIR")
        _require(not global_dir or kind == "global",
                 "--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global")
        _require(not local_dir or not os.path.exists(local_dir) or os.path.isdir(local_dir),
                 f"--non-persistent-local-ckpt-dir {local_dir} exists and is not a directory")

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches of a step at the full global batch (evaluation, and after any ramp-up)."""
        return self.global_batch_size // (self.micro_batch_size * dp)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        self.notes: List[str] = []  # start-up lines: flags that the configuration drops or overrides
        self.model_flags: dict = {}  # the model fields given on the command line (arguments.py)
        self.data_flags: dict = {}  # ... and the data fields (a tokenizer inferred from them counts as given)

    def finalize(self, world_size: int) -> "Config":
        """Fill what depends on the world size (the default global batch: micro-batch x DP).
        The one step that derives values; validate() only checks."""
        self.parallel.validate_sizes()
        self.training.finalize(self.parallel.data_parallel_size(world_size))
        return self

    def validate(self, world_size: int) -> None:
        flag_rules.check_values(self)  # (first: a NaN or a zero size would mislead the checks below)
        self.model.validate(self.training.seq_length)
        self.parallel.validate(world_size, self.model, self.training.seq_length)
        dp = self.parallel.data_parallel_size(world_size)
        self.training.validate(dp, self.parallel.zero_stage)
        _require(self.data.num_workers >= 0, f"num_workers ({self.data.num_workers}) must be >= 0")
        t = self.training
        for m in t.batch_schedule(dp).microbatch_counts(t.train_iters):
            self._validate_pipeline(m)
        self._validate_pipeline(t.num_microbatches(dp))  # evaluation
        feature_checks.validate_fp8(self)
        _require(not (t.qk_clip and self.model.qk_layernorm), "--qk-clip scales the query and key weights, which "
                                                              "--qk-layernorm normalises away: drop one of them")

        if self.training.transformer_impl == "transformer_engine":
            from .transformer import te_backend
            te_backend.te_pytorch()  # one line where it is missing
            te_backend.check_supported(self)
            _require(self.training.fp8_recipe in (None, "tensorwise", "delayed", "blockwise"),
                     f"--fp8-recipe {self.training.fp8_recipe} has no Transformer Engine recipe: use tensorwise, "
                     f"delayed or blockwise, or --transformer-impl local")
        _require(self.parallel.grad_comm_dtype is None or t.optimizer not in ("adam-1bit", "adam-01"),
                 f"--optimizer {t.optimizer} compresses its own communication (signs): drop --grad-comm-dtype "
                 f"{self.parallel.grad_comm_dtype}")
        _require((self.parallel.grad_comm_dtype is None and not self.parallel.zeropp_quantized_gradients)
                 or not t.use_precision_aware_optimizer or t.main_grads_dtype == "fp32",
                 f"--grad-comm-dtype {self.parallel.grad_comm_dtype} compresses fp32 gradient buffers: drop "
                 f"--main-grads-dtype {t.main_grads_dtype} (or --grad-comm-dtype)")
        feature_checks.validate_activation_memory(self)
        feature_checks.validate_param_offload(self)
        validate_hybrid(self)  # --hybrid-override-pattern and the Mamba flags
        from .transformer.dsa_config import validate_dsa_layout
        validate_dsa_layout(self)
        flag_rules.check(self)

    def _validate_pipeline(self, num_microbatches: int) -> None:
        from .parallel.pipeline.partition import LayerSplit, layout_mtp_layers, stage_layer_ranges
        from .parallel.pipeline.schedules import default_schedule, validate_schedule_args

        p = self.parallel
        vpp = p.virtual_pipeline_model_parallel_size or 1
        _require(vpp == 1 or p.pp > 1, f"virtual pipeline stages ({vpp}) need --pipeline-model-parallel-size > 1")
        split = LayerSplit.of(p)
        _require(split.even or p.pp > 1, "--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers "
                                         "and --account-for-*-in-pipeline-split need --pipeline-model-parallel-size > 1")
        if p.pp > 1 or p.pipeline_schedule is not None:
            validate_schedule_args(p.pipeline_schedule or default_schedule(vpp), p.pp, num_microbatches, vpp,
                                   self.model.num_layers if split.even else None)  # the split checked its own
        vpp = p.vpp if p.pp > 1 else 1
        ranges = stage_layer_ranges(self.model.num_layers, p.pp, vpp, split, p.pp_placement)
        if split.layout is not None:  # as Megatron-Core: the layout's m entries are the MTP layers
            placed = layout_mtp_layers(split.layout)
            _require(placed == self.model.mtp_depth,
                     f"--pipeline-model-parallel-layout places {placed} multi-token prediction layers (m) but "
                     f"--mtp-num-layers is {self.model.mtp_depth}: give one m per MTP layer, just before L")
        t = self.training
        if t.recompute_granularity == "full":
            most = max(end - start for start, end in ranges)
            _require(t.recompute_num_layers <= most,
                     f"--recompute-num-layers ({t.recompute_num_layers}) exceeds the {most} layers of a model chunk "
                     f"({self.model.num_layers} layers over {p.pp * vpp} pipeline stages); use at most {most}")

    def to_dict(self) -> dict:
        return {f.name: asdict(getattr(self, f.name)) for f in fields(self)}
