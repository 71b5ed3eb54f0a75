"""The HCA cache's position scheme: how the positions of tokens older than the ring are read.

HCABase picks one scheme when it is made (far_positions.position_scheme) and calls it wherever
old tokens' positions matter: the queries that read the sinks and the store, the keys that enter
the sinks or leave the ring, the CPU steps' inputs, a GPU step's turn, the saved state's signature.
PlainPositions, here, is the interface and the ordinary positions (every token at its own
distance: each method returns what it is given, or does nothing); far_positions.FarFrame is the
other scheme (old tokens at one distance D, or grouped distances).

`far` says whether sinks and store hold keys at positions of their own, read with queries of their
own: the places that choose kernels or buffers by it (a CPU key store that encodes ahead, the
sinks' own partial or launch, decode_prep's far query) read this one boolean.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch


class PlainPositions:
    """Every token at its own position: keys keep their RoPE rotation in every tier and one query
    reads them all."""

    far = False         # sinks and store at positions of their own (read with their own queries)
    unrotated = False   # store keys held without their rotation (codebooks of `minirun calibrate --unrotated`)

    def notices(self):
        """Lines a user is told when the cache is made (none)."""
        return ()

    def signature(self):
        """What a prompt-cache file's signature holds of the scheme (None: plain positions)."""
        return None

    def queries(self, qs: torch.Tensor, pos0: int) -> torch.Tensor:
        """qs [T, Hq, hd] at positions pos0.. -> the queries that read sinks and store (qs itself)."""
        return qs

    def sink_keys(self, K: torch.Tensor, positions: torch.Tensor, sinks: int) -> torch.Tensor:
        """K [L, Hkv, m, hd] at positions [m] -> as the exact tier holds them (the rows at positions
        below `sinks` as the sinks hold them): K itself."""
        return K

    def leaving_ring(self, K: torch.Tensor, pos0: int, codes):
        """K [L, Hkv, m, hd] leaving the ring at positions pos0.., and their codes [L, Hkv, m, g]
        encoded ahead (or None) -> (keys as the store holds them, codes still valid or None): both
        as given."""
        return K, codes

    def step_inputs(self, qs: torch.Tensor, k: torch.Tensor, EK: np.ndarray, sinks: int, pos: int) -> tuple:
        """A one-call CPU decode step's (query [Hq, hd], own key [Hkv, hd], exact tier
        [Hkv, S + W, hd]) numpy, from qs [1, Hq, hd] (scaled), k [1, Hkv, hd] and the layer's exact
        tier EK at position pos: as they are."""
        return qs[0].numpy(), k[0].float().numpy(), EK

    def chunk_inputs(self, qs: torch.Tensor, EK: np.ndarray, sinks: int, pos0: int) -> tuple:
        """A prompt chunk's one-call CPU steps: qs [T, Hq, hd] f32 (scaled) at positions pos0.., EK
        [Hkv, S + W + T, hd] f32 (the exact tier with the chunk's keys appended) -> (queries
        [T, Hq, hd], an iterable of each query's exact tier, taken in order): qs, and EK T times."""
        return qs, itertools.repeat(EK, qs.shape[0])

    # ---- a GPU step's turn (kv/hca_cuda.py, kv/hca_graph.py) ------------------------------------
    def upload_turn(self, cs: torch.Tensor, pos: int, gpu: bool) -> None:
        """An eager GPU step's query turn at pos into cs [hd] on the device (none here)."""

    def forget_upload(self) -> None:
        """Something else wrote cs (a captured step): the next upload_turn writes again (none here)."""

    def on_device(self, device: torch.device) -> None:
        """Before capturing steps on `device`: what captured_turn and keys_leaving_at read there (none)."""

    def captured_turn(self, cs: torch.Tensor, pos: torch.Tensor) -> None:
        """A captured step's query turn at the device position pos (int64 [1]) into cs (none here)."""

    def keys_leaving_at(self, K: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, 1, hd] leaving the ring at the device position pos (int64 [1]) -> as the store
        holds it (a captured step's eviction): K itself."""
        return K
