"""Packed documents (--reset-attention-mask --reset-position-ids): every core-attention backend
and every TP layout give each token the loss it has when its document runs alone."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.grads import finalize_model_grads
from megatron_lite.parallel.sharding import gather_full
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, run_distributed
from megatron_lite.transformer.core_attention import PackedSeq
from models.gpt import build_model

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             vocab_size=97, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0)
GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97, hidden_dropout=0.0,
            attention_dropout=0.0)
LENGTHS = [5, 9, 2, 8]  # documents packed into one sequence of 24 tokens


def _packed_batch(batch=2):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (batch, sum(LENGTHS) + 1), generator=gen)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]).expand(batch, -1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).expand(batch, -1)
    return tokens[:, :-1], tokens[:, 1:], positions, docs


def _per_token_loss(rank, world, cfg_kw, backend, tp, sp=False):
    cfg = ModelConfig(**cfg_kw, attention_backend=backend)
    dims = ParallelDims.from_world(tp=tp)
    model = build_model(cfg, dims, seed=3, sequence_parallel=sp)[0]
    tokens, labels, positions, docs = _packed_batch()
    loss = model(tokens, positions, labels, PackedSeq(docs))
    loss.sum().backward()
    finalize_model_grads(model.parameters(), dims)  # SP norms: partial over the TP ranks
    grads = {n: gather_full(p.grad, p, dims) for n, p in model.named_parameters()}
    if sp:  # documents alone would not split evenly over the TP ranks' sequence shards
        return loss.detach(), None, grads
    alone = []  # each document on its own: positions from 0, no packing
    start = 0
    for n in LENGTHS:
        alone.append(model(tokens[:, start:start + n], None, labels[:, start:start + n]))
        start += n
    return loss.detach(), torch.cat(alone, dim=1).detach(), grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", ["sdpa", "local", "flash"])
def test_packed_documents_see_only_themselves(family, backend):
    kw = GPT2 if family == "gpt2" else LLAMA
    packed, alone, _ = run_distributed(_per_token_loss, 1, kw, backend, 1)[0]
    assert_close(packed, alone, rtol=1e-6)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True)])
def test_packed_documents_under_tensor_parallelism(tp, sp):
    ref_loss, _, ref_grads = run_distributed(_per_token_loss, 1, LLAMA, "sdpa", 1)[0]
    loss, _, grads = run_distributed(_per_token_loss, tp, LLAMA, "sdpa", tp, sp)[0]
    assert_close(loss, ref_loss, rtol=1e-6)
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], rtol=1e-5, what=name)
