"""Checkpoint conversion throughput and peak memory (issue 13): tools/convert_checkpoint.py on a
~1 GB random-weight Llama checkpoint.

The source is a save_pretrained-style directory (config.json, sharded model-0000i-of-0000n.safetensors
and model.safetensors.index.json) of a Llama of 253M parameters in fp32 (16 layers, h 1024, 16 heads
/ 8 KV groups, SwiGLU 2816, vocab 32000, untied output layer: 1.01 GB; the largest tensors are the
embedding and the output layer, 131 MB each). Its tensors are written straight with safetensors,
one shard in memory at a time (names and shapes from LlamaForCausalLM built on the meta device), and
cached in --work-dir. Then, each in a fresh process (`--child`), median over --repeats:

  hf-to-ml at TP 1, hf-to-ml at TP 2 x PP 2, ml-to-hf back from the TP2xPP2 checkpoint (and
  the same with --no-verify-checkpoint: no checksum pass over memory-mapped files), and a process
  that only imports the converter (the python + torch + transformers baseline).

A child imports tools/convert_checkpoint.py, resets its peak resident set (VmHWM, through
/proc/self/clear_refs), runs main(argv) while a thread samples RssAnon and RssFile of
/proc/self/status every 2 ms, and reports the conversion's wall time, VmHWM, and the sampled peaks
of anonymous memory (what the converter allocates) and of file-backed resident pages (memory maps:
reclaimable page cache, counted in RSS). The parent also takes the child's whole-process
ru_maxrss from os.wait4. GB/s = checkpoint bytes (1e9) / conversion wall time. After the runs the
round-trip HF directory's tensors are compared bitwise with the source's, so the figures are of a
working conversion.

    python benchmarks/bench_convert.py [--repeats 3] [--work-dir DIR] [--max-shard-size-gb 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


# --- the child: one conversion (or none) in a fresh process -----------------------------------
def _status_kib() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    return out


class _Sampler(threading.Thread):
    """Peaks of RssAnon and RssFile, sampled every `period` seconds (VmHWM is exact for their sum)."""

    def __init__(self, period: float = 0.002):
        super().__init__(daemon=True)
        self.period, self.stop, self.peak = period, threading.Event(), {"RssAnon": 0, "RssFile": 0}

    def sample(self) -> None:
        s = _status_kib()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], s[k])

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.period)


def child(argv) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import importlib

    import convert_checkpoint  # the imports a conversion pays before it starts

    transformers = importlib.import_module("transformers")  # hf-to-ml and ml-to-hf import these lazily
    transformers.AutoConfig, transformers.GenerationConfig, transformers.LlamaConfig

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident set
    base = _status_kib()
    sampler = _Sampler()
    sampler.sample()
    sampler.start()
    start = time.perf_counter()
    rc = convert_checkpoint.main(argv) if argv else 0
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    sampler.sample()
    end = _status_kib()
    return {"rc": rc, "wall_s": wall, "base_rss_kib": base["VmRSS"], "base_anon_kib": base["RssAnon"],
            "hwm_kib": end["VmHWM"], "peak_anon_kib": sampler.peak["RssAnon"],
            "peak_file_kib": sampler.peak["RssFile"], "end_anon_kib": end["RssAnon"], "end_file_kib": end["RssFile"]}


def run_child(argv) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(argv)],
                                cwd=ROOT, env=env, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (its peak RSS)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    process_wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"child {argv} failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"conversion {argv} returned {result['rc']}:\n{err[-3000:]}")
    result["process_wall_s"] = process_wall
    result["ru_maxrss_kib"] = usage.ru_maxrss
    return result


# --- the source checkpoint ----------------------------------------------------------------------
def build_source(hf_dir: str, shard_bytes: int, seed: int = 1234) -> None:
    """A random-weight Llama save_pretrained directory, written shard by shard."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")):
        return
    tmp = hf_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = LlamaConfig(**LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = [(n, t.shape) for n, t in LlamaForCausalLM(config).state_dict().items()]
    groups, size = [[]], 0
    for name, shape in shapes:
        n = shape.numel() * 4
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in group}
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    config.save_pretrained(tmp)
    os.replace(tmp, hf_dir)


def safetensors_files(d: str):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def tensor_stats(hf_dir: str):
    """(total bytes, largest tensor bytes, tensor count, file count) of a safetensors directory."""
    from megatron_lite.checkpoint.files import read_header

    sizes = []
    for path in safetensors_files(hf_dir):
        _, entries = read_header(path)
        entries.pop("__metadata__", None)
        sizes += [hi - lo for lo, hi in (e["data_offsets"] for e in entries.values())]
    return sum(sizes), max(sizes), len(sizes), len(safetensors_files(hf_dir))


def compare_bitwise(src_dir: str, back_dir: str) -> int:
    """Every tensor of src_dir is in back_dir with the same dtype, shape and bytes; returns the count."""
    import torch
    from safetensors import safe_open

    def where(d):
        out = {}
        for path in safetensors_files(d):
            with safe_open(path, framework="pt") as f:
                out.update({k: path for k in f.keys()})
        return out

    src, back = where(src_dir), where(back_dir)
    if set(src) != set(back):
        raise SystemExit(f"round trip changed the tensor names: missing {sorted(set(src) - set(back))[:3]}, "
                         f"extra {sorted(set(back) - set(src))[:3]}")
    for name in sorted(src):
        with safe_open(src[name], framework="pt") as a, safe_open(back[name], framework="pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                raise SystemExit(f"round trip changed {name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
    return len(src)


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


# --- the parent ----------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "megatron-lite-bench-convert"))
    p.add_argument("--source-shard-mb", type=int, default=300, help="largest source safetensors file (MB)")
    p.add_argument("--max-shard-size-gb", type=float, default=None,
                   help="ml-to-hf's --max-shard-size-gb (default: the tool's own default)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return

    sys.path.insert(0, ROOT)
    import torch

    os.makedirs(args.work_dir, exist_ok=True)
    hf_dir = os.path.join(args.work_dir, "llama-hf")
    t0 = time.perf_counter()
    build_source(hf_dir, args.source_shard_mb * 10**6)
    total, largest, count, nfiles = tensor_stats(hf_dir)
    print(f"source {hf_dir}: {count} tensors, {total / 1e9:.3f} GB in {nfiles} files, largest tensor "
          f"{largest / MIB:.0f} MiB (ready in {time.perf_counter() - t0:.1f} s)")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")

    tp1, tp2pp2, back = (os.path.join(args.work_dir, n) for n in ("ml-tp1", "ml-tp2pp2", "hf-back"))
    shard = [] if args.max_shard_size_gb is None else ["--max-shard-size-gb", str(args.max_shard_size_gb)]
    cases = [
        ("import only (baseline)", None, []),
        ("hf-to-ml TP1", tp1, ["hf-to-ml", "--hf-dir", hf_dir, "--out", tp1]),
        ("hf-to-ml TP2xPP2", tp2pp2, ["hf-to-ml", "--hf-dir", hf_dir, "--out", tp2pp2,
                                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        ("ml-to-hf from TP2xPP2", back, ["ml-to-hf", "--load", tp2pp2, "--out", back] + shard),
        ("ml-to-hf, --no-verify-checkpoint", back + "-nv",
         ["ml-to-hf", "--load", tp2pp2, "--out", back + "-nv", "--no-verify-checkpoint"] + shard),
    ]
    results = {name: [] for name, _, _ in cases}
    loads = [os.getloadavg()]
    for r in range(args.repeats):
        for name, out, argv in cases:
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            res = run_child(argv)
            if out is not None:
                res["out_bytes"] = dir_bytes(out)
            results[name].append(res)
            print(f"repeat {r + 1} {name}: {res['wall_s']:.2f} s, VmHWM {res['hwm_kib'] / 1024:.0f} MiB, "
                  f"peak anon {res['peak_anon_kib'] / 1024:.0f} MiB, peak file-backed "
                  f"{res['peak_file_kib'] / 1024:.0f} MiB, load {os.getloadavg()[0]:.2f}", flush=True)
        loads.append(os.getloadavg())

    n = compare_bitwise(hf_dir, back)
    print(f"round trip: all {n} tensors of {back} equal the source's bitwise")

    med = lambda name, key: statistics.median(x[key] for x in results[name])  # noqa: E731
    base = med("import only (baseline)", "hwm_kib") * 1024
    base_anon = med("import only (baseline)", "base_anon_kib") * 1024
    print(f"\ncheckpoint {total / 1e9:.3f} GB ({total / MIB:.0f} MiB), largest tensor {largest / MIB:.0f} MiB; "
          f"import baseline RSS {base / MIB:.0f} MiB (anonymous {base_anon / MIB:.0f} MiB), its process "
          f"{med('import only (baseline)', 'process_wall_s'):.2f} s; median of {args.repeats}")
    print("| conversion | wall (s) | GB/s | process wall (s) | written (MiB) | peak RSS (MiB) | peak RSS - "
          "baseline (MiB) | / largest tensor | / checkpoint | peak anonymous - baseline (MiB) | peak file-backed "
          "(MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, out, _ in cases[1:]:
        wall, hwm = med(name, "wall_s"), med(name, "hwm_kib") * 1024
        anon = med(name, "peak_anon_kib") * 1024 - base_anon
        grow = hwm - base
        print(f"| {name} | {wall:.2f} | {total / 1e9 / wall:.2f} | {med(name, 'process_wall_s'):.2f} | "
              f"{med(name, 'out_bytes') / MIB:.0f} | {hwm / MIB:.0f} | {grow / MIB:.0f} | {grow / largest:.2f} | "
              f"{grow / total:.2f} | {anon / MIB:.0f} | {med(name, 'peak_file_kib') / 1024:.0f} |")
    print("\nwhole-process ru_maxrss (os.wait4, imports included), median: " + ", ".join(
        f"{name} {med(name, 'ru_maxrss_kib') / 1024:.0f} MiB" for name, _, _ in cases))
    print("load averages (1, 5, 15 min) before and after each repeat: " + "; ".join(
        ", ".join(f"{x:.2f}" for x in la) for la in loads))


if __name__ == "__main__":
    main()
