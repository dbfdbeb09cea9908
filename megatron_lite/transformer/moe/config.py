"""MoEConfig: the mixture-of-experts settings, one field per Megatron-LM flag (same names).

Kept apart from ModelConfig for now (it will be folded in); `validate()` reports every impossible
combination as a one-line `ConfigError` naming the value and the fix, before any process group or
parameter exists. `parse_moe_layer_freq` turns `--moe-layer-freq` (an int or a list expression such
as "([0]*1+[1]*3)*2") into one flag per layer.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import List, Optional, Union

from ...errors import ConfigError
from ...options import arg

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class MoEConfig:
    num_experts: Optional[int] = arg(None, "routed experts per MoE layer (None: a dense model)")
    moe_router_topk: int = arg(2, "experts each token is sent to (k)")
    moe_router_score_function: str = arg("softmax", "router scores: softmax, or sigmoid (DeepSeek-V3)",
                                         choices=list(SCORE_FUNCTIONS))
    moe_router_pre_softmax: bool = arg(False, "softmax over all experts before the top-k (else over the k chosen)",
                                       store="true")
    moe_router_norm_topk_prob: Optional[bool] = arg(None, "renormalize the k weights (HF norm_topk_prob); None: "
                                                          "Megatron's rule", flag=None)
    moe_router_topk_scaling_factor: Optional[float] = arg(None, "multiply the routing weights (DeepSeek's "
                                                                "routed_scaling_factor)")
    moe_router_num_groups: Optional[int] = arg(None, "expert groups of group-limited routing")
    moe_router_group_topk: Optional[int] = arg(None, "groups a token may pick experts from")
    moe_router_dtype: Optional[str] = arg(None, "router GEMM, scores and weighting dtype (None: the input's)",
                                          choices=["fp32", "fp64"])
    moe_router_load_balancing_type: str = arg("aux_loss", "aux_loss, seq_aux_loss (per sequence) or none",
                                              choices=list(LOAD_BALANCING_TYPES))
    moe_aux_loss_coeff: float = arg(0.0, "weight of the load-balancing loss (0: not computed)")
    moe_z_loss_coeff: Optional[float] = arg(None, "weight of the router z-loss (None: not computed)")
    moe_router_enable_expert_bias: bool = arg(False, "aux-loss-free balancing: a per-expert bias on the selection "
                                                     "scores", store="true")
    moe_router_bias_update_rate: float = arg(1e-3, "step of the expert-bias update, once per optimizer step")
    moe_input_jitter_eps: Optional[float] = arg(None, "multiply the router input by U(1-eps, 1+eps) in training")
    moe_token_dispatcher_type: str = arg("allgather", "token exchange over EP", choices=list(DISPATCHERS))
    moe_expert_capacity_factor: Optional[float] = arg(None, "capacity per expert as a factor of the even share "
                                                            "(None: dropless)")
    moe_token_drop_policy: str = arg("probs", "over capacity drop the lowest-probability (probs) or latest "
                                              "(position) tokens", choices=list(DROP_POLICIES))
    moe_pad_expert_input_to_capacity: bool = arg(False, "fill every expert up to its capacity (static shapes)",
                                                 store="true")
    moe_grouped_gemm: bool = arg(False, "one grouped GEMM per projection instead of a loop over experts",
                                 store="true")
    moe_ffn_hidden_size: Optional[int] = arg(None, "hidden size of each routed expert (None: --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: Optional[int] = arg(None, "hidden size of the shared expert(s) "
                                                                   "(None: none)")
    moe_shared_expert_gate: bool = arg(False, "Qwen2-MoE: scale the shared expert by sigmoid(x . w_gate)",
                                       store="true")
    moe_layer_freq: Union[int, str, List[int]] = arg(1, "every N-th layer is MoE, or one 0/1 per layer such as "
                                                        "'([0]*1+[1]*3)*2'")
    moe_layer_recompute: bool = arg(False, "recompute each MoE layer in backward instead of keeping its "
                                           "activations", store="true")

    def with_defaults(self, ffn_hidden_size: int) -> "MoEConfig":
        """A copy with Megatron's defaults filled in from the dense model (moe_ffn_hidden_size)."""
        if self.moe_ffn_hidden_size is not None:
            return replace(self)
        return replace(self, moe_ffn_hidden_size=ffn_hidden_size)

    @property
    def normalizes_topk(self) -> bool:
        """Whether the k routing weights of a token are renormalised to sum to 1 (before scaling)."""
        if self.moe_router_norm_topk_prob is not None:
            return self.moe_router_norm_topk_prob
        if self.moe_router_score_function == "softmax":
            return not self.moe_router_pre_softmax  # softmax over the k chosen logits
        return self.moe_router_topk > 1  # Megatron normalises sigmoid scores when k > 1

    def validate(self, num_layers: Optional[int] = None, ep: int = 1, etp: int = 1) -> "MoEConfig":
        e, k = self.num_experts, self.moe_router_topk
        _require(e is not None and e >= 1, f"num_experts ({e}) must be a positive number of experts for an MoE layer: "
                                           f"set --num-experts")
        _require(1 <= k <= e, f"moe_router_topk ({k}) must be between 1 and num_experts ({e}): "
                              f"lower --moe-router-topk")
        self._validate_choices()
        self._validate_scores()
        self._validate_groups()
        self._validate_losses()
        self._validate_capacity()
        self._validate_sizes(ep, etp)
        if num_layers is not None:
            parse_moe_layer_freq(self.moe_layer_freq, num_layers)
        return self

    def _validate_choices(self) -> None:
        for name, value, choices in (
                ("moe_router_score_function", self.moe_router_score_function, SCORE_FUNCTIONS),
                ("moe_router_load_balancing_type", self.moe_router_load_balancing_type, LOAD_BALANCING_TYPES),
                ("moe_token_dispatcher_type", self.moe_token_dispatcher_type, DISPATCHERS),
                ("moe_token_drop_policy", self.moe_token_drop_policy, DROP_POLICIES),
                ("moe_router_dtype", self.moe_router_dtype, ROUTER_DTYPES)):
            _require(value in choices, f"{name} ({value!r}) is not one of {', '.join(map(str, choices))}: "
                                       f"pick one of those for --{name.replace('_', '-')}")

    def _validate_scores(self) -> None:
        k = self.moe_router_topk
        softmax = self.moe_router_score_function == "softmax"
        # The softmax of a single selected logit is 1 whatever the logit: the router would get no gradient.
        _require(not (softmax and k == 1 and not self.moe_router_pre_softmax),
                 "moe_router_topk 1 with softmax scores over the chosen expert gives the router no gradient: "
                 "add --moe-router-pre-softmax")
        _require(not (softmax and not self.moe_router_pre_softmax and self.moe_router_norm_topk_prob is False),
                 "moe_router_norm_topk_prob False needs scores over all experts: add --moe-router-pre-softmax "
                 "(a softmax over the k chosen logits is normalised by construction)")
        _require(not self.moe_router_enable_expert_bias or not softmax,
                 "moe_router_enable_expert_bias needs sigmoid scores: set --moe-router-score-function sigmoid")
        f = self.moe_router_topk_scaling_factor
        _require(f is None or f > 0, f"moe_router_topk_scaling_factor ({f}) must be positive: drop it or set it > 0")
        eps = self.moe_input_jitter_eps
        _require(eps is None or 0 < eps < 1, f"moe_input_jitter_eps ({eps}) must lie in (0, 1): e.g. 1e-2")

    def _validate_groups(self) -> None:
        e, k, g, gk = self.num_experts, self.moe_router_topk, self.moe_router_num_groups, self.moe_router_group_topk
        if g is None and gk is None:
            return
        _require(g is not None and gk is not None,
                 f"group-limited routing needs both moe_router_num_groups ({g}) and moe_router_group_topk ({gk}): "
                 f"set both or neither")
        _require(g >= 1 and e % g == 0, f"moe_router_num_groups ({g}) must divide num_experts ({e}): "
                                        f"pick a divisor of {e}")
        _require(1 <= gk <= g, f"moe_router_group_topk ({gk}) must be between 1 and moe_router_num_groups ({g})")
        # Groups are ranked by the sum of their top k / group_topk scores (DeepSeek-V3: top 2 of 8 / 4).
        _require(k % gk == 0, f"moe_router_topk ({k}) must be a multiple of moe_router_group_topk ({gk}): "
                              f"each chosen group contributes k / group_topk experts to its rank")
        _require(k // gk <= e // g, f"moe_router_topk / moe_router_group_topk ({k // gk}) exceeds the experts per "
                                    f"group ({e // g}): raise --moe-router-group-topk or lower --moe-router-topk")

    def _validate_losses(self) -> None:
        a, z, rate = self.moe_aux_loss_coeff, self.moe_z_loss_coeff, self.moe_router_bias_update_rate
        _require(a >= 0, f"moe_aux_loss_coeff ({a}) must be >= 0: use 0 to turn the load-balancing loss off")
        _require(z is None or z >= 0, f"moe_z_loss_coeff ({z}) must be >= 0: drop it to turn the z-loss off")
        _require(rate > 0, f"moe_router_bias_update_rate ({rate}) must be positive: e.g. 1e-3")
        _require(not (self.moe_router_load_balancing_type == "none" and a > 0),
                 f"moe_aux_loss_coeff ({a}) has no effect with moe_router_load_balancing_type 'none': "
                 f"set --moe-router-load-balancing-type aux_loss or drop --moe-aux-loss-coeff")

    def _validate_capacity(self) -> None:
        cf = self.moe_expert_capacity_factor
        _require(cf is None or cf > 0, f"moe_expert_capacity_factor ({cf}) must be positive: drop it for dropless routing")
        _require(not self.moe_pad_expert_input_to_capacity or cf is not None,
                 "moe_pad_expert_input_to_capacity needs a capacity: set --moe-expert-capacity-factor")

    def _validate_sizes(self, ep: int, etp: int) -> None:
        e, f, s = self.num_experts, self.moe_ffn_hidden_size, self.moe_shared_expert_intermediate_size
        _require(f is not None and f >= 1, f"moe_ffn_hidden_size ({f}) is not set: set --moe-ffn-hidden-size "
                                           f"(Megatron defaults it to --ffn-hidden-size; see MoEConfig.with_defaults)")
        _require(e % ep == 0, f"num_experts ({e}) must be divisible by the expert model parallel size ({ep}): "
                              f"pick --expert-model-parallel-size among the divisors of {e}")
        _require(f % etp == 0, f"moe_ffn_hidden_size ({f}) must be divisible by the expert tensor parallel size "
                               f"({etp}): pick a multiple of {etp}")
        _require(s is None or s >= 1, f"moe_shared_expert_intermediate_size ({s}) must be positive: drop it for no "
                                      f"shared expert")
        _require(not self.moe_shared_expert_gate or s is not None,
                 "moe_shared_expert_gate needs a shared expert: set --moe-shared-expert-intermediate-size")


# --- --moe-layer-freq ---------------------------------------------------------------------------
_MAX_PATTERN = 100_000  # no model has more layers; keeps "[1]*10**9"-style typos from eating memory


def _eval_layer_pattern(node: ast.AST):
    """Evaluate a list expression made only of int literals, lists, tuples, + and *."""
    if isinstance(node, ast.Expression):
        return _eval_layer_pattern(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_layer_pattern(n) for n in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_layer_pattern(node.left), _eval_layer_pattern(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(left, list) and isinstance(right, int) and len(left) * right > _MAX_PATTERN:
            raise ValueError(f"the pattern is longer than {_MAX_PATTERN} layers")
        return left * right
    raise ValueError(f"{type(node).__name__} is not allowed (only ints, lists, + and *)")


def layer_pattern_of_text(text: str):
    """An int, or the list a pattern expression such as "([0]*1+[1]*3)*2" spells (SyntaxError,
    ValueError or TypeError when it is neither)."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else _eval_layer_pattern(ast.parse(text, mode="eval"))


def parse_moe_layer_freq(value: Union[int, str, List[int]], num_layers: int) -> List[bool]:
    """One flag per layer, True where the layer is MoE. An int N makes every N-th layer MoE
    starting with the first (Megatron's rule: layer i is MoE when i % N == 0); a list (or its
    string form, e.g. "([0]*1+[1]*3)*2") gives 1 for MoE and 0 for dense, one per layer."""
    given = value
    if isinstance(value, str):
        try:
            value = layer_pattern_of_text(value)
        except (SyntaxError, ValueError, TypeError) as e:
            raise ConfigError(f"moe_layer_freq ({given!r}) is not an int or a list of 0/1 such as "
                              f"'([0]*1+[1]*3)*2': {e}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        _require(value >= 1, f"moe_layer_freq ({given!r}) must be >= 1: 1 makes every layer MoE")
        return [i % value == 0 for i in range(num_layers)]
    _require(isinstance(value, list) and all(v in (0, 1) and not isinstance(v, bool) for v in value),
             f"moe_layer_freq ({given!r}) must be an int or a list of 0 (dense) and 1 (MoE), one per layer")
    _require(len(value) == num_layers, f"moe_layer_freq ({given!r}) has {len(value)} entries for {num_layers} "
                                       f"layers: give one 0/1 per layer")
    return [v == 1 for v in value]
