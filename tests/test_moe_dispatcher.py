"""Token dispatchers round trip over EP in {1, 2, 4} (and ETP 2 under TP 2): with identity experts
the layer returns its input (weights summing to 1 per token), including an expert that gets no
token and every token on one expert; gradients reach the tokens and the routing weights; and the
experts see exactly the tokens routed to them, with the counts computed by hand."""
import pytest
import torch

from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import run_distributed
from megatron_lite.transformer.moe.dispatcher import build_dispatcher
from megatron_lite.transformer.moe.router import Routing

E, H, T = 8, 4, 12


def _routing(case: str, rank: int, requires_grad=True):
    gen = torch.Generator().manual_seed(100 + rank)
    if case == "one_expert":  # every token of every rank goes only to expert E - 1
        routing_map = torch.zeros(T, E, dtype=torch.bool)
        routing_map[:, E - 1] = True
    else:
        scores = torch.rand(T, E, generator=gen)
        if case == "empty_expert":  # nobody picks expert 2 (on EP rank 0 or 1 depending on EP)
            scores[:, 2] = -1.0
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(2, -1).indices, True)
    raw = torch.rand(T, E, generator=gen) * routing_map
    probs = (raw / raw.sum(1, keepdim=True)).requires_grad_(requires_grad)
    return Routing(probs, routing_map)


def _round_trip(rank, world, ep, tp, kind, case):
    dims = ParallelDims.from_world(tp=tp, ep=ep, etp=tp)
    # Each TP rank has its own tokens (as the MoE layer arranges); data differs per rank.
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    routing = _routing(case, rank)
    dispatcher = build_dispatcher(kind, E, dims)
    rows, counts, state = dispatcher.dispatch(x, routing)
    assert rows.shape[0] == sum(counts) and len(counts) == E // ep
    # Identity experts; with ETP each rank contributes 1/ETP so the partial sums add up to 1.
    out = dispatcher.combine(rows / dims.etp, state)
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(50 + rank))
    (out * probe).sum().backward()
    return dict(x=x.detach(), out=out.detach(), x_grad=x.grad, probs_grad=routing.probs.grad,
                probe=probe, map=routing.routing_map, counts=counts, rows=rows.detach(), ep_rank=dims.ep_rank)


LAYOUTS = [(1, 1, 1), (2, 2, 1), (4, 4, 1), (4, 2, 2)]  # world, ep, tp (= etp)


@pytest.mark.parametrize("world,ep,tp", LAYOUTS, ids=[f"ep{e}-etp{t}" for _, e, t in LAYOUTS])
@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", ["random", "empty_expert", "one_expert"])
def test_identity_experts_round_trip(world, ep, tp, kind, case):
    results = run_distributed(_round_trip, world, ep, tp, kind, case)
    for r in results:
        torch.testing.assert_close(r["out"], r["x"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["x_grad"], r["probe"], rtol=1e-6, atol=1e-6)
        # d out_t / d w_te = x_t (identity expert): grad = x_t . probe_t where routed, else 0.
        expected = (r["x"] * r["probe"]).sum(1, keepdim=True) * r["map"]
        torch.testing.assert_close(r["probs_grad"], expected, rtol=1e-5, atol=1e-6)
    # Each expert saw every token routed to it by every rank of its exchange group, in order.
    dims = ParallelDims(tp=tp, dp=world // tp, ep=ep, etp=tp)
    for members in dims._rank_lists()["etp_ep"]:
        _check_expert_inputs([results[m] for m in members], members, ep, tp, kind)


def _check_expert_inputs(group, members, ep, tp, kind):
    """Ranks exchanging tokens (one ETP x EP group): each local expert gets the tokens routed to
    it, source after source: by (ETP rank, EP rank) for alltoall (all-to-all over EP, then the
    ETP gather), by global rank for allgather (one gather over ETP x EP)."""
    e_local = E // ep
    if kind == "alltoall":
        order = sorted(range(len(group)), key=lambda i: (members[i] % tp, group[i]["ep_rank"]))
    else:
        order = list(range(len(group)))
    sources = [group[i] for i in order]
    for r in group:
        first = r["ep_rank"] * e_local
        assert r["counts"] == [sum(int(s["map"][:, first + l].sum()) for s in sources) for l in range(e_local)]
        rows = r["rows"].split(r["counts"])
        for l in range(e_local):
            torch.testing.assert_close(rows[l], torch.cat([s["x"][s["map"][:, first + l]] for s in sources]))


def _one_expert_counts(rank, world):
    dims = ParallelDims.from_world(ep=4)
    x = torch.randn(T, H)
    rows, counts, _ = build_dispatcher("alltoall", E, dims).dispatch(x, _routing("one_expert", rank, False))
    return counts


def test_all_tokens_on_one_expert_land_on_its_rank():
    counts = run_distributed(_one_expert_counts, 4)
    # Expert E - 1 = 7 lives on EP rank 3 as its local expert 1; it gets all 4 x 12 tokens.
    assert counts == [[0, 0], [0, 0], [0, 0], [0, 4 * T]]


def _counted(rank, world, kind):
    from megatron_lite.parallel.comm import CommCounter

    dims = ParallelDims.from_world(ep=world)
    dims.comm_counter = CommCounter()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    routing = _routing("random", rank)
    dispatcher = build_dispatcher(kind, E, dims)
    rows, counts, state = dispatcher.dispatch(x, routing)
    dispatcher.combine(rows, state).sum().backward()
    return dict(dims.comm_counter.bytes)


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatch_bytes_are_counted(kind):
    """--log-comm-volume sees the MoE exchanges (the counter counts each collective's whole input
    buffer). alltoall: dispatch sends this rank's T x k routed rows (H fp32), combine sends back
    the rows it received, backward the same with the roles swapped, plus the per-expert counts
    (int64); over the EP group every routed row is counted four times. allgather: tokens,
    probabilities and the routing map (int32) gathered, the output reduce-scattered; backward
    reduce-scatters the token and probability gradients and gathers the output gradient."""
    ep, k = 2, 2
    got = run_distributed(_counted, ep, kind)
    if kind == "alltoall":
        assert all(set(c) == {"all_to_all"} for c in got)
        assert sum(c["all_to_all"] for c in got) == ep * (4 * T * k * H * 4 + E * 8)
    else:
        full = ep * T  # the gathered rows
        for counted in got:
            assert counted == {"all_gather": 2 * full * H * 4 + 2 * full * E * 4,
                               "reduce_scatter": 2 * full * H * 4 + full * E * 4}
