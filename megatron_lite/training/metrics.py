"""Where training metrics go: console lines (Megatron style), a JSON Lines file, and optionally
TensorBoard and Weights & Biases. Only the rank that holds the loss writes."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Dict, Optional

from ..config import TrainingConfig


def _console_line(rec: dict, train_iters: int) -> str:
    parts = [f"iteration {rec['iteration']:>6}/{train_iters}"]
    fmt = [("consumed_samples", "consumed samples", "{:d}"), ("step_time_s", "elapsed time per iteration (ms)", None),
           ("lr", "learning rate", "{:.3E}"), ("global_batch_size", "global batch size", "{:d}"),
           ("lm_loss", "lm loss", "{:.6E}"), ("mtp_loss", "mtp loss", "{:.6E}"), ("loss_scale", "loss scale", "{:.1f}"),
           ("grad_norm", "grad norm", "{:.3f}"), ("moe_aux_loss", "moe aux loss", "{:.4E}"),
           ("moe_z_loss", "moe z loss", "{:.4E}"), ("moe_load_imbalance", "moe max load", "{:.2f}"),
           ("dsa_indexer_loss", "indexer loss", "{:.4E}"),
           ("tokens_per_sec", "tokens/s", "{:.0f}"), ("tflops_per_gpu", "TFLOP/s/GPU", "{:.2f}"),
           ("mfu", "MFU", "{:.1%}"), ("max_memory_gb", "max mem (GB)", "{:.2f}")]
    for key, label, f in fmt:
        if key not in rec or rec[key] is None:
            continue
        if key == "step_time_s":
            parts.append(f"{label}: {rec[key] * 1000:.1f}")
        else:
            parts.append(f"{label}: {f.format(rec[key])}")
    if rec.get("skipped"):
        parts.append("skipped iterations: 1")
    return " | ".join(parts) + " |"


# Megatron-LM's TensorBoard / wandb names of our record's keys (training.py training_log, evaluate), and
# whether it also writes a "<name> vs samples" series (x: consumed samples); other keys keep ours.
MEGATRON_TAGS = {"lm_loss": ("lm loss", True), "lr": ("learning-rate", True), "global_batch_size": ("batch-size", True),
                 "loss_scale": ("loss-scale", True), "grad_norm": ("grad-norm", True),
                 "val_lm_loss": ("lm loss validation", True), "step_time_s": ("iteration-time", False),
                 "tflops_per_gpu": ("throughput", False), "consumed_samples": ("samples vs steps", False)}


class MetricsLogger:
    def __init__(self, tcfg: TrainingConfig, enabled: bool, config_dict: Optional[dict] = None, start_iteration: int = 0):
        self.tcfg, self.enabled = tcfg, enabled
        self.file = None
        self.tb = None
        self.wandb = None
        self._window = []  # losses since the last console line
        if not enabled:
            return
        if tcfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(tcfg.metrics_file)), exist_ok=True)
            self.file = open(tcfg.metrics_file, "a" if start_iteration > 0 else "w")
        if tcfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional extra, imported on demand
            self.tb = SummaryWriter(log_dir=tcfg.tensorboard_dir)
            for section in (config_dict or {}).values():  # the run's arguments, as Megatron-LM writes them
                for name, value in section.items():
                    self.tb.add_text(name, str(value), global_step=start_iteration)
        if tcfg.wandb_project:
            self.wandb = _start_wandb(tcfg, config_dict)

    def log(self, rec: Dict, console: bool) -> None:
        if not self.enabled:
            return
        if self.file:  # strict JSON: a skipped step's NaN grad norm is written as null
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
            self.file.write(json.dumps(clean, allow_nan=False) + "\n")
            self.file.flush()
        if rec.get("lm_loss") is not None and not rec.get("skipped"):
            self._window.append(rec["lm_loss"])
        if console:  # like Megatron-LM: the loss averaged over the iterations since the last line
            shown = dict(rec)
            if self._window:
                shown["lm_loss"] = sum(self._window) / len(self._window)
            self._window = []
            print(_console_line(shown, self.tcfg.train_iters), flush=True)
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "iteration"}
        for layer, stats in rec.get("moe_layers", {}).items():  # per MoE layer, e.g. moe/layer_3/max_load
            scalars.update({f"moe/layer_{layer}/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        if self.tb:
            for k, v in scalars.items():
                tag, vs_samples = MEGATRON_TAGS.get(k, (k, False))
                self.tb.add_scalar(tag, v, rec["iteration"])
                if vs_samples:
                    self.tb.add_scalar(f"{tag} vs samples", v, rec["consumed_samples"])
            self.tb.flush()
        if self.wandb:
            try:
                self.wandb.log({MEGATRON_TAGS.get(k, (k,))[0]: v for k, v in scalars.items()}, step=rec["iteration"])
            except Exception as e:  # logging must never fail a run
                print(f"warning: wandb logging failed ({e}); continuing without it", file=sys.stderr)
                self.wandb = None

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            try:
                self.wandb.finish()
            except Exception:
                pass


def _start_wandb(tcfg: TrainingConfig, config_dict: Optional[dict]):
    """A wandb run, offline when there is no API key; None (with a warning) if it cannot start."""
    try:
        import wandb  # optional extra
    except ImportError:
        print("warning: --wandb-project given but wandb is not installed (pip install megatron-lite[logging]); "
              "continuing without it", file=sys.stderr)
        return None
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        has_key = bool(os.environ.get("WANDB_API_KEY")) or os.path.exists(os.path.expanduser("~/.netrc"))
        mode = "online" if has_key else "offline"
    # Megatron-LM's directory: --wandb-save-dir, else <--save>/wandb (here ./wandb without --save)
    save_dir = tcfg.wandb_save_dir or os.path.join(tcfg.save or os.getcwd(), "wandb")
    os.makedirs(save_dir, exist_ok=True)
    try:
        run = wandb.init(project=tcfg.wandb_project, name=tcfg.wandb_exp_name, dir=save_dir, mode=mode,
                         config=config_dict, settings=wandb.Settings(init_timeout=30, silent=True))
    except Exception as e:
        print(f"warning: could not start wandb ({e}); continuing without it", file=sys.stderr)
        return None
    run_dir = os.path.dirname(run.dir)  # run.dir is the run's files/ folder
    print(f"> wandb: run {tcfg.wandb_exp_name} of project {tcfg.wandb_project}, {mode}, in {run_dir}"
          + (f" (upload it with: wandb sync {run_dir})" if mode == "offline" else ""), flush=True)
    return run
