#!/usr/bin/env python
"""A fake-CUDA dry run: one training step (forward, backward, optimizer step) of pretrain_gpt's
Trainer with `--device cuda` on a machine without a GPU, for bf16 and each FP8 recipe.

    python tools/fake_cuda_dry_run.py                                  # both models, every recipe
    python tools/fake_cuda_dry_run.py --models moe-mla-tiny --recipes rowwise
    python tools/fake_cuda_dry_run.py --models llama-1.3b -- --cpu-offloading   # extra trainer flags

Under tools/fake_cuda.py's `fake_cuda()` the tensors are `cuda` fake tensors (no memory: the 1.3B
model costs nothing), and each operator runs its meta kernel, which checks the CUDA kernel's rules
(torch._scaled_mm: a row-major left and column-major right operand, multiples of 16, scale shapes
per recipe; SDPA's; grouped GEMM's). Models: `llama-1.3b`, the MFU model of benchmarks/gpu_bench.py
(the same flags), `mla-tiny` (multi-latent attention), and `moe-mla-tiny` (4 experts top-2, grouped
GEMM, MLA), which fake tensors cannot run yet: the routing's token counts are data (`nonzero`,
`.tolist()` split sizes), and a fake tensor has no data. It is not in the default set.
A refusal is a finding, reported with the project's line it came from. The report then lists the
CUDA-only branches of megatron_lite/ that ran and those that did not, with why where known.
Exit status: 0 when every step completed, 1 otherwise, 2 for a bad command line.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import traceback
from typing import Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.cuda_branches import BranchRecorder  # noqa: E402
from tools.fake_cuda import fake_cuda  # noqa: E402

RECIPES = ("bf16", "tensorwise", "rowwise", "delayed", "blockwise")
FP8 = {r: ["--fp8-format", "hybrid", "--fp8-recipe", r] for r in RECIPES if r != "bf16"}
MLA = ["--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "32",
       "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2"]


def model_argv(model: str) -> List[str]:
    """pretrain_gpt.py's flags of a dry-run model (one micro-batch, one iteration, on cuda)."""
    from benchmarks.gpu_bench import SHAPES, ours_argv

    if model == "llama-1.3b":
        return ours_argv(SHAPES["llama-1.3b"], 1, 1, "cuda", ["--bf16"])
    shape = dict(layers=2, hidden=128, heads=4, ffn=256, seq=128, vocab=256)
    if model == "mla-tiny":
        return ours_argv(shape, 2, 1, "cuda", ["--bf16"] + MLA)
    if model == "moe-mla-tiny":
        return ours_argv(shape, 2, 1, "cuda", ["--bf16"] + MOE + MLA)
    raise ValueError(model)


MODELS = ("llama-1.3b", "mla-tiny", "moe-mla-tiny")
DEFAULT_MODELS = ("llama-1.3b", "mla-tiny")  # moe-mla-tiny: blocked (routing's data-dependent shapes)


def _finding(e: BaseException) -> str:
    """One line: the error and the last frame of the project's own code it passed through."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename.startswith(REPO) and os.sep + "tools" + os.sep not in f.filename]
    at = f" at {os.path.relpath(frames[-1].filename, REPO)}:{frames[-1].lineno}" if frames else ""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}{at}"


def one_step(argv: List[str]) -> dict:
    """Build pretrain_gpt's Trainer for `argv` and train one iteration under fake CUDA; its record."""
    from pretrain_gpt import make_trainer, resolve

    cfg, tokenizer = resolve(argv)
    with fake_cuda() as reads, contextlib.redirect_stdout(io.StringIO()):
        trainer = make_trainer(cfg, tokenizer, torch.device("cuda", 0))
        records = trainer.train()
    assert len(records) == 1 and records[0]["iteration"] == 1, records
    return dict(records[0], host_reads=reads.count)


@contextlib.contextmanager
def single_process_world():
    """A gloo world of one process (the Trainer's collectives go through it), unless one exists."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def dry_run(models, recipes, extra: List[str] = (), recorder: Optional[BranchRecorder] = None) -> Dict[tuple, List[str]]:
    """(model, recipe) -> findings (empty: the step completed)."""
    results = {}
    with single_process_world(), (recorder or contextlib.nullcontext()):
        for model in models:
            for recipe in recipes:
                argv = model_argv(model) + FP8.get(recipe, []) + list(extra)
                try:
                    one_step(argv)
                    results[(model, recipe)] = []
                except Exception as e:  # noqa: BLE001 - every refusal is a finding to report
                    results[(model, recipe)] = [_finding(e)]
    return results


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated: " + ", ".join(RECIPES))
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    models, recipes = [m for m in args.models.split(",") if m], [r for r in args.recipes.split(",") if r]
    for given, known, what in ((models, MODELS, "model"), (recipes, RECIPES, "recipe")):
        unknown = [x for x in given if x not in known]
        if unknown:
            print(f"error: unknown {what}(s) {', '.join(unknown)}: use {', '.join(known)}", file=sys.stderr)
            return 2
    os.environ.setdefault("WORLD_SIZE", "1")
    recorder = BranchRecorder(os.path.join(REPO, "megatron_lite"))
    results = dry_run(models, recipes, extra, recorder)
    print("fake-CUDA dry run: one training step (forward, backward, optimizer step), --device cuda"
          + (f", extra flags: {' '.join(extra)}" if extra else ""))
    for (model, recipe), findings in results.items():
        print(f"  {model:<13} {recipe:<11} {'PASS' if not findings else 'FAIL'}")
        for f in findings:
            print(f"      finding: {f}")
    print(recorder.report(REPO))
    return 0 if not any(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
