"""Data pipeline: Megatron .bin/.idx corpora, tokenizers, GPT samples, blending, DP sampling.

Names are imported lazily, so tools that need only the file format (tools/preprocess_data.py)
start without importing torch.
"""
import importlib

_EXPORTS = {
    "build_tokenizer": "tokenizers",
    "build_train_valid_test_datasets": "builder",
    "build_pretraining_data_loader": "sampler",
    "PretrainingBatchSampler": "sampler",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "BlendedDataset": "blended_dataset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
