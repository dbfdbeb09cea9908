"""Named model configurations (`--model NAME`). Explicit command-line flags override them.

Real shapes follow the published configurations; the tiny ones are for tests and laptops.
"""
from __future__ import annotations

from typing import Dict

from megatron_lite.errors import ConfigError

_GPT2 = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
             activation="gelu_tanh", add_bias_linear=True, untie_embeddings_and_output_weights=False,
             vocab_size=50257, max_position_embeddings=1024, seq_length=1024, norm_epsilon=1e-5)
_LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
              untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0)
_LLAMA2 = dict(_LLAMA, vocab_size=32000, max_position_embeddings=4096, seq_length=4096, norm_epsilon=1e-5,
               rotary_base=10000.0)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, max_position_embeddings=8192, seq_length=8192, norm_epsilon=1e-5,
               rotary_base=500000.0)


def _shape(layers, hidden, heads, **kw):
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, **kw)


MODELS: Dict[str, dict] = {
    # Tiny sizes: unit tests, the built-in default, laptops.
    "gpt2-tiny": dict(_GPT2, **_shape(2, 64, 4), vocab_size=257, max_position_embeddings=256, seq_length=128),
    # The built-in default (no --model): Megatron-LM's GPT defaults (exact GELU, biases, tied
    # embeddings) but no dropout, so that every parallel layout reproduces the same losses.
    "gpt2-small-cpu": dict(_GPT2, **_shape(4, 256, 4), activation="gelu", vocab_size=257,
                           max_position_embeddings=256, seq_length=128, attention_dropout=0.0, hidden_dropout=0.0),
    "llama-tiny": dict(_LLAMA, **_shape(2, 64, 4), num_query_groups=2, ffn_hidden_size=176, vocab_size=257,
                       max_position_embeddings=256, seq_length=128),
    "llama-20m": dict(_LLAMA, **_shape(6, 512, 8), num_query_groups=4, ffn_hidden_size=1408, vocab_size=2048,
                      max_position_embeddings=512, seq_length=256),
    # GPT-2 family (OpenAI shapes).
    "gpt2-124m": dict(_GPT2, **_shape(12, 768, 12)),
    "gpt2-355m": dict(_GPT2, **_shape(24, 1024, 16)),
    "gpt2-774m": dict(_GPT2, **_shape(36, 1280, 20)),
    "gpt2-1.5b": dict(_GPT2, **_shape(48, 1600, 25)),
    # Llama 2 and Llama 3 (Meta shapes).
    "llama2-7b": dict(_LLAMA2, **_shape(32, 4096, 32), ffn_hidden_size=11008),
    "llama2-13b": dict(_LLAMA2, **_shape(40, 5120, 40), ffn_hidden_size=13824),
    "llama2-70b": dict(_LLAMA2, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672),
    "llama3-8b": dict(_LLAMA3, **_shape(32, 4096, 32), num_query_groups=8, ffn_hidden_size=14336),
    "llama3-70b": dict(_LLAMA3, **_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672),
}


# The built-in default run (`torchrun pretrain_gpt.py` with no --model): the model above, and its
# schedule. A preset value is dropped when the command line gives one of the flags it depends on.
DEFAULT_RUN = {"model": "gpt2-small-cpu",
               "training": {"min_lr": 1e-4, "lr_warmup_iters": 20},
               "unless": {"min_lr": ("lr",), "lr_warmup_iters": ("train_iters", "lr_warmup_fraction")}}


def get_model_config(name: str) -> dict:
    """The named configuration as flag-name -> value (ModelConfig fields plus seq_length)."""
    if name not in MODELS:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(sorted(MODELS))}")
    return dict(MODELS[name])


def zoo():
    """The zoo as the command line reads it (megatron_lite.arguments.Zoo)."""
    from megatron_lite.arguments import Zoo
    return Zoo(get_model_config, DEFAULT_RUN)
