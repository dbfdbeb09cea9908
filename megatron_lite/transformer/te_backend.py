"""--transformer-impl transformer_engine: the layers' linears and core attention from Transformer
Engine (TE) where `import transformer_engine` works (NGC PyTorch images, CUDA only).

Per layer: the QKV projection as te.LayerNormLinear (the input norm fused in; column-parallel over
our TP group, with SP), te.DotProductAttention (sbhd, causal, grouped-query), the output projection
as te.Linear (row-parallel); the MLP as te.LayerNormLinear fc1 (the pre-MLP norm fused in) and
te.Linear fc2. Every parameter gets our ShardSpec, so initialization, ZeRO, gradient reduction and
checkpoints treat them as their own (the names differ from the local layers': linear_qkv and the
fused norms' layer_norm_weight, so checkpoints do not cross between the two implementations). With
--fp8-format each layer's forward runs under te.fp8_autocast with TE's recipe object for our
recipe flags (DelayedScaling / Float8CurrentScaling / Float8BlockScaling), amaxes reduced over the
stage's TP x DP x CP group; the output layer stays in the params dtype.

Everything TE is imported lazily: a machine without TE gets a one-line error naming the fix. This
backend is NOT exercised in CI (TE does not install on the CPU machines the tests run on); its
tests (tests/test_transformer_engine.py) run only where TE is installed. Dense layers with
standard attention only (MoE, MLA and CP are refused in one line).
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..parallel.sharding import ShardSpec, Split, set_spec, tp_split

MISSING = ("--transformer-impl transformer_engine needs Transformer Engine (not importable here): pip install "
           "--no-build-isolation 'transformer_engine[pytorch]' on a CUDA machine, or use an NGC PyTorch container "
           "(nvcr.io/nvidia/pytorch); or drop the flag (--transformer-impl local, the native layers)")


def available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_pytorch():
    if not available():
        raise ConfigError(MISSING)
    import transformer_engine.pytorch as te
    return te


def te_recipe(fmt: str, recipe: str, margin: int = 0, history_len: int = 1, algo: str = "most_recent"):
    """TE's recipe object for our FP8 flags."""
    from transformer_engine.common import recipe as r
    fp8_format = r.Format.HYBRID if fmt == "hybrid" else r.Format.E4M3
    if recipe == "delayed":
        return r.DelayedScaling(margin=margin, fp8_format=fp8_format, amax_history_len=history_len,
                                amax_compute_algo=algo)
    if recipe == "tensorwise":
        return r.Float8CurrentScaling(fp8_format=fp8_format)
    if recipe == "blockwise":
        return r.Float8BlockScaling(fp8_format=fp8_format)
    raise ConfigError(f"--fp8-recipe {recipe} has no Transformer Engine recipe: use tensorwise, delayed or blockwise "
                      f"with --transformer-impl transformer_engine, or --transformer-impl local")


class TEContext:
    """What the TE layers share: the recipe (None: no FP8) and the amax reduction group."""

    def __init__(self, recipe=None, group=None):
        self.recipe, self.group = recipe, group

    def autocast(self):
        if self.recipe is None:
            return contextlib.nullcontext()
        return te_pytorch().fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.group)


def te_context(t, dims) -> TEContext:
    """The TE layers' context for TrainingConfig `t`: TE's recipe for our FP8 flags (None without FP8)."""
    te_pytorch()
    recipe = None if t.fp8_format is None else te_recipe(t.fp8_format, t.fp8_recipe, t.fp8_margin,
                                                         t.fp8_amax_history_len, t.fp8_amax_compute_algo)
    return TEContext(recipe, dims.tp_dp_cp_group)


def _te_kwargs(ctx):
    dims = ctx.dims
    return dict(tp_group=dims.tp_group if dims.tp > 1 else None, tp_size=dims.tp,
                sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype,
                device=ctx.device if ctx.device is not None and ctx.device.type == "cuda" else "cuda")


def _specs(module: nn.Module, ctx, weight_split: Split, full_weight, norm_width=None, normalization="RMSNorm"):
    """Our ShardSpecs on a TE module's parameters (TE names them weight, bias, layer_norm_*)."""
    col = weight_split.dim == 0
    for name, p in module.named_parameters(recurse=False):
        if name == "weight":
            set_spec(p, ShardSpec(full_weight, (weight_split,), init="normal" if col else "normal_scaled"))
        elif name == "bias":
            spec = ShardSpec((full_weight[0],), (weight_split,) if col else (), init="zeros",
                             sequence_parallel=not col and ctx.sequence_parallel)
            set_spec(p, spec)
        elif name.startswith("layer_norm_"):  # whole on every rank; partial gradients under SP
            init = "ones" if name.endswith("weight") else "zeros"
            set_spec(p, ShardSpec((norm_width,), (), init=init, sequence_parallel=ctx.sequence_parallel))


class TESelfAttention(nn.Module):
    cache_update = None  # generation runs with the local layers

    def __init__(self, cfg, ctx, layer_number: int, core_attention=None):
        super().__init__()
        te, dims, h = te_pytorch(), ctx.dims, cfg.hidden_size
        heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        self.heads, self.groups, self.d, self.te_ctx = heads // dims.tp, groups // dims.tp, d, ctx.te
        qkv = [heads * d, groups * d, groups * d]
        bias = cfg.add_bias_linear or cfg.add_qkv_bias
        self.linear_qkv = te.LayerNormLinear(h, sum(qkv), eps=cfg.norm_epsilon, bias=bias,
                                             normalization=cfg.normalization, parallel_mode="column",
                                             zero_centered_gamma=cfg.apply_layernorm_1p, **_te_kwargs(ctx))
        _specs(self.linear_qkv, ctx, tp_split(dims, 0, sum(qkv), qkv), (sum(qkv), h), h)
        self.core_attention = te.DotProductAttention(heads, d, num_gqa_groups=groups,
                                                     attention_dropout=cfg.attention_dropout, qkv_format="sbhd",
                                                     attn_mask_type="causal", tp_size=dims.tp,
                                                     tp_group=dims.tp_group if dims.tp > 1 else None,
                                                     layer_number=layer_number + 1)
        self.linear_proj = te.Linear(heads * d, h, bias=cfg.add_bias_linear, parallel_mode="row", **_te_kwargs(ctx))
        _specs(self.linear_proj, ctx, tp_split(dims, 1, heads * d), (h, heads * d))

    def forward(self, x, rope=None, packed=None):
        from .rope import apply_rope
        s, b = x.shape[:2]
        with self.te_ctx.autocast():
            qkv = self.linear_qkv(x)  # [s, b, (heads + 2 groups) d / tp]: this rank's [q | k | v]
            q, k, v = qkv.split([self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
            q, k, v = (t.reshape(s, b, -1, self.d) for t in (q, k, v))
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            return self.linear_proj(self.core_attention(q, k, v))


class TEMLP(nn.Module):
    def __init__(self, cfg, ctx, layer_number: int = 0):
        super().__init__()
        from .mlp import GatedUnit
        te, dims, h, f = te_pytorch(), ctx.dims, cfg.hidden_size, cfg.ffn_hidden_size
        fc1, segments = (2 * f, [f, f]) if cfg.swiglu else (f, [f])
        self.swiglu, self.glu, self.activation, self.te_ctx = cfg.swiglu, GatedUnit.of(cfg), cfg.activation, ctx.te
        self.linear_fc1 = te.LayerNormLinear(h, fc1, eps=cfg.norm_epsilon, bias=cfg.add_bias_linear,
                                             normalization=cfg.normalization, parallel_mode="column",
                                             zero_centered_gamma=cfg.apply_layernorm_1p, **_te_kwargs(ctx))
        _specs(self.linear_fc1, ctx, tp_split(dims, 0, fc1, segments), (fc1, h), h)
        self.linear_fc2 = te.Linear(f, h, bias=cfg.add_bias_linear, parallel_mode="row", **_te_kwargs(ctx))
        _specs(self.linear_fc2, ctx, tp_split(dims, 1, f), (h, f))

    def forward(self, x):
        with self.te_ctx.autocast():
            h = self.linear_fc1(x)
            h = self.glu(h) if self.swiglu else torch.nn.functional.gelu(
                h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
            return self.linear_fc2(h)


def fused_norm(cfg, ctx, layer_number: int = 0) -> nn.Module:
    """The norm slots: TE's LayerNormLinear applies them (identity here)."""
    return nn.Identity()


def check_supported(cfg) -> None:
    """One-line errors for what this backend does not build."""
    m, p = cfg.model, cfg.parallel
    for what, bad in (("MoE layers (--num-experts)", m.moe is not None and m.moe.num_experts),
                      ("--multi-latent-attention", m.multi_latent_attention),
                      ("--context-parallel-size > 1", p.cp > 1), ("--qk-layernorm", m.qk_layernorm),
                      ("--experimental-attention-variant", m.experimental_attention_variant),
                      ("--attention-output-gate", m.attention_output_gate)):
        if bad:
            raise ConfigError(f"--transformer-impl transformer_engine builds dense layers with standard attention: "
                              f"{what} needs --transformer-impl local")
