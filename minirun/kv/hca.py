"""The HCA cache on the CPU: torch for the exact tier, Numba kernels (kernels_cpu) for the store.

The tiers and their bookkeeping are hca_base.HCABase's. Here: the buffers (host memory; a store of
codes column-major for the scoring kernels: kv/store.ColumnBuffer) and the key store, picked once
from the layout (kv/key_store_cpu.py: it encodes, and scores in its one-call step, with its own
codebook copies and scratch); attention in hca mode is one kernel call per query
(kv/hca_cpu_step.py: the exact tier, the query's own token, the selected store tokens -- scored
by the key store, cut by tau and the cap -- merged).
"""
from __future__ import annotations

import torch

from .. import hugepages
from .hca_base import HCABase
from .hca_cpu_step import OneCallSteps
from .hca_layout import fast_scan
from .key_store_cpu import key_stores
from .store import ColumnBuffer, GrowingBuffer


class HCACache(OneCallSteps, HCABase):
    """See the module docstring."""

    def __init__(self, args, layout, capacity, sinks, window, tau, dtype, device, codebooks=None, **kw):
        super().__init__(args, layout, capacity, sinks, window, tau, dtype, device, codebooks, **kw)
        # numpy views of the exact tier for the one-call steps (float32/float16 on the CPU only)
        self._numpy_exact_tier = device.type == "cpu" and self.ek.dtype in (torch.float32, torch.float16)
        self._ek_np = self.ek.numpy() if self._numpy_exact_tier else None
        self._ev_np = self.ev.numpy() if self._numpy_exact_tier else None
        self.lev = self.scratch[2]   # the selection's integer score levels (uint16 bits: kernels_cpu.level_select)
        self._views = {}             # layer -> (buffer addresses, numpy views) for the steps
        # the layout's key store, and the exact-keys one that scores the store while none is encoded
        self.exact_store, self.key_store = key_stores(self, fast_scan(layout) and device.type == "cpu")

    backend = "cpu"

    def _make_exact_tier(self, spec) -> tuple:
        return tuple(hugepages.zeros(*spec.lead, spec.rows, spec.width, dtype=spec.dtype, device=self.device)
                     for _ in range(2))

    def _make_pool(self, spec, read_by_device):
        return self._grow(spec)

    def _grow(self, spec):
        """On the host, as the Numba kernels read them (also when torch runs on a GPU)."""
        return GrowingBuffer(spec.lead, spec.width, spec.dtype, spec.rows)

    def _make_indices(self, spec):
        """group-major [L, Hkv, g, cap]: the scoring kernel's layout (kernels_cpu.packed)"""
        return ColumnBuffer(spec.lead, spec.width, spec.dtype, spec.rows)

    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] -> indices [L, Hkv, m, g], one kernel call for all layers."""
        return self.key_store.encode(K, self.codebooks)

    def _take_pending(self, pos: int) -> torch.Tensor | None:
        return self.key_store.take_pending(pos)

    def truncate(self, n: int) -> bool:
        self.key_store.take_pending(-1)      # (the ring may change: codes encoded ahead dropped)
        return super().truncate(n)

    def reset(self) -> None:
        super().reset()
        self.key_store.take_pending(-1)

    def stats(self) -> dict:
        """The base's, with the key store's codebook copies and the steps' fixed scratch (both
        stores': the exact one holds the selection's level-bucket counts)."""
        s = super().stats()
        s.pop("total_bytes")
        s["codebook_bytes"] += self.key_store.copy_bytes(self.codebooks)
        s["decode_scratch_bytes"] = sum(a.nbytes for st in {self.exact_store, self.key_store} for a in st.scratch)
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s
