"""The HCA cache on the CPU: torch for the exact tier, Numba kernels (kernels_cpu) for the store.

The tiers and their bookkeeping are hca_base.HCABase's. Here: the buffers (host memory; the key
store column-major for the scoring kernels: kv/store.ColumnBuffer), the encoder, and the kernels'
scratch; attention in hca mode is one kernel call per query (kv/hca_cpu_step.py: the exact tier,
the query's own token, the selected store tokens -- scored by the key store's kernel, cut by tau
and the cap -- merged).
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu as kc
from kernels_cpu import fastscan as fs

from .. import hugepages
from .hca_base import HCABase
from .hca_cpu_step import OneCallSteps
from .hca_layout import fast_scan
from .store import ColumnBuffer, GrowingBuffer


class HCACache(OneCallSteps, HCABase):
    """See the module docstring."""

    def __init__(self, args, layout, capacity, sinks, window, tau, dtype, device, codebooks=None, **kw):
        super().__init__(args, layout, capacity, sinks, window, tau, dtype, device, codebooks, **kw)
        self._lanes = kc.lane_map(self.q_to_kv, self.Hkv)           # query heads in the packed tables' lanes
        self._counts = np.zeros(self.Hq, np.int32)                 # selection sizes of the last step
        # numpy views of the exact tier for the one-call steps (float32/float16 on the CPU only)
        self._numpy_exact_tier = device.type == "cpu" and self.ek.dtype in (torch.float32, torch.float16)
        self._ek_np = self.ek.numpy() if self._numpy_exact_tier else None
        self._ev_np = self.ev.numpy() if self._numpy_exact_tier else None
        self.lev = self.scratch[2]   # the selection's integer score levels (uint16 bits: kernels_cpu.level_select)
        self._cnorm = None        # (codebooks, their ||c||^2) for the encode kernel
        # decode steps encode the ring's oldest key (the next to leave) inside each layer's fused
        # call, where the codebooks are in cache: codes [L, Hkv, 1, g] for position _pending_pos
        self._pending = None
        self._pending_pos = -1
        self._pending_done = np.zeros(self.n_layers, bool)
        self._cbt = None          # (codebooks, their [L, Hkv, g, ds, c] layout) for the LUT kernel
        self._lut = None          # [Hq, g, c] scratch lookup table
        self._hist = None         # level-bucket counts of the selection (kc.level_hist)
        self._views = {}          # layer -> (buffer addresses, numpy views) for the decode kernel
        self._packed = None       # the lookup table's packed integer form (kc.PackedLUT of scratch arrays)
        # nibble pairs (layout.pairs): (codebooks, factors transposed, their norms), the fast-scan scratch
        self._fast_scan = fast_scan(layout) and device.type == "cpu"
        self._fs = None
        self._fs_lut = None

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

    def _factors(self) -> tuple[np.ndarray, np.ndarray]:
        """Nibble pairs: the 16-centroid factor codebooks transposed, [L, Hkv, G, ds, 16] f32, and
        their norms [L, Hkv, G, 16] (made once per codebook set, with the fast-scan step's scratch
        and the codes it encodes ahead)."""
        if self._fs is None or self._fs[0] is not self.codebooks:
            F = np.ascontiguousarray(self.codebooks.factors.numpy().transpose(0, 1, 2, 4, 3))
            self._fs = (self.codebooks, F, fs.factor_norms(F))
            self._fs_lut = fs.FastScanLUT(self.Hq, F.shape[2], self._lanes) if self._fast_scan else None
            self._hist = kc.level_hist(self.Hq) if self._hist is None else self._hist
            self._new_pending()
        return self._fs[1], self._fs[2]

    def _codebook_copy_bytes(self) -> int:
        """The CPU kernels' copies of the current codebooks: the transposed layout of the LUT kernel,
        the centroid norms of the encoder, the nibble pairs' transposed factors and their norms (made
        on first use)."""
        own = [c for c in (self._cbt, self._cnorm, self._fs) if c is not None and c[0] is self.codebooks]
        return sum(a.nbytes for c in own for a in c[1:])      # (codebooks, arrays made from them...)

    def _decode_scratch(self) -> list:
        """Fixed-size scratch of the CPU decode kernels, where made: the lookup table, its packed
        form, the level-bucket counts and the ring-key codes encoded ahead."""
        arrs = [a for a in (self._lut, self._hist, self._pending) if a is not None]
        if self._packed is not None:
            p = self._packed
            arrs += [p.tables, p.scale, p.offset, p.top, p.shift]   # (lanes is self._lanes, not scratch)
        if self._fs_lut is not None:
            arrs += self._fs_lut.arrays
        return arrs

    def _take_pending(self, pos: int) -> torch.Tensor | None:
        """The codes [L, Hkv, 1, g] the decode steps encoded ahead, if they are position pos's (the
        one token leaving the ring) for every layer; None otherwise. Either way they are used up."""
        codes = None
        if pos == self._pending_pos >= 0 and self._pending_done.all():
            codes = torch.from_numpy(self._pending)
        self._pending_pos = -1
        return codes

    def _codebooks_t(self) -> np.ndarray:
        """Codebooks laid out [L, Hkv, g, ds, c] for the fast LUT kernel (made once per codebook set)."""
        if self._cbt is None or self._cbt[0] is not self.codebooks:
            C = self.codebooks.centroids.numpy()
            self._cbt = (self.codebooks, np.ascontiguousarray(C.transpose(0, 1, 2, 4, 3)))
            g, c = self.layout.groups, self.layout.centroids
            self._lut = np.empty((self.Hq, g, c), np.float32)
            self._packed = kc.PackedLUT(np.empty((self._lanes.shape[0], g, c), np.uint64), self._lanes,
                                        np.empty(self.Hq, np.float32), np.empty(self.Hq, np.float32))
            self._hist = kc.level_hist(self.Hq)                    # per-thread level-bucket counts
        return self._cbt[1]

    def _codebook_norms(self) -> np.ndarray:
        """||c||^2 per centroid, [L, Hkv, g, c] f32 (made once per codebook set); also makes the
        decode steps' scratch for the codes they encode."""
        if self._cnorm is None or self._cnorm[0] is not self.codebooks:
            C = self.codebooks.centroids.numpy()
            self._cnorm = (self.codebooks, kc.codebook_norms(C.reshape(-1, *C.shape[2:])).reshape(C.shape[:-1]))
            self._new_pending()
        return self._cnorm[1]

    def _new_pending(self) -> None:
        """The scratch of the codes the decode steps encode ahead, [L, Hkv, 1, g] of the index dtype
        (made with each codebook set's encoder state), none pending yet."""
        self._pending = np.empty((self.n_layers, self.Hkv, 1, self.layout.groups),
                                 np.uint8 if self.layout.index_bytes == 1 else np.int16)
        self._pending_pos = -1

    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] -> indices [L, Hkv, m, g], one kernel call for all layers."""
        L, Hkv, m, hd = K.shape
        if self.layout.pairs:   # nibble pairs, from the 16-centroid factors (the product's nearest)
            F, fnorm = self._factors()
            P = fs.encode_pairs(K.float().reshape(L * Hkv, m, hd).numpy(), F.reshape(L * Hkv, *F.shape[2:]),
                                fnorm.reshape(L * Hkv, *fnorm.shape[2:]))
            return torch.from_numpy(P).view(L, Hkv, m, -1)
        C = self.codebooks.centroids.reshape(L * Hkv, *self.codebooks.centroids.shape[2:]).numpy()
        cn = self._codebook_norms().reshape(L * Hkv, *self._cnorm[1].shape[2:])
        Ct = self._codebooks_t().reshape(L * Hkv, *self._cbt[1].shape[2:])   # encode_keys picks its path by m
        P = kc.encode_keys(K.float().reshape(L * Hkv, m, hd).numpy(), C, cnorm=cn, codebooks_t=Ct)
        return torch.from_numpy(P).view(L, Hkv, m, -1)

    def truncate(self, n: int) -> bool:
        self._pending_pos = -1
        return super().truncate(n)

    def reset(self) -> None:
        super().reset()
        self._pending_pos = -1

    def stats(self) -> dict:
        s = super().stats()
        s.pop("total_bytes")
        s["codebook_bytes"] += self._codebook_copy_bytes()
        s["decode_scratch_bytes"] = sum(a.nbytes for a in self._decode_scratch())
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s
