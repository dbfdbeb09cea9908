"""The GEMM path (megatron_lite/parallel/gemm.py): every weight GEMM of a model goes through the
one GemmPath it was built with. Under zero-bubble's deferral the weight gradients of the routed
experts (loop and grouped) and of the shared expert are queued in B like the dense ones, and the
W pass gives exactly the gradients of a plain backward; a recipe's per-call object reaches the
backward (deferred or not) of the forward that made it."""
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.gemm import GemmPath
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.transformer.moe import MoEConfig
from models.gpt import build_model


def _moe_model(gemm, grouped):
    """2 MoE layers (4 routed experts and a gated shared expert each), untied output layer."""
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped,
                    moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=64, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, moe=moe)
    return build_model(cfg, ParallelDims(), seed=5, gemm=gemm)[0]


def _backward(model):
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()


# Per layer: Q, K;V, proj; the experts' fc1 and fc2; the shared expert's fc1 and fc2. And the output layer.
GEMM_WEIGHTS = {f"layers.{i}.{name}" for i in range(2) for name in (
    "self_attention.linear_q.weight", "self_attention.linear_kv.weight", "self_attention.linear_proj.weight",
    "mlp.experts.weight1", "mlp.experts.weight2", "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight")} | {"output_layer.weight"}


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_weight_gradients_are_queued_in_b_and_run_in_w(grouped):
    direct = _moe_model(GemmPath(), grouped)
    _backward(direct)
    gemm = GemmPath(deferrable=True)
    model = _moe_model(gemm, grouped)
    gemm.deferring = True
    _backward(model)
    gemm.deferring = False
    queue = gemm.take()
    names = {id(p): n for n, p in model.named_parameters()}
    queued = [names[id(p)] for params, _ in queue for p in params if p is not None]
    assert len(queue) == len(queued) == len(GEMM_WEIGHTS) and set(queued) == GEMM_WEIGHTS
    params = dict(model.named_parameters())
    assert all(params[n].grad is None for n in GEMM_WEIGHTS), "a weight gradient computed in B"
    gemm.run(queue)
    for n, p in direct.named_parameters():
        assert torch.equal(params[n].grad, p.grad), n


class _Recording(GemmPath):
    """A precision recipe in miniature: each forward keeps its input in its call object, which
    every backward primitive must get back (the W pass included)."""

    def __init__(self):
        super().__init__(deferrable=True)
        self.calls = {"forward": [], "input_grad": [], "weight_grad": []}

    def new_call(self, batches=None, order=None):
        return {}

    def _forward(self, call, x):
        call["x"] = x
        self.calls["forward"].append(id(call))

    def _backward(self, kind, call, x=None):
        assert x is None or torch.equal(call["x"], x), "backward got another forward's call"
        self.calls[kind].append(id(call))

    def forward(self, call, x, w, bias=None):
        self._forward(call, x)
        return super().forward(call, x, w, bias)

    def input_grad(self, call, g, w):
        self._backward("input_grad", call)
        return super().input_grad(call, g, w)

    def weight_grad(self, call, g, x):
        self._backward("weight_grad", call, x)
        return super().weight_grad(call, g, x)

    def grouped_forward(self, call, x, w, offs):
        self._forward(call, x)
        return super().grouped_forward(call, x, w, offs)

    def grouped_input_grad(self, call, g, w, offs):
        self._backward("input_grad", call)
        return super().grouped_input_grad(call, g, w, offs)

    def grouped_weight_grad(self, call, g, x, offs):
        self._backward("weight_grad", call, x)
        return super().grouped_weight_grad(call, g, x, offs)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("defer", [False, True])
def test_every_weight_gemm_takes_the_path_with_its_call(grouped, defer):
    gemm = _Recording()
    model = _moe_model(gemm, grouped)
    gemm.deferring = defer
    _backward(model)
    gemm.deferring = False
    gemm.flush()
    forward = gemm.calls["forward"]
    # One call per dense weight, per expert in the loop, per projection when grouped.
    per_layer = 5 + (2 if grouped else 2 * 4)
    assert len(forward) == len(set(forward)) == 2 * per_layer + 1
    assert sorted(gemm.calls["input_grad"]) == sorted(gemm.calls["weight_grad"]) == sorted(forward)
