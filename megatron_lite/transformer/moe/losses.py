"""Auxiliary router losses and how their gradients reach backward.

The losses follow Megatron-Core's conventions, computed as *partials*: the tokens of one
micro-batch on one data-parallel replica are spread over the TP x CP ranks (each routes its own
sequence shard), and each rank returns its share, so that the sum over the TP x CP group is the
loss of the whole micro-batch. The routed-token counts a loss needs are summed over that group
first (no gradient flows through counts, as in Megatron), so each rank's partial has exactly the
gradient of the whole loss with respect to its own tokens.

  load balancing (aux_loss):  E / (k T^2) * sum_e P_e * c_e
      P_e = sum over the micro-batch's T tokens of the router score of expert e,
      c_e = tokens whose top-k (of the scores, before expert bias or capacity) includes e
      (Megatron's 1/k; Hugging Face's load_balancing_loss_func omits it and is k times this)
  seq_aux_loss: the same per sequence (S tokens each), averaged over the b sequences
  z-loss:       mean over tokens of logsumexp(logits)^2

No pipeline schedule knows about these losses: `attach_aux_loss` ties each one to an activation
of the forward pass, and in backward adds `weight * d(loss)`, with the auxiliary-loss weight of the
step's LossNormalization (transformer/loss_normalization.py) read when the forward ran (so 1F1B,
interleaved schedules and activation recomputation, whose forward runs again during backward, all
use the micro-batch's own value).
"""
from __future__ import annotations

import torch

from ...parallel.comm import Communicator
from ..loss_normalization import LossNormalizationSlot, attach_loss


def attach_aux_loss(activation: torch.Tensor, loss: torch.Tensor, weights: LossNormalizationSlot) -> torch.Tensor:
    """`activation`, unchanged, carrying `loss` into backward with the current step's aux weight."""
    return attach_loss(activation, loss, weights.current.aux_weight)


def recording() -> bool:
    """Whether this forward should count tokens and log losses: gradients are on (not evaluation)
    and no backward pass is running (not the recomputation of a checkpointed forward)."""
    # The id of the running backward graph task; -1 outside backward (torch >= 1.13).
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def _global_counts(counts: torch.Tensor, num_tokens: int, group, comm: Communicator) -> tuple:
    """(counts, tokens) summed over the sequence-partition group, in fp32, without gradient."""
    buf = torch.cat([counts.detach().float().reshape(-1),
                     torch.tensor([float(num_tokens)], device=counts.device)])
    comm.all_reduce(buf, group)
    return buf[:-1].reshape(counts.shape), buf[-1]


def load_balancing_loss(scores: torch.Tensor, topk_map: torch.Tensor, topk: int, group,
                        comm: Communicator) -> torch.Tensor:
    """This rank's partial of E / (k T^2) * sum_e P_e * c_e (coefficient not applied).
    scores [T_local, E] (softmax or normalised sigmoid of the logits), topk_map [T_local, E] bool."""
    num_experts = scores.shape[1]
    counts, total = _global_counts(topk_map.sum(0), scores.shape[0], group, comm)
    return (scores.float().sum(0) * counts).sum() * (num_experts / (topk * total * total))


def sequence_load_balancing_loss(scores: torch.Tensor, topk_map: torch.Tensor, topk: int, seq_len: int,
                                 batch: int, group, comm: Communicator) -> torch.Tensor:
    """This rank's partial of the per-sequence load-balancing loss, averaged over the `batch`
    sequences. Tokens are laid out [seq_len (this rank's shard), batch] as in the [s, b, h] input."""
    num_experts = scores.shape[1]
    per_seq = scores.float().reshape(seq_len, batch, num_experts).sum(0)  # [b, E]
    counts, total = _global_counts(topk_map.reshape(seq_len, batch, num_experts).sum(0), seq_len, group, comm)
    return (per_seq * counts).sum() * (num_experts / (topk * total * total * batch))


def z_loss(logits: torch.Tensor, group, comm: Communicator) -> torch.Tensor:
    """This rank's partial of mean over tokens of logsumexp(logits)^2 (coefficient not applied)."""
    total = torch.tensor(float(logits.shape[0]), device=logits.device)
    comm.all_reduce(total, group)
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / total
