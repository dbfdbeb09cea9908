"""Planner vs reality: run pretrain_gpt's Trainer for one layout in forked gloo ranks and
measure, per rank, what the planner predicts.

Measured: the optimizer's accounting (`memory_bytes()`, which the trainer prints), the tensors it
holds (`held_bytes()`), and the peak of what the second step's forward and backward (the whole
schedule, every micro-batch, with the gradient buffers' in-step allocations) allocate on top of
the state held across steps, seen by megatron_lite.planning.measure.StepMemory (every storage an
operator creates while alive). The optimizer update's own temporaries are not part of it.
"""
import os
import time
from typing import Dict, List

import torch

from megatron_lite.parallel.comm import CommCounter
from megatron_lite.planning.activations import step_memory
from megatron_lite.planning.layout import from_config
from megatron_lite.planning.measure import StepMemory
from megatron_lite.planning.state import rank_state_bytes
from megatron_lite.training.step import train_step
from models.gpt_inventory import GPTInventory


def _measure_one(world: int, argv: List[str]) -> Dict:
    from pretrain_gpt import make_trainer, resolve

    os.environ["WORLD_SIZE"] = str(world)
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    t, dims = cfg.training, trainer.dims
    meter = StepMemory()
    inner = trainer.forward_backward

    def measured(*args, **kw):
        with meter:
            return inner(*args, **kw)

    for step in range(2):  # the first step warms up what is built once; measure the second
        batches = trainer._next_batches(trainer.train_iter, trainer.num_microbatches)
        fb = measured if step == 1 else inner
        dims.comm_counter = CommCounter()
        start = time.perf_counter()
        train_step(trainer.chunks, batches, dims, trainer.optimizer, trainer.grad_sync, t.lr, trainer.forward_step,
                   fb, loss_normalizer=float(t.global_batch_size * t.seq_length))
        step_s = time.perf_counter() - start
    return {"pp_rank": dims.pp_rank, "tp_rank": dims.tp_rank, "accounted": trainer.optimizer.memory_bytes(),
            "held": trainer.optimizer.held_bytes(), "peak": meter.peak_bytes, "comm": dims.comm_counter.reset(),
            "step_s": step_s}


def measure_layouts(rank: int, world: int, argvs: List[List[str]]) -> List[Dict]:
    """Every layout of `argvs` (pretrain_gpt flags for this world size) on this rank, in order."""
    return [_measure_one(world, argv) for argv in argvs]


def predict(argv: List[str], world: int, pp_rank: int, tp_rank: int) -> Dict:
    """The planner's figures for one rank, from the same flags, without building the model."""
    from pretrain_gpt import resolve

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        cfg, _ = resolve(argv)
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved
    lay = from_config(cfg, world)
    inventory = GPTInventory(cfg.model, lay.params_dtype).chunk
    return {"accounted": rank_state_bytes(cfg.model.num_layers, lay, pp_rank, inventory),
            "step": step_memory(cfg.model, lay, pp_rank, inventory, tp_rank), "layout": lay}


# --- the layouts the planner is checked on --------------------------------------------------------
# Model A: GPT-2 style (LayerNorm, learned positions, GELU, biases, tied embeddings), 4 layers,
# h 64, vocabulary 512. Model B: Llama style (RMSNorm, RoPE, SwiGLU, GQA 8 heads / 4 groups, untied),
# 4 layers, h 128, ffn 352, vocabulary 1000. Random tokens (--mock-data), no dropout.
_COMMON = ["--num-layers", "4", "--device", "cpu", "--eval-iters", "0", "--train-iters", "2", "--micro-batch-size", "2",
           "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data"]
MODEL_A = _COMMON + ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "512"]
MODEL_B = _COMMON + ["--hidden-size", "128", "--num-attention-heads", "8", "--ffn-hidden-size", "352",
                     "--seq-length", "128", "--vocab-size", "1000", "--normalization", "RMSNorm", "--swiglu",
                     "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                     "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "4"]
GBS8 = ["--global-batch-size", "8"]
GBS32 = ["--global-batch-size", "32"]  # 8 micro-batches of 2 per rank at DP2
# (name, world size, flags)
LAYOUTS = [
    ("A  DP2 ZeRO-0", 2, MODEL_A + ["--zero-stage", "0"]),
    ("A  recompute full", 1, MODEL_A + ["--recompute-granularity", "full"]),
    ("A  DP2 ZeRO-1", 2, MODEL_A + ["--zero-stage", "1"]),
    ("A  DP2 ZeRO-2, 2 micro-batches", 2, MODEL_A + ["--zero-stage", "2"] + GBS8),
    ("A  DP2 ZeRO-3, 2 micro-batches", 2, MODEL_A + ["--zero-stage", "3"] + GBS8),
    ("A  DP2 ZeRO-2, 8 micro-batches, buckets of 40k", 2, MODEL_A + ["--zero-stage", "2", "--ddp-bucket-size", "40000"]
     + GBS32),
    ("A  DP2 ZeRO-2, 8 micro-batches, once per step", 2, MODEL_A + ["--zero-stage", "2", "--ddp-bucket-size", "40000",
                                                                   "--grad-reduce-once-per-step"] + GBS32),
    ("A  DP2 ZeRO-3, 8 micro-batches, overlap", 2, MODEL_A + ["--zero-stage", "3", "--overlap-grad-reduce"] + GBS32),
    ("A  PP2 gpipe", 2, MODEL_A + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"] + GBS8),
    ("A  TP2 SP", 2, MODEL_A + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("B  DP1 recompute selective", 1, MODEL_B + ["--recompute-granularity", "selective"]),
    ("B  PP2 1f1b", 2, MODEL_B + ["--pipeline-model-parallel-size", "2"] + GBS8),
    ("B  PP2 zb-h1", 2, MODEL_B + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"] + GBS8),
    ("B  PP2 zb-v (V placement)", 2, MODEL_B + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"]
     + GBS8),
    ("A  PP2 dualpipe-v (V, tied)", 2, MODEL_A + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                                  "dualpipe-v"] + GBS8),
    ("B  PP2 VPP2 interleaved", 2, MODEL_B + ["--pipeline-model-parallel-size", "2",
                                              "--num-layers-per-virtual-pipeline-stage", "1"] + GBS8),
    ("B  PP2 layout E|tt|tt|L", 2, MODEL_B + ["--pipeline-model-parallel-size", "2",
                                               "--pipeline-model-parallel-layout", "E|tt|tt|L"] + GBS8),
    ("B  CP2 ring", 2, MODEL_B + ["--context-parallel-size", "2"]),
    ("B  MoE EP2 ZeRO-1", 2, MODEL_B + ["--num-experts", "4", "--moe-router-topk", "2",
                                        "--expert-model-parallel-size", "2", "--zero-stage", "1"]),
    ("B  TP2 PP2 SP ZeRO-1 recompute full", 4, MODEL_B + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                          "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                                                          "--recompute-granularity", "full"] + GBS8),
    ("A  PP2 VPP2 DP2 ZeRO-3 interleaved", 4, MODEL_A + ["--pipeline-model-parallel-size", "2", "--zero-stage", "3",
                                                         "--num-layers-per-virtual-pipeline-stage", "1"] + GBS8),
    ("A  PP2 DP2 ZeRO-3 1f1b, no reshard after forward", 4, MODEL_A + [
        "--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--no-reshard-after-forward"] + GBS8),
    ("B  TP2 DP2 ZeRO-3, 2 micro-batches", 4, MODEL_B + ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]
     + GBS8),
    ("B  recompute modules core_attn mlp layernorm", 1, MODEL_B + [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "layernorm"]),
    ("B  MoE recompute modules moe_act", 1, MODEL_B + ["--num-experts", "4", "--moe-router-topk", "2",
                                                      "--recompute-granularity", "selective",
                                                      "--recompute-modules", "moe_act"]),
    ("B  CPU offloading 3 of 4 layers", 1, MODEL_B + ["--cpu-offloading", "--cpu-offloading-num-layers", "3"]),
    ("B  PP2 1f1b CPU offloading 3 layers", 2, MODEL_B + ["--pipeline-model-parallel-size", "2", "--cpu-offloading",
                                                         "--cpu-offloading-num-layers", "3"] + GBS8),
]


def measure_all() -> List[Dict]:
    """Every layout of LAYOUTS: per rank, the measured and predicted figures (one forked world per
    world size, its layouts run one after another)."""
    from megatron_lite.testing import run_distributed

    rows = []
    for world in sorted({w for _, w, _ in LAYOUTS}):
        chosen = [(name, argv) for name, w, argv in LAYOUTS if w == world]
        per_rank = run_distributed(measure_layouts, world, [argv for _, argv in chosen])
        for i, (name, argv) in enumerate(chosen):
            seen = set()
            for rank_results in per_rank:
                got = rank_results[i]
                key = (got["pp_rank"], got["tp_rank"], got["peak"])
                if key in seen:  # data-parallel copies of a rank that measured the same
                    continue
                seen.add(key)
                rows.append({"name": name, "world": world, **got,
                             "predicted": predict(argv, world, got["pp_rank"], got["tp_rank"])})
    return rows


# --- saved activations per layer against Korthikanti's formula ------------------------------------
# bf16 (Megatron's mixed precision: bf16 parameters and activations, fp32 main copy), 2 layers.
_LAYER = ["--num-layers", "2", "--device", "cpu", "--eval-iters", "0", "--train-iters", "1", "--micro-batch-size", "2",
          "--global-batch-size", "2", "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data", "--bf16",
          "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "512"]
LAYER_MODELS = {"GPT": _LAYER,
                "Llama": _LAYER + ["--ffn-hidden-size", "704", "--normalization", "RMSNorm", "--swiglu",
                                   "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                                   "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]}
TP2 = ["--tensor-model-parallel-size", "2"]
LAYER_CELLS = [("GPT", []), ("Llama", []), ("GPT", TP2), ("GPT", TP2 + ["--sequence-parallel"]),
               ("Llama", TP2), ("Llama", TP2 + ["--sequence-parallel"])]


def saved_per_layer(rank: int, world: int, argvs: List[List[str]]) -> List[Dict]:
    """Per flags of `argvs`: bytes autograd keeps for the last layer over one micro-batch's forward
    (measure.SavedBytes), with the formula's and the planner's (layer counts) figures."""
    from pretrain_gpt import make_trainer, resolve

    from megatron_lite.planning.activations import formula_layer_bytes, micro_batch
    from megatron_lite.planning.measure import SavedBytes
    from megatron_lite.transformer.model_counts import layer_counts

    os.environ["WORLD_SIZE"] = str(world)
    out = []
    for argv in argvs:
        cfg, tokenizer = resolve(argv)
        trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
        model = trainer.chunks[0]
        batch = trainer._next_batches(trainer.train_iter, 1)[0]
        with SavedBytes(dict(model.layers.items())) as saved:
            trainer.forward_step(batch, model)
        lay = from_config(cfg, world)
        mb = micro_batch(lay)
        last = str(cfg.model.num_layers - 1)
        out.append({"measured": saved.per_layer[last], "sbh": mb.tokens * cfg.model.hidden_size,
                    "formula": formula_layer_bytes(cfg.model, mb.tokens, lay.tp, lay.sp, mb.a),
                    "planner": layer_counts(cfg.model, mb, False).act_bytes})
    return out
