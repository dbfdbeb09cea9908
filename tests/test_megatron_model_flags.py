"""Megatron-LM's model flags against Megatron-Core 0.16.1 itself (issue 16): --rotary-percent,
--apply-layernorm-1p, --use-rope-scaling / --rope-scaling-factor, --qk-layernorm, --rotary-base and
--make-vocab-size-divisible-by.

Each case builds a tiny Megatron-Core GPTModel (local spec, on forked gloo ranks through
tests/mcore_cpu.py) configured the way Megatron-LM configures it from the flag, every weight random
(zero-centred norm weights around 0, so that 1 + w matters), saves it as Megatron-LM does, converts
it with `convert_checkpoint.py megatron-to-ml` and runs our forward: the logits equal Megatron-Core's
to fp32 round-off. Our model with the flag's effect left out gives other logits (so each case
tests its flag), and our own parse of the same Megatron-LM command line gives the config the
converter read from the checkpoint's args. The case with every flag at once, converted to TP 2,
starts training with Megatron-Core's loss.

Cases: half the head rotated; 5 of 16 channels asked (an odd count: Megatron-Core rotates 6, with
frequencies base^(-2i/5)); zero-centred LayerNorm weights on a GPT-2-like model; Llama-3.1 RoPE
scaling; base 500000; Qwen3 (RMSNorm q/k norms, base 1e6) at TP 2 with the vocabulary padded to a
multiple of 32 x TP; all of them at once at TP 2 (1p q/k LayerNorms, partial and scaled RoPE).

Megatron-Core's local spec has its zero-centred LayerNorm only in FusedLayerNorm, which needs
apex's kernel: the case runs FusedLayerNorm (its 1 + w) with that kernel as F.layer_norm
(mcore_cpu.apex_layer_norm). RMSNorm with --apply-layernorm-1p exists only in Transformer Engine's
RMSNorm (TENorm), not installed here: that case is skipped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.arguments import parse_args  # noqa: E402
from megatron_lite.checkpoint.offline import full_weights, open_checkpoint  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.data.gpt_dataset import MockGPTDataset, SampleOptions  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import load_full_state_dict_into_model  # noqa: E402
from models.zoo import zoo  # noqa: E402
from training_utils import ROOT, train_in_process  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint as tool  # noqa: E402

SEQ, BATCH, ITERATION, SEED = 64, 2, 3, 1234
# Two families, each with its Megatron-LM command line (biases and exact GELU: --no-bias-gelu-fusion).
_COMMON = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=SEQ, norm_epsilon=1e-5)
_COMMON_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
                 "--seq-length 64 --norm-epsilon 1e-5 --attention-dropout 0 --hidden-dropout 0")
FAMILIES = {
    "llama": (dict(_COMMON, num_query_groups=2, ffn_hidden_size=96, normalization="RMSNorm",
                   position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                   untie_embeddings_and_output_weights=True),
              "--group-query-attention --num-query-groups 2 --ffn-hidden-size 96 --normalization RMSNorm "
              "--position-embedding-type rope --swiglu --disable-bias-linear --untie-embeddings-and-output-weights"),
    "gpt": (dict(_COMMON, ffn_hidden_size=128, normalization="LayerNorm", position_embedding_type="learned_absolute",
                 swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False),
            "--ffn-hidden-size 128 --normalization LayerNorm --position-embedding-type learned_absolute "
            "--no-bias-gelu-fusion"),
}
# Megatron-LM's default GELU with biases: --bias-gelu-fusion is on and its fused kernel is the tanh
# approximation; the same command line without --no-bias-gelu-fusion must give it here too.
FAMILIES["gpt-fused-gelu"] = (FAMILIES["gpt"][0], FAMILIES["gpt"][1].replace(" --no-bias-gelu-fusion", ""))
# case -> (family, TP, checkpoint format, the shape's flags (Megatron-LM's args), the same as a command line,
#          our config with the flags' effect left out)
CASES = {
    "rotary-percent": ("llama", 1, "legacy", dict(rotary_percent=0.5), "--rotary-percent 0.5",
                       dict(rotary_percent=1.0)),
    # 16 x 0.3125 = 5 channels: Megatron-Core (and HF) take the frequencies base^(-2i/5), i < 3, and
    # rotate 6 channels
    "rotary-percent-odd": ("llama", 1, "legacy", dict(rotary_percent=0.3125), "--rotary-percent 0.3125",
                           dict(rotary_percent=1.0)),
    "layernorm-1p": ("gpt", 1, "legacy", dict(apply_layernorm_1p=True), "--apply-layernorm-1p",
                     dict(apply_layernorm_1p=False)),
    "bias-gelu-fusion": ("gpt-fused-gelu", 1, "legacy", dict(bias_gelu_fusion=True), "", dict(activation="gelu")),
    "rope-scaling": ("llama", 1, "legacy", dict(use_rope_scaling=True, rope_scaling_factor=8.0),
                     "--use-rope-scaling --rope-scaling-factor 8", dict(rope_scaling_type=None)),
    "rotary-base": ("llama", 1, "legacy", dict(rotary_base=500000), "--rotary-base 500000",
                    dict(rotary_base=10000.0)),
    # Qwen3: RMSNorm over each head's q and k, base 1e6; heads split over TP 2, the vocabulary padded
    # to a multiple of 32 x 2 (150 ids -> 192 rows)
    "qwen3-tp2": ("llama", 2, "torch_dist",
                  dict(qk_layernorm=True, rotary_base=1000000, make_vocab_size_divisible_by=32),
                  "--qk-layernorm --rotary-base 1000000 --make-vocab-size-divisible-by 32",
                  dict(rotary_base=10000.0)),
    # every flag at once at TP 2: zero-centred LayerNorms (the q/k ones too), partial and scaled RoPE
    "all-tp2": ("gpt", 2, "torch_dist",
                dict(position_embedding_type="rope", qk_layernorm=True, apply_layernorm_1p=True, rotary_percent=0.5,
                     rotary_base=20000, use_rope_scaling=True, rope_scaling_factor=4.0),
                "--position-embedding-type rope --qk-layernorm --apply-layernorm-1p --rotary-percent 0.5 "
                "--rotary-base 20000 --use-rope-scaling --rope-scaling-factor 4", dict(apply_layernorm_1p=False)),
}
# The two GELUs differ by ~1e-3 at most on a unit input: their logits by ~2e-4, still 20 x the tolerance.
MIN_EFFECT = {"bias-gelu-fusion": 1e-4}
VOCAB = 150  # NullTokenizer: 149 ids + its end of document
SKIPPED = {"rmsnorm-1p": "Megatron-Core 0.16.1 has RMSNorm with zero-centred gamma only as Transformer Engine's "
                         "TENorm (not installed here); its local-spec RMSNorm (torch.nn.RMSNorm through "
                         "WrappedTorchNorm) asserts `not config.layernorm_zero_centered_gamma` and its "
                         "FusedLayerNorm asserts normalization == 'LayerNorm'"}


def _case(name):
    family, tp, fmt, shape_flags, flags, off = CASES[name]
    shape, family_flags = FAMILIES[family]
    shape = dict(shape, **shape_flags)
    multiple = shape.get("make_vocab_size_divisible_by", 128) * tp
    padded = -(-VOCAB // multiple) * multiple
    argv = f"{_COMMON_FLAGS} {family_flags} {flags} --tensor-model-parallel-size {tp}".split()
    return shape, tp, fmt, padded, argv, off


def _batch():
    """The first global batch of a --mock-data run (samples 0..BATCH-1): tokens, labels."""
    data = MockGPTDataset(VOCAB, SEQ, BATCH, SEED, SampleOptions(eod=VOCAB - 1))
    return (torch.stack([data[i]["tokens"] for i in range(BATCH)]),
            torch.stack([data[i]["labels"] for i in range(BATCH)]))


def _megatron_world(rank, world, name, root):
    """One rank of Megatron-Core: build the case's model, save it as Megatron-LM does, forward."""
    from megatron.core import parallel_state

    shape, tp, fmt, padded, _, _ = _case(name)
    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, 1, padded)
    args = mcore_cpu.megatron_args(shape, tp, 1, padded, "torch_dist" if fmt == "torch_dist" else "torch")
    args.tokenizer_type, args.vocab_size = "NullTokenizer", VOCAB - 1
    if fmt == "torch_dist":
        mcore_cpu.save_torch_dist(chunks, args, root, ITERATION)
    else:
        mcore_cpu.save_legacy(chunks, args, root, ITERATION, parallel_state.get_tensor_model_parallel_rank(), 0, 1)
    logits = mcore_cpu.forward_logits(chunks, _batch()[0], 1)
    return logits if parallel_state.get_tensor_model_parallel_rank() == 0 else None


def _ours(ckpt, **changes):
    """Our single-process logits from the converted checkpoint (its config with `changes`), and the config."""
    with open_checkpoint(str(ckpt)) as reader:
        cfg = ModelConfig(**reader.meta["model_config"])
        state = full_weights(reader, fp32_from_main=False)
    cfg = dataclasses.replace(cfg, **changes)
    dims = ParallelDims()
    model = build_model(cfg, dims)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        return model(_batch()[0]), cfg


def _relative(ours, reference):
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """case -> (its Megatron checkpoint's root, Megatron-Core's logits [b, s, VOCAB]), built once."""
    made = {}

    def get(name):
        if name not in made:
            shape, tp, fmt, padded, _, _ = _case(name)
            root = str(tmp_path_factory.mktemp(f"megatron-{name}"))
            logits = next(r for r in run_distributed(_megatron_world, tp, name, root, daemon=False) if r is not None)
            assert logits.shape == (BATCH, SEQ, padded)
            made[name] = root, logits[..., :VOCAB]
        return made[name]
    return get


@pytest.mark.parametrize("name", list(CASES) + list(SKIPPED))
def test_model_flag_equals_megatron_core(megatron, tmp_path, name):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    shape, tp, fmt, padded, argv, off = _case(name)
    root, reference = megatron(name)
    ckpt = tmp_path / "ckpt"
    assert tool.main(["megatron-to-ml", "--load", root, "--out", str(ckpt), "--trim-padded-vocab"]) == 0
    assert json.load(open(ckpt / "iter_0000000" / "metadata.json"))["weights_only"]
    logits, converted = _ours(ckpt)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert _relative(logits, reference) < 1e-5, name
    assert _relative(_ours(ckpt, **off)[0], reference) > MIN_EFFECT.get(name, 1e-3), \
        f"{name}: {off} changes nothing: the case tests nothing"

    parsed = dataclasses.replace(parse_args(argv, zoo()).model, vocab_size=VOCAB)  # the tokenizer's
    assert parsed.padded_vocab_size(tp) == padded
    assert dataclasses.asdict(parsed) == dataclasses.asdict(converted)


def test_training_at_tp2_starts_with_megatrons_loss(megatron, tmp_path):
    """Every flag at once, converted to TP 2 and trained from there (--use-checkpoint-args): the
    first loss is Megatron-Core's on the same batch."""
    root, reference = megatron("all-tp2")
    ckpt = tmp_path / "ckpt"
    tp2 = ["--tensor-model-parallel-size", "2"]
    assert tool.main(["megatron-to-ml", "--load", root, "--out", str(ckpt), "--trim-padded-vocab", *tp2]) == 0
    run = ["--mock-data", "--vocab-size", str(VOCAB - 1), "--seq-length", str(SEQ), "--micro-batch-size", "1",
           "--global-batch-size", str(BATCH), "--train-iters", "1", "--eval-iters", "0", "--device", "cpu",
           "--use-checkpoint-args", "--seed", str(SEED), "--load", str(ckpt), *tp2]
    first = next(h[0] for h in run_distributed(train_in_process, 2, run) if h and h[0]["lm_loss"] is not None)
    expected = F.cross_entropy(reference.reshape(-1, VOCAB), _batch()[1].reshape(-1)).item()
    assert abs(first["lm_loss"] - expected) < 1e-5 * expected
