"""Attention sinks (--softmax-type learnable, Megatron-Core's softmax_offset; off-by-one: a zero
logit): the attention output and its gradients (queries, keys, values, the per-head sink logits)
equal Hugging Face gpt_oss's eager attention, which appends the sinks to the scores before the
softmax, with and without a sliding window; a model trains at TP2 + SP, PP2 and ZeRO-1 like the
single process; CP is refused with one line."""
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.config import Config, ModelConfig, ParallelConfig  # noqa: E402
from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.inference.generation import DecodingSession  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import assert_close, assert_same_run, run_distributed  # noqa: E402
from megatron_lite.transformer.attention import SelfAttention  # noqa: E402
from megatron_lite.transformer.core_attention import core_attention_class  # noqa: E402
from megatron_lite.transformer.spec import BuildContext  # noqa: E402
from models.gpt import build_model  # noqa: E402
from training_utils import LLAMA_SWITCHES, TINY, records_of, train_in_process  # noqa: E402

B, S, HEADS, GROUPS, D = 2, 12, 4, 2, 8


def _hf_attention(q, k, v, sinks, window):
    """gpt_oss's eager attention ([b, s, heads, d] in and out)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    i = torch.arange(S)
    visible = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    mask = torch.zeros(S, S).masked_fill(~visible, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=HEADS // GROUPS, sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                     scaling=D ** -0.5)
    return out


@pytest.mark.parametrize("backend", ["sdpa", "local"])
@pytest.mark.parametrize("softmax_type,window", [("learnable", None), ("learnable", 5), ("off-by-one", None)])
def test_sinks_equal_hf_gpt_oss_attention_and_gradients(softmax_type, window, backend):
    cfg = ModelConfig(hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=GROUPS, attention_dropout=0.0,
                      softmax_type=softmax_type, window_size=window, attention_backend=backend)
    attn = SelfAttention(cfg, BuildContext(), 0, core_attention=core_attention_class(backend))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=g, requires_grad=True) for h in (HEADS, GROUPS, GROUPS))
    sinks = torch.randn(HEADS, generator=g) if softmax_type == "learnable" else torch.zeros(HEADS)
    if softmax_type == "learnable":
        attn.softmax_offset.data.copy_(sinks)
    sinks.requires_grad_(softmax_type == "learnable")
    out = attn._attend(q, k, v, None, 0)
    ref = _hf_attention(q, k, v, sinks, window)
    assert_close(out, ref, rtol=1e-5, what="output")
    assert (out - attn.core_attention(q, k, v)).abs().max() > 1e-3  # the sinks change the output
    dout = torch.randn(out.shape, generator=g)
    ours = torch.autograd.grad(out, [q, k, v] + ([attn.softmax_offset] if softmax_type == "learnable" else []), dout)
    theirs = torch.autograd.grad(ref, [q, k, v] + ([sinks] if softmax_type == "learnable" else []), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), ours, theirs):
        assert_close(a, b, rtol=1e-5, what=name)


ARGV = TINY + LLAMA_SWITCHES + ["--softmax-type", "learnable", "--num-layers", "2"]


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
    pytest.param(["--zero-stage", "1"], marks=pytest.mark.slow)], ids=["tp2-sp", "pp2", "dp2-zero1"])
def test_sinks_train_like_single_process(extra):
    ref = records_of(run_distributed(train_in_process, 1, ARGV))
    out = records_of(run_distributed(train_in_process, 2, ARGV + extra))
    assert_same_run(ref, out, grad_norm_rtol=1e-6, what=" ".join(extra))


def test_sinks_with_context_parallelism_are_refused():
    cfg = Config(model=ModelConfig(softmax_type="learnable", attention_dropout=0.0),
                 parallel=ParallelConfig(context_parallel_size=2))
    with pytest.raises(ConfigError, match="--softmax-type learnable with context parallelism"):
        cfg.validate(2)


def test_sinks_with_alternating_windows_decode_from_the_kv_cache_as_recomputed():
    """gpt-oss's attention (sinks; windowed and full layers alternating): cached decoding of a
    left-padded batch gives each sequence's logits of a full forward."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                      normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      attention_dropout=0.0, hidden_dropout=0.0, softmax_type="learnable", window_size=4,
                      window_attn_skip_freq=2)
    model = build_model(cfg, ParallelDims(), seed=3)[0].eval()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    session = DecodingSession(model, prompts, 10)
    logits, seqs, gap = session.prefill(), [list(p) for p in prompts], 0.0
    for _ in range(10):
        with torch.no_grad():
            full = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
        gap = max(gap, (logits - full).abs().max().item())
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        logits = session.step(logits.argmax(-1))
    assert gap < 1e-5 and len(seqs[0]) == 16
