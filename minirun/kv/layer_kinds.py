"""A cache per layer kind: the sliding-window layers' ring (kv/sliding.py) beside the configured
cache (dense or HCA) of the layers that attend to the whole context.

Models with sliding layers (Gemma 3: five of every six; Qwen past max_window_layers; Mistral v0.1:
all) need the long cache only for their global layers: the others read their last W tokens. The
global layers' cache is built for those layers alone (their count, their codebooks: a calibration
of such a model covers its global layers), and LayerKindCache sends each layer to its part.
"""
from __future__ import annotations

import dataclasses


from .base import KVCache


def layer_split(args) -> tuple[tuple, tuple]:
    """(the sliding layers, the global ones): model layer indices."""
    sliding = tuple(i for i in range(args.num_hidden_layers) if args.layer_window(i) is not None)
    return sliding, tuple(i for i in range(args.num_hidden_layers) if i not in sliding)


def global_args(args):
    """The ModelArgs of the global layers alone, as their cache sees them: their count, no window."""
    n = len(layer_split(args)[1])
    return dataclasses.replace(args, num_hidden_layers=n, sliding_window=None, layer_types=None)


class LayerKindCache(KVCache):
    """Routes each model layer to the sliding layers' ring (`local`) or to the global layers'
    cache (`whole`), both holding the same positions."""

    def __init__(self, local: KVCache, whole: KVCache, sliding: tuple, n_layers: int):
        super().__init__(n_layers, whole.capacity)
        self.local, self.whole = local, whole
        index = {layer: i for i, layer in enumerate(sliding)}
        glob = [layer for layer in range(n_layers) if layer not in index]
        # per model layer: (its part, its index there)
        self.route = tuple((local, index[layer]) if layer in index else (whole, glob.index(layer))
                           for layer in range(n_layers))
        self.truncates_anywhere = False

    @property
    def full_layers(self) -> KVCache:
        return self.whole

    def attend(self, layer, q, k, v):
        part, i = self.route[layer]
        return part.attend(i, q, k, v)

    def attend_np(self, layer, q, k, v):
        part, i = self.route[layer]
        return part.attend_np(i, q, k, v)

    def advance(self, n: int) -> None:
        super().advance(n)
        self.local.advance(n)
        self.whole.advance(n)

    def truncate(self, n: int) -> bool:
        ok = self.local.truncate(n) & self.whole.truncate(n)     # (both tried: each drops what it can)
        self.offset = min(self.offset, n) if ok else self.offset
        return ok

    def checkpoint(self, name: str = "prompt") -> None:
        self.local.checkpoint(name)
        self.whole.checkpoint(name)

    def begin_prefill(self, mode: str) -> str:
        self.local.begin_prefill(mode)
        return self.whole.begin_prefill(mode)

    def end_prefill(self) -> None:
        self.local.end_prefill()
        self.whole.end_prefill()

    def reset(self) -> None:
        super().reset()
        self.local.reset()
        self.whole.reset()

    def stats(self) -> dict:
        """The global layers' stats, with the ring's bytes beside them and in the total."""
        s, ring = dict(self.whole.stats()), self.local.stats()
        s.update({k: v for k, v in ring.items() if k.startswith("sliding_")})
        s["total_bytes"] += ring["total_bytes"]
        return s

    def state_signature(self) -> dict:
        return {"kind": "layer_kinds", "local": self.local.state_signature(), "whole": self.whole.state_signature()}

    def state_dict(self) -> tuple[dict, list]:
        (ls, lt), (ws, wt) = self.local.state_dict(), self.whole.state_dict()
        return ({"local": ls, "whole": ws},
                [(f"local.{n}", t) for n, t in lt] + [(f"whole.{n}", t) for n, t in wt])

    def load_state_dict(self, scalars: dict, get) -> None:
        self.local.load_state_dict(scalars["local"], lambda name: get(f"local.{name}"))
        self.whole.load_state_dict(scalars["whole"], lambda name: get(f"whole.{name}"))
        self.offset = self.whole.offset


def split_by_kind(args, make_global, make_local) -> KVCache:
    """The cache of a model with sliding layers: make_local(n_sliding_layers, window) beside
    make_global(global_args(args)); either alone where the model has only that kind."""
    sliding, glob = layer_split(args)
    local = make_local(len(sliding), args.sliding_window) if sliding else None
    if not glob:
        return local
    whole = make_global(global_args(args) if sliding else args)
    return whole if local is None else LayerKindCache(local, whole, sliding, args.num_hidden_layers)


__all__ = ["LayerKindCache", "global_args", "layer_split", "split_by_kind"]
