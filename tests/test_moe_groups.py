"""ParallelDims' expert grid: the rank lists of ep / etp / edp / etp_ep / expert_mp / tp_dp_cp for
several layouts (worked out by hand from rank = tp + TP (cp + CP (dp + DP pp))), its one-line
errors, and the groups built in a real 4-rank world."""
import pytest
import torch.distributed as dist

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.state import ParallelDims, group_size
from megatron_lite.testing import run_distributed

KINDS = ("ep", "etp", "edp", "etp_ep", "expert_mp", "tp_dp_cp")

LAYOUTS = [
    # EP over pure DP: consecutive DP ranks share out the experts, the others replicate them.
    (dict(dp=4, ep=2), {"ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0, 2], [1, 3]],
                        "etp_ep": [[0, 1], [2, 3]], "expert_mp": [[0, 1], [2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    (dict(dp=4, ep=4), {"ep": [[0, 1, 2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0], [1], [2], [3]],
                        "etp_ep": [[0, 1, 2, 3]], "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    # TP 2 with ETP 1 (Megatron's folding, order tp-ep-dp): EP spans the two TP ranks of a replica;
    # the DP replicas hold the same experts, so they are expert-data-parallel.
    (dict(tp=2, dp=2, ep=2, etp=1), {"ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0, 2], [1, 3]],
                                     "etp_ep": [[0, 1], [2, 3]], "expert_mp": [[0, 1], [2, 3]],
                                     "tp_dp_cp": [[0, 1, 2, 3]]}),
    # TP 2 with ETP 2: the expert TP group is the TP group; no expert replicas are left.
    (dict(tp=2, dp=2, ep=2, etp=2), {"ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]], "edp": [[0], [1], [2], [3]],
                                     "etp_ep": [[0, 1, 2, 3]], "expert_mp": [[0, 1, 2, 3]],
                                     "tp_dp_cp": [[0, 1, 2, 3]]}),
    # EP carved out of DP x CP: the two CP ranks of a replica hold different experts.
    (dict(cp=2, dp=2, ep=2), {"ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0, 2], [1, 3]],
                              "etp_ep": [[0, 1], [2, 3]], "expert_mp": [[0, 1], [2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    (dict(cp=2, dp=2, ep=4), {"ep": [[0, 1, 2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0], [1], [2], [3]],
                              "etp_ep": [[0, 1, 2, 3]], "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    # Pipeline stages hold different layers: nothing expert-related crosses them but expert_mp.
    (dict(dp=2, pp=2, ep=2), {"ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0], [1], [2], [3]],
                              "etp_ep": [[0, 1], [2, 3]], "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1], [2, 3]]}),
    (dict(tp=2, dp=2, pp=2, ep=2, etp=1),
     {"ep": [[0, 1], [2, 3], [4, 5], [6, 7]], "etp": [[r] for r in range(8)],
      "edp": [[0, 2], [1, 3], [4, 6], [5, 7]], "etp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
      "expert_mp": [[0, 1, 4, 5], [2, 3, 6, 7]], "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    (dict(tp=2, dp=4, ep=2, etp=2),
     {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]], "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
      "edp": [[0, 4], [1, 5], [2, 6], [3, 7]], "etp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
      "expert_mp": [[0, 1, 2, 3], [4, 5, 6, 7]], "tp_dp_cp": [list(range(8))]}),
    # MoE parallel folding: EP (and ETP) over any ranks of a stage, TP ranks first.
    (dict(tp=2, cp=2, ep=4), {"ep": [[0, 1, 2, 3]], "etp": [[0], [1], [2], [3]], "edp": [[0], [1], [2], [3]],
                              "etp_ep": [[0, 1, 2, 3]], "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    (dict(tp=4, ep=2, etp=2), {"ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]], "edp": [[0], [1], [2], [3]],
                               "etp_ep": [[0, 1, 2, 3]], "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
    (dict(tp=2, dp=4, ep=2, etp=2, pp=1),  # ETP = TP: EP pairs DP replicas, as before folding
     {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]], "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
      "edp": [[0, 4], [1, 5], [2, 6], [3, 7]], "etp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
      "expert_mp": [[0, 1, 2, 3], [4, 5, 6, 7]], "tp_dp_cp": [list(range(8))]}),
    (dict(dp=4, ep=2, etp=2),  # ETP over data-parallel ranks (no dense TP at all)
     {"ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]], "edp": [[0], [1], [2], [3]], "etp_ep": [[0, 1, 2, 3]],
      "expert_mp": [[0, 1, 2, 3]], "tp_dp_cp": [[0, 1, 2, 3]]}),
]


@pytest.mark.parametrize("sizes,expected", LAYOUTS, ids=[str(s) for s, _ in LAYOUTS])
def test_expert_rank_lists(sizes, expected):
    dims = ParallelDims(**sizes)
    lists = dims._rank_lists()
    for kind in KINDS:
        assert sorted(lists[kind]) == expected[kind], kind
    # Every rank has one place in the expert grid, and the sizes multiply to the world.
    coords = {dims.expert_coords(r) for r in range(dims.world_size)}
    assert len(coords) == dims.world_size
    assert dims.etp * dims.ep * dims.edp * dims.pp == dims.world_size
    assert all(len(g) == dims.edp for g in lists["edp"]) and all(len(g) == dims.ep for g in lists["ep"])


def test_dense_groups_are_unchanged_by_ep():
    with_ep, without = ParallelDims(tp=2, dp=2, ep=2)._rank_lists(), ParallelDims(tp=2, dp=2)._rank_lists()
    for kind in ("tp", "cp", "pp", "dp_cp", "mp", "tp_cp", "embedding"):
        assert with_ep[kind] == without[kind]


@pytest.mark.parametrize("sizes,needle", [
    (dict(dp=4, ep=3), "expert model parallel size 3 must divide tp x cp x dp = 4"),
    (dict(dp=2, cp=1, ep=4), "expert tensor parallel size 1 x expert model parallel size 4 must divide tp x cp x dp = 2"),
    (dict(tp=2, dp=2, ep=2, etp=4), "expert tensor parallel size 4 x expert model parallel size 2 must divide"),
    (dict(tp=2, cp=3, ep=4), "ETP x EP x EDP = TP x CP x DP")])
def test_impossible_expert_grids_are_one_line_errors(sizes, needle):
    with pytest.raises(ConfigError) as err:
        ParallelDims(**sizes)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _built_groups(rank, world, etp):
    dims = ParallelDims.from_world(tp=2, ep=2, etp=etp)
    out = {}
    for kind in KINDS:
        g = dims.group(kind)
        out[kind] = (dims.group_ranks[kind], group_size(g))
    # The EP group really connects the ranks it lists: sum the ranks over it.
    import torch
    t = torch.tensor([float(rank)])
    if dims.ep_group is not None:
        dist.all_reduce(t, group=dims.ep_group)
    out["ep_sum"] = t.item()
    out["coords"] = (dims.etp_rank, dims.ep_rank, dims.edp_rank)
    return out


@pytest.mark.parametrize("etp", [1, 2])
def test_groups_built_in_a_4_rank_world(etp):
    results = run_distributed(_built_groups, 4, etp)
    expected = dict(LAYOUTS[2 if etp == 1 else 3][1])
    for rank, out in enumerate(results):
        for kind in KINDS:
            ranks, size = out[kind]
            assert rank in ranks and ranks in expected[kind] and size == len(ranks), (rank, kind)
        assert out["ep_sum"] == sum(out["ep"][0])
    # ep_rank: the TP rank under folding (ETP 1), the DP rank with ETP = TP
    assert [o["coords"][1] for o in results] == ([0, 1, 0, 1] if etp == 1 else [0, 0, 1, 1])


ORACLE_LAYOUTS = [dict(tp=2, dp=2, ep=2), dict(tp=2, dp=2, ep=4), dict(tp=2, cp=2, ep=4), dict(tp=4, ep=2, etp=2),
                  dict(tp=2, dp=2, ep=2, etp=2), dict(dp=4, ep=2, etp=2), dict(tp=2, cp=2, dp=2, pp=2, ep=4),
                  dict(tp=2, cp=2, dp=2, ep=2, etp=2), dict(tp=4, dp=2, pp=2, ep=2, etp=2)]


@pytest.mark.parametrize("sizes", ORACLE_LAYOUTS, ids=[str(s) for s in ORACLE_LAYOUTS])
def test_groups_equal_megatron_cores_rank_generators(sizes):
    """Oracle: Megatron-Core's own RankGenerators (megatron/core/parallel_state.py, default order
    "tp-cp-ep-dp-pp"; the expert one with CP 1, i.e. "tp-ep-dp-pp") give the same rank lists, dense
    and expert, folded or not."""
    from megatron.core.parallel_state import RankGenerator
    dims = ParallelDims(**sizes)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=order)
    expert = RankGenerator(tp=dims.etp, ep=dims.ep, dp=dims.edp, pp=dims.pp, cp=1, order=order)
    ours = dims._rank_lists()
    for kind, gen, token in [("tp", dense, "tp"), ("cp", dense, "cp"), ("dp_cp", dense, "cp-dp"), ("pp", dense, "pp"),
                             ("mp", dense, "tp-pp"), ("etp", expert, "tp"), ("ep", expert, "ep"),
                             ("edp", expert, "dp"), ("etp_ep", expert, "tp-ep"), ("expert_mp", expert, "tp-ep-pp")]:
        assert sorted(ours[kind]) == sorted(gen.get_ranks(token)), kind


@pytest.mark.parametrize("sizes,sources,shared", [
    (dict(dp=2), [[0], [1]], False),  # each expert copy sees one replica's tokens
    (dict(cp=2, dp=2), [[0], [0], [1], [1]], True),  # a replica's CP halves reach two copies
    (dict(tp=2, dp=2, ep=2), [[0, 0], [1, 1]], False),  # folded: EP over a replica's TP ranks
    (dict(dp=4, ep=2), [[0, 1], [2, 3]], False),
    (dict(cp=4, ep=2), [[0, 0], [0, 0]], True),
])
def test_which_micro_batches_each_expert_copy_receives(sizes, sources, shared):
    """Per expert-data-parallel copy, the data-parallel rank of each ETP x EP source (what FP8's
    per-micro-batch scales group by), and whether two copies share a micro-batch."""
    dims = ParallelDims(**sizes)
    assert [dims.expert_source_replicas(e) for e in range(dims.edp)] == sources
    assert dims.edp_shares_micro_batches is shared
