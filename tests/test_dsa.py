"""DeepSeek Sparse Attention: the indexer's top-k against a naive per-query loop and Hugging Face's
DeepseekV32Indexer, the sparse core against dense attention masked to the same keys (forward and
gradients), the KL loss against Megatron-Core's, DSA equal to MLA when top-k covers the sequence,
packed documents kept apart, the two training stages, layouts equal to the single process, and the
flags' one-line errors."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import TINY, assert_one_line_error, merged_params, records_of, single_process_reference, \
    train_and_gather

MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "20"]
DSA = ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "16",
       "--dsa-indexer-topk", "16", "--dsa-indexer-loss-coeff", "0.5", "--init-method-std", "0.1"]
BASE = TINY + ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear"] + MLA + DSA


def _cfg(**kw):
    base = dict(hidden_size=64, num_attention_heads=4, normalization="RMSNorm", position_embedding_type="rope",
                add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, multi_latent_attention=True,
                q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=20,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
                dsa_indexer_topk=6, dsa_indexer_loss_coeff=0.5)
    return ModelConfig(**{**base, **kw})


def _randomized(module, seed=0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))
    return module


def _rope(cfg, positions):
    from megatron_lite.transformer.rope import rope_cos_sin, rope_inv_freq
    return rope_cos_sin(positions, rope_inv_freq(cfg), torch.float32)


def _indexer(cfg, seed=0):
    from megatron_lite.transformer.dsa_config import DSASettings
    from megatron_lite.transformer.dsa_indexer import LightningIndexer
    from megatron_lite.transformer.spec import BuildContext
    return _randomized(LightningIndexer(cfg, BuildContext(), DSASettings.from_model(cfg)), seed)


# --- the indexer ------------------------------------------------------------------------------------
def test_indexer_topk_equals_a_naive_per_query_loop():
    """Scores and top-k of every query (two packed documents: keys of the other one never chosen)
    against a loop over queries, heads and visible keys written from the formula."""
    cfg = _cfg()
    ix = _indexer(cfg)
    b, s = 2, 12
    g = torch.Generator().manual_seed(1)
    x, qr = torch.randn(s, b, 64, generator=g), torch.randn(s, b, 24, generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    rope = _rope(cfg, torch.arange(s).expand(b, -1))
    sel = ix(x, qr, rope, docs)
    wq, wk, ww = ix.linear_wq_b.weight, ix.linear_wk.weight, ix.linear_weights_proj.weight
    for bi in range(b):
        k = F.layer_norm(x[:, bi] @ wk.T, (16,), ix.k_norm.weight, ix.k_norm.bias, cfg.norm_epsilon)  # [s, 16]
        for i in range(s):
            q = (qr[i, bi] @ wq.T).view(4, 16)
            cos, sin = rope[0][i, bi, 0], rope[1][i, bi, 0]
            w = x[i, bi] @ ww.T / (4 ** 0.5 * 16 ** 0.5)
            visible = [j for j in range(i + 1) if docs[bi, j] == docs[bi, i]]
            naive = {}
            for j in visible:
                kc, kcos, ksin = k[j], rope[0][j, bi, 0], rope[1][j, bi, 0]
                kj = torch.cat([kc[:8], kc[8:] * kcos + torch.cat([-kc[12:], kc[8:12]]) * ksin])
                total = 0.0
                for h in range(4):
                    qh = torch.cat([q[h, :8], q[h, 8:] * cos + torch.cat([-q[h, 12:], q[h, 8:12]]) * sin])
                    total = total + w[h] * torch.relu(qh @ kj)
                naive[j] = total
            got = sel.scores[bi, i]
            for j in range(s):
                if j in naive:
                    assert torch.allclose(got[j], naive[j], rtol=1e-4, atol=1e-5), (bi, i, j)
                else:
                    assert got[j] == float("-inf")
            want = sorted(naive, key=lambda j: -naive[j].item())[:6]
            picked = [int(j) for j, ok in zip(sel.indices[bi, i], sel.valid[bi, i]) if ok]
            assert sorted(picked) == sorted(want), (bi, i)
            assert int(sel.valid[bi, i].sum()) == min(6, len(visible))


def test_indexer_equals_hugging_face_deepseek_v32():
    """Our indexer with HF's weights (RoPE channels moved from the front to the back of each head)
    picks HF DeepseekV32Indexer's top-k, with YaRN-free RoPE at the same positions."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, \
        DeepseekV32RotaryEmbedding
    from models.hf_dsa import indexer_rope_last
    hf_cfg = DeepseekV32Config(hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                               qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, index_n_heads=4,
                               index_head_dim=16, index_topk=6, rms_norm_eps=1e-6, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = _randomized(DeepseekV32Indexer(hf_cfg, 0), seed=3)
    cfg = _cfg(norm_epsilon=1e-6)
    ours = _indexer(cfg)
    names = {"wq_b.weight": "linear_wq_b.weight", "wk.weight": "linear_wk.weight", "k_norm.weight": "k_norm.weight",
             "k_norm.bias": "k_norm.bias", "weights_proj.weight": "linear_weights_proj.weight"}
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            ours.get_parameter(names[name]).copy_(t if name.startswith("weights") else indexer_rope_last(t, cfg))
    b, s = 2, 20
    g = torch.Generator().manual_seed(4)
    x, qr = torch.randn(b, s, 64, generator=g), torch.randn(b, s, 24, generator=g)
    pos = torch.arange(s).expand(b, -1)
    mask = torch.full((s, s), float("-inf")).triu(1).expand(b, s, s)
    want = hf(x, qr, DeepseekV32RotaryEmbedding(hf_cfg)(x, pos), mask, pos)
    got = ours(x.transpose(0, 1), qr.transpose(0, 1), _rope(cfg, pos))
    assert torch.equal(got.indices.sort(-1).values, want.long().sort(-1).values)


# --- the sparse core and the loss ---------------------------------------------------------------------
def test_sparse_attention_equals_dense_attention_masked_to_the_same_keys():
    """Forward and gradients (q, k, v) against SDPA with a mask of exactly the valid picks."""
    from megatron_lite.transformer.dsa_indexer import Selection
    from megatron_lite.transformer.sparse_attention import sparse_attention
    b, s, h, d, dv, k = 2, 10, 3, 8, 5, 4
    g = torch.Generator().manual_seed(0)
    q, key, v = (torch.randn(b, s, h, n, generator=g, requires_grad=True) for n in (d, d, dv))
    scores = torch.randn(b, s, s, generator=g).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    top, indices = scores.topk(k, dim=-1)
    sel = Selection(scores, indices, top > float("-inf"))
    out = sparse_attention(q, key, v, sel.indices, sel.valid)
    mask = sel.key_mask()
    assert mask.sum(-1).tolist() == [[min(i + 1, k) for i in range(s)]] * b
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, key, v)),
                                           attn_mask=mask.unsqueeze(1)).transpose(1, 2)
    assert torch.allclose(out, dense, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, key, v), grad)
    want = torch.autograd.grad(dense, (q, key, v), grad)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-5)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-loss", "sparse-loss"])
def test_indexer_loss_equals_megatron_core(sparse):
    """indexer_kl_loss (value and gradient to the scores) against Megatron-Core 0.16.1's
    compute_dsa_indexer_loss on the same causal scores, q, k and top-k."""
    from types import SimpleNamespace
    from mcore_cpu import import_mcore
    import_mcore()
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss
    from megatron_lite.parallel.state import ParallelDims
    from megatron_lite.transformer.dsa_indexer import Selection
    from megatron_lite.transformer.dsa_loss import indexer_kl_loss
    b, s, h, d, k = 2, 9, 3, 8, 4
    g = torch.Generator().manual_seed(0)
    q, key = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    raw = torch.randn(b, s, s, generator=g)
    causal = torch.full((s, s), float("-inf")).triu(1)
    scores = (raw + causal).requires_grad_(True)
    top, indices = scores.detach().topk(k, dim=-1)
    sel = Selection(scores, indices, top > float("-inf"))
    keys = sel.key_mask() if sparse else scores.detach() > float("-inf")
    ours = indexer_kl_loss(scores, q, key, keys, ParallelDims())
    theirs_scores = (raw + causal).requires_grad_(True)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    theirs = compute_dsa_indexer_loss(theirs_scores * 1.0, indices, q.transpose(0, 1), key.transpose(0, 1), d ** -0.5,
                                      1.0, sparse, pg)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(scores.grad, theirs_scores.grad, atol=1e-7)


# --- the layer ----------------------------------------------------------------------------------------
def _layers(cfg, seed=0):
    """(DSA layer, MLA layer) with the same MLA weights, in training mode."""
    from megatron_lite.transformer.core_attention import SDPAAttention
    from megatron_lite.transformer.dsa import DSASelfAttention
    from megatron_lite.transformer.mla import MLASelfAttention
    from megatron_lite.transformer.spec import BuildContext
    dsa = _randomized(DSASelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention), seed, std=0.2)
    mla = MLASelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention)
    mla.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})
    return dsa.train(), mla.train()


def test_dsa_with_topk_covering_the_sequence_is_mla_exactly():
    s = 12
    dsa, mla = _layers(_cfg(dsa_indexer_topk=s))
    x = torch.randn(s, 2, 64, generator=torch.Generator().manual_seed(2))
    rope = _rope(_cfg(), torch.arange(s).expand(2, -1))
    outs = []
    for layer in (dsa, mla):
        xi = x.clone().requires_grad_(True)
        out = layer(xi, rope)
        out.square().sum().backward()
        outs.append((out, xi.grad, {n: p.grad for n, p in layer.named_parameters() if not n.startswith("indexer.")}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2].keys() == outs[1][2].keys()
    assert all(torch.equal(outs[0][2][n], outs[1][2][n]) for n in outs[0][2])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dsa.indexer.parameters())  # by its loss


def test_sparse_dsa_differs_from_mla_and_keeps_packed_documents_apart():
    """With top-k below the sequence the layer is not MLA; two packed documents give what each gives
    alone (positions restarting at each document), so no key of one reaches the other."""
    from megatron_lite.transformer.core_attention import PackedSeq
    cfg = _cfg(dsa_indexer_topk=3)
    dsa, mla = _layers(cfg)
    lengths = (5, 7)
    x = torch.randn(sum(lengths), 1, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = dsa(x, _rope(cfg, positions), PackedSeq(docs))
    assert not torch.allclose(packed, mla(x, _rope(cfg, positions), PackedSeq(docs)), atol=1e-3)
    alone = [dsa(part, _rope(cfg, torch.arange(len(part))[None])) for part in x.split(lengths)]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)


# --- training: the two stages, the log, the layouts ------------------------------------------------------
def _train_from(rank, world, argv):
    """(initial, final) parameters by name and the records of a single-process run of `argv`."""
    import os
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    params = lambda: {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters()}
    first = params()
    history = trainer.train()
    return first, params(), history


def _changed(first, last, indexer: bool):
    return {n for n in first if ("indexer." in n) == indexer and not torch.equal(first[n], last[n])}


def test_dense_warm_up_trains_the_indexer_alone_then_the_sparse_stage_trains_the_model():
    """Iterations 1-2 (dense warm-up): no parameter of the main model moves, every indexer parameter
    does, and the indexer loss is logged. Iteration 3 on (sparse): the main model learns too."""
    argv = BASE + ["--train-iters", "2", "--dsa-dense-warmup-iters", "2"]
    (first, last, history), = run_distributed(_train_from, 1, argv)
    assert _changed(first, last, indexer=False) == set()
    assert _changed(first, last, indexer=True) == {n for n in first if "indexer." in n}
    assert [r["dsa_stage"] for r in history] == ["dense", "dense"]
    assert all(r["dsa_indexer_loss"] > 0 for r in history)
    (first, last, history), = run_distributed(_train_from, 1, argv[:-1] + ["1"])
    assert [r["dsa_stage"] for r in history] == ["dense", "sparse"]
    assert len(_changed(first, last, indexer=False)) == len([n for n in first if "indexer." not in n])


def test_sparse_stage_indexer_learns_from_its_loss_only():
    """With the loss weighted 0 (and no weight decay) the indexer never moves: the LM loss does not
    reach it (its inputs are detached); the main model does move."""
    argv = BASE + ["--train-iters", "2", "--dsa-indexer-loss-coeff", "0", "--weight-decay", "0"]
    (first, last, history), = run_distributed(_train_from, 1, argv)
    assert _changed(first, last, indexer=True) == set()
    assert _changed(first, last, indexer=False)
    assert "dsa_indexer_loss" not in history[0]


TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
LAYOUTS = {  # name: (world, model flags of both runs, layout flags); the fast representative first, the rest slow
    "tp2-sp": (2, [], TP_SP),
    "cp2": (2, [], ["--context-parallel-size", "2"]),
    "tp2-sp-cp2-reset": (4, ["--reset-attention-mask", "--reset-position-ids"], TP_SP + ["--context-parallel-size", "2"]),
    "cp2-warmup": (2, ["--dsa-dense-warmup-iters", "2"], ["--context-parallel-size", "2"]),
    "dp2-zero3": (2, ["--global-batch-size", "8"], ["--zero-stage", "3"]),
    "pp2-1f1b": (2, ["--num-layers", "4"], ["--pipeline-model-parallel-size", "2"]),
    "ep2-tp2-sp-moe": (4, MOE, TP_SP + ["--expert-model-parallel-size", "2"]),
    "fp8-pp2-zb-h1": (2, FP8 + ["--num-layers", "4"], ["--pipeline-model-parallel-size", "2",
                                                       "--pipeline-schedule", "zb-h1"]),
    "recompute-selective-both": (1, [], ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                         "mla_up_proj"]),
    "recompute-full": (1, [], ["--recompute-granularity", "full"]),
    "tp2-warmup": (2, ["--dsa-dense-warmup-iters", "2"], ["--tensor-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("layout", [name if name == "tp2-sp" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_dsa_layout_trains_like_single_process(layout):
    """Losses (1e-5), the first grad norm (1e-6), the indexer loss and the final weights (1e-4) of
    the single process. FP8: both runs in FP8 (the indexer's projections too), as test_mla's."""
    world, model, extra = LAYOUTS[layout]
    argv = BASE + model
    ref, ref_params = single_process_reference(argv)
    results = run_distributed(train_and_gather, world, argv + extra)
    got = records_of([r[0] for r in results])
    assert_same_run(ref, got, rtol=1e-4 if "fp8" in layout else 1e-5, grad_norm_rtol=1e-6, what=layout)
    params = merged_params(results)
    if "ep2" in layout:  # each EP rank holds its own experts (their training shows in the losses above)
        params = {k: v for k, v in params.items() if ".experts." not in k}
        ref_params = {k: v for k, v in ref_params.items() if k in params}
    assert_same_run(ref, got, rtol=1e-4, params=params, ref_params=ref_params, what=layout)
    for a, b in zip(ref, got):
        assert a["dsa_indexer_loss"] == pytest.approx(b["dsa_indexer_loss"], rel=1e-4)


def test_dsa_context_parallel_bytes_equal_the_theory():
    """CP2: per layer and micro-batch each rank all-gathers the indexer key, the latent and the RoPE key
    of every token (the full logical buffer, s x b x (16 + 16 + 8) fp32) and reduce-scatters their
    gradients; without the indexer loss its keys have no gradient to send back."""
    from training_utils import train_in_process
    argv = BASE + ["--context-parallel-size", "2", "--log-comm-volume", "--train-iters", "1"]
    per_token = {"indexer": 16, "latent": 16, "rope": 8}
    calls = 2 * 2  # layers x micro-batches
    for extra, sent_back in (([], per_token), (["--dsa-indexer-loss-coeff", "0"], ("latent", "rope"))):
        comm = run_distributed(train_in_process, 2, argv + extra)[0][0]["comm_bytes"]
        assert comm["all_gather"] == calls * 64 * 2 * sum(per_token.values()) * 4
        assert comm["reduce_scatter"] == calls * 64 * 2 * sum(per_token[k] for k in sent_back) * 4


# --- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,fragment", [
    (["--dsa-indexer-topk", "65"], "exceeds --seq-length"),
    (["--dsa-indexer-head-dim", "4"], "must be >= --qk-pos-emb-head-dim"),
    (["--dsa-indexer-n-heads", "0"], "--dsa-indexer-n-heads (0) must be >= 1"),
    (["--dsa-indexer-loss-coeff", "0", "--dsa-dense-warmup-iters", "2"], "set --dsa-indexer-loss-coeff > 0"),
    (["--attention-dropout", "0.1"], "use --attention-dropout 0"),
], ids=["topk", "head-dim", "heads", "warmup-coeff", "dropout"])
def test_dsa_bad_input_is_one_line(extra, fragment, monkeypatch, capsys):
    assert_one_line_error(BASE + extra, fragment, monkeypatch, capsys)


def test_dsa_without_mla_is_one_line(monkeypatch, capsys):
    argv = [a for a in BASE if a != "--multi-latent-attention"]
    assert_one_line_error(argv, "add --multi-latent-attention", monkeypatch, capsys)


def test_dsa_with_context_parallelism_and_selective_recomputation_is_one_line(monkeypatch, capsys):
    import pretrain_gpt
    monkeypatch.setenv("WORLD_SIZE", "2")  # a CP2 world: the check runs before any process group
    monkeypatch.setenv("RANK", "0")
    argv = BASE + ["--context-parallel-size", "2", "--recompute-granularity", "selective"]
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "core_attn with DSA under context parallelism" in err, err


def test_deepseek_v32_zoo_entry_adds_exactly_the_indexers_to_deepseek_v3():
    """DeepSeek-V3.2 is DeepSeek-V3 (whose published total test_zoo checks) plus one indexer per layer
    at the published shapes: W_q 1536 x 64 x 128, W_k 7168 x 128, the LayerNorm (weight and bias),
    the head weights 7168 x 64; test_zoo builds transformers' DeepseekV32ForCausalLM from the same
    config on the meta device and finds the same total."""
    from models import zoo
    v3, v32 = (ModelConfig(**{k: v for k, v in zoo.get_model_config(n).items() if k != "seq_length"})
               for n in ("deepseek-v3", "deepseek-v3.2"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.num_parameters() - v3.num_parameters() == 61 * per_layer == 851_524_864
    biases = 58 * 256  # the expert-bias buffers (test_zoo: DEEPSEEK_PUBLISHED)
    assert v32.num_parameters() + biases == 671_026_419_200 + 61 * per_layer
