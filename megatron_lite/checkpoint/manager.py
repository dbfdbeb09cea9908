"""The training loop's view of checkpoints: load at start, save on schedule, stop early on demand.

Which checkpoint a run starts from:
- `--save DIR` that already holds a checkpoint: this run's own progress (a job restarted by
  torchrun --max-restarts, or resubmitted after preemption); resume it fully, whatever --load;
- else `--load DIR`: resume it (or only its weights with --finetune / --no-load-optim);
  a --load directory without a checkpoint starts from scratch with a note, as in Megatron-LM
  (an error with --finetune, which exists to load weights).

Non-persistent checkpoints compete with that source, written every --non-persistent-save-interval
iterations at which no --save checkpoint is due: with --non-persistent-ckpt-type local (local.py)
the newest checkpoint complete on every rank is resumed, local or global; with global, the newer
of --non-persistent-global-ckpt-dir's and the source's.

Saves happen every --save-interval iterations, when an exit condition fires, and at the end of
training (unless that iteration was just saved). With --async-save the files are written in the
background; the commit happens at the start of a later iteration once every rank is done (one
tiny all-reduce per iteration while a save is pending) or at the end of training.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Dict, Optional

from ..config import Config
from ..errors import ConfigError, agree_on_errors
from .directory import check_save_dir, has_checkpoint, read_metadata, resolve
from .exit_conditions import ExitConditions
from .faults import fault_hook
from .files import PinnedHostBuffers
from .loader import Loaded, load_checkpoint
from .local import LocalCheckpoints
from .saver import PendingSave, start_save, world_rank
from .state import TrainState


def checkpoint_run_config(tcfg) -> Optional[dict]:
    """--use-checkpoint-args: the metadata of the checkpoint the run starts from (its own --save,
    else --load, else --pretrained-checkpoint: model_config, config), read before any process group exists."""
    if not tcfg.use_checkpoint_args:
        return None
    for path in (tcfg.save, tcfg.load, tcfg.pretrained_checkpoint):
        if has_checkpoint(path):
            ckpt_dir, _ = resolve(path)
            return read_metadata(ckpt_dir, tcfg.verify_checkpoint)
    raise ConfigError("--use-checkpoint-args: none of --save / --load / --pretrained-checkpoint holds a checkpoint")


def inherit_global_batch_size(tcfg) -> Optional[int]:
    """Elastic restarts: a run that resumes its own --save checkpoint without --global-batch-size
    keeps the checkpoint's global batch (not micro-batch x the new DP size), so that a restart on
    fewer or more ranks continues the same run. Returns it when inherited (before validation)."""
    if tcfg.global_batch_size is not None or not has_checkpoint(tcfg.save):
        return None
    ckpt_dir, _ = resolve(tcfg.save)
    saved = read_metadata(ckpt_dir, tcfg.verify_checkpoint)["config"]["training"].get("global_batch_size")
    tcfg.global_batch_size = saved
    return saved


def expected_checkpoint_bytes(cfg: Config) -> int:
    """About the size of one checkpoint: params in their dtype, Adam's m and v, fp32 main params
    when the params are bf16/fp16."""
    t = cfg.training
    per_param = (2 + 4 if t.bf16 or t.fp16 else 4) + 8
    return cfg.model.num_parameters() * per_param


def non_persistent_global_dir(tcfg) -> Optional[str]:
    """Where --non-persistent-ckpt-type global writes: the given directory, else --save/non_persistent
    (Megatron-LM's default); None for other types."""
    if tcfg.non_persistent_ckpt_type != "global":
        return None
    return tcfg.non_persistent_global_ckpt_dir or os.path.join(tcfg.save, "non_persistent")


class Checkpointing:
    def __init__(self, cfg: Config, device):
        self.tcfg, self.device = cfg.training, device
        if self.tcfg.save:
            agree_on_errors(lambda: check_save_dir(self.tcfg.save, expected_checkpoint_bytes(cfg), world_rank()),
                            device)
        self.pending: Optional[PendingSave] = None
        self.host_buffers = PinnedHostBuffers()  # --async-save's staging memory, kept from one save to the next
        self.last_saved: Optional[int] = None
        self.exit = ExitConditions(self.tcfg, device)
        self.blocked_s: Dict[int, float] = {}  # per iteration: time the loop spent here (benchmarks)
        self.write_s: Dict[int, float] = {}  # per saved iteration: time writing this rank's file took
        self.checksum_s: Dict[int, float] = {}  # ... of which computing its checksums
        self.load_s = 0.0
        self.fault = fault_hook(world_rank())  # crash tests only (MEGATRON_LITE_FAULT); else None
        self.keep_last = self.tcfg.keep_last  # of the pending save's directory
        self.local: Optional[LocalCheckpoints] = None
        if self.tcfg.non_persistent_ckpt_type == "local":
            self.local = LocalCheckpoints(self.tcfg.non_persistent_local_ckpt_dir, device, self.fault)
            self.local.check_dir()
        self.np_global = non_persistent_global_dir(self.tcfg)
        if self.np_global:
            agree_on_errors(lambda: check_save_dir(self.np_global, 0, world_rank(), "--non-persistent-global-ckpt-dir"),
                            device)
        self.local_write_s: Dict[int, float] = {}  # per local save: this rank's time writing it
        self.local_checksum_s: Dict[int, float] = {}  # ... of which computing its checksums

    @contextmanager
    def _timed(self, iteration: int):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s[iteration] = self.blocked_s.get(iteration, 0.0) + time.perf_counter() - start

    def load_at_start(self, state: TrainState) -> Optional[Loaded]:
        start = time.perf_counter()
        loaded = self._load(state)
        self.load_s = time.perf_counter() - start
        return loaded

    def _source(self) -> Optional[str]:
        """'save' (resume this run), 'load', 'pretrained' or None (train from scratch)."""
        t = self.tcfg
        if has_checkpoint(t.save):
            return "save"
        if t.load and has_checkpoint(t.load):
            return "load"
        if t.load and t.finetune:
            raise ConfigError(f"--finetune: no checkpoint in --load {t.load}")
        if t.pretrained_checkpoint:
            if not has_checkpoint(t.pretrained_checkpoint):
                raise ConfigError(f"--pretrained-checkpoint {t.pretrained_checkpoint} holds no checkpoint")
            return "pretrained"
        return None

    def _resumed_iteration(self, source: Optional[str]) -> int:
        """The iteration a load of the global `source` starts training at."""
        t = self.tcfg
        if source == "save" or (source == "load" and not t.finetune):
            return resolve(t.save if source == "save" else t.load)[1]
        return 0

    def _load(self, state: TrainState) -> Optional[Loaded]:
        t = self.tcfg
        source = agree_on_errors(self._source, self.device)
        if self.np_global is None and self.local is None:
            return self._load_global(state, source)
        resumed = agree_on_errors(lambda: self._resumed_iteration(source), self.device)
        if self.np_global is not None:
            newest = agree_on_errors(lambda: resolve(self.np_global)[1] if has_checkpoint(self.np_global) else -1,
                                     self.device)
            if newest > resumed:  # layout-independent, as --save's
                return load_checkpoint(state, self.np_global, load_rng=not t.no_load_rng, verify=t.verify_checkpoint)
        else:
            newest = self.local.newest_common(t.verify_checkpoint)
            if newest is not None and newest > resumed:
                self.local.check_layout(state, newest, t.verify_checkpoint)
                try:
                    return self.local.load(state, newest, load_rng=not t.no_load_rng, verify=t.verify_checkpoint)
                except ConfigError as e:  # a damaged file: the global checkpoint overwrites all that was filled
                    if source is None:
                        raise
                    if world_rank() == 0:
                        print(f"> local checkpoint iteration {newest} cannot be loaded ({e}): loading the global "
                              f"checkpoint instead", flush=True)
            elif newest is None and self.local.holds_any() and world_rank() == 0:
                print(f"> no local checkpoint in {t.non_persistent_local_ckpt_dir} is complete on every rank",
                      flush=True)
        return self._load_global(state, source)

    def _load_global(self, state: TrainState, source: Optional[str]) -> Optional[Loaded]:
        t = self.tcfg
        if source == "save":
            loaded = load_checkpoint(state, t.save, load_rng=not t.no_load_rng, verify=t.verify_checkpoint)
        elif source == "load":
            loaded = load_checkpoint(state, t.load, load_optim=not t.no_load_optim, load_rng=not t.no_load_rng,
                                     finetune=t.finetune, verify=t.verify_checkpoint)
        elif source == "pretrained":
            loaded = load_checkpoint(state, t.pretrained_checkpoint, finetune=True, verify=t.verify_checkpoint)
        else:
            if t.load and world_rank() == 0:
                print(f"> no checkpoint in --load {t.load}: training from scratch", flush=True)
            return None
        self.last_saved = state.value("iteration")
        return loaded

    def poll(self) -> None:
        """At the start of an iteration: commit a background save that every rank finished."""
        if self.pending is not None:
            with self._timed(self.pending.iteration):
                if self.pending.ready():
                    self._commit()

    def after_iteration(self, state: TrainState) -> bool:
        """Save if due; True when the run must stop now (after saving)."""
        iteration = state.value("iteration")
        if self.fault is not None:
            self.fault("iteration", iteration)
        reason = self.exit.check(iteration)
        t = self.tcfg
        if t.save and (reason or (t.save_interval and iteration % t.save_interval == 0)):
            with self._timed(iteration):
                self.save(state, background=t.async_save and reason is None)
        elif t.non_persistent_save_interval and iteration % t.non_persistent_save_interval == 0:
            with self._timed(iteration):
                if self.local is not None:
                    self.local_write_s[iteration], self.local_checksum_s[iteration] = self.local.save(state)
                else:
                    self.save(state, background=t.async_save, non_persistent=True)
        if reason and world_rank() == 0:
            print(f"> exiting after iteration {iteration}: {reason}", flush=True)
        return reason is not None

    def save(self, state: TrainState, background: bool = False, non_persistent: bool = False) -> None:
        """A global checkpoint into --save; `non_persistent`: into the non-persistent global directory,
        only the newest kept (not counted as saved: the end of training still saves into --save)."""
        self.finish()  # one save at a time
        root, self.keep_last = (self.np_global, 1) if non_persistent else (self.tcfg.save, self.tcfg.keep_last)
        self.pending = start_save(state, root, background, self.fault, self.host_buffers)
        if not non_persistent:
            self.last_saved = self.pending.iteration
        if not background:
            self.finish()

    def finish(self) -> None:
        """Wait for the pending save, if any, and commit it."""
        if self.pending is None:
            return
        if self.pending.thread is not None:
            self.pending.thread.join()
        self.pending.ready()  # every rank done (raises if one failed)
        self._commit()

    def _commit(self) -> None:
        self.pending.commit(self.keep_last)
        self.write_s[self.pending.iteration] = self.pending.write_s
        self.checksum_s[self.pending.iteration] = self.pending.checksum_s
        self.pending = None

    def at_end(self, state: TrainState) -> None:
        """End of training: save the final state (Megatron-LM does when --save is given), commit."""
        iteration = state.value("iteration")
        with self._timed(iteration):
            if self.tcfg.save and iteration > 0 and self.last_saved != iteration:
                self.save(state)
            self.finish()
        self.exit.close()
