"""Far positions: the HCA cache's answer to contexts longer than the model was trained on.

A model trained to N tokens (SmolLM2: 8K) has never seen a query-key distance past N; at 12K
tokens SmolLM2 loses a pass key with dense attention (docs/QUALITY.md, "Beyond the trained
context"). With far positions on, the exact ring keeps true distances (at most W + a chunk), and
every older token, sinks and store, is attended as if it sat at one distance D from the query
(InfLLM's memory units sit at D = W; D = 256 lost the pass key where 1024 found it): keys leave
the ring *without* their rotation (pre-RoPE: R(-j) k for the key of position j), and a query at
position p scores them rotated by R(D - p), so that <R(D - p) q_p, R(-j) k_j> = <R(D) q_pre, k_pre>
for every old j. One rotation per query and layer: the codebook LUT, the selection and the GPU
kernels take the rotated query unchanged.

Rotation convention: that of ops.apply_rope (HF Llama's half split).
"""
from __future__ import annotations

import torch

from ..ops import rope_cos_sin

SETTINGS = ("auto", "on", "off")


def far_positions_on(setting: str, trained_ctx: int | None, ctx: int) -> bool:
    """auto: on exactly when the context is longer than the model's trained context
    (config.json's max_position_embeddings; unknown -> off)."""
    if setting == "auto":
        return trained_ctx is not None and ctx > trained_ctx
    return setting == "on"


def default_far_distance(window: int, trained_ctx: int | None) -> int:
    """D when not given: 1024 (or half the trained context when that is shorter), never below the
    window. On SmolLM2 at ~12K tokens of Botchan the pass key was found with D = 1024 and 2048 and
    lost with D = 256 (docs/QUALITY.md, "Beyond the trained context")."""
    return max(window, min(1024, trained_ctx // 2) if trained_ctx else 1024)


def turn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., hd] float32 turned by angles whose cos / sin c, s broadcast to [..., hd/2]
    (HF Llama's half split: [x1 c - x2 s, x2 c + x1 s])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """x [..., m, hd] rotated by sign * position, positions int [m] (one per row of the
    second-to-last axis) -> same shape and dtype (computed in float32; angles in float64)."""
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]     # [m, hd/2]
    c, s = ang.cos().float().to(x.device), (sign * ang.sin()).float().to(x.device)
    return turn(x.float(), c, s).to(x.dtype)


def unrotate_keys(K: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """K [..., m, hd] (post-RoPE, row i at positions[i]) -> the keys without their rotation."""
    return rotate(K, positions, inv_freq, sign=-1)


def far_queries(qs: torch.Tensor, pos0: int, distance: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """qs [T, Hq, hd] (post-RoPE, positions pos0..pos0+T-1) -> R(distance - p) q per query: scores
    against unrotated keys then read every old key at `distance` from the query."""
    cos, sin = rope_cos_sin(inv_freq, pos0 - distance, qs.shape[0], torch.float32, qs.device)   # (p - D) f
    return turn(qs.float(), cos[:, None, :], -sin[:, None, :])                                   # by -(p - D)
