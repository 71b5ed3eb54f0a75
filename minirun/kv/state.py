"""A cache's state as named tensors, and back: what a prompt-cache file holds (minirun/prompt_cache.py).

export_state(cache) -> (signature, scalars, tensors): signature says what the state only fits
(cache kind, shapes, dtypes, far-position frame; import checks it against the cache it goes into),
scalars are the counters, tensors [(name, tensor)] are views of the cache's own buffers (no copies:
the writer streams them). Per-layer rows are token-major [Hkv, n, width] whatever the buffer's
layout (the CPU key store is column-major, kv/store.ColumnBuffer). Derived state (numpy views,
lookup tables, packed scratch, encode-ahead codes) is not saved: the caches rebuild it on first use.

import_state(cache, scalars, get) fills a cache reset beforehand; get(name) -> a CPU tensor.
"""
from __future__ import annotations

import torch

from .codebooks import Codebooks
from .dense import DenseCache
from .hca import HCACache
from .store import ColumnBuffer


def token_rows(buf, layer: int, n: int) -> torch.Tensor:
    """A store buffer's first n rows of `layer`, token-major [Hkv, n, width] (a view: also written through)."""
    v = buf.view(layer, n)
    return v.transpose(-1, -2) if isinstance(buf, ColumnBuffer) else v


def signature(cache) -> dict:
    """What a saved state must match to go into this cache."""
    if isinstance(cache, DenseCache):
        return {"kind": "dense", "capacity": cache.capacity, "shape": list(cache.k.shape), "dtype": str(cache.k.dtype)}
    if isinstance(cache, HCACache):
        lay, far = cache.layout, cache.far
        return {"kind": "hca", "capacity": cache.capacity, "layers": cache.n_layers, "kv_heads": cache.Hkv,
                "head_dim": cache.hd, "sinks": cache.S, "window": cache.W,
                "layout": [lay.exact_keys, lay.groups, lay.centroids, lay.pairs],
                "exact_tier_dtype": str(cache.ek.dtype), "values_dtype": str(cache.values.dtype),
                "far": None if far is None else [far.distance, far.group],
                # (--rescore; only where there are host keys, so that the files of a cache without them,
                # older ones included, keep their signature)
                **({"host_keys": True} if cache.host_keys is not None else {})}
    raise TypeError(f"{type(cache).__name__} cannot be saved")


def export_state(cache) -> tuple[dict, dict, list]:
    sig = signature(cache)
    if sig["kind"] == "dense":
        n = cache.offset
        tensors = [(f"{kv}.{l}", t[l, :, :n]) for l in range(cache.n_layers) for kv, t in (("k", cache.k), ("v", cache.v))]
        return sig, {"offset": n}, tensors
    if getattr(cache, "anchor_k", None) is not None or cache.mode != "hca":
        raise ValueError("a cache in the middle of a prefill cannot be saved")
    for pool in (cache.values, cache.host_keys):   # (the GPU cache's pools: eviction copies still in flight)
        if hasattr(pool, "wait"):
            pool.wait()
    n, ne, base = cache.n_store, cache.n_encoded, cache.exact_base
    scalars = {"offset": cache.offset, "n_store": n, "n_encoded": ne, "exact_base": base}
    tensors = [("ek", cache.ek), ("ev", cache.ev), ("slot_pos", cache.slot_pos)]
    cb = cache.codebooks
    if cb is not None:   # (fitted from a prompt: only here; calibrated: the same file's, kept with the state)
        tensors.append(("codebooks", cb.factors if cb.factors is not None else cb.centroids))
        scalars["codebooks"] = {"source": cb.source, "pair": cb.factors is not None}
    for l in range(cache.n_layers):
        if n:
            tensors.append((f"values.{l}", token_rows(cache.values, l, n)))
        if n and cache.host_keys is not None:   # (rescore)
            tensors.append((f"host_keys.{l}", token_rows(cache.host_keys, l, n)))
        if cache.indices is not None and ne:
            tensors.append((f"indices.{l}", token_rows(cache.indices, l, ne)))
        if n > ne:   # full-precision store keys (the exact-key preset, or not encoded yet), from exact_base on
            tensors.append((f"exact_keys.{l}", token_rows(cache.exact_keys, l, n - base)))
    return sig, scalars, tensors


def import_state(cache, scalars: dict, get) -> None:
    """Fill `cache` (reset, with the signature of the saved state) from scalars and get(name)."""
    if isinstance(cache, DenseCache):
        n = scalars["offset"]
        for l in range(cache.n_layers):
            cache.k[l, :, :n] = get(f"k.{l}")
            cache.v[l, :, :n] = get(f"v.{l}")
        cache.offset = n
        return
    n, ne, base = scalars["n_store"], scalars["n_encoded"], scalars["exact_base"]
    cache.ek.copy_(get("ek"))
    cache.ev.copy_(get("ev"))
    cache.slot_pos.copy_(get("slot_pos"))
    if "codebooks" in scalars:
        C = get("codebooks").float().to(cache.device)
        cb = Codebooks(C, scalars["codebooks"]["source"])
        cache.codebooks = cb.paired() if scalars["codebooks"]["pair"] else cb
    for buf in (cache.values, cache.host_keys, cache.z, cache.sel, cache.lev):   # (and the scores' scratch, as _store_append grows it)
        if buf is not None and n:
            buf.reserve(n)
    if cache.indices is not None and ne:
        cache.indices.reserve(ne)
    if n > ne:
        cache.exact_keys.reserve(n - base)
    for l in range(cache.n_layers):
        if n:
            token_rows(cache.values, l, n).copy_(get(f"values.{l}"))
        if n and cache.host_keys is not None:
            token_rows(cache.host_keys, l, n).copy_(get(f"host_keys.{l}"))
        if cache.indices is not None and ne:
            token_rows(cache.indices, l, ne).copy_(get(f"indices.{l}"))
        if n > ne:
            token_rows(cache.exact_keys, l, n - base).copy_(get(f"exact_keys.{l}"))
    cache.offset, cache.n_store, cache.n_encoded, cache.exact_base = scalars["offset"], n, ne, base
