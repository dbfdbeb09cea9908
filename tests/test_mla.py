"""Multi-latent attention: every layout trains like the single process (losses, grad norms, final
weights), the layer equals Hugging Face's DeepSeek-V3 attention (with YaRN), decoding over the
cache of latents with the absorbed up-projections equals the uncached forward, and the flags'
one-line errors."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import (TINY, assert_layout_like_single, merged_params, records_of, single_process_reference,
                            train_and_gather)

MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "20"]
BASE = TINY + ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear"] + MLA


TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # the fast representative of each feature first; the rest are slow
    "tp2-sp": (2, TP_SP),
    "cp2-p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "pp2-zb-h1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--num-layers", "4"]),
    "dp2-zero3": (2, ["--zero-stage", "3", "--global-batch-size", "8"]),
    "recompute-selective": (1, ["--recompute-granularity", "selective"]),
    "cp2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "cp2-allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
    "cp4-a2a+p2p": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                        "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--num-layers", "4"]),
    "recompute-full": (1, ["--recompute-granularity", "full"]),
    "tp2-sp-cp2": (4, TP_SP + ["--context-parallel-size", "2"]),
    "tp2-sp-pp2-zb-h1": (4, TP_SP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                     "--num-layers", "4"]),
    "tp2-dp2-zero3": (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--global-batch-size", "8"]),
}
FAST = ("tp2-sp", "cp2-p2p", "pp2-zb-h1", "dp2-zero3", "recompute-selective")


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_mla_layout_trains_like_single_process(layout):
    world, extra = LAYOUTS[layout]
    assert_layout_like_single(BASE, world, extra)


def test_mla_fp8_zero_bubble_pp2_equals_the_single_process_fp8_run():
    """FP8 GEMMs (tensorwise e4m3) in every MLA projection, their weight gradients deferred by zb-h1: as
    the single process, first step to fp32 rounding, later ones to 1e-4 (test_fp8.py says why). At TP > 1:
    test_fp8_recipe_layouts.py."""
    fp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    argv = BASE + fp8 + ["--num-layers", "4"]
    ref, ref_params = single_process_reference(argv)
    plain, _ = single_process_reference(BASE + ["--num-layers", "4"])
    assert plain[0]["lm_loss"] != ref[0]["lm_loss"]  # FP8 reaches MLA's GEMMs
    results = run_distributed(train_and_gather, 2, argv + ["--pipeline-model-parallel-size", "2",
                                                           "--pipeline-schedule", "zb-h1"])
    assert_same_run(ref, records_of([r[0] for r in results]), rtol=1e-4, grad_norm_rtol=1e-6,
                    params=merged_params(results), ref_params=ref_params)


@pytest.mark.slow
def test_mla_without_q_lora_and_with_biases_tp2_sp():
    argv = [a for a in BASE if a != "--disable-bias-linear"]
    i = argv.index("--q-lora-rank")
    assert_layout_like_single(argv[:i] + argv[i + 2:], 2, TP_SP)


@pytest.mark.parametrize("kw,message", [
    (dict(position_embedding_type="learned_absolute"), "--position-embedding-type rope"),
    (dict(qk_pos_emb_head_dim=7), "--qk-pos-emb-head-dim (7) must be even"),
    (dict(q_lora_rank=0), "--q-lora-rank (0) must be positive"),
    (dict(qk_layernorm=True), "drop --qk-layernorm"),
    (dict(rotary_percent=0.5), "drop it"),
])
def test_mla_config_errors(kw, message):
    cfg = ModelConfig(**{**dict(multi_latent_attention=True, position_embedding_type="rope"), **kw})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate(64)


# --- oracles: Hugging Face's DeepSeek-V3 attention and YaRN ----------------------------------------
YARN = dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0)


def _ours_from_hf_rope(p):
    return dict(rope_scaling_type="yarn", rotary_scaling_factor=p["factor"], mscale=p["mscale"],
                mscale_all_dim=p["mscale_all_dim"], original_max_position_embeddings=p["original_max_position_embeddings"],
                beta_fast=p["beta_fast"], beta_slow=p["beta_slow"], rotary_base=p["rope_theta"])


@pytest.mark.parametrize("params", [YARN, dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                                                original_max_position_embeddings=4096)], ids=["tiny", "deepseek-v3"])
def test_yarn_equals_hf(params):
    """inv_freq and the cos/sin attention factor equal transformers' _compute_yarn_parameters."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from megatron_lite.transformer.rope import rope_attention_factor, rope_inv_freq
    hf = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=dict(params),
                          max_position_embeddings=int(params["factor"] * params["original_max_position_embeddings"]))
    inv_freq, factor = _compute_yarn_parameters(hf)
    cfg = ModelConfig(multi_latent_attention=True, position_embedding_type="rope", qk_pos_emb_head_dim=64,
                      **_ours_from_hf_rope(params))
    assert torch.allclose(rope_inv_freq(cfg), inv_freq, rtol=1e-6, atol=0)
    assert abs(rope_attention_factor(cfg) - factor) < 1e-12


def _hf_attention(q_lora_rank):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
                              rope_parameters=dict(YARN), max_position_embeddings=64, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(hf_cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return hf_cfg, attn, DeepseekV3RotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "q-full"])
def test_mla_layer_equals_hf_deepseek_v3_attention(q_lora_rank):
    """Our MLA layer with HF's weights (RoPE rows de-interleaved) equals DeepseekV3Attention with
    YaRN (mscale in cos/sin and in the softmax scale)."""
    from megatron_lite.transformer.core_attention import SDPAAttention
    from megatron_lite.transformer.mla import MLASelfAttention
    from megatron_lite.transformer.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
    from megatron_lite.transformer.spec import BuildContext
    from models.hf_families import deinterleave_rope_rows
    hf_cfg, attn, rotary = _hf_attention(q_lora_rank)
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, normalization="RMSNorm", norm_epsilon=1e-6,
                      position_embedding_type="rope", add_bias_linear=False, attention_dropout=0.0,
                      multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_head_dim=12,
                      qk_pos_emb_head_dim=8, v_head_dim=20, **_ours_from_hf_rope(YARN))
    ours = MLASelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention)
    sd = {n: p for n, p in attn.named_parameters()}
    with torch.no_grad():
        q_name = "q_proj.weight" if q_lora_rank is None else "q_b_proj.weight"
        q_up = ours.linear_q_proj if q_lora_rank is None else ours.linear_q_up_proj
        q_up.weight.copy_(deinterleave_rope_rows(sd[q_name], 12, 8))
        if q_lora_rank is not None:
            ours.linear_q_down_proj.weight.copy_(sd["q_a_proj.weight"])
            ours.q_layernorm.weight.copy_(sd["q_a_layernorm.weight"])
        ours.linear_kv_down_proj.weight.copy_(deinterleave_rope_rows(sd["kv_a_proj_with_mqa.weight"], 16, 8))
        ours.kv_layernorm.weight.copy_(sd["kv_a_layernorm.weight"])
        ours.linear_kv_up_proj.weight.copy_(sd["kv_b_proj.weight"])
        ours.linear_proj.weight.copy_(sd["o_proj.weight"])
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32).expand(2, -1)
    mask = torch.full((32, 32), float("-inf")).triu(1).expand(2, 1, 32, 32)
    expected = attn(x, rotary(x, pos), mask)[0]
    rope = rope_cos_sin(pos, rope_inv_freq(cfg), x.dtype, rope_attention_factor(cfg))
    got = ours(x.transpose(0, 1), rope).transpose(0, 1)
    assert (got - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


# --- generation: the cache of latents and the absorbed up-projections --------------------------------
def _decoding_worker(rank, world, bias):
    from megatron_lite.inference import KVCache, kv_cache_bytes_per_token
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model
    from test_generate import PROMPTS, _recomputation_gap
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", swiglu=True,
                      position_embedding_type="rope", add_bias_linear=bias, attention_dropout=0.0, hidden_dropout=0.0,
                      init_method_std=0.2, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
                      qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=20, **_ours_from_hf_rope(YARN))
    model = build_model(cfg, ParallelDims.from_world(tp=world), seed=7)[0].eval()
    gap = max(_recomputation_gap(model), _recomputation_gap(model, [PROMPTS[0], PROMPTS[0][::-1]]))
    cache = KVCache.for_model(model, batch_size=1, max_length=1)
    assert kv_cache_bytes_per_token(model) == cache.nbytes()
    return gap, cache.nbytes()


@pytest.mark.parametrize("tp,bias", [(1, False), (2, True)], ids=["tp1", "tp2-biases"])
def test_mla_decoding_over_latents_equals_recomputation(tp, bias):
    """Greedy decoding with the cache of latents (absorbed W_UK / W_UV) gives the logits of a full
    forward of each sequence; the cache holds kv_lora_rank + qk_pos_emb_head_dim numbers per token
    and layer on every rank, not per-head K and V."""
    for gap, nbytes in run_distributed(_decoding_worker, tp, bias):
        assert gap < 5e-5, f"cached logits differ from recomputation by {gap:.2e}"
        assert nbytes == 2 * (16 + 8) * 4  # 2 layers, fp32, one token


def test_mla_and_yarn_flags_parse():
    from megatron_lite.arguments import parse_args
    from models.zoo import zoo
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--position-embedding-type", "rope", "--rope-type", "yarn", "--rotary-scaling-factor", "40",
                      "--mscale", "0.707", "--mscale-all-dim", "0.707", "--original-max-position-embeddings", "16",
                      "--beta-fast", "32", "--beta-slow", "1"] + MLA, zoo()).model
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
            cfg.v_head_dim) == (True, 24, 16, 12, 8, 20)
    assert (cfg.rope_scaling_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim,
            cfg.original_max_position_embeddings) == ("yarn", 40.0, 0.707, 0.707, 16)
    assert cfg.kv_channels == 20 and cfg.num_query_groups == 4  # query / key head size; one K/V head per head
    with pytest.raises(ConfigError, match="--rope-type rope contradicts --rope-scaling-type yarn"):
        parse_args(["--rope-type", "rope", "--rope-scaling-type", "yarn"], zoo())
    with pytest.raises(ConfigError, match=r"--beta-fast \(1.0\) >= --beta-slow \(2.0\)"):
        parse_args(["--position-embedding-type", "rope", "--rope-type", "yarn", "--beta-fast", "1", "--beta-slow",
                    "2"], zoo()).model.validate(64)
