"""Multi-latent attention models to and from Megatron-LM checkpoints, against Megatron-Core 0.16.1's
own MLA GPTModel on CPU (its local spec, with a plain softmax core attention in place of Transformer
Engine's): megatron-to-ml reads its legacy and torch_dist checkpoints with its logits, and what
ml-to-megatron writes it loads strictly with ours."""
from __future__ import annotations

import pytest
import torch

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from test_megatron_checkpoints import PADDED, _batch, _convert, _our_logits  # noqa: E402
from test_megatron_moe_checkpoints import _megatron_loads, assert_ours_and_back, random_ml_checkpoint  # noqa: E402

ITERATION = 2
# DeepSeek-V2/V3-like attention: low-rank Q (32) and K/V (16), 16 + 8 (RoPE) query/key channels, 12 value
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, max_position_embeddings=32,
             norm_epsilon=1e-5, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=PADDED,
             multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
             v_head_dim=12, rope_type="rope")
TP, PP = 2, 2


def _megatron_world(rank, world, root, shape, tp, pp, fmt):
    from megatron.core import parallel_state

    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, pp, PADDED)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    args = mcore_cpu.megatron_args(shape, tp, pp, PADDED, fmt)
    if fmt == "torch_dist":
        mcore_cpu.save_torch_dist(chunks, args, root, ITERATION)
    else:
        mcore_cpu.save_legacy(chunks, args, root, ITERATION, t, p, pp)
    logits = mcore_cpu.forward_logits(chunks, _batch(PADDED)[0], pp)
    return logits if logits is not None and t == 0 else None


@pytest.fixture(scope="module")
def megatron_mla(tmp_path_factory):
    out = {}
    for fmt in ("torch", "torch_dist"):
        root = tmp_path_factory.mktemp(f"megatron-mla-{fmt}")
        results = run_distributed(_megatron_world, TP * PP, str(root), SHAPE, TP, PP, fmt, daemon=False)
        out[fmt] = (root, next(r for r in results if r is not None))
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_mla_checkpoint_gives_megatron_cores_logits(megatron_mla, tmp_path, fmt):
    root, reference = megatron_mla[fmt]
    ckpt = tmp_path / "ckpt"
    assert _convert("megatron-to-ml", "--load", root, "--out", ckpt) == 0
    logits, cfg = _our_logits(ckpt, _batch(PADDED)[0])
    assert cfg.multi_latent_attention and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim) == (32, 16, 12)
    assert (logits - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("fmt,tp,pp", [("torch", TP, PP), ("torch_dist", 1, 1)])
def test_ml_to_megatron_mla_loads_into_megatron_core(megatron_mla, tmp_path, fmt, tp, pp):
    """(legacy at TP2 x PP2; torch_dist written once, loaded at TP2 x PP2)"""
    ml, out, back = tmp_path / "ml", tmp_path / "megatron", tmp_path / "back"
    assert _convert("megatron-to-ml", "--load", megatron_mla["torch"][0], "--out", ml) == 0
    assert _convert("ml-to-megatron", "--load", ml, "--out", out, "--ckpt-format", fmt,
                    "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp) == 0
    theirs = next(r for r in run_distributed(_megatron_loads, TP * PP, str(out), SHAPE, TP, PP, fmt, daemon=False)
                  if r is not None)
    assert_ours_and_back(theirs, ml, out, back)


def test_ml_to_megatron_mla_with_yarn_and_full_q(tmp_path):
    """DeepSeek-V3's RoPE (YaRN with both mscales) and a full Q projection: Megatron-Core's MLA loads
    ml-to-megatron's legacy files at TP2 with our logits."""
    shape = dict(SHAPE, q_lora_rank=None, rope_type="yarn", rotary_scaling_factor=4.0,
                 original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
    ml, out = tmp_path / "ml", tmp_path / "megatron"
    model = random_ml_checkpoint(ml, shape, rope_scaling_type="yarn")
    assert _convert("ml-to-megatron", "--ml-dir", ml, "--out", out, "--tensor-model-parallel-size", 2) == 0
    theirs = next(r for r in run_distributed(_megatron_loads, 2, str(out), shape, 2, 1, "torch", daemon=False)
                  if r is not None)
    with torch.no_grad():
        ours = model(_batch(PADDED)[0])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
