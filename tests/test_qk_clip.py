"""QK-clip (--qk-clip, Kimi-K2's MuonClip): the measured max logit is the dense one; after a clip
(with LR 0, so that only the clip moves the weights, and the same batch again) every head's (query
group's) largest logit in the first layer is its old one times eta = min(1, tau / max), so none
exceeds tau (standard attention with GQA, and MLA; later layers' inputs move a little with the
layers below them); the clipped run of TP2, CP2 and DP2 equals the single process (losses and the step's max
logit, reduced over the ranks); bad flags are one line."""
import os

import pytest
import torch

from megatron_lite.testing import assert_close, assert_same_run, run_distributed
from megatron_lite.transformer.qk_clip import head_max_logits
from training_utils import TINY, assert_one_line_error, records_of, train_in_process
from test_mla import MLA

MUON = TINY + ["--optimizer", "muon", "--log-max-attention-logit"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
ROPE_MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"] + MLA


def test_head_max_logits_is_the_dense_maximum():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 9, 4, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen)
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    index = torch.arange(9)
    got = head_max_logits(q, k, index, index, docs, docs, window=3)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) / 8 ** 0.5
    diff = index[:, None] - index[None, :]
    visible = (diff >= 0) & (diff < 3) & (docs[:, :, None] == docs[:, None, :])  # [b, q, k]
    want = scores.masked_fill(~visible[:, None], float("-inf")).amax(dim=(0, 2, 3))
    assert torch.equal(got, want)


def _maxima_around_each_clip(rank, world, argv):
    """Per step, the [layers, heads] maxima the clip acted on; every step trains on the first batch."""
    os.environ["WORLD_SIZE"] = str(world)
    from megatron_lite.training.qk_clip import QKClip
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    part, seen = trainer.hooks.parts[QKClip], []
    fetch, first = trainer._next_batches, []
    trainer._next_batches = lambda *a: first[0] if first else first.append(fetch(*a)) or first[0]
    clip = part.after_update

    def recording():
        seen.append(part._global_maxima().clone())
        clip()
    part.after_update = recording
    trainer.train()
    return seen


@pytest.mark.parametrize("extra,heads_per_group,tau", [(GQA, 2, 0.05), (ROPE_MLA, 1, 0.01)], ids=["gqa", "mla"])
def test_after_the_clip_no_head_exceeds_tau(extra, heads_per_group, tau):
    argv = MUON + extra + ["--lr", "0", "--min-lr", "0", "--train-iters", "2", "--qk-clip",
                           "--qk-clip-threshold", str(tau)]
    before, after = run_distributed(_maxima_around_each_clip, 1, argv)[0]
    layers, heads = before.shape
    group_max = before.view(layers, heads // heads_per_group, heads_per_group).amax(dim=2)
    eta = torch.clamp(tau / group_max, max=1.0).repeat_interleave(heads_per_group, dim=1)
    assert (eta < 1).any() and before.max() > tau, before  # the clip acted
    # the first layer's input is the same: its logits scale by eta exactly; the later layers' inputs
    # moved with the clipped layers below them, a little
    assert_close(after[0], before[0] * eta[0], rtol=1e-5, what="first layer's max logits after the clip")
    assert after[0].max() <= tau * (1 + 1e-5)
    assert_close(after, before * eta, rtol=0.05, what="max logits after the clip")
    assert after.max() <= tau * 1.01


def _records(world, argv):
    return records_of(run_distributed(train_in_process, world, argv))


FAST = ["--lr", "0.02"]  # logits grow past 0.3 (MLA's: 0.05) by the third step


def _assert_layout_matches(layout, world, extra=(), tau=0.3):
    argv = MUON + GQA + FAST + list(extra) + ["--qk-clip", "--qk-clip-threshold", str(tau)]
    ref = _records(1, argv)
    got = _records(world, argv + layout)
    assert_same_run(ref, got, rtol=1e-5, what=" ".join(layout))
    for r, g in zip(ref, got):
        assert abs(g["max_attention_logit"] - r["max_attention_logit"]) <= 1e-4 * r["max_attention_logit"]
    unclipped = _records(1, MUON + GQA + FAST + list(extra))
    assert any(r["max_attention_logit"] > tau for r in unclipped)
    assert [r["lm_loss"] for r in unclipped] != [r["lm_loss"] for r in ref], "the clip changed nothing"


def test_tp2_clip_equals_single_process():
    _assert_layout_matches(["--tensor-model-parallel-size", "2"], 2)


ADAM = ["--optimizer", "adam"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,extra,tau", [
    (["--context-parallel-size", "2"], [], 0.3), (["--use-distributed-optimizer"], [], 0.3),
    (["--pipeline-model-parallel-size", "2"], [], 0.3),
    (["--tensor-model-parallel-size", "2"], ROPE_MLA, 0.05),
    (["--zero-stage", "3"], ADAM, 0.3),  # the clip scales the param shards
    (["--use-distributed-optimizer", "--optimizer-cpu-offload"], ADAM, 0.3),  # ... and main params apart
], ids=["cp2", "dp2-zero1", "pp2", "mla-tp2", "adam-dp2-zero3", "adam-dp2-host-offload"])
def test_clip_equals_single_process_more_layouts(layout, extra, tau):
    _assert_layout_matches(layout, 2, extra, tau)


@pytest.mark.parametrize("flags,fragment", [
    (["--qk-clip", "--qk-clip-threshold", "0"], "--qk-clip-threshold (0.0) must be > 0"),
    (["--qk-clip", "--qk-clip-alpha", "1"], "--qk-clip-alpha (1.0) must lie in (0, 1)"),
    (["--qk-clip-threshold", "5"], "--qk-clip-threshold and --qk-clip-alpha need --qk-clip"),
    (["--qk-clip", "--qk-layernorm"], "--qk-layernorm normalises away"),
    (["--qk-clip", "--optimizer-offload-nvme-path", "/tmp"], "drop --use-precision-aware-optimizer and "
                                                             "--optimizer-offload-nvme-path"),
])
def test_bad_qk_clip_flags_are_one_line(flags, fragment, monkeypatch, capsys):
    assert_one_line_error(TINY + flags, fragment, monkeypatch, capsys)


@pytest.mark.parametrize("modules", [["core_attn", "mla_up_proj"], ["mla_up_proj"]], ids=["core+up", "up"])
def test_mla_max_logit_is_measured_the_same_under_recompute_modules(modules):
    """MLA with --qk-clip measures its max logit where q and k exist: with mla_up_proj (and core_attn) they
    are recomputed in backward or not kept, so the forward measures them apart; the clipped run is the
    same as without recomputation, step by step."""
    base = MUON + ROPE_MLA + FAST + ["--qk-clip", "--qk-clip-threshold", "0.05"]
    ref = _records(1, base)
    got = _records(1, base + ["--recompute-granularity", "selective", "--recompute-modules"] + modules)
    assert any(r["max_attention_logit"] > 0.05 for r in ref)
    for r, g in zip(ref, got):
        assert abs(g["lm_loss"] - r["lm_loss"]) <= 1e-6 * r["lm_loss"]
        assert abs(g["max_attention_logit"] - r["max_attention_logit"]) <= 1e-6 * r["max_attention_logit"]
