"""Two-hop qgZ (--zeropp-quantized-gradients when DP spans nodes): an int4 all-to-all inside each
node, an fp32 sum, a second int4 all-to-all across nodes. Bytes per hop against their theory, each
reduced gradient close to the exact one and on the rank that owns it in ZeRO-3's layout, nothing
lost (applied + residual = exact, both hops' errors folded), an idle bucket's errors drain, and the
node size rule (one hop where the DP group fits in a node)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.parallel import comm
from megatron_lite.parallel.compression import CompressedReducer, node_hops, qgz_node_size
from megatron_lite.parallel.compression import codec as make_codec
from megatron_lite.parallel.data_parallel import GradientSync
from megatron_lite.parallel.state import ParallelDims, group_rank
from megatron_lite.testing import run_distributed
from models.gpt import build_model
from test_compression import STEP_TOLERANCE, STEPS
from test_zero import MODEL, make_batches
from training_utils import reduce_step

INT4 = make_codec("int4-blocks")


def test_node_size_rule():
    """hpZ's partition first, else LOCAL_WORLD_SIZE over the TP ranks in a node; DP itself (one
    hop) when the DP group fits in a node or a node would not hold a whole share of it."""
    assert qgz_node_size(dp=8, tp=1, hpz=2, local_world_size=8) == 2
    assert qgz_node_size(dp=8, tp=2, hpz=1, local_world_size=8) == 4
    assert qgz_node_size(dp=4, tp=1, hpz=1, local_world_size=8) == 4  # DP inside one node
    assert qgz_node_size(dp=4, tp=1, hpz=1, local_world_size=None) == 4  # not under torchrun
    assert qgz_node_size(dp=6, tp=1, hpz=1, local_world_size=4) == 6  # 4 does not divide 6
    assert qgz_node_size(dp=8, tp=3, hpz=1, local_world_size=8) == 8  # TP across nodes


def zero3_reduce_steps(make_reducer):
    """ZeRO-3 GradientSync over this world's DP group with `make_reducer(dims)`'s reducer (None:
    plain), STEPS steps of gradients reduced: (dims, chunks, sync, every step's shards, bytes)."""
    dims = ParallelDims.from_world()
    dims.comm_counter = comm.CommCounter()
    chunks = build_model(ModelConfig(**MODEL), dims, seed=5)
    sync = GradientSync(chunks, dims, zero_stage=3, bucket_size=3000, overlap_grad_reduce=True,
                        units=[c.sharding_units() for c in chunks], reducer=make_reducer(dims))
    shards, volume = [], []
    for step in range(STEPS):
        reduce_step(sync, chunks, make_batches(step, dims, 1, MODEL["vocab_size"]))
        shards.append([b.grad_shard_view().clone() for b in sync.buckets])
        volume.append(dims.comm_counter.reset())
        sync.zero_grad()
    return dims, chunks, sync, shards, volume


def _reduce_steps(rank, world, node):
    """Per reducer (PlainReducer, two-hop int4): every step's reduced shards and bytes, the
    residual the errors fold into; and whether node size = DP gives no second hop."""
    out = {}
    for name in ("plain", "two-hop"):
        dims, chunks, sync, shards, volume = zero3_reduce_steps(
            lambda dims: None if name == "plain" else CompressedReducer(dims.comm, "int4-blocks", node_hops(dims, node)))
        reducer = sync.reducer if name != "plain" else None
        residual = [reducer.fold_for_checkpoint(b).clone() for b in sync.buckets] if reducer else None
        theory = [(b.numel, b.group_size) for b in sync.buckets]
        out[name] = shards, volume, residual, theory
    out["one_hop_at_dp"] = node_hops(dims, world) is None
    return out


@pytest.mark.parametrize("world,node", [(4, 2), pytest.param(8, 2, marks=pytest.mark.slow),
                                        pytest.param(8, 4, marks=pytest.mark.slow)])
def test_two_hops_move_their_bytes_and_reduce_like_fp32(world, node):
    """DP4 in nodes of 2 (ZeRO-3): per micro-batch and bucket the intra-node
    all-to-all moves the N int4 rows (as one hop's all-to-all did) and the inter-node one only
    N / node rows; each reduced shard is within one hop's int4 bound (the test_compression
    tolerance; the second rounding is of fp32 partial sums) of the fp32 reduce-scatter's on the
    same rank (a shard landing elsewhere fails it); applied + residual = the exact sums."""
    nodes, runs = world // node, run_distributed(_reduce_steps, world, node, timeout=180)
    rounds = len(make_batches(0, SimpleNamespace(dp=world, dp_rank=0), 1, 1))  # ZeRO-3: one per micro-batch
    for run in runs:
        exact, plain_volume, _, theory = run["plain"]
        got, volume, residual, _ = run["two-hop"]
        for step in range(STEPS):
            for e, g in zip(exact[step], got[step]):
                assert torch.all((g - e).abs() <= STEP_TOLERANCE["int4-blocks"] * world * e.abs().max() + 1e-12)
        for i in range(len(theory)):
            applied = sum(got[s][i] for s in range(STEPS)) + residual[i]
            wanted = sum(exact[s][i] for s in range(STEPS))
            torch.testing.assert_close(applied, wanted, rtol=1e-5, atol=1e-6 * wanted.abs().max().item())
        rows = [-(-(-(-numel // n)) // INT4.align) * INT4.align for numel, n in theory]  # shard in whole blocks
        intra = sum(n * INT4.row_bytes(p) for p, (_, n) in zip(rows, theory))
        inter = sum(n // node * INT4.row_bytes(p) for p, (_, n) in zip(rows, theory))
        assert inter * node == intra  # cross-node bytes: 1/node of one hop's all-to-all
        for step in range(STEPS):
            kinds = {k: v for k, v in volume[step].items() if k.startswith("all_to_all")}
            assert kinds == {"all_to_all_intra_node": rounds * intra, "all_to_all_inter_node": rounds * inter}
            assert "reduce_scatter" not in volume[step] and plain_volume[step]["reduce_scatter"] > 0
        assert run["one_hop_at_dp"]
    assert nodes > 1


def _idle_bucket(rank, world, node, steps):
    """A 2-block-per-rank bucket reduced in two hops: a gradient on step 0, none after (only the
    errors travel). Returns (every step's reduced shard, the worker and node errors at the end)."""
    dims = ParallelDims.from_world()
    hops = node_hops(dims, node)
    reducer = CompressedReducer(dims.comm, "int4-blocks", hops)
    numel = world * 2 * INT4.align
    out = torch.zeros(numel // world)
    b = SimpleNamespace(index=0, group=hops.group, group_size=world, group_rank=group_rank(hops.group), sharded=True,
                        numel=numel, grad_data=torch.zeros(numel), replica_group=None, reduce_out=lambda: out)
    gen = torch.Generator().manual_seed(rank)
    shards = []
    for step in range(steps):
        b.grad_data = torch.randn(numel, generator=gen) * 1e-3 if step == 0 else torch.zeros(numel)
        reducer.start(b).wait()
        shards.append(out.clone())
    return shards, reducer.exchange.worker[0], reducer.node_error[0]


def test_an_idle_bucket_drains_through_both_hops():
    """After its one gradient, a bucket sends only its errors, which shrink to denormals in both
    hops; no scale may become 0 / 0 (NaN for good, the bug the one-hop idle-block test pins)."""
    for shards, worker, node_error in run_distributed(_idle_bucket, 4, 2, 150, timeout=120):
        assert all(torch.isfinite(s).all() for s in shards)
        assert torch.isfinite(worker).all() and torch.isfinite(node_error).all()
        assert worker.abs().max() < 1e-37 and node_error.abs().max() < 1e-37
        assert shards[0].abs().max() > 0


def _train_in_nodes_of(rank, world, argv, local_world_size):
    """pretrain_gpt's Trainer on this rank as if torchrun had put `local_world_size` ranks on a node."""
    import os
    from test_compression import _train_with_params
    if local_world_size:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    return _train_with_params(rank, world, argv)


def test_pretrain_at_dp4_in_nodes_of_two_reduces_in_two_hops_and_trains_like_plain():
    """pretrain_gpt at DP4 ZeRO-3 with --zeropp-quantized-gradients: nodes of 2 from
    --zeropp-hpz-partition-size 2 or (without hpZ) from LOCAL_WORLD_SIZE=2 give the same two hops
    (--log-comm-volume: the intra-node bytes twice the inter-node ones, no one-hop all-to-all, no
    reduce-scatter) and the same losses (hpZ changes no value), within 1 % of plain ZeRO-3's."""
    from test_compression import TINY
    from training_utils import losses_of
    argv = TINY + ["--train-iters", "2", "--zero-stage", "3", "--global-batch-size", "8", "--log-comm-volume"]
    qg = ["--zeropp-quantized-gradients"]
    runs = {name: run_distributed(_train_in_nodes_of, 4, argv + flags, local, timeout=240)
            for name, flags, local in (("plain", [], None), ("hpz", qg + ["--zeropp-hpz-partition-size", "2"], None),
                                       ("local", qg, 2))}
    for name in ("hpz", "local"):
        for rec in runs[name][0][0]:
            comm_bytes = rec["comm_bytes"]
            assert comm_bytes["all_to_all_intra_node"] == 2 * comm_bytes["all_to_all_inter_node"] > 0, name
            assert "all_to_all" not in comm_bytes and "reduce_scatter" not in comm_bytes, name
    base, hpz = losses_of([r[0] for r in runs["plain"]]), losses_of([r[0] for r in runs["hpz"]])
    assert losses_of([r[0] for r in runs["local"]]) == hpz
    # qgZ's int4 gradients are not plain's: their norm differs (the losses alone may agree, since Adam's
    # first step is close to sign(g), which quantization rarely flips)
    grad_norms = {name: [rec["grad_norm"] for rec in runs[name][0][0]] for name in ("plain", "hpz")}
    assert hpz == pytest.approx(base, rel=0.01) and grad_norms["hpz"] != grad_norms["plain"]


@pytest.mark.slow  # (three DP4 runs and a DP2 load: ~16 s here; the fold itself is in the default cell above)
def test_two_hop_errors_checkpoint_resume_exactly_and_reshard_to_one_hop(tmp_path):
    """DP4 ZeRO-3 qgZ in nodes of 2 (hpZ 2): saved at 3 and resumed, the run continues exactly as
    the one that saved at 3 and went on (a save folds both hops' errors into grad_residual); its
    last checkpoint loaded at DP2 (one hop) gives every rank the checkpoint's residual shard."""
    from megatron_lite.checkpoint.offline import open_checkpoint
    from test_compression import TINY, _loaded_residual
    from training_utils import losses_of, train_in_process
    argv = TINY + ["--train-iters", "6", "--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-qgz-error-feedback"]
    dp4 = ["--global-batch-size", "8", "--zeropp-hpz-partition-size", "2"]

    def losses(extra):
        return losses_of(run_distributed(train_in_process, 4, argv + dp4 + extra, timeout=240))

    straight = losses(["--save", str(tmp_path / "a"), "--save-interval", "3"])
    first = losses(["--save", str(tmp_path / "b"), "--exit-interval", "3"])
    assert first + losses(["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]) == straight
    with open_checkpoint(str(tmp_path / "a"), 6) as reader:
        saved = {k.split("/")[1]: reader.read_full(k).reshape(-1) for k in reader.pieces
                 if k.endswith("/grad_residual")}
    assert saved and any(t.abs().max() > 0 for t in saved.values())
    loaded = {}
    for pieces in run_distributed(_loaded_residual, 2, argv + ["--load", str(tmp_path / "a")], timeout=240):
        for name, lo, values in pieces:
            loaded.setdefault(name, {})[lo] = values
    for name, want in saved.items():  # (a padded vocabulary's rows past the true one are not stored)
        got = torch.cat([loaded[name][lo] for lo in sorted(loaded[name])])
        assert torch.equal(got[:want.numel()], want) and not got[want.numel():].any(), name
