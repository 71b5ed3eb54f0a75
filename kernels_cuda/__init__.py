"""CUDA kernels (CUDA C compiled at run time by CuPy/NVRTC) for the HCAttention KV cache.

Public API -- torch CUDA tensors in and out, launched on torch's current stream
(shapes and dtypes documented on each function in :mod:`kernels_cuda.ops`):

* ``build_lut(q, codebooks, q_to_kv) -> T``
* ``approx_scores(T, P, q_to_kv, n, out=None) -> (z, (m, l))``
* ``threshold_select(z, tau, out_idx=None, *, stats=None) -> (idx, counts, m, l_sel)``
* ``attend_exact(q, K, V, q_to_kv, n, valid=None) -> (o, m, l)``
* ``lse_merge(os, ms, ls) -> (o, m, l)``
* ``encode_keys(K, codebooks, out=None) -> P``
* ``available() -> bool``

``kernels_cuda.decode`` holds the glue kernels of one HCA decode step and
``DecodeStep`` (that step's launches on persistent buffers).

The NumPy references are ``<name>_ref`` in tests/references/.  The weighted
value sum runs on the CPU (kernels_cpu).  ``import kernels_cuda`` needs
neither cupy nor torch; they are imported on first use.  See README.md.
"""

from __future__ import annotations

import functools

from .ops import approx_scores, attend_exact, build_lut, encode_keys, lse_merge, threshold_select

__all__ = [
    "available",
    "build_lut",
    "approx_scores",
    "threshold_select",
    "attend_exact",
    "lse_merge",
    "encode_keys",
]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when cupy imports and a CUDA device is present (and torch, whose
    tensors the wrappers take, sees it too)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
    except Exception:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False
