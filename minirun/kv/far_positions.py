"""Far positions: the HCA cache's answer to contexts longer than the model was trained on.

A model trained to N tokens (SmolLM2: 8K) has never seen a query-key distance past N; at 12K
tokens SmolLM2 loses a pass key with dense attention (docs/QUALITY.md, "Past the trained
context"). With far positions on, the exact ring keeps true distances (at most W + a chunk), and
every older token, sinks and store, is attended as if it sat at one distance D from the query
(InfLLM's memory units sit at D = W; D = 256 lost the pass key where 1024 found it): keys leave
the ring *without* their rotation (pre-RoPE: R(-j) k for the key of position j), and a query at
position p scores them rotated by R(D - p), so that <R(D - p) q_p, R(-j) k_j> = <R(D) q_pre, k_pre>
for every old j. One rotation per query and layer: the codebook LUT, the selection and the GPU
kernels take the rotated query unchanged.

Grouped (`far_positions=grouped`; SelfExtend, Jin et al. 2024, "LLM Maybe LongLM"): instead of
one distance, an old key j keeps its order, G times compressed: it is held at position j // G
(R(j // G - j) k_j instead of R(-j) k_j) and read by a query at p turned to p // G + W - W // G, so
the distance is W - W // G + p // G - j // G: W at the ring's edge, at most W + ctx / G past it,
inside the trained context N with G = ceil(ctx / (N - W)) (`far_group`). Still one rotation per
query and layer. docs/QUALITY.md, "Past the trained context": a novel's continuation read better than
with one distance at 16K and 24K.

FarFrame is the HCA cache's position scheme when far positions are on (kv/positions.py: the
interface, and PlainPositions, the scheme when they are off); position_scheme picks one.

Rotation convention: that of ops.apply_rope (HF Llama's half split).
"""
from __future__ import annotations

import math

import numpy as np
import torch

import kernels_cpu as kc

from ..model.ops import rope_inv_freq
from .positions import PlainPositions


def far_positions_on(setting: str, trained_ctx: int | None, ctx: int) -> bool:
    """on and grouped: on; auto: on exactly when the context is longer than the model's trained context
    (config.json's max_position_embeddings; unknown -> off)."""
    if setting == "auto":
        return trained_ctx is not None and ctx > trained_ctx
    return setting in ("on", "grouped")


def far_group(ctx: int, window: int, trained_ctx: int | None) -> int:
    """G of grouped far positions: the smallest compression that keeps every far distance
    (at most window + ctx / G) inside the trained context (unknown: 8192)."""
    return max(1, math.ceil(ctx / max(1, (trained_ctx or 8192) - window)))


def default_far_distance(window: int, trained_ctx: int | None) -> int:
    """D when not given: 1024 (or half the trained context when that is shorter), never below the
    window. On SmolLM2 at ~12K tokens of Botchan the pass key was found with D = 1024 and 2048 and
    lost with D = 256."""
    return max(window, min(1024, trained_ctx // 2) if trained_ctx else 1024)


def position_scheme(args, config, capacity: int) -> PlainPositions:
    """The HCA cache's position scheme: FarFrame where config.far_positions is on for a context of
    `capacity` tokens (far_positions_on), else PlainPositions."""
    trained, window = args.max_position_embeddings, config.window
    if not far_positions_on(config.far_positions, trained, capacity):
        return PlainPositions()
    dist = config.far_distance or default_far_distance(window, trained)
    group = far_group(capacity, window, trained) if config.far_positions == "grouped" else 0
    return FarFrame(args, dist, group, window)


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


class FarFrame(PlainPositions):
    """One HCA cache's far positions: its rotations, and what a decode step reuses across layers.

    distance: D; group: G of grouped far positions (0: one distance D), window W (the ring).
    The cache holds sinks and store keys placed by `unrotate` (unrotated; grouped: at j // G), and
    reads them with `queries`; its one-call CPU steps take a single query and get `step_inputs`."""

    far = True

    def __init__(self, args, distance: int, group: int = 0, window: int = 0):
        self.inv_freq = rope_inv_freq(args)      # [hd/2] (the model's, rope scaling included)
        self.distance, self.group, self.window = distance, group, window
        self._angles = None                      # (position, cos, sin) of the query's turn
        self._turned = None                      # the steps' turned copy of one layer's sinks + ring
        self._cs_host = self._cs_event = None    # a GPU step's turn [cos | sin] (pinned), its copy's event
        self._uploaded = None                    # the position whose turn the device's cs holds
        self._inv64_dev = None                   # inv_freq float64 on the device (captured steps)

    @property
    def unrotated(self) -> bool:
        """Store keys held without their rotation: one distance D (grouped ones sit at j // G,
        rotated as the ordinary calibration's)."""
        return not self.group

    def notices(self):
        how = f"at their distances divided by {self.group}" if self.group else f"at distance {self.distance}"
        return (f"far positions: tokens older than the {self.window}-token window are attended {how}",)

    def signature(self):
        return [self.distance, self.group]

    def query_turn(self, pos):
        """The angle (in positions) a query at pos (int, or an int64 tensor) is turned by: D - pos,
        grouped pos // G + W - W // G - pos."""
        if not self.group:
            return self.distance - pos
        G, W = self.group, self.window
        return pos // G + W - W // G - pos

    def key_turn(self, positions: torch.Tensor) -> torch.Tensor:
        """The angle (in positions) a post-RoPE key at each position is turned by when it leaves
        the ring: -j (unrotated), grouped j // G - j."""
        positions = positions.to(torch.int64)
        return positions // self.group - positions if self.group else -positions

    def unrotate(self, K: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """K [..., m, hd] (post-RoPE, row i at positions[i]) -> as the cache holds them (key_turn)."""
        return rotate(K, self.key_turn(positions), self.inv_freq)

    def turn_cos_sin(self, positions: torch.Tensor, inv_freq64: torch.Tensor | None = None) -> tuple:
        """cos, sin [m, hd/2] f32 of the query turn at each of positions [m] (int64; on inv_freq64's
        device when it is given: a captured GPU step's device position), angles in float64."""
        inv = self.inv_freq.to(torch.float64) if inv_freq64 is None else inv_freq64
        ang = self.query_turn(positions.to(torch.int64)).to(torch.float64)[:, None] * inv[None, :]
        return ang.cos().float(), ang.sin().float()

    def angles(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [hd/2] f32 (CPU) of the query's turn at pos (made once per position: every layer
        of a decode step reuses them)."""
        if self._angles is None or self._angles[0] != pos:
            c, s = self.turn_cos_sin(torch.tensor([pos]))
            self._angles = (pos, c[0], s[0])
        return self._angles[1], self._angles[2]

    def queries(self, qs: torch.Tensor, pos0: int) -> torch.Tensor:
        """qs [T, Hq, hd] at positions pos0.. -> turned to read the held keys (query_turn)."""
        if qs.shape[0] == 1 and qs.device.type == "cpu":   # a decode step: the cached angles
            return turn(qs.float(), *self.angles(pos0))
        c, s = self.turn_cos_sin(torch.arange(pos0, pos0 + qs.shape[0]))
        return turn(qs.float(), c[:, None, :].to(qs.device), s[:, None, :].to(qs.device))

    def sink_keys(self, K: torch.Tensor, positions: torch.Tensor, sinks: int) -> torch.Tensor:
        """The rows at positions below `sinks` placed by `unrotate` (sinks are read at distance D)."""
        is_sink = positions < sinks
        if not bool(is_sink.any()):
            return K
        return torch.where(is_sink[:, None].to(K.device), self.unrotate(K, positions), K)

    def leaving_ring(self, K: torch.Tensor, pos0: int, codes):
        """Keys placed by `unrotate`; codes encoded ahead are dropped (they were of the rotated keys)."""
        return self.unrotate(K, torch.arange(pos0, pos0 + K.shape[2])), None

    def step_inputs(self, qs, k, EK: np.ndarray, sinks: int, pos: int) -> tuple:
        """The one-call CPU steps take one query, so it is the far one (it reads the sinks' and the
        store's unrotated keys at distance D), and the ring keys and the token's own key are turned by
        R(D - p) to keep their true distances: <R(D) q_pre, R(D - p) R(j) k_pre> =
        <R(p) q_pre, R(j) k_pre>."""
        c, s = self.angles(pos)
        if EK.dtype == np.float32:                     # query, key and the ring's turned copy in one Numba call
            if self._turned is None or self._turned.shape != EK.shape:
                self._turned = np.empty(EK.shape, np.float32)
            return kc.turn_step(qs[0].float().numpy(), k[0].float().numpy(), EK, sinks, c.numpy(), s.numpy(),
                                ek_out=self._turned)
        t = torch.from_numpy(EK).clone()               # float16 tier (bfloat16 runs): torch
        t[:, sinks:] = turn(t[:, sinks:].float(), c, s).to(t.dtype)
        return self.queries(qs, pos)[0].numpy(), turn(k[0].float(), c, s).numpy(), t.numpy()

    def chunk_inputs(self, qs: torch.Tensor, EK: np.ndarray, sinks: int, pos0: int) -> tuple:
        """Each query is the far one, and the rows it reads past the sinks are turned by its angle,
        as a decode step turns the ring (step_inputs): the chunk's angles made once, each query's
        tier turned into one buffer when it is taken."""
        T, n0 = qs.shape[0], EK.shape[1] - qs.shape[0]
        c, s = self.turn_cos_sin(torch.arange(pos0, pos0 + T))
        qs, c, s = turn(qs, c[:, None], s[:, None]), c.numpy(), s.numpy()
        turned = np.empty_like(EK)
        return qs, (kc.turn_rows(EK, sinks, c[i], s[i], out=turned, end=n0 + i + 1) for i in range(T))

    # ---- a GPU step's turn --------------------------------------------------------------------
    def upload_turn(self, cs: torch.Tensor, pos: int, gpu: bool) -> None:
        """cs <- [cos | sin] of the turn at pos, once per position (every layer shares it), through a
        pinned buffer. gpu: a CUDA device (else the emulator: plain copies)."""
        if self._uploaded == pos:
            return
        c, s = self.angles(pos)
        h = c.numel()
        if self._cs_host is None:
            self._cs_host = torch.empty(2 * h, dtype=torch.float32, pin_memory=gpu)
            self._cs_event = torch.cuda.Event() if gpu else None
        if gpu:   # the host may run ahead of the GPU (no host wait inside a token with value_sum gpu)
            self._cs_event.synchronize()   # the previous position's copy has read the buffer
        self._cs_host[:h], self._cs_host[h:] = c, s
        cs.copy_(self._cs_host, non_blocking=gpu)
        if gpu:
            self._cs_event.record(torch.cuda.current_stream(cs.device))
        self._uploaded = pos

    def forget_upload(self) -> None:
        self._uploaded = None

    def on_device(self, device: torch.device) -> None:
        if self._inv64_dev is None:
            self._inv64_dev = self.inv_freq.to(device=device, dtype=torch.float64)

    def captured_turn(self, cs: torch.Tensor, pos: torch.Tensor) -> None:
        """cs <- [cos | sin] of the turn at pos, computed on the device (turn_cos_sin)."""
        cs.copy_(torch.cat(self.turn_cos_sin(pos, self._inv64_dev), dim=-1)[0])

    def keys_leaving_at(self, K: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """K placed by `unrotate`, its angles made on the device."""
        return rotate(K, self.key_turn(pos), self._inv64_dev)
