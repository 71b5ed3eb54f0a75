"""What a prompt-cache file holds of an HCA cache (minirun/prompt_cache.py writes and reads it; HCABase
mixes this in, for both backends).

The state is the counters and views of the cache's own buffers (kv/hca_base.py documents the tiers):
the exact tier, the ring's slot positions, the store's values, host keys, indices and full-precision
keys, and the codebooks. Derived state (lookup tables, numpy views, encode-ahead codes) is rebuilt
on first use.
"""
from __future__ import annotations

from .codebooks import Codebooks


class SavedState:
    """state_signature / state_dict / load_state_dict of the KVCache interface, for HCABase."""

    def state_signature(self) -> dict:
        lay, far = self.layout, self.far
        return {"kind": "hca", "capacity": self.capacity, "layers": self.n_layers, "kv_heads": self.Hkv,
                "head_dim": self.hd, "sinks": self.S, "window": self.W,
                "layout": [lay.exact_keys, lay.groups, lay.centroids, lay.pairs],
                "exact_tier_dtype": str(self.ek.dtype), "values_dtype": str(self.values.dtype),
                "far": None if far is None else [far.distance, far.group],
                # (rescore: only where there are host keys, so that the files of a cache without them
                # keep their signature)
                **({"host_keys": True} if self.host_keys is not None else {})}

    def state_dict(self) -> tuple[dict, list]:
        if self.anchor_k is not None or self.mode != "hca":
            raise ValueError("a cache in the middle of a prefill cannot be saved")
        for pool in (self.values, self.host_keys):   # (the GPU's pools: eviction copies still in flight)
            if hasattr(pool, "wait"):
                pool.wait()
        n, ne, base = self.n_store, self.n_encoded, self.exact_base
        scalars = {"offset": self.offset, "n_store": n, "n_encoded": ne, "exact_base": base}
        tensors = [("ek", self.ek), ("ev", self.ev), ("slot_pos", self.slot_pos)]
        cb = self.codebooks
        if cb is not None:   # (fitted from a prompt: only here; calibrated: the same file's, kept with the state)
            tensors.append(("codebooks", cb.factors if cb.factors is not None else cb.centroids))
            scalars["codebooks"] = {"source": cb.source, "pair": cb.factors is not None}
        for layer in range(self.n_layers):
            if n:
                tensors.append((f"values.{layer}", self.values.token_rows(layer, n)))
            if n and self.host_keys is not None:
                tensors.append((f"host_keys.{layer}", self.host_keys.token_rows(layer, n)))
            if self.indices is not None and ne:
                tensors.append((f"indices.{layer}", self.indices.token_rows(layer, ne)))
            if n > ne:   # full-precision store keys (exact keys, or not encoded yet), from exact_base on
                tensors.append((f"exact_keys.{layer}", self.exact_keys.token_rows(layer, n - base)))
        return scalars, tensors

    def load_state_dict(self, scalars: dict, get) -> None:
        n, ne, base = scalars["n_store"], scalars["n_encoded"], scalars["exact_base"]
        self.ek.copy_(get("ek"))
        self.ev.copy_(get("ev"))
        self.slot_pos.copy_(get("slot_pos"))
        if "codebooks" in scalars:
            cb = Codebooks(get("codebooks").float().to(self.device), scalars["codebooks"]["source"])
            self.codebooks = cb.paired() if scalars["codebooks"]["pair"] else cb
        for buf in (self.values, self.host_keys, *self.scratch):   # (the scores' scratch grows with the store)
            if buf is not None and n:
                buf.reserve(n)
        if self.indices is not None and ne:
            self.indices.reserve(ne)
        if n > ne:
            self.exact_keys.reserve(n - base)
        for layer in range(self.n_layers):
            if n:
                self.values.token_rows(layer, n).copy_(get(f"values.{layer}"))
            if n and self.host_keys is not None:
                self.host_keys.token_rows(layer, n).copy_(get(f"host_keys.{layer}"))
            if self.indices is not None and ne:
                self.indices.token_rows(layer, ne).copy_(get(f"indices.{layer}"))
            if n > ne:
                self.exact_keys.token_rows(layer, n - base).copy_(get(f"exact_keys.{layer}"))
        self.offset, self.n_store, self.n_encoded, self.exact_base = scalars["offset"], n, ne, base
