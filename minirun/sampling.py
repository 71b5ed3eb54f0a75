"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import MiniRunError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    min_p: float = 0.0            # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise MiniRunError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise MiniRunError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise MiniRunError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise MiniRunError("top_k must be >= 0 and repetition_penalty > 0")


class Sampler:
    """Turns the last position's logits [V] into a token id; owns its random generator."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """logits [V] float32 (any device); history [n] int64 ids seen so far (for the penalty)."""
        p = self.p
        logits = logits.float()
        if p.repetition_penalty != 1.0 and history is not None and history.numel():
            ids = history.to(logits.device).unique()
            picked = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(logits.argmax())
        logits = (logits / p.temperature).cpu()
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p   # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))
