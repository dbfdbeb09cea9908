"""Hugging Face nemotron_h (Mamba-2 / attention / squared-ReLU MLP layers) converted both ways: a tiny
random HF model's logits reproduced at TP1 and TP2, round trips exact, the config round trip."""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (ConversionError, gather_full_state_dict, hf_config_to_model_config,  # noqa: E402
                                  hf_to_megatron_lite, load_full_state_dict_into_model, megatron_lite_to_hf,
                                  model_config_to_hf_config)
from test_hf_parity import _tp_worker  # noqa: E402

VOCAB = 100  # not a multiple of 128: TP vocab padding is exercised


@functools.lru_cache(maxsize=None)
def hf_model():
    cfg = transformers.NemotronHConfig(
        hybrid_override_pattern="M*-M-M", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=4,
        vocab_size=VOCAB, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight perturbed: a wrong split, order or norm shows
            p.add_(torch.randn_like(p) * 0.1)
    return model


@functools.lru_cache(maxsize=None)
def oracle():
    model = hf_model()
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))  # 11: chunks of 4 don't divide
    with torch.no_grad():
        logits = model(tokens).logits.float()
    cfg = hf_config_to_model_config(model.config)
    return tokens, logits, cfg, hf_to_megatron_lite(model.state_dict(), cfg)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_hf(tp):
    tokens, expected, cfg, state = oracle()
    assert cfg.family == "nemotron_h" and cfg.hybrid_override_pattern == "M*-M-M"
    for rank, (logits, gathered) in enumerate(run_distributed(_tp_worker, tp, cfg, state, tokens)):
        assert (logits - expected).abs().max() < 1e-4, f"rank {rank}"
        assert all(torch.equal(gathered[k], v) for k, v in state.items()), f"rank {rank}: shard + gather changed"
    assert expected.abs().max() > 1.0


def test_round_trips_are_exact():
    hf = hf_model()
    cfg = hf_config_to_model_config(hf.config)
    dims = ParallelDims().build_groups()
    ours = gather_full_state_dict(build_model(cfg, dims, seed=11)[0], dims)
    back = hf_to_megatron_lite(megatron_lite_to_hf(ours, cfg), cfg)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())
    hf_sd = hf.state_dict()  # in-memory names (model.); ours -> HF writes the on-disk ones (backbone.)
    again = megatron_lite_to_hf(hf_to_megatron_lite(hf_sd, cfg), cfg)
    assert all(k.startswith(("backbone.", "lm_head.")) for k in again)
    in_memory = {k.replace("backbone.", "model."): v for k, v in again.items()}
    assert in_memory.keys() == hf_sd.keys() and all(torch.equal(in_memory[k], v) for k, v in hf_sd.items())
    type(hf)(hf.config).load_state_dict(in_memory, strict=True)
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


def test_a_saved_checkpoint_converts(tmp_path):
    """What save_pretrained writes (backbone. names) converts to the same weights as the in-memory model."""
    from safetensors.torch import load_file
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    on_disk = {}
    for f in tmp_path.glob("*.safetensors"):
        on_disk.update(load_file(f))
    cfg = hf_config_to_model_config(hf.config)
    state = oracle()[3]
    converted = hf_to_megatron_lite(on_disk, cfg)
    assert converted.keys() == state.keys() and all(torch.equal(converted[k], v) for k, v in state.items())


def test_moe_layers_are_refused_in_one_line():
    c = transformers.NemotronHConfig(hybrid_override_pattern="M*E", hidden_size=32, vocab_size=VOCAB, pad_token_id=0)
    with pytest.raises(ConversionError, match="MoE layers"):
        hf_config_to_model_config(c)


def test_greedy_generation_equals_transformers():
    """Our decoding with the conv + SSM state cache gives transformers' greedy tokens (its own cache)."""
    from megatron_lite.inference import generate
    hf = hf_model()
    _, _, cfg, state = oracle()
    dims = ParallelDims().build_groups()
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    prompt = [7, 3, 91, 15, 42, 8]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, use_cache=True)[0, 6:]
    assert generate(model, [prompt], max_new_tokens=8)[0].tokens == expected.tolist()
