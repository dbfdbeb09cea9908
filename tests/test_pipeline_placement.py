"""Pipeline stage placement (loop, V) as one object, and messages of several tensors whose shapes
come from the micro-batch: the placement's own consistency, a V-placed action list through the
simulator and the executor (matching the single-process GPT), and tuple messages of varying length."""
import pytest
import torch
import torch.nn as nn

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.pipeline.executor import PipelineExecutor
from megatron_lite.parallel.pipeline.placement import StagePlacement
from megatron_lite.parallel.pipeline.schedules import Action, place_comm
from megatron_lite.parallel.pipeline.simulator import ScheduleError, check_schedule, simulate
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, run_distributed
from models.gpt import build_model, gpt_forward_step

PLACEMENTS = [StagePlacement(pp, vpp, kind) for kind in ("loop", "V") for pp in (1, 2, 3, 4) for vpp in (1, 2, 3)]


@pytest.mark.parametrize("pl", PLACEMENTS, ids=str)
def test_every_stage_has_one_home_and_peers_agree(pl):
    homes = [(r, c) for r in range(pl.pp) for c in range(pl.vpp)]
    assert sorted(pl.stage(r, c) for r, c in homes) == list(range(pl.num_stages))
    for r, c in homes:
        s = pl.stage(r, c)
        assert pl.location(s) == (r, c)
        assert pl.is_first(r, c) == (s == 0) and pl.is_last(r, c) == (s == pl.num_stages - 1)
        for step in (1, -1):
            n = pl.neighbour(r, c, step)
            assert n == (pl.location(s + step) if 0 <= s + step < pl.num_stages else None)
            peer = pl.peer(r, c, step)
            if n is None or n[0] == r:  # past an end, or a hand-off on this rank: no message
                assert peer is None
            else:  # if r sends to n then n receives from r, about the same hop
                assert peer == n[0] and pl.peer(n[0], n[1], -step) == r
    if pl.kind == "loop":  # Megatron's interleaved layout, unchanged
        assert all(pl.stage(r, c) == c * pl.pp + r for r, c in homes)


def test_v_turns_on_the_last_rank_and_ends_on_the_first():
    pl = StagePlacement(4, 2, "V")
    assert [pl.location(s) for s in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert pl.end_ranks() == (0, 0) and StagePlacement(4, 2).end_ranks() == (0, 3)
    assert pl.neighbour(3, 0, 1) == (3, 1) and pl.peer(3, 0, 1) is None and pl.peer(3, 1, -1) is None
    assert pl.rank_chunks(0, 16) == [((0, 2), True, False), ((14, 16), False, True)]
    assert ParallelDims(pp=4, vpp=2, pp_placement="V", rank=0).is_last_stage
    with pytest.raises(ValueError, match="placement"):
        StagePlacement(2, 2, "W")


def v_gpipe(pp, m):
    """All forwards, then all backwards, on the V placement with two chunks: each rank runs its
    chunk 0 (the earlier stage) first forward and last backward."""
    orders = [[Action("F", i, c) for c in (0, 1) for i in range(m)] + [Action("BW", i, c) for c in (1, 0)
                                                                        for i in range(m)] for _ in range(pp)]
    return place_comm(orders, StagePlacement(pp, 2, "V"))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_simulator_runs_a_v_placed_list(pp):
    m, pl = 3, StagePlacement(pp, 2, "V")
    lists = v_gpipe(pp, m)
    check_schedule(lists, pl)
    last = lists[pp - 1]
    assert not any(a.is_comm and a.kind in ("SEND_F", "RECV_B") and a.chunk == 0 for a in last)  # the turn
    res = simulate(lists, placement=pl)
    assert res.num_stages == 2 * pp
    assert res.busy == [6.0 * m] * pp and res.peak_in_flight == [2 * m] * pp  # GPipe: F = 1, BW = 2, all held
    with pytest.raises(ScheduleError):  # the same lists read as loop-placed do not pair up
        check_schedule(lists)


LLAMA4 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
              vocab_size=96, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
              add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
              attention_dropout=0.0)



def test_tied_embeddings_with_both_ends_on_one_rank_hold_two_copies_there():
    """Under V the embedding and its tied output copy are two chunks of rank 0: both built, the
    copy marked as such (GradientSync sums their gradients on the rank; tests/test_pipeline_zbv.py
    trains it like one process)."""
    from megatron_lite.parallel.sharding import spec_of
    tied = ModelConfig(**dict(LLAMA4, untie_embeddings_and_output_weights=False))
    first, last = build_model(tied, ParallelDims(pp=2, vpp=2, pp_placement="V", rank=0), seed=3, materialize=False)
    emb, out = first.embedding.word_embeddings.weight, last.output_layer.weight
    assert spec_of(emb).tie.primary and not spec_of(out).tie.primary and spec_of(emb).tie.name == spec_of(out).tie.name
    assert not hasattr(first, "output_layer") and not hasattr(last, "embedding")


def _batches(m):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, LLAMA4["vocab_size"], (2, 9), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 8)})
    return out


class _Totals:
    def __init__(self):
        self.loss = 0.0

    def add(self, loss_sum, tokens, logs):
        self.loss += loss_sum.item()


class _ListExecutor(PipelineExecutor):
    """The executor on hand-written per-rank lists (a V-placed GPipe, which no schedule name yields)."""

    def __init__(self, lists, *args):
        super().__init__(*args)
        self.lists = lists

    def actions(self, num_microbatches, forward_only):
        return self.lists[self.rank]


def _grads(chunks):
    return {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}


def _v_pipeline(rank, world, m):
    dims = ParallelDims(pp=2, vpp=2, pp_placement="V").build_groups()
    chunks = build_model(ModelConfig(**LLAMA4), dims, seed=3)
    totals = _ListExecutor(v_gpipe(2, m), chunks, dims, "gpipe", torch.device("cpu")).run(
        _batches(m), gpt_forward_step, lambda loss_sum, tokens: loss_sum, _Totals())
    return totals.loss, _grads(chunks)


def test_executor_runs_a_v_placed_list_like_one_process():
    m = 3
    model = build_model(ModelConfig(**LLAMA4), ParallelDims(), seed=3)[0]
    ref_loss = 0.0
    for b in _batches(m):
        out, loss_func = gpt_forward_step(b, model)
        loss_sum, _, _ = loss_func(out)
        loss_sum.backward()
        ref_loss += loss_sum.item()
    ref = _grads([model])
    (loss0, grads0), (loss1, grads1) = run_distributed(_v_pipeline, 2, m)
    assert abs(loss0 - ref_loss) <= 1e-5 * ref_loss and loss1 == 0.0  # rank 0 holds the last stage
    assert "embedding.word_embeddings.weight" in grads0 and "output_layer.weight" in grads0
    assert sorted({**grads0, **grads1}) == sorted(ref)
    for name, g in {**grads0, **grads1}.items():
        assert_close(g, ref[name], rtol=1e-5, what=name)


class _Carry(nn.Module):
    """A toy stage whose message is three tensors: hidden [s, 4], extra [s, 2] and integer
    positions [s] (no gradient), s varying by micro-batch."""

    def __init__(self, stage, last):
        super().__init__()
        torch.manual_seed(stage)
        self.lin, self.first, self.last, self.x = nn.Linear(4, 4), stage == 0, last, None

    def set_input_tensor(self, x):
        self.x = x

    def pipeline_input_spec(self, batch):
        s = batch["x"].shape[0]
        return [((s, 4), torch.float32), ((s, 2), torch.float32), ((s,), torch.int64)]

    def forward(self, batch):
        x = batch["x"]
        h, extra, pos = (x, x[:, :2], torch.arange(len(x))) if self.first else self.x
        h = torch.tanh(self.lin(h))
        extra = extra * h[:, 2:] + pos[:, None]
        return h.square().sum() + extra.square().sum() if self.last else (h, extra, pos)


def _carry_batches():
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(n, 4, generator=gen)} for n in (3, 5, 2, 7)]


def _carry_step(batch, chunk):
    return chunk(batch), lambda out: (out, 1, {})


def _carry_pipeline(rank, world, forward_only):
    dims = ParallelDims(pp=2).build_groups()
    chunk = _Carry(rank, last=rank == 1)
    totals = PipelineExecutor([chunk], dims, "1f1b", torch.device("cpu")).run(
        _carry_batches(), _carry_step, lambda loss_sum, tokens: loss_sum, _Totals(), forward_only)
    return totals.loss, {n: p.grad for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("forward_only", [False, True])
def test_messages_of_several_tensors_and_lengths(forward_only):
    stages = [_Carry(0, last=False), _Carry(1, last=True)]
    ref_loss = 0.0
    for b in _carry_batches():
        stages[1].set_input_tensor(stages[0](b))
        loss = stages[1](b)
        loss.backward()
        ref_loss += loss.item()
    (_, grads0), (loss1, grads1) = run_distributed(_carry_pipeline, 2, forward_only)
    assert abs(loss1 - ref_loss) <= 1e-5 * ref_loss
    for (n, p), got in zip([(n, p) for s in stages for n, p in s.named_parameters()],
                           list(grads0.values()) + list(grads1.values())):
        if forward_only:
            assert got is None, n
        else:
            assert_close(got, p.grad, rtol=1e-5, what=n)
