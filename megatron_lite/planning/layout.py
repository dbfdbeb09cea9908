"""One candidate layout of a training run, as the planner sees it: the parallel sizes, ZeRO stage,
recomputation, pipeline schedule, batch shape and precision. Pure data; `from_config` reads it
from the same Config the trainer runs (pretrain_gpt.py's flags)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from ..config import Config
from ..parallel.data_parallel import default_bucket_size
from ..parallel.pipeline.partition import LayerSplit
from ..parallel.pipeline.schedules import default_schedule


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    recompute: Optional[str] = None  # None | "selective" | "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: Tuple[str, ...] = ("core_attn",)  # selective: --recompute-modules
    cpu_offloading_num_layers: int = 0  # --cpu-offloading: the first layers' activations wait in host memory
    schedule: Optional[str] = None  # None: 1f1b, or interleaved with vpp > 1 (the trainer's default)
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int = 2048
    params_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype = torch.float32
    bucket_size: Optional[int] = None  # elements; None: Megatron's default for the DP size
    overlap_grad_reduce: bool = False
    grad_reduce_once_per_step: bool = False
    reshard_after_forward: bool = True
    overlap_param_gather: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    optimizer_offload_nvme: bool = False  # --optimizer-offload-nvme-path: the state in a file, two staging buffers
    optimizer: str = "adam"  # --optimizer (bucket_plan.UPDATE_RULES: its states and error feedback)
    grad_comm_dtype: Optional[str] = None  # --grad-comm-dtype: error feedback per bucket
    zeropp_quantized_gradients: bool = False  # qgZ: int4 blocks, error feedback per bucket
    zeropp_qgz_error_feedback: bool = False  # --zeropp-qgz-error-feedback: qgZ keeps an error per bucket
    zeropp_quantized_weights: bool = False  # qwZ: keeps nothing between its gathers
    zeropp_hpz_partition_size: int = 1  # hpZ: a secondary partition of 1/N of the dense buckets
    param_offload_nvme: bool = False  # --param-offload-nvme-path: ZeRO-3's param shards in a file, two staging buffers
    split: LayerSplit = LayerSplit()  # layers per virtual stage when not even
    fp8: Optional[str] = None  # the FP8 recipe of the layers' GEMMs (--fp8-recipe); None: none in FP8
    fp8_param_gather: bool = False  # ZeRO gathers the FP8 GEMMs' weights in FP8

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def pipeline_schedule(self) -> Optional[str]:
        return (self.schedule or default_schedule(self.vpp)) if self.pp > 1 else None

    @property
    def grad_reduce_per_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatter each micro-batch's buckets (unless --grad-reduce-once-per-step)."""
        return self.zero_stage >= 2 and not self.grad_reduce_once_per_step

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs TP > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel size (ParallelDims.edp): the expert grid ETP x EP x EDP folds over TP x CP x DP."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def grad_codec(self) -> Optional[str]:
        """The format gradients are reduced in with error feedback (compression.build_reducer's); None
        where no error is kept (qgZ without --zeropp-qgz-error-feedback)."""
        if self.zeropp_quantized_gradients:
            return "int4-blocks" if self.zeropp_qgz_error_feedback else None
        return self.grad_comm_dtype

    @property
    def buckets(self) -> int:
        return self.bucket_size or default_bucket_size(self.dp * self.cp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.etp > 1:
            parts.append(f"ETP{self.etp}")
        parts += [f"DP{self.dp}", f"ZeRO-{self.zero_stage}"]
        if self.sp:
            parts.append("SP")
        if self.recompute:
            modules = f" ({' '.join(self.recompute_modules)})" if self.recompute == "selective" else ""
            parts.append(f"recompute {self.recompute}{modules}")
        if self.cpu_offloading_num_layers:
            parts.append(f"CPU offload {self.cpu_offloading_num_layers} layers")
        if self.fp8:
            parts.append(f"FP8 {self.fp8}" + (" + FP8 param gather" if self.fp8_param_gather else ""))
        if self.optimizer != "adam":
            parts.append(self.optimizer)
        if self.grad_comm_dtype:
            parts.append(f"grads sent as {self.grad_comm_dtype}")
        hpz = self.zeropp_hpz_partition_size
        qgz = "qgZ + error feedback" if self.zeropp_qgz_error_feedback else "qgZ"
        parts += [name for name, on in ((qgz, self.zeropp_quantized_gradients),
                                        ("qwZ", self.zeropp_quantized_weights), (f"hpZ{hpz}", hpz > 1),
                                        ("optimizer on NVMe", self.optimizer_offload_nvme)) if on]
        if self.pp > 1:
            parts.append(self.pipeline_schedule)
        parts.append(f"mbs {self.micro_batch_size} x {self.num_microbatches} micro-batches")
        return " ".join(parts)

    def with_(self, **kw) -> "Layout":
        return replace(self, **kw)


def dtype_of(cfg: Config) -> torch.dtype:
    t = cfg.training
    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32


def from_config(cfg: Config, world_size: int) -> Layout:
    """The layout a pretrain_gpt.py run of `cfg` on `world_size` ranks would use."""
    p, t = cfg.parallel, cfg.training
    dp = p.data_parallel_size(world_size)
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    return Layout(tp=p.tp, pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, cp=p.cp,
                  ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size, dp=dp, zero_stage=p.zero_stage,
                  sequence_parallel=p.sequence_parallel, cp_comm_type=p.cp_comm_type[0],
                  recompute=t.recompute_granularity,
                  recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
                  recompute_modules=tuple(t.recompute_modules or ("core_attn",)),
                  cpu_offloading_num_layers=t.cpu_offloading_num_layers if t.cpu_offloading else 0,
                  schedule=p.pipeline_schedule, micro_batch_size=t.micro_batch_size, global_batch_size=gbs,
                  seq_length=t.seq_length, params_dtype=dtype_of(cfg),
                  grad_dtype=torch.bfloat16 if p.grad_reduce_in_bf16 else torch.float32, bucket_size=p.ddp_bucket_size,
                  overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
                  grad_reduce_once_per_step=p.grad_reduce_once_per_step,
                  reshard_after_forward=p.reshard_after_forward, optimizer_cpu_offload=t.optimizer_cpu_offload, optimizer_offload_fraction=t.optimizer_offload_fraction,
                  optimizer_offload_nvme=bool(t.optimizer_offload_nvme_path),
                  optimizer=t.optimizer, grad_comm_dtype=p.grad_comm_dtype,
                  zeropp_quantized_gradients=p.zeropp_quantized_gradients,
                  zeropp_qgz_error_feedback=p.zeropp_qgz_error_feedback,
                  zeropp_quantized_weights=p.zeropp_quantized_weights,
                  zeropp_hpz_partition_size=p.zeropp_hpz_partition_size,
                  param_offload_nvme=bool(t.param_offload_nvme_path),
                  split=LayerSplit.of(p), fp8=t.fp8_recipe if t.fp8_format else None,
                  fp8_param_gather=t.fp8_param_gather)
