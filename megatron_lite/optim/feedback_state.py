"""Each rank's own compression errors in a checkpoint (1-bit / 0/1 Adam's, --grad-comm-dtype's,
qgZ's with --zeropp-qgz-error-feedback).

A checkpoint holds the errors twice. Folded over the ranks (`grad_residual`, `exp_avg_residual`:
sharded like the optimizer state) they load at any layout. Each rank's own, as they are, keyed by
its coordinates (like its RNG states): a load at the writing layout restores these instead, so a
run that saves goes on bit-identically to one that does not, and its resumption does too. Saving
reads the errors and never changes them.

With 0/1 Adam's local steps pending at a save, the checkpoint's params, m and residual are their
synchronisation computed on copies (what a load at any layout starts from), and each rank's own
main params, m, anchor, LR sums and step are stored here too (`local_steps`), restored with the
errors at the writing layout.
"""
from __future__ import annotations

from typing import Dict, List

import torch

FEEDBACK = "feedback"  # the checkpoint's key prefix: feedback/<rank coordinates>/b<bucket>/<state>/<part>
LOCAL_STEPS = "local_steps"  # the <state> of 0/1 Adam's pending local steps


def _handlers(optimizer) -> List[object]:
    """The optimizer's error-feedback holders that checkpoint errors (its gradient reducer, its rule)."""
    return [h for h in (optimizer.sync.reducer, optimizer.rule) if hasattr(h, "own_errors")
            and getattr(h, "checkpoints_residual", True)]


def own_errors(optimizer) -> Dict[str, torch.Tensor]:
    """{"b<bucket>/<state>/<part>": copy} of this rank's errors (after shard_tensors() folded them)
    and of 0/1 Adam's pending local steps."""
    handlers = _handlers(optimizer)
    out = {f"b{s.bucket.index}/numel": torch.tensor([s.bucket.numel]) for s in optimizer.shards} if handlers else {}
    for h in handlers:
        for s in optimizer.shards:
            for part, t in h.own_errors(s.bucket).items():
                out[f"b{s.bucket.index}/{h.residual_name}/{part}"] = t
    local = getattr(optimizer.rule, "own_local_state", None)
    for s in optimizer.shards if local is not None else ():
        for part, t in local(s).items():
            out[f"b{s.bucket.index}/{LOCAL_STEPS}/{part}"] = t
    return out


def restore_own_errors(optimizer, saved: Dict[str, torch.Tensor]) -> bool:
    """After a load filled the folded residuals (and synchronised state): this rank's own errors
    (and pending local steps) instead, when `saved` (as own_errors() wrote it) fits every bucket;
    False (the folded ones stay) when it does not."""
    buckets = {k: int(v[0]) for k, v in saved.items() if k.endswith("/numel")}
    if buckets != {f"b{s.bucket.index}/numel": s.bucket.numel for s in optimizer.shards}:
        return False  # another bucket plan (--ddp-bucket-size): the rows mean other elements
    plan = []
    for h in _handlers(optimizer):
        for s in optimizer.shards:
            prefix = f"b{s.bucket.index}/{h.residual_name}/"
            mine = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
            live = h.own_errors(s.bucket)  # (zeros of the right shapes after residual_for_loading)
            if any(part in live and live[part].shape != t.shape for part, t in mine.items()):
                return False
            plan.append((h, s.bucket, mine))
    local = []
    for s in optimizer.shards:
        prefix = f"b{s.bucket.index}/{LOCAL_STEPS}/"
        mine = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        if mine and mine["main"].shape != s.store.tensors["main"].shape:
            return False
        if mine:
            local.append((s, mine))
    for h, bucket, mine in plan:
        h.restore_own_errors(bucket, mine)
    for s, mine in local:
        optimizer.rule.restore_local_state(s, mine)
    return True
