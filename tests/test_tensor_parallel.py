"""Tensor/sequence parallelism reproduces the single-process model: losses and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.grads import finalize_model_grads
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.sharding import gather_full
from megatron_lite.parallel.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.testing import assert_close, assert_same_run, run_distributed
from models.gpt import build_model

GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300, hidden_dropout=0.0,
            attention_dropout=0.0, activation="gelu_tanh")
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             vocab_size=300, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0)
# OLMoE's q/k RMSNorm over all heads: its sum of squares spans the TP ranks (at TP4 the 2 K/V groups,
# and so the K norm's weight, are replicated)
FULL_WIDTH_QK_NORM = dict(LLAMA, qk_layernorm=True, qk_layernorm_full_width=True)
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "full_width_qk_norm": FULL_WIDTH_QK_NORM}


def _train(rank, world, tp, sp, cfg_kw, steps=5, recompute=None, method="uniform", num_layers=1):
    """`steps` SGD steps on fixed batches; returns losses and the gathered full gradients.
    (SGD, not Adam: Adam turns rounding noise in near-zero gradients into O(lr) updates.)"""
    cfg = ModelConfig(**cfg_kw)
    dims = ParallelDims.from_world(tp=tp)
    model = build_model(cfg, dims, seed=7, sequence_parallel=sp, recompute_granularity=recompute,
                        recompute_method=method, recompute_num_layers=num_layers)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
        opt.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        finalize_model_grads(model.parameters(), dims)
        grads.append({n: gather_full(p.grad, p, dims) for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads


@pytest.fixture(scope="module")
def references():
    return {name: run_distributed(_train, 1, 1, False, kw)[0] for name, kw in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp,sp", [(2, False), pytest.param(2, True, marks=pytest.mark.slow),
                                   pytest.param(4, False, marks=pytest.mark.slow), (4, True)])
def test_tp_matches_single_process(references, family, tp, sp):
    ref_losses, ref_grads = references[family]
    losses, grads = run_distributed(_train, tp, tp, sp, FAMILIES[family])[0]
    assert_same_run(ref_losses, losses, rtol=1e-5)
    assert len(grads) == len(ref_grads)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == rg.keys()
        # Per tensor, relative to its own norm; tensors whose gradient is negligible against the
        # whole model's are held to 1e-5 of the model-wide norm instead.
        total = torch.sqrt(sum(t.double().pow(2).sum() for t in rg.values())).item()
        for name in rg:
            assert_close(g[name], rg[name], rtol=1e-5, atol=1e-5 * 1e-2 * total, what=f"step {step} grad {name}")


def _init_weights(rank, world, tp, cfg_kw):
    dims = ParallelDims.from_world(tp=tp)
    model = build_model(ModelConfig(**cfg_kw), dims, seed=11)[0]
    return {n: gather_full(p.data, p, dims) for n, p in model.named_parameters()}


def test_initialization_is_layout_independent():
    ref = run_distributed(_init_weights, 1, 1, LLAMA)[0]
    out = run_distributed(_init_weights, 2, 2, LLAMA)[0]
    assert ref.keys() == out.keys()
    for name in ref:
        assert torch.equal(out[name], ref[name]), name
    other_seed = _init_weights_single(seed=12)
    assert not torch.equal(other_seed["layers.0.mlp.linear_fc1.weight"], ref["layers.0.mlp.linear_fc1.weight"])


def _init_weights_single(seed):
    dims = ParallelDims().build_groups()
    model = build_model(ModelConfig(**LLAMA), dims, seed=seed)[0]
    return dict(model.named_parameters())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("granularity,method,num_layers", [("full", "uniform", 1), ("full", "uniform", 2),
                                                            ("full", "block", 1), ("selective", "uniform", 1)])
def test_recomputation_gives_same_gradients(family, granularity, method, num_layers):
    kw = dict(GPT2 if family == "gpt2" else LLAMA, hidden_dropout=0.1, attention_dropout=0.1)
    out = {}
    for mode in (None, granularity):
        torch.manual_seed(3)  # same dropout masks for both runs
        losses, grads = _train(0, 1, 1, False, kw, steps=2, recompute=mode, method=method, num_layers=num_layers)
        out[mode] = (losses, grads)
    assert out[None][0] == out[granularity][0]
    for g, rg in zip(out[granularity][1], out[None][1]):
        for name in rg:
            assert torch.allclose(g[name], rg[name], rtol=1e-6, atol=1e-8), name


def _ce(rank, world, tp, vocab, ignore):
    dims = ParallelDims.from_world(tp=tp)
    gen = torch.Generator().manual_seed(5)
    padded = -(-vocab // (tp * 8)) * tp * 8  # padded like the model pads, not a multiple of vocab
    full = torch.randn(6, 3, padded, generator=gen, dtype=torch.float64).float()
    target = torch.randint(0, vocab, (6, 3), generator=gen)
    target[ignore] = -100
    local = full.chunk(tp, dim=-1)[dims.tp_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, dims, vocab)
    weights = torch.rand(6, 3, generator=gen)
    (loss * weights).sum().backward()
    return loss.detach(), local.grad, full, target, weights


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    vocab = 37  # not a multiple of tp
    ignore = (torch.tensor([0, 4]), torch.tensor([1, 2]))
    results = run_distributed(_ce, tp, tp, vocab, ignore)
    loss, _, full, target, weights = results[0]
    logits = full[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=-100, reduction="none")
    ref = ref.reshape(6, 3)
    (ref * weights).sum().backward()
    assert_close(loss, ref.detach(), rtol=1e-6, what="loss")
    assert loss[0, 1] == 0 and loss[4, 2] == 0
    grad = torch.cat([r[1] for r in results], dim=-1)
    assert_close(grad[..., :vocab], logits.grad, rtol=1e-6, what="grad")
    assert torch.all(grad[..., vocab:] == 0), "padded vocab columns must get no gradient"
