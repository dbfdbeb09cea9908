"""The Mamba-2 mixer (megatron_lite/transformer/mamba.py) against transformers' nemotron_h mixer (its
plain-torch path), with packed documents, and the conv + SSM state cache against the full forward."""
import dataclasses

import pytest
import torch

from megatron_lite.transformer.core_attention import PackedSeq
from megatron_lite.transformer.mamba import MambaConfig, MambaMixer
from megatron_lite.transformer.spec import BuildContext

HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS = 32, 8, 6, 5, 2


def hf_mixer(chunk=4, seed=0):
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    cfg = NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, ssm_state_size=STATE,
                          n_groups=GROUPS, chunk_size=chunk, layer_types=["linear_attention"], vocab_size=64,
                          layer_norm_epsilon=1e-5, use_conv_bias=True)
    torch.manual_seed(seed)
    m = NemotronHMamba2Mixer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():  # random values everywhere, so that every parameter matters
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        m.A_log.copy_(torch.rand(HEADS).log1p())
        m.norm.weight.add_(1.0)
    return cfg, m


def ours_from(cfg, hf) -> MambaMixer:
    config = MambaConfig(HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                         time_step_min=cfg.time_step_min, norm_eps=cfg.layer_norm_epsilon)
    m = MambaMixer(None, BuildContext(), 0, config=config).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(hf.get_parameter(name))  # the same names, one to one
    return m


def test_forward_equals_transformers_nemotron_h_mixer():
    cfg, hf = hf_mixer(chunk=4)
    ours = ours_from(cfg, hf)
    x = torch.randn(2, 11, HIDDEN)  # 11 tokens: chunks of 4 do not divide the sequence
    with torch.no_grad():
        ref = hf(x)
        out = ours(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_packed_documents_restart_conv_and_state():
    """Two documents packed in one row = each run alone (the conv window and the state stop at the
    boundary); the chunk boundary (4) falls inside the first document."""
    cfg, hf = hf_mixer(chunk=4, seed=1)
    ours = ours_from(cfg, hf)
    x = torch.randn(1, 10, HIDDEN)
    docs = torch.tensor([[0] * 6 + [1] * 4])
    with torch.no_grad():
        packed = ours(x.transpose(0, 1), packed=PackedSeq(docs)).transpose(0, 1)
        alone = torch.cat([ours(x[:, :6].transpose(0, 1)), ours(x[:, 6:].transpose(0, 1))]).transpose(0, 1)
        joined = ours(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (joined[:, 6:] - alone[:, 6:]).abs().max() > 1e-3  # unpacked, the second document sees the first


@pytest.mark.parametrize("chunk", [3, 16])
def test_gradients_flow_to_every_parameter_and_match_transformers(chunk):
    cfg, hf = hf_mixer(chunk=chunk, seed=2)
    hf.train()
    ours = ours_from(cfg, hf).train()
    x = torch.randn(2, 9, HIDDEN)
    (hf(x) ** 2).sum().backward()
    (ours(x.transpose(0, 1)) ** 2).sum().backward()
    for name, p in ours.named_parameters():
        ref = hf.get_parameter(name).grad  # fp32 rounding of gradients in the hundreds: relative to the largest
        assert ref.abs().max() > 0 and (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_config_refuses_heads_not_divisible():
    c = MambaConfig(HIDDEN, 6, HEAD_DIM, STATE, 4)
    with pytest.raises(Exception, match="divisible by --mamba-num-groups"):
        c.check(1)
    with pytest.raises(Exception, match="tensor-parallel size"):
        dataclasses.replace(c, num_groups=2).check(4)


def _kernels_missing() -> str:
    import importlib.util
    if not torch.cuda.is_available():
        return "mamba-ssm / causal-conv1d kernels run on CUDA only: no GPU here"
    missing = [p for p in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(p) is None]
    return f"{' and '.join(missing)} not installed" if missing else ""


@pytest.mark.skipif(bool(_kernels_missing()), reason=_kernels_missing() or "-")
def test_mamba_ssm_kernels_equal_the_torch_path():
    """--mamba-impl mamba_ssm (conv and scan kernels) = the plain-torch path, forward and gradients, with
    packed documents."""
    cfg, hf = hf_mixer(chunk=4, seed=3)
    ref = ours_from(cfg, hf).cuda().train()
    fast = MambaMixer(None, BuildContext(), 0, config=dataclasses.replace(ref.config, impl="mamba_ssm")).cuda().train()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(13, 2, HIDDEN, device="cuda")
    packed = PackedSeq(torch.tensor([[0] * 5 + [1] * 8, [0] * 13], device="cuda"))
    outs = [m(x, packed=packed) for m in (ref, fast)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)
    for m, out in zip((ref, fast), outs):
        (out ** 2).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-3 * p.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("seq, chunk", [(64, 8), (48, 16)])
def test_counts_equal_the_built_mixer_and_a_flop_counter(seq, chunk):
    """Parameters = the module's; forward FLOPs per token = what torch's FlopCounterMode counts (the
    projections' GEMMs and the chunked scan's einsums: counts' core_flops) plus 2 per weight outside a
    GEMM (conv, dt_bias, A_log, D, norm: the convention counts every weight)."""
    from torch.utils.flop_counter import FlopCounterMode
    from megatron_lite.config import ModelConfig
    from megatron_lite.transformer.counts import MicroBatch
    cfg = ModelConfig(num_layers=1, hidden_size=HIDDEN, mamba_state_dim=STATE, mamba_head_dim=8, mamba_num_groups=GROUPS,
                      mamba_chunk_size=chunk, hybrid_override_pattern="M", add_bias_linear=False)
    m = MambaMixer(cfg, BuildContext(), 0)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    with FlopCounterMode(display=False) as counter:
        m(torch.randn(seq, 1, HIDDEN))
    counts = MambaMixer.counts(cfg, MicroBatch(seq_length=seq, tokens=seq))
    assert counts.params == sum(p.numel() for p in m.parameters())
    outside_gemms = sum(p.numel() for name, p in m.named_parameters() if not name.endswith("proj.weight"))
    assert counter.get_total_flops() / seq == counts.flops - 2 * outside_gemms
    assert counts.core_flops > 0
