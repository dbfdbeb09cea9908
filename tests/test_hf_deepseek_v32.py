"""Hugging Face `deepseek_v32` (DeepSeek-V3.2: V3 plus DSA's lightning indexer) both ways: a tiny random
HF model's logits at TP1, TP2 and TP2 x PP2 x EP2 (top-k below the sequence, so the indexer's choice
matters), exact round trips, the config round trip, and greedy generation equal to HF's."""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (gather_full_state_dict, hf_config_to_model_config, hf_to_megatron_lite,  # noqa: E402
                                  load_full_state_dict_into_model, megatron_lite_to_hf, model_config_to_hf_config)
from test_hf_deepseek_checkpoints import _perturbed  # noqa: E402
from test_hf_parity import TOL, VOCAB, YARN, _DEEPSEEK, _max_diff, _pipeline_worker, _tp_worker  # noqa: E402


@functools.lru_cache(maxsize=None)
def hf_model():
    cfg = transformers.DeepseekV32Config(**dict(_DEEPSEEK, num_hidden_layers=4, rms_norm_eps=1e-6), n_group=4,
                                         topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5,
                                         norm_topk_prob=True, q_lora_rank=24, rope_parameters=dict(YARN),
                                         index_n_heads=4, index_head_dim=16, index_topk=6)
    return _perturbed(lambda: transformers.DeepseekV32ForCausalLM(cfg), seed=5)


@functools.lru_cache(maxsize=None)
def oracle():
    model = hf_model()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    cfg = hf_config_to_model_config(model.config)
    return tokens, logits, cfg, hf_to_megatron_lite(model.state_dict(), cfg)


def _dense_logits(tokens):
    """HF's logits with the indexer keeping every key (what DSA must differ from)."""
    model = hf_model()
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 10 ** 6
    try:
        with torch.no_grad():
            return model(tokens).logits.float()
    finally:
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 6


def test_deepseek_v32_logits_match_hf():
    tokens, expected, cfg, state = oracle()
    assert cfg.family == "deepseek_v32" and cfg.experimental_attention_variant == "dsa"
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (4, 16, 6)
    assert _max_diff(_dense_logits(tokens), expected) > 100 * TOL  # the top-6 of 16 keys changes the logits
    dims = ParallelDims().build_groups()
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        assert _max_diff(model(tokens), expected) < TOL


def test_deepseek_v32_logits_match_hf_tp2():
    tokens, expected, cfg, state = oracle()
    for logits, gathered in run_distributed(_tp_worker, 2, cfg, state, tokens):
        assert _max_diff(logits, expected) < TOL
        assert all(torch.equal(gathered[k], v) for k, v in state.items())


@pytest.mark.slow
def test_deepseek_v32_logits_match_hf_at_tp2_pp2_ep2():
    tokens, expected, cfg, state = oracle()
    results = [r for r in run_distributed(_pipeline_worker, 8, cfg, state, tokens) if r is not None]
    assert len(results) == 4 and all(_max_diff(r, expected) < TOL for r in results)


def test_deepseek_v32_round_trips_are_exact(tmp_path):
    from safetensors.torch import load_file
    hf = hf_model()
    cfg = hf_config_to_model_config(hf.config)
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    again = megatron_lite_to_hf(hf_to_megatron_lite(on_disk, cfg), cfg)
    assert again.keys() == on_disk.keys() and all(torch.equal(again[k], v) for k, v in on_disk.items())
    dims = ParallelDims().build_groups()
    ours = gather_full_state_dict(build_model(cfg, dims, seed=11)[0], dims)
    assert any(".indexer." in k for k in ours)
    back = hf_to_megatron_lite(megatron_lite_to_hf(ours, cfg), cfg)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())


def _generate(rank, world, cfg, state, prompts, new):
    from megatron_lite.inference import kv_cache_bytes_per_token
    from megatron_lite.inference.generation import generate
    dims = ParallelDims.from_world(tp=world)
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    return [generate(model, prompts, new), [generate(model, [p], new)[0] for p in prompts],
            kv_cache_bytes_per_token(model)]


PROMPTS, NEW = [[3, 17, 42, 5, 8, 60, 1, 9, 33], [99, 0, 12]], 12  # longer than the top-k (6) as they decode


@functools.lru_cache(maxsize=None)
def hf_greedy():
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        res = hf_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)
        out.append(res[0, len(p):].tolist())
    return out


def test_deepseek_v32_greedy_generation_matches_hf():
    """Greedy tokens equal HF generate's (which caches the indexer's keys), batched (left-padded)
    and one prompt at a time; the cache holds per token and layer MLA's latent and RoPE key and
    the indexer's key. (MoE models generate at TP 1 for now: inference/generation.py.)"""
    for batched, single, nbytes in run_distributed(_generate, 1, *oracle()[2:], PROMPTS, NEW):
        assert [c.tokens for c in batched] == hf_greedy() and [c.tokens for c in single] == hf_greedy()
        assert nbytes == 4 * (16 + 8 + 16) * 4  # 4 layers, fp32
