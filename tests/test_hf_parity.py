"""Hugging Face parity: converted checkpoints reproduce transformers' logits.

The oracle is code nobody here wrote: random tiny GPT2LMHeadModel / LlamaForCausalLM built from
config objects (no download), with eager attention so that the attention path differs from
ours (SDPA). Every weight is perturbed, so norm weights and biases are not trivially 1 and 0
and a wrong transpose, split or tie shows up in the logits.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 100  # not a multiple of 128: TP vocab padding is exercised
TOL = 1e-4


def _hf_config(name: str):
    common = dict(vocab_size=VOCAB, attn_implementation="eager", bos_token_id=None, eos_token_id=None)
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, attn_pdrop=0.0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, **common)
    if name == "llama_gqa":  # 4 query heads over 2 K/V groups, untied output
        return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                        tie_word_embeddings=False, **common)
    # Tied embeddings, one K/V group (MQA), head_dim != hidden / heads, biases on every linear.
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=24, intermediate_size=96,
                                    tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **common)


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    torch.manual_seed({"gpt2": 1, "llama_gqa": 2, "llama_tied": 3}[name])
    config = _hf_config(name)
    cls = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
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


NAMES = ["gpt2", "llama_gqa", "llama_tied"]


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(name):
    tokens, expected, cfg, state = oracle(name)
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


@pytest.mark.parametrize("name,tp", [("gpt2", 2), ("llama_gqa", 2), ("llama_gqa", 4), ("llama_tied", 2)])
def test_logits_match_hf_tensor_parallel(name, tp):
    """Any TP size loads the full checkpoint (K/V groups replicated when tp > groups)."""
    tokens, expected, cfg, state = oracle(name)
    for rank, (logits, gathered) in enumerate(run_distributed(_tp_worker, tp, cfg, state, tokens)):
        assert _max_diff(logits, expected) < TOL, f"rank {rank}"
        assert gathered.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(gathered[k], v), f"rank {rank}: {k} changed through shard + gather"


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("zoo_name", ["gpt2-tiny", "llama-tiny"])
def test_config_round_trip(zoo_name):
    fields = {k: v for k, v in zoo.get_model_config(zoo_name).items() if k != "seq_length"}
    cfg = ModelConfig(**fields)
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


def test_unsupported_inputs_are_clear_errors():
    with pytest.raises(ConversionError, match="unsupported architecture"):
        hf_config_to_model_config(transformers.BertConfig())
    _, _, cfg, state = oracle("llama_gqa")
    broken = dict(hf_model("llama_gqa").state_dict())
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="missing"):
        hf_to_megatron_lite(broken, cfg)
    with pytest.raises(ConversionError, match="not gpt2"):
        megatron_lite_to_hf(state, cfg, "gpt2")


def _tool(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("name", ["gpt2", "llama_tied"])
def test_cli_round_trip(name, tmp_path):
    """save_pretrained dir -> ours -> HF dir -> from_pretrained gives the same logits."""
    model = hf_model(name)
    tokens, expected, _, _ = oracle(name)
    src, ours, dst = tmp_path / "hf", tmp_path / "ml", tmp_path / "hf2"
    model.save_pretrained(src)
    for args in (["hf-to-ml", "--hf-dir", str(src), "--out", str(ours)],
                 ["ml-to-hf", "--ml-dir", str(ours), "--out", str(dst)]):
        r = _tool(*args)
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(ours)) == ["config.json", "model.safetensors"]
    reloaded = type(model).from_pretrained(dst, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reloaded(tokens).logits
    assert torch.equal(logits, expected)


def test_cli_errors_exit_2(tmp_path, capsys):
    sys.path.insert(0, os.path.dirname(TOOL))
    try:
        import convert_checkpoint as tool
    finally:
        sys.path.pop(0)
    assert tool.main(["hf-to-ml", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    transformers.BertConfig().save_pretrained(tmp_path / "bert")
    assert tool.main(["hf-to-ml", "--hf-dir", str(tmp_path / "bert"), "--out", str(tmp_path / "o")]) == 2
    assert tool.main(["ml-to-hf", "--ml-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "not a directory" in err[0] and "unsupported architecture" in err[1]
