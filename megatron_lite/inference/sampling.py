"""Choosing the next token from the logits: greedy, or sampling with temperature, top-k, top-p.

Tensor parallelism: the model gathers its vocab-parallel logits (GPTModel.forward without labels),
so every TP rank holds the same full logits, bit for bit (each vocabulary slice is computed by
one rank and copied to the others). Each prompt samples from a random stream of its own, seeded
from the seed and the prompt's index in the command: prompts and rows draw independent numbers
(two identical prompts get two samples), a seed reproduces them whatever the batching, and every
rank draws the same numbers, so every rank picks the same token without any further communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False  # the most likely token; the other fields are then ignored
    temperature: float = 1.0
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the fewest most likely tokens whose probability reaches p (1: all)
    seed: int = 1234

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ConfigError(f"--temperature ({self.temperature}) must be positive (or use --greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k ({self.top_k}) must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p ({self.top_p}) must lie in (0, 1] (1 keeps every token)")

    def generators(self, device, first: int, count: int) -> Optional[List[torch.Generator]]:
        """The random streams of prompts first .. first + count - 1 of a command (None when greedy):
        prompt i's is seeded with (seed, i) mixed into 64 bits (golden-ratio increments)."""
        if self.greedy:
            return None
        return [torch.Generator(device=device).manual_seed((self.seed + (i + 1) * 0x9E3779B97F4A7C15) % 2**64)
                for i in range(first, first + count)]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [b, vocab] (float32) scaled by the temperature, -inf outside top-k and top-p."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generators: Optional[Sequence[torch.Generator]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(next tokens [b], their log-probabilities [b]) from logits [b, vocab], row r drawn from
    generators[r]. The log-probability is the model's own (log-softmax of the raw logits),
    whatever the sampling settings."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(logits, params).softmax(dim=-1)
        tokens = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
