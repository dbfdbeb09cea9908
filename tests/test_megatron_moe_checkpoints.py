"""MoE models to and from Megatron-LM checkpoints, against Megatron-Core 0.16.1's own GPTModel on CPU.

Megatron-Core builds an MoE model (SequentialMLP experts, a gated shared expert, dense and MoE layers
mixed by --moe-layer-freq) at TP2 x EP2 on 4 ranks and saves it as Megatron-LM does (torch_dist, and
the legacy per-rank files mp_rank_TT_EEE); megatron-to-ml reads both and our logits equal Megatron-
Core's. ml-to-megatron writes them back (legacy at any TP / PP / EP; torch_dist) and Megatron-Core's
GPTModel loads them strictly with our logits.
"""
from __future__ import annotations

import os

import pytest
import torch

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.checkpoint.offline import full_weights, open_checkpoint  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from test_megatron_checkpoints import PADDED, _batch, _convert, _our_logits  # noqa: E402

ITERATION = 3
# Llama-like MoE: 4 experts, top-2 of the softmax over the chosen logits, a gated shared expert;
# layer 0 dense, layers 1-3 MoE; 256 padded rows, all kept (the tokenizer is not known).
SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             max_position_embeddings=32, norm_epsilon=1e-5, normalization="RMSNorm", position_embedding_type="rope",
             swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=PADDED,
             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40,
             moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1, 1])
TP, EP = 2, 2  # 4 ranks: DP 2, the experts over EP 2 (folded over DP), expert TP = TP


def _megatron_world(rank, world, root, shape, tp, pp, fmt):
    """One rank of Megatron-Core's MoE model: build, save (`fmt`), forward."""
    from megatron.core import parallel_state

    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, pp, PADDED)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    e = parallel_state.get_expert_model_parallel_rank()
    args = mcore_cpu.megatron_args(shape, tp, pp, PADDED, fmt)
    if fmt == "torch_dist":
        mcore_cpu.save_torch_dist(chunks, args, root, ITERATION)
    else:
        mcore_cpu.save_legacy(chunks, args, root, ITERATION, t, p, pp, e, shape.get("ep", 1))
    logits = mcore_cpu.forward_logits(chunks, _batch(shape["vocab"])[0], pp)
    return logits if logits is not None and t == 0 else None


@pytest.fixture(scope="module")
def megatron_moe(tmp_path_factory):
    """format -> (Megatron-LM checkpoint root, Megatron-Core's logits) of the MoE model at TP2 x EP2."""
    out = {}
    shape = dict(SHAPE, ep=EP)
    for fmt in ("torch", "torch_dist"):
        root = tmp_path_factory.mktemp(f"megatron-moe-{fmt}")
        results = run_distributed(_megatron_world, 4, str(root), shape, TP, 1, fmt, daemon=False)
        out[fmt] = (root, next(r for r in results if r is not None))
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_moe_checkpoint_gives_megatron_cores_logits(megatron_moe, tmp_path, fmt):
    """megatron-to-ml of Megatron-Core's MoE checkpoint (legacy mp_rank_TT_EEE files; torch_dist,
    whose dense and expert keys hold only some layers): our logits are Megatron-Core's."""
    root, reference = megatron_moe[fmt]
    ckpt = tmp_path / "ckpt"
    assert _convert("megatron-to-ml", "--load", root, "--out", ckpt) == 0
    logits, cfg = _our_logits(ckpt, _batch(PADDED)[0])
    assert cfg.moe.num_experts == 4 and cfg.moe_layers() == [False, True, True, True] and cfg.moe.moe_shared_expert_gate
    assert (logits - reference).abs().max().item() < 1e-4


def _megatron_loads(rank, world, root, shape, tp, pp, fmt):
    """One rank of Megatron-Core's MoE model loading (strictly) what ml-to-megatron wrote; its logits."""
    from megatron.core import dist_checkpointing, parallel_state

    from models.megatron_checkpoint import safe_load

    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, pp, PADDED)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    e, ep = parallel_state.get_expert_model_parallel_rank(), shape.get("ep", 1)
    release = os.path.join(root, "release")
    if fmt == "torch_dist":
        from megatron.core.safe_globals import SAFE_GLOBALS
        torch.serialization.add_safe_globals(SAFE_GLOBALS)
        sharded = chunks[0].sharded_state_dict(metadata={"singleton_local_shards": False})
        state = dict(dist_checkpointing.load({"model": sharded}, release), args=safe_load(release + "/common.pt")["args"])
    else:
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
        state = safe_load(os.path.join(release, name, "model_optim_rng.pt"))
        assert (state["args"].tensor_model_parallel_size, state["args"].expert_model_parallel_size) == (tp, ep)
    assert state["args"].num_experts == shape.get("num_experts")
    assert getattr(state["args"], "moe_layer_freq", None) == shape.get("moe_layer_freq")
    chunks[0].load_state_dict(state["model"], strict=True)
    logits = mcore_cpu.forward_logits(chunks, _batch(shape["vocab"])[0], pp)
    return logits if logits is not None and t == 0 else None


@pytest.mark.parametrize("fmt,tp,pp,ep", [("torch", 1, 1, 1), ("torch", 2, 1, 2), ("torch", 1, 2, 2),
                                          ("torch_dist", 2, 1, 2)])
def test_ml_to_megatron_moe_loads_into_megatron_core(megatron_moe, tmp_path, fmt, tp, pp, ep):
    """megatron -> ml -> ml-to-megatron (legacy at TP x PP x EP; torch_dist, loaded at TP2 x EP2):
    Megatron-Core's MoE GPTModel loads it strictly with our logits; megatron-to-ml of it gives our
    checkpoint back bit for bit."""
    ml, out, back = tmp_path / "ml", tmp_path / "megatron", tmp_path / "back"
    assert _convert("megatron-to-ml", "--load", megatron_moe["torch"][0], "--out", ml) == 0
    assert _convert("ml-to-megatron", "--load", ml, "--out", out, "--ckpt-format", fmt,
                    "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
                    "--expert-model-parallel-size", ep) == 0
    # (legacy files are read at their own layout; torch_dist at Megatron-Core's TP2 x EP2)
    load_tp, load_ep = (tp, ep) if fmt == "torch" else (TP, EP)
    theirs = next(r for r in run_distributed(_megatron_loads, load_tp * pp * load_ep, str(out),
                                             dict(SHAPE, ep=load_ep), load_tp, pp, fmt, daemon=False) if r is not None)
    assert_ours_and_back(theirs, ml, out, back)


def assert_ours_and_back(theirs, ml, out, back):
    """Megatron-Core's logits `theirs` (of what ml-to-megatron wrote from `ml` to `out`) are ours, and
    megatron-to-ml of `out` gives our checkpoint back bit for bit (into `back`)."""
    ours, _ = _our_logits(ml, _batch(PADDED)[0])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert _convert("megatron-to-ml", "--load", out, "--out", back) == 0
    with open_checkpoint(str(ml)) as a, open_checkpoint(str(back)) as b:
        wa, wb = full_weights(a, fp32_from_main=False), full_weights(b, fp32_from_main=False)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def random_ml_checkpoint(directory, shape: dict, **config):
    """A randomly initialised model of `shape` (its ModelConfig and MoE keys, `config` over them)
    written as a full (--ml-dir) checkpoint; the model, in eval mode."""
    import convert_checkpoint as tool
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model

    moe = {k: v for k, v in shape.items() if k.startswith("moe_") or k == "num_experts"}
    keys = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{**{k: v for k, v in shape.items() if k in keys}, "vocab_size": PADDED, "moe": moe or None,
                         **config})
    torch.manual_seed(0)
    model = build_model(cfg, ParallelDims())[0].eval()
    tool.write_ml_checkpoint(str(directory), cfg, {n: p.detach() for n, p in model.named_parameters()})
    return model


def test_ml_to_megatron_torch_dist_stacks_uniform_moe_layers(tmp_path):
    """Every layer MoE (--moe-layer-freq 1): Megatron-Core stacks a layer's tensors over the layers
    ([layers, ...]; the experts' [layers, experts, ...]); it loads ours strictly with our logits."""
    shape = dict(SHAPE, num_layers=2, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
                 moe_shared_expert_gate=False)
    ml, out = tmp_path / "ml", tmp_path / "megatron"
    model = random_ml_checkpoint(ml, shape)
    assert _convert("ml-to-megatron", "--ml-dir", ml, "--out", out, "--ckpt-format", "torch_dist") == 0
    from models.megatron_checkpoint import read_dcp_metadata
    stored = read_dcp_metadata(str(out / "release" / ".metadata")).state_dict_metadata
    assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 96, 64)
    theirs = next(r for r in run_distributed(_megatron_loads, TP * EP, str(out), dict(shape, ep=EP), TP, 1,
                                             "torch_dist", daemon=False) if r is not None)
    with torch.no_grad():
        ours = model(_batch(PADDED)[0])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


# DeepSeek-V3's routing: sigmoid scores, the expert bias in the selection only, group-limited top-k
# (the top group of 2), the weights scaled by 2.5; a shared expert without a gate
DEEPSEEK = dict(SHAPE, num_layers=2, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                moe_router_topk_scaling_factor=2.5, moe_shared_expert_gate=False)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_expert_bias_and_group_routing_both_ways(tmp_path, fmt):
    """Megatron-Core's DeepSeek-style router (its expert bias a buffer): megatron-to-ml gives its
    logits, and ml-to-megatron's checkpoint loads back into it with ours."""
    root, ml, out, back = tmp_path / "megatron", tmp_path / "ml", tmp_path / "out", tmp_path / "back"
    shape = dict(DEEPSEEK, ep=EP)
    reference = next(r for r in run_distributed(_megatron_world, 4, str(root), shape, TP, 1, fmt, daemon=False)
                     if r is not None)
    assert _convert("megatron-to-ml", "--load", root, "--out", ml) == 0
    logits, cfg = _our_logits(ml, _batch(PADDED)[0])
    assert cfg.moe.moe_router_enable_expert_bias and cfg.moe.moe_router_num_groups == 2
    assert (logits - reference).abs().max().item() < 1e-4
    assert _convert("ml-to-megatron", "--load", ml, "--out", out, "--ckpt-format", fmt,
                    "--tensor-model-parallel-size", TP, "--expert-model-parallel-size", EP) == 0
    theirs = next(r for r in run_distributed(_megatron_loads, 4, str(out), shape, TP, 1, fmt, daemon=False)
                  if r is not None)
    assert_ours_and_back(theirs, ml, out, back)


# gpt-oss-like MoE: router and expert biases (and every other linear's), no shared expert
BIASED = dict(SHAPE, num_layers=2, moe_layer_freq=[0, 1], add_bias_linear=True,
              moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)


def test_router_and_expert_biases_both_ways(tmp_path):
    """Megatron-Core's MoE with --add-bias-linear (router bias, each expert's fc1 / fc2 bias) at EP2 (it
    takes expert biases at expert TP 1 only, as we do): megatron-to-ml gives its logits; ml-to-megatron's
    legacy files load back with ours."""
    root, ml, out, back = tmp_path / "megatron", tmp_path / "ml", tmp_path / "out", tmp_path / "back"
    shape = dict(BIASED, ep=EP)
    reference = next(r for r in run_distributed(_megatron_world, 2, str(root), shape, 1, 1, "torch", daemon=False)
                     if r is not None)
    assert _convert("megatron-to-ml", "--load", root, "--out", ml) == 0
    logits, cfg = _our_logits(ml, _batch(PADDED)[0])
    assert cfg.add_bias_linear and cfg.moe.num_experts == 4
    assert (logits - reference).abs().max().item() < 1e-4
    assert _convert("ml-to-megatron", "--load", ml, "--out", out, "--expert-model-parallel-size", EP) == 0
    theirs = next(r for r in run_distributed(_megatron_loads, 2, str(out), shape, 1, 1, "torch", daemon=False)
                  if r is not None)
    assert_ours_and_back(theirs, ml, out, back)
    assert _convert("ml-to-megatron", "--load", ml, "--out", tmp_path / "tp2", "--tensor-model-parallel-size", 2) == 2
