"""Megatron-Core 0.16.1 on CPU with gloo, for tests: its GPTModel (local spec) on forked ranks, its
own forward, and its checkpoints as Megatron-LM writes them (torch_dist through Megatron-Core's
dist_checkpointing.save; legacy per-rank model_optim_rng.pt built the way Megatron-LM's
save_checkpoint builds it).

Import megatron.core through `import_mcore()` (before any other megatron.core import): it undoes
megatron.core's process-wide torch.load registrations and turns off Megatron-Core's JIT fuser (torch.compile, slow to start on CPU; the fused functions
then run as plain PyTorch, the same math), and `cpu_shims()` (in each rank) points what Megatron-
Core puts on "cuda" at the CPU:
- every megatron.core module's `torch` becomes a copy whose tensor factories map a CUDA device to
  the CPU and whose `torch.cuda.current_device()` is the CPU (buffers, RoPE frequencies);
- `Tensor.cuda()` returns the tensor itself (the tied output layer's copy is moved to "cuda"
  before its all-reduce over the embedding group): in this rank's process only;
- the checkpoint writer's result queue (a multiprocessing Manager, which cannot start inside a
  forked rank) becomes a plain queue (the writer's results are read by the same process), and its
  memory probe (needs psutil, only for a debug log line) returns 0;
- its optimizer's gradient clipping (which asserts CUDA gradients) scales the CPU gradients the same way.
The ranks must not be daemonic: the writer forks a process per file (run_distributed(daemon=False)).
A model with --apply-layernorm-1p runs Megatron-Core's FusedLayerNorm as with apex installed, apex's
kernel standing in as F.layer_norm (`apex_layer_norm()`, in that rank only): the local spec's other
LayerNorm, torch's, refuses zero-centred weights.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import types
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


def import_mcore():
    """Import the Megatron-Core modules the tests use (None when megatron-core is not installed).
    Importing megatron.core registers its classes (argparse.Namespace among them) as safe for every
    torch.load(weights_only=True) of the process: that registration is undone, so that the other
    tests in this pytest process see torch's own list."""
    registered = torch.serialization.get_safe_globals()
    try:
        import megatron.core.jit as jit
    except ImportError:
        return None
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)
    jit.disable_jit_fuser()
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.state_dict_saver  # noqa: F401  (imported lazily in 0.19)
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.enums
    return megatron.core


def _cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or \
            (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return factory(*args, **kwargs)
    return make


def cpu_shims() -> None:
    """Run Megatron-Core on the CPU in this process (see the module docstring)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    fake_cuda = types.ModuleType("torch.cuda (on the CPU)")
    fake_cuda.__dict__.update(vars(torch.cuda))
    fake_cuda.current_device = lambda: torch.device("cpu")
    fake_cuda.synchronize = fake_cuda.empty_cache = lambda *a, **k: None
    fake_torch = types.ModuleType("torch (CUDA factories on the CPU)")
    fake_torch.__dict__.update(vars(torch))
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(fake_torch, name, _on_cpu(getattr(torch, name)))
    fake_torch.cuda = fake_cuda
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = fake_torch
    torch.Tensor.cuda = lambda self, *a, **k: self
    filesystem_async._results_queue = queue.Queue()
    filesystem_async._process_memory = lambda: 0
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no CUDA RNG states
    from megatron.core.optimizer import optimizer
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grads  # (its own asserts CUDA gradients)
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # the router's GEMM asks for it (None: no Transformer Engine)
        moe_utils.te_general_gemm = None


def _clip_grads(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron-Core's clip_grad_by_total_norm_fp32 (the gradients scaled by max_norm / (total + 1e-6)
    when that is below 1), on CPU tensors."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            grad = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if grad is not None:
                grad.mul_(coeff)


# --- a model and its Megatron-LM args -------------------------------------------------------------
def transformer_config(shape: dict, tp: int, pp: int, vpp: int = 1):
    """Megatron-Core's config of the shape (`first_stage_layers` / `last_stage_layers`: an uneven
    pipeline split), dropout off and no fused kernels but the bias-GELU one when asked."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    mla = {k: shape[k] for k in MLA_KEYS if k in shape} if shape.get("multi_latent_attention") else {}
    if mla:
        mla.update(multi_latent_attention=True, rope_type=shape.get("rope_type", "rope"))
    return (MLATransformerConfig if mla else TransformerConfig)(**mla,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=shape.get("first_stage_layers"),
        num_layers_in_last_pipeline_stage=shape.get("last_stage_layers"),
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_query_groups=shape.get("num_query_groups"),
        ffn_hidden_size=shape["ffn_hidden_size"], kv_channels=shape.get("kv_channels"),
        normalization=shape["normalization"], layernorm_epsilon=shape["norm_epsilon"],
        gated_linear_unit=shape["swiglu"], activation_func=F.silu if shape["swiglu"] else F.gelu,
        add_bias_linear=shape["add_bias_linear"], add_qkv_bias=shape.get("add_qkv_bias", False),
        bias_activation_fusion=shape.get("bias_gelu_fusion", False), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        layernorm_zero_centered_gamma=shape.get("apply_layernorm_1p", False),
        qk_layernorm=shape.get("qk_layernorm", False), **_moe_config(shape))


# An MLA shape's keys (Megatron-LM's args and Megatron-Core's config fields of the same names)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
            "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


# An MoE shape's keys (Megatron-LM's args of the same names); the experts run as SequentialMLP
# and the allgather dispatcher (the alltoall one asks for a CUDA stream).
MOE_KEYS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_layer_freq", "moe_router_score_function", "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_num_groups",
            "moe_router_group_topk")


def _moe_config(shape: dict) -> dict:
    if not shape.get("num_experts"):
        return {}
    kw = {k: shape[k] for k in MOE_KEYS[1:] if k in shape}
    return dict(kw, num_moe_experts=shape["num_experts"], moe_token_dispatcher_type="allgather",
                moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                expert_model_parallel_size=shape.get("ep", 1), expert_tensor_parallel_size=None)


def megatron_args(shape: dict, tp: int, pp: int, padded_vocab: int, ckpt_format: str,
                  vpp: int = 1) -> argparse.Namespace:
    """The args Namespace Megatron-LM would have saved for this model (the model-defining fields,
    and a few others of the kinds a real run's args hold: an enum, a dtype, None, lists)."""
    from megatron.core.transformer.enums import AttnBackend

    gqa = shape.get("num_query_groups") not in (None, shape["num_attention_heads"])
    return argparse.Namespace(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"], ffn_hidden_size=shape["ffn_hidden_size"],
        num_attention_heads=shape["num_attention_heads"], group_query_attention=gqa,
        num_query_groups=shape.get("num_query_groups") if gqa else 1, kv_channels=shape.get("kv_channels"),
        max_position_embeddings=shape["max_position_embeddings"], seq_length=shape["max_position_embeddings"],
        position_embedding_type=shape["position_embedding_type"], rotary_base=shape.get("rotary_base", 10000),
        rotary_percent=shape.get("rotary_percent", 1.0), rotary_interleaved=False,
        use_rope_scaling=shape.get("use_rope_scaling", False),
        rope_scaling_factor=shape.get("rope_scaling_factor", 8.0),
        normalization=shape["normalization"], norm_epsilon=shape["norm_epsilon"], swiglu=shape["swiglu"],
        openai_gelu=False, bias_gelu_fusion=shape.get("bias_gelu_fusion", False),
        add_bias_linear=shape["add_bias_linear"], add_qkv_bias=shape.get("add_qkv_bias", False),
        qk_layernorm=shape.get("qk_layernorm", False), apply_layernorm_1p=shape.get("apply_layernorm_1p", False),
        untie_embeddings_and_output_weights=shape["untie_embeddings_and_output_weights"],
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        make_vocab_size_divisible_by=shape.get("make_vocab_size_divisible_by", 128),
        padded_vocab_size=padded_vocab, vocab_size=None, tokenizer_type="GPT2BPETokenizer",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        decoder_first_pipeline_num_layers=shape.get("first_stage_layers"),
        decoder_last_pipeline_num_layers=shape.get("last_stage_layers"),
        **{k: shape.get(k) for k in MOE_KEYS}, moe_grouped_gemm=False, expert_model_parallel_size=shape.get("ep", 1),
        multi_latent_attention=bool(shape.get("multi_latent_attention")), rope_type=shape.get("rope_type"),
        **{k: shape[k] for k in MLA_KEYS if k in shape}, use_legacy_models=False, transformer_impl="local", ckpt_format=ckpt_format,
        attention_backend=AttnBackend.auto, params_dtype=torch.float32, data_path=["a", "b"], iteration=5,
        **_newer_args())


def _newer_args() -> dict:
    """Args of the kinds a newer Megatron-LM saves (0.19: its inference CUDA-graph scope and graph
    modules are enums of classes 0.16 does not have)."""
    from megatron.core.transformer import enums

    out = {}
    if hasattr(enums, "InferenceCudaGraphScope"):
        out["inference_cuda_graph_scope"] = next(iter(enums.InferenceCudaGraphScope))
    if hasattr(enums, "CudaGraphModule"):
        out["cuda_graph_modules"] = [next(iter(enums.CudaGraphModule))]
    return out


def _seed(name: str, *extra) -> int:
    return zlib.crc32(("/".join([name, *map(str, extra)])).encode())


@torch.no_grad()
def randomize(model, tp_rank: int, pp_rank: int, tied: bool, post_process: bool, zero_centered: bool = False) -> None:
    """Every parameter random (norm weights and biases too), the same on all TP ranks where
    Megatron-Core keeps a tensor whole, and a tied output layer equal to the embedding. Norm weights
    lie around 1, or around 0 where they are `zero_centered` (applied as 1 + w)."""
    for name, p in model.named_parameters():
        key = name
        if tied and post_process and name == "output_layer.weight":
            key, stage = "embedding.word_embeddings.weight", 0
        else:
            stage = pp_rank
        split = getattr(p, "tensor_model_parallel", False)
        g = torch.Generator().manual_seed(_seed(key, stage, tp_rank if split else "whole"))
        scale = 0.3 if p.dim() == 1 else 0.15
        centre = 1.0 if "norm" in name and "weight" in name and not zero_centered else 0.0
        p.copy_(torch.randn(p.shape, generator=g) * scale + centre)
    for name, b in model.named_buffers():  # the MoE router's expert bias (aux-loss-free balancing)
        if name.endswith("expert_bias"):
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(_seed(name, pp_rank))) * 0.3)


def apex_layer_norm() -> None:
    """Megatron-Core's norms as with apex installed (in this rank's process only): its
    FusedLayerNorm (the one local-spec LayerNorm that has --apply-layernorm-1p: weight applied as
    1 + w; torch's LayerNorm refuses it) for every LayerNorm of the spec and the final norm, apex's
    kernel standing in as its math, F.layer_norm."""
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.models import backends
    from megatron.core.transformer import transformer_block

    class FusedLayerNormAffineFunction:  # apex.normalization.fused_layer_norm's, as plain PyTorch
        @staticmethod
        def forward(ctx, input, weight, bias, normalized_shape, eps):
            return F.layer_norm(input, normalized_shape, weight, bias, eps)

        @staticmethod
        def apply(input, weight, bias, normalized_shape, eps):
            return F.layer_norm(input, normalized_shape, weight, bias, eps)

    fused_layer_norm.FusedLayerNormAffineFunction = FusedLayerNormAffineFunction
    fused_layer_norm.HAVE_FUSED_LAYER_NORM = True
    backends.LNImpl = transformer_block.LayerNormImpl = fused_layer_norm.FusedLayerNorm


def build_gpt(shape: dict, tp: int, pp: int, padded_vocab: int, vpp: int = 1, parallel_output: bool = False):
    """This rank's Megatron-Core GPTModel chunks (local spec; one per virtual pipeline stage),
    random weights; parallel_state set up. `parallel_output`: the logits stay split over the TP ranks
    (training: the loss is the vocabulary-parallel cross entropy); else gathered (forward_logits).
    The shape's model flags reach Megatron-Core as Megatron-LM passes them: qk_layernorm and apply_layernorm_1p (layernorm_zero_centered_gamma)
    through the config and the spec, rotary_percent, rotary_base, use_rope_scaling and
    rope_scaling_factor as GPTModel's arguments."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             expert_model_parallel_size=shape.get("ep", 1))
    pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    tied = not shape["untie_embeddings_and_output_weights"]
    one_p = shape.get("apply_layernorm_1p", False)
    if one_p:
        apex_layer_norm()
    config = transformer_config(shape, tp, pp, vpp)
    if shape.get("multi_latent_attention"):
        spec = mla_local_spec(shape)
    elif shape.get("num_experts"):  # dense and MoE layers as --moe-layer-freq says
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=shape["normalization"],
                                          qk_l2_norm=False)
    else:
        spec = get_gpt_layer_local_spec(normalization=shape["normalization"], qk_layernorm=shape.get("qk_layernorm", False))
    chunks = []
    for v in range(vpp):
        first, last = pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == vpp - 1
        model = GPTModel(config, spec, vocab_size=padded_vocab, max_sequence_length=shape["max_position_embeddings"],
                         pre_process=first, post_process=last, parallel_output=parallel_output,
                         share_embeddings_and_output_weights=tied,
                         position_embedding_type=shape["position_embedding_type"],
                         rotary_percent=shape.get("rotary_percent", 1.0), rotary_base=shape.get("rotary_base", 10000),
                         rope_scaling=shape.get("use_rope_scaling", False),
                         rope_scaling_factor=shape.get("rope_scaling_factor", 8.0), vp_stage=v if vpp > 1 else None)
        randomize(model, tp_rank, pp_rank * vpp + v, tied, last, zero_centered=one_p)
        chunks.append(model.eval())
    return chunks


class _SDPA:
    """Megatron-Core's core attention for MLA as its local DotProductAttention cannot be (it takes no
    separate key / value head sizes; 0.16 wants Transformer Engine's there): causal softmax attention
    with MLA's softmax scale, [s, b, heads, d] in, [s, b, heads * dv] out."""

    def __new__(cls, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                softmax_scale=None, **kwargs):
        from megatron.core.transformer.module import MegatronModule

        class SDPA(MegatronModule):
            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None, **kw):
                q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale)
                return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)

        return SDPA(config)


def mla_local_spec(shape: dict):
    """Megatron-Core's local layer spec with multi-latent attention, runnable without Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention as mla

    for name in ("TELinear", "TEColumnParallelLinear"):  # (stand-ins: MagicMocks without TE)
        if not isinstance(getattr(mla, name, None), type):
            setattr(mla, name, type(name, (), {}))
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization=shape["normalization"],
                                    qk_layernorm=True)
    spec.submodules.self_attention.submodules.core_attention = _SDPA
    return spec


@torch.no_grad()
def forward_logits(chunks, tokens: torch.Tensor, pp: int):
    """Megatron-Core's own forward through the whole pipeline (chunk v of every stage in turn, then
    chunk v + 1): the full (padded-vocabulary) logits [b, s, V] on the last stage, None elsewhere;
    the hidden states are sent from rank to rank."""
    from megatron.core import parallel_state

    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    stage = parallel_state.get_pipeline_model_parallel_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    out = None
    for v, model in enumerate(chunks):
        first, last = stage == 0 and v == 0, stage == pp - 1 and v == len(chunks) - 1
        if not first:
            h = torch.empty(s, b, model.config.hidden_size)
            dist.recv(h, src=dist.get_global_rank(group, (stage - 1) % pp))
            model.set_input_tensor(h)
        out = model(tokens if first else None, position_ids, causal)
        if not last:
            dist.send(out.contiguous(), dst=dist.get_global_rank(group, (stage + 1) % pp))
            out = None
    return None if out is None else out.float()


# --- checkpoints as Megatron-LM writes them ----------------------------------------------------------
def _tracker(root: str, iteration: int) -> None:
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _model_states(chunks, state_dict) -> dict:
    """Megatron-LM's `model` entry (one chunk), or `model0`, `model1`, ... (virtual pipeline stages)."""
    if len(chunks) == 1:
        return {"model": state_dict(chunks[0])}
    return {f"model{v}": state_dict(c) for v, c in enumerate(chunks)}


def save_torch_dist(chunks, args: argparse.Namespace, root: str, iteration: int) -> None:
    """Megatron-LM's torch_dist save: {model: sharded state dict, args, checkpoint_version,
    iteration} through dist_checkpointing.save into root/iter_XXXXXXX, then the tracker file."""
    from megatron.core import dist_checkpointing

    path = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {**_model_states(chunks, lambda c: c.sharded_state_dict(metadata={"singleton_local_shards": False})),
             "args": args, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, path)
    if dist.get_rank() == 0:
        _tracker(root, iteration)
    dist.barrier()


def save_legacy(chunks, args: argparse.Namespace, root: str, iteration: int, tp_rank: int, pp_rank: int,
                pp: int, ep_rank: int = 0, ep: int = 1) -> None:
    """Megatron-LM's legacy save: each rank torch.saves {args, checkpoint_version, iteration,
    model (its state dict), rng_state, ...} to root/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
    (data-parallel replicas write the same file)."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    path = os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
    from megatron.core.safe_globals import SAFE_GLOBALS
    if torch._C.Generator in SAFE_GLOBALS:  # (0.19 declares generator objects safe: one in the file)
        rng[0]["generator"] = torch.Generator().manual_seed(iteration)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                **_model_states(chunks, lambda c: c.state_dict()), "rng_state": rng, "num_floating_point_operations_so_far": 0,
                "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": iteration}}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        _tracker(root, iteration)
