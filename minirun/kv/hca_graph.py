"""A whole HCA decode token inside a CUDA graph: the cache's side (minirun/model/cuda_graph.py replays it).

An eager decode step (hca_cuda.py) reads three host values per token: the store's length n (grid
sizes and loop bounds of scoring and selection), the ring slot the oldest token leaves from, and
the pool row it goes to (a copy at a host offset). Here they live in a small device state
[pos, slot, row, leaving pos] (int64; the row, = n, also read as int32 by the kernels' n_live)
that the host writes before each replay (graph_prepare); grids are sized for a bucket of n
(graph_key: one graph per bucket), the kernels read the live n (kernels_cuda scores.cu n_live).
After all layers commit_at evicts on the device (the pool's row written by store_rows), and
graph_advance does the host bookkeeping the eager advance does, without its copies. A ring short
of W tokens (after a truncate: the server's next question, a bench's next repetition) is captured
too: the exact tier's attention reads a device mask of its live slots (written before the replay),
and the eviction's writes land past the store's end, where nothing reads them, since the store
does not grow.

Capturable (graph_capturable, fixed per cache): the GPU's value sum (value_sum "gpu": no host part
in the step) and codebook keys. Length scaling's factor moves every token: it is written with the
state and applied to the scaled queries on the device (two small multiplies a layer). Per token
(graph_key): decode mode, every store key encoded, codebooks fitted, no selection probe, room in
the store; otherwise that token runs eagerly.
"""
from __future__ import annotations

import torch


class CapturedSteps:
    """Mixin of HCACacheCUDA: the capture protocol of minirun/cuda_graph.GraphedDecode
    (graph_capturable, graph_key, graph_prepare, attend_at, commit_at, graph_advance, and
    graph_snapshot / graph_restore around the capture's warm-ups)."""

    def graph_capturable(self) -> bool:
        return self.value_sum == "gpu" and not self.layout.exact_keys

    def _graph_state(self):
        """The device state [pos, slot, row, leaving pos] int64 and n_live (the row's int32 low word)."""
        if getattr(self, "_gstate", None) is None:
            self._gstate = torch.zeros(4, dtype=torch.int64, device=self.device)
            self._n_live = self._gstate.view(torch.int32)[4:5]     # little-endian: element 2's low word
            self.positions.on_device(self.device)   # (what a captured step's turns read there)
            self._length_factor = torch.ones(1, dtype=torch.float32, device=self.device)   # (length scaling)
        return self._gstate

    def graph_key(self, bucket: int):
        """(key, n_keys) when the next decode step can run inside a graph, else None. n_keys: the
        store length rounded up to the bucket (the grids' size); z and sel are reserved to it here,
        outside any capture, and their addresses are part of the key (a reallocation recaptures)."""
        n = self.n_store
        if not (self.graph_capturable() and self.mode == "hca" and n > 0 and self.n_encoded == n
                and self.codebooks is not None and self.record_selection is None and self.W > 0
                and n < self.values.max_cap and self.values.mapped):
            return None
        nb = min(self.values.max_cap, (n // bucket + 1) * bucket)
        self.z.reserve(nb)
        self.sel.reserve(nb)
        self.values.reserve(n + 1)
        self.indices.reserve(n + 1)
        self._graph_state()
        self._live_mask(graph=True)
        C = self._store_state().centroids
        T = self._decode_kernels().reserve_lut(C.shape[2], C.shape[3])
        # what a graph bakes in: the addresses (and strides) of everything that can be reallocated
        key = ("hca", nb) + tuple((t.data_ptr(), tuple(t.shape)) for t in (
            self.z.data, self.sel.data, self.indices.data, self.values.data, C, T))
        return key, nb

    def graph_prepare(self) -> None:
        """Before a replay: this token's state into device memory; the pool's eager eviction copies
        waited for on the GPU (the graph writes the pool itself)."""
        pos = self.offset
        st = torch.tensor([pos, self.ring.slot(pos), self.n_store, self.S + self.n_store], dtype=torch.int64)
        self._graph_state().copy_(st)
        self._live_mask(graph=True)
        self.positions.forget_upload()   # the graph writes ds.cs: an eager step (at any position) must write it again
        if self.length_ctx:   # _q_scale(1)'s factor, applied on the device after decode_prep's base scale
            self._length_factor.fill_(self._q_scale(1) / self.scale)
        self.values.device_wait()

    def rotates_at(self, n_heads: int, dtype) -> bool:
        """Whether attend_at takes q, k before RoPE (rope=: their position's cos | sin): decode_prep
        turns them as it stages the key (float32 / bfloat16 models, whose exact tier has their dtype)."""
        return dtype in (torch.float32, torch.bfloat16) and self.ek.dtype == dtype

    def attend_at(self, layer, q, k, v, pos, n_keys, rope=None):
        """_attend_hca with the GPU's value sum, every per-token value read from the device state:
        q [1, Hq, hd], k, v [1, Hkv, hd] -> [1, Hq, hd] (model dtype). pos: unused (the state has it);
        rope: [hd] cos | sin of the position where q, k are not turned yet (rotates_at)."""
        ds = self._decode_kernels()
        S, W = self.S, self.W
        st = self._graph_state()
        if layer == 0:   # this token's query turn (far positions), computed on the device
            self.positions.captured_turn(ds.cs, st[0:1])
        with ds.session() as L:
            qs, qf = ds.prep(L, q[0], k[0], v[0], self.scale, self._ekx[layer, :, S + W],
                             self._evx[layer, :, S + W], self.positions.far, self._histogram_cut(n_keys), rope)
            if self.length_ctx:   # (its factor moves every token: read from device memory)
                qs.mul_(self._length_factor)
                if qf is not qs:   # (far positions: a query of its own)
                    qf.mul_(self._length_factor)
            o = self._gpu_sum_launches(L, ds, layer, qs, qf, n_keys, self._mask, self._n_live)   # (graph_key made _mask)
        return (o if o.dtype == q.dtype else o.to(q.dtype))[None]

    def commit_at(self, pos) -> None:
        """After all layers, on the device: the ring's oldest token (slot) into the store (row): its
        key encoded (unrotated first with far positions), its values into the pool; the new token
        (decode_prep's spare rows) into the slot. (A short ring's slot is dead: row n is past the
        store's end then, and graph_advance leaves n as it was.)"""
        st = self._graph_state()
        slot, row = st[1:2], st[2:3]
        S, W = self.S, self.W
        K = self.ek.index_select(2, slot)                                   # [L, Hkv, 1, hd]
        V = self.ev.index_select(2, slot)
        K = self.positions.keys_leaving_at(K, st[3:4])                    # (far positions: unrotated)
        self.indices.data.index_copy_(2, row, self._encode(K))
        L, Hkv, cap, width = self.values.data.shape
        rows = self.value_codes.encode(V.reshape(L * Hkv, self.hd)).contiguous()   # [L Hkv, width] (codes: on the device)
        dst = self.values.data.view(L * Hkv, cap, width)
        if self.value_codes.quantized:   # (code rows as 16-bit elements: store_rows copies raw b16 / b32)
            rows, dst = rows.view(torch.int16), dst.view(torch.int16)
        ds = self._decode_kernels()
        with ds.session() as launcher:
            ds.store_rows(launcher, rows, dst, self._n_live)   # (n_live: the row)
        # (clones: the spare rows share the tiers' storage, which index_copy_ refuses as a source)
        self.ek.index_copy_(2, slot, self._ekx[:, :, S + W:S + W + 1].clone())
        self.ev.index_copy_(2, slot, self._evx[:, :, S + W:S + W + 1].clone())

    def graph_snapshot(self):
        """What commit_at overwrites and a later run of the same step reads: the ring slot's k, v."""
        slot = self.ring.slot(self.offset)
        return slot, self.ek[:, :, slot].clone(), self.ev[:, :, slot].clone()

    def graph_restore(self, snap) -> None:
        slot, k, v = snap
        self.ek[:, :, slot] = k
        self.ev[:, :, slot] = v

    def graph_advance(self) -> None:
        """After a replay: the host's bookkeeping of advance(1) (the graph did the device part). A
        short ring took the token into a dead slot: the store did not grow (the graph's eviction
        wrote the row past its end, which the next eviction overwrites)."""
        pos = self.offset
        slot, evicted = self.ring.slot(pos), self.ring.full(pos, self.n_store)
        self.n_store += evicted
        self.n_encoded = self.n_store
        self.ring.entered(pos, slot, evicted)
        self._step_done(pos)
