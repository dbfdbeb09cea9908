"""Text generation: a static KV cache per layer, prefill then decode, sampling (tools/generate.py).

    from megatron_lite.inference import SamplingParams, generate
    completions = generate(model, [prompt_ids, ...], max_new_tokens=32,
                           sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=1), eod=tokenizer.eod)

The model takes the cache as `model(tokens, position_ids, packed=..., kv_cache=cache)`: each
attention module writes its new tokens' entry (K/V for standard attention, latents for MLA) into the cache and
attends over everything cached (kv_cache.py); `DecodingSession` drives prefill and decode steps
for a left-padded batch.
"""
from .generation import Completion, DecodingSession, PromptBatch, generate, inference_context
from .kv_cache import KVCache, kv_cache_bytes_per_token
from .sampling import SamplingParams, filter_logits, sample

__all__ = ["Completion", "DecodingSession", "KVCache", "PromptBatch", "SamplingParams", "filter_logits", "generate",
           "inference_context", "kv_cache_bytes_per_token", "sample"]
