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

from typing import NamedTuple

import torch

import kernels_cuda as kcu

from .codebooks import Codebooks


class DeviceStore(NamedTuple):
    """What a score reads of the GPU cache's state (HCACacheCUDA._store_state makes it)."""
    exact_keys: object          # kv/store.GrowingBuffer [L, Hkv, cap, hd] f32: positions exact_base..
    exact_base: int             # store tokens before it are encoded
    n_encoded: int              # store tokens [0, n_encoded) have codes
    indices: object             # GrowingBuffer [L, Hkv, cap, g] of codes, or None (exact keys)
    q2k: torch.Tensor           # int32 [Hq] on the device: each query head's kv head
    centroids: torch.Tensor     # [L, Hkv, g, c, ds] f32 on the device (device_codebooks), or None


def device_key_stores(layout, Hq: int, Hkv: int, hd: int) -> tuple:
    """(exact, store) of a GPU cache of `layout` and heads, as key_store_cpu.key_stores."""
    exact = DeviceExactKeys(Hq, Hkv, hd)
    return (exact, exact) if layout.exact_keys else (exact, DeviceCodes(exact))


def device_codebooks(cb: Codebooks, device: torch.device) -> Codebooks:
    """The codebooks as the kernels read them: float32, contiguous, on the device (nibble pairs:
    the product codebooks only, their factors dropped); cb itself where it is so already."""
    C = cb.centroids
    if C.device != device or C.dtype != torch.float32 or not C.is_contiguous() or cb.factors is not None:
        return Codebooks(C.float().to(device).contiguous(), cb.source)
    return cb


class DeviceExactKeys:
    """score(ds, L, layer, q, zb, n, st): zb [Hq, >= n] <- the scores of the store's first n tokens
    for q [Hq, hd] f32 (scaled), ds.m, ds.l <- their softmax stats (kernels_cuda.decode.DecodeStep's
    buffers). Never captured in a graph (graph_capturable needs every key encoded): n_live None."""

    def __init__(self, Hq: int, Hkv: int, hd: int):
        self.Hq, self.Hkv, self.hd = Hq, Hkv, hd

    def score(self, ds, L, layer, q, zb, n: int, st: DeviceStore, n_live=None) -> None:
        """Tokens [exact_base, n) from the exact keys (those before it are encoded: DeviceCodes
        scored them), stats over all n."""
        Kx = st.exact_keys.view(layer, n - st.exact_base)
        zb[:, st.exact_base:n] = torch.bmm(q.view(self.Hkv, -1, self.hd), Kx.transpose(1, 2)).reshape(self.Hq, -1)
        torch.amax(zb[:, :n], 1, out=ds.m)
        torch.sum(torch.exp(zb[:, :n] - ds.m[:, None]), 1, out=ds.l)


class DeviceCodes:
    """The codes' store: score as DeviceExactKeys (approx_scores over the encoded tokens; a
    captured step's n_live, int32 [1] on the device: the store's length, n its grids' bound, every
    token encoded), and encode(K [L, Hkv, m, hd] on the device, centroids) -> indices [L, Hkv, m, g]."""

    def __init__(self, exact: DeviceExactKeys):
        self.exact = exact

    def score(self, ds, L, layer, q, zb, n: int, st: DeviceStore, n_live=None) -> None:
        ne = n if n_live is not None else min(n, st.n_encoded)
        if ne:
            ds.scores(L, q, st.q2k, st.centroids[layer], st.indices.data[layer], ne, zb, n_live=n_live)
        if n > ne:
            self.exact.score(ds, L, layer, q, zb, n, st)

    def encode(self, K: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        Lr, Hkv, m, hd = K.shape
        C = centroids
        return kcu.encode_keys(K.reshape(Lr * Hkv, m, hd), C.reshape(Lr * Hkv, *C.shape[2:])).view(Lr, Hkv, m, -1)
