"""Alternating sliding-window and full-attention layers (--window-size W --window-attn-skip-freq N,
Megatron-Core's rule: every N-th layer counting from 1 is full; gpt-oss alternates with N = 2): the
logits equal Hugging Face Qwen2's with the same `layer_types`, at TP1 and TP2; training under CP
(ring and all-to-all) equals the single process; the FLOP counts follow each layer's window."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import assert_same_run, run_distributed  # noqa: E402
from megatron_lite.transformer.counts import MicroBatch  # noqa: E402
from megatron_lite.transformer.model_counts import model_counts  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (ConversionError, hf_config_to_model_config, hf_to_megatron_lite,  # noqa: E402
                                  load_full_state_dict_into_model)
from models.hf_families import family_of  # noqa: E402
from training_utils import LLAMA_SWITCHES, TINY, records_of, train_in_process  # noqa: E402

VOCAB, WINDOW = 100, 5
_QWEN2 = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              rms_norm_eps=1e-5, vocab_size=VOCAB, attn_implementation="eager", bos_token_id=None, eos_token_id=None,
              tie_word_embeddings=False)
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def _oracle():
    """(tokens, HF logits with alternating windows, our config with the flags, our state dict)."""
    torch.manual_seed(3)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, layer_types=LAYER_TYPES, **_QWEN2)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf(tokens).logits.float()
    plain = hf_config_to_model_config(transformers.Qwen2Config(**_QWEN2))  # the same weights, no window
    cfg = dataclasses.replace(plain, window_size=WINDOW, window_attn_skip_freq=2)
    return tokens, logits, cfg, hf_to_megatron_lite(hf.state_dict(), plain)


def _logits(rank, world, cfg, state, tokens):
    dims = ParallelDims(tp=world).build_groups()
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("tp", [1, 2])
def test_alternating_windows_equal_hf_layer_types(tp):
    tokens, expected, cfg, state = _oracle()
    logits = run_distributed(_logits, tp, cfg, state, tokens)[0]
    assert (logits - expected).abs().max().item() < 1e-4 and expected.abs().max() > 1.0
    # the window matters here: every layer windowed, or none, gives other logits
    for other in (dataclasses.replace(cfg, window_attn_skip_freq=None), dataclasses.replace(
            cfg, window_size=None, window_attn_skip_freq=None)):
        assert (run_distributed(_logits, 1, other, state, tokens)[0] - expected).abs().max().item() > 1e-3


ARGV = TINY + LLAMA_SWITCHES + ["--num-layers", "4", "--window-size", "8", "--window-attn-skip-freq", "2"]


@pytest.mark.parametrize("comm", ["p2p", pytest.param("a2a", marks=pytest.mark.slow)])
def test_alternating_windows_train_like_single_process_under_cp(comm):
    ref = records_of(run_distributed(train_in_process, 1, ARGV))
    out = records_of(run_distributed(train_in_process, 2, ARGV + ["--context-parallel-size", "2",
                                                                  "--cp-comm-type", comm]))
    assert_same_run(ref, out, grad_norm_rtol=1e-6, what=f"cp2 {comm}")


def test_window_skip_freq_counts_and_errors():
    cfg = ModelConfig(num_layers=4, window_size=8, window_attn_skip_freq=2)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    core = [layer.core_flops for layer in model_counts(cfg, MicroBatch(seq_length=64)).layers]
    assert core[0] == core[2] == core[1] // 8 and core[1] == core[3]
    for kw in ({"window_attn_skip_freq": 2}, {"window_size": 8, "window_attn_skip_freq": 0}):
        with pytest.raises(ConfigError, match="--window-attn-skip-freq"):
            ModelConfig(**kw).validate(64)
    # Mistral's window covers every layer: the conversion refuses rather than drop the full layers
    mistral = ModelConfig(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                          untie_embeddings_and_output_weights=True, window_size=8, window_attn_skip_freq=2)
    with pytest.raises(ConversionError, match="window_attn_skip_freq"):
        family_of(mistral)
