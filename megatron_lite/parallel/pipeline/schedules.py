"""Pipeline-parallel schedules as ordered action lists, one list per pipeline rank.

One executor runs any of these lists and `simulator.py` replays the very same lists, so the
schedule is defined once, here, as data.

Stages. With p pipeline ranks and v model chunks per rank (v > 1 for "interleaved" and the V
schedules), a StagePlacement (placement.py) says which (rank, local chunk) runs virtual stage s.
The schedules are written for the "loop" placement (chunk c on rank r is stage c * p + r) except
those of V_SCHEDULES, written for "V" with two chunks (`schedule_placement`); `place_comm` and
the simulator take any placement.

Actions (`Action(kind, microbatch, chunk)`, chunk = the LOCAL chunk index on this rank):
  F        forward of (microbatch, chunk).
  B        backward for inputs only (the input gradient); ZERO_BUBBLE schedules only.
  W        backward for weights only (needs the B of the same microbatch/chunk); ZERO_BUBBLE only.
  BW       the whole backward (inputs and weights) in one pass: gpipe, 1f1b and interleaved
           use it, so their executor runs one plain autograd backward. Costs B + W.
  RECV_F   receive the input activation of F(mb, chunk) from the previous virtual stage.
  SEND_F   send the output activation of F(mb, chunk) to the next virtual stage.
  RECV_B   receive the gradient of the output of (mb, chunk) from the next virtual stage.
  SEND_B   send the gradient of the input of (mb, chunk), made by its B/BW, to the previous stage.
SEND_F and RECV_B talk to the rank of the next virtual stage; RECV_F and SEND_B to that of the
previous one. The first virtual stage has no RECV_F/SEND_B, the last no SEND_F/RECV_B (it starts
its backward from the loss); nor has a hop between two stages of the same rank (a local hand-off).

Execution rule (what every executor must do, and what `simulator.check_schedule` proves
deadlock-free for every (p, v, m) that `validate_schedule_args` accepts):
  * Run each rank's list strictly in order.
  * A maximal run of consecutive comm actions is ONE batch (see `group_steps`): post all of it
    at once, in list order, as one `batch_isend_irecv`. Batches are never split, and never
    merged across a compute action.
  * Wait for a batch either at once ("blocking") or lazily ("lazy"): just before the first
    compute that uses a tensor it received, before posting the rank's next batch, and at the
    end of the list (keep sent tensors alive until then). Both are deadlock-free. Lazy is what
    the simulator assumes by default and reaches the theoretical bubble for every schedule;
    blocking reaches it too except interleaved with p = 2, 5, 8 (p % 3 == 2), where BW (2 units)
    and F (1 unit) leave adjacent ranks no common idle moment to exchange in, e.g. p=8, v=2,
    m=16 gives idle/busy 0.292 instead of 0.219.
  * Pairing is FIFO per ordered rank pair: the k-th SEND_* from rank a to rank b (in a's list
    order) carries the same tensor as the k-th RECV_* from a on rank b (in b's list order):
    SEND_F(mb, c) pairs with RECV_F(mb, c') on the next stage's rank, SEND_B(mb, c) with
    RECV_B(mb, c') on the previous stage's rank, where c' is the neighbour's local chunk of the
    adjacent virtual stage. Tags are therefore unnecessary (NCCL ignores them anyway). A message
    may be several tensors: each is one op of the batch, in the same order on both sides.

How comm is placed (why it cannot deadlock). Each message gets a key K, a time between the end
of its producer and the start of its consumer in the ideal unit-cost timeline, chosen where both
ranks sit between two compute actions if possible (so nothing stalls). Both ranks put the op at
"time K" in their lists; within a time, ops are sorted by message identity. Each rank's comm ops
are then sorted by key and matched ops share a key, so a blocked rank with the smallest pending
key always finds its partner posted or able to progress: no cycle of waits is possible.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.pipeline.placement import StagePlacement

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipe-v")  # schedules that split backward into B and W (deferred weight gradients)
V_SCHEDULES = ("zb-v", "dualpipe-v")  # written for the V placement with two chunks per rank
COMPUTE_KINDS = ("F", "B", "W", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# Unit costs used to place communication in the lists (the lists do not depend on real costs).
PLACEMENT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    chunk: int = 0

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Step = Union[Action, Tuple[Action, ...]]


# ---------------------------------------------------------------- topology helpers
COMM_STEP = {"SEND_F": 1, "RECV_B": 1, "RECV_F": -1, "SEND_B": -1}  # the neighbour stage it talks to


def comm_peer(action: Action, rank: int, placement: StagePlacement) -> int:
    """The rank a comm action talks to."""
    peer = placement.peer(rank, action.chunk, COMM_STEP[action.kind])
    if peer is None:
        raise ValueError(f"rank {rank}: {action} has no neighbouring stage on another rank")
    return peer


def message_id(action: Action, rank: int, placement: StagePlacement) -> Tuple[str, int, int]:
    """What a comm action carries: (direction, microbatch, receiving virtual stage).

    A send and the receive it pairs with have the same id."""
    s = placement.stage(rank, action.chunk)
    return {"SEND_F": ("F", action.microbatch, s + 1), "RECV_F": ("F", action.microbatch, s),
            "SEND_B": ("B", action.microbatch, s - 1), "RECV_B": ("B", action.microbatch, s)}[action.kind]


def event_of(action: Action, rank: int, placement: StagePlacement) -> Tuple[str, int, int]:
    """The data event a compute action produces: ('F'|'B'|'W', microbatch, virtual stage)."""
    kind = "B" if action.kind == "BW" else action.kind
    return kind, action.microbatch, placement.stage(rank, action.chunk)


def needs(action: Action, rank: int, placement: StagePlacement) -> List[Tuple[str, int, int]]:
    """Data events a compute action waits for (F of the previous stage, B of the next, ...)."""
    mb, s = action.microbatch, placement.stage(rank, action.chunk)
    if action.kind == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if action.kind in ("B", "BW"):
        return [("F", mb, s)] + ([("B", mb, s + 1)] if s < placement.num_stages - 1 else [])
    if action.kind == "W":
        return [("B", mb, s)]
    raise ValueError(f"{action} is not a compute action")


def group_steps(actions: Sequence[Action]) -> List[Step]:
    """Split a rank's list into steps: a compute Action, or a tuple = one batch of comm actions."""
    steps: List[Step] = []
    batch: List[Action] = []
    for a in actions:
        if a.is_comm:
            batch.append(a)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append(a)
    if batch:
        steps.append(tuple(batch))
    return steps


# ---------------------------------------------------------------- compute orders per rank
def _gpipe(p: int, m: int, r: int) -> List[Action]:
    return [Action("F", i) for i in range(m)] + [Action("BW", i) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int) -> List[Action]:
    # Warm-up forwards keep exactly p - r micro-batches in flight once the steady phase starts.
    warm = min(p - r - 1, m)
    order = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [Action("F", warm + i), Action("BW", i)]
    return order + [Action("BW", i) for i in range(m - warm, m)]


def _interleaved(p: int, m: int, r: int, v: int) -> List[Action]:
    # Megatron's order: micro-batches go in groups of p through chunk 0, then chunk 1, ...;
    # backward walks the chunks in reverse. Rank r runs 2(p-r-1) + (v-1)p warm-up forwards.
    def fwd(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return Action("BW", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    total = m * v
    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    order = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        order += [fwd(warm + i), bwd(i)]
    return order + [bwd(k) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int, r: int) -> List[Action]:
    # ZB-H1 (Qi et al. 2023): 1F1B's forwards (p - r in flight), B split from W, and rank r
    # postpones r of its W's so they fill the cool-down, where B's arrive more slowly.
    # W before the next F keeps live activations (F until W) at p - r + r = p, as in 1F1B.
    warm = min(p - r, m)
    order = [Action("F", i) for i in range(warm)]
    next_w = 0
    for i in range(m):
        order.append(Action("B", i))
        if i >= r:
            order.append(Action("W", next_w))
            next_w += 1
        if warm + i < m:
            order.append(Action("F", warm + i))
    return order + [Action("W", j) for j in range(next_w, m)]


def _zb_v(p: int, m: int, r: int) -> List[Action]:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6) on the V placement:
    rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), B is split from W.

    Warm-up: 2(p-r)-1 forwards of chunk 0, r pairs (F chunk 1, F chunk 0), then p-r triples
    F B W of chunk 1. Steady: F B W of chunk 0, then of chunk 1, per micro-batch. Cool-down: the
    remaining B's, chunk 1 before chunk 0, then all their W's, which fill the drain. Every W
    follows its B before the next F, so a rank holds at most 2p chunk activations until W (p
    whole stages: 1F1B's peak). At F = B = W and m >= 2p - 1 the makespan is 6m + p - 1, the
    least possible (the last rank waits p - 1 forwards for its first input and never idles
    after): bubble (p - 1) / 6m, half of ZB-H1's, -> 0 as m grows; from m = p it is never worse
    than ZB-H1 (below p it can be worse than 1F1B: validate_schedule_args refuses it)."""
    order: List[Action] = []
    done = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}  # actions issued per kind and chunk, in mb order

    def add(kind: str, chunk: int, with_w: bool = False) -> None:
        i = done[f"{kind}{chunk}"]
        done[f"{kind}{chunk}"] += 1
        order.append(Action(kind, i, chunk))
        if with_w:
            order.append(Action("W", i, chunk))

    def can_f1() -> bool:  # chunk 1 of a micro-batch follows its chunk 0 (on the last rank too)
        return done["F1"] < done["F0"]

    for _ in range(min(m, 2 * (p - r) - 1)):
        add("F", 0)
    for _ in range(r):
        if can_f1():
            add("F", 1)
        if done["F0"] < m:
            add("F", 0)
    for _ in range(p - r):
        if can_f1():
            add("F", 1)
            add("B", 1, with_w=True)
    while done["F0"] < m or can_f1():
        if done["F0"] < m:
            add("F", 0)
        if done["B0"] < done["F0"]:
            add("B", 0, with_w=True)
        if can_f1():
            add("F", 1)
            add("B", 1, with_w=True)
    drain: List[Action] = []
    while done["B0"] < m or done["B1"] < m:
        for c in (1, 0):
            if done[f"B{c}"] < m:
                drain.append(Action("W", done[f"B{c}"], c))
                add("B", c)
    return order + drain


def _dualpipe_v(p: int, m: int, r: int) -> List[Action]:
    """DualPipe-V (DeepSeek's DualPipe cut in half onto the V placement, as torchtitan runs it),
    its overlapped pairs run one after the other: the eight phases of rank r are
      1. 2(p-r-1) F of chunk 0          5. p-r-1 x (BW 1, then the pair BW 0 / F 1)
      2. r+1 x (F 0, F 1)               6. r+1 x (B 1, B 0), W deferred from the middle on
      3. p-r-1 x (B 1, W, F 1)          7. p-r-1 x (W, B 0 with W deferred)
      4. m-2p+r+1 x (pair BW 1 / F 0, pair BW 0 / F 1)   8. r+1 W
    A pair puts its backward first: serialized, that keeps the makespan at 6m + p - 1 for
    F = B = W (the lower bound, as zb-v) and the activations at 2p chunks; with its forward
    first, the chain of pairs across ranks stalls one unit per micro-batch. Deferred W's run
    oldest first. Needs m >= 2p - 1 (phase 4 on rank 0)."""
    order: List[Action] = []
    done = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
    weights: List[Action] = []

    def f(c: int) -> None:
        order.append(Action("F", done[f"F{c}"], c))
        done[f"F{c}"] += 1

    def b(c: int, defer_w: bool = False) -> None:
        i = done[f"B{c}"]
        done[f"B{c}"] += 1
        order.append(Action("B" if defer_w else "BW", i, c))
        if defer_w:
            weights.append(Action("W", i, c))

    def w() -> None:
        order.append(weights.pop(0))

    for _ in range(2 * (p - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0)
        f(1)
    for _ in range(p - r - 1):
        b(1, defer_w=True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):
        b(1)
        f(0)
        b(0)
        f(1)
    for _ in range(p - r - 1):
        b(1)
        b(0)
        f(1)
    defer = False
    for i in range(r + 1):  # the second half of these backwards defer W (odd ranks from a B 1)
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        b(1, defer)
        defer = defer or (i == (r + 1) // 2 and r % 2 == 0)
        b(0, defer)
    for _ in range(p - r - 1):
        w()
        b(0, defer_w=True)
    while weights:
        w()
    return order


def overlapped_pairs(actions: Sequence[Action]) -> List[Tuple[int, int]]:
    """(index of BW, index of F) of each overlapped pair of a DualPipe-V list made by
    `build_schedule(..., overlap=True)`: a BW followed at once by an F."""
    return [(i, i + 1) for i in range(len(actions) - 1)
            if actions[i].kind == "BW" and actions[i + 1].kind == "F"]


def _pair_comm(actions: List[Action]) -> List[Action]:
    """DualPipe-V's list with each pair (a BW followed in compute order by an F) made adjacent, so
    that both can run at once: the pair's F input is received before the BW (joining the batch
    before it), and the rest of the comm between them (the BW's gradient sent back, later
    receives) goes after the F (in front of the batch after it). Sends keep their order among
    sends and receives among receives, so FIFO pairing holds; the simulator proves the result
    deadlock-free (tests). Serialized it costs p - 1 more units (each pair's send waits for its F)."""
    steps = group_steps(actions)
    out: List[Step] = []
    i = 0
    while i < len(steps):
        bw = steps[i]
        between = steps[i + 1] if i + 1 < len(steps) and isinstance(steps[i + 1], tuple) else ()
        j = i + 1 + bool(between)
        f = steps[j] if j < len(steps) else None
        if not (isinstance(bw, Action) and bw.kind == "BW" and isinstance(f, Action) and f.kind == "F"):
            out.append(bw)
            i += 1
            continue
        needed = tuple(a for a in between if a == Action("RECV_F", f.microbatch, f.chunk))
        later = tuple(a for a in between if a not in needed)
        if needed:
            if out and isinstance(out[-1], tuple):
                out[-1] = out[-1] + needed
            else:
                out.append(needed)
        out += [bw, f]
        if later:
            if j + 1 < len(steps) and isinstance(steps[j + 1], tuple):
                steps[j + 1] = later + steps[j + 1]
            else:
                out.append(later)
        i = j + 1
    return [a for step in out for a in (step if isinstance(step, tuple) else (step,))]


def compute_orders(name: str, pp_size: int, num_microbatches: int, vpp: int = 1) -> List[List[Action]]:
    """Compute actions only, per rank, in execution order."""
    p, m = pp_size, num_microbatches
    if name in V_SCHEDULES:
        make_v = _zb_v if name == "zb-v" else _dualpipe_v
        return [make_v(p, m, r) for r in range(p)]
    if name == "interleaved":
        return [_interleaved(p, m, r, vpp) for r in range(p)]
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}[name]
    return [make(p, m, r) for r in range(p)]


# ---------------------------------------------------------------- communication placement
def _ideal_times(orders: List[List[Action]], placement: StagePlacement) -> List[List[Tuple[float, float]]]:
    """(start, end) of every compute action with PLACEMENT_COSTS and data dependencies only."""
    times: List[List[Tuple[float, float]]] = [[] for _ in orders]
    done: Dict[Tuple[str, int, int], float] = {}
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while len(times[r]) < len(order):
                a = order[len(times[r])]
                deps = needs(a, r, placement)
                if any(d not in done for d in deps):
                    break
                start = max([times[r][-1][1] if times[r] else 0.0] + [done[d] for d in deps])
                end = start + PLACEMENT_COSTS[a.kind]
                times[r].append((start, end))
                done[event_of(a, r, placement)] = end
                if a.kind == "BW":
                    done[("W",) + event_of(a, r, placement)[1:]] = end
                progress = True
    if any(len(t) != len(o) for t, o in zip(times, orders)):
        raise RuntimeError("compute orders have a dependency cycle")  # a bug in an order above
    return times


def _at_boundary(times: List[Tuple[float, float]], starts: List[float], t: float) -> bool:
    """True if the rank is between two compute actions (or idle) at time t."""
    i = bisect.bisect_left(starts, t) - 1  # last compute starting before t
    return i < 0 or times[i][1] <= t


def _choose_key(ta, sa, tb, sb, t_prod: float, t_cons: float) -> float:
    """Earliest time in [t_prod, t_cons] where sender (a) and receiver (b) both sit idle/between."""
    cands = {t_prod, t_cons}
    for times in (ta, tb):
        cands.update(e for _, e in times if t_prod <= e <= t_cons)
    for t in sorted(cands):
        if _at_boundary(ta, sa, t) and _at_boundary(tb, sb, t):
            return t
    return t_prod  # no common gap: the receiver posts after its current compute


def place_comm(orders: List[List[Action]], placement: StagePlacement) -> List[List[Action]]:
    """Per-rank compute orders written for `placement`, with their comm actions inserted."""
    times = _ideal_times(orders, placement)
    starts = [[s for s, _ in t] for t in times]
    where = {}  # event -> (rank, index in order)
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            where[event_of(a, r, placement)] = (r, i)
    inserts: List[List[Tuple[float, Tuple, Action]]] = [[] for _ in orders]
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            if a.kind == "W":
                continue
            mb, s = a.microbatch, placement.stage(r, a.chunk)
            dst = s + 1 if a.kind == "F" else s - 1
            if placement.peer(r, a.chunk, dst - s) is None:
                continue  # first stage's backward, last stage's forward, a local hand-off: no message
            br, bc = placement.location(dst)
            bi = where[("F", mb, dst)] if a.kind == "F" else where[("B", mb, dst)]
            key = _choose_key(times[r], starts[r], times[br], starts[br], times[r][i][1], times[br][bi[1]][0])
            send, recv = ("SEND_F", "RECV_F") if a.kind == "F" else ("SEND_B", "RECV_B")
            mid = (a.kind[0], mb, dst)
            inserts[r].append((key, mid, Action(send, mb, a.chunk)))
            inserts[br].append((key, mid, Action(recv, mb, bc)))
    out = []
    for r, order in enumerate(orders):
        seq: List[Action] = []
        pending = sorted(inserts[r], key=lambda x: (x[0], x[1], x[2].kind))
        j = 0
        for i, a in enumerate(order):  # comm with key K goes before the first compute starting at >= K
            while j < len(pending) and pending[j][0] <= times[r][i][0]:
                seq.append(pending[j][2])
                j += 1
            seq.append(a)
        seq += [x[2] for x in pending[j:]]
        out.append(seq)
    return out


# ---------------------------------------------------------------- public API
def default_schedule(vpp: Optional[int]) -> str:
    return "interleaved" if (vpp or 1) > 1 else "1f1b"


def schedule_placement(name: str) -> str:
    """The StagePlacement kind a schedule's lists are written for."""
    return "V" if name in V_SCHEDULES else "loop"


def schedule_vpp(name: Optional[str], vpp: Optional[int]) -> int:
    """Model chunks per rank: the V schedules imply two when none are given."""
    return 2 if name in V_SCHEDULES and vpp in (None, 1) else (1 if vpp is None else vpp)


def validate_schedule_args(name: str, pp_size: int, num_microbatches: int, vpp: Optional[int] = 1,
                           num_layers: Optional[int] = None) -> None:
    """Raise ConfigError (one line: the values and the fix) if the schedule cannot run."""
    p, m, v = pp_size, num_microbatches, schedule_vpp(name, vpp)

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(name in SCHEDULES, f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    need(p >= 1, f"pipeline_model_parallel_size ({p}) must be >= 1")
    need(m >= 1, f"number of micro-batches ({m}) must be >= 1; raise --global-batch-size")
    need(v >= 1, f"virtual pipeline size ({v}) must be >= 1")
    if name in V_SCHEDULES:
        need(p >= 2, f"schedule {name!r} needs pipeline_model_parallel_size >= 2 (got {p}): its V places two "
                     f"model chunks per rank down the ranks and back; raise --pipeline-model-parallel-size")
        need(v == 2, f"schedule {name!r} runs exactly two model chunks per rank (got virtual pipeline size {v}); "
                     f"drop --num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
        least = p if name == "zb-v" else 2 * p - 1
        need(m >= least, f"schedule {name!r} needs at least {least} micro-batches with {p} pipeline ranks (got {m}): "
                         f"with fewer its warm-up runs dry; raise --global-batch-size or use --pipeline-schedule 1f1b")
    elif name == "interleaved":
        need(v > 1, f"schedule 'interleaved' needs virtual pipeline size > 1 (got {v}); "
                    f"set --num-layers-per-virtual-pipeline-stage or use --pipeline-schedule 1f1b")
        need(p >= 2, f"schedule 'interleaved' needs pipeline_model_parallel_size >= 2 (got {p}); "
                     f"raise --pipeline-model-parallel-size or drop virtual stages")
        need(m % p == 0, f"schedule 'interleaved' needs the number of micro-batches ({m}) to be a multiple "
                         f"of pipeline_model_parallel_size ({p}); change --global-batch-size or --micro-batch-size")
    else:
        need(v == 1, f"schedule {name!r} does not support virtual pipeline stages (vpp={v}); "
                     f"use --pipeline-schedule interleaved or drop --num-layers-per-virtual-pipeline-stage")
    if name == "zb-h1":
        need(m >= p, f"schedule 'zb-h1' needs at least as many micro-batches ({m}) as pipeline stages ({p}); "
                     f"raise --global-batch-size or use --pipeline-schedule 1f1b")
    if num_layers is not None:
        need(num_layers >= p * v, f"num_layers ({num_layers}) must be >= pipeline stages ({p}) x virtual "
                                  f"stages ({v}) = {p * v}; lower the pipeline sizes or add layers")
        if v > 1 and name not in V_SCHEDULES:  # V: the partition decides (uneven ends allowed)
            need(num_layers % (p * v) == 0, f"num_layers ({num_layers}) must be divisible by pipeline stages "
                                            f"({p}) x virtual stages ({v}) = {p * v}; change --num-layers or "
                                            f"--num-layers-per-virtual-pipeline-stage")


def build_schedule(name: str, pp_size: int, num_microbatches: int, vpp: Optional[int] = 1,
                   overlap: bool = False) -> List[List[Action]]:
    """Per-rank action lists (compute + comm) for one training step. See the module docstring.
    `overlap` (dualpipe-v only): each forward/backward pair adjacent, to run overlapped."""
    vpp = schedule_vpp(name, vpp)
    validate_schedule_args(name, pp_size, num_microbatches, vpp)
    if overlap and name != "dualpipe-v":
        raise ValueError(f"overlapped pairs are DualPipe-V's, not {name!r}'s")
    placement = StagePlacement(pp_size, vpp, schedule_placement(name))
    lists = place_comm(compute_orders(name, pp_size, num_microbatches, vpp), placement)
    return [_pair_comm(lst) for lst in lists] if overlap else lists
