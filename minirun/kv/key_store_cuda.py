"""The GPU cache's key stores: each encodes the keys that leave the ring and scores the whole store
for one query into the selection's scratch, on the device (launches on the current stream, no
host wait), as key_store_cpu's stores do on the host.

- DeviceExactKeys: full-precision keys (the cache's exact_keys [L, Hkv, cap, hd] f32 on the device:
  the 50% preset, and any store before its codebooks exist): one batched matmul, the softmax
  stats (m, l) by torch.
- DeviceCodes: codebook indices [L, Hkv, cap, g] -- nibble pairs too: on a GPU each byte is an
  index into the product codebooks (Codebooks.paired) --, scored through the query's lookup table
  (kernels_cuda approx_scores, which writes m, l), encoded by kernels_cuda.encode_keys in one
  launch for all layers; tokens not yet encoded (a state loaded mid-prefill) scored as exact keys.
"""
from __future__ import annotations

import torch

import kernels_cuda as kcu

from .codebooks import Codebooks


def device_key_stores(c) -> tuple:
    """(exact, store) of the GPU cache c, as key_store_cpu.key_stores."""
    exact = DeviceExactKeys(c)
    return (exact, exact) if c.layout.exact_keys else (exact, DeviceCodes(c, exact))


class DeviceExactKeys:
    """score(ds, L, layer, q, zb, n): zb [Hq, >= n] <- the scores of the store's first n tokens for
    q [Hq, hd] f32 (scaled), ds.m, ds.l <- their softmax stats (kernels_cuda.decode.DecodeStep's
    buffers). Never captured in a graph (graph_capturable needs every key encoded): n_live None."""

    def __init__(self, c):
        self.c = c

    def score(self, ds, L, layer, q, zb, n: int, n_live=None) -> None:
        """Tokens [exact_base, n) from the exact keys (those before it are encoded: DeviceCodes
        scored them), stats over all n."""
        c = self.c
        Kx = c.exact_keys.view(layer, n - c.exact_base)
        zb[:, c.exact_base:n] = torch.bmm(q.view(c.Hkv, -1, c.hd), Kx.transpose(1, 2)).reshape(c.Hq, -1)
        torch.amax(zb[:, :n], 1, out=ds.m)
        torch.sum(torch.exp(zb[:, :n] - ds.m[:, None]), 1, out=ds.l)


class DeviceCodes:
    """The codes' store: score as DeviceExactKeys (approx_scores over the encoded tokens; a
    captured step's n_live, int32 [1] on the device: the store's length, n its grids' bound, every
    token encoded), and encode(K [L, Hkv, m, hd] on the device) -> indices [L, Hkv, m, g]."""

    def __init__(self, c, exact: DeviceExactKeys):
        self.c, self.exact = c, exact

    def centroids(self) -> torch.Tensor:
        """The cache's codebooks as the kernels read them: float32, contiguous, on the device (moved
        once; nibble pairs: the product codebooks only, their factors dropped)."""
        c = self.c
        C = c.codebooks.centroids
        if C.device != c.device or C.dtype != torch.float32 or not C.is_contiguous() or c.codebooks.factors is not None:
            c.codebooks = Codebooks(C.float().to(c.device).contiguous(), c.codebooks.source)
        return c.codebooks.centroids

    def score(self, ds, L, layer, q, zb, n: int, n_live=None) -> None:
        c = self.c
        ne = n if n_live is not None else min(n, c.n_encoded)
        if ne:
            ds.scores(L, q, c.q2k_dev, self.centroids()[layer], c.indices.data[layer], ne, zb, n_live=n_live)
        if n > ne:
            self.exact.score(ds, L, layer, q, zb, n)

    def encode(self, K: torch.Tensor) -> torch.Tensor:
        Lr, Hkv, m, hd = K.shape
        C = self.centroids()
        return kcu.encode_keys(K.reshape(Lr * Hkv, m, hd), C.reshape(Lr * Hkv, *C.shape[2:])).view(Lr, Hkv, m, -1)
