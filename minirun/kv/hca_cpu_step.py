"""The CPU's one-call decode steps of the HCA cache (HCACache mixes this in).

A decode step with the ring full and the store encoded runs in one kernel call on the CPU
(kernels_cpu.hca_decode_attend, fastscan.hca_decode_attend_fs, hca_exact_decode_attend): sinks +
ring exactly, the new token, the selected store tokens, merged by log-sum-exp. HCACache._decode_step
decides when; these methods gather the call's numpy inputs and record what it did. They read the
cache's state (kv/hca.py documents the tiers) and add none of their own.
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu as kc
from kernels_cpu import fastscan as fs


class OneCallSteps:
    """HCACache's one-call CPU decode steps (chosen in HCACache._decode_step)."""

    def _attend_decode_step(self, layer, qs, k, v):
        """The common decode step (full ring, encoded store) in one kernel call: sinks + ring
        exactly, the new token itself, and the selected store tokens, merged by log-sum-exp."""
        n = self.n_store
        if self._fast_scan:
            return self._attend_fast_scan_step(layer, qs, k, v)
        cbt = self._codebooks_t()[layer]                          # (also makes the self._lut scratch)
        # nibble pairs without fast scan encode no ring key ahead: their codes come from the
        # factors, in _encode
        cnorm = None if self.layout.pairs else self._codebook_norms()[layer]   # (also makes self._pending)
        slot = None if self.layout.pairs or self.far else self._encode_ahead_slot()
        encode = None if slot is None else (slot, cnorm, self._pending[layer])
        PT, V, z, sel, lev, Kh = self._decode_views(layer)
        q, kn, EK = self._step_inputs(layer, qs, k)
        o = kc.hca_decode_attend(q, kn, v[0].float().numpy(), EK, self._ev_np[layer], self.S + self.W, cbt, PT, n,
                                 V, self.tau, self.q_to_kv, self._packed, self._lut, z, sel, self._counts,
                                 encode=encode, levels=(lev, self._hist), exact_valid=self._exact_valid(),
                                 host_keys=Kh)
        return self._step_done(layer, o, encode is not None)

    def _attend_fast_scan_step(self, layer, qs, k, v):
        """_attend_decode_step for nibble-pair codes on a CPU with AVX2 (kernels_cpu.fastscan)."""
        F, fnorm = self._factors()
        slot = None if self.far else self._encode_ahead_slot()
        encode = None if slot is None else (slot, self._pending[layer])
        PT, V, z, sel, lev, Kh = self._decode_views(layer)
        q, kn, EK = self._step_inputs(layer, qs, k)
        o = fs.hca_decode_attend_fs(q, kn, v[0].float().numpy(), EK, self._ev_np[layer], self.S + self.W, F[layer],
                                    PT, self.n_store, V, self.tau, self.q_to_kv, self._fs_lut, z, sel, self._counts,
                                    fnorm=fnorm[layer], encode=encode, levels=(lev, self._hist),
                                    exact_valid=self._exact_valid(), host_keys=Kh)
        return self._step_done(layer, o, encode is not None)

    def _encode_ahead_slot(self) -> int | None:
        """The slot of the ring token that leaves the ring next, whose codes the decode steps encode
        ahead (into self._pending, one layer at a time), or None while the ring refills (none leaves)."""
        if not self._ring_full():
            return None
        pos = self.S + self.n_store
        if pos != self._pending_pos:
            self._pending_pos = pos
            self._pending_done[:] = False
        return self._ring_slot(pos)

    def _step_done(self, layer, o, encoded: bool) -> torch.Tensor:
        """After a one-call step: its encode-ahead marked done, its selection recorded; -> [1, Hq, hd]."""
        if encoded:
            self._pending_done[layer] = True
        if self.record_selection is not None:
            self.record_selection.append(self._counts / self.n_store)
        return torch.from_numpy(o)[None]

    def _attend_exact_keys_step(self, layer, qs, k, v):
        """The decode step of a store of exact keys (the 50% preset) in one kernel call
        (kernels_cpu.exact_step): each store key read once, only the selected values."""
        n = self.n_store
        if self._hist is None:
            self._hist = kc.level_hist(self.Hq)
        K = self.exact_keys.view(layer, self.exact_keys.cap).numpy()    # full-capacity views: contiguous
        V = self.values.view(layer, self.values.cap).numpy()
        z = self.z.data[..., 0].numpy()
        q, kn, EK = self._step_inputs(layer, qs, k)
        o = kc.hca_exact_decode_attend(q, kn, v[0].float().numpy(), EK, self._ev_np[layer], self.S + self.W, K, n,
                                       V, self.tau, self.q_to_kv, self._lanes, z, self._hist, self._counts,
                                       exact_valid=self._exact_valid())
        return self._step_done(layer, o, False)

    def _step_inputs(self, layer, qs, k):
        """The one-call steps' query [Hq, hd], own key [Hkv, hd] and exact tier [Hkv, S + W, hd]
        (numpy); with far positions FarFrame.step_inputs' far query and turned ring."""
        if not self.far:
            return qs[0].numpy(), k[0].float().numpy(), self._ek_np[layer]
        return self.far.step_inputs(qs, k, self._ek_np[layer], self.ek[layer], self.S, self.offset)

    def _decode_views(self, layer: int) -> tuple:
        """numpy views for the decode kernel, at full capacity (it reads the first n_store columns):
        PT [Hkv, g, cap], V [Hkv, cap, hd], z / sel / lev [Hq, cap], and rescore's host keys
        Kh [Hkv, cap, hd] (else None). Made again only when a buffer was reallocated (grown), not
        six times per layer and step."""
        bufs = [self.indices, self.values, self.z, self.sel, self.lev]
        if self.host_keys is not None:
            bufs.append(self.host_keys)
        key = tuple(b.data.data_ptr() for b in bufs)
        hit = self._views.get(layer)
        if hit is not None and hit[0] == key:
            return hit[1]
        cap = self.values.cap
        views = (self.indices.view(layer, cap).numpy(), self.values.view(layer, cap).numpy(),
                 self.z.data[..., 0].numpy(), self.sel.data[..., 0].numpy(), self.lev.data[..., 0].numpy().view(np.uint16),
                 None if self.host_keys is None else self.host_keys.view(layer, self.host_keys.cap).numpy())
        self._views[layer] = (key, views)
        return views
