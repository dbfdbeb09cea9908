"""Generation: a batch of prompts is prefilled in one forward, then decoded one token per step,
each step feeding only the new tokens and attending over the KV cache.

Prompts of different lengths are LEFT-padded to the longest, so that every sequence's next token
sits at the same cache index and one forward serves the whole batch at every step. Padding is
never seen: each sequence's positions (RoPE or learned) count from its first real token, and the
pad slots are their own "document" (PackedSeq ids 0 against 1 for the real tokens), so the core
attention lets no real token attend a pad; pads attend only pads, so no row is empty. A batch of
equal lengths needs no mask at all and keeps the core attention's fast paths.

Tensor parallelism: every TP rank runs the same loop on the same prompts; see sampling.py for why
they pick the same tokens. Pipeline and context parallelism are not supported for generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..transformer.core_attention import PackedSeq
from ..transformer.spec import BuildContext
from .kv_cache import KVCache
from .sampling import SamplingParams, sample


@dataclass
class Completion:
    """What one prompt produced: token ids (ending with the EOD id when it stopped on one) and
    the model's log-probability of each."""
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)


class PromptBatch:
    """Prompts left-padded into tokens [b, longest], with the positions and document ids of every
    slot the generation will fill ([b, longest + max_new_tokens])."""

    def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int = 0, device=None):
        lengths = torch.tensor([len(p) for p in prompts])
        longest = int(lengths.max())
        total = longest + max_new_tokens
        pads = (longest - lengths).unsqueeze(1)  # [b, 1]
        index = torch.arange(total).unsqueeze(0)
        self.tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            self.tokens[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        self.tokens = self.tokens.to(device)
        self.positions = (index - pads).clamp_min(0).to(device)
        self.document_ids = (index >= pads).long().to(device) if bool((pads > 0).any()) else None
        self.total = total


class DecodingSession:
    """One batch of prompts through one model chunk holding the whole model (tp ranks only):
    `prefill()`, then `step(tokens)` once per generated token; each returns the next-token logits
    [b, vocab] (float32, the tokenizer's full vocabulary on every TP rank). Puts the model in eval mode."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int = 0):
        check_generation_model(model)
        check_prompts(model.cfg, prompts, max_new_tokens)
        self.model = model.eval()
        device = next(model.parameters()).device
        self.batch = PromptBatch(prompts, max_new_tokens, pad_id, device)
        self.cache = KVCache.for_model(model, len(prompts), self.batch.total)

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start, end = self.cache.offset, self.cache.offset + tokens.shape[1]
        docs = self.batch.document_ids
        packed = None if docs is None else PackedSeq(docs[:, :end])  # the keys: every slot cached so far
        logits = self.model(tokens, self.batch.positions[:, start:end], packed=packed, kv_cache=self.cache)
        self.cache.advance(tokens.shape[1])
        return logits[:, -1, :self.model.cfg.tokenizer_vocab]  # a Megatron model's padded rows are no tokens

    def prefill(self) -> torch.Tensor:
        return self._forward(self.batch.tokens)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b]: the token each sequence takes next."""
        return self._forward(tokens.unsqueeze(1))


def inference_context(cfg, dims, params_dtype=torch.float32, device=None) -> BuildContext:
    """How to build a model for generation: no sequence parallelism, no recomputation."""
    return BuildContext(dims, params_dtype=params_dtype, device=device)


def check_generation_layout(cfg, tp: int, pp: int = 1, cp: int = 1) -> None:
    """What generation supports: tensor parallelism only (an MoE model at TP 1: its layers split
    the tokens over TP ranks, and a decoding step has one token per sequence)."""
    if pp > 1:
        raise ConfigError(f"--pipeline-model-parallel-size {pp}: generation runs tensor parallelism only; use 1")
    if cp > 1:
        raise ConfigError(f"--context-parallel-size {cp}: generation runs tensor parallelism only; use 1")
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.num_experts and tp > 1:
        raise ConfigError(f"--tensor-model-parallel-size {tp}: generation from an MoE model runs at TP 1 for now")


def check_generation_model(model: nn.Module) -> None:
    dims = model.dims
    check_generation_layout(model.cfg, dims.tp, dims.pp, dims.cp)
    if not (model.pre_process and model.post_process):
        raise ConfigError("generation needs the whole model in one chunk (embedding to output layer)")
    if model.sequence_parallel:
        raise ConfigError("generation needs a model built without --sequence-parallel")


def check_prompts(cfg, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ConfigError("no prompt to generate from")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens ({max_new_tokens}) must be >= 1")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i} has no tokens")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt {i}: token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
    needed = max(len(p) for p in prompts) + max_new_tokens - 1  # the last token is never fed back
    if cfg.position_embedding_type == "learned_absolute" and needed > cfg.max_position_embeddings:
        raise ConfigError(f"the longest prompt plus --max-new-tokens need {needed} positions, but the model has "
                          f"{cfg.max_position_embeddings} (max_position_embeddings); shorten them")


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(greedy=True), eod: Optional[int] = None,
             on_token: Optional[Callable[[int, int], None]] = None, first_index: int = 0) -> List[Completion]:
    """Up to `max_new_tokens` tokens after each prompt (token-id lists); a sequence stops after
    producing `eod` (when given). `on_token(prompt index, token id)` is called for each token as
    it is produced (streaming). An empty prompt starts from `eod`: what precedes every document
    in training. `first_index`: the index of prompts[0] among the command's prompts, whose
    sampling streams these are (SamplingParams.generators)."""
    if eod is not None:
        prompts = [list(p) if len(p) else [eod] for p in prompts]
    session = DecodingSession(model, prompts, max_new_tokens, pad_id=eod if eod is not None else 0)
    generators = sampling.generators(session.batch.tokens.device, first_index, len(prompts))
    completions = [Completion() for _ in prompts]
    running = [True] * len(prompts)
    logits = session.prefill()
    for step in range(max_new_tokens):
        tokens, logprobs = sample(logits, sampling, generators)
        for i, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            if not running[i]:
                continue  # a finished sequence is still computed with the batch, and ignored
            completions[i].tokens.append(token)
            completions[i].logprobs.append(logprob)
            running[i] = token != eod
            if on_token is not None:
                on_token(i, token)
        if not any(running) or step == max_new_tokens - 1:
            break
        logits = session.step(tokens)
    return completions
