"""The cache interface the model talks to.

Who mutates what: `Model.forward` calls `attend` once per layer (which stores that layer's new
keys/values at positions offset..offset+T-1) and then `advance(T)` once. Only `advance`,
`truncate` and `reset` move `offset`; the Engine calls the last two.
"""
from __future__ import annotations

import torch

from ..model.ops import as_numpy, from_numpy_bits


class KVCache:
    """Base class: position bookkeeping shared by every cache."""

    def __init__(self, n_layers: int, capacity: int):
        self.n_layers = n_layers
        self.capacity = capacity   # most tokens this cache may ever hold (the engine's ctx)
        self.offset = 0            # tokens held (= position of the next token)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [T, Hkv, hd] for `layer` and return causal attention of q [T, Hq, hd] -> [T, Hq, hd]."""
        raise NotImplementedError

    def attend_np(self, layer: int, q, k, v):
        """attend for one token on numpy rows (runners.NumpyTokenRunner): q [Hq, hd], k, v [Hkv, hd]
        (float32, or bfloat16 bits: uint16) -> o [Hq, hd] in q's dtype, valid until the next call."""
        return as_numpy(self.attend(layer, *(from_numpy_bits(t)[None] for t in (q, k, v)))[0])

    def advance(self, n: int) -> None:
        self.offset += n

    @property
    def full_layers(self) -> "KVCache":
        """The cache of the layers that attend to the whole context: this one (a LayerKindCache's:
        its global layers' part, where the tools find an HCA cache's codebooks and selection)."""
        return self

    # ---- the capture protocol (minirun/cuda_graph.GraphedDecode): a whole decode token in a graph ----
    # A graph replays fixed launches, so what a step reads per token (its position, the store's
    # length) comes from device memory, and grids are sized for a bucket of positions. Call order per
    # token: graph_key -> graph_prepare -> the model's decode_at (attend_at per layer) -> commit_at ->
    # graph_advance; graph_snapshot / graph_restore undo a capture's warm-up runs.
    def graph_capturable(self) -> bool:
        """Whether this cache's decode steps can be captured at all (fixed per cache)."""
        return False

    def graph_key(self, bucket: int):
        """(key, n_keys) when the next step can run in a graph (key: what the graph bakes in, such as
        buffer addresses; n_keys: the positions its grids cover, a multiple of bucket), else None."""
        raise NotImplementedError

    def graph_prepare(self) -> None:
        """Before a replay: this token's per-step state into device memory."""
        raise NotImplementedError

    def rotates_at(self, n_heads: int, dtype: torch.dtype) -> bool:
        """Whether attend_at takes q, k before RoPE (rope=) and turns them in its first launch."""
        return False

    def attend_at(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  n_keys: int, rope: torch.Tensor | None = None) -> torch.Tensor:
        """attend for one token at the device position pos [1] int64: q [1, Hq, hd], k, v [1, Hkv, hd]
        -> [1, Hq, hd], over the first n_keys slots (fixed per graph). rope: [hd] cos | sin of pos
        where q, k are not turned yet (rotates_at)."""
        raise NotImplementedError

    def commit_at(self, pos: torch.Tensor) -> None:
        """After all layers of a captured step: the device-side part of advance (eviction, slots)."""
        raise NotImplementedError

    def graph_advance(self) -> None:
        """After a replay: the host's bookkeeping of advance(1)."""
        raise NotImplementedError

    def graph_snapshot(self):
        """What a run of the step overwrites and a later run of the same step reads (None: nothing)."""
        return None

    def graph_restore(self, snap) -> None:
        """Undo a warm-up run from graph_snapshot's value."""

    def truncate(self, n: int) -> bool:
        """Forget tokens from position n on; return False when this cache cannot (caller resets)."""
        return n == self.offset

    truncates_anywhere = False   # truncate(n) works for every n <= offset (then checkpoints are not needed)

    def checkpoint(self, name: str = "prompt") -> None:
        """A point a later truncate should be able to go back to: what the cache holds now. The
        engine names two: "prompt" (after each prompt) and "shared" (where a prompt left the
        cached tokens); each replaces the last one of its name."""

    def begin_prefill(self, mode: str) -> str:
        """A prompt of several chunks follows; mode "exact" | "hca" | "anchor" -> the mode the cache
        takes ("exact" here: a cache without modes attends to every token)."""
        return "exact"

    def end_prefill(self) -> None:
        """The prompt is in; the next call is a decode step."""

    def reset(self) -> None:
        self.offset = 0

    def stats(self) -> dict:
        """Bytes per tier and tokens held (see kv_stats in the engine)."""
        raise NotImplementedError

    # ---- what a prompt-cache file holds (minirun/prompt_cache.py) ----------------------------------------
    def state_signature(self) -> dict:
        """What a saved state must match to go into this cache (kind, shapes, dtypes, frames)."""
        raise TypeError(f"{type(self).__name__} cannot be saved")

    def state_dict(self) -> tuple[dict, list]:
        """(scalars, [(name, tensor)]): the counters and views of the cache's own buffers (no copies:
        the writer streams them); per-layer rows token-major [Hkv, n, width]. Derived state (lookup
        tables, numpy views, encode-ahead codes) is not saved: the caches rebuild it on first use."""
        raise TypeError(f"{type(self).__name__} cannot be saved")

    def load_state_dict(self, scalars: dict, get) -> None:
        """Fill this cache (reset, with the saved state's signature) from scalars and get(name) -> a
        CPU tensor."""
        raise TypeError(f"{type(self).__name__} cannot be loaded")


def causal_mask(pos0: int, T: int, device) -> torch.Tensor | None:
    """Boolean [T, pos0+T] mask (True = attend) for queries at pos0.. over keys 0..pos0+T-1."""
    if T == 1:
        return None
    q_pos = torch.arange(pos0, pos0 + T, device=device)[:, None]
    return torch.arange(pos0 + T, device=device)[None, :] <= q_pos
