"""Gradient finalization (parallel/grads.py) sums every partial gradient model parallelism
leaves, with ONE all-reduce per group over a flat buffer: under TP 4 with SP and one K/V group
per two ranks, one all-reduce over TP (the sequence-parallel norms and biases) and one over each
K/V replica pair; the sums equal all-reducing each gradient alone (to rounding: gloo's ring sums
a flat buffer in another order), and gradients no group shares are left as they were."""
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.parallel import grads
from megatron_lite.parallel.sharding import spec_of
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import run_distributed
from models.gpt import build_model


def _finalize_both_ways(rank, world):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      vocab_size=256, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0)
    dims = ParallelDims.from_world(tp=world)
    model = build_model(cfg, dims, seed=3, sequence_parallel=True)[0]
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    params = list(model.parameters())
    before = [p.grad.clone() for p in params]

    calls = []
    real = dims.comm.all_reduce

    def counted(t, group, *a, **kw):
        calls.append((t.numel(), tuple(torch.distributed.get_process_group_ranks(group))))
        return real(t, group, *a, **kw)

    dims.comm.all_reduce = counted
    try:
        grads.finalize_model_grads(params, dims)
    finally:
        del dims.comm.all_reduce  # the method again
    expected = []  # each gradient all-reduced alone, over each group it is partial over
    for p, g in zip(params, before):
        g = g.clone()
        for _, group in grads._partial_over(p, dims):
            real(g, group)
        expected.append(g)
    partial = {key for p in params for key, _ in grads._partial_over(p, dims)}
    sp = sum(spec_of(p).sequence_parallel for p in params)
    return calls, partial, sp, [torch.allclose(p.grad, e, rtol=1e-6, atol=1e-8) and not torch.equal(e, b) if grads._partial_over(p, dims)
                         else torch.equal(p.grad, b) for p, e, b in zip(params, expected, before)]


def test_one_all_reduce_per_group_and_the_same_sums():
    for calls, partial, sp, same in run_distributed(_finalize_both_ways, 4):
        assert partial == {"tp", "tp_sub2"}  # SP params over TP, K/V replicated on pairs of ranks
        assert sp >= 5  # final norm and two per layer: batched, not one call each
        assert len(calls) == 2, calls
        assert all(same)
