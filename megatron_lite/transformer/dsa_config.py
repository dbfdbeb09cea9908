"""DeepSeek Sparse Attention's settings and their checks (no torch here: read while parsing flags).

The flags are Megatron-Core's (`--experimental-attention-variant dsa`, `--dsa-indexer-*`), fields of
ModelConfig; `--dsa-dense-warmup-iters` (ours) sets the length of DeepSeek's dense warm-up stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class DSASettings:
    n_heads: int
    head_dim: int
    topk: int
    loss_coeff: float
    sparse_loss: bool
    dense_warmup_iters: int

    @classmethod
    def from_model(cls, cfg) -> "DSASettings":
        return cls(cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk,
                   cfg.dsa_indexer_loss_coeff, cfg.dsa_indexer_use_sparse_loss, cfg.dsa_dense_warmup_iters)


def uses_dsa(cfg) -> bool:
    return getattr(cfg, "experimental_attention_variant", None) == "dsa"


def validate_dsa(cfg, seq_length: int) -> None:
    """The model's DSA flags (ModelConfig.validate calls this with --experimental-attention-variant dsa)."""
    _require(cfg.multi_latent_attention, "--experimental-attention-variant dsa selects keys for multi-latent "
                                         "attention: add --multi-latent-attention")
    for flag, value in (("--dsa-indexer-n-heads", cfg.dsa_indexer_n_heads),
                        ("--dsa-indexer-head-dim", cfg.dsa_indexer_head_dim),
                        ("--dsa-indexer-topk", cfg.dsa_indexer_topk)):
        _require(value >= 1, f"{flag} ({value}) must be >= 1")
    _require(cfg.dsa_indexer_head_dim >= cfg.qk_pos_emb_head_dim,
             f"--dsa-indexer-head-dim ({cfg.dsa_indexer_head_dim}) must be >= --qk-pos-emb-head-dim "
             f"({cfg.qk_pos_emb_head_dim}): the indexer rotates that many of its channels")
    _require(cfg.dsa_indexer_topk <= seq_length,
             f"--dsa-indexer-topk ({cfg.dsa_indexer_topk}) exceeds --seq-length ({seq_length}): a query cannot "
             f"select more keys than the sequence has; lower --dsa-indexer-topk")
    _require(cfg.dsa_indexer_loss_coeff >= 0, f"--dsa-indexer-loss-coeff ({cfg.dsa_indexer_loss_coeff}) must be >= 0")
    _require(cfg.dsa_dense_warmup_iters >= 0, f"--dsa-dense-warmup-iters ({cfg.dsa_dense_warmup_iters}) must be >= 0")
    _require(cfg.dsa_dense_warmup_iters == 0 or cfg.dsa_indexer_loss_coeff > 0,
             "--dsa-dense-warmup-iters trains only the indexer, by its KL loss: set --dsa-indexer-loss-coeff > 0")
    _require(cfg.attention_dropout == 0, f"--attention-dropout {cfg.attention_dropout} with DSA: the sparse "
                                         f"attention has no dropout (as Megatron-Core's); use --attention-dropout 0")
    _require(cfg.window_size is None, "--window-size with DSA: the indexer chooses the keys; drop --window-size")


def validate_dsa_layout(cfg) -> None:
    """The layouts DSA runs at (Config.validate calls this)."""
    if not uses_dsa(cfg.model) or cfg.parallel.context_parallel_size == 1:
        return
    t = cfg.training
    recomputed = [m for m in ("core_attn", "mla_up_proj")
                  if t.recompute_granularity == "selective" and m in (t.recompute_modules or ("core_attn",))]
    _require(not recomputed, f"--recompute-modules {' '.join(recomputed)} with DSA under context parallelism: the "
                             f"CP path attends over gathered latents outside those regions; use "
                             f"--recompute-granularity full, or drop them")
