"""KV caches behind one interface (see base.KVCache)."""
from __future__ import annotations

from .base import KVCache
from .dense import DenseCache


def make_cache(args, config, device, dtype, capacity: int, model_dir=None) -> KVCache:
    """Build the cache the EngineConfig asks for, holding at most `capacity` tokens."""
    if config.kv == "dense":
        return DenseCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, capacity, dtype, device)
    if str(device).startswith("cuda"):
        import kernels_cuda
        if kernels_cuda.available():
            from .hca_cuda import HCACacheCUDA
            return HCACacheCUDA.create(args, config, device, dtype, capacity, model_dir=model_dir)
    # The CPU class also runs with a CUDA device (torch on the device, Numba on host copies made
    # every step): a slow fallback when cupy is missing.
    from .hca import HCACache
    return HCACache.create(args, config, device, dtype, capacity, model_dir=model_dir)


__all__ = ["KVCache", "DenseCache", "make_cache"]
