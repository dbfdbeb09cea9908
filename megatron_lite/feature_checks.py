"""Checks of the newer feature flags that span several config sections (FP8 recipes and layouts,
activation recomputation modules and CPU offloading, 1-bit and 0/1 Adam), kept apart from config.py so that each
stays readable; `Config.validate` calls them with itself (hence no import of config.py here: that would be a
file cycle). One `_require` failure is one `error:` line."""
from __future__ import annotations

import os

from .model_config import _require


def validate_activation_memory(cfg) -> None:
    t, m = cfg.training, cfg.model
    moe = m.moe is not None and bool(m.moe.num_experts)
    for module, present, what in (("moe", moe, "MoE layers (--num-experts)"),
                                  ("moe_act", moe, "MoE layers (--num-experts)"),
                                  ("shared_experts", moe and bool(m.moe.moe_shared_expert_intermediate_size),
                                   "a shared expert (--moe-shared-expert-intermediate-size)"),
                                  ("mla_up_proj", m.multi_latent_attention, "--multi-latent-attention"),
                                  ("linear_attn", m.experimental_attention_variant == "gated_delta_net",
                                   "linear-attention layers (--experimental-attention-variant gated_delta_net)")):
        _require(module not in (t.recompute_modules or ()) or present,
                 f"--recompute-modules {module} needs {what}: drop it from the list")
    if not t.cpu_offloading:
        _require(t.cpu_offloading_num_layers == 0 and not t.cpu_offloading_weights,
                 "--cpu-offloading-num-layers and --cpu-offloading-weights need --cpu-offloading")
        return
    _require(not t.cpu_offloading_weights, "--cpu-offloading-weights is not implemented (weights stay on the "
                                           "device; --optimizer-cpu-offload moves optimizer state): drop it")
    _require(0 <= t.cpu_offloading_num_layers < m.num_layers,
             f"--cpu-offloading-num-layers ({t.cpu_offloading_num_layers}) must lie in [0, {m.num_layers - 1}] "
             f"(fewer than --num-layers, as in Megatron-LM)")
    _require(t.recompute_granularity is None, "--cpu-offloading with --recompute-granularity: activation "
                                              "offloading does not work with recomputation (nor in "
                                              "Megatron-LM): use one of them")

def validate_fp8(cfg) -> None:
    t, p = cfg.training, cfg.parallel
    given = {flag: f"{flag}" + ("" if value is True else f" {value}") for flag, value, default in (
        ("--fp8-recipe", t.fp8_recipe, None), ("--fp8-margin", t.fp8_margin, 0),
        ("--fp8-amax-history-len", t.fp8_amax_history_len, 1),
        ("--fp8-amax-compute-algo", t.fp8_amax_compute_algo, "most_recent"),
        ("--first-last-layers-bf16", t.first_last_layers_bf16, False)) if value != default}
    if t.fp8_format is None:
        _require(not given, f"{next(iter(given.values()), '')} needs --fp8-format e4m3|hybrid")
        return
    _require(t.fp8_margin >= 0, f"--fp8-margin ({t.fp8_margin}) must be >= 0: the scale is fp8 max / amax / "
                                f"2^margin, and a negative margin saturates the largest values")
    _require(t.fp8_recipe != "mxfp8", "--fp8-recipe mxfp8 needs Blackwell (sm100) GPUs and Transformer Engine's "
                                      "MXFP8 kernels: use tensorwise, rowwise, delayed or blockwise")
    _require(t.fp8_amax_history_len >= 1, f"--fp8-amax-history-len ({t.fp8_amax_history_len}) must be >= 1")
    for flag in ("--fp8-amax-history-len", "--fp8-amax-compute-algo"):
        _require(t.fp8_recipe == "delayed" or flag not in given,
                 f"{flag} is delayed scaling's and does nothing with --fp8-recipe {t.fp8_recipe}: drop it")
    most = cfg.model.num_layers // p.pp  # Megatron-LM's bound: the layers of one pipeline stage
    for flag, n in (("--num-layers-at-start-in-bf16", t.num_layers_at_start_in_bf16),
                    ("--num-layers-at-end-in-bf16", t.num_layers_at_end_in_bf16)):
        _require(t.first_last_layers_bf16 or n == 1, f"{flag} needs --first-last-layers-bf16")
        _require(0 <= n <= most, f"{flag} ({n}) must be between 0 and the layers per pipeline stage ({most})")
    if t.fp8_param_gather:  # fp8_param_gather.py
        _require(p.zero_stage > 0, "--fp8-param-gather needs --use-distributed-optimizer or --zero-stage 1|2|3 "
                                   "(at --zero-stage 0 nothing is gathered)")
        _require(not p.zeropp_quantized_weights, "--fp8-param-gather and --zeropp-quantized-weights both "
                                                 "quantize the parameter all-gather: choose one")


def validate_compressed_adam(t, zero_stage: int) -> None:
    """--optimizer adam-1bit / adam-01 and 0/1 Adam's flags (t: the training section)."""
    zero_one = (("--var-freeze-step", t.var_freeze_step, 100000),
                ("--var-update-scaler", t.var_update_scaler, 16),
                ("--local-step-scaler", t.local_step_scaler, 32678),
                ("--local-step-clipper", t.local_step_clipper, 16))
    if t.optimizer != "adam-01":
        changed = [flag for flag, v, default in zero_one if v != default]
        _require(not changed, f"{changed[0] if changed else ''} needs --optimizer adam-01")
    _require(t.optimizer == "adam-1bit" or t.freeze_step == 100000,
             "--freeze-step needs --optimizer adam-1bit (0/1 Adam's is --var-freeze-step)")
    if t.optimizer not in ("adam-1bit", "adam-01"):
        return
    why = {"--var-freeze-step": ": the variance is first set at step 1 (an element without one never moves)"}
    for flag, v, _ in zero_one if t.optimizer == "adam-01" else ():
        _require(v >= 1, f"{flag} ({v}) must be >= 1{why.get(flag, '')}")
    _require(t.optimizer == "adam-01" or t.freeze_step >= 1,
             f"--freeze-step ({t.freeze_step}) must be >= 1: 1-bit Adam freezes the variance of its warm-up steps")
    _require(zero_stage == 0, f"--optimizer {t.optimizer} averages whole momenta over DP (as DeepSpeed's): use "
                              "--zero-stage 0 (no --use-distributed-optimizer)")
    _require(not (t.fp16 or t.use_precision_aware_optimizer or t.optimizer_cpu_offload),
             f"--optimizer {t.optimizer} keeps fp32 state on the device and skips no steps: drop --fp16, "
             "--use-precision-aware-optimizer and --optimizer-cpu-offload")
    _require(t.optimizer != "adam-01" or not t.optimizer_offload_nvme_path,
             "--optimizer adam-01 with --optimizer-offload-nvme-path is not implemented (a checkpoint synchronises "
             "pending local steps into the state, which would not reach the file): drop one of them")


def require_nvme_dir(path: str, flag: str) -> None:
    """An NVMe offload directory: not empty, and it (or its nearest existing parent) writable."""
    _require(path.strip() != "", f"{flag} is empty: give a directory on a fast local disk, or drop the flag")
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip("/")) or "."
    _require(os.path.isdir(existing), f"{flag} {path}: {existing} is not a directory")
    _require(os.access(existing, os.W_OK | os.X_OK), f"{flag} {path} is not writable: give a writable directory")


def validate_param_offload(cfg) -> None:
    """--param-offload-nvme-path (parallel/param_offload.py): ZeRO-3's plain all-gathers read the
    shards from the file; what would keep or change them in memory is refused."""
    t, p, flag = cfg.training, cfg.parallel, "--param-offload-nvme-path"
    if t.param_offload_nvme_path is None:
        return
    require_nvme_dir(t.param_offload_nvme_path, flag)
    _require(p.zero_stage == 3, f"{flag} offloads ZeRO-3's parameter shards: add --zero-stage 3 (stages 0-2 keep "
                                f"full parameters; --optimizer-offload-nvme-path offloads their optimizer state)")
    for other, given in (("--zeropp-quantized-weights", p.zeropp_quantized_weights),
                         ("--zeropp-hpz-partition-size", p.zeropp_hpz_partition_size != 1),
                         ("--fp8-param-gather", t.fp8_param_gather),
                         ("--qk-clip", t.qk_clip)):
        _require(not given, f"{flag} with {other} is not implemented (it gathers or changes the shards "
                            f"in memory): drop one of them")
