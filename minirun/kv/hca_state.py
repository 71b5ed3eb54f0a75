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
        lay = self.layout
        return {"kind": "hca", "capacity": self.capacity, "layers": self.n_layers, "kv_heads": self.Hkv,
                "head_dim": self.hd, "sinks": self.S, "window": self.W,
                "layout": [lay.exact_keys, lay.groups, lay.centroids, lay.pairs],
                "exact_tier_dtype": str(self.ek.dtype), "values_dtype": str(self.values.dtype),
                "far": self.positions.signature(),
                # (rescore: only where there are host keys, so that the files of a cache without them
                # keep their signature)
                **({"host_keys": True} if self.host_keys is not None else {}),
                # (quantized values only: files of float values keep their signature)
                **({"values": self.value_codes.kind} if self.value_codes.quantized else {})}

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
        parts = self._store_parts(n, ne, base)
        tensors += [(f"{name}.{layer}", buf.token_rows(layer, rows))
                    for layer in range(self.n_layers) for name, buf, rows in parts]
        return scalars, tensors

    def _store_parts(self, n: int, ne: int, base: int) -> list:
        """(name, buffer, rows) of the store's per-layer buffers a state holds, in the file's order:
        values and host keys (n rows), indices (ne), and the full-precision keys from exact_base on
        (exact keys, or not encoded yet)."""
        parts = [("values", self.values, n), ("host_keys", self.host_keys, n), ("indices", self.indices, ne),
                 ("exact_keys", self.exact_keys, n - base if n > ne else 0)]
        return [(name, buf, rows) for name, buf, rows in parts if buf is not None and rows]

    def load_state_dict(self, scalars: dict, get) -> None:
        n, ne, base = scalars["n_store"], scalars["n_encoded"], scalars["exact_base"]
        self.ek.copy_(get("ek"))
        self.ev.copy_(get("ev"))
        self.slot_pos.copy_(get("slot_pos"))
        if "codebooks" in scalars:
            cb = Codebooks(get("codebooks").float().to(self.device), scalars["codebooks"]["source"])
            self.codebooks = cb.paired() if scalars["codebooks"]["pair"] else cb
        parts = self._store_parts(n, ne, base)
        for buf in self.scratch if n else ():   # (the scores' scratch grows with the store)
            buf.reserve(n)
        for name, buf, rows in parts:
            buf.reserve(rows)
        for layer in range(self.n_layers):
            for name, buf, rows in parts:
                buf.token_rows(layer, rows).copy_(get(f"{name}.{layer}"))
        self.offset, self.n_store, self.n_encoded, self.exact_base = scalars["offset"], n, ne, base
