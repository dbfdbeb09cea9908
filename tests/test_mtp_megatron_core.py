"""Multi-token prediction against Megatron-Core 0.16.1's own (its GPTModel with an MTP block, local
spec, on the CPU: tests/mcore_cpu.py): with Megatron-Core's random weights converted to ours, the
main loss, each depth's logged MTP loss and every gradient of the main loss with the MTP losses
attached (Megatron's MTPLossAutoScaler at scale 1: one micro-batch) are equal, with a loss mask."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import assert_close, run_distributed  # noqa: E402
from megatron_lite.transformer.loss_normalization import LossNormalization  # noqa: E402
from models.gpt import build_model, gpt_forward_step  # noqa: E402
from models.hf_conversion import hf_to_ours_stream, load_full_state_dict_into_model, our_sizes  # noqa: E402
from models.megatron_conversion import ALIASES, MEGATRON_RULES  # noqa: E402

DEPTH, FACTOR, VOCAB, B, S = 2, 0.3, 100, 2, 16
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, position_embedding_type="rope", max_position_embeddings=S)


def _megatron(rank, world, tokens, labels, mask):
    """Megatron-Core's weights and gradients (its names), main loss and per-depth MTP losses."""
    mcore_cpu.cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    parallel_state.initialize_model_parallel(1, 1)
    config = mcore_cpu.transformer_config(SHAPE, 1, 1)
    config.mtp_num_layers, config.mtp_loss_scaling_factor = DEPTH, FACTOR
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # the vocabulary unpadded: Megatron's softmax would count padding rows
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=S, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    mcore_cpu.randomize(model, 0, 0, False, True)
    model.train()
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    loss = model(tokens, torch.arange(S).expand(B, S), causal, labels=labels, loss_mask=mask)
    main = (loss * mask).sum() / mask.sum()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    main.backward()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad.clone() for n, p in model.named_parameters()},
            main.item(), MTPLossLoggingHelper.tracker["values"].clone())


def _to_ours(theirs: dict, cfg: ModelConfig) -> dict:
    """Megatron-Core's (local-spec) tensors by our names: the decoder through the Megatron conversion
    table, each MTP module's layer as a decoder layer after the others, its norms and projection by
    their (shared) names."""
    mtp_layer = "mtp.layers.{k}.transformer_layer."
    renamed = {}
    for name, t in theirs.items():
        for k in range(DEPTH):
            name = name.replace(mtp_layer.format(k=k), f"decoder.layers.{cfg.num_layers + k}.")
        renamed[name] = t

    def get(name):
        for canonical, local in ALIASES.items():
            name = name.replace(canonical, local)
        return renamed.pop(name)

    flat = dataclasses.replace(cfg, num_layers=cfg.num_layers + DEPTH, mtp_num_layers=None)
    ours = dict(hf_to_ours_stream(get, renamed.__contains__, flat, MEGATRON_RULES, our_sizes(flat)))
    for k in range(DEPTH):
        ours = {n.replace(f"layers.{cfg.num_layers + k}.", mtp_layer.format(k=k)): t for n, t in ours.items()}
    return {**ours, **renamed}  # what is left: the MTP norms and projections, named alike


def test_mtp_equals_megatron_core():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": (torch.rand(B, S, generator=g) > 0.2).float(),
             "position_ids": torch.arange(S).expand(B, S)}
    params, grads, main, depth_losses = run_distributed(
        _megatron, 1, batch["tokens"], batch["labels"], batch["loss_mask"], daemon=False)[0]

    cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                      attention_dropout=0.0, hidden_dropout=0.0, mtp_num_layers=DEPTH, mtp_loss_scaling_factor=FACTOR)
    dims = ParallelDims()
    model = build_model(cfg, dims)[0].train()
    load_full_state_dict_into_model(model, _to_ours(params, cfg), dims)
    norm = LossNormalization()  # one micro-batch, per-micro-batch mean: Megatron's default
    model.ctx.loss_normalization.current = norm
    output, loss_func = gpt_forward_step(batch, model)
    loss_sum, tokens, logs = loss_func(output)
    norm(loss_sum, tokens).backward()

    assert abs(loss_sum.item() / tokens.item() - main) <= 1e-6 * main
    for k in range(DEPTH):
        s, n = logs[f"mtp_{k + 1}_loss"]
        assert_close(s / n, depth_losses[k], rtol=1e-6, what=f"MTP depth {k + 1} loss")
    want = _to_ours(grads, cfg)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want)
    for name, g in got.items():
        vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")  # ours padded to 128 rows
        assert_close(g[:VOCAB] if vocab else g, want[name], rtol=1e-5, what=name)
