"""The HCA cache on the CPU: torch for the exact tier, Numba kernels (kernels_cpu) for the store.

The tiers and their bookkeeping are hca_base.HCABase's, their buffers in host memory
(kv/hca_buffers.HostBuffers: a store of codes column-major for the scoring kernels). Here: the key
store, picked once from the layout (kv/key_store_cpu.py: it encodes keys, and scores in its kernel's one call with its own
codebook copies and scratch), and attention in hca mode. Every query with a store, a decode token
or one of a prompt chunk's, is one call of the key store's step (the exact-keys store's while no
key is encoded yet): steps 1-4 of kv/__init__'s docstring. A decode token reads the exact tier in
place and has the store encode the ring key that leaves next; a chunk's queries read a float32
copy of it with the chunk's keys appended (_attend_chunk).
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu as kc

from .hca_base import HCABase
from .hca_buffers import HostBuffers
from .hca_layout import fast_scan
from .key_store_cpu import Heads, StoreState, key_stores


class HCACache(HCABase):
    """See the module docstring."""

    def __init__(self, args, config, device, dtype, capacity, model_dir=None):
        super().__init__(args, config, device, dtype, capacity, HostBuffers(device), model_dir)
        # numpy views of the exact tier for the one-call steps (float32/float16 on the CPU only)
        self._numpy_exact_tier = device.type == "cpu" and self.ek.dtype in (torch.float32, torch.float16)
        self._ek_np = self.ek.numpy() if self._numpy_exact_tier else None
        self._ev_np = self.ev.numpy() if self._numpy_exact_tier else None
        self.lev = self.scratch[2]   # the selection's integer score levels (uint16 bits: kernels_cpu.level_select)
        self._views = {}             # layer -> (buffer addresses, numpy views) for the steps
        self._no_store = None        # attend_np's placeholders for a step with an empty store
        # the layout's key store, and the exact-keys one that scores the store while none is encoded
        heads = Heads(self.n_layers, self.Hq, self.Hkv, self.q_to_kv)
        self.exact_store, self.key_store = key_stores(heads, self.layout, self.positions.far,
                                                      fast_scan(self.layout) and device.type == "cpu")

    def _take_pending(self, pos: int) -> torch.Tensor | None:
        return self.key_store.take_pending(pos)

    def stats(self) -> dict:
        """The base's, with the key store's codebook copies and the steps' fixed scratch (both
        stores': the exact one holds the selection's level-bucket counts)."""
        s = super().stats()
        s.pop("total_bytes")
        s["codebook_bytes"] += self.key_store.copy_bytes(self.codebooks)
        s["decode_scratch_bytes"] = sum(a.nbytes for st in {self.exact_store, self.key_store} for a in st.scratch)
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s

    # ---- attention in hca mode (HCABase.attend calls _attend_hca) --------------------------------
    def attend_np(self, layer, q, k, v):
        """One decode token on numpy rows (runners.NumpyTokenRunner): q [Hq, hd], k, v [Hkv, hd]
        float32 -> o [Hq, hd] float32, in one fused call with no torch arithmetic on the way (attend's
        torch path, the reference, costs about as much as the call itself in a short store). The
        exact tier alone while the store is empty; prefill modes and bfloat16 rows take attend."""
        if q.dtype != np.float32 or not self._numpy_exact_tier or (self.n_store and self.mode != "hca"):
            return super().attend_np(layer, q, k, v)
        kt = torch.from_numpy(k)[None]
        self._staged[layer] = (kt, torch.from_numpy(v)[None])
        self._encode_unencoded()
        q1, kn, EK = self.positions.step_inputs(torch.from_numpy(q * np.float32(self._q_scale(1)))[None], kt,
                                                self._ek_np[layer], self.S, self.offset)
        if self.n_store:
            live = self.ring.live_mask(self.offset, self.n_store)
            return self._one_call(layer, q1, kn, v, EK, self._ev_np[layer], self.S + self.W, live, decode=True)
        ex, (K0, z0) = self.exact_store, self._empty_store()
        return kc.hca_exact_decode_attend(q1, kn, v, EK, self._ev_np[layer], self.S + self.W, K0, 0, K0, self.tau,
                                          self.q_to_kv, ex.lanes, z0, ex.levels(), ex.counts,
                                          exact_valid=self.ring.live_mask(self.offset, self.n_store))

    def _empty_store(self) -> tuple:
        """Placeholders K, V [Hkv, 1, hd] and z [Hq, 1] for a step with no store (never read)."""
        if self._no_store is None:
            self._no_store = (np.zeros((self.Hkv, 1, self.hd), np.float32), np.zeros((self.Hq, 1), np.float32))
        return self._no_store

    def _attend_hca(self, layer, q, k, v):
        """q [T, Hq, hd], k, v [T, Hkv, hd] -> [T, Hq, hd] (q's dtype and device), in hca mode with a store."""
        self._encode_unencoded()
        T = q.shape[0]
        qs = q.float().cpu() * self._q_scale(T)
        if T == 1 and self._numpy_exact_tier:
            q1, kn, EK = self.positions.step_inputs(qs, k, self._ek_np[layer], self.S, self.offset)
            o = self._one_call(layer, q1, kn, v[0].float().numpy(), EK, self._ev_np[layer], self.S + self.W,
                               self.ring.live_mask(self.offset, self.n_store), decode=True)
            return torch.from_numpy(o)[None].to(q.dtype)
        return self._attend_chunk(layer, qs, k, v).to(device=q.device, dtype=q.dtype)

    def _encode_unencoded(self) -> None:
        """A state loaded mid-prefill: the store's keys not encoded yet, encoded before scoring."""
        if self.n_encoded < self.n_store and self.codebooks is not None and not self.layout.exact_keys:
            self._fit_and_encode()

    def _attend_chunk(self, layer, qs, k, v) -> torch.Tensor:
        """Each of a chunk's T queries in one call: over a float32 copy of the exact tier with the
        chunk's keys and values appended [Hkv, S + W + T, hd] (query i reads its first S + W + i
        rows where live, row S + W + i as its own token), the queries and each one's copy as the
        position scheme gives them (chunk_inputs; far positions: turned, FarFrame.chunk_inputs)."""
        T, n0 = qs.shape[0], self.S + self.W
        EK = torch.cat([self.ek[layer], k.transpose(0, 1).to(self.ek.dtype)], 1).float().cpu().numpy()
        EV = torch.cat([self.ev[layer], v.transpose(0, 1).to(self.ev.dtype)], 1).float().cpu().numpy()
        valid = np.ones(n0 + T, np.uint8)
        valid[:n0] = (self.slot_pos >= 0).numpy()
        qs, exact_tiers = self.positions.chunk_inputs(qs, EK, self.S, self.offset)
        qn = qs.numpy()
        out = np.empty((T, self.Hq, self.hd), np.float32)
        for i, EKi in enumerate(exact_tiers):
            out[i] = self._one_call(layer, qn[i], EKi[:, n0 + i].copy(), EV[:, n0 + i].copy(), EKi, EV, n0 + i,
                                    valid, decode=False)
        return torch.from_numpy(out)

    def _one_call(self, layer, q, kn, vn, EK, EV, n_exact, valid, decode: bool) -> np.ndarray:
        """One query's call of the key store's step: q [Hq, hd] (pre-scaled), its own kn, vn
        [Hkv, hd], the exact tier EK, EV [Hkv, >= n_exact, hd] (valid: uint8 live rows, or None)
        -> o [Hq, hd] f32. A decode step also has the store encode the ring key that leaves next
        (where it does), and records the selection where asked."""
        store = self.key_store if self.n_encoded else self.exact_store
        leaving = self._leaving() if decode and store.encodes_ahead else None
        st = StoreState(self.n_store, self.tau, self.select_cap(layer), self.codebooks, self.exact_keys)
        o = store.step(st, layer, q, kn, vn, EK, EV, n_exact, valid, self._views_of(layer), leaving)
        if decode and self.record_selection is not None:
            self.record_selection.append(store.counts / self.n_store)
        return o

    def _leaving(self) -> tuple[int, int] | None:
        """(position, slot) of the ring token that leaves the ring next, or None while the ring
        refills (none leaves)."""
        if not self.ring.full(self.offset, self.n_store):
            return None
        pos = self.S + self.n_store
        return pos, self.ring.slot(pos)

    def _views_of(self, layer: int) -> tuple:
        """numpy views for the steps, at full capacity (they read the first n_store columns; full
        views are contiguous): V [Hkv, cap, hd], z [Hq, cap]; the coded stores' PT [Hkv, g, cap]
        (None for exact keys), sel / lev [Hq, cap], rescore's host keys Kh [Hkv, cap, hd] (else None).
        Made again only when a buffer was reallocated (grown), not per layer and step."""
        bufs = (self.values, self.z, self.indices, self.sel, self.lev, self.host_keys)
        key = tuple(0 if b is None or b.data is None else b.data.data_ptr() for b in bufs)
        hit = self._views.get(layer)
        if hit is not None and hit[0] == key:
            return hit[1]
        # (each buffer at its own capacity: the pools grow apart, and a view of the indices cut to
        # the values' capacity is strided, which Numba compiles into a slower, unvectorized scan)
        views = (self.values.view(layer, self.values.cap).numpy(), self.z.data[..., 0].numpy(),
                 None if key[2] == 0 else self.indices.view(layer, self.indices.cap).numpy(),
                 self.sel.data[..., 0].numpy(), self.lev.data[..., 0].numpy().view(np.uint16),
                 None if self.host_keys is None else self.host_keys.view(layer, self.host_keys.cap).numpy())
        self._views[layer] = (key, views)
        return views
