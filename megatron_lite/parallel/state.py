"""ParallelDims: the sizes of every parallel dimension, this rank's coordinates, and its groups.

Rank layout follows Megatron-LM's default order "tp-cp-ep-dp-pp": TP ranks are adjacent (so
TP stays inside a node), then CP, then DP, then PP outermost:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert layers see Megatron-Core's expert grid ETP x EP x EDP x PP, folded over the same ranks as
the attention grid TP x CP x DP x PP but independently of it (MoE parallel folding): within one
pipeline stage, with s = tp_rank + tp * (cp_rank + cp * dp_rank) the rank's place in the stage,
the expert order is "tp-ep-dp" (ETP ranks adjacent, then EP, then EDP):

    etp_rank = s % etp,   ep_rank = (s // etp) % ep,   edp_rank = s // (etp * ep)

so ETP x EP x EDP = TP x CP x DP (etp * ep must divide it). With ETP = TP the expert TP group is
the dense TP group; with ETP < TP, EP spans the TP ranks of a node first (TP2 x EP4 on 4 ranks).
Every rank routes its own tokens (MoE layers split the sequence over TP), so any expert grid
sees each token once.

One object is built once and passed to the layers that need a group; nothing is stored in
module-level globals, so several instances may coexist (tests build one per layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .comm import CommCounter, Communicator, group_rank, group_size  # noqa: F401 (re-exported)
from .pipeline.placement import StagePlacement


@dataclass
class ParallelDims:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    cp_a2a: int = 0  # hierarchical CP (a2a+p2p): consecutive CP ranks in each all-to-all group; 0: none
    etp: int = 1  # expert tensor parallelism: ranks splitting each expert's ffn dimension
    pp_placement: str = "loop"  # which pipeline rank runs each virtual stage (pipeline/placement.py)
    rank: int = 0
    groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict, repr=False)
    group_ranks: Dict[str, List[int]] = field(default_factory=dict, repr=False)
    timeout: Optional[timedelta] = None  # of every group (--distributed-timeout-minutes); None: torch's default
    comm: Communicator = field(default_factory=Communicator, repr=False, compare=False)  # every collective

    def __post_init__(self):
        stage = self.tp * self.cp * self.dp
        if self.ep < 1 or self.etp < 1 or stage % (self.ep * self.etp) != 0:
            raise ConfigError(f"expert grid does not fit: expert tensor parallel size {self.etp} x expert model "
                              f"parallel size {self.ep} must divide tp x cp x dp = {stage} (tp {self.tp} x cp "
                              f"{self.cp} x dp {self.dp}; ETP x EP x EDP = TP x CP x DP): pick "
                              f"--expert-model-parallel-size and --expert-tensor-parallel-size whose product "
                              f"divides {stage}")

    @property
    def comm_counter(self) -> Optional[CommCounter]:
        """Where the communicator counts bytes moved (None: nothing is counted)."""
        return self.comm.counter

    @comm_counter.setter
    def comm_counter(self, counter: Optional[CommCounter]) -> None:
        self.comm.counter = counter

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel size: ranks of one pipeline stage holding the same expert shard."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

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

    def expert_coords(self, rank: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(etp_rank, ep_rank, edp_rank, pp_rank) of a global rank in the expert grid."""
        r = self.rank if rank is None else rank
        stage = self.tp * self.cp * self.dp
        s, pp_rank = r % stage, r // stage
        return s % self.etp, (s // self.etp) % self.ep, s // (self.etp * self.ep), pp_rank

    def expert_global_rank(self, etp_rank: int = 0, ep_rank: int = 0, edp_rank: int = 0, pp_rank: int = 0) -> int:
        return etp_rank + self.etp * (ep_rank + self.ep * (edp_rank + self.edp * pp_rank))

    def expert_source_replicas(self, edp_rank: Optional[int] = None) -> List[int]:
        """The data-parallel rank of each member (etp_src * EP + ep_src) of this rank's ETP x EP group,
        or that of expert-data-parallel rank `edp_rank`: whose micro-batches its experts receive."""
        _, _, mine, pp_rank = self.expert_coords()
        edp_rank = mine if edp_rank is None else edp_rank
        return [self.coords(self.expert_global_rank(t, e, edp_rank, pp_rank))[2]
                for t in range(self.etp) for e in range(self.ep)]

    @cached_property
    def edp_shares_micro_batches(self) -> bool:
        """Whether two expert-data-parallel copies of an expert receive tokens of one micro-batch (a
        data-parallel replica split over CP or TP ranks of different ETP x EP groups)."""
        seen = [set(self.expert_source_replicas(d)) for d in range(self.edp)]
        return sum(len(r) for r in seen) > len(set().union(*seen))

    @property
    def ep_rank(self) -> int:
        return self.expert_coords()[1]

    @property
    def etp_rank(self) -> int:
        return self.expert_coords()[0]

    @property
    def edp_rank(self) -> int:
        return self.expert_coords()[2]

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
    def placement(self) -> StagePlacement:
        return StagePlacement(self.pp, self.vpp, self.pp_placement)

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first virtual pipeline stage (the embedding)."""
        return self.pp_rank == self.placement.end_ranks()[0]

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last virtual pipeline stage (the loss)."""
        return self.pp_rank == self.placement.end_ranks()[1]

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

    # --- expert groups (see the module docstring for the grid) ----------------------------------
    @property
    def ep_group(self):
        """Expert parallel: the ranks that share out one layer's experts (token all-to-all)."""
        return self.group("ep")

    @property
    def etp_group(self):
        """Expert tensor parallel: the ranks holding slices of the same experts (adjacent ranks)."""
        return self.group("etp")

    @property
    def etp_ep_group(self):
        """ETP x EP: every rank holding a piece of one layer's experts for one set of tokens."""
        return self.group("etp_ep")

    @property
    def edp_group(self):
        """Expert data parallel: the ranks holding the same expert shard. Expert gradients are
        summed over it (instead of dp_cp) and ZeRO shards expert state over it."""
        return self.group("edp")

    @property
    def expert_mp_group(self):
        """ETP x EP x PP: the ranks holding distinct pieces of the experts of one model replica.
        The expert part of the global grad norm (every rank counts all its expert elements) is
        all-reduced over it, as the dense part is over mp."""
        return self.group("expert_mp")

    @property
    def tp_dp_cp_group(self):
        """All ranks of one pipeline stage: routed-token counts for the expert bias are summed here."""
        return self.group("tp_dp_cp")

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
            "tp": by({0}), "cp": by({1}), "pp": by({3}),
            "dp_cp": by({1, 2}), "mp": by({0, 3}), "tp_cp": by({0, 1}), "tp_dp_cp": by({0, 1, 2}),
        }
        if self.cp_a2a:  # Ulysses inside blocks of consecutive CP ranks, the ring across them
            a = self.cp_a2a
            lists["cp_a2a"] = [g[i:i + a] for g in lists["cp"] for i in range(0, self.cp, a)]
            lists["cp_p2p"] = [g[j::a] for g in lists["cp"] for j in range(a)]
        lists.update(self._expert_rank_lists())
        lists["world"] = [list(range(self.world_size))]
        for r in range(2, self.tp):  # blocks of r consecutive TP ranks (replicated K/V groups)
            if self.tp % r == 0:
                lists[f"tp_sub{r}"] = [tp_group[i:i + r] for tp_group in lists["tp"] for i in range(0, self.tp, r)]
        lists["embedding"] = [sorted({g[r] for r in self.placement.end_ranks()}) for g in lists["pp"]]
        return lists

    def _expert_rank_lists(self) -> Dict[str, List[List[int]]]:
        """The groups of the expert grid (etp, ep, edp, pp coordinates) as lists of global ranks."""
        coords = [self.expert_coords(r) for r in range(self.world_size)]

        def by(vary):  # ranks that agree on every expert coordinate not in `vary`
            buckets: Dict[tuple, List[int]] = {}
            for r, c in enumerate(coords):
                buckets.setdefault(tuple(v for i, v in enumerate(c) if i not in vary), []).append(r)
            return list(buckets.values())

        return {"etp": by({0}), "ep": by({1}), "edp": by({2}), "etp_ep": by({0, 1}), "expert_mp": by({0, 1, 3})}

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
                g = dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self.groups[name] = g
                    self.group_ranks[name] = ranks
                    self.comm.name_group(g, name)  # for the one line that names a failed collective
        return self

    @classmethod
    def from_world(cls, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int = 1,
                   cp_a2a: int = 0, etp: int = 1, timeout: Optional[timedelta] = None,
                   pp_placement: str = "loop") -> "ParallelDims":
        """Derive DP from the initialized world and build the groups (or a single-process layout)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        dims = cls(tp=tp, cp=cp, dp=world // (tp * cp * pp), pp=pp, ep=ep, vpp=vpp, cp_a2a=cp_a2a, etp=etp,
                   rank=dist.get_rank() if dist.is_initialized() else 0, timeout=timeout,
                   pp_placement=pp_placement if pp > 1 else "loop")
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
            g = dist.new_group(ranks, timeout=dims.timeout) if len(ranks) > 1 and dist.is_initialized() else None
            if dims.rank in ranks:
                dims.groups[key + suffix], dims.group_ranks[key + suffix] = g, ranks
                dims.comm.name_group(g, key + suffix)
    return dims.groups[key + "_shard"], dims.groups[key + "_replica"]


def choose_device(requested: Optional[str]) -> torch.device:
    if requested != "cpu":
        # Megatron-LM's setting (read when the CUDA context is created): one hardware queue, so
        # kernels start in issue order and a TP/CP collective issued before a GEMM overlaps it.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if requested == "cuda" or (requested is None and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_minutes: Optional[float] = None) -> None:
    """Join the torchrun world (NCCL on GPUs, gloo on CPU); nothing to do for a single process.
    `timeout_minutes` (--distributed-timeout-minutes): how long a collective waits for a peer."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    # Under torchrun every restart of the workers reuses the agent's store, where the failed
    # attempt's keys would hand the new ranks the dead ranks' addresses (torch 2.13: "connection
    # refused"; pytorch/pytorch#167288). A key prefix per attempt keeps the attempts apart. A store
    # that rank 0 hosts (no agent store: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is new at every
    # attempt and takes no prefix: a node that joined later counts its agent's restarts from 0.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timedelta(minutes=10))
    if agent_store:
        store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
