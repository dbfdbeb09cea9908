"""Training runs others published with their measured throughput and memory, as tools/plan.py
command lines: what the planner's step time and memory are checked against (tests/test_planner.py,
benchmarks/bench_planner_published.py).

Megatron-LM's README (2024 table, images/model_table.png): GPT models with a 131,072-token
vocabulary, sequence 4096, micro-batch 1, untied embeddings, 4h GELU MLP, bf16 with the
distributed optimizer and overlapped gradient reduce / parameter gather, sequence parallelism with
TP; published as model TFLOP/s per GPU on H100 SXM (80 GB). The README gives no virtual pipeline
size: Megatron's default schedule, 1F1B. (It also overlaps TP communication with Transformer
Engine's userbuffers, which this trainer lacks; the plan is for this trainer.)

torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Table 1): Llama-3.1-8B with FSDP on 8
H100s of 96 GB (HBM2e, 2.4 TB/s, 500 W power limit), local batch 2, sequence 8192, selective
activation checkpointing, no torch.compile: 5,762 tokens/s/GPU at 82.4 GiB. Planned as ZeRO-3 with
reshard-after-forward and fp32 gradient reduction on a GPU record with that memory and bandwidth
(its GEMM and attention rates the H100 record's: the 500 W limit is not modelled). torchtitan's
op-level selective checkpointing (every other matmul and the elementwise ops recomputed) has no
flag here, and Megatron's selective recomputation (the attention core) keeps too much at this size
to fit: planned with full recomputation of every layer (more recomputed work than theirs).
"""
from __future__ import annotations

import json
import os
from typing import List, NamedTuple, Optional

_MEGATRON = ["--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "131072",
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--micro-batch-size", "1",
             "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16",
             "--gpu", "H100"]


def _gpt(layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, batch: int) -> List[str]:
    sizes = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--global-batch-size", str(batch), "--world-size", str(gpus)]
    return _MEGATRON + sizes + (["--sequence-parallel"] if tp > 1 else [])


class PublishedRun(NamedTuple):
    name: str
    argv: List[str]  # tools/plan.py's command line
    tflops_per_gpu: Optional[float] = None  # published model TFLOP/s per GPU
    tokens_per_gpu: Optional[float] = None  # published tokens/s per GPU
    memory_gib: Optional[float] = None  # published peak memory per GPU
    source: str = ""
    hardware: Optional[dict] = None  # GPU fields over --gpu's (tools/plan.py --hardware-file)

    def plan(self, tmp_dir: str):
        """tools/plan.py's evaluation of the run and its GPU record."""
        from tools.plan import plan_of

        argv = list(self.argv)
        if self.hardware:
            path = os.path.join(tmp_dir, "hardware.json")
            with open(path, "w") as f:
                json.dump(self.hardware, f)
            argv += ["--hardware-file", path]
        return plan_of(argv)

    def predicted(self, ev) -> float:
        """The plan's figure in the published one's unit (model TFLOP/s or tokens/s per GPU)."""
        t, lay = ev.time, ev.layout
        if self.tflops_per_gpu:
            return t.model_tflop_per_gpu / t.total_s
        return lay.global_batch_size * lay.seq_length / t.total_s / lay.world_size

    @property
    def published(self) -> float:
        return self.tflops_per_gpu or self.tokens_per_gpu


# The torchtitan machines: 96 GB of HBM2e at 2.4 TB/s (90 %: 2160 GB/s).
TORCHTITAN_H100 = {"name": "H100 96GB HBM2e", "memory_bytes": 96 * 2 ** 30, "hbm_gbps": 2160}

RUNS = [
    PublishedRun("Megatron-LM GPT 1.7B, TP1, 48 x H100", _gpt(24, 2048, 16, 1, 1, 48, 192), 408.8,
                 source="Megatron-LM README (2024)"),
    PublishedRun("Megatron-LM GPT 7.1B, TP2, 96 x H100", _gpt(30, 4096, 32, 2, 1, 96, 192), 465.9,
                 source="Megatron-LM README (2024)"),
    PublishedRun("Megatron-LM GPT 70B, TP8 x PP2, 768 x H100", _gpt(84, 8192, 64, 8, 2, 768, 384), 419.7,
                 source="Megatron-LM README (2024)"),
    PublishedRun("Megatron-LM GPT 462B, TP8 x PP16, 6144 x H100", _gpt(112, 18432, 144, 8, 16, 6144, 3072), 459.9,
                 source="Megatron-LM README (2024)"),
    PublishedRun("torchtitan Llama-3.1-8B FSDP, 8 x H100 96GB", [
        "--model", "llama3.1-8b", "--bf16", "--seq-length", "8192", "--micro-batch-size", "2", "--global-batch-size",
        "16", "--use-distributed-optimizer", "--zero-stage", "3", "--overlap-grad-reduce", "--overlap-param-gather",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--world-size", "8", "--gpu", "H100"],
        tokens_per_gpu=5762, memory_gib=82.4, source="torchtitan benchmarks (2024-12), Table 1",
        hardware=TORCHTITAN_H100),
]

# Published layouts without a published throughput in this form: accepted and fitting is the check.
# DeepSeek-V3 (its report, section 3.2): 2048 H800s, PP16 with two chunks per rank in a V
# (DualPipe; here dualpipe-v), EP64 over 8 nodes, ZeRO-1 DP, no TP, MTP depth 1, sequence 4096,
# global batch 15360; 61 layers as Megatron-LM's recipes place them (the embedding with one layer
# first, two layers a virtual stage, the loss and MTP alone last). Its FP8 training, node-limited
# dispatch and recomputation of selected modules are not flags here: full recomputation instead.
# Kimi-K2 (its report: PP16 with virtual stages, EP16, ZeRO-1; 67M-token batches of 4096): the
# same placement on 2048 H800s, interleaved, global batch 16384 sequences.
_MOE = ["--bf16", "--seq-length", "4096", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "16",
        "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--world-size", "2048", "--gpu", "H800"]
LAYOUTS = [
    PublishedRun("DeepSeek-V3, PP16 x VPP2 (dualpipe-v) x EP64, 2048 x H800",
                 ["--model", "deepseek-v3", "--mtp-num-layers", "1", "--global-batch-size", "15360",
                  "--pipeline-schedule", "dualpipe-v", "--expert-model-parallel-size", "64",
                  "--pipeline-model-parallel-layout", "Et|(tt|)*30,mL"] + _MOE,
                 source="DeepSeek-V3 technical report"),
    PublishedRun("Kimi-K2, PP16 x VPP2 x EP16, 2048 x H800",
                 ["--model", "kimi-k2", "--global-batch-size", "16384", "--expert-model-parallel-size", "16",
                  "--pipeline-model-parallel-layout", "Et|(tt|)*30,L"] + _MOE,
                 source="Kimi-K2 technical report (layout), our choice of world and batch"),
]
