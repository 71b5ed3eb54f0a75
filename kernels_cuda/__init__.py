"""CUDA kernels (CUDA C compiled at run time by CuPy/NVRTC) for the HCAttention KV cache.

Torch CUDA tensors in and out, launched on torch's current stream:

* ``encode_keys(K, codebooks) -> P`` (:mod:`kernels_cuda.ops`)
* ``kernels_cuda.decode.DecodeStep``: one HCA decode step's launches on persistent buffers
  (scores, selection, copy-back pack, exact tier, value gather, merge)
* ``kernels_cuda.dense_decode.DenseDecodeAttention``: the dense cache's split-K decode attention
* ``kernels_cuda.layer``: a layer's one-token element-wise ops; ``kernels_cuda.quant``: GGUF GEMVs
* ``available() -> bool``

The tests run every kernel through checked wrappers (tests/support/cuda_wrappers.py) against the NumPy
references (``<name>_ref`` in tests/support/references/). ``import kernels_cuda`` needs
neither cupy nor torch; they are imported on first use.  See README.md.
"""

from __future__ import annotations

import functools

from .ops import encode_keys

__all__ = ["available", "encode_keys"]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when cupy imports and a CUDA device is present (and torch, whose
    tensors the wrappers take, sees it too)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False
