"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Any parameters SamplingParams accepts give a token: non-finite logits (a penalty that overflows
float32, a model that produced inf or nan) are made finite or dropped, a temperature too small to
divide by is greedy, top-p keeps at least the most likely token, and a distribution left with no
finite mass falls back to the most likely token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import MiniRunError

GREEDY_BELOW = 1e-5   # temperatures below it are greedy (vLLM's sampling epsilon): logits / t would overflow


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
            logits = finite(logits)     # (a penalty far from 1 overflows: x / 1e-30 = inf, -inf * 1e-30 = nan)
        if p.temperature < GREEDY_BELOW:
            return int(logits.argmax())
        logits = finite(logits)
        logits = ((logits - logits.max()) / p.temperature).cpu()    # <= 0: exp cannot overflow
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p
            keep[0] = True    # the most likely token, even when top_p rounds to 0 in float32
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        total = float(probs.sum())
        if not 0.0 < total < float("inf"):   # (nothing finite left to sample from)
            return int(logits.argmax())
        return int(torch.multinomial(probs, 1, generator=self.gen))


def finite(logits: torch.Tensor) -> torch.Tensor:
    """logits [V] float32 with nan as -inf (never picked) and +-inf clamped to float32's range, so that
    subtracting the maximum leaves no nan."""
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf")).clamp(-big, big)
