"""ModelConfig: the model's shape and architecture (one field per Megatron-LM flag) and its checks.

Kept apart from config.py (the parallel, training and data settings, and the checks across them);
`megatron_lite.config` re-exports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Union

from .errors import ConfigError
from .options import arg
from .transformer.mixer_pattern import validate_linear_attention
from .transformer.dsa_config import validate_dsa
from .transformer.moe.config import MoEConfig, parse_moe_layer_freq


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class ModelConfig:
    num_layers: int = arg(2, "transformer layers")
    hidden_size: int = arg(64, "hidden size (h)")
    num_attention_heads: int = arg(4, "attention heads")
    num_query_groups: Optional[int] = arg(None, "K/V heads of grouped-query attention (with --group-query-attention); "
                                                "None: one per head")
    ffn_hidden_size: Optional[int] = arg(None, "MLP hidden size; None: 4h, or 2/3 of 4h rounded down to 64 with SwiGLU")
    kv_channels: Optional[int] = arg(None, "head size; None: hidden_size / num_attention_heads")
    vocab_size: int = arg(257, "true vocabulary size (from the tokenizer; padded for TP internally)", flag=None)
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this x TP")
    tokenizer_vocab_size: Optional[int] = arg(None, "the tokenizer's vocabulary where the model has more rows, all of "
                                                    "them logits in the softmax (a Megatron-LM checkpoint's padded "
                                                    "vocabulary, kept by megatron-to-ml); None: vocab_size", flag=None)
    max_position_embeddings: int = arg(1024, "positions of the learned position embedding")
    normalization: str = arg("LayerNorm", "norm of every layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = arg(1e-5, "norm epsilon", aliases=["--layernorm-epsilon"])
    position_embedding_type: str = arg("learned_absolute", "position embedding",
                                       choices=["learned_absolute", "rope", "none"])
    rotary_base: float = arg(10000.0, "RoPE base (theta)")
    rotary_percent: float = arg(1.0, "fraction of each head's channels that RoPE rotates (the first ones)")
    rope_scaling_type: Optional[str] = arg(None, "RoPE frequency scaling: llama3 (Llama-3.1; --use-rope-scaling), "
                                                 "yarn (--rope-type yarn)", choices=["llama3", "yarn"])
    rope_scaling_factor: float = arg(8.0, "Llama-3.1 scaling factor")
    rope_scaling_low_freq_factor: float = arg(1.0, "Llama-3.1 low-frequency factor", flag=None)
    rope_scaling_high_freq_factor: float = arg(4.0, "Llama-3.1 high-frequency factor", flag=None)
    rope_scaling_original_max_position: int = arg(8192, "Llama-3.1 original context length", flag=None)
    rotary_scaling_factor: float = arg(1.0, "YaRN: the context-extension factor (--rope-type yarn)")
    original_max_position_embeddings: int = arg(4096, "YaRN: the context length the model was pretrained at")
    beta_fast: float = arg(32.0, "YaRN: rotations over the original context above which a frequency is kept")
    beta_slow: float = arg(1.0, "YaRN: rotations over the original context below which a frequency is interpolated")
    mscale: float = arg(1.0, "YaRN: attention magnitude scale (DeepSeek's mscale)")
    mscale_all_dim: float = arg(0.0, "YaRN: DeepSeek's mscale_all_dim (0: none); the softmax scale takes its square")
    yarn_correction_range_round_to_int: bool = arg(True, "YaRN: the ends of the interpolation ramp rounded to whole "
                                                         "channels (--no-yarn-correction-range-round-to-int: not, "
                                                         "gpt-oss)", flag="--no-yarn-correction-range-round-to-int",
                                                   store="false")
    multi_latent_attention: bool = arg(False, "multi-latent attention (DeepSeek-V2/V3): low-rank K/V (and Q) with a "
                                              "decoupled RoPE key shared by the heads", store="true")
    q_lora_rank: Optional[int] = arg(None, "MLA: rank of the query's low-rank projection (None: a full Q projection)")
    kv_lora_rank: int = arg(32, "MLA: rank of the compressed K/V latent (what generation caches)")
    qk_head_dim: int = arg(128, "MLA: the query / key head size without the RoPE part")
    qk_pos_emb_head_dim: int = arg(64, "MLA: the RoPE part of each query / key head (the key's is shared by all heads)")
    v_head_dim: int = arg(128, "MLA: the value head size")
    experimental_attention_variant: Optional[str] = arg(None, "an experimental token mixer in the attention slot: "
                                                              "gated_delta_net (linear-attention layers beside full "
                                                              "attention, as --linear-attention-freq places them: "
                                                              "Qwen3-Next), or dsa (DeepSeek Sparse Attention: a "
                                                              "lightning indexer's top-k keys for MLA)",
                                                        choices=["gated_delta_net", "dsa"])
    dsa_indexer_n_heads: int = arg(64, "DSA: heads of the lightning indexer")
    dsa_indexer_head_dim: int = arg(128, "DSA: head size of the lightning indexer (its last --qk-pos-emb-head-dim "
                                         "channels rotated)")
    dsa_indexer_topk: int = arg(2048, "DSA: keys each query attends to, chosen by the indexer")
    dsa_indexer_loss_coeff: float = arg(0.0, "DSA: weight of the indexer's KL loss to the attention (0: not trained)")
    dsa_indexer_use_sparse_loss: bool = arg(False, "DSA: the KL loss over the selected keys only (else all earlier "
                                                   "keys)", store="true")
    dsa_dense_warmup_iters: int = arg(0, "DSA: first iterations of DeepSeek's dense warm-up: dense attention, the "
                                         "main model frozen, only the indexer trained (by its KL loss)")
    swiglu: bool = arg(False, "SwiGLU MLP (Llama) instead of GELU", store="true")
    quick_geglu: bool = arg(False, "a gated MLP (as --swiglu) whose gate's activation is quick-GELU, x sigmoid(1.702 "
                                   "x), not silu (gpt-oss)", store="true")
    glu_linear_offset: float = arg(0.0, "gated MLP: added to the linear half before the product (gpt-oss: 1)")
    activation_func_clamp_value: Optional[float] = arg(None, "gated MLP: the gate clamped from above and the linear "
                                                             "half to [-v, v] (gpt-oss: 7)")
    activation: str = arg("gelu", "MLP activation without SwiGLU (--openai-gelu: gelu_tanh)",
                          choices=["gelu", "gelu_tanh"])
    add_bias_linear: bool = arg(True, "biases in every linear layer (--disable-bias-linear: none)",
                                flag="--disable-bias-linear", store="false")
    add_qkv_bias: bool = arg(False, "Q/K/V biases even without linear biases (Qwen)", store="true")
    qk_layernorm: bool = arg(False, "a norm over each head's channels on Q and K, before RoPE (Qwen3)", store="true")
    qk_layernorm_full_width: bool = arg(False, "with --qk-layernorm: RMSNorm over all of Q's and all of K's heads "
                                               "together, not each head (OLMoE)", store="true")
    apply_layernorm_1p: bool = arg(False, "zero-centred norm weights: applied as (1 + w), w initialized to 0",
                                   store="true")
    untie_embeddings_and_output_weights: bool = arg(False, "separate output layer instead of the tied embedding",
                                                    store="true")
    attention_dropout: float = arg(0.1, "dropout of the attention probabilities")
    hidden_dropout: float = arg(0.1, "dropout of the hidden states")
    init_method_std: float = arg(0.02, "std of the normal initialization")
    attention_backend: str = arg("auto", "core attention: sdpa (auto, fused), local (unfused: pure PyTorch), "
                                         "flash (flash-attn on CUDA when installed, else sdpa)",
                                 choices=["auto", "sdpa", "local", "flash", "fused", "unfused"])
    window_size: Optional[int] = arg(None, "sliding-window attention: a query sees the keys less than this many "
                                           "tokens back (Mistral)")
    softmax_type: str = arg("vanilla", "attention softmax: vanilla; off-by-one (a zero logit joins each softmax's "
                                       "denominator); learnable (a learned logit per head: gpt-oss's attention sinks)",
                            choices=["vanilla", "off-by-one", "learnable"])
    window_attn_skip_freq: Optional[int] = arg(None, "with --window-size: every N-th layer (counting from 1) attends "
                                                     "to the whole context, the others through the window (gpt-oss: "
                                                     "2); None: every layer windowed")
    family: Optional[str] = arg(None, "the Hugging Face family this config belongs to (gpt2, llama, mistral, qwen2, "
                                      "qwen3, mixtral, qwen2_moe, qwen3_moe); None: infer when converting", flag=None)
    moe: Optional[MoEConfig] = arg(None, "mixture of experts (the --num-experts / --moe-* flags); None: dense",
                                   flag=None)
    mtp_num_layers: Optional[int] = arg(None, "multi-token prediction: this many sequential modules after the decoder, "
                                              "module k predicting token t+k+1 (DeepSeek-V3); None: off")
    mtp_loss_scaling_factor: float = arg(0.1, "weight of the multi-token prediction loss: the mean over its depths "
                                              "is multiplied by this and added to the LM loss")
    # Linear-attention mixers (--experimental-attention-variant gated_delta_net, above; transformer/mixer_pattern.py
    # picks each layer's, gated_delta_net.py builds them)
    linear_attention_freq: Optional[Union[int, str, List[int]]] = arg(
        None, "every N-th layer (from 1) is full attention, the others linear; or one 1 (linear) / 0 (full) per layer "
              "such as '([1]*3+[0]*1)*2'")
    linear_attention_type: str = arg("gated_delta_net", "the linear layers' mixer: gated_delta_net, or kda (Kimi "
                                                        "Delta Attention, a decay per key channel; our flag, not "
                                                        "Megatron-LM's)", choices=["gated_delta_net", "kda"])
    linear_conv_kernel_dim: int = arg(4, "linear attention: the short causal conv's kernel size")
    linear_key_head_dim: int = arg(128, "linear attention: query / key head size")
    linear_value_head_dim: int = arg(128, "linear attention: value head size (kda: the key head size)")
    linear_num_key_heads: int = arg(16, "linear attention: query / key heads (kda: all heads)")
    linear_num_value_heads: int = arg(32, "linear attention: value heads, a multiple of the key heads (kda: ignored)")
    linear_chunk_size: int = arg(64, "linear attention: tokens per chunk of the chunked delta rule (our flag)")
    linear_attention_kernel: str = arg("torch", "linear attention's delta rule in training: torch (plain, any device) "
                                                "or fla (flash-linear-attention's Triton kernels, CUDA; our flag)",
                                       choices=["torch", "fla"])
    attention_output_gate: bool = arg(False, "full attention: a sigmoid gate from the query projection multiplies "
                                             "the attention output (Qwen3-Next)", store="true")
    # Mamba hybrids (Nemotron-H; transformer/hybrid.py, transformer/mamba.py)
    hybrid_override_pattern: Optional[str] = arg(None, "one letter per layer, each layer that one block: M Mamba-2, "
                                                       "* attention, - MLP, E MoE (Nemotron-H); None: every layer "
                                                       "attention + MLP")
    mamba_state_dim: int = arg(128, "Mamba-2: SSM state size per head (n)")
    mamba_head_dim: int = arg(64, "Mamba-2: channels per head (p)")
    mamba_num_groups: int = arg(8, "Mamba-2: groups of heads sharing B and C")
    mamba_num_heads: Optional[int] = arg(None, "Mamba-2: heads; None: 2 hidden_size / mamba_head_dim")
    mamba_chunk_size: int = arg(128, "Mamba-2: tokens per chunk of the SSD scan (exact whatever the size)")
    mamba_time_step_min: float = arg(0.0, "Mamba-2: dt clamped from below after softplus (HF nemotron_h's "
                                          "time_step_min); 0: not clamped (Megatron-Core)")
    squared_relu: bool = arg(False, "MLP activation relu(x)^2 (Nemotron-H)", store="true")
    mamba_impl: str = arg("torch", "Mamba-2 kernels in training: torch (plain, everywhere) or mamba_ssm (mamba-ssm "
                                   "+ causal-conv1d, CUDA)", choices=["torch", "mamba_ssm"])

    def __post_init__(self):
        if isinstance(self.moe, dict):  # from a checkpoint's metadata or a zoo preset
            self.moe = MoEConfig(**self.moe)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.multi_latent_attention:  # one K/V head per query head; kv_channels: the query / key head size
            self.num_query_groups = self.num_attention_heads
            self.kv_channels = self.qk_head_dim + self.qk_pos_emb_head_dim
        self._kv_channels_given = self.kv_channels is not None
        self.swiglu = self.swiglu or self.quick_geglu  # the gated unit; its gate activation differs
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.swiglu:  # Megatron-LM's rule: 2/3 of 4h, rounded down to a multiple of 64
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe is not None and self.moe.moe_ffn_hidden_size is None:  # Megatron: the dense MLP's size
            self.moe = self.moe.with_defaults(self.ffn_hidden_size)

    @property
    def tokenizer_vocab(self) -> int:
        """The vocabulary of the tokenizer this model takes (at most vocab_size)."""
        return self.tokenizer_vocab_size or self.vocab_size

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule).

        The padded rows never affect the loss: the cross entropy masks their logits."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def moe_layers(self) -> List[bool]:
        """Per layer, whether its MLP slot is an MoE layer."""
        if self.moe is None or not self.moe.num_experts:
            return [False] * self.num_layers
        if self.hybrid_override_pattern is not None:  # the pattern's E layers
            return [kind == "E" for kind in self.hybrid_override_pattern]
        return parse_moe_layer_freq(self.moe.moe_layer_freq, self.num_layers)

    def num_parameters(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count of the unsharded model (true vocab, no padding) as its layer types report
        it; with `active`, an MoE layer counts only the experts a token is routed to (what MFU counts)."""
        from .transformer.model_counts import model_counts  # the model stack: not loaded to parse flags
        counts = model_counts(self)
        total = counts.total.active if active else counts.total.params
        return total if include_embedding else total - counts.embedding.params

    def validate(self, seq_length: int) -> None:
        _require(self.num_layers > 0, f"num_layers ({self.num_layers}) must be positive")
        _require(self.hidden_size > 0, f"hidden_size ({self.hidden_size}) must be positive")
        _require(self.num_attention_heads > 0, f"num_attention_heads ({self.num_attention_heads}) must be positive")
        _require(self._kv_channels_given or self.hidden_size % self.num_attention_heads == 0,
                 f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                 f"({self.num_attention_heads}), or set the head size with --kv-channels")
        _require(self.num_query_groups is not None and self.num_query_groups > 0,
                 f"num_query_groups ({self.num_query_groups}) must be positive")
        _require(self.ffn_hidden_size > 0, f"ffn_hidden_size ({self.ffn_hidden_size}) must be positive")
        _require(self.make_vocab_size_divisible_by >= 1,
                 f"make_vocab_size_divisible_by ({self.make_vocab_size_divisible_by}) must be >= 1")
        _require(self.normalization in ("LayerNorm", "RMSNorm"),
                 f"normalization ({self.normalization}) must be LayerNorm or RMSNorm")
        _require(self.position_embedding_type in ("learned_absolute", "rope", "none"),
                 f"position_embedding_type ({self.position_embedding_type}) must be learned_absolute, rope or none")
        _require(self.activation in ("gelu", "gelu_tanh"), f"activation ({self.activation}) must be gelu or gelu_tanh")
        _require(self.num_attention_heads % self.num_query_groups == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups "
                 f"({self.num_query_groups}); choose a number of query groups that divides the heads")
        _require(self.kv_channels is not None and self.kv_channels > 0,
                 f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                 f"({self.num_attention_heads}) or --kv-channels must be set")
        if self.position_embedding_type == "rope" and not self.multi_latent_attention:  # MLA: its RoPE part
            _require(self.kv_channels % 2 == 0, f"rope needs an even head dim, got kv_channels={self.kv_channels}")
        else:
            _require(seq_length <= self.max_position_embeddings,
                     f"seq_length ({seq_length}) exceeds max_position_embeddings ({self.max_position_embeddings}); "
                     f"raise --max-position-embeddings or shorten --seq-length")
        _require(0.0 <= self.attention_dropout < 1 and 0.0 <= self.hidden_dropout < 1,
                 "dropout probabilities must lie in [0, 1)")
        _require(self.vocab_size > 0, f"vocab_size ({self.vocab_size}) must be positive")
        _require(self.tokenizer_vocab_size is None or 0 < self.tokenizer_vocab_size <= self.vocab_size,
                 f"tokenizer_vocab_size ({self.tokenizer_vocab_size}) must lie in [1, vocab_size ({self.vocab_size})]")
        _require(0 < self.rotary_percent <= 1, f"rotary_percent ({self.rotary_percent}) must lie in (0, 1]")
        _require(self.window_size is None or self.window_size >= 1,
                 f"window_size ({self.window_size}) must be >= 1 (or unset: full causal attention)")
        gated = ("quick_geglu", "glu_linear_offset", "activation_func_clamp_value")
        _require(self.swiglu or not (self.quick_geglu or self.glu_linear_offset or self.activation_func_clamp_value),
                 f"--{'/--'.join(g.replace('_', '-') for g in gated)} shape a gated MLP: add --swiglu")
        _require(self.activation_func_clamp_value is None or self.activation_func_clamp_value > 0,
                 f"--activation-func-clamp-value ({self.activation_func_clamp_value}) must be positive")
        _require(self.softmax_type in ("vanilla", "off-by-one", "learnable"),
                 f"softmax_type ({self.softmax_type}) must be vanilla, off-by-one or learnable")
        _require(self.window_attn_skip_freq is None or (self.window_size and self.window_attn_skip_freq >= 1),
                 f"--window-attn-skip-freq ({self.window_attn_skip_freq}) must be >= 1 and needs --window-size")
        _require(not self.qk_layernorm_full_width or (self.qk_layernorm and self.normalization == "RMSNorm"),
                 "--qk-layernorm-full-width changes --qk-layernorm to one RMSNorm over all heads: add --qk-layernorm "
                 "and --normalization RMSNorm")
        _require(self.rope_scaling_factor > 0, f"rope_scaling_factor ({self.rope_scaling_factor}) must be positive")
        if self.rope_scaling_type == "yarn":
            _require(self.rotary_scaling_factor >= 1 and self.original_max_position_embeddings >= 1,
                     f"--rope-type yarn needs --rotary-scaling-factor >= 1 ({self.rotary_scaling_factor}) and "
                     f"--original-max-position-embeddings >= 1 ({self.original_max_position_embeddings})")
            _require(self.beta_fast >= self.beta_slow > 0, f"YaRN needs --beta-fast ({self.beta_fast}) >= --beta-slow "
                                                          f"({self.beta_slow}) > 0")
        if self.multi_latent_attention:
            self._validate_mla()
        if self.experimental_attention_variant == "dsa":
            validate_dsa(self, seq_length)
        _require(self.mtp_num_layers is None or self.mtp_num_layers >= 1,
                 f"--mtp-num-layers ({self.mtp_num_layers}) must be >= 1 (or unset: no multi-token prediction)")
        _require(self.mtp_loss_scaling_factor >= 0,
                 f"--mtp-loss-scaling-factor ({self.mtp_loss_scaling_factor}) must be >= 0")
        _require(not self.mtp_num_layers or self.mtp_num_layers < seq_length,
                 f"--mtp-num-layers ({self.mtp_num_layers}) must be below seq_length ({seq_length}): depth k predicts "
                 f"the token k+1 positions ahead")
        validate_linear_attention(self)

    def _validate_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            _require(getattr(self, name) > 0, f"--{name.replace('_', '-')} ({getattr(self, name)}) must be positive")
        _require(self.q_lora_rank is None or self.q_lora_rank > 0,
                 f"--q-lora-rank ({self.q_lora_rank}) must be positive (or unset: a full Q projection)")
        _require(self.position_embedding_type == "rope",
                 f"--multi-latent-attention rotates its decoupled RoPE key: use --position-embedding-type rope, not "
                 f"{self.position_embedding_type}")
        _require(self.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim ({self.qk_pos_emb_head_dim}) must be even")
        _require(self.rotary_percent == 1.0, f"--rotary-percent {self.rotary_percent} with --multi-latent-attention: "
                                             f"MLA rotates exactly its --qk-pos-emb-head-dim channels; drop it")
        _require(not self.qk_layernorm, "--qk-layernorm with --multi-latent-attention: MLA normalises its Q and K/V "
                                        "latents itself; drop --qk-layernorm")

    def layer_window(self, layer_number: int):
        """The sliding window of layer `layer_number` (0-based; multi-token prediction's layers follow
        the decoder's), None for full attention: Megatron-Core's rule, every window_attn_skip_freq-th
        layer counting from 1 is full."""
        freq = self.window_attn_skip_freq
        return None if freq and (layer_number + 1) % freq == 0 else self.window_size

    @property
    def mtp_depth(self) -> int:
        """Multi-token prediction modules (0: none)."""
        return self.mtp_num_layers or 0
