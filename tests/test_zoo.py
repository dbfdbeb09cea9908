"""The named configurations of models/zoo.py: each builds, parses from the command line, and a
published shape matches the Hugging Face model it is named after (parameter count of the real
`transformers` class, built on the meta device, and the config round trip)."""
import pytest
import torch
import transformers

from megatron_lite.arguments import parse_args
from megatron_lite.config import ModelConfig
from models import zoo
from models.hf_conversion import hf_config_to_model_config, model_config_to_hf_config

NAMES = sorted(zoo.MODELS)
FAMILY_NAMES = [n for n in NAMES if zoo.MODELS[n].get("family")]

# Totals published on the models' Hugging Face cards / safetensors metadata.
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
             "llama3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704,
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "gpt2-124m": 124_439_808}


def _cfg(name) -> ModelConfig:
    return ModelConfig(**{k: v for k, v in zoo.get_model_config(name).items() if k != "seq_length"})


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_builds_and_parses(name):
    cfg = _cfg(name)
    cfg.validate(zoo.get_model_config(name).get("seq_length", 1024))
    parsed = parse_args(["--model", name], zoo.zoo())
    assert parsed.model == cfg
    assert parsed.training.seq_length == zoo.get_model_config(name).get("seq_length", parsed.training.seq_length)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_shape_matches_hugging_face(name):
    cfg = _cfg(name)
    hf_config = model_config_to_hf_config(cfg)
    assert hf_config_to_model_config(hf_config) == cfg
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_total = sum(p.numel() for p in hf.parameters())  # tied weights are one parameter
    assert cfg.num_parameters() == hf_total
    if name in PUBLISHED:
        assert hf_total == PUBLISHED[name]


def test_moe_active_parameters():
    # Mixtral 8x7B: 12.9B of its 46.7B parameters are used per token (Mistral AI's figure).
    cfg = _cfg("mixtral-8x7b")
    assert round(cfg.num_parameters(active=True) / 1e9, 1) == 12.9
    # Qwen3-30B-A3B: 3.3B active (Qwen's card).
    assert 3.3e9 <= _cfg("qwen3-30b-a3b").num_parameters(active=True) < 3.4e9


def test_unknown_name_lists_the_choices():
    with pytest.raises(Exception, match="unknown --model 'llama9'.*qwen3-8b"):
        zoo.get_model_config("llama9")
