"""HCACacheCUDA: the HCA cache with its device tier on the GPU (CuPy kernels) and values on the host.

Tested on an H100 (2026-11-24: the GPU tests against the CPU cache; kernels_cuda/README.md, "GPU
backend") and, everywhere, on the CPU with the kernel emulator (kernels_cuda._emu), which runs the
same code with CPU tensors and no streams.

Where things live (CUDA device):
- device: sinks + ring (base class), key-store indices (or exact keys), codebooks, scratch z / sel;
  exact-mode prefill also keeps the store's values on the device until end_prefill (the exact
  prefill is dense attention anyway), anchor mode keeps the anchor block's values there;
- host: the value pool, page-locked and allocated once at capacity (minirun/kv/pinned.py says why),
  and small pinned staging buffers (the copied-back selection, the (o, m, l) stage).

One decode step of one layer (`_decode_step`), in issue order on the current (compute) stream S0 and
the copy stream S1:
  S0: build_lut, approx_scores (+ m, l), threshold_select (stats reused), gather of the scores of
      the first w selected slots, pack [counts | idx[:, :w] | z_sel[:, :w]] into one int32 tensor
  S1: waits for S0, copies the pack device->host (pinned), records sel_event
  S0: attend_exact over sinks + ring, the new token's own score   <- queued BEFORE the host waits
  host: sel_event.synchronize() (that copy only), wait for the last eviction copy's event,
      weighted_value_sum (Numba) of the copied scores (compact: no scatter) on the pinned pool,
      (o, m, l) into a pinned stage, copy host->device (non_blocking, on S0)
  S0: lse_merge of the three partials (exact tier, new token, store) -> next ops of the layer.
What overlaps: the host value sum of layer l with the GPU's exact-tier attention of layer l and
with eviction copies on S1. What cannot: layer l+1's projections need layer l's attention output,
so the GPU idles from the end of layer l's exact tier until the host sum is back (the host sum
is on the critical path once per layer); the host's enqueueing of layer l+1 also waits for it.
The width w of the copy-back is a guess (grows to the next power of two >= 1.25 max(counts) when a
step selects more; a wider second copy then fixes that step): one D2H round trip per layer normally.

Kernel launches per decode token: see `decode_launches` (the emulator test checks the count).
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu as kc
import kernels_cuda as kcu

from .attention import merge, partial_attention
from .codebooks import Codebooks
from .hca import HCACache
from .pinned import PinnedPool
from .store import GrowingBuffer

INITIAL_WIDTH = 1024   # selected tokens per head copied back on the first try


class HCACacheCUDA(HCACache):
    """HCACache with the GPU pipeline above; same tiers, modes and semantics as the CPU class."""
    uses_levels = False   # the GPU selects on float scores (kernels_cuda.threshold_select)

    def __init__(self, args, layout, capacity, sinks, window, tau, dtype, device, codebooks=None, **kw):
        super().__init__(args, layout, capacity, sinks, window, tau, dtype, device, codebooks, **kw)
        L, Hkv, Hq, hd = self.n_layers, self.Hkv, self.Hq, self.hd
        self._gpu = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._gpu else None
        store_cap = max(0, capacity - sinks - window)
        self.values = PinnedPool((L, Hkv), hd, self.values.dtype, store_cap, device, self._copy_stream)
        if self.indices is not None:   # at capacity: doubling a 11 GiB store held old + new + the allocator's
            # cache (a 4M prompt peaked at 26.9 GB of GPU memory for 11.2 GiB of indices on an H100)
            self.indices = GrowingBuffer((L, Hkv), layout.groups, self.indices.dtype, store_cap, device=device,
                                         at_capacity=True)
        self.exact_keys = GrowingBuffer((L, Hkv), hd, torch.float32, store_cap, device=device)
        self.z = GrowingBuffer((Hq,), 1, torch.float32, store_cap, device=device)
        self.sel = GrowingBuffer((Hq,), 1, torch.int32, store_cap, device=device)
        self.prefill_values = GrowingBuffer((L, Hkv), hd, dtype, store_cap, device=device)   # exact prefill
        self.anchor_v = None
        self.q2k_dev = torch.as_tensor(self.q_to_kv).to(device)
        self._q2k_long = self.q2k_dev.long()
        if codebooks is not None:   # moved to the device once
            self.codebooks = Codebooks(codebooks.centroids.float().to(device).contiguous(), codebooks.source)
        self._width = INITIAL_WIDTH
        self.second_copies = 0                  # steps whose copy-back guess was too narrow
        self._pack_host = None                  # pinned int32, grows with the copy-back width
        self._stage_host = self._host_empty((Hq, hd + 2), torch.float32)
        self._sel_event = torch.cuda.Event() if self._gpu else None
        self._h2d_event = torch.cuda.Event() if self._gpu else None
        self._h2d_pending = False
        self._valid_dev = None                  # (offset, device mask) of _exact_valid_dev

    @staticmethod
    def exact_tier_dtype(dtype, device):
        """The compute dtype: the CUDA kernels read bfloat16 (and the emulator runs them as they are)."""
        return dtype

    def _host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=self._gpu)

    @staticmethod
    def decode_launches(tau: float, n_exact_splits: int = 1, exact_keys: bool = False) -> dict:
        """Launches per layer of one decode step in HCA mode (times L for a token).

        kernels_cuda (checked against the emulator's launch log in tests/test_hca_cuda.py):
        build_lut 1 + approx_scores 2 (scores, ms_reduce) -- a torch bmm instead with exact keys --
        threshold_select 3 for 0 < tau < 1 (zhist, zcut, zcompact; stats reused) or 2 for tau >= 1,
        attend_exact 1 (2 when it splits K: nsplit > 1 in kernels_cuda.ops.attend_exact), lse_merge 1.
        torch on the device (float32 model; +3 casts for 16-bit): q scale 1, histogram memset 1
        (tau < 1), copy-back pack 4 (clamp, int64 cast, gather, cat), new-token part 4 (2 index,
        mul, sum), merge inputs 4 (3 stack, ones_like); plus 2 memcpys (D2H pack, H2D (o, m, l)).
        (While the ring refills after a truncate: one more H2D per step, the live-slot mask.)
        """
        k = (0 if exact_keys else 3) + (2 if tau >= 1.0 else 3) + (1 if n_exact_splits == 1 else 2) + 1
        t = 1 + (0 if tau >= 1.0 else 1) + 4 + 4 + 4 + (2 if exact_keys else 0)   # exact keys: bmm + copy
        return {"kernels_cuda": k, "torch": t, "memcpy": 2}

    # ---- attention ----------------------------------------------------------------------------
    def attend(self, layer, q, k, v):
        """q [T, Hq, hd], k, v [T, Hkv, hd] at positions offset.. -> [T, Hq, hd]. Stages k, v."""
        T = q.shape[0]
        self._staged[layer] = (k, v)
        qs = q.float() * self.scale
        if T == 1 and self.mode == "hca" and self.n_store > 0:   # (a short ring: its dead slots masked)
            return self._decode_step(layer, qs, k, v).to(q.dtype)
        qf = self.far.queries(qs, self.offset) if self.far else qs   # what reads sinks and store
        o1, m1, l1 = self._attend_exact_tier(layer, qs, k, v, qf)   # torch, on the device
        n = self.n_store
        if n == 0:
            return o1.to(q.dtype)
        if self.mode == "exact":
            o2, m2, l2 = partial_attention(qf, self.exact_keys.view(layer, n), self.prefill_values.view(layer, n))
        elif self.mode == "anchor":
            na = min(self.anchor_k.shape[2], n)
            o2, m2, l2 = partial_attention(qf, self.anchor_k[layer, :, :na], self.anchor_v[layer, :, :na])
        else:
            o2, m2, l2 = self._attend_store_hca(layer, qf)
        o, _, _ = merge((o1, m1, l1), (o2, m2, l2))
        return o.to(q.dtype)

    def _decode_step(self, layer, qs, k, v):
        q = qs[0]                                                                 # [Hq, hd] f32
        qf = self.far.queries(qs, self.offset)[0] if self.far else q              # reads unrotated keys
        sel = self._select(layer, qf)                                             # GPU + async D2H
        # queued before the host waits: the GPU runs these while the host sums values
        parts = self._exact_parts(layer, q, qf)
        kn, vn = k[0].float()[self._q2k_long], v[0].float()[self._q2k_long]       # the new token
        parts.append((vn, (q * kn).sum(-1), torch.ones(self.Hq, device=q.device)))
        parts.append(self._host_sum(layer, *sel))
        o, _, _ = kcu.lse_merge(*(torch.stack(x) for x in zip(*parts)))
        return o[None]

    def _exact_parts(self, layer, q, qf):
        """attend_exact over sinks + ring -> [(o, m, l)]; with far positions the sinks (unrotated)
        take the far query qf in a launch of their own."""
        valid = self._exact_valid_dev()
        if not self.far:
            return [kcu.attend_exact(q, self.ek[layer], self.ev[layer], self.q2k_dev, self.S + self.W, valid=valid)]
        S, ek, ev = self.S, self.ek[layer], self.ev[layer]
        cut = (None, None) if valid is None else (valid[:S], valid[S:])
        return [kcu.attend_exact(q, ek[:, S:], ev[:, S:], self.q2k_dev, self.W, valid=cut[1]),
                kcu.attend_exact(qf, ek[:, :S], ev[:, :S], self.q2k_dev, S, valid=cut[0])]

    def _exact_valid_dev(self):
        """The live sinks + ring slots (HCACache._exact_valid) as a device uint8 [S + W] mask while
        the ring is short after a truncate (one small host->device copy per step, shared by the
        layers), else None: attend_exact then reads every slot."""
        valid = self._exact_valid()
        if valid is None:
            return None
        if self._valid_dev is None or self._valid_dev[0] != self.offset:
            self._valid_dev = (self.offset, torch.from_numpy(valid.copy()).to(self.device))
        return self._valid_dev[1]

    def _attend_store_hca(self, layer, qs):
        """Several queries (prefill in hca mode, ring not full): one selection round trip each."""
        outs = [self._host_sum(layer, *self._select(layer, qs[t])) for t in range(qs.shape[0])]
        return tuple(torch.stack(x) for x in zip(*outs))

    def _select(self, layer, q):
        """Launch scores + selection for one query [Hq, hd]; start the copy-back. Returns a handle."""
        n, ne = self.n_store, self.n_encoded
        zb = self.z.data[..., 0]                                                  # [Hq, cap]
        z = zb[:, :n]
        stats = None
        if ne:
            lut = kcu.build_lut(q, self._codebooks_dev()[layer], self.q2k_dev)
            _, stats = kcu.approx_scores(lut, self.indices.data[layer], self.q2k_dev, ne, out=zb)
        if n > ne:   # keys not (yet) encoded: exact scores, positions [ne, n)
            Kx = self.exact_keys.view(layer, n - self.exact_base)
            z[:, ne:] = torch.bmm(q.view(self.Hkv, -1, self.hd), Kx.transpose(1, 2)).reshape(self.Hq, -1)
            stats = None
        idx, counts, _, _ = kcu.threshold_select(z, self.tau, out_idx=self.sel.data[..., 0], stats=stats)
        cap = self.max_select
        if cap and n > cap:   # the selection is a top set: its first min(count, cap) of the sorted top `cap`
            idx = torch.topk(z, cap, dim=1, sorted=True).indices.to(torch.int32)   # (kv/select_cap.py)
            counts = counts.clamp(max=cap)
        w = min(n, idx.shape[1], self._width)   # (idx: the [Hq, >= n] scratch, or [Hq, cap] when capped)
        return (self._copy_back(z, idx, counts, w), w, z, idx, counts)

    def _copy_back(self, z, idx, counts, w):
        """[counts | idx[:, :w] | z at those idx], each block whole (the host sum reads idx and z
        as contiguous [Hq, w] arrays, no copy) -> pinned host buffer, on the copy stream."""
        n = z.shape[1]
        s = idx[:, :w]
        zs = torch.gather(z, 1, s.clamp(0, n - 1).long())    # slots past counts hold scratch: clamp
        pack = torch.cat([counts, s.reshape(-1), zs.view(torch.int32).reshape(-1)])   # [Hq (2w + 1)] int32
        if self._pack_host is None or self._pack_host.numel() < pack.numel():
            self._pack_host = self._host_empty((pack.numel(),), torch.int32)
        host = self._pack_host[:pack.numel()]
        if not self._gpu:
            host.copy_(pack)
            return host
        cur = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(cur)
        pack.record_stream(self._copy_stream)
        with torch.cuda.stream(self._copy_stream):
            host.copy_(pack, non_blocking=True)
        self._sel_event.record(self._copy_stream)
        return host

    def _host_sum(self, layer, host, w, z, idx, counts):
        """Wait for the copy-back only, sum the selected host values, send (o, m, l) to the device."""
        if self._gpu:
            self._sel_event.synchronize()
        Hq = self.Hq
        cnt = host[:Hq].numpy()
        cmax = int(cnt.max())
        if cmax > w:   # the guessed width was too small: a second, wide enough copy
            self.second_copies += 1
            self._width = 1 << int(cmax + cmax // 4).bit_length()       # > 1.25 cmax
            w = min(z.shape[1], idx.shape[1], self._width)               # >= cmax (cmax <= n, cap)
            host = self._copy_back(z, idx, counts, w)
            if self._gpu:
                self._sel_event.synchronize()
            cnt = host[:Hq].numpy()
        if self.record_selection is not None:
            self.record_selection.append(cnt / z.shape[1])
        self.values.wait()                                        # eviction copies have landed
        hn = host.numpy()
        idx_h = hn[Hq:Hq + Hq * w].reshape(Hq, w)
        zs_h = hn[Hq + Hq * w:].view(np.float32).reshape(Hq, w)          # zs_h[h, t]: score of idx_h[h, t]
        V = self.values.data[layer].numpy()                       # [Hkv, cap, hd], pinned
        o, m, l = kc.weighted_value_sum(zs_h, idx_h, cnt, V, self.q_to_kv, compact=True)
        if self._h2d_pending:                                     # the stage is free again
            self._h2d_event.synchronize()
        st = self._stage_host
        st[:, :self.hd] = torch.from_numpy(o)
        st[:, self.hd] = torch.from_numpy(m)
        st[:, self.hd + 1] = torch.from_numpy(l)
        dev = torch.empty_like(st, device=self.device)
        dev.copy_(st, non_blocking=self._gpu)                     # on the current stream
        if self._gpu:
            self._h2d_event.record(torch.cuda.current_stream(self.device))
            self._h2d_pending = True
        return dev[:, :self.hd], dev[:, self.hd], dev[:, self.hd + 1]

    # ---- moving tokens between tiers ----------------------------------------------------------------
    def _codebooks_dev(self) -> torch.Tensor:
        C = self.codebooks.centroids
        # (nibble pairs: the GPU reads the product codebooks only, so their factors are not kept)
        if (C.device != self.device or C.dtype != torch.float32 or not C.is_contiguous()
                or self.codebooks.factors is not None):
            self.codebooks = Codebooks(C.float().to(self.device).contiguous(), self.codebooks.source)
        return self.codebooks.centroids

    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] (device) -> indices [L, Hkv, m, g] (device), one launch for all layers."""
        L, Hkv, m, hd = K.shape
        C = self._codebooks_dev()
        P = kcu.encode_keys(K.reshape(L * Hkv, m, hd), C.reshape(L * Hkv, *C.shape[2:]))
        return P.view(L, Hkv, m, -1)

    def _store_append(self, K, V, codes=None):
        """As the base class (values go to the pinned pool asynchronously, keys are encoded on the
        GPU), plus the device copies of values the exact / anchor prefill attends to. (codes: always
        None here; only the CPU decode step encodes ahead.)"""
        j0, m = self.n_store, K.shape[2]
        super()._store_append(K, V, codes)
        if self.mode == "exact":
            self.prefill_values.reserve(j0 + m)
            self.prefill_values.write_all(j0, V)
        if self.anchor_v is not None and j0 < self.anchor_v.shape[2]:
            cnt = min(m, self.anchor_v.shape[2] - j0)
            self.anchor_v[:, :, j0:j0 + cnt] = V[:, :, :cnt]

    def begin_prefill(self, mode: str) -> None:
        super().begin_prefill(mode)
        if self.mode == "anchor":
            L, Hkv, _, hd = self.ek.shape
            self.anchor_v = torch.zeros(L, Hkv, max(0, self.anchor_tokens - self.S), hd, dtype=self.dtype,
                                        device=self.device)

    def end_prefill(self) -> None:
        super().end_prefill()
        self.prefill_values.free()
        self.anchor_v = None

    def truncate(self, n: int) -> bool:
        self._valid_dev = None
        return super().truncate(n)

    def reset(self) -> None:
        self.values.wait()
        self._valid_dev = None
        super().reset()
        self.prefill_values.free()
        self.anchor_v = None

    def stats(self) -> dict:
        s = super().stats()
        s.pop("total_bytes")
        s["prefill_values_bytes"] = self.prefill_values.nbytes + (
            self.anchor_v.numel() * self.anchor_v.element_size() if self.anchor_v is not None else 0)
        pack = self._pack_host.numel() * 4 if self._pack_host is not None else 0
        s["host_scratch_bytes"] = pack + self._stage_host.numel() * 4
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s
