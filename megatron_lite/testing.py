"""A small multi-process harness: run fn(rank, world_size, *args) on N forked gloo ranks.

Forked workers with a file store start in a fraction of a second (spawn or torchrun cost
seconds of torch import on a small machine). Each worker's return value comes back in rank
order; if any rank raises, the others are stopped and its traceback is re-raised here.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    pass


class Exited(int):
    """The result of a rank that ended its process itself (os._exit) without returning: its exit code."""


def _worker(rank: int, world_size: int, tmp: str, fn: Callable, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmp, f"result_{rank}.pt"), "wb") as f:
            torch.save(result, f)
        if dist.is_initialized():  # fn may have ended the world itself (pretrain_gpt.main does)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures, to the parent
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0, daemon: bool = True,
                    exits: bool = False) -> List[Any]:
    """Run fn(rank, world_size, *args) on `world_size` forked ranks; return the results by rank.
    `daemon=False` for ranks that start processes of their own (a daemonic process may not:
    e.g. Megatron-Core's checkpoint writer forks one per file); they are killed here all the same.
    `exits`: a rank that ended its process (os._exit) before the deadline gives `Exited(code)`."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world_size, tmp, fn, args), daemon=daemon)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = []
        while any(p.is_alive() for p in procs):
            failed = [r for r in range(world_size) if os.path.exists(os.path.join(tmp, f"error_{r}.txt"))]
            if failed or time.monotonic() > deadline:
                time.sleep(0.2)  # let other failing ranks write their reports too
                break
            time.sleep(0.01)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp, f"error_{r}.txt")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n{open(path).read()}")
        if errors:
            raise WorkerError("distributed worker failed:\n" + "\n".join(errors))
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"result_{r}.pt")
            if not os.path.exists(path) and exits and p.exitcode is not None and p.exitcode >= 0 \
                    and time.monotonic() <= deadline:
                results.append(Exited(p.exitcode))
                continue
            if not os.path.exists(path):
                why = "timed out" if time.monotonic() > deadline else f"exit code {p.exitcode}"
                raise WorkerError(f"rank {r} returned no result ({why})")
            with open(path, "rb") as f:
                results.append(torch.load(f, weights_only=False))
        return results


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 0.0, what: str = ""):
    """Relative error in norm: ||actual - expected|| <= atol + rtol * ||expected|| (float64 math)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).norm().item()
    scale = expected.norm().item()
    assert err <= atol + rtol * scale, f"{what}: |diff| {err:.3e} > {atol:.1e} + {rtol:.1e} * |ref| {scale:.3e}"


def assert_state_close(actual: dict, expected: dict, rtol: float = 1e-5, what: str = ""):
    """Every tensor within rtol of its own norm, or of the whole state's norm for tensors that are
    nearly zero-signal: e.g. attention K biases, whose true gradient is exactly zero (softmax is
    shift-invariant), so Adam turns float rounding noise in that gradient into lr-sized steps."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(set(actual) ^ set(expected))}"
    total = sum(t.double().pow(2).sum() for t in expected.values()).sqrt().item()
    for name in expected:
        assert_close(actual[name], expected[name], rtol=rtol, atol=rtol * total, what=f"{what} {name}")


def assert_same_run(reference, other, rtol: float = 1e-5, grad_norm_rtol: float = None, params=None,
                    ref_params=None, what: str = ""):
    """Two runs agree: the same number of iterations, and per iteration `lm_loss` and `grad_norm`
    within rtol of the reference; then, where given, the final parameters (`assert_state_close`).
    `grad_norm_rtol` (if given) holds the first iteration's grad norm, computed from the same
    weights in both runs, to a tighter bound; later grad norms are held to 10 x rtol: Adam's
    normalized steps turn the layouts' rounding differences in tiny gradient elements into
    parameter differences that move the gradient more than the loss. `reference` / `other`:
    lists of per-iteration records (dicts with 'lm_loss' and optionally 'grad_norm'), or plain
    lists of losses."""
    def as_records(run):
        return [r if isinstance(r, dict) else {"lm_loss": r} for r in run]

    ref, got = as_records(reference), as_records(other)
    assert len(got) == len(ref), f"{what}: {len(got)} iterations vs {len(ref)} in the reference"
    for i, (a, b) in enumerate(zip(got, ref)):
        gn_rtol = (grad_norm_rtol if grad_norm_rtol is not None else rtol) if i == 0 else 10 * rtol
        for key, tol in (("lm_loss", rtol), ("grad_norm", gn_rtol)):
            if b.get(key) is None:
                continue
            assert a.get(key) is not None, f"{what}: iteration {i + 1} has no {key}"
            assert abs(a[key] - b[key]) <= tol * abs(b[key]), \
                f"{what}: iteration {i + 1}: {key} {a[key]!r} vs reference {b[key]!r} (rtol {tol:.0e})"
    if params is not None:
        assert_state_close(params, ref_params, rtol=rtol, what=f"{what} parameters")


__all__ = ["run_distributed", "assert_close", "assert_state_close", "assert_same_run", "WorkerError", "Exited"]
