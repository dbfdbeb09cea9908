"""ParallelDims: the sizes of every parallel dimension, this rank's coordinates, and its groups.

Rank layout follows Megatron-LM's default order "tp-cp-ep-dp-pp": TP ranks are adjacent (so
TP stays inside a node), then CP, then DP, then PP outermost:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

EP is carved out of (dp * cp) for expert layers. One object is built once and passed to the
layers that need a group; nothing is stored in module-level globals, so several instances may
coexist (tests build one per layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist


@dataclass
class ParallelDims:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    rank: int = 0
    groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict, repr=False)
    group_ranks: Dict[str, List[int]] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    # --- coordinates -------------------------------------------------------------------------
    def coords(self, rank: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank."""
        r = self.rank if rank is None else rank
        tp_rank = r % self.tp
        r //= self.tp
        cp_rank = r % self.cp
        r //= self.cp
        dp_rank = r % self.dp
        pp_rank = r // self.dp
        return tp_rank, cp_rank, dp_rank, pp_rank

    def global_rank(self, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    @property
    def tp_rank(self) -> int:
        return self.coords()[0]

    @property
    def cp_rank(self) -> int:
        return self.coords()[1]

    @property
    def dp_rank(self) -> int:
        return self.coords()[2]

    @property
    def pp_rank(self) -> int:
        return self.coords()[3]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    # --- groups ------------------------------------------------------------------------------
    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group `name` this rank belongs to; None when it has one member."""
        return self.groups.get(name)

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def cp_group(self):
        return self.group("cp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def dp_cp_group(self):
        return self.group("dp_cp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def mp_group(self):
        """Model-parallel group (TP x PP): ranks holding different slices of one model replica."""
        return self.group("mp")

    @property
    def embedding_group(self):
        """First and last pipeline stage of one TP/DP slice, for tied embedding grads."""
        return self.group("embedding")

    def tp_replica_group(self, replicas: int):
        """The TP ranks that hold the same shard of a parameter replicated on `replicas` ranks."""
        if replicas <= 1:
            return None
        return self.tp_group if replicas >= self.tp else self.group(f"tp_sub{replicas}")

    def pp_ranks(self) -> List[int]:
        return self.group_ranks["pp"]

    def _rank_lists(self) -> Dict[str, List[List[int]]]:
        """Every group of every kind as lists of global ranks, in a deterministic order."""
        coords = [self.coords(r) for r in range(self.world_size)]

        def by(keep):  # group ranks that agree on all coordinates except those in `keep`
            buckets: Dict[tuple, List[int]] = {}
            for r, c in enumerate(coords):
                key = tuple(v for i, v in enumerate(c) if i not in keep)
                buckets.setdefault(key, []).append(r)
            return list(buckets.values())

        lists = {
            "tp": by({0}), "cp": by({1}), "dp": by({2}), "pp": by({3}),
            "dp_cp": by({1, 2}), "mp": by({0, 3}), "tp_cp": by({0, 1}),
        }
        for r in range(2, self.tp):  # blocks of r consecutive TP ranks (replicated K/V groups)
            if self.tp % r == 0:
                lists[f"tp_sub{r}"] = [tp_group[i:i + r] for tp_group in lists["tp"] for i in range(0, self.tp, r)]
        emb = []
        for pp_group in lists["pp"]:
            emb.append(sorted({pp_group[0], pp_group[-1]}))
        lists["embedding"] = emb
        return lists

    def build_groups(self) -> "ParallelDims":
        """Create every process group. Collective: every rank must call it in the same order."""
        if self.world_size == 1 or not dist.is_initialized():
            assert self.world_size == 1 or not dist.is_initialized(), "world > 1 needs torch.distributed"
            for name, lists in self._rank_lists().items():
                self.group_ranks[name] = lists[0]
                self.groups[name] = None
            return self
        assert dist.get_world_size() == self.world_size, (
            f"world size {dist.get_world_size()} != tp*cp*dp*pp = {self.world_size}")
        self.rank = dist.get_rank()
        for name, lists in self._rank_lists().items():
            for ranks in lists:
                # new_group is collective over the whole world, even for non-members.
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self.groups[name] = g
                    self.group_ranks[name] = ranks
        return self

    @classmethod
    def from_world(cls, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int = 1) -> "ParallelDims":
        """Derive DP from the initialized world and build the groups (or a single-process layout)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        dims = cls(tp=tp, cp=cp, dp=world // (tp * cp * pp), pp=pp, ep=ep, vpp=vpp,
                   rank=dist.get_rank() if dist.is_initialized() else 0)
        return dims.build_groups()


def partial_dp_groups(dims: ParallelDims, instances: int):
    """(shard group, replica group) of this rank for --num-distributed-optimizer-instances: the
    DP x CP ranks of each model slice cut into `instances` blocks of consecutive ranks (an
    instance, over which the optimizer is sharded), and the ranks at the same place in every
    block (which hold the same shard). Collective the first time (built once per `instances`)."""
    key = f"dp_cp_partial{instances}"
    if key + "_shard" in dims.group_ranks:
        return dims.groups[key + "_shard"], dims.groups[key + "_replica"]
    lists = dims._rank_lists()["dp_cp"]
    size = len(lists[0])
    if instances < 1 or size % instances:
        raise ValueError(f"{instances} distributed-optimizer instances must divide the {size} data-parallel ranks")
    per = size // instances
    kinds = {"_shard": [ranks[i:i + per] for ranks in lists for i in range(0, size, per)],
             "_replica": [ranks[j::per] for ranks in lists for j in range(per)]}
    for suffix, groups in kinds.items():
        for ranks in groups:
            # new_group is collective over the whole world, even for non-members.
            g = dist.new_group(ranks) if len(ranks) > 1 and dist.is_initialized() else None
            if dims.rank in ranks:
                dims.groups[key + suffix], dims.group_ranks[key + suffix] = g, ranks
    return dims.groups[key + "_shard"], dims.groups[key + "_replica"]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)
