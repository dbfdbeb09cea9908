"""TopKRouter against the routing code of Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepseekV3 (tiny configs, the same weights): the same experts for every token and the same
weights to 1e-6. Inputs whose ordering is decided by less than 1e-4 (near ties, which two correct
implementations may break differently) are redrawn. Then the balancing losses against their
closed forms and HF's load_balancing_loss_func, the injected gradient, capacity dropping against
hand computations, and aux-loss-free expert-bias updates."""
import pytest
import torch

from megatron_lite.parallel.random import RNGStatesTracker, recompute
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.testing import assert_close, run_distributed
from megatron_lite.transformer.loss_normalization import LossNormalization
from megatron_lite.transformer.moe import MoEConfig, MoEMetricsTracker, TopKRouter, update_expert_bias
from megatron_lite.transformer.moe.router import Routing
from tests.moe_helpers import aux_weight

H = 16


def _router(cfg, weight, bias=None, tracker=None, scale=None, dims=None):
    dims = dims or ParallelDims().build_groups()
    r = TopKRouter(cfg.validate(), weight.shape[1], dims, layer_number=0, loss_normalization=scale,
                   tracker=tracker)
    r.weight.data.copy_(weight)
    if bias is not None:
        r.expert_bias.copy_(bias)
    return r


def _dense(weights, idx, num_experts):
    return torch.zeros(weights.shape[0], num_experts, dtype=torch.float64).scatter(1, idx, weights.double())


def _untied_input(gen, tokens, margin_fn, margin=1e-4):
    """Redraw until every token's choice is decided by more than `margin`."""
    for _ in range(100):
        x = torch.randn(tokens, H, generator=gen)
        if margin_fn(x) > margin:
            return x
    raise AssertionError("could not draw an input without near ties")


def _topk_margin(scores, k):
    top = scores.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).min().item()


def _hf_router(family, num_experts, k, norm_topk_prob=None, **extra):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
        return MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=num_experts, num_experts_per_tok=k))
    if family in ("qwen2_moe", "qwen3_moe"):
        if family == "qwen2_moe":
            from transformers import Qwen2MoeConfig as C
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as R
        else:
            from transformers import Qwen3MoeConfig as C
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R
        return R(C(hidden_size=H, num_experts=num_experts, num_experts_per_tok=k, norm_topk_prob=norm_topk_prob))
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    return DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=num_experts, num_experts_per_tok=k,
                                                 norm_topk_prob=norm_topk_prob, **extra))


SOFTMAX_CASES = [
    # family, HF norm_topk_prob, our MoEConfig settings
    ("mixtral", None, dict()),
    ("qwen2_moe", False, dict(moe_router_pre_softmax=True)),
    ("qwen2_moe", True, dict(moe_router_pre_softmax=True, moe_router_norm_topk_prob=True)),
    ("qwen3_moe", True, dict()),
    ("qwen3_moe", False, dict(moe_router_pre_softmax=True)),
]


@pytest.mark.parametrize("family,norm,settings", SOFTMAX_CASES, ids=[f"{f}-norm{n}" for f, n, _ in SOFTMAX_CASES])
@pytest.mark.parametrize("router_dtype", [None, "fp64"])
def test_softmax_routers_match_hf(family, norm, settings, router_dtype):
    e, k = 8, 2
    gen = torch.Generator().manual_seed(hash((family, norm)) % 1000)
    hf = _hf_router(family, e, k, norm)
    weight = torch.randn(e, H, generator=gen) * 0.5
    hf.weight.data.copy_(weight)
    ours = _router(MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_router_dtype=router_dtype,
                             **settings), weight)
    x = _untied_input(gen, 64, lambda x: _topk_margin(x @ weight.t(), k))
    _, hf_weights, hf_idx = hf(x)
    routing = ours(x, 64, 1)
    assert torch.equal(routing.routing_map, _dense(hf_weights, hf_idx, e) != 0)
    assert (routing.probs.double() - _dense(hf_weights, hf_idx, e)).abs().max() < 1e-6


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])
def test_deepseek_v3_router_matches_hf(norm, groups):
    """Sigmoid scores, expert bias on the selection only, group-limited top-k, scaling factor."""
    e, k, (n_group, topk_group) = 16, 4, groups
    gen = torch.Generator().manual_seed(3 + int(norm))
    hf = _hf_router("deepseek_v3", e, k, norm, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    weight, bias = torch.randn(e, H, generator=gen) * 0.5, torch.randn(e, generator=gen) * 0.1
    hf.weight.data.copy_(weight)
    hf.e_score_correction_bias.copy_(bias)
    cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
                    moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                    moe_router_norm_topk_prob=norm, moe_router_dtype="fp32",
                    moe_router_num_groups=n_group if n_group > 1 else None,
                    moe_router_group_topk=topk_group if n_group > 1 else None)
    ours = _router(cfg, weight, bias)

    def margin(x):  # both the group choice and the expert choice must be clear
        sel = torch.sigmoid(x @ weight.t()) + bias
        group_scores = sel.view(-1, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        m = _topk_margin(group_scores, topk_group) if topk_group < n_group else 1.0
        return min(m, _topk_margin(sel, k))

    x = _untied_input(gen, 64, margin)
    _, hf_weights, hf_idx = hf(x)
    routing = ours(x, 64, 1)
    expected = _dense(hf_weights, hf_idx, e)
    assert torch.equal(routing.routing_map, expected != 0)
    assert (routing.probs.double() - expected).abs().max() < 1e-6
    # The bias changes the choice, never the weights: these are the unbiased sigmoid scores.
    if not norm:
        chosen = routing.routing_map
        assert torch.allclose(routing.probs[chosen], 2.5 * torch.sigmoid(x @ weight.t())[chosen], atol=1e-6)


# --- balancing losses ---------------------------------------------------------------------------
def _aux_closed_form(logits, k, score="softmax"):
    """E / (k T^2) sum_e P_e c_e in float64, from the definition."""
    logits = logits.double()
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    if score == "sigmoid":
        scores = scores / scores.sum(-1, keepdim=True)
    t, e = scores.shape
    counts = torch.zeros(e, dtype=torch.float64).scatter_add_(0, scores.topk(k, -1).indices.flatten(),
                                                               torch.ones(t * k, dtype=torch.float64))
    return e / (k * t * t) * (scores.sum(0) * counts).sum()


def _seq_aux_closed_form(logits, k, s, b):
    scores = torch.softmax(logits.double(), -1).view(s, b, -1)
    e = scores.shape[-1]
    total = 0.0
    for j in range(b):
        sc = scores[:, j]
        counts = torch.zeros(e, dtype=torch.float64).scatter_add_(0, sc.topk(k, -1).indices.flatten(),
                                                                   torch.ones(s * k, dtype=torch.float64))
        total = total + e / (k * s * s) * (sc.sum(0) * counts).sum()
    return total / b


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_value_and_injected_gradient(score):
    e, k, t, coeff, scale = 8, 2, 48, 0.01, 3.0
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(e, H, generator=gen)
    tracker = MoEMetricsTracker(1, e)
    cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_aux_loss_coeff=coeff,
                    moe_router_score_function=score)
    router = _router(cfg, weight, tracker=tracker, scale=aux_weight(scale))
    x = torch.randn(t, H, generator=gen, requires_grad=True)
    routing = router(x, t, 1)
    logits = (x @ weight.t()).detach()
    expected = _aux_closed_form(logits, k, score)
    assert abs(tracker.losses[0, 0].item() - expected.item()) <= 1e-6 * expected.item()
    if score == "softmax":  # HF's Switch loss is k times Megatron's (it omits the 1/k)
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
        hf = load_balancing_loss_func((logits,), e, k)
        assert abs(hf.item() / k - expected.item()) <= 1e-6 * expected.item()
    # Backward with no gradient from the routing weights: all that reaches x is scale * coeff * d aux.
    routing.probs.backward(torch.zeros_like(routing.probs))
    x_ref = x.detach().clone().requires_grad_(True)
    (scale * coeff * _aux_closed_form(x_ref @ weight.t(), k, score)).backward()
    assert_close(x.grad, x_ref.grad, rtol=1e-5, what="aux-loss input gradient")
    assert_close(router.weight.grad, _weight_grad(x, weight, k, score, scale * coeff), rtol=1e-5,
                 what="aux-loss router gradient")


def _weight_grad(x, weight, k, score, factor):
    w = weight.clone().requires_grad_(True)
    (factor * _aux_closed_form(x.detach() @ w.t(), k, score)).backward()
    return w.grad


def test_seq_aux_loss_and_z_loss_closed_forms():
    e, k, s, b = 8, 2, 12, 3
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(e, H, generator=gen)
    tracker = MoEMetricsTracker(1, e)
    cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.1,
                    moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=1e-3)
    router = _router(cfg, weight, tracker=tracker)
    x = torch.randn(s * b, H, generator=gen)
    router(x, s, b)
    logits = (x @ weight.t()).double()
    seq = _seq_aux_closed_form(logits, k, s, b)
    assert abs(tracker.losses[0, 0].item() - seq.item()) <= 1e-6 * seq.item()
    z = torch.logsumexp(logits, -1).square().mean()
    assert abs(tracker.losses[1, 0].item() - z.item()) <= 1e-6 * z.item()
    # Per-sequence and whole-batch balance differ on this input (the test could tell them apart).
    assert abs(_aux_closed_form(logits, k).item() - seq.item()) > 1e-3 * seq.item()


def test_no_aux_loss_or_counts_in_evaluation():
    e = 4
    tracker = MoEMetricsTracker(1, e)
    cfg = MoEConfig(num_experts=e, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.1,
                    moe_z_loss_coeff=0.1)
    router = _router(cfg, torch.randn(e, H), tracker=tracker)
    x = torch.randn(10, H)
    with torch.no_grad():
        router(x, 10, 1)
    router.eval()
    out = router(x.requires_grad_(True), 10, 1)
    assert tracker.micro_batches.sum() == 0 and tracker.losses.abs().sum() == 0
    assert out.probs.grad_fn is not None  # eval forward still differentiable, just no losses


def test_recomputation_counts_once_and_injects_once():
    """Activation recomputation runs the router again inside backward: counted and logged once,
    and the aux-loss gradient arrives once, with the scale of the original forward."""
    e, k, t = 8, 2, 20
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(e, H, generator=gen)
    cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.5,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    x = torch.randn(t, H, generator=gen)
    grads = []
    for use_recompute in (False, True):
        tracker, scale = MoEMetricsTracker(1, e), aux_weight(2.0)
        router = _router(cfg, weight, tracker=tracker, scale=scale)
        xi = x.clone().requires_grad_(True)
        fn = lambda inp: router(inp, t, 1).probs
        probs = recompute(fn, RNGStatesTracker(), xi) if use_recompute else fn(xi)
        scale.current = LossNormalization(loss_scale=1e6)  # changing the weight after the forward must not matter
        probs.backward(torch.zeros_like(probs))
        assert tracker.micro_batches[0].item() == 1
        assert router.local_tokens_per_expert.sum().item() == t * k
        grads.append(xi.grad.clone())
    assert_close(grads[1], grads[0], rtol=1e-6, what="recomputed aux gradient")
    assert grads[0].abs().sum() > 0


# --- capacity -----------------------------------------------------------------------------------
def _one_hot_router(cfg, e):
    """A router whose logits are the input itself (weight = identity), for hand-made routings."""
    return _router(cfg, torch.eye(e, H))


def _logits_input(logits):
    return torch.cat([logits, torch.zeros(logits.shape[0], H - logits.shape[1])], dim=1)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_factor_one_drops_the_hand_computed_tokens(policy):
    """8 tokens, 4 experts, top-1: capacity = ceil(8 * 1 / 4 * 1.0) = 2. Five tokens want expert
    0, two expert 1, one expert 2, none expert 3: 3 tokens of expert 0 are dropped."""
    e = 4
    strength = torch.tensor([3.0, 5.0, 1.0, 4.0, 2.0, 3.0, 4.0, 2.0])  # routing confidence per token
    target = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])
    logits = torch.full((8, e), -4.0).scatter(1, target.unsqueeze(1), strength.unsqueeze(1))
    cfg = MoEConfig(num_experts=e, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=8,
                    moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy)
    routing = _one_hot_router(cfg, e)(_logits_input(logits), 8, 1)
    assert routing.dropped == 3
    assert routing.routing_map.sum(0).tolist() == [2, 2, 1, 0]
    kept_of_expert0 = routing.routing_map[:5, 0].nonzero().flatten().tolist()
    # probs keeps the two most confident (tokens 1 and 3), position the two earliest (0 and 1).
    assert kept_of_expert0 == ([1, 3] if policy == "probs" else [0, 1])
    dropped = ~routing.routing_map.any(1)
    assert (routing.probs[dropped] == 0).all() and (routing.probs[routing.routing_map] > 0).all()


def test_capacity_top2_and_padding():
    """4 tokens, 4 experts, top-2, factor 1: capacity ceil(4 * 2 / 4) = 2. Every token wants
    experts 0 and 1 -> each keeps 2 of 4 (4 pairs dropped); padding fills experts 2 and 3 with two
    tokens of weight 0 each."""
    e = 4
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [5.0, 1.0, -1.0, 0.0], [3.5, 3.2, 0.5, 0.0], [2.0, 4.0, 0.0, 0.0]])
    base = dict(num_experts=e, moe_router_topk=2, moe_ffn_hidden_size=8, moe_expert_capacity_factor=1.0)
    routing = _one_hot_router(MoEConfig(**base), e)(_logits_input(logits), 4, 1)
    assert routing.dropped == 4
    assert routing.routing_map.sum(0).tolist() == [2, 2, 0, 0]
    # Expert 0 keeps its two highest weights: softmax over each token's two logits.
    w0 = torch.softmax(logits[:, :2], -1)[:, 0]
    assert routing.routing_map[:, 0].nonzero().flatten().tolist() == w0.topk(2).indices.sort().values.tolist()
    padded = _one_hot_router(MoEConfig(**base, moe_pad_expert_input_to_capacity=True), e)(_logits_input(logits), 4, 1)
    assert padded.routing_map.sum(0).tolist() == [2, 2, 2, 2]
    assert torch.equal(padded.probs[:, :2], routing.probs[:, :2]) and (padded.probs[:, 2:] == 0).all()


def test_capacity_large_enough_is_dropless():
    e = 4
    cfg = MoEConfig(num_experts=e, moe_router_topk=2, moe_ffn_hidden_size=8, moe_expert_capacity_factor=4.0)
    x = torch.randn(16, H)
    dropless = MoEConfig(num_experts=e, moe_router_topk=2, moe_ffn_hidden_size=8)
    w = torch.randn(e, H)
    a, b = _router(cfg, w)(x, 16, 1), _router(dropless, w)(x, 16, 1)
    assert a.dropped == 0 and torch.equal(a.routing_map, b.routing_map) and torch.equal(a.probs, b.probs)


# --- aux-loss-free expert bias -----------------------------------------------------------------
def _bias_run(rank, world, steps):
    """Each DP rank routes its own skewed tokens; the bias follows the counts summed over ranks."""
    dims = ParallelDims.from_world()
    e, k, t, rate = 8, 2, 64, 0.05
    cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate, moe_aux_loss_coeff=0.0)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(e, H, generator=gen)
    router = _router(cfg, weight, dims=dims)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(10 + rank)) + 0.8 * weight[0] + 0.5 * weight[1]
    history = []
    for _ in range(steps):
        before = router.expert_bias.clone()
        for chunk in x.chunk(2):  # two micro-batches per step, both counted
            router(chunk, chunk.shape[0], 1)
        local = router.local_tokens_per_expert.clone()
        update_expert_bias([router], dims)
        history.append((before, local, router.expert_bias.clone()))
        assert router.local_tokens_per_expert.sum() == 0
    return history


def test_expert_bias_moves_with_the_sign_of_the_load_error():
    histories = run_distributed(_bias_run, 2, 12)
    rate = 0.05
    for step, per_rank in enumerate(zip(*histories)):
        (b0, c0, a0), (b1, c1, a1) = per_rank
        assert torch.equal(a0, a1) and torch.equal(b0, b1), "the bias must be the same on every rank"
        counts = c0 + c1  # the step's counts over both DP ranks
        assert counts.sum() == 2 * 64 * 2
        assert torch.allclose(a0 - b0, rate * torch.sign(counts.mean() - counts), rtol=0, atol=1e-6), f"step {step}"
    first, last = histories[0][0][1] + histories[1][0][1], histories[0][-1][1] + histories[1][-1][1]
    assert last.max() < first.max(), "the bias should even the load out"


def test_routing_object_shapes():
    r = _router(MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8), torch.randn(4, H))
    out = r(torch.randn(6, H), 3, 2)
    assert isinstance(out, Routing) and out.probs.shape == (6, 4) and out.routing_map.dtype == torch.bool
    assert (out.routing_map.sum(1) == 2).all()
    assert torch.allclose(out.probs.sum(1), torch.ones(6))


@pytest.mark.parametrize("mode", ["per_token", "per_micro_batch_mean"])
def test_loss_normalization_weights_give_the_documented_objective(mode):
    """The weights of a step's LossNormalization (main loss, auxiliary losses, gradient factor) make
    the gradients those of J = (1/N) sum_mb (loss_sum_mb + T aux_mb) (per token: T = s x b, the
    micro-batch's nominal tokens, N the loss-bearing ones) or (1/M) sum_mb (loss_mb / T_mb + aux_mb)
    (per-micro-batch mean), micro-batches with different loss-token counts T_mb."""
    from tests.moe_helpers import build_layer, full_state, load_full_state
    s, b, h, ls, coeff = 6, 2, 16, 4.0, 0.3
    cfg_kw = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=coeff)
    dims = ParallelDims().build_groups()
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(s, b, h, generator=gen), torch.randn(s, b, h, generator=gen),
                (torch.rand(s, b, 1, generator=gen) < p).float()) for p in (0.9, 0.4)]
    n = sum(m.sum() for _, _, m in batches)
    norm = LossNormalization(per_token=mode == "per_token", num_microbatches=len(batches), loss_scale=ls,
                             normalizer=float(s * b * len(batches)), dims=dims)
    grads = []
    for injected in (True, False):
        layer, _ = build_layer(dict(cfg_kw, moe_aux_loss_coeff=coeff if injected else 0.0), dims, h)
        load_full_state(layer, full_state(layer, seed=2))
        layer.router.loss_normalization.current = norm  # what the trainer does before the step
        for x, probe, mask in batches:
            t_mb = mask.sum()
            loss_sum = (layer(x) * probe * mask).sum()
            if injected:  # what a training step does: backpropagate the weighted main loss only
                norm(loss_sum, t_mb).backward()
            else:  # the objective written out, its aux term differentiated directly
                aux = coeff * layer.router.aux_loss(layer.router.gating(x.reshape(s * b, h)), s, b)
                j = (loss_sum + s * b * aux) * ls / n if mode == "per_token" else (loss_sum / t_mb + aux) * ls / len(batches)
                j.backward()
        factor = norm.grad_factor(n) if injected else 1.0  # the step's final gradient multiplier
        grads.append({k: p.grad * factor for k, p in layer.named_parameters()})
    for k in grads[1]:
        assert_close(grads[0][k], grads[1][k], rtol=1e-5, what=k)
