"""Replay pipeline action lists: timelines, bubbles, memory, and a deadlock/consistency checker.

The replay models the executor described in `schedules.py`: each rank runs its list in order; a
compute action starts when the rank is free and its data dependencies are done (F of stage s
needs F of s - 1, B/BW needs its own F and the B of s + 1, W needs its B), plus `comm_cost` when
the producer is on another rank. Comm batches (consecutive comm actions) follow `comm`:
  "lazy"     (default) post the batch; wait for it only before a compute that uses one of its
             receives, before the rank's next batch, and at the end of the list;
  "blocking" wait for each batch where it stands;
  "ideal"    ignore comm actions: data dependencies only (lists without comm replay the same).
Each op of a batch completes `comm_cost` after both it and its FIFO partner are posted.

Stages and peers come from the StagePlacement the lists are written for (default: loop); a hop
between two chunks of one rank is a local hand-off: no comm action, no comm cost.

Costs are per action of one model chunk: F, B, W; BW costs B + W. Bubble fraction per rank =
idle / busy within the makespan (comm waits count as idle). In-flight micro-batches per rank =
(microbatch, chunk) pairs whose F has started and whose B/BW has not finished: the activations
the rank holds (zb-h1 and zb-v keep part of them until W; that tail is not counted).

Overlapped pairs (`pair_cost`): each BW followed at once by an F in a list (DualPipe-V's pairs,
`build_schedule(..., overlap=True)`) runs as one unit: it starts when both its actions could
start and costs `pair_cost` (DeepSeek's F&B) times the mean weight of their two stages; both end
with it. Busy time counts the pair once; its F holds activations from the start, its BW frees at
the end, so a pair holds both micro-batches at once.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import (
    COMM_KINDS, COMPUTE_KINDS, COMM_STEP, Action, comm_peer, event_of, group_steps, message_id, needs)


class ScheduleError(ValueError):
    """An action list that is inconsistent or would deadlock."""


@dataclass
class SimResult:
    timelines: List[List[Tuple[float, float, Action]]]  # per rank, compute actions only
    makespan: float
    busy: List[float]
    bubble: List[float]  # idle / busy per rank
    peak_in_flight: List[int]
    num_stages: int = 1


def _shape(schedules: Sequence[Sequence[Action]], placement=None) -> Tuple[StagePlacement, int]:
    """(placement, m) of the lists: `placement` (checked against them), else loop with their p and v."""
    acts = [a for lst in schedules for a in lst]
    if not schedules or not acts:
        raise ScheduleError("empty schedule")
    p, v = len(schedules), max(a.chunk for a in acts) + 1
    placement = placement or StagePlacement(p, v)
    if placement.pp != p or placement.vpp < v:
        raise ScheduleError(f"{p} ranks with {v} chunks do not fit the placement {placement}")
    return placement, max(a.microbatch for a in acts) + 1


def _pair_ops(steps: List[List], placement: StagePlacement) -> Dict[Tuple[int, int, int], Tuple[int, int]]:
    """Map (rank, step, op) of every comm op to (rank, step) of its FIFO partner.

    Raises if the k-th send on a rank pair does not carry the same message as the k-th receive."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, rank_steps in enumerate(steps):
        for j, step in enumerate(rank_steps):
            if isinstance(step, Action):
                continue
            for o, a in enumerate(step):
                peer = comm_peer(a, r, placement)
                chan, book = ((r, peer), sends) if a.kind.startswith("SEND") else ((peer, r), recvs)
                book[chan].append((r, j, o, a))
    partner = {}
    for chan in set(sends) | set(recvs):
        s_list, r_list = sends.get(chan, []), recvs.get(chan, [])
        for k, ((sr, sj, so, sa), (rr, rj, ro, ra)) in enumerate(zip(s_list, r_list)):
            if message_id(sa, sr, placement) != message_id(ra, rr, placement):
                raise ScheduleError(f"FIFO mismatch on channel {sr}->{rr}, message #{k}: rank {sr} "
                                    f"sends {sa} but rank {rr} receives {ra}")
            partner[(sr, sj, so)] = (rr, rj)
            partner[(rr, rj, ro)] = (sr, sj)
        if len(s_list) != len(r_list):
            k = min(len(s_list), len(r_list))
            lone_r, _, _, lone = (s_list if len(s_list) > k else r_list)[k]
            other = "receive" if lone.kind.startswith("SEND") else "send"
            raise ScheduleError(f"rank {lone_r}: {lone} has no matching {other} on channel {chan[0]}->{chan[1]}")
    return partner


COMM_MODES = ("lazy", "blocking", "ideal")


class _Replay:
    """Event-driven replay of per-rank lists. Ranks advance while they can; none can: deadlock.

    Comm modes: "blocking" waits for each batch where it stands; "lazy" posts a batch and waits
    for it only before a compute that uses one of its receives, before posting the rank's next
    batch, and at the end of the list; "ideal" ignores comm actions (data dependencies only).
    Any rank's progress only ever unblocks others, so one completed run proves every run completes."""

    def __init__(self, schedules, costs: Dict[str, float], comm_cost: float, mode: str, placement=None,
                 stage_weights: Optional[Sequence[float]] = None, pair_cost: Optional[float] = None):
        if mode not in COMM_MODES:
            raise ValueError(f"comm mode {mode!r} is not one of {COMM_MODES}")
        self.placement, _ = _shape(schedules, placement)
        n = self.placement.num_stages
        self.weights = list(stage_weights) if stage_weights is not None else [1.0] * n
        if len(self.weights) != n or min(self.weights) < 0:
            raise ValueError(f"stage_weights must be {n} numbers >= 0 (one per virtual stage), got {stage_weights}")
        self.p, self.costs, self.comm_cost, self.mode = self.placement.pp, costs, comm_cost, mode
        self.steps = [group_steps(lst) for lst in schedules]
        self.partner = _pair_ops(self.steps, self.placement)
        self.recv_step = {}  # (rank, kind, mb, chunk) of a compute -> step index of its receive
        for r, rank_steps in enumerate(self.steps):
            for j, step in enumerate(rank_steps):
                for a in (() if isinstance(step, Action) else step):
                    if a.kind.startswith("RECV"):
                        self.recv_step[(r, a.kind[-1], a.microbatch, a.chunk)] = j
        self.pos, self.clock = [0] * self.p, [0.0] * self.p
        self.last_batch: List[Optional[int]] = [None] * self.p
        self.posted: Dict[Tuple[int, int], float] = {}
        self.done: Dict[Tuple[str, int, int], Tuple[float, int]] = {}  # event -> (end, rank)
        self.timelines: List[List[Tuple[float, float, Action]]] = [[] for _ in range(self.p)]
        self.pair_cost = pair_cost
        self.pair_starts = set() if pair_cost is None else {
            (r, j) for r, rank_steps in enumerate(self.steps) for j, (a, b) in enumerate(zip(rank_steps, rank_steps[1:]))
            if isinstance(a, Action) and isinstance(b, Action) and a.kind == "BW" and b.kind == "F"}

    def _completion(self, r: int, j: int) -> Optional[float]:
        """When batch j of rank r completes, or None while a partner has not posted yet."""
        mine = self.posted[(r, j)]
        finish = mine
        for o in range(len(self.steps[r][j])):
            peer = self.partner[(r, j, o)]
            if peer not in self.posted:
                return None
            finish = max(finish, max(mine, self.posted[peer]) + self.comm_cost)
        return finish

    def _ready(self, r: int, a: Action) -> Optional[float]:
        """Earliest start of `a` on rank r by its data (and, lazily, its receive), or None if not yet known."""
        deps = needs(a, r, self.placement)
        if any(d not in self.done for d in deps):
            return None
        ready = [self.clock[r]] + [t + (self.comm_cost if pr != r else 0.0) for t, pr in (self.done[d] for d in deps)]
        if self.mode == "lazy":
            j = self.recv_step.get((r, "F" if a.kind == "F" else "B", a.microbatch, a.chunk))
            if j is not None:
                t = self._completion(r, j)
                if t is None:
                    return None
                ready.append(t)
        return max(ready)

    def _record(self, r: int, a: Action, start: float, end: float) -> None:
        self.timelines[r].append((start, end, a))
        self.done[event_of(a, r, self.placement)] = (end, r)
        if a.kind == "BW":
            self.done[("W",) + event_of(a, r, self.placement)[1:]] = (end, r)
        self.clock[r] = end

    def _compute(self, r: int, a: Action) -> bool:
        start = self._ready(r, a)
        if start is None:
            return False
        self._record(r, a, start, start + self.costs[a.kind] * self.weights[self.placement.stage(r, a.chunk)])
        return True

    def _compute_pair(self, r: int, bw: Action, f: Action) -> bool:
        """An overlapped BW / F pair as one unit costing `pair_cost` (times its stages' mean weight)."""
        starts = [self._ready(r, bw), self._ready(r, f)]
        if None in starts:
            return False
        start = max(starts)
        weight = (self.weights[self.placement.stage(r, bw.chunk)] + self.weights[self.placement.stage(r, f.chunk)]) / 2
        end = start + self.pair_cost * weight
        self._record(r, bw, start, end)
        self._record(r, f, start, end)
        return True

    def _batch(self, r: int, j: int) -> bool:
        if self.mode == "ideal":
            return True
        if self.mode == "lazy" and (r, j) not in self.posted and self.last_batch[r] is not None:
            t = self._completion(r, self.last_batch[r])
            if t is None:
                return False
            self.clock[r] = max(self.clock[r], t)
        self.posted.setdefault((r, j), self.clock[r])
        self.last_batch[r] = j
        if self.mode == "lazy":
            return True
        t = self._completion(r, j)
        if t is None:
            return False
        self.clock[r] = t
        return True

    def _finish(self, r: int) -> bool:
        """End of the list: the last batch must have completed."""
        if self.mode != "lazy" or self.last_batch[r] is None:
            return True
        t = self._completion(r, self.last_batch[r])
        if t is None:
            return False
        self.clock[r] = max(self.clock[r], t)
        self.last_batch[r] = None
        return True

    def run(self) -> SimResult:
        p, steps = self.p, self.steps
        finished = [False] * p
        progress = True
        while progress:
            progress = False
            for r in range(p):
                while self.pos[r] < len(steps[r]):
                    step, paired = steps[r][self.pos[r]], (r, self.pos[r]) in self.pair_starts
                    if paired:
                        ok = self._compute_pair(r, step, steps[r][self.pos[r] + 1])
                    else:
                        ok = self._compute(r, step) if isinstance(step, Action) else self._batch(r, self.pos[r])
                    if not ok:
                        break
                    self.pos[r] += 1 + paired
                    progress = True
                if self.pos[r] == len(steps[r]) and not finished[r] and self._finish(r):
                    finished[r] = progress = True
        stuck = [r for r in range(p) if not finished[r]]
        if stuck:
            where = "; ".join(f"rank {r} blocked at step {self.pos[r]}: "
                              f"{_fmt_step(steps[r][self.pos[r]]) if self.pos[r] < len(steps[r]) else 'end'}"
                              for r in stuck)
            raise ScheduleError(f"deadlock ({self.mode} comm): {where}")
        return _summarize(self.timelines, self.clock, self.placement.num_stages)


def _fmt_step(step) -> str:
    return str(step) if isinstance(step, Action) else "[" + " ".join(str(a) for a in step) + "]"


def _summarize(timelines, clock, stages) -> SimResult:
    makespan = max(clock) if clock else 0.0
    busy = [sum(e - s for s, e in {(s, e) for s, e, _ in tl}) for tl in timelines]  # a pair's span once
    bubble = [(makespan - b) / b if b else float("inf") for b in busy]
    peaks = [held_peak(tl, _in_flight) for tl in timelines]
    return SimResult(timelines, makespan, busy, bubble, peaks, stages)


def held_peak(timeline: Sequence[Tuple[float, float, Action]], change: Callable[[Action], float]) -> float:
    """Peak of what one rank's timeline holds when each compute action changes it by `change(a)`:
    at an F's start (what its forward keeps for the backward), at a B / BW / W's end (what it frees).
    F: +1, B / BW: -1, W: 0 counts the micro-batches in flight; measured bytes per action kind and
    chunk give the activation memory (tests/test_pipeline_v_memory.py)."""
    marks = sorted((s if a.kind == "F" else e, a.kind == "F", change(a)) for s, e, a in timeline)
    live = peak = 0  # at equal times a release comes before an acquisition
    for _, _, d in marks:
        live += d
        peak = max(peak, live)
    return peak


def _in_flight(a: Action) -> int:
    return {"F": 1, "B": -1, "BW": -1}.get(a.kind, 0)


def _costs(costs) -> Dict[str, float]:
    f, b, w = (float(c) for c in costs)
    if min(f, b, w) < 0 or min(f, b + w) <= 0:
        raise ValueError(f"costs must be >= 0 with F > 0 and B + W > 0, got {costs}")
    return {"F": f, "B": b, "W": w, "BW": b + w}


def simulate(schedules: Sequence[Sequence[Action]], costs=(1.0, 1.0, 1.0), comm_cost: float = 0.0,
             comm: str = "lazy", placement: Optional[StagePlacement] = None,
             stage_weights: Optional[Sequence[float]] = None, pair_cost: Optional[float] = None) -> SimResult:
    """Replay per-rank action lists written for `placement` (default: loop); costs = (F, B, W) per
    action of one chunk, times its virtual stage's weight (`stage_weights`, e.g. its share of the
    layers under an uneven split or a --pipeline-model-parallel-layout; default 1 each);
    `pair_cost`: run each BW followed at once by an F as one overlapped unit of that cost (see the
    module's docstring; default: every action alone). Raises on deadlock."""
    if pair_cost is not None and not pair_cost > 0:
        raise ValueError(f"pair_cost must be > 0 (the time of an overlapped BW / F pair), got {pair_cost}")
    return _Replay(schedules, _costs(costs), float(comm_cost), comm, placement, stage_weights, pair_cost).run()


# ---------------------------------------------------------------- checker
def _check_compute(r: int, lst: Sequence[Action], v: int, m: int) -> Dict[Tuple[str, int, int], int]:
    """Each (mb, chunk) once: F, then BW or B then W. Returns the index of each compute action."""
    idx: Dict[Tuple[str, int, int], int] = {}
    for i, a in enumerate(lst):
        if a.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r}")
        if not (0 <= a.microbatch < m and 0 <= a.chunk < v):
            raise ScheduleError(f"rank {r}: {a} out of range (m={m}, v={v})")
        key = (a.kind, a.microbatch, a.chunk)
        if key in idx:
            raise ScheduleError(f"rank {r}: {a} appears twice")
        idx[key] = i
    for mb in range(m):
        for c in range(v):
            f, bw = idx.get(("F", mb, c)), idx.get(("BW", mb, c))
            b, w = idx.get(("B", mb, c)), idx.get(("W", mb, c))
            if f is None:
                raise ScheduleError(f"rank {r}: missing F{mb} of chunk {c}")
            fused, split = bw is not None, b is not None or w is not None
            if fused == split or (split and (b is None or w is None)):
                raise ScheduleError(f"rank {r}: micro-batch {mb} chunk {c} needs exactly one BW, or one B and one W")
            back = bw if bw is not None else b
            if back < f or (w is not None and w < b):
                raise ScheduleError(f"rank {r}: micro-batch {mb} chunk {c}: F, B, W out of order")
    return idx


def _check_comm(r: int, placement: StagePlacement, idx: Dict[Tuple[str, int, int], int]) -> None:
    """Each cross-rank tensor is received before its use and sent after it is made, exactly once
    (a gradient is received after its forward: the executor sizes it like the forward's output)."""
    comm = {k for k in idx if k[0] in COMM_KINDS}
    for kind, mb, c in comm:
        if placement.peer(r, c, COMM_STEP[kind]) is None:
            raise ScheduleError(f"rank {r}: {Action(kind, mb, c)} has no neighbouring stage on another rank")
    expected = set()
    for kind, mb, c in [k for k in idx if k[0] in ("F", "B", "BW")]:
        i = idx[(kind, mb, c)]
        if kind == "F":
            rules = [("RECV_F", -1, True), ("SEND_F", 1, False)]
        else:
            rules = [("RECV_B", 1, True), ("SEND_B", -1, False)]
        for ck, step, before in rules:
            if placement.peer(r, c, step) is None:
                continue
            expected.add((ck, mb, c))
            j = idx.get((ck, mb, c))
            if j is None:
                raise ScheduleError(f"rank {r}: {Action(kind, mb, c)} lacks its {ck}")
            if (j < i) != before or (ck == "RECV_B" and j < idx[("F", mb, c)]):
                raise ScheduleError(f"rank {r}: {ck}{mb} of chunk {c} must come {'before' if before else 'after'} "
                                    f"{kind}{mb}")
    if comm - expected:
        raise ScheduleError(f"rank {r}: unexpected comm actions {sorted(comm - expected)}")


def check_schedule(schedules: Sequence[Sequence[Action]], placement: Optional[StagePlacement] = None) -> None:
    """Raise ScheduleError unless the lists (written for `placement`, default loop) are complete,
    consistent and run without deadlock."""
    placement, m = _shape(schedules, placement)
    for r, lst in enumerate(schedules):
        idx = _check_compute(r, lst, placement.vpp, m)
        if placement.pp > 1:
            _check_comm(r, placement, idx)
        elif any(a.is_comm for a in lst):
            raise ScheduleError("a single-rank pipeline has nothing to communicate")
    for mode in ("blocking", "lazy"):  # event-driven runs of both executor styles
        _Replay(schedules, _costs((1, 1, 1)), 0.0, mode, placement).run()


# ---------------------------------------------------------------- rendering
def _label(a: Action, v: int) -> str:
    return f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if v > 1 else "")


def _glyph(a: Action) -> str:
    """One-letter form for narrow timelines: F, B, W, X (= BW); lower case on odd micro-batches."""
    g = "X" if a.kind == "BW" else a.kind
    return g.lower() if a.microbatch % 2 else g


def _cells(timeline, v: int) -> List[Tuple[float, float, str, str]]:
    """(start, end, label, glyph) per span of a rank: an overlapped pair is one span, 'BW0.1&F4.0' / '&'."""
    spans: Dict[Tuple[float, float], List[Action]] = {}
    for s, e, a in timeline:
        spans.setdefault((s, e), []).append(a)
    return [(s, e, "&".join(_label(a, v) for a in acts), _glyph(acts[0]) if len(acts) == 1 else "&")
            for (s, e), acts in spans.items()]


def format_timeline(result: SimResult, width: Optional[int] = None) -> str:
    """One row per rank, '.' = idle. Each action shows its label (F3, BW0, or F3.1 = chunk 1 when
    v > 1; an overlapped pair BW0.1&F4.0); when `width` (total columns) leaves too little room, every
    cell shows a one-letter glyph instead (see `_glyph`; '&' = a pair). Default scale: one label-wide
    cell per unit of the cheapest action."""
    acts = [x for tl in result.timelines for x in tl]
    if not acts:
        return ""
    v = max(a.chunk for _, _, a in acts) + 1
    rows_cells = [_cells(tl, v) for tl in result.timelines]
    cells = [c for rc in rows_cells for c in rc]
    unit = min(e - s for s, e, _, _ in cells if e > s)
    cell = max(len(label) for _, _, label, _ in cells) + 1
    scale = (width / result.makespan) if width else cell / unit  # chars per time unit
    cols = max(1, int(round(result.makespan * scale)))

    def span(s: float, e: float) -> Tuple[int, int]:
        c0 = int(round(s * scale))
        return c0, max(int(round(e * scale)), c0 + 1)

    compact = any(span(s, e)[1] - span(s, e)[0] < len(label) for s, e, label, _ in cells)
    rows = []
    for r, rank_cells in enumerate(rows_cells):
        line = ["."] * cols
        for s, e, label, glyph in rank_cells:
            c0, c1 = span(s, e)
            text = glyph * (c1 - c0) if compact else label.ljust(c1 - c0)
            line[c0:c1] = list(text)
        rows.append(f"rank {r:>2} |{''.join(line[:cols])}|")
    return "\n".join(rows)


LEGEND = {"F": "F forward", "B": "B backward (input grad)", "W": "W weight grad", "BW": "BW backward (input + weight)"}


def save_png(result: SimResult, path: str, title: str = "") -> list:
    """Gantt chart of the timelines (needs matplotlib, imported here only); returns the legend's labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}
    p = len(result.timelines)
    fig, ax = plt.subplots(figsize=(max(6.0, result.makespan * 0.35), 0.6 * p + 1.2))
    v = max((a.chunk for tl in result.timelines for _, _, a in tl), default=0) + 1
    for r, tl in enumerate(result.timelines):
        paired = {(s, e) for i, (s, e, _) in enumerate(tl) if any(x[:2] == (s, e) for x in tl[:i])}
        for s, e, a in tl:  # an overlapped pair: its BW in the upper half of the row, its F in the lower
            y, h = (r + (0.2 if a.kind == "F" else -0.2), 0.4) if (s, e) in paired else (r, 0.8)
            ax.barh(y, e - s, height=h, left=s, color=colors[a.kind], edgecolor="black", linewidth=0.5,
                    alpha=1.0 - 0.4 * a.chunk / max(1, v - 1) if v > 1 else 1.0)
            ax.text((s + e) / 2, y, _label(a, v), ha="center", va="center", fontsize=6)
    kinds = [k for k in LEGEND if any(a.kind == k for tl in result.timelines for _, _, a in tl)]
    handles = [Patch(facecolor=colors[k], edgecolor="black", label=LEGEND[k]) for k in kinds]
    if v > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", label=f"F3.1 = micro-batch 3, chunk 1 (lighter: later of {v} chunks)"))
    ax.legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              frameon=False)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [h.get_label() for h in handles]
