"""Delayed FP8 scaling (`--fp8-recipe delayed`, Megatron-LM's default recipe): each FP8 GEMM's three
tensors (input, weight, output gradient) are scaled by a scale computed from an amax history
BEFORE the step sees them; the step's amaxes are only recorded.

The recipe state: per GEMM, keyed by its weight's global parameter name (the same on every TP
rank, and at every layout; an expert's GEMMs by `<stacked weight's name>.<global expert>`, and
every rank of the stage folds every expert's, 0 for those EP puts elsewhere, so the MAX over
the group is the expert's amax at any EP / ETP / CP), an amax history [3 tensors, --fp8-amax-history-len] (newest first)
and the 3 scales. Each quantization records its local amax into the step's pending maximum
(micro-batches, recomputation and evaluation passes fold by MAX); once per applied optimizer
step (`after_update`) the pending amaxes are MAX-all-reduced over the stage's TP x DP x CP
ranks (TE's amax reduction group: a tensor split over TP / SP / CP, and the DP ranks' different
micro-batches of one global batch, all agree), pushed into the histories, and the scales become
fp8 max / amax / 2^margin with amax the history's max (`max`) or newest entry (`most_recent`);
an amax of 0 (or one so small that the scale overflows) keeps the previous scale (with
--fp8-param-gather at ZeRO-1/2 the fold runs just before the updated weights are gathered, which
need the next step's scales: fold_before_gather). A GEMM with no folded step yet (the first step, or a
checkpoint without this state) uses current scaling, as torchao's delayed scaling initializes
from the first amax, instead of TE's scale 1 that flushes small gradients to zero.

The state is saved as a checkpoint value by global name (gathered over pipeline stages), so it
reshards with the checkpoint (TP/DP/CP: replicated; PP: each stage takes its layers).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

ROLES = ("input", "weight", "grad")
CHECKPOINT_NAME = "fp8_delayed_scaling"


class DelayedScaling:
    """The recipe state and its step hooks (before_step / after_update / metrics)."""

    def __init__(self, dtypes, history_len: int = 1, algo: str = "most_recent", margin: int = 0, dims=None,
                 device=None):
        assert algo in ("max", "most_recent") and history_len >= 1, (algo, history_len)
        self.fmax = torch.tensor([torch.finfo(dtypes[r]).max for r in ROLES], dtype=torch.float32, device=device)
        self.history_len, self.algo, self.margin, self.dims, self.device = history_len, algo, margin, dims, device
        self.history: Dict[str, torch.Tensor] = {}  # name -> [3, history_len], newest first
        self.scale: Dict[str, torch.Tensor] = {}  # name -> [3]
        self.folds: Dict[str, int] = {}  # name -> steps folded into its history
        self.pending: Dict[str, torch.Tensor] = {}  # name -> [3]: this step's amaxes so far
        self.loaded: dict = {}  # a checkpoint's entries, taken by each GEMM when first seen
        self.expected: List[str] = []  # the stage's GEMMs (bind): folded even where a rank runs none (experts)
        self.observed = False  # amaxes recorded since the step began
        self.folded_early = False  # this step's fold ran before the ZeRO-1/2 FP8 param gather

    def _entry(self, name: str) -> None:
        if name in self.history:
            return
        saved = self.loaded.get(name)
        hist = torch.zeros(3, self.history_len, device=self.device)
        if saved is not None:  # a shorter or longer saved history keeps its newest entries
            old = torch.tensor(saved["amax_history"], dtype=torch.float32, device=self.device)[:, :self.history_len]
            hist[:, :old.shape[1]] = old
        self.history[name] = hist
        self.scale[name] = (torch.tensor(saved["scale"], dtype=torch.float32, device=self.device) if saved is not None
                            else torch.ones(3, device=self.device))
        self.folds[name] = saved["folds"] if saved is not None else 0
        self.pending[name] = torch.zeros(3, device=self.device)

    def expect(self, names) -> None:
        self.expected = sorted(set(self.expected).union(names))

    # --- the GEMM path's side -------------------------------------------------------------------
    def scale_of(self, name: str, role: str) -> Optional[torch.Tensor]:
        """The scale this step uses for `role` of GEMM `name`; None before its first fold."""
        self._entry(name)
        return self.scale[name][ROLES.index(role)] if self.folds[name] else None

    def observe(self, name: str, role: str, amax: torch.Tensor) -> None:
        self._entry(name)
        i = ROLES.index(role)
        self.pending[name][i] = torch.maximum(self.pending[name][i], amax.float())
        self.observed = True

    # --- step hooks -------------------------------------------------------------------------------
    def before_step(self, iteration: int) -> None:
        for p in self.pending.values():  # a skipped step's (or evaluation's) amaxes are not kept
            p.zero_()
        self.observed = self.folded_early = False

    def fold_before_gather(self) -> bool:
        """Collective (as after_update): fold this step's amaxes now, before ZeRO-1/2 gathers the
        updated weights in FP8 with the next step's scales (--fp8-param-gather), and tell whether
        a step ran (False at a checkpoint load: nothing folded, the weights gathered exactly)."""
        if self.folded_early or not self.observed:
            return self.folded_early
        self.after_update()
        self.folded_early = True
        return True

    def after_update(self) -> None:
        if self.folded_early:  # the param gather folded this step already
            self.folded_early = False
            return
        for name in self.expected:  # an expert held by other EP ranks folds their amaxes (0 here)
            self._entry(name)
        if not self.pending:
            return
        names = sorted(self.pending)  # the same GEMMs, in the same order, on every rank of the group
        amax = torch.stack([self.pending[n] for n in names])
        group = self.dims.tp_dp_cp_group if self.dims is not None else None
        if group is not None:
            self.dims.comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        for name, a in zip(names, amax):
            self.fold(name, a)
        self.observed = False

    def fold(self, name: str, amax: torch.Tensor) -> None:
        """Push one step's amaxes [3] into the history and recompute the scales."""
        self._entry(name)
        hist = torch.cat([amax[:, None].to(self.history[name]), self.history[name][:, :-1]], dim=1)
        self.history[name] = hist
        use = hist.amax(dim=1) if self.algo == "max" else hist[:, 0]
        new = self.fmax / use / 2.0 ** self.margin
        self.scale[name] = torch.where((use > 0) & torch.isfinite(new), new, self.scale[name])
        self.folds[name] += 1

    def metrics(self) -> dict:
        return {}

    # --- checkpoints ------------------------------------------------------------------------------
    def local_state(self) -> dict:
        return {n: {"amax_history": self.history[n].tolist(), "scale": self.scale[n].tolist(), "folds": self.folds[n]}
                for n in sorted(self.history)}

    def state_dict(self) -> dict:
        """Collective over the pipeline stages: every GEMM's state by global name."""
        layers = self.local_state()
        group = self.dims.pp_group if self.dims is not None else None
        if group is not None:
            parts: List[Optional[dict]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, layers, group=group)
            layers = {k: v for part in parts for k, v in part.items()}
        return {"amax_history_len": self.history_len, "amax_compute_algo": self.algo, "layers": layers}

    def load_state_dict(self, saved: Optional[dict]) -> List[str]:
        self.history, self.scale, self.folds, self.pending = {}, {}, {}, {}
        self.loaded = dict(saved["layers"]) if saved else {}
        if not saved:
            return ["the checkpoint has no FP8 delayed-scaling state: the amax histories start fresh"]
        return []


def register_checkpoint_state(state, recipe: Optional[DelayedScaling]) -> None:
    """The delayed-scaling state as the checkpoint value `fp8_delayed_scaling`; a run without
    delayed scaling writes none and ignores a saved one with a note."""
    def restore(saved, meta):
        if recipe is not None:
            return recipe.load_state_dict(saved)
        if saved:
            return ["the checkpoint's FP8 delayed-scaling state (amax histories) is not used by this run"]
        return []

    state.register(CHECKPOINT_NAME, recipe.state_dict if recipe is not None else None, progress=restore)
