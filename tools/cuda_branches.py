"""The CUDA-only branches of a source tree, and which of them a run reached.

A branch site is an `if` statement or conditional expression whose test names CUDA (`is_cuda`,
`.type == "cuda"`, `torch.cuda.is_available()`, an attribute called `cuda`, ...) or compares a
device type with "cpu". A recorder
traces the lines run in those files while it is entered (sys.settrace, only for frames of files
that hold a site) and reports each site as reached (its test ran) or not reached, with the reason
known for the files that no single-process fake run can reach.
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set, Tuple

# Why a site in these files is out of a fake single-process run's reach (path suffix -> why).
UNREACHABLE = {
    "training/loop.py": "device choice and NCCL start-up come before the Trainer (launch.py); the dry run builds "
                        "the Trainer itself on a gloo world of one process",
    "training/profiling.py": "only with --profile / --record-memory-history; the CUDA profiler and memory snapshots "
                             "need the driver (cudart, _record_memory_history)",
    "transformer/te_backend.py": "Transformer Engine is not installed (no CPU build)",
    "transformer/core_attention.py": "flash-attn is not installed (a CUDA-only package)",
    "kernels/block_attention.py": "block attention serves packed sequences, windows and CP ring steps, not these "
                                  "models' plain causal attention; its fused CUDA kernels are opt-in "
                                  "(MEGATRON_LITE_FUSED_ATTENTION_CUDA=1)",
    "parallel/offload.py": "activation offload: only with --cpu-offloading (pass it after --)",
    "parallel/param_offload.py": "parameter offload: only with ZeRO-3 parameter offload",
    "optim/nvme_store.py": "the optimizer's NVMe store: only with --optimizer-offload-nvme-path",
    "optim/state_store.py": "the optimizer's host store: only with --optimizer-cpu-offload",
    "checkpoint/": "no checkpoint is saved or loaded in a dry run",
    "parallel/pipeline/": "pipeline parallelism needs several ranks",
}


def _mentions_cuda(node: ast.AST) -> bool:
    """A test naming CUDA, or comparing a device type with "cpu" (whose other side is CUDA's)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value == "cuda":
            return True
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and n.left.attr == "type" and any(
                isinstance(c, ast.Constant) and c.value == "cpu" for c in n.comparators):
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("is_cuda", "cuda"):
            return True
        if isinstance(n, ast.Name) and n.id == "fused_cuda":
            return True
    return False


def branch_sites(path: str) -> List[int]:
    """The line numbers of the CUDA branch tests in one file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return sorted({n.test.lineno for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp)) and _mentions_cuda(n.test)})


def scan(root: str) -> Dict[str, List[int]]:
    """file -> its CUDA branch lines, for every .py file under root."""
    sites = {}
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                lines = branch_sites(path)
                if lines:
                    sites[os.path.abspath(path)] = lines
    return sites


class BranchRecorder:
    """While entered, records which CUDA branch sites under `root` run."""

    def __init__(self, root: str):
        self.sites = scan(root)
        self.reached: Set[Tuple[str, int]] = set()
        self._previous = None

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno in self.sites[frame.f_code.co_filename]:
            self.reached.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.sites else None

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False

    def not_reached(self) -> List[Tuple[str, int]]:
        return [(f, n) for f, lines in self.sites.items() for n in lines if (f, n) not in self.reached]

    def report(self, repo: str) -> str:
        out = [f"CUDA branches reached ({len(self.reached)}):"]
        out += [f"  {os.path.relpath(f, repo)}:{n}: {_line(f, n)}" for f, n in sorted(self.reached)]
        missing = self.not_reached()
        out.append(f"CUDA branches not reached ({len(missing)}):")
        for f, n in missing:
            rel = os.path.relpath(f, repo)
            why = next((w for k, w in UNREACHABLE.items() if k in rel), "not on the path this run takes")
            out.append(f"  {rel}:{n}: {_line(f, n)}  -- {why}")
        return "\n".join(out)


def _line(path: str, lineno: int) -> str:
    with open(path) as f:
        return f.read().splitlines()[lineno - 1].strip()[:100]
