"""Core attention: softmax(q k^T / sqrt(d)) v over heads already split by TP, as a module chosen
at build time (`--attention-backend`).

Interface, shared by every backend and by the context-parallel wrapper:

    forward(q, k, v, packed=None, q_offset=0, k_offset=0, return_lse=False)
        q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] (hq a multiple of hkv: grouped-query
        attention; the value head size dv may differ from d) -> out [b, sq, hq, dv]
        (and lse [b, hq, sq] float32 when return_lse)

Causality is by absolute position: query i sits at q_offset + i, key j at k_offset + j, and a key
is visible iff it is not later than the query (and, with a sliding window w, less than w before
it). So decoding with a KV cache (q_offset = tokens already cached) and any other alignment are
exact whatever a kernel's own convention is (SDPA's is_causal aligns top-left, flash-attn's
bottom-right). `packed` (--reset-attention-mask) says which document each key belongs to; tokens
attend only within their document. There is no dense [b, s, s] mask in the interface.

Backends:
  sdpa  torch.nn.functional.scaled_dot_product_attention (flash / efficient / cuDNN / math kernels
        as PyTorch picks them; is_causal without a mask on the fast path). The default.
  local the pure-PyTorch block attention (kernels/block_attention.py): the reference, returns the LSE.
  flash flash-attn on CUDA in bf16/fp16 when installed (plain causal self-attention, one head
        size), else sdpa.
Each returns the LSE through the local path when asked (context parallelism needs it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.block_attention import attention_block, fused_kernel, visibility_mask
from ..parallel.context_parallel import cp_attention, ulysses_attention, zigzag_indices

BACKENDS = ("auto", "sdpa", "local", "flash", "fused", "unfused")  # Megatron's names map onto ours


@dataclass
class PackedSeq:
    """Packed documents: document_ids [b, sk] of the keys; the queries are the keys at
    q_offset - k_offset onwards (all of them for self-attention)."""
    document_ids: torch.Tensor

    def for_queries(self, sq: int, q_offset: int, k_offset: int) -> torch.Tensor:
        start = q_offset - k_offset
        return self.document_ids[:, start:start + sq]


@functools.cache
def flash_attn_func():
    """flash_attn.flash_attn_func if importable (CUDA only), else None. Imported once, lazily."""
    try:
        from flash_attn import flash_attn_func as fn  # type: ignore
    except Exception:
        return None
    return fn


class CoreAttention(nn.Module):
    """The local path: pure-PyTorch block attention (always available, returns the LSE)."""
    name = "local"

    def __init__(self, cfg, ctx=None, layer_number: int = 0):
        super().__init__()
        self.dropout = cfg.attention_dropout
        self.window = cfg.layer_window(layer_number)

    def _indices(self, sq, sk, q_offset, k_offset, device):
        return (torch.arange(q_offset, q_offset + sq, device=device),
                torch.arange(k_offset, k_offset + sk, device=device))

    def _local(self, q, k, v, packed, q_offset, k_offset, dropout_p):
        q_index, k_index = self._indices(q.shape[1], k.shape[1], q_offset, k_offset, q.device)
        docs = (None, None) if packed is None else (packed.for_queries(q.shape[1], q_offset, k_offset),
                                                    packed.document_ids)
        return attention_block(q, k, v, q_index=q_index, k_index=k_index, q_doc=docs[0], k_doc=docs[1],
                               window=self.window, dropout_p=dropout_p)

    def forward(self, q, k, v, packed: Optional[PackedSeq] = None, q_offset: int = 0, k_offset: int = 0,
                return_lse: bool = False):
        dropout_p = self.dropout if self.training else 0.0
        out, lse = self._local(q, k, v, packed, q_offset, k_offset, dropout_p)
        return (out, lse) if return_lse else out


class SDPAAttention(CoreAttention):
    name = "sdpa"

    def forward(self, q, k, v, packed: Optional[PackedSeq] = None, q_offset: int = 0, k_offset: int = 0,
                return_lse: bool = False):
        dropout_p = self.dropout if self.training else 0.0
        if return_lse:
            return self._local(q, k, v, packed, q_offset, k_offset, dropout_p)
        sq, sk = q.shape[1], k.shape[1]
        # KV-cache decoding: one query after every key sees them all; no mask keeps the fast kernels.
        decoding = sq == 1 and q_offset - k_offset == sk - 1 and packed is None and self.window is None
        mask = None
        if not decoding and (packed is not None or self.window is not None or q_offset - k_offset != sk - sq
                             or sq != sk):
            q_index, k_index = self._indices(sq, sk, q_offset, k_offset, q.device)
            docs = (None, None) if packed is None else (packed.for_queries(sq, q_offset, k_offset),
                                                        packed.document_ids)
            mask = visibility_mask(q_index, k_index, docs[0], docs[1], window=self.window).unsqueeze(1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        gqa = q.shape[1] != k.shape[1]
        if mask is None:  # plain causal self-attention: the fast path
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=not decoding, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
        return out.transpose(1, 2)


class FlashAttention(SDPAAttention):
    name = "flash"

    def forward(self, q, k, v, packed: Optional[PackedSeq] = None, q_offset: int = 0, k_offset: int = 0,
                return_lse: bool = False):
        fn = flash_attn_func()
        plain = (packed is None and not return_lse and q_offset - k_offset == k.shape[1] - q.shape[1]
                 and v.shape[-1] == q.shape[-1])
        if fn is not None and plain and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            window = (-1, -1) if self.window is None else (self.window - 1, 0)
            return fn(q, k, v, dropout_p=self.dropout if self.training else 0.0, causal=True, window_size=window)
        return super().forward(q, k, v, packed, q_offset, k_offset, return_lse)


def describe_attention(backend: str, device, dtype, cp: int = 1, cp_comm_type=("p2p",)) -> str:
    """What the core attention will run, for the start-up line (chosen at build time)."""
    cls = core_attention_class(backend)
    name = cls.name
    if cls is FlashAttention and not (flash_attn_func() is not None and torch.device(device).type == "cuda"
                                      and dtype in (torch.bfloat16, torch.float16)):
        name = "sdpa (flash-attn needs CUDA, bf16/fp16 and the flash-attn package)"
    if cp > 1:
        types = list(dict.fromkeys(cp_comm_type))
        blocks = [t for t in types if t != "a2a"]
        name = (f"context parallel {'/'.join(types)} over {cp} ranks"
                + (f"; Ulysses core {name}" if "a2a" in types else "")
                + ("; ring / all-gather blocks: " + _block_kernel(device, dtype) if blocks else ""))
    return name


def _block_kernel(device, dtype) -> str:
    """What block attention runs for CP blocks on this device (block_attention's fused switches)."""
    kind = fused_kernel(device, dtype)
    if kind is None:
        return "local LSE kernel (materialises each block's scores)"
    return f"{kind} flash LSE kernel where the blocks allow (no window / documents / dropout), else local"


def core_attention_class(backend: str):
    """The core-attention constructor of `--attention-backend` (Megatron's names accepted:
    fused -> sdpa, unfused -> local)."""
    return {"auto": SDPAAttention, "sdpa": SDPAAttention, "fused": SDPAAttention, "local": CoreAttention,
            "unfused": CoreAttention, "flash": FlashAttention}[backend]


class ContextParallelAttention(nn.Module):
    """The core attention of a context-parallel layer: q, k, v are this rank's zigzag chunks of
    the sequence (parallel/context_parallel.py), and the layer's --cp-comm-type decides how the
    other ranks' keys are reached. Same interface as the backends (offsets must be 0: training).
    Ulysses (a2a) runs the configured backend over the whole gathered sequence, put back in
    order; the ring and all-gather types compute their blocks with the LSE-returning kernel."""
    name = "context_parallel"

    def __init__(self, cfg, ctx, layer_number: int):
        super().__init__()
        types = ctx.cp_comm_type if isinstance(ctx.cp_comm_type, (list, tuple)) else [ctx.cp_comm_type]
        # one per layer; multi-token prediction's layers, numbered after the decoder's, take the last one's
        self.comm_type = types[min(layer_number, len(types) - 1)]
        self.dims, self.window = ctx.dims, cfg.layer_window(layer_number)
        self.inner = core_attention_class(cfg.attention_backend)(cfg, ctx, layer_number)
        self.dropout = self.inner.dropout

    def _ordered_core(self, q, k, v, index, docs):
        """The inner backend over the gathered sequence in its natural order (its fast causal path)."""
        order = torch.argsort(index)
        back = torch.argsort(order)
        packed = None if docs is None else PackedSeq(docs[:, order])
        out = self.inner(q[:, order], k[:, order], v[:, order], packed)
        return out[:, back]

    def forward(self, q, k, v, packed: Optional[PackedSeq] = None, q_offset: int = 0, k_offset: int = 0,
                return_lse: bool = False):
        assert q_offset == 0 and k_offset == 0 and not return_lse, "context-parallel attention is for training"
        dims = self.dims
        index = zigzag_indices(q.shape[1] * dims.cp, dims.cp, dims.cp_rank, device=q.device)
        docs = None if packed is None else packed.document_ids
        if self.comm_type == "a2a":
            return ulysses_attention(q, k, v, group=dims.cp_group, q_index=index, q_doc=docs, window=self.window,
                                     core=self._ordered_core, comm=dims.comm)
        groups = (dict(a2a_group=dims.group("cp_a2a"), p2p_group=dims.group("cp_p2p"))
                  if self.comm_type == "a2a+p2p" else dict(cp_group=dims.cp_group))
        return cp_attention(q, k, v, comm_type=self.comm_type, q_index=index, q_doc=docs, window=self.window,
                            comm=dims.comm, **groups)
