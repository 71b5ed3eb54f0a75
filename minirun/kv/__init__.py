"""KV caches behind one interface (base.KVCache: attend, advance, truncate, reset, the prefill
modes, stats, and the state a prompt-cache file holds).

Reading order:
- dense.py: K, V for every position (DenseCache).
- sliding.py and layer_kinds.py: a model's sliding-window layers keep a ring of their window
  (SlidingWindowCache) beside the cache of its global layers (LayerKindCache routes each layer).
- The HCA cache: hca_layout.py (the geometry a config asks for, and the one declaration of every
  tier's buffers that the backends allocate and `minirun plan` counts) -> hca_base.py (HCABase:
  the tiers -- sinks, ring, store -- and how tokens move between them; store.py and pinned.py
  hold the buffers) -> a backend: hca.py with key_store_cpu.py (the CPU: its key stores, one class
  per store) or hca_cuda.py with key_store_cuda.py (a GPU's) and hca_graph.py. Beside them:
  codebooks.py (the key store's codebooks), positions.py (the position scheme: plain, or
  far_positions.py's far positions), rescore.py (the rescoring step: none, or exact scores from
  host keys), ring_checkpoint.py (rewind points),
  hca_state.py (prompt-cache state), attention.py (partial attention and the log-sum-exp merge),
  value_codes.py (the store's values as 4- or 8-bit codes), head_budgets.py (per-head selection
  caps: measured, stored beside the codebooks, or the default rule).

One decode step of one layer in an HCA cache (HCABase.attend -> the backend's _attend_hca):
1. the key store scores every store token for each query head (codebook indices through a lookup
   table of the query, nibble pairs by fast scan, or exact keys);
2. the selector keeps, per query head, the smallest top set holding tau of the scores' softmax
   mass, then at most max_select tokens;
3. the value sum adds the selected tokens' values from the host pool (CPU: Numba; GPU: a kernel
   reading the mapped pool, or the host);
4. exact attention over sinks + ring + the token itself, merged with the store's part by log-sum-exp;
then advance moves the ring's oldest token to the store (its key encoded, its value to the pool).
The CPU runs 1-4 in one kernel call per query (its key store's), the GPU in ten launches captured
in one CUDA graph per token.
"""
from __future__ import annotations

from .base import KVCache
from .dense import DenseCache


def make_cache(args, config, device, dtype, capacity: int, model_dir=None) -> KVCache:
    """Build the cache the EngineConfig asks for, holding at most `capacity` tokens: a model's
    sliding-window layers keep a ring of their window (kv/layer_kinds.py), the others the cache
    config.kv names."""
    from .layer_kinds import split_by_kind
    from .sliding import SlidingWindowCache

    def local(n_layers: int, window: int) -> KVCache:
        return SlidingWindowCache(n_layers, args.num_key_value_heads, args.head_dim, window, capacity, dtype, device)
    return split_by_kind(args, lambda a: _whole_context_cache(a, config, device, dtype, capacity, model_dir), local)


def _whole_context_cache(args, config, device, dtype, capacity: int, model_dir) -> KVCache:
    if config.kv == "dense":
        return DenseCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, capacity, dtype, device)
    if str(device).startswith("cuda"):
        import kernels_cuda
        if kernels_cuda.available():
            from .hca_cuda import HCACacheCUDA
            return HCACacheCUDA(args, config, device, dtype, capacity, model_dir)
    # The CPU class also runs with a CUDA device (torch on the device, Numba on host copies made
    # every step): a slow fallback when cupy is missing.
    from .hca import HCACache
    return HCACache(args, config, device, dtype, capacity, model_dir)


__all__ = ["KVCache", "DenseCache", "make_cache"]
