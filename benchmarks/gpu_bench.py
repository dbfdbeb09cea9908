#!/usr/bin/env python
"""One command for a lent GPU: smoke rows of every single-GPU path, then MFU of a ~1.3B Llama
against plain PyTorch and Hugging Face on the same model and batch.

    python benchmarks/gpu_bench.py --out $OUT/gpu_bench          # on the GPU (< 8 minutes on one H200)
    python benchmarks/gpu_bench.py --device cpu --out /tmp/gb     # CPU: tiny sizes, the same code paths
        [--only smoke,mfu,peers] [--skip fp16,cp,...] [--no-compile] [--mbs 2,4,8]
        [--warmup 3] [--iters 10] [--peak-tflops 989] [--budget-s 450] [--jobs N]

Smoke (5 iterations each, `pretrain_gpt.py` in its own process with its own timeout; a failing
row never stops the others): fp32, bf16, fp16 (initial loss scale 2^16, so that some steps
update), recompute full / selective, --compile, a checkpoint round trip (an uninterrupted 10-step
run against save at 5 + exit, then load and continue: steps 6-10 must give the same losses),
MoE (4 experts, top-2, grouped GEMM, EP 1), CP 2 (two ranks under torchrun: gloo on the CPU; on
CUDA only with two GPUs, since NCCL refuses two ranks on one GPU). PASS: exit status 0, every
iteration logged with a finite loss, and no skipped step (fp16: at least one step not skipped).

MFU: a ~1.3B Llama (24 layers, hidden 2048, 16 heads, SwiGLU 5504, RMSNorm, RoPE, seq 2048,
vocab 32000, untied), bf16, --mock-data, one micro-batch per step; the micro-batch sweep
(--mbs, default 2,4,8; it stops at the first failure such as OOM, or when tokens/s gains less
than 2%) runs without --compile, then the best micro-batch again with --compile. Timing:
--warmup steps dropped, the median step_time_s of the next --iters steps from --metrics-file
(the trainer synchronizes CUDA before reading the clock). The whole run keeps to --budget-s:
each row's timeout is cut to what is left, and a row with too little left is skipped.

Peers, same model and batch, each in its own process (benchmarks/gpu_bench_peers.py): the model
written plainly in PyTorch (F.rms_norm, SDPA causal, SwiGLU, RoPE), eager and torch.compile'd, and Hugging Face
`LlamaForCausalLM` (attn_implementation="sdpa", torch.compile'd), compiled per transformer block
as our --compile is (--peer-compile-scope model: the whole model); fp32 weights under bf16
autocast, torch.optim.AdamW (fused on CUDA), weight decay 0.01, gradient clipping at 1.0,
torch.cuda.synchronize() around each timed step. Their parameter counts must equal ours.

Results go to stdout as tables, and to OUT.json / OUT.md (rewritten after every row, so that a
run cut short keeps what it measured) and OUT.log (the tail of every row's output).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_bench_peers.py")

FLOP_CONVENTION = ("FLOPs/token = 6N + 12*L*H*Q*T (PaLM appendix B, megatron_lite/training/flops.py): N the parameters "
                   "without the input embedding (output layer counted), L layers, H heads, Q head dim, T seq length; "
                   "attention term not halved for the causal mask; model FLOPs, so recomputation is not counted "
                   "(MFU, not HFU)")
PRECISION_NOTE = ("ours: --bf16 (bf16 weights and compute, fp32 main params and gradients, Megatron mixed "
                  "precision); peers: fp32 weights under torch.autocast(bf16), AdamW on the fp32 weights")

# Model shapes: the 1.3B of the MFU rows, the small one of the GPU smoke rows, and --tiny (CPU) for both.
SHAPES = {
    "llama-1.3b": dict(layers=24, hidden=2048, heads=16, ffn=5504, seq=2048, vocab=32000),
    "smoke": dict(layers=2, hidden=256, heads=4, ffn=704, seq=256, vocab=32000),
    "tiny": dict(layers=2, hidden=64, heads=4, ffn=192, seq=64, vocab=256),
}
SMOKE_ITERS = 5
SMOKE_MB = 2
CKPT_SAVE_AT = 5
CKPT_ITERS = 10


# --- command lines of our trainer ------------------------------------------------------------
def ours_argv(shape: dict, mb: int, iters: int, device: str, extra: List[str]) -> List[str]:
    """pretrain_gpt.py flags of a Llama of `shape`: NullTokenizer over vocab-1 ids plus its EOD,
    so that the vocabulary is exactly shape["vocab"] (a multiple of 128: no padding)."""
    s = shape
    return ["--device", device, "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--ffn-hidden-size", str(s["ffn"]),
            "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]), "--swiglu",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(s["vocab"] - 1), "--micro-batch-size", str(mb), "--global-batch-size", str(mb),
            "--train-iters", str(iters), "--lr", "3e-4", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"] + list(extra)


def resolve_ours(argv: List[str]):
    """Our config for these flags, exactly as pretrain_gpt.py resolves it."""
    import pretrain_gpt

    cfg, _ = pretrain_gpt.resolve(argv)
    return cfg


def ours_flops_per_token(argv: List[str]) -> float:
    from megatron_lite.training.flops import flops_per_token

    cfg = resolve_ours(argv)
    return flops_per_token(cfg.model, cfg.training.seq_length)


def ours_parameter_count(argv: List[str]) -> int:
    """Parameters of the model our trainer builds for these flags (built on the meta device)."""
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model

    cfg = resolve_ours(argv)
    chunks = build_model(cfg.model, ParallelDims().build_groups(), seed=cfg.training.seed, materialize=False)
    return sum(p.numel() for c in chunks for p in c.parameters())


# --- processes with a timeout each -------------------------------------------------------------
def subprocess_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_process(cmd: List[str], timeout: float, log_path: str, env: Optional[dict] = None) -> dict:
    """Run in its own process group (torchrun's workers die with it); output to log_path."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(env), cwd=REPO,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
    with open(log_path, errors="replace") as f:
        text = f.read()
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": time.perf_counter() - start, "output": text}


def failure_reason(proc: dict, timeout: float) -> str:
    """One line: why a process failed (timeout, OOM, our `error:` line, or its last exception)."""
    if proc["timed_out"]:
        return f"timed out after {timeout:.0f} s"
    lines = [ln.strip() for ln in proc["output"].splitlines() if ln.strip()]
    if any("out of memory" in ln.lower() for ln in lines):
        return "OOM: " + next(ln for ln in reversed(lines) if "out of memory" in ln.lower())[:300]
    lines = [ln for ln in lines if "ChildFailedError" not in ln]  # torchrun's report, not the cause
    for pred in (lambda ln: ln.startswith("error:"), lambda ln: "Error" in ln.split(" ")[0], lambda ln: "Error" in ln):
        hits = [ln for ln in lines if pred(ln)]
        if hits:
            return hits[-1][:300]
    return f"exit status {proc['rc']}: " + (lines[-1][:300] if lines else "no output")


def read_metrics(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# --- the bench: rows, budget, outputs ------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.work = tempfile.mkdtemp(prefix="gpu_bench_")  # checkpoints and metrics: never under --out
        self.start = time.perf_counter()
        self.lock = threading.Lock()
        self.rows: List[dict] = []
        self.logs: List[str] = []
        self.info: dict = {}
        self.mfu: dict = {}

    # time budget
    def remaining(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def row_timeout(self, cap: float) -> Optional[float]:
        """This row's timeout: its cap, cut to what the budget leaves; None: no time left."""
        left = self.remaining() - 5.0  # a little for writing the results
        return None if left < self.args.min_row_s else min(cap, left)

    def add(self, row: dict) -> dict:
        with self.lock:
            self.rows.append(row)
            mark = {"PASS": "PASS", "FAIL": "FAIL", "SKIP": "skip"}[row["status"]]
            extra = f" {row['tokens_per_sec']:,.0f} tokens/s" if row.get("tokens_per_sec") else ""
            print(f"[{row['section']}] {row['name']}: {mark}{extra} ({row.get('wall_s', 0):.1f} s)"
                  + (f" - {row['reason']}" if row.get("reason") else "")
                  + f"  [{time.perf_counter() - self.start:.0f} s used]", flush=True)
            self.write()
        return row

    def log(self, name: str, proc: dict, cmd: List[str]) -> None:
        tail = "\n".join(proc["output"].splitlines()[-self.args.log_lines:])
        with self.lock:
            self.logs.append(f"===== {name} (rc {proc['rc']}, {proc['wall_s']:.1f} s)\n$ {' '.join(cmd)}\n{tail}\n")

    def skip(self, section: str, name: str, reason: str) -> dict:
        return self.add({"section": section, "name": name, "status": "SKIP", "reason": reason, "wall_s": 0.0})

    def result(self) -> dict:
        return {"info": self.info, "mfu": self.mfu, "rows": self.rows,
                "wall_s": time.perf_counter() - self.start}

    def write(self) -> None:
        out = self.args.out
        if not out:
            return
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        res = self.result()
        for suffix, text in ((".json", json.dumps(res, indent=1, default=str)), (".md", render(res)),
                             (".log", "\n".join(self.logs))):
            tmp = out + suffix + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, out + suffix)

    # one run of our trainer
    def run_ours(self, name: str, argv: List[str], cap: float, nproc: int = 1, metrics: Optional[str] = None,
                 env: Optional[dict] = None) -> dict:
        """{"ok", "reason", "records", "wall_s", "proc"} of pretrain_gpt.py with these flags."""
        metrics = metrics or os.path.join(self.work, f"{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        timeout = self.row_timeout(cap)
        if timeout is None:
            return {"ok": False, "skip": True, "reason": "skipped: out of time budget", "records": [], "wall_s": 0.0}
        launcher = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = launcher + [PRETRAIN] + argv + ["--metrics-file", metrics]
        proc = run_process(cmd, timeout, os.path.join(self.work, f"{name}.log"), env)
        self.log(name, proc, cmd)
        recs = read_metrics(metrics)
        out = {"ok": False, "reason": "", "records": recs, "wall_s": proc["wall_s"], "proc": proc}
        if proc["rc"] != 0 or proc["timed_out"]:
            out["reason"] = failure_reason(proc, timeout)
        else:
            out["ok"], out["reason"] = check_records(recs, int(argv[argv.index("--train-iters") + 1]), argv)
        return out


def check_records(recs: List[dict], train_iters: int, argv: List[str]) -> tuple:
    """(ok, reason) of a finished run's metrics: every iteration there, finite losses, steps taken."""
    its = [r["iteration"] for r in recs]
    first = its[0] if its else None
    if not recs or its != list(range(first, train_iters + 1)):
        return False, f"metrics hold iterations {its}, expected up to {train_iters}"
    bad = [r["iteration"] for r in recs if not finite(r.get("lm_loss"))]
    if bad:
        return False, f"non-finite loss at iterations {bad}"
    skipped = [r["iteration"] for r in recs if r.get("skipped")]
    if "--fp16" in argv:
        if len(skipped) == len(recs):
            return False, "every step skipped (fp16 overflow)"
        return True, f"{len(skipped)} of {len(recs)} steps skipped by the loss scaler" if skipped else ""
    if skipped:
        return False, f"skipped steps {skipped}"
    return True, ""


def losses_of(recs: List[dict]) -> List[float]:
    return [r.get("lm_loss") for r in recs]


# --- smoke -------------------------------------------------------------------------------------
def smoke_rows() -> Dict[str, List[str]]:
    """name -> extra flags. Everything but the precision rows runs in bf16 (what a GPU trains in)."""
    return {
        "fp32": [],
        "bf16": ["--bf16"],
        "fp16": ["--fp16", "--initial-loss-scale", "65536"],
        "recompute-full": ["--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"],
        "recompute-selective": ["--bf16", "--recompute-granularity", "selective"],
        "compile": ["--bf16", "--compile"],
        "checkpoint": ["--bf16"],
        "moe": ["--bf16", "--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm"],
        "cp": ["--bf16", "--context-parallel-size", "2"],
        "host-syncs": ["--bf16"],
    }


def smoke_one(b: Bench, name: str, extra: List[str]) -> dict:
    a = b.args
    argv = ours_argv(a.smoke_shape, SMOKE_MB, SMOKE_ITERS, a.device, extra)
    row = {"section": "smoke", "name": name, "flags": " ".join(extra)}
    nproc = 1
    if name == "cp":
        nproc = 2
        if a.device == "cuda" and a.gpus < 2:
            return b.skip("smoke", name, f"skipped: needs 2 GPUs (NCCL refuses two ranks on one GPU; {a.gpus} visible)")
    env = None
    if name == "host-syncs":  # torch.cuda's sync debug mode over the steps after warm-up
        if a.device != "cuda":
            return b.skip("smoke", name, "skipped: CUDA only (torch.cuda.set_sync_debug_mode)")
        env = {"MEGATRON_LITE_SYNC_DEBUG_FROM": "3"}
    r = b.run_ours(f"smoke-{name}", argv, a.smoke_compile_timeout_s if name == "compile" else a.smoke_timeout_s,
                   nproc=nproc, env=env)
    if r.get("skip"):
        return b.skip("smoke", name, r["reason"])
    row.update(status="PASS" if r["ok"] else "FAIL", reason=r["reason"], wall_s=r["wall_s"],
               losses=losses_of(r["records"]))
    if r["ok"] and name == "host-syncs":
        counted = [x for x in r["records"] if "host_syncs" in x]
        if not counted:
            row.update(status="FAIL", reason="no step reported host_syncs")
        else:  # measured, not judged here: the logged scalars (loss, grad norm) are expected
            sites = sorted({s for x in counted for s in x["host_sync_sites"]})
            row.update(host_syncs=[x["host_syncs"] for x in counted], host_sync_sites=sites,
                       reason=f"host syncs per step {[x['host_syncs'] for x in counted]} at {', '.join(sites)}")
    if r["ok"] and name == "moe" and not any("moe_aux_loss" in x or "moe_load_imbalance" in x for x in r["records"]):
        row.update(status="FAIL", reason="no MoE statistics in the metrics: did the MoE layers run?")
    return b.add(row)


def smoke_checkpoint(b: Bench, extra: List[str]) -> dict:
    """Uninterrupted 10 steps vs save at 5 (and exit), then load and continue to 10."""
    a = b.args
    ck = os.path.join(b.work, "ckpt")
    base = ours_argv(a.smoke_shape, SMOKE_MB, CKPT_ITERS, a.device, extra)
    row = {"section": "smoke", "name": "checkpoint", "flags": " ".join(extra)
           + f" --save/--load at {CKPT_SAVE_AT} of {CKPT_ITERS}", "wall_s": 0.0}
    parts = [("uninterrupted", []),
             ("first-half", ["--save", ck, "--save-interval", str(CKPT_SAVE_AT), "--exit-interval", str(CKPT_SAVE_AT)]),
             ("resumed", ["--save", ck, "--load", ck])]
    runs = {}
    for part, flags in parts:
        r = b.run_ours(f"smoke-checkpoint-{part}", base + flags, a.smoke_timeout_s)
        row["wall_s"] += r["wall_s"]
        runs[part] = r
        if r.get("skip"):
            return b.skip("smoke", "checkpoint", r["reason"])
        if part == "first-half":  # exits at the save: its metrics stop at iteration 5
            its = [x["iteration"] for x in r["records"]]
            if r["proc"]["rc"] == 0 and its == list(range(1, CKPT_SAVE_AT + 1)):
                r["ok"], r["reason"] = True, ""
        if not r["ok"]:
            row.update(status="FAIL", reason=f"{part}: {r['reason']}")
            return b.add(row)
    full = losses_of(runs["uninterrupted"]["records"])
    first, resumed = losses_of(runs["first-half"]["records"]), losses_of(runs["resumed"]["records"])
    resumed_its = [x["iteration"] for x in runs["resumed"]["records"]]
    row.update(losses=full, losses_first_half=first, losses_resumed=resumed, resumed_iterations=resumed_its)
    if resumed_its != list(range(CKPT_SAVE_AT + 1, CKPT_ITERS + 1)):
        row.update(status="FAIL", reason=f"the resumed run logged iterations {resumed_its}")
        return b.add(row)
    expect = full[CKPT_SAVE_AT:]
    diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(resumed + first, expect + full[:CKPT_SAVE_AT]))
    row["max_rel_diff"] = diff
    tol = 0.0 if a.device == "cpu" else a.resume_rtol  # CUDA: SDPA's backward may be nondeterministic
    if diff <= tol:
        row.update(status="PASS", reason="bitwise equal to the uninterrupted run" if diff == 0 else
                   f"equal to the uninterrupted run within {diff:.1e} (relative)")
    else:
        row.update(status="FAIL", reason=f"resumed losses differ from the uninterrupted run by {diff:.2e} "
                   f"(relative; tolerance {tol:g})")
    return b.add(row)


def run_smoke(b: Bench) -> None:
    a = b.args
    rows = [(n, f) for n, f in smoke_rows().items() if n not in a.skip and not (a.no_compile and "--compile" in f)]
    rows.sort(key=lambda nf: nf[0] != "compile")  # the slowest first, when rows run side by side

    def one(nf):
        name, flags = nf
        try:
            return smoke_checkpoint(b, flags) if name == "checkpoint" else smoke_one(b, name, flags)
        except Exception as e:  # a bug of the bench itself fails its row, not the run
            return b.add({"section": "smoke", "name": name, "status": "FAIL", "wall_s": 0.0,
                          "reason": f"bench error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()})

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        list(pool.map(one, rows))


# --- MFU: ours ---------------------------------------------------------------------------------
def timed_stats(step_times: List[float], tokens_per_step: int, flops_per_token: float, peak: float) -> dict:
    med = statistics.median(step_times)
    tps = tokens_per_step / med
    tflops = flops_per_token * tps / 1e12
    return {"step_s_median": med, "step_s_mean": statistics.fmean(step_times), "tokens_per_sec": tps,
            "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None, "timed_steps": len(step_times)}


def mfu_ours(b: Bench, name: str, mb: int, compile_: bool) -> dict:
    a, m = b.args, b.mfu
    extra = ["--bf16"] + (["--compile"] if compile_ else [])
    argv = ours_argv(a.mfu_shape, mb, a.warmup + a.iters, a.device, extra)
    row = {"section": "mfu", "name": name, "framework": "megatron-lite", "compile": compile_, "micro_batch": mb,
           "flags": " ".join(extra)}
    r = b.run_ours(f"mfu-{name}", argv, a.mfu_compile_timeout_s if compile_ else a.mfu_timeout_s)
    if r.get("skip"):
        return b.skip("mfu", name, r["reason"])
    row.update(wall_s=r["wall_s"], losses=losses_of(r["records"]))
    if not r["ok"]:
        row.update(status="FAIL", reason=r["reason"], oom=r["reason"].startswith("OOM"))
        return b.add(row)
    recs = r["records"]
    timed = recs[a.warmup:]
    row.update(timed_stats([x["step_time_s"] for x in timed], mb * a.mfu_shape["seq"], m["flops_per_token"],
                           a.peak_tflops))
    row.update(status="PASS", reason="", warmup_s=sum(x["step_time_s"] for x in recs[:a.warmup]),
               peak_memory_gib=max((x.get("max_memory_gb") or 0.0) for x in recs),
               records=[{k: x.get(k) for k in ("iteration", "lm_loss", "step_time_s", "tokens_per_sec",
                                                "tflops_per_gpu", "max_memory_gb")} for x in recs])
    return b.add(row)


def run_mfu(b: Bench) -> None:
    a, m = b.args, b.mfu
    sweep = []
    for mb in a.mbs:
        row = mfu_ours(b, f"ours-eager-mb{mb}", mb, False)
        if row["status"] != "PASS":
            break  # OOM (or any failure): larger micro-batches will not do better
        sweep.append(row)
        if len(sweep) > 1 and row["tokens_per_sec"] < a.sweep_gain * sweep[-2]["tokens_per_sec"]:
            break  # saturated: a larger micro-batch is not worth its minutes
    if sweep:
        m["best_micro_batch"] = max(sweep, key=lambda r: r["tokens_per_sec"])["micro_batch"]
    if not a.no_compile:
        mb = m.get("best_micro_batch", a.mbs[0])
        mfu_ours(b, f"ours-compile-mb{mb}", mb, True)


# --- peers: the same model, plainly in PyTorch and in Hugging Face (benchmarks/gpu_bench_peers.py) --
def run_peer(b: Bench, kind: str, compile_: bool, mb: int) -> dict:
    a, m = b.args, b.mfu
    name = f"{kind}-{'compile' if compile_ else 'eager'}-mb{mb}"
    row = {"section": "peers", "name": name, "framework": {"plain": "plain PyTorch", "hf": "HF LlamaForCausalLM"}[kind],
           "compile": compile_, "micro_batch": mb, "compile_scope": a.peer_compile_scope if compile_ else None}
    if kind == "hf":
        try:
            importlib.import_module("transformers")
        except ImportError:
            return b.skip("peers", name, "skipped: transformers is not installed")
    timeout = b.row_timeout(a.peer_compile_timeout_s if compile_ else a.mfu_timeout_s)
    if timeout is None:
        return b.skip("peers", name, "skipped: out of time budget")
    spec = {"kind": kind, "compile": a.peer_compile_scope if compile_ else False, "micro_batch": mb, "shape": a.mfu_shape, "device": a.device,
            "warmup": a.warmup, "iters": a.iters, "result": os.path.join(b.work, f"peer-{name}.json")}
    spec_path = os.path.join(b.work, f"peer-{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, PEERS, spec_path]
    proc = run_process(cmd, timeout, os.path.join(b.work, f"peer-{name}.log"))
    b.log(f"peer-{name}", proc, cmd)
    row["wall_s"] = proc["wall_s"]
    if proc["rc"] != 0 or proc["timed_out"] or not os.path.exists(spec["result"]):
        row.update(status="FAIL", reason=failure_reason(proc, timeout))
        return b.add(row)
    with open(spec["result"]) as f:
        res = json.load(f)
    times = res["step_times"]
    row.update(timed_stats(times[a.warmup:], mb * a.mfu_shape["seq"], m["flops_per_token"], a.peak_tflops))
    row.update(param_count=res["param_count"], losses=res["losses"], peak_memory_gib=res["peak_memory_gib"],
               warmup_s=sum(times[:a.warmup]), step_times=times)
    ours = m.get("ours_param_count")
    if not all(finite(x) for x in res["losses"]):
        row.update(status="FAIL", reason="non-finite loss")
    elif ours is not None and res["param_count"] != ours:
        row.update(status="FAIL", reason=f"{res['param_count']:,} parameters, ours {ours:,}: not the same model")
    else:
        row.update(status="PASS", reason="")
    return b.add(row)


def run_peers(b: Bench) -> None:
    a, m = b.args, b.mfu
    mb = m.get("best_micro_batch", a.mbs[0])
    peers = [("plain", False), ("plain", True), ("hf", True)] if not a.no_compile else [("plain", False), ("hf", False)]
    for kind, compile_ in peers:
        if f"{kind}-{'compile' if compile_ else 'eager'}" in a.skip:
            continue
        try:
            run_peer(b, kind, compile_, mb)
        except Exception as e:
            b.add({"section": "peers", "name": f"{kind}-{'compile' if compile_ else 'eager'}-mb{mb}", "status": "FAIL",
                   "wall_s": 0.0, "reason": f"bench error: {type(e).__name__}: {e}"})


def ratios(rows: List[dict]) -> List[tuple]:
    """(label, ours tokens/s / peer tokens/s) over the measured rows at the same micro-batch."""
    ok = [r for r in rows if r["section"] in ("mfu", "peers") and r["status"] == "PASS"]

    def pick(section, pred):
        hits = [r for r in ok if r["section"] == section and pred(r)]
        return max(hits, key=lambda r: r["tokens_per_sec"]) if hits else None

    out = []
    peers = [r for r in ok if r["section"] == "peers"]
    for p in peers:
        for comp in (False, True):
            ours = pick("mfu", lambda r: r["compile"] == comp and r["micro_batch"] == p["micro_batch"])
            if ours is not None and (p["compile"] == comp):
                tag = "compile" if comp else "eager"
                out.append((f"ours {tag} / {p['framework']} {tag} (mb {p['micro_batch']})",
                            ours["tokens_per_sec"] / p["tokens_per_sec"]))
    best_ours = pick("mfu", lambda r: True)
    for fw in ("plain PyTorch", "HF LlamaForCausalLM"):
        best_peer = max((r for r in peers if r["framework"] == fw), key=lambda r: r["tokens_per_sec"], default=None)
        if best_ours and best_peer:
            out.append((f"ours best ({best_ours['name']}) / {fw} best ({best_peer['name']})",
                        best_ours["tokens_per_sec"] / best_peer["tokens_per_sec"]))
    return out


# --- output ------------------------------------------------------------------------------------
def _fmt(x, spec="{:.1f}", none="-"):
    return none if x is None else spec.format(x)


def render(res: dict) -> str:
    info, m, rows = res["info"], res["mfu"], res["rows"]
    lines = [f"GPU benchmark ({'CPU smoke run at tiny sizes: no GPU figures' if info.get('device') == 'cpu' else info.get('device_name', '')})",
             "", f"- command: `{info.get('command', '')}`",
             f"- machine: {info.get('machine', '')}; torch {info.get('torch', '')}; transformers "
             f"{info.get('transformers', 'not installed')}",
             f"- total wall time: {res['wall_s']:.0f} s (budget {info.get('budget_s', 0):.0f} s)", ""]
    smoke = [r for r in rows if r["section"] == "smoke"]
    if smoke:
        lines += [f"Smoke: {info.get('smoke_shape_text', '')}, micro-batch {SMOKE_MB}, {SMOKE_ITERS} iterations each", "",
                  "| row | status | losses (first .. last) | wall s | note |", "| --- | --- | --- | ---: | --- |"]
        for r in smoke:
            ls = [x for x in r.get("losses") or [] if x is not None]
            loss = f"{ls[0]:.4f} .. {ls[-1]:.4f}" if ls else "-"
            lines.append(f"| {r['name']} | {r['status']} | {loss} | {r.get('wall_s', 0):.1f} | "
                         f"{(r.get('reason') or '').replace('|', '/')} |")
        lines.append("")
    perf = [r for r in rows if r["section"] in ("mfu", "peers")]
    if perf or m:
        lines += [f"MFU: {info.get('mfu_shape_text', '')}; {m.get('params_text', '')}",
                  f"- {FLOP_CONVENTION}; {m.get('flops_per_token', 0):.4g} FLOPs/token; peak "
                  f"{info.get('peak_tflops')} TFLOP/s (--peak-tflops)",
                  f"- {PRECISION_NOTE}; one micro-batch per step; median of {info.get('iters')} steps after "
                  f"{info.get('warmup')} warm-up steps; peers' torch.compile: {info.get('peer_compile_scope')}"
                  + ("; peak mem on the CPU: the process's peak RSS" if info.get("device") == "cpu" else ""), "",
                  "| run | mb | tokens/s | step ms | TFLOP/s/GPU | MFU | peak mem GiB | warm-up s | wall s | status |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in perf:
            fw = r.get("framework", "")
            lines.append(
                f"| {fw} {'compile' if r.get('compile') else 'eager'} | {r.get('micro_batch', '-')} | "
                f"{_fmt(r.get('tokens_per_sec'), '{:,.0f}')} | {_fmt(r.get('step_s_median') and r['step_s_median'] * 1e3)} | "
                f"{_fmt(r.get('tflops_per_gpu'), '{:.2f}')} | {_fmt(r.get('mfu'), '{:.1%}')} | "
                f"{_fmt(r.get('peak_memory_gib'), '{:.2f}')} | {_fmt(r.get('warmup_s'))} | {r.get('wall_s', 0):.1f} | "
                f"{r['status']}{(' - ' + r['reason'].replace('|', '/')) if r.get('reason') else ''} |")
        rat = ratios(rows)
        if rat:
            lines += ["", "Ratios of tokens/s (ours / peer; above 1: ours faster):", ""]
            lines += [f"- {label}: {x:.3f}" for label, x in rat]
        lines.append("")
    return "\n".join(lines)


def shape_text(s: dict) -> str:
    return (f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, SwiGLU {s['ffn']}, RMSNorm, RoPE, "
            f"seq {s['seq']}, vocab {s['vocab']}, untied")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the default on the CPU)")
    p.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.log")
    p.add_argument("--only", default="smoke,mfu,peers", help="sections to run: smoke, mfu, peers")
    p.add_argument("--skip", default="", help="rows to leave out, e.g. fp16,cp,compile,plain-compile,hf-compile")
    p.add_argument("--no-compile", action="store_true", help="no torch.compile row anywhere (HF peer runs eager)")
    p.add_argument("--mbs", default=None, help="micro-batch sweep of the MFU rows (default 2,4,8; tiny 1,2,4)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed steps per MFU / peer row")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 SXM: 989)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-run budget (default 450 on CUDA, 900 on CPU)")
    p.add_argument("--min-row-s", type=float, default=20.0, help="a row is skipped when less budget is left")
    p.add_argument("--jobs", type=int, default=None, help="smoke rows side by side (default 4 on CUDA, 1 on CPU)")
    p.add_argument("--smoke-timeout-s", type=float, default=150.0)
    p.add_argument("--smoke-compile-timeout-s", type=float, default=180.0)
    p.add_argument("--mfu-timeout-s", type=float, default=150.0)
    p.add_argument("--mfu-compile-timeout-s", type=float, default=300.0)
    p.add_argument("--peer-compile-timeout-s", type=float, default=240.0)
    p.add_argument("--peer-compile-scope", choices=["layer", "model"], default="layer",
                   help="peers' torch.compile: each transformer block (as ours) or the whole model")
    p.add_argument("--sweep-gain", type=float, default=1.02,
                   help="the sweep stops when a micro-batch gains less than this factor of tokens/s")
    p.add_argument("--resume-rtol", type=float, default=1e-3, help="CUDA: checkpoint round-trip loss tolerance")
    p.add_argument("--log-lines", type=int, default=60, help="lines of each row's output kept in OUT.log")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    args.tiny = args.tiny or cpu
    args.mfu_shape = SHAPES["tiny" if args.tiny else "llama-1.3b"]
    args.smoke_shape = SHAPES["tiny" if args.tiny else "smoke"]
    args.mbs = [int(x) for x in (args.mbs or ("1,2,4" if args.tiny else "2,4,8")).split(",")]
    args.only = {x.strip() for x in args.only.split(",") if x.strip()}
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if "compile" in args.skip:
        args.no_compile = True
    args.budget_s = args.budget_s or (900.0 if cpu else 450.0)
    args.jobs = args.jobs or (1 if cpu else 4)
    args.gpus = 0
    if not cpu:
        import torch
        args.gpus = torch.cuda.device_count()
    return args


def machine_info(args) -> dict:
    import torch
    info = {"device": args.device, "torch": torch.__version__, "command": " ".join([os.path.basename(sys.executable)]
            + [os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:]),
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
            "peak_tflops": args.peak_tflops, "peer_compile_scope": {"layer": "each transformer block",
                                                                   "model": "the whole model"}[args.peer_compile_scope],
            "budget_s": args.budget_s, "warmup": args.warmup, "iters": args.iters,
            "tiny": args.tiny, "mfu_shape": args.mfu_shape, "smoke_shape": args.smoke_shape,
            "mfu_shape_text": shape_text(args.mfu_shape), "smoke_shape_text": shape_text(args.smoke_shape)}
    if args.device == "cuda":
        info["device_name"] = f"{torch.cuda.get_device_name(0)} x {args.gpus}, CUDA {torch.version.cuda}"
        info["machine"] += f"; {info['device_name']}"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    b = Bench(args)
    b.info = machine_info(args)
    print(f"gpu_bench: device {args.device}{' (tiny)' if args.tiny else ''}, budget {args.budget_s:.0f} s, "
          f"work dir {b.work}", flush=True)
    try:
        if args.only & {"mfu", "peers"}:  # the shared arithmetic: our FLOPs and parameter count
            argv0 = ours_argv(args.mfu_shape, args.mbs[0], args.warmup + args.iters, args.device, ["--bf16"])
            b.mfu["flops_per_token"] = ours_flops_per_token(argv0)
            b.mfu["ours_param_count"] = ours_parameter_count(argv0)
            b.mfu["flop_convention"] = FLOP_CONVENTION
            b.mfu["params_text"] = f"{b.mfu['ours_param_count'] / 1e6:,.2f}M parameters (ours = each peer's)"
        for section, fn in (("smoke", run_smoke), ("mfu", run_mfu), ("peers", run_peers)):
            if section in args.only:
                fn(b)
    finally:
        b.write()
        report = render(b.result())
        print("\n" + report, flush=True)
    failed = [r["name"] for r in b.rows if r["status"] == "FAIL"]
    print(f"gpu_bench: {len(b.rows)} rows, {len(failed)} failed{(': ' + ', '.join(failed)) if failed else ''}; "
          f"{time.perf_counter() - b.start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
