"""GroupedExperts: the grouped-GEMM path equals the per-expert loop (forward and backward, with
experts that get no token), SwiGLU and GELU; the ShardSpecs every expert parameter carries
(EP split of the expert dimension, ETP split of [gate | up]), the boxes checkpoints read from
them; and the one-line errors of grouped GEMM."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.sharding import Split, spec_of
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close
from megatron_lite.transformer.moe import GroupedExperts, is_expert_parameter

E, H, FF = 4, 8, 12


@pytest.mark.parametrize("swiglu,activation", [(True, "gelu"), (False, "gelu"), (False, "gelu_tanh")])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 0], [0, 0, 0, 0]])
def test_grouped_gemm_equals_the_expert_loop(swiglu, activation, counts):
    dims = ParallelDims()
    loop = GroupedExperts(E, H, FF, dims, swiglu, activation, grouped_gemm=False)
    grouped = GroupedExperts(E, H, FF, dims, swiglu, activation, grouped_gemm=True)
    gen = torch.Generator().manual_seed(0)
    for p, q in zip(loop.parameters(), grouped.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=gen))
        q.data.copy_(p.data)
    x = torch.randn(sum(counts), H, generator=gen)
    probe = torch.randn(sum(counts), H, generator=gen)
    outs = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_(True)
        y = experts(xi, counts)
        (y * probe).sum().backward()
        outs.append((y.detach(), xi.grad, experts.weight1.grad, experts.weight2.grad))
    for a, b, what in zip(outs[1], outs[0], ("output", "input grad", "weight1 grad", "weight2 grad")):
        assert_close(a, b, rtol=1e-6, atol=1e-6, what=what)
    # And the loop is the plain per-expert MLP.
    start = 0
    for e, n in enumerate(counts):
        h = x[start:start + n] @ loop.weight1[e].t()
        h = F.silu(h[:, :FF]) * h[:, FF:] if swiglu else F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
        assert_close(outs[0][0][start:start + n], h @ loop.weight2[e].t(), rtol=1e-6, what=f"expert {e}")
        if n == 0:
            assert outs[0][2][e].abs().sum() == 0
        start += n


def test_shard_specs_under_ep2_etp2():
    # rank 3 of tp 2 x dp 2: tp_rank 1, dp_rank 1 -> ep_rank 1, etp_rank 1.
    dims = ParallelDims(tp=2, dp=2, ep=2, etp=2, rank=3)
    experts = GroupedExperts(E, H, FF, dims, swiglu=True)
    s1, s2 = spec_of(experts.weight1), spec_of(experts.weight2)
    assert s1.full_shape == (E, 2 * FF, H) and s2.full_shape == (E, H, FF)
    assert s1.splits == (Split(0, "ep", 2, 1, (E,)), Split(1, "tp", 2, 1, (FF, FF)))
    assert s2.splits == (Split(0, "ep", 2, 1, (E,)), Split(2, "tp", 2, 1, (FF,)))
    assert tuple(experts.weight1.shape) == (2, FF, H) and tuple(experts.weight2.shape) == (2, H, FF // 2)
    assert s1.init == "normal" and s2.init == "normal_scaled"
    assert is_expert_parameter(experts.weight1) and is_expert_parameter(experts.weight2)
    # This rank's piece: experts 2..3, the second half of gate and of up.
    full = torch.arange(E * 2 * FF * H, dtype=torch.float32).view(E, 2 * FF, H)
    piece = s1.shard(full)
    expected = torch.cat([full[2:, FF // 2:FF], full[2:, FF + FF // 2:]], dim=1)
    assert torch.equal(piece, expected)
    # Checkpoint geometry: the local tensor maps to two boxes of the full one (gate and up).
    boxes = s1.local_to_full(((0, 2), (0, FF), (0, H)))
    assert boxes == [(((0, 2), (0, FF // 2), (0, H)), ((2, 2), (FF // 2, FF // 2), (0, H))),
                     (((0, 2), (FF // 2, FF // 2), (0, H)), ((2, 2), (FF + FF // 2, FF // 2), (0, H)))]


def test_shard_specs_under_etp1_are_whole_experts():
    dims = ParallelDims(tp=2, dp=2, ep=2, etp=1, rank=1)  # tp_rank 1: EP folds over TP first, ep_rank 1
    experts = GroupedExperts(E, H, FF, dims, swiglu=False)
    assert spec_of(experts.weight1).splits == (Split(0, "ep", 2, 1, (E,)),)
    assert tuple(experts.weight1.shape) == (2, FF, H) and experts.local_expert_start == 2


def test_shard_specs_under_folded_etp2_inside_tp4():
    # rank 1 of tp 4 with ETP 2 x EP 2: etp_rank 1, ep_rank 0 (ETP adjacent, then EP)
    dims = ParallelDims(tp=4, ep=2, etp=2, rank=1)
    experts = GroupedExperts(E, H, FF, dims, swiglu=True)
    s1, s2 = spec_of(experts.weight1), spec_of(experts.weight2)
    assert s1.splits == (Split(0, "ep", 2, 0, (E,)), Split(1, "tp", 2, 1, (FF, FF)))
    assert s2.splits == (Split(0, "ep", 2, 0, (E,)), Split(2, "tp", 2, 1, (FF,)))
    assert tuple(experts.weight1.shape) == (2, FF, H) and tuple(experts.weight2.shape) == (2, H, FF // 2)


@pytest.mark.parametrize("hidden,ffn,dtype,needle", [
    (10, 12, torch.float32, "hidden size (10) to be a multiple of 4"),
    (8, 6, torch.float32, "expert ffn size per ETP rank (6) to be a multiple of 4"),
    (12, 16, torch.bfloat16, "hidden size (12) to be a multiple of 8"),
    (8, 12, torch.float64, "runs in float32, bfloat16 or float16"),
])
def test_grouped_gemm_errors(hidden, ffn, dtype, needle):
    with pytest.raises(ConfigError) as err:
        GroupedExperts(E, hidden, ffn, ParallelDims(), grouped_gemm=True, dtype=dtype)
    assert needle in str(err.value) and "\n" not in str(err.value)
