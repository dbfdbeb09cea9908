"""Plan a training run on paper: per-rank memory and an estimated step time for any layout and
world size, or (--search) the fastest layouts that fit, with the reasons. Nothing is built.

Takes pretrain_gpt.py's flags (paste a launch script's: data, logging and checkpoint flags are
read and ignored) plus --world-size, --gpu-memory, --gpu and --search; the GPU record's figures
(planning/hardware.py, README's table) can be overridden one by one (--gemm-tflops, ...) or from a
JSON file (--hardware-file):

    python tools/plan.py --model llama3-70b --world-size 1024 --gpu-memory 80GB --search
    python tools/plan.py --model llama3-8b --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 256 --world-size 64

The parameter, gradient and optimizer bytes are the trainer's own accounting (the `> memory on
this rank` line); activations follow the layers' saved tensors per micro-batch in flight under
the schedule; the step time is a roofline (planning/timing.py). Without --bf16 / --fp16 the
planner assumes bf16 mixed precision (--fp32 plans fp32); without --micro-batch-size, 1; without
--global-batch-size, a search keeps one sequence per GPU per step. --json prints the same plan as
one JSON object for scripts (bytes and seconds as numbers; the search's table under "ranked").
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_lite.arguments import build_parser, config_from_args  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.planning.hardware import GPUS, from_json, parse_bytes  # noqa: E402
from megatron_lite.planning.layout import from_config  # noqa: E402
from megatron_lite.planning.search import (KEPT_ON_DEVICE, evaluate, gib, memory_line, neighbours, reasons,  # noqa: E402
                                           search, time_line)
from models.gpt_inventory import GPTInventory  # noqa: E402
from models.zoo import zoo  # noqa: E402


def parser():
    p = build_parser(zoo())
    p.description = __doc__.split("\n")[0]
    g = p.add_argument_group("planner")
    g.add_argument("--world-size", type=int, required=True, help="GPUs of the run")
    g.add_argument("--gpu", choices=sorted(GPUS), default="H100", help="GPU kind (default H100)")
    g.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GB (GB read as GiB); default: the GPU's")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per NVLink domain (default 8)")
    g.add_argument("--gemm-tflops", "--achievable-tflops", type=float, default=None, dest="gemm_tflops",
                   help="sustained bf16 GEMM TFLOP/s per GPU of large shapes (default: the GPU's, README's table)")
    g.add_argument("--attention-tflops", type=float, default=None,
                   help="fused attention TFLOP/s per GPU, forward + backward, in the kernel's FLOPs")
    g.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth GB/s a streaming kernel reaches")
    g.add_argument("--hardware-file", default=None,
                   help="JSON object of GPU fields over --gpu's (e.g. {\"gemm_tflops\": 650, \"network_gbps\": 45})")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="intra-node collective GB/s per GPU")
    g.add_argument("--network-gbps", type=float, default=None, help="inter-node collective GB/s per GPU")
    g.add_argument("--nvme-gbps", type=float, default=None,
                   help="GB/s per GPU of the --optimizer-offload-nvme-path disk, reads and writes together "
                        "(default 3.5: one Gen4 NVMe drive per GPU, an assumption)")
    g.add_argument("--fp32", action="store_true", help="plan fp32 parameters (the default without --bf16/--fp16: bf16)")
    g.add_argument("--search", action="store_true", help="search TP/PP/VPP/CP/EP/DP/ZeRO/recompute for the best fits")
    g.add_argument("--top", type=int, default=5, help="layouts listed by --search")
    g.add_argument("--max-pp", type=int, default=16, help="largest pipeline size --search tries")
    g.add_argument("--json", action="store_true", help="print the plan as one JSON object (for scripts)")
    return p


def _given(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _hardware(args):
    hw = GPUS[args.gpu] if not args.hardware_file else from_json(GPUS[args.gpu], args.hardware_file)
    over = {k: getattr(args, k) for k in ("gpus_per_node", "gemm_tflops", "attention_tflops", "hbm_gbps",
                                          "nvlink_gbps", "network_gbps", "nvme_gbps") if getattr(args, k) is not None}
    if args.gpu_memory:
        over["memory_bytes"] = parse_bytes(args.gpu_memory)
    for name, v in over.items():
        if v <= 0:
            flag, given = ("gpu-memory", args.gpu_memory) if name == "memory_bytes" else (name.replace("_", "-"), v)
            raise ConfigError(f"--{flag} ({given}) must be positive")
    return hw.with_(**over)


def _prepare(cfg, args, argv) -> None:
    """The planner's defaults over the flags, then the trainer's finalize (ConfigError if impossible)."""
    t = cfg.training
    if cfg.data.vocab_size:  # NullTokenizer's vocabulary; other tokenizers are not loaded here
        cfg.model.vocab_size = cfg.data.vocab_size
    if not (t.bf16 or t.fp16 or args.fp32):
        t.bf16 = True
    if not _given(argv, "--micro-batch-size"):
        t.micro_batch_size = 1
    if args.search and not _given(argv, "--global-batch-size"):
        t.global_batch_size = args.world_size * t.micro_batch_size
    if t.train_iters is None and t.train_samples is None:
        t.train_iters = 1  # a plan is per step: the run's length does not matter
    cfg.finalize(args.world_size)


def setup(argv: List[str]):
    """(args, Config, Hardware) of a command line; ConfigError / ValueError when it cannot be planned."""
    args = parser().parse_args(argv)
    cfg = config_from_args(args, zoo())
    hw = _hardware(args)
    if args.world_size < 1:
        raise ConfigError(f"--world-size ({args.world_size}) must be >= 1: the GPUs of the run")
    if cfg.training.fp8_format and not hw.fp8_rate:
        raise ConfigError(f"--fp8-format needs FP8 tensor cores, which the {args.gpu} lacks: drop --fp8-format "
                          f"or plan for --gpu H100 / H200")
    _prepare(cfg, args, argv)
    if not args.search:  # the layout of the flags must fill the world, as the trainer requires
        cfg.parallel.validate(args.world_size, cfg.model, cfg.training.seq_length)
    return args, cfg, hw


def plan_of(argv: List[str]):
    """The evaluation (memory per rank, step time) of the layout a command line gives, and the GPU."""
    args, cfg, hw = setup(argv)
    base = from_config(cfg, args.world_size)
    return evaluate(cfg, base, hw, GPTInventory(cfg.model, base.params_dtype).chunk), hw


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, cfg, hw = setup(argv)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    world = args.world_size
    base = from_config(cfg, world)
    m = cfg.model
    inventory = GPTInventory(m, base.params_dtype).chunk
    header = dict(model=args.model or "model from flags", parameters=m.num_parameters(), num_layers=m.num_layers,
                  hidden_size=m.hidden_size, vocab_size=m.vocab_size, world_size=world, gpu=hw.name,
                  usable_bytes=hw.usable_bytes, gpus_per_node=hw.gpus_per_node, seq_length=base.seq_length,
                  global_batch_size=base.global_batch_size, micro_batch_size=base.micro_batch_size,
                  params_dtype=str(base.params_dtype).split(".")[-1])
    if args.json:
        return _json(args, cfg, base, hw, inventory, header)
    print(f"plan: {args.model or 'model from flags'} ({m.num_parameters() / 1e9:.2f}B parameters, {m.num_layers} layers, "
          f"h {m.hidden_size}, vocab {m.vocab_size}), {world} x {hw.name} ({gib(hw.usable_bytes)} usable each, "
          f"{hw.gpus_per_node} per node), seq {base.seq_length}, global batch {base.global_batch_size} x "
          f"{base.seq_length} tokens, micro-batch {base.micro_batch_size}, {str(base.params_dtype).split('.')[-1]}")
    start = time.perf_counter()
    if not args.search:
        return _one(cfg, base, hw, inventory)
    result = search(cfg, base, hw, inventory, max_pp=args.max_pp)
    elapsed = time.perf_counter() - start
    refused = sum(1 for e in result.rejected if not e.valid)
    print(f"searched {result.evaluated} layouts in {elapsed:.1f} s: {len(result.ranked)} fit, "
          f"{len(result.rejected) - refused} do not fit, {refused} refused by the trainer's rules")
    if not result.ranked:
        closest = min((e for e in result.rejected if e.valid), key=lambda e: e.peak_bytes, default=None)
        print("no layout fits" + (f"; the closest, {closest.layout.describe()}, needs {gib(closest.peak_bytes)}"
                                  if closest else ""))
        return 1
    print(f"{'#':>2}  {'layout':72s} {'peak':>9s} {'step':>8s} {'tok/s/GPU':>10s} {'MFU':>6s}")
    for i, ev in enumerate(result.ranked[:args.top], 1):
        tokens = base.global_batch_size * base.seq_length / ev.time.total_s / world
        print(f"{i:>2}  {ev.layout.describe():72s} {ev.peak_bytes / 2**30:7.1f}Gi {ev.time.total_s:7.2f}s "
              f"{tokens:10,.0f} {ev.time.mfu(hw):6.1%}")
    best = result.ranked[0]
    print(f"\nwhy #1 ({best.layout.describe()}):")
    print(f"  memory: {memory_line(best)}")
    print(f"  time: {time_line(best, hw)}")
    for line in reasons(result, hw) + neighbours(cfg, best, hw, inventory):
        print(f"  {line}")
    return 0


def _evaluation(ev, hw) -> dict:
    """One layout's plan: the layout, per-rank bytes, the step time's parts, whether it fits."""
    out = dict(layout=ev.layout.describe(), settings={k: str(v) if not isinstance(v, (int, float, str, bool, type(None)))
                                                      else v for k, v in dataclasses.asdict(ev.layout).items()},
               valid=ev.valid, error=ev.error)
    if not ev.valid:
        return out
    out.update(fits=ev.fits, peak_bytes=ev.peak_bytes, usable_bytes=ev.usable,
               ranks=[dict(pp_rank=r.pp_rank, **r.state, activation_bytes=r.step.activations,
                           in_flight=r.step.in_flight, buffers=dict(r.step.buffers), device_bytes=r.device_bytes)
                      for r in ev.ranks])
    t, lay = ev.time, ev.layout
    out["time"] = dict(total_s=t.total_s, compute_s=t.compute_s, bubble_s=t.bubble_s, tp_s=t.tp_s, cp_s=t.cp_s,
                       ep_s=t.ep_s, dp_exposed_s=t.dp_s, optimizer_s=t.optimizer_s, nvme_exposed_s=t.nvme_s,
                       bubble_fraction=t.bubble_fraction,
                       tokens_per_s_per_gpu=lay.global_batch_size * lay.seq_length / t.total_s / lay.world_size,
                       mfu=t.mfu(hw), detail=dict(t.detail))
    return out


def _json(args, cfg, base, hw, inventory, header: dict) -> int:
    """--json: the plan (or the search: every fitting layout ranked, the counts, the reasons) on stdout."""
    if not args.search:
        ev = evaluate(cfg, base, hw, inventory)
        print(json.dumps(dict(header, plan=_evaluation(ev, hw))))
        return 0 if ev.fits else (1 if ev.valid else 2)
    start = time.perf_counter()
    result = search(cfg, base, hw, inventory, max_pp=args.max_pp)
    refused = sum(1 for e in result.rejected if not e.valid)
    out = dict(header, evaluated=result.evaluated, search_s=time.perf_counter() - start, fitting=len(result.ranked),
               not_fitting=len(result.rejected) - refused, refused=refused,
               ranked=[_evaluation(ev, hw) for ev in result.ranked[:args.top]])
    if result.ranked:
        out["why_best"] = reasons(result, hw) + neighbours(cfg, result.ranked[0], hw, inventory)
    print(json.dumps(out))
    return 0 if result.ranked else 1


def _one(cfg, lay, hw, inventory) -> int:
    ev = evaluate(cfg, lay, hw, inventory)
    print(f"layout: {lay.describe()}")
    if not ev.valid:
        print(f"error: the trainer refuses this layout: {ev.error}", file=sys.stderr)
        return 2
    for r in ev.ranks:
        s = r.state
        print(f"  pipeline rank {r.pp_rank}: params {gib(s['param_bytes'])}, grads {gib(s['grad_bytes'])}, optimizer "
              f"{gib(s['optimizer_state_bytes'])}" + (f" (+ host {gib(s['optimizer_host_bytes'])})"
                                                       if s.get("optimizer_host_bytes") else "")
              + (f" (+ host staging {gib(s['optimizer_staging_bytes'])}, NVMe {gib(s['optimizer_nvme_bytes'])})"
                 if s.get("optimizer_nvme_bytes") else "")
              + (f" (param shards: host staging {gib(s['param_staging_bytes'])}, NVMe {gib(s['param_nvme_bytes'])})"
                 if s.get("param_nvme_bytes") else "")
              + f", activations {gib(r.step.activations)} ({r.step.in_flight} in flight)"
              + "".join(f", {k.replace('_', ' ')} {gib(v)}" for k, v in r.step.buffers.items() if v)
              + "".join(f", {k[:-len('_bytes')].replace('_', ' ')} {gib(s[k])}" for k in KEPT_ON_DEVICE if s.get(k))
              + f" -> {gib(r.device_bytes)}")
    print(f"memory: {memory_line(ev)} -> {'fits' if ev.fits else 'does NOT fit'}")
    print(f"time: {time_line(ev, hw)}")
    return 0 if ev.fits else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
