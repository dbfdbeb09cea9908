"""Hugging Face parity for every family: converted checkpoints reproduce transformers' logits.

The oracle is code nobody here wrote: random tiny models of each family built from config objects
(no download), with eager attention so that the attention path differs from ours (SDPA). Every
weight is perturbed, so norm weights and biases are not trivially 1 and 0 and a wrong transpose,
split, tie or expert order shows up in the logits. Families: GPT-2, Llama (GQA, tied + biases +
explicit head_dim, Llama-3.1 RoPE scaling), Mistral (sliding window shorter than the sequence),
Qwen2 (Q/K/V biases), Qwen3 (q/k norms), Mixtral, Qwen2-MoE (gated shared expert, a dense layer),
Qwen3-MoE, OLMoE (q/k norms over all heads), GLM-4.5 (partial RoPE), DeepSeek-V2 / V3 (MLA, YaRN),
gpt-oss (sinks, biased router and experts, alternating windows, YaRN).
"""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models import zoo  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (ConversionError, gather_full_state_dict, hf_config_to_model_config,  # noqa: E402
                                  hf_to_megatron_lite, load_full_state_dict_into_model, megatron_lite_to_hf,
                                  model_config_to_hf_config)

VOCAB = 100  # not a multiple of 128: TP vocab padding is exercised
TOL = 1e-4
_COMMON = dict(vocab_size=VOCAB, attn_implementation="eager", bos_token_id=None, eos_token_id=None)
_LLAMA = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              rms_norm_eps=1e-5, **_COMMON)
_MOE = dict(_LLAMA, num_experts_per_tok=2)


_DEEPSEEK = dict(_LLAMA, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                 first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
                 max_position_embeddings=64, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


def _hf_config(name: str):
    t = transformers
    rope = {"rope_type": "default", "rope_theta": 5000.0}
    return {
        "gpt2": lambda: t.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, **_COMMON),
        "llama_gqa": lambda: t.LlamaConfig(rope_parameters=rope, tie_word_embeddings=False, **_LLAMA),
        # tied embeddings, one K/V group (MQA), head_dim != hidden / heads, biases on every linear
        "llama_tied": lambda: t.LlamaConfig(**dict(_LLAMA, num_key_value_heads=1), head_dim=24, tie_word_embeddings=True,
                                            attention_bias=True, mlp_bias=True),
        "llama31": lambda: t.LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16},
                                         max_position_embeddings=64, tie_word_embeddings=False, **_LLAMA),
        "llama_yarn": lambda: t.LlamaConfig(rope_parameters={k: v for k, v in YARN.items() if "mscale" not in k},
                                            max_position_embeddings=64, tie_word_embeddings=False, **_LLAMA),
        "mistral": lambda: t.MistralConfig(sliding_window=5, tie_word_embeddings=False, **_LLAMA),
        "qwen2": lambda: t.Qwen2Config(tie_word_embeddings=True, **_LLAMA),
        "qwen3": lambda: t.Qwen3Config(head_dim=24, tie_word_embeddings=False, **_LLAMA),
        "mixtral": lambda: t.MixtralConfig(num_local_experts=4, tie_word_embeddings=False, **_MOE),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                              mlp_only_layers=[0], norm_topk_prob=False, **_MOE),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=48, head_dim=24,
                                              norm_topk_prob=True, **_MOE),
        # q/k RMSNorm over all heads together (at TP4 its 2 K/V groups are replicated: the K norm too)
        "olmoe": lambda: t.OlmoeConfig(num_experts=4, **_MOE),
        # partial RoPE, Q/K/V biases, q/k norms per head; DeepSeek-V3's routing after a dense layer
        "glm4_moe": lambda: t.Glm4MoeConfig(**_LLAMA, head_dim=24, attention_bias=True,
                                            use_qk_norm=True, rope_parameters=dict(rope, partial_rotary_factor=0.5),
                                            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                            first_k_dense_replace=1, n_group=4, topk_group=2, num_experts_per_tok=4,
                                            routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
                                            num_nextn_predict_layers=0),
        # MLA with YaRN; 4 layers: one dense, then sigmoid group-limited routing with expert bias, one shared expert
        "deepseek_v3": lambda: t.DeepseekV3Config(**dict(_DEEPSEEK, num_hidden_layers=4), n_group=4, topk_group=2,
                                                  num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                                                  q_lora_rank=24, rope_parameters=dict(YARN),
                                                  num_nextn_predict_layers=0),  # MTP: test_hf_deepseek_checkpoints
        # V2-Lite's kind: no query compression, softmax routing without renormalization, two shared experts
        "deepseek_v2": lambda: t.DeepseekV2Config(**dict(_DEEPSEEK, n_shared_experts=2), num_experts_per_tok=2,
                                                  topk_method="greedy", q_lora_rank=None, rope_parameters=rope),
        # attention sinks, biases everywhere (router and experts too), alternating windows, YaRN without rounding
        "gpt_oss": lambda: t.GptOssConfig(**dict(_LLAMA, head_dim=16), num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=5, max_position_embeddings=256, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                           "original_max_position_embeddings": 64}),
    }[name]()


CLASSES = {"gpt2": "GPT2LMHeadModel", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
           "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
           "deepseek_v2": "DeepseekV2ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
NAMES = ["gpt2", "llama_gqa", "llama_tied", "llama31", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
         "deepseek_v3", "deepseek_v2", "llama_yarn", "olmoe", "glm4_moe", "gpt_oss"]
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "olmoe", "glm4_moe", "gpt_oss"}


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    torch.manual_seed(NAMES.index(name) + 1)
    model = getattr(transformers, CLASSES.get(name, "LlamaForCausalLM"))(_hf_config(name)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert bias: changes which experts are chosen
                b.add_(torch.randn_like(b) * 0.1)
    return model


@functools.lru_cache(maxsize=None)
def oracle(name: str):
    """(tokens, HF logits, our config, our full state dict) for one tiny model."""
    model = hf_model(name)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens[0, :2] = torch.tensor([0, VOCAB - 1])  # both ends of the vocabulary
    with torch.no_grad():
        logits = model(tokens).logits.float()
    cfg = hf_config_to_model_config(model.config)
    return tokens, logits, cfg, hf_to_megatron_lite(model.state_dict(), cfg)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(name):
    tokens, expected, cfg, state = oracle(name)
    assert cfg.family == (name if name in CLASSES else "llama")
    dims = ParallelDims().build_groups()
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        logits = model(tokens)
    assert _max_diff(logits, expected) < TOL
    assert expected.abs().max() > 1.0  # logits are large enough for the tolerance to mean something


def _tp_worker(rank, world, cfg, state, tokens):
    dims = ParallelDims(tp=world).build_groups()
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        logits = model(tokens)
    return logits, gather_full_state_dict(model, dims)


@pytest.mark.parametrize("name,tp", [("gpt2", 2), ("llama_gqa", 2), ("llama_gqa", 4), ("llama_tied", 2),
                                     ("qwen3", 2), ("mistral", 2), ("qwen2_moe", 2),
                                     ("olmoe", 2), ("olmoe", 4), ("glm4_moe", 2), ("gpt_oss", 2)])
def test_logits_match_hf_tensor_parallel(name, tp):
    """Any TP size loads the full weights (K/V groups replicated when tp > groups)."""
    tokens, expected, cfg, state = oracle(name)
    for rank, (logits, gathered) in enumerate(run_distributed(_tp_worker, tp, cfg, state, tokens)):
        assert _max_diff(logits, expected) < TOL, f"rank {rank}"
        assert gathered.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(gathered[k], v), f"rank {rank}: {k} changed through shard + gather"


@pytest.mark.parametrize("name", [n for n in NAMES if n not in MOE])
def test_round_trips_are_exact(name):
    hf = hf_model(name)
    cfg = hf_config_to_model_config(hf.config)
    # ours -> HF -> ours, starting from our own initialization.
    dims = ParallelDims().build_groups()
    ours = gather_full_state_dict(build_model(cfg, dims, seed=11)[0], dims)
    back = hf_to_megatron_lite(megatron_lite_to_hf(ours, cfg), cfg)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], v) for k, v in ours.items())
    # HF -> ours -> HF: every HF tensor (lm_head included when tied), loadable strictly.
    hf_sd = hf.state_dict()
    again = megatron_lite_to_hf(hf_to_megatron_lite(hf_sd, cfg), cfg)
    assert again.keys() == hf_sd.keys()
    assert all(torch.equal(again[k], v) for k, v in hf_sd.items())
    type(hf)(hf.config).load_state_dict(again, strict=True)


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip(name):
    cfg = hf_config_to_model_config(hf_model(name).config)
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


@pytest.mark.parametrize("zoo_name", ["gpt2-tiny", "llama-tiny"])
def test_zoo_config_round_trip(zoo_name):
    cfg = ModelConfig(**{k: v for k, v in zoo.get_model_config(zoo_name).items() if k != "seq_length"})
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


def test_unsupported_inputs_are_clear_errors():
    with pytest.raises(ConversionError, match="unsupported model_type 'bert'"):
        hf_config_to_model_config(transformers.BertConfig())
    with pytest.raises(ConversionError, match="rope_type 'dynamic'"):
        hf_config_to_model_config(transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                            "rope_theta": 1e4}))
    _, _, cfg, state = oracle("llama_gqa")
    broken = dict(hf_model("llama_gqa").state_dict())
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="missing"):
        hf_to_megatron_lite(broken, cfg)
    with pytest.raises(ConversionError, match="not gpt2"):
        megatron_lite_to_hf(state, cfg, "gpt2")
    extra = dict(hf_model("llama_gqa").state_dict(), **{"model.layers.0.extra.weight": torch.zeros(1)})
    with pytest.raises(ConversionError, match="unexpected"):
        hf_to_megatron_lite(extra, cfg)
    gpt_oss = _hf_config("gpt_oss")
    gpt_oss.layer_types = ["full_attention", "sliding_attention"]  # not every N-th layer full
    with pytest.raises(ConversionError, match="layer_types .* --window-attn-skip-freq cannot represent them"):
        hf_config_to_model_config(gpt_oss)


def test_olmoe_refusals():
    """OLMoE's clip_qkv has no equivalent here; its q/k norms over all heads none in Megatron-Core."""
    from models.megatron_conversion import megatron_args_of_config
    with pytest.raises(ConversionError, match="clip_qkv"):
        hf_config_to_model_config(transformers.OlmoeConfig(clip_qkv=8.0))
    with pytest.raises(ConversionError, match="qk-layernorm-full-width"):
        megatron_args_of_config(oracle("olmoe")[2], tp=1, pp=1)


def _pipeline_worker(rank, world, cfg, state, tokens):
    """Logits of a TP2 x PP2 x EP2 layout (8 ranks): stage 0's hidden states sent to stage 1 (one
    layer each for OLMoE; DeepSeek's and GLM's dense layer, then their MoE ones)."""
    dims = ParallelDims.from_world(tp=2, pp=2, ep=2)
    model = build_model(cfg, dims, seed=7, first_stage_layers=1)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    tp_rank, cp_rank, dp_rank, pp_rank = dims.coords(rank)
    with torch.no_grad():
        if pp_rank == 0:
            hidden = model(tokens)
            torch.distributed.send(hidden.contiguous(), dims.global_rank(tp_rank, cp_rank, dp_rank, 1))
            return None
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], cfg.hidden_size)
        torch.distributed.recv(hidden, dims.global_rank(tp_rank, cp_rank, dp_rank, 0))
        model.set_input_tensor(hidden)
        return model(tokens)


@pytest.mark.parametrize("name", ["deepseek_v3", "olmoe", "glm4_moe", "gpt_oss",
                                  pytest.param("deepseek_v2", marks=pytest.mark.slow)])
def test_moe_logits_match_hf_at_tp2_pp2_ep2(name):
    tokens, expected, cfg, state = oracle(name)
    results = [r for r in run_distributed(_pipeline_worker, 8, cfg, state, tokens) if r is not None]
    assert len(results) == 4
    for logits in results:
        assert _max_diff(logits, expected) < TOL


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "olmoe", "glm4_moe", "gpt_oss"])
def test_moe_round_trips_are_exact(name, tmp_path):
    """HF (as save_pretrained writes it: DeepSeek's expert bias, gpt-oss's fused interleaved experts
    with their biases) -> ours -> HF identical, and loadable strictly; ours -> HF -> ours identical
    from our own initialization."""
    from safetensors.torch import load_file
    hf = hf_model(name)
    cfg = hf_config_to_model_config(hf.config)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    again = megatron_lite_to_hf(hf_to_megatron_lite(on_disk, cfg), cfg)
    assert again.keys() == on_disk.keys()
    assert all(torch.equal(again[k], v) for k, v in on_disk.items())
    assert type(hf).from_pretrained(tmp_path) is not None
    dims = ParallelDims().build_groups()
    ours = gather_full_state_dict(build_model(cfg, dims, seed=11)[0], dims)
    back = hf_to_megatron_lite(megatron_lite_to_hf(ours, cfg), cfg)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does():
    """The Hub's gpt-oss checkpoints store the expert weights as MXFP4 blocks and scales: read in place of
    the fused tensors, they convert to what transformers' own dequantization gives (its
    convert_moe_packed_tensors, the oracle), and the biases stay as they are."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = hf_model("gpt_oss")
    cfg = hf_config_to_model_config(hf.config)
    g = torch.Generator().manual_seed(3)
    quantized, dequantized = dict(hf.state_dict()), dict(hf.state_dict())
    for name in [k for k in quantized if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = quantized.pop(name).shape
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 131, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
        quantized.update({name + "_blocks": blocks, name + "_scales": scales})
        dequantized[name] = convert_moe_packed_tensors(blocks, scales)
    ours, expected = hf_to_megatron_lite(quantized, cfg), hf_to_megatron_lite(dequantized, cfg)
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[k], v) for k, v in expected.items())
    assert ours["layers.0.mlp.experts.weight1"].abs().max() > 6  # the scales are exercised
