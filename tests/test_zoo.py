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
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "gpt2-124m": 124_439_808,
             "nemotron-h-8b": 8_100_852_736}


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


def test_gpt_oss_totals_equal_the_cards():
    # OpenAI's model card: gpt-oss-20b 21B parameters, 3.6B active; gpt-oss-120b 117B, 5.1B active
    # (active without the input embedding).
    for name, total, active in (("gpt-oss-20b", 21, 3.6), ("gpt-oss-120b", 117, 5.1)):
        cfg = _cfg(name)
        assert round(cfg.num_parameters() / 1e9) == total
        assert round(cfg.num_parameters(active=True, include_embedding=False) / 1e9, 1) == active
    # its unrounded YaRN ramp is also a flag (Megatron-Core's yarn_correction_range_round_to_int)
    flag = parse_args(["--model", "deepseek-v3", "--no-yarn-correction-range-round-to-int"], zoo.zoo())
    assert not flag.model.yarn_correction_range_round_to_int
    assert parse_args(["--model", "deepseek-v3"], zoo.zoo()).model.yarn_correction_range_round_to_int


def test_unknown_name_lists_the_choices():
    with pytest.raises(Exception, match="unknown --model 'llama9'.*qwen3-8b"):
        zoo.get_model_config("llama9")


def test_flops_count_active_parameters_and_the_window():
    from megatron_lite.training.flops import flops_per_token

    # Llama-3-8B at 8192 tokens: 6 x 7.50B (no input embedding) + 12 x 32 x 32 x 128 x 8192.
    dense = _cfg("llama3-8b")
    n = dense.num_parameters(include_embedding=False)
    assert flops_per_token(dense, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192
    # Mixtral: FLOPs follow the 12.9B active parameters, not the 46.7B stored ones.
    moe = _cfg("mixtral-8x7b")
    active = moe.num_parameters(include_embedding=False, active=True)
    assert active < moe.num_parameters(include_embedding=False) / 3
    assert flops_per_token(moe, 4096) == 6 * active + 12 * 32 * 32 * 128 * 4096
    # Mistral's 4096-token window caps the keys a query sees.
    assert flops_per_token(_cfg("mistral-7b"), 16384) == flops_per_token(_cfg("mistral-7b"), 4096)


def test_olmoe_totals():
    # OLMoE-1B-7B: 6.9B total, 1.3B active (AllenAI's card).
    olmoe = _cfg("olmoe-1b-7b")
    assert round(olmoe.num_parameters() / 1e9, 1) == 6.9 and round(olmoe.num_parameters(active=True) / 1e9, 1) == 1.3



# Safetensors totals of the published checkpoints without DeepSeek-V3's MTP module: the parameters
# plus one expert-bias buffer (e_score_correction_bias) per MoE layer of the sigmoid-routed ones.
DEEPSEEK_PUBLISHED = {"deepseek-v3": (671_026_419_200, 37), "kimi-k2": (1_026_408_232_448, 32),
                      "deepseek-v2-lite": (15_706_484_224, 2.4)}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_PUBLISHED))
def test_deepseek_architecture_totals(name):
    """Totals equal the published checkpoints'; active parameters (without the input embedding) the
    cards' rounded figure within 3%."""
    cfg = _cfg(name)
    total, active = DEEPSEEK_PUBLISHED[name]
    biases = sum(cfg.moe_layers()) * cfg.moe.num_experts if cfg.moe.moe_router_enable_expert_bias else 0
    assert cfg.num_parameters() + biases == total
    assert abs(cfg.num_parameters(active=True, include_embedding=False) / 1e9 - active) < 0.03 * active
    assert zoo.MODELS["deepseek-v3-shaped"] == zoo.MODELS["deepseek-v3"]  # the former name still works


@pytest.mark.parametrize("name,total", [("glm-4.5", 355), ("glm-4.5-air", 106)])
def test_glm_totals(name, total):
    """Z.ai's cards (billions, rounded; they count the MTP layer the zoo leaves out): within 2%. The
    exact check is test_shape_matches_hugging_face's count of transformers' own Glm4MoeForCausalLM."""
    assert abs(_cfg(name).num_parameters() / 1e9 - total) < 0.02 * total
