"""Megatron-LM-compatible command-line flags -> Config dataclasses.

Model-shape flags default to None so that a named `--model` fills what the command line leaves
out; explicit flags always win. Without `--model`, the built-in default model is used.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from .config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from .errors import ConfigError

DEFAULT_MODEL = "gpt2-small-cpu"

# Flags of Megatron-LM that select fused kernels or legacy code paths: accepted so that existing
# launch scripts run unchanged; they do not change the math here.
COMPAT_NOOP_FLAGS = [
    "--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--no-async-tensor-model-parallel-allreduce", "--use-rotary-position-embeddings", "--no-rope-fusion",
    "--bias-swiglu-fusion", "--no-bias-swiglu-fusion", "--use-torch-fsdp2", "--no-create-attention-mask-in-dataloader",
    # logging extras and allocator/IO hints: what they control is either always on here or moot
    "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
    "--log-loss-scale-to-tensorboard", "--log-learning-rate-to-tensorboard", "--log-batch-size-to-tensorboard",
    "--manual-gc", "--cross-entropy-loss-fusion", "--use-cpu-initialization", "--no-mmap-bin-files",
    "--no-persist-layer-norm", "--overlap-p2p-communication", "--tp-comm-overlap",
]
COMPAT_VALUE_FLAGS = ["--distributed-backend", "--transformer-impl", "--timing-log-level", "--distributed-timeout-minutes",
                      "--num-dataset-builder-threads", "--data-impl", "--tensorboard-log-interval", "--ckpt-format",
                      "--manual-gc-interval", "--tensorboard-queue-size"]
# Megatron-LM flags that would change training here but are not implemented: refused with one
# line rather than silently ignored.
UNSUPPORTED_FLAGS = {"--rampup-batch-size": "batch-size ramp-up", "--train-samples": "sample-based training length",
                     "--lr-warmup-samples": "sample-based warmup", "--lr-decay-samples": "sample-based decay",
                     "--lr-warmup-init": "a non-zero warmup start", "--use-checkpoint-args": "model shape from a checkpoint",
                     "--expert-tensor-parallel-size": "expert tensor parallelism",
                     "--moe-grouped-gemm": "mixture of experts"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (no usage dump), exit code 2."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Pretrain a GPT model (megatron-lite)", allow_abbrev=False)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help=f"named config from models/zoo.py (default {DEFAULT_MODEL})")
    for flag, typ in [("--num-layers", int), ("--hidden-size", int), ("--ffn-hidden-size", int),
                      ("--num-attention-heads", int), ("--num-query-groups", int), ("--kv-channels", int),
                      ("--max-position-embeddings", int), ("--rotary-base", float), ("--norm-epsilon", float),
                      ("--attention-dropout", float), ("--hidden-dropout", float), ("--init-method-std", float),
                      ("--make-vocab-size-divisible-by", int), ("--vocab-size", int)]:
        m.add_argument(flag, type=typ, default=None)
    m.add_argument("--layernorm-epsilon", type=float, dest="norm_epsilon", default=None, help="alias of --norm-epsilon")
    m.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None)
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    m.add_argument("--group-query-attention", action="store_true",
                   help="use --num-query-groups (without it every head has its own K/V)")
    for flag in ["--swiglu", "--openai-gelu", "--disable-bias-linear", "--add-qkv-bias",
                 "--untie-embeddings-and-output-weights"]:
        m.add_argument(flag, action="store_true", default=None)
    m.add_argument("--attention-backend", choices=["auto", "sdpa", "flash"], default="auto")
    m.add_argument("--use-flash-attn", action="store_const", const="flash", dest="attention_backend")

    par = p.add_argument_group("parallelism")
    for flag in ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size"]:
        par.add_argument(flag, type=int, default=1)
    for flag in ["--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--ddp-bucket-size",
                 "--num-experts", "--moe-router-topk"]:
        par.add_argument(flag, type=int, default=None)
    par.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b", "interleaved", "zb-h1"], default=None)
    par.add_argument("--cp-comm-type", choices=["p2p", "a2a", "all_gather"], default="p2p")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true", help="= --zero-stage 1 (Megatron-LM)")
    par.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])
    for flag in ["--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16"]:
        par.add_argument(flag, action="store_true")

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=None)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument("--seq-length", type=int, default=None)
    t.add_argument("--train-iters", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--min-lr", type=float, default=None)
    t.add_argument("--lr-warmup-iters", type=int, default=None)
    t.add_argument("--lr-warmup-fraction", type=float, default=None)
    t.add_argument("--lr-decay-iters", type=int, default=None)
    t.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--fp16", action="store_true")
    t.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    t.add_argument("--min-loss-scale", type=float, default=1.0)
    t.add_argument("--loss-scale-window", type=int, default=1000)
    t.add_argument("--hysteresis", type=int, default=2)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--eval-interval", type=int, default=None)
    t.add_argument("--eval-iters", type=int, default=None)
    t.add_argument("--log-interval", type=int, default=None)
    t.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    t.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    t.add_argument("--recompute-num-layers", type=int, default=1)
    t.add_argument("--device", choices=["cpu", "cuda"], default=None)
    t.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="stop on a non-finite loss or gradient (default on)")
    t.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")

    o = p.add_argument_group("logging and checkpoints")
    o.add_argument("--metrics-file", default=None, help="JSON Lines, one record per iteration")
    o.add_argument("--log-comm-volume", action="store_true")
    o.add_argument("--tensorboard-dir", default=None)
    o.add_argument("--wandb-project", default=None)
    o.add_argument("--wandb-exp-name", default=None)
    o.add_argument("--wandb-save-dir", default=None)
    o.add_argument("--save", default=None)
    o.add_argument("--load", default=None)
    o.add_argument("--save-interval", type=int, default=None)
    o.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    o.add_argument("--keep-last", type=int, default=None, help="keep only the newest N checkpoints")
    o.add_argument("--finetune", action="store_true",
                   help="load only the weights from --load; iteration and consumed samples start at 0")
    o.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state or LR schedule")
    o.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    o.add_argument("--no-verify-checkpoint", action="store_false", dest="verify_checkpoint",
                   help="do not check the checkpoint's checksums on load")
    o.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save after the current iteration and exit 0")
    o.add_argument("--exit-duration-in-mins", type=float, default=None)
    o.add_argument("--exit-interval", type=int, default=None)

    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None, help="prefix, or weight prefix weight prefix ...")
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--data-cache-path", default=None)
    d.add_argument("--mock-data", action="store_true")
    d.add_argument("--tokenizer-type", default=None,
                   help="ByteTokenizer (default), NullTokenizer, SentencePieceTokenizer (alias "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer), HuggingFaceTokenizer, GPT2BPETokenizer")
    d.add_argument("--tokenizer-model", default=None)
    d.add_argument("--vocab-file", default=None)
    d.add_argument("--merge-file", default=None)
    for flag in ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]:
        d.add_argument(flag, action="store_true")
    d.add_argument("--num-workers", type=int, default=0)

    t.add_argument("--loss-scale", type=float, default=None, help="constant fp16 loss scale (default: dynamic)")
    t.add_argument("--optimizer", choices=["adam"], default="adam", help="AdamW (decoupled weight decay)")
    for flag in UNSUPPORTED_FLAGS:
        p.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    compat = p.add_argument_group("accepted for compatibility with Megatron-LM launch scripts (no effect)")
    for flag in COMPAT_NOOP_FLAGS:
        compat.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in COMPAT_VALUE_FLAGS:
        compat.add_argument(flag, default=None, help=argparse.SUPPRESS)
    return p


# Training defaults for the built-in default run (what `torchrun pretrain_gpt.py` with no flags does).
_TRAINING_DEFAULTS = dict(micro_batch_size=8, train_iters=300, lr=1e-3, min_lr=1e-4, eval_interval=100,
                          eval_iters=4, log_interval=10)


def config_from_args(args: argparse.Namespace) -> Config:
    """Resolve flags (over the named model, over the defaults) into a Config. No validation yet."""
    from models.zoo import get_model_config  # models/ sits above megatron_lite: import late

    for flag, what in UNSUPPORTED_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            raise ConfigError(f"{flag} ({what}) is not supported by megatron-lite; remove it from the command line")
    if args.num_experts is not None:
        raise ConfigError(f"--num-experts ({args.num_experts}): mixture-of-experts models are not implemented "
                          f"yet; drop --num-experts to train a dense model")
    named = get_model_config(args.model or DEFAULT_MODEL)
    seq_length = args.seq_length if args.seq_length is not None else named.pop("seq_length", 1024)
    named.pop("seq_length", None)
    overrides = {k: getattr(args, k) for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "max_position_embeddings", "rotary_base", "norm_epsilon", "attention_dropout", "hidden_dropout",
        "init_method_std", "make_vocab_size_divisible_by", "position_embedding_type", "normalization")
        if getattr(args, k) is not None}
    if args.group_query_attention and args.num_query_groups is not None:
        overrides["num_query_groups"] = args.num_query_groups
    if args.attention_backend != "auto":
        overrides["attention_backend"] = args.attention_backend
    if args.swiglu:
        overrides["swiglu"] = True
    if args.openai_gelu:
        overrides["activation"] = "gelu_tanh"
    if args.disable_bias_linear:
        overrides["add_bias_linear"] = False
    if args.add_qkv_bias:
        overrides["add_qkv_bias"] = True
    if args.untie_embeddings_and_output_weights:
        overrides["untie_embeddings_and_output_weights"] = True
    shape_changed = any(k in overrides for k in ("hidden_size", "num_attention_heads", "swiglu"))
    if shape_changed:  # derived sizes follow the new shape unless given explicitly
        for k in ("kv_channels", "ffn_hidden_size"):
            if k not in overrides:
                named.pop(k, None)
        if "num_attention_heads" in overrides and "num_query_groups" not in overrides:
            named.pop("num_query_groups", None)
    model = ModelConfig(**{**named, **overrides})

    vpp = args.virtual_pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.num_layers_per_virtual_pipeline_stage < 1:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage}) "
                              f"must be >= 1")
        per_pp = model.num_layers // max(1, args.pipeline_model_parallel_size)
        if per_pp % args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                f"layers per pipeline stage ({per_pp}) must be divisible by --num-layers-per-virtual-pipeline-stage "
                f"({args.num_layers_per_virtual_pipeline_stage})")
        vpp = per_pp // args.num_layers_per_virtual_pipeline_stage
    zero = args.zero_stage if args.zero_stage is not None else (1 if args.use_distributed_optimizer else 0)
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_schedule=args.pipeline_schedule, sequence_parallel=args.sequence_parallel, zero_stage=zero,
        ddp_bucket_size=args.ddp_bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        cp_comm_type=args.cp_comm_type)

    tdef = dict(_TRAINING_DEFAULTS)
    given = {k: getattr(args, k) for k in ("micro_batch_size", "train_iters", "lr", "min_lr", "eval_interval",
                                           "eval_iters", "log_interval") if getattr(args, k) is not None}
    if "lr" in given and "min_lr" not in given:
        tdef["min_lr"] = 0.0  # Megatron's default when only --lr is given
    tdef.update(given)
    training = TrainingConfig(
        **tdef, global_batch_size=args.global_batch_size, seq_length=seq_length,
        lr_warmup_iters=args.lr_warmup_iters if args.lr_warmup_iters is not None else 0, lr_warmup_fraction=args.lr_warmup_fraction,
        lr_decay_iters=args.lr_decay_iters, lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        seed=args.seed, recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, device=args.device, metrics_file=args.metrics_file,
        log_comm_volume=args.log_comm_volume, tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        save=args.save, load=args.load, save_interval=args.save_interval, async_save=args.async_save,
        keep_last=args.keep_last, finetune=args.finetune, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, verify_checkpoint=args.verify_checkpoint, exit_signal_handler=args.exit_signal_handler,
        exit_duration_in_mins=args.exit_duration_in_mins, exit_interval=args.exit_interval,
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad)
    if args.model is None and args.lr_warmup_iters is None and args.lr_warmup_fraction is None \
            and args.train_iters is None:
        training.lr_warmup_iters = 20  # the built-in default run

    data = DataConfig(
        data_path=args.data_path if args.data_path is not None else [], split=args.split, data_cache_path=args.data_cache_path,
        mock_data=args.mock_data, tokenizer_type=args.tokenizer_type or ("NullTokenizer" if args.mock_data and
                                                                         args.vocab_size is not None
                                                                         else "ByteTokenizer"),
        tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
        vocab_size=args.vocab_size, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        num_workers=args.num_workers)
    return Config(model=model, parallel=parallel, training=training, data=data)


def parse_args(argv: Optional[List[str]] = None) -> Config:
    return config_from_args(build_parser().parse_args(argv))
