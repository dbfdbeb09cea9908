"""The pretraining loop: build everything from a validated Config, then train, evaluate, log."""
from __future__ import annotations

import resource
import sys
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..checkpoint.manager import Checkpointing
from ..checkpoint.state import TrainState
from ..config import Config
from ..errors import NonFiniteError, agree_on_errors
from ..optim.lr_scheduler import DEFAULT_GROUP
from ..parallel.random import RNGStatesTracker, model_parallel_seed
from ..parallel.state import ParallelDims
from .flops import device_peak_tflops, flops_per_token
from .metrics import MetricsLogger
from .features import build_features
from .profiling import HostSyncCounter, empty_unused_memory
from ..parallel.context_parallel import split_batch_for_cp
from ..parallel.pipeline.executor import PipelineExecutor
from ..parallel.pipeline.schedules import ZERO_BUBBLE, default_schedule
from ..optim.adam import fused_adamw_available
from ..transformer.core_attention import describe_attention
from ..transformer.fast_paths import describe_fast_paths
from ..transformer.loss_normalization import LossNormalization
from ..transformer.spec import BuildContext
from .step import eval_step, forward_backward_no_pipelining, move_batch, pipelined_forward_backward, train_step


SLOW_PHASE_S = 5.0  # a start-up phase (data, model build, checkpoint load, first step) slower than this says so


def _phase_done(name: str, since: float) -> float:
    """Ends a start-up phase begun at `since`: when it was slow, one line with its time on rank 0, so
    that a slow start shows where it is. Returns the time now (the next phase's start)."""
    now = time.perf_counter()
    if now - since > SLOW_PHASE_S and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> start-up: {name} took {now - since:.1f} s", flush=True)
    return now


def params_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32


class Trainer:
    """Holds the model chunks, optimizer, data and logging of one run (one per process).

    The model and its data come from the entry point (pretrain_gpt.py passes GPT's):
      model_provider(cfg, ctx: BuildContext) -> this rank's model chunks (one per virtual pipeline
          stage), initialized on ctx.device, or with parameters still on the meta device that the
          optimizer's gradient buffers materialize in place (parallel/tiled_init.py); chunks may
          offer sharding_units() (ZeRO-3) and must offer set_input_tensor(x) and
          pipeline_input_spec(batch) (pipeline stages after the first: parallel/pipeline/executor.py);
          it puts its step hooks in ctx.hooks, and reads ctx.loss_normalization;
      datasets_provider(cfg, tokenizer, num_samples: (train, valid, test)) -> three datasets (or None);
      forward_step(batch, chunk) -> (output, loss_func): the protocol of training/step.py."""

    def __init__(self, cfg: Config, tokenizer, device: torch.device, *, model_provider: Callable,
                 datasets_provider: Callable, forward_step: Callable, checkpoint_formats: tuple = ()):
        from ..optim.optimizer import build_optimizer

        self.cfg, self.device, self.forward_step, self.checkpoint_formats = cfg, device, forward_step, checkpoint_formats
        p, t = cfg.parallel, cfg.training
        self.dims = dims = ParallelDims.from_world(
            tp=p.tp, pp=p.pp, cp=p.cp, ep=p.expert_model_parallel_size, vpp=p.vpp, pp_placement=p.pp_placement,
            cp_a2a=p.cp_a2a_size(), etp=p.expert_tensor_parallel_size,
            timeout=timedelta(minutes=t.distributed_timeout_minutes))
        self.tracker = RNGStatesTracker(device)
        model_parallel_seed(self.tracker, t.seed, dims.tp_rank, dims.pp_rank)
        schedule = (p.pipeline_schedule or default_schedule(dims.vpp)) if dims.pp > 1 else None
        self.features = build_features(t, cfg.model, dims, device, schedule in ZERO_BUBBLE, params_dtype(cfg))
        ctx = self._build_context()
        self.gemm = ctx.gemm
        clock = time.perf_counter()
        self.chunks = model_provider(cfg, ctx)  # fills ctx.hooks with the model's step hooks
        self.loss_normalization, self.hooks = ctx.loss_normalization, ctx.hooks
        self.features.model_built(self)
        self.optimizer, self.grad_sync = build_optimizer(self.chunks, dims, t, p, t.optimizer_precision(),
                                                         p.num_distributed_optimizer_instances)
        clock = _phase_done("model build", clock)
        self.lr_schedule = t.param_scheduler()  # counts samples, as Megatron-LM's
        self.batch_schedule = t.batch_schedule(dims.dp)  # the global batch of each step (ramp-up)
        self.num_microbatches = t.num_microbatches(dims.dp)  # at the full global batch: evaluation
        self.forward_backward = forward_backward_no_pipelining
        if dims.pp > 1:
            executor = PipelineExecutor(self.chunks, dims, schedule, device, self.gemm,
                                        overlap=p.overlap_moe_expert_parallel_comm)
            self.forward_backward = pipelined_forward_backward(executor)
        train_ds, valid_ds = self._datasets(datasets_provider, tokenizer)
        self.iteration, self.consumed_samples, self.consumed_valid_samples = 0, 0, 0
        self._register_state()
        self.logs_here = dims.is_last_stage and dims.tp_rank == 0 and dims.dp_rank == 0 and dims.cp_rank == 0
        self.checkpointing = Checkpointing(cfg, device)
        self.features.attached(self)  # before a checkpoint loads: what features keep in it is registered
        clock = time.perf_counter()
        loaded = self.checkpointing.load_at_start(self.state)  # sets the iteration and consumed samples
        _phase_done("checkpoint load", clock)
        self._data_iterators(train_ds, valid_ds)
        if loaded is not None:  # last: creating the data iterators above draws from the RNG
            loaded.restore_rng(self.state)
        # A resumed run appends to its metrics file, so that a restarted job keeps the earlier records.
        self.logger = MetricsLogger(t, self.logs_here, cfg.to_dict(), start_iteration=self.iteration)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_length)  # active parameters of an MoE model
        self.peak_tflops = device_peak_tflops(device)
        self.host_syncs = HostSyncCounter(device)

    def _build_context(self) -> BuildContext:
        """What every layer is built with besides the model config; features fill their fields."""
        p, t = self.cfg.parallel, self.cfg.training
        return BuildContext(self.dims, sequence_parallel=p.sequence_parallel, params_dtype=params_dtype(self.cfg),
                            tracker=self.tracker, recompute_granularity=t.recompute_granularity,
                            recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
                            recompute_modules=tuple(t.recompute_modules or ("core_attn",)), device=self.device,
                            cp_comm_type=[c.replace("allgather", "all_gather") for c in p.cp_comm_type],
                            compile=t.compile, cross_entropy_chunk_size=t.cross_entropy_chunk_size,
                            **self.features.context())

    def _datasets(self, datasets_provider: Callable, tokenizer):
        """(train, valid) datasets sized for the run's samples (every rank agrees on an error)."""
        t = self.cfg.training
        evals = t.train_iters // t.eval_interval + 1
        train_samples = t.train_samples if t.train_samples is not None else self.batch_schedule.samples(t.train_iters)
        num_samples = (train_samples, evals * t.eval_iters * t.global_batch_size, t.eval_iters * t.global_batch_size)
        clock = time.perf_counter()
        train_ds, valid_ds, _ = agree_on_errors(lambda: datasets_provider(self.cfg, tokenizer, num_samples), self.device)
        _phase_done("data", clock)
        return train_ds, valid_ds

    def _register_state(self) -> None:
        """What checkpoints hold besides the model, the optimizer and the RNG states (TrainState)."""
        self.state = TrainState(self.cfg, self.dims, self.device, self.chunks, self.optimizer, self.tracker,
                                formats=self.checkpoint_formats)  # (and the foreign formats a load may read)
        for name in ("iteration", "consumed_samples", "consumed_valid_samples"):  # the data position
            self.state.register_attribute(self, name)
        self.state.register("lr_scheduler", self.lr_schedule.state_dict, progress=self.lr_schedule.resume,
                            optimizer=self.lr_schedule.changes_note)  # the position; notes on changed flags
        self.state.register("optimizer", self.optimizer.scalar_state, optimizer=self.optimizer.load_scalar_state)

    def _data_iterators(self, train_ds, valid_ds) -> None:
        from ..data import build_pretraining_data_loader

        t, dims, workers = self.cfg.training, self.dims, self.cfg.data.num_workers
        self.train_loader = build_pretraining_data_loader(train_ds, self.consumed_samples, t.micro_batch_size,
                                                          self.batch_schedule.running_global_batch_size,
                                                          dims.dp_rank, dims.dp, workers)
        self.train_iter = iter(self.train_loader)
        self.valid_iter = None
        if valid_ds is not None and t.eval_iters > 0:
            self.valid_iter = iter(build_pretraining_data_loader(
                valid_ds, self.consumed_valid_samples, t.micro_batch_size, t.global_batch_size, dims.dp_rank, dims.dp,
                workers))

    def _next_batches(self, it, num_microbatches: int) -> List[Dict[str, torch.Tensor]]:
        """This rank's micro-batches: under context parallelism, its zigzag chunks of each sample."""
        batches = [move_batch(next(it), self.device) for _ in range(num_microbatches)]
        if self.dims.cp > 1:
            batches = [split_batch_for_cp(b, self.dims.cp, self.dims.cp_rank)[0] for b in batches]
        return batches

    def evaluate(self) -> Optional[float]:
        losses = []
        for _ in range(self.cfg.training.eval_iters):
            loss = eval_step(self.chunks, self._next_batches(self.valid_iter, self.num_microbatches), self.dims,
                             self.forward_step, self.forward_backward)
            empty_unused_memory(self.cfg.training.empty_unused_memory_level, "eval_step")
            losses.append(loss)
        return None if losses[0] is None else sum(losses) / len(losses)

    def train(self) -> List[dict]:
        t, dims = self.cfg.training, self.dims
        history = []
        if self.iteration >= t.train_iters > 0 or self.iteration > t.train_iters:  # a rerun of a finished job
            self.logger.info(f"> the run is finished: iteration {self.iteration} of {t.train_iters} already done (the "
                             f"checkpoint loaded); give a larger --train-iters or --train-samples to train on")
        mem = self.optimizer.memory_bytes()
        self.logger.info(
            f"> model: {self._parameters_line()} | layout tp={dims.tp} pp={dims.pp} "
            f"vpp={dims.vpp} cp={dims.cp} dp={dims.dp}{self._expert_layout()} | zero stage {self.cfg.parallel.zero_stage} | "
            f"micro-batches/step {self.num_microbatches} | device {self.device} | attention "
            + describe_attention(self.cfg.model.attention_backend, self.device, params_dtype(self.cfg), dims.cp,
                                 self.cfg.parallel.cp_comm_type))
        self.logger.info("> fast paths: " + describe_fast_paths(
            device=self.device, params_dtype=params_dtype(self.cfg), compile=t.compile,
            chunk_setting=t.cross_entropy_chunk_size, vocab_per_rank=self.cfg.model.padded_vocab_size(dims.tp) // dims.tp,
            normalization=self.cfg.model.normalization, fused_adamw=fused_adamw_available(self.device.type)))
        self.logger.info("> memory on this rank: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()))
        offloads = (self.optimizer.placement.describe(), self.grad_sync.param_home.describe())
        for line in [line for line in offloads if line] + self.features.start_lines():
            self.logger.info(f"> {line}")
        first = self.iteration == 0  # a fresh run's first record holds this rank's memory
        self.features.train_started()
        try:
            while self.iteration < t.train_iters:
                clock = time.perf_counter()
                rec = self._train_iteration(mem if first else None)
                if not history:
                    _phase_done("first step", clock)
                first = False
                history.append(rec)
                self.logger.log(rec, console=self.iteration % t.log_interval == 0
                                or self.iteration in (1, t.train_iters))
                if self.checkpointing.after_iteration(self.state):  # saves when due; True: an exit condition fired
                    break
        finally:
            self.features.close()
        self.features.train_finished()
        self.checkpointing.at_end(self.state)
        self.grad_sync.wait_param_gather()  # --overlap-param-gather: the last step's params
        self.logger.close()
        return history

    def _train_iteration(self, mem: Optional[dict]) -> dict:
        """One step at the global batch the samples consumed so far call for, and its record."""
        t, dims = self.cfg.training, self.dims
        self.checkpointing.poll()  # commit a background save every rank has finished
        self.iteration += 1
        self.features.step_started(self.iteration)
        gbs = self.batch_schedule.running_global_batch_size(self.consumed_samples)
        num_microbatches = gbs // (t.micro_batch_size * dims.dp)
        tokens_per_step = gbs * t.seq_length
        lrs, weight_decay = self.lr_schedule.lrs(), self.lr_schedule.weight_decay()
        start, blocked = time.perf_counter(), dims.comm.blocked_s
        batches = self._next_batches(self.train_iter, num_microbatches)
        fetched = backward = time.perf_counter()
        norm = LossNormalization(t.calculate_per_token_loss, num_microbatches, self.optimizer.loss_scale,
                                 float(tokens_per_step), dims)  # the weight of every loss of the step
        self.hooks.before_step(self.iteration)
        lrs_used, norm = self.hooks.step_settings(lrs, norm, DEFAULT_GROUP)  # DSA's warm-up: the indexer alone
        self.loss_normalization.current = norm  # ... the model's own (MoE's auxiliary losses) included
        level = t.empty_unused_memory_level

        def after_backward():
            nonlocal backward
            empty_unused_memory(level, "forward_backward")
            backward = time.perf_counter()  # the gradients are reduced: the optimizer's part starts

        try:
            with self.host_syncs.step(self.iteration):
                out = train_step(self.chunks, batches, dims, self.optimizer, self.grad_sync, lrs_used, self.forward_step,
                                 self.forward_backward, loss_normalization=norm, weight_decay=weight_decay,
                                 after_backward=after_backward)
        except NonFiniteError as e:  # raised on every rank at once: stop before any save
            self._stop_on_nonfinite(e)
        empty_unused_memory(level, "optimizer")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        self.features.step_ended(self.iteration, dict(data=fetched - start, fwd_bwd=backward - fetched,
                                                      optimizer=start + step_time - backward,
                                                      blocked=dims.comm.blocked_s - blocked))
        if out["update_successful"]:
            self.lr_schedule.step(gbs)  # the schedule advances by the samples of the update
            self.hooks.after_update()
        self.consumed_samples += gbs
        model_metrics = self.hooks.metrics()  # collective
        rec = self._record(out, lrs[DEFAULT_GROUP], step_time, tokens_per_step, gbs, mem, model_metrics)
        for line in self.features.record(self.iteration, rec):  # (collectives: every rank calls it)
            self.logger.info(line)
        if self.valid_iter is not None and (self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters):
            rec["val_lm_loss"] = self.evaluate()
            self.consumed_valid_samples += t.eval_iters * t.global_batch_size
            if self.logs_here:
                self.logger.info(f"> validation at iteration {self.iteration} | lm loss: {rec['val_lm_loss']:.6E}")
        return rec

    def _stop_on_nonfinite(self, error: NonFiniteError) -> None:
        """Finish a background save of an earlier (finite) iteration, then stop with one line."""
        self.checkpointing.finish()
        self.checkpointing.exit.close()
        kept = self.checkpointing.last_saved
        raise NonFiniteError(
            f"iteration {self.iteration}: {error}; stopping"
            + (f" (the last checkpoint, iteration {kept}, is kept)" if kept else "")
            + ". Lower --lr (or --clip-grad), or pass --no-check-for-nan-in-loss-and-grad to train on anyway") from error

    def _parameters_line(self) -> str:
        m = self.cfg.model
        line = f"{m.num_parameters() / 1e6:.2f}M parameters"
        return line + (f" ({m.num_parameters(active=True) / 1e6:.2f}M active)" if m.moe is not None else "")

    def _expert_layout(self) -> str:
        return f" ep={self.dims.ep} etp={self.dims.etp}" if self.cfg.model.moe is not None else ""

    def _record(self, out: dict, lr: float, step_time: float, tokens: int, global_batch_size: int,
                mem: Optional[dict], model_metrics: dict) -> dict:
        tokens_per_sec = tokens / step_time
        tflops = self.flops_per_token * tokens_per_sec / self.dims.world_size / 1e12
        rec = {"iteration": self.iteration, "lm_loss": out["lm_loss"], "grad_norm": out["grad_norm"], "lr": lr,
               "tokens_per_sec": tokens_per_sec, "step_time_s": step_time, "tflops_per_gpu": tflops,
               "consumed_samples": self.consumed_samples, "global_batch_size": global_batch_size,
               "skipped": not out["update_successful"]}
        rec.update(out["logs"])  # the loss function's own losses (multi-token prediction's mtp_loss)
        if self.cfg.training.fp16:
            rec["loss_scale"] = out["loss_scale"]
        if self.peak_tflops:
            rec["mfu"] = tflops / self.peak_tflops
        if self.device.type == "cuda":
            rec["max_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:  # peak resident memory of this process (KiB on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rec["max_memory_gb"] = rss / (2**30 if sys.platform == "darwin" else 2**20)
        if mem is not None:
            rec.update(mem)
        rec.update(self.host_syncs.fields())
        rec.update(model_metrics)  # from the model's step hooks (MoE: router statistics)
        return rec
