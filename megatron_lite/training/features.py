"""What the trainer does besides training: features, built from the flags in `build_features`. The
loop calls each hook below on every feature that has it and names none of them (the model's own
per-step parts go through ModelHooks, transformer/step_hooks.py, the same way):
  context() -> dict               BuildContext fields it fills (the GEMM path, the offloader)
  model_built(trainer)            the chunks exist; before the optimizer is built
  attached(trainer)               the optimizer and TrainState exist; before a checkpoint loads
  start_lines() -> [str]          its start-up lines
  train_started() / close()       around the loop (close: also when it fails)
  step_started(it) / step_ended(it, phases)   around each step; phases: seconds by stragglers.PARTS
  record(it, rec) -> line | None  fields of the step's record (every rank; collectives allowed)
  train_finished()                after the last step, before the final save
Besides those here: StepProfiler (profiling.py), HangWatchdog (watchdog.py), StragglerLog (stragglers.py).
"""
from __future__ import annotations

import functools
import gc
import logging
import os
from typing import List

from ..parallel.comm import CommCounter
from ..parallel.fp8 import Float8GemmPath
from ..parallel.fp8_delayed import register_checkpoint_state
from ..parallel.gemm import GemmPath
from ..parallel.offload import ActivationOffloader
from ..transformer.te_backend import te_context
from .profiling import StepProfiler, default_trace_dir
from .stragglers import StragglerLog
from .watchdog import HangWatchdog

STEP_HOOKS = ("model_built", "attached", "train_started", "step_started", "step_ended", "train_finished", "close")


class Features:
    """Several features as one: `features.<hook>(...)` calls it on each that has it, in order
    (context: the fields merged; start_lines: joined; record: the lines they gave)."""

    def __init__(self, features: list):
        self.features = features
        for hook in STEP_HOOKS:
            setattr(self, hook, functools.partial(self._each, hook))

    def _each(self, hook: str, *args) -> list:
        return [getattr(f, hook)(*args) for f in self.features if hasattr(f, hook)]

    def context(self) -> dict:
        return {k: v for fields in self._each("context") for k, v in fields.items()}

    def start_lines(self) -> List[str]:
        return [line for lines in self._each("start_lines") for line in lines]

    def record(self, iteration: int, rec: dict) -> List[str]:
        return [line for line in self._each("record", iteration, rec) if line]


class Precision:
    """The GEMM path of every weight (bf16 / fp16 / fp32, an FP8 recipe, Transformer Engine): built
    here, bound to the model's weights, its delayed-scaling state stepped and checkpointed."""

    def __init__(self, t, model, dims, device, deferrable: bool, params_dtype):
        self.t, self.model, self.params_dtype = t, model, params_dtype
        self.te = te_context(t, dims) if t.transformer_impl == "transformer_engine" else None
        self.gemm = GemmPath(deferrable) if t.fp8_format is None or self.te is not None else Float8GemmPath(
            dims, t.fp8_format, t.fp8_recipe, t.fp8_margin, deferrable, t.fp8_amax_history_len,
            t.fp8_amax_compute_algo, device)
        self.delayed = getattr(self.gemm, "delayed", None)  # delayed scaling's amax histories

    def context(self) -> dict:
        return {"gemm": self.gemm, "te": self.te}

    def model_built(self, trainer) -> None:
        t = self.t
        if isinstance(self.gemm, Float8GemmPath):  # names the recipe state's GEMMs, marks bf16 layers
            self.gemm.bind(trainer.chunks, (t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16)
                           if t.first_last_layers_bf16 else None, self.model.num_layers)
        if self.delayed is not None:
            trainer.hooks.add(self.delayed)  # folds the amaxes once per step

    def attached(self, trainer) -> None:
        if hasattr(trainer.grad_sync.param_gather, "bind_recipe"):  # --fp8-param-gather: the weight scales
            trainer.grad_sync.param_gather.bind_recipe(self.delayed)
        register_checkpoint_state(trainer.state, self.delayed)

    def start_lines(self) -> List[str]:
        t, lines = self.t, []
        if isinstance(self.gemm, Float8GemmPath):
            lines.append("fp8: " + self.gemm.describe(self.params_dtype, self.model.moe_layers(),
                                                       self.model.multi_latent_attention))
        if self.te is not None:
            lines.append("transformer impl: Transformer Engine's LayerNormLinear / Linear / DotProductAttention"
                         + (f"; fp8: TE {t.fp8_recipe} recipe ({t.fp8_format}); output layer in "
                            f"{self.params_dtype}" if t.fp8_format else ""))
        return lines


class ActivationOffload:
    """--cpu-offloading: the saved activations of the offloaded layers go to host memory (parallel/offload.py)."""

    def __init__(self, device, layers: int):
        fields = {"offloader": ActivationOffloader(device), "offloaded_layers": layers}
        self.context = lambda: fields


class QKClipStep:
    """--qk-clip / --log-max-attention-logit: a model step hook over the optimizer (qk_clip.py)."""

    def __init__(self, t):
        self.t = t

    def attached(self, trainer) -> None:
        from .qk_clip import QKClip
        t = self.t
        trainer.hooks.add(QKClip(trainer.chunks, trainer.dims, trainer.optimizer, t.qk_clip_threshold,
                                 t.qk_clip_alpha, t.qk_clip))


class CommVolume:
    """--log-comm-volume: the bytes each step's collectives moved (the communicator counts them)."""

    def __init__(self, dims):
        self.dims = dims
        dims.comm_counter = CommCounter()

    def step_started(self, iteration: int) -> None:
        self.dims.comm_counter.reset()  # count this step's traffic only

    def record(self, iteration: int, rec: dict) -> None:
        rec["comm_bytes"] = self.dims.comm_counter.reset()


class ManualGC:
    """Megatron's --manual-gc: no automatic collections (and their stalls) mid-step; one every
    --manual-gc-interval steps."""

    def __init__(self, interval: int):
        self.interval = interval

    def train_started(self) -> None:
        gc.disable()
        gc.collect()

    def step_ended(self, iteration: int, phases) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        gc.enable()


def build_features(t, model, dims, device, deferrable: bool, params_dtype) -> Features:
    """The features the flags `t` (TrainingConfig) turn on for `model` (ModelConfig), in the order
    the loop calls them."""
    if t.logging_level is not None:  # --logging-level: Python logging (libraries' messages)
        logging.getLogger().setLevel(t.logging_level)
    profiler = StepProfiler(dims.rank, profile=t.profile, step_start=t.profile_step_start,
                            step_end=t.profile_step_end, ranks=t.profile_ranks,
                            trace_dir=default_trace_dir(t.tensorboard_dir),
                            record_memory_history=t.record_memory_history,
                            memory_snapshot_path=t.memory_snapshot_path, snapshot_interval=t.log_interval,
                            is_last_rank=dims.rank == dims.world_size - 1, device=device)
    wanted = [(True, lambda: Precision(t, model, dims, device, deferrable, params_dtype)),
              (t.cpu_offloading, lambda: ActivationOffload(device, t.cpu_offloading_num_layers)),
              (t.qk_clip or t.log_max_attention_logit, lambda: QKClipStep(t)),
              (t.log_comm_volume, lambda: CommVolume(dims)),
              (True, lambda: profiler),
              (t.hang_detection_factor, lambda: HangWatchdog(  # the dump goes next to the checkpoints
                  t.hang_detection_factor, t.hang_detection_warmup_steps, t.save or os.getcwd(), dims.rank)),
              (t.log_straggler, lambda: StragglerLog(dims, t.straggler_minmax_count, t.log_interval,
                                                     t.train_iters, device)),
              (t.manual_gc, lambda: ManualGC(t.manual_gc_interval))]
    return Features([make() for on, make in wanted if on])
