"""The CPU cache's key stores: each encodes the keys that leave the ring and scores the store in
its kind's one-call step (kernels_cpu), owning the copies its kernels make of the codebooks and
the scratch they write.

- ExactKeys: full-precision keys (the cache's exact_keys [L, Hkv, cap, hd] f32: the 50% preset, and
  any store before its codebooks exist): kernels_cpu.hca_exact_decode_attend. It also holds the
  level-bucket counts (kc.level_hist) that every store's selection writes.
- CodebookKeys: codebook indices [L, Hkv, g, cap] (group-major): kernels_cpu.hca_decode_attend over
  the query's lookup table packed as integers; encoded by kernels_cpu.encode_keys.
- PairKeys: nibble pairs [L, Hkv, G/2, cap] uint8 scored by fast scan (kernels_cpu.fastscan, AVX2),
  encoded on the 16-centroid factor codebooks.
- ProductPairKeys: nibble pairs where fast scan is not available: encoded as PairKeys, scored as
  CodebookKeys over the product codebooks (each byte is an index into them: Codebooks.paired).

The copies of the codebooks are made when a step or an encode first meets a codebook set (the
cache fits, loads or is given new ones). A decode step of CodebookKeys or PairKeys also encodes
the ring key that leaves next while the layer's codebooks are in cache; advance takes those codes
(take_pending) instead of encoding the key again. Not with far positions: keys leave the ring
unrotated, while the step reads the ring turned.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import kernels_cpu as kc
from kernels_cpu import fastscan as fs


class Heads(NamedTuple):
    """The cache's shape as its key stores see it."""
    n_layers: int
    Hq: int
    Hkv: int
    q_to_kv: np.ndarray      # int32 [Hq]: each query head's kv head


class StoreState(NamedTuple):
    """What one step reads of the cache's state (HCACache._one_call makes it)."""
    n_store: int             # tokens in the store
    tau: float               # the softmax mass the selection keeps
    cap: object              # the layer's selection cap: int64 [Hq] per head (-1 skips the store) or one int
    codebooks: object        # the cache's Codebooks (None before they are fitted)
    exact_keys: object       # the full-precision keys (kv/store.GrowingBuffer [L, Hkv, cap, hd] f32)


def key_stores(heads: Heads, layout, far: bool, fast_scan: bool) -> tuple:
    """(exact, store) for a cache of `heads` and `layout` (hca_layout.Layout; far: far positions on):
    the store the layout names, and the exact-keys store that scores a store with no key encoded
    yet (the same object where the layout keeps exact keys)."""
    exact = ExactKeys(heads)
    if layout.exact_keys:
        return exact, exact
    kind = (PairKeys if fast_scan else ProductPairKeys) if layout.pairs else CodebookKeys
    return exact, kind(heads, layout, far, exact)


class KeyStore:
    """encode(K [L, Hkv, m, hd], codebooks) -> indices [L, Hkv, m, g] (torch); step(st, layer, q, kn,
    vn, EK, EV, n_exact, valid, views, leaving) -> o [Hq, hd] f32: one query's call of the store's
    kernel (st: StoreState; views the cache's buffers from HCACache._views_of; leaving: (position,
    slot) of the ring key to encode ahead, or None),
    after which counts holds each query head's selection size; take_pending(pos); for the stats,
    `scratch` (fixed-size arrays) and copy_bytes(codebooks) (of the arrays made from them)."""
    encodes_ahead = False

    def __init__(self, heads: Heads):
        self.q_to_kv = heads.q_to_kv
        self.lanes = kc.lane_map(heads.q_to_kv, heads.Hkv)     # query heads in the tables' 16-bit lanes
        self.counts = np.zeros(heads.Hq, np.int32)
        self.scratch, self.copies = [], []
        self.bound = None                               # the codebook set `copies` are of

    def take_pending(self, pos: int):
        """The codes [L, Hkv, 1, g] encoded ahead for the key at pos, or None; either way they are
        used up (pos -1: dropped, after the ring changed)."""
        return None

    def copy_bytes(self, codebooks) -> int:
        return sum(a.nbytes for a in self.copies) if codebooks is self.bound else 0


class ExactKeys(KeyStore):
    def __init__(self, heads: Heads):
        super().__init__(heads)
        self.hist = None

    def levels(self) -> np.ndarray:
        """The per-thread level-bucket counts (kc.level_hist), made on first use."""
        if self.hist is None:
            self.hist = kc.level_hist(self.counts.shape[0])
            self.scratch = [self.hist]
        return self.hist

    def step(self, st: StoreState, layer, q, kn, vn, EK, EV, n_exact, valid, views, leaving):
        K = st.exact_keys.view(layer, st.exact_keys.cap).numpy()
        return kc.hca_exact_decode_attend(q, kn, vn, EK, EV, n_exact, K, st.n_store, views[0], st.tau, self.q_to_kv,
                                          self.lanes, views[1], self.levels(), self.counts, exact_valid=valid,
                                          cap=st.cap)


class CodedKeys(KeyStore):
    """A store of codes. bind(cb) makes the subclass's copies of codebook set cb (_copies) and, once,
    its fixed scratch (_scratch), taking the exact store's level-bucket counts; encode flattens the
    layers for the subclass's encoder (_encode: K [L * Hkv, m, hd] f32 -> [L * Hkv, m, g]). Where
    the kind encodes ahead, codes [L, Hkv, 1, g] hold what the decode steps encoded for the ring
    key at position `pending`, one layer a call (done[layer]); advance takes them once all have."""
    encodes_ahead = True

    def __init__(self, heads: Heads, layout, far: bool, exact: ExactKeys):
        super().__init__(heads)
        self.exact, self.Hq, self.hist = exact, heads.Hq, None
        code_type = np.uint8 if layout.index_bytes == 1 else np.int16
        self.codes = (np.empty((heads.n_layers, heads.Hkv, 1, layout.groups), code_type)
                      if self.encodes_ahead else None)
        self.done, self.pending = np.zeros(heads.n_layers, bool), -1
        self.encodes_ahead = self.encodes_ahead and not far

    def bind(self, cb) -> None:
        self.copies = self._copies(cb)
        if not self.scratch:
            self.scratch = self._scratch() + ([] if self.codes is None else [self.codes])
            self.hist = self.exact.levels()
        self.bound, self.pending = cb, -1          # (codes encoded ahead were of the previous set)

    def _ahead(self, layer: int, pos: int) -> np.ndarray:
        """codes[layer], about to be written for the key at pos (a new pos starts over)."""
        if pos != self.pending:
            self.pending, self.done[:] = pos, False
        return self.codes[layer]

    def take_pending(self, pos: int):
        codes = torch.from_numpy(self.codes) if pos == self.pending >= 0 and self.done.all() else None
        self.pending = -1
        return codes

    def encode(self, K: torch.Tensor, codebooks) -> torch.Tensor:
        if codebooks is not self.bound:
            self.bind(codebooks)
        L, Hkv, m, hd = K.shape
        return torch.from_numpy(self._encode(K.float().reshape(L * Hkv, m, hd).numpy())).view(L, Hkv, m, -1)


class CodebookKeys(CodedKeys):
    """Copies: the codebooks transposed [L, Hkv, g, ds, c] (the LUT kernel, and the encoder of a few
    tokens) and their norms ||c||^2 [L, Hkv, g, c] (the encoder); scratch: the lookup table f32
    [Hq, g, c], its packed form (kc.PackedLUT) and the codes encoded ahead."""

    def _copies(self, cb) -> list:
        C = cb.centroids.numpy()
        self.cbt = np.ascontiguousarray(C.transpose(0, 1, 2, 4, 3))
        self.cnorm = kc.codebook_norms(_flat(C)).reshape(C.shape[:-1])
        return [self.cbt, self.cnorm]

    def _scratch(self) -> list:
        Hq, g, c = self.Hq, self.cbt.shape[2], self.cbt.shape[4]
        self.lut = np.empty((Hq, g, c), np.float32)
        self.packed = p = kc.PackedLUT(np.empty((self.lanes.shape[0], g, c), np.uint64), self.lanes,
                                       np.empty(Hq, np.float32), np.empty(Hq, np.float32))
        return [self.lut, p.tables, p.scale, p.offset, p.top, p.shift]

    def _encode(self, K):
        C = self.bound.centroids.numpy()
        return kc.encode_keys(K, _flat(C), cnorm=_flat(self.cnorm), codebooks_t=_flat(self.cbt))   # (its path by m)

    def step(self, st: StoreState, layer, q, kn, vn, EK, EV, n_exact, valid, views, leaving):
        V, z, PT, sel, lev, Kh = views
        if st.codebooks is not self.bound:
            self.bind(st.codebooks)
        encode = None if leaving is None else (leaving[1], self.cnorm[layer], self._ahead(layer, leaving[0]))
        o = kc.hca_decode_attend(q, kn, vn, EK, EV, n_exact, self.cbt[layer], PT, st.n_store, V, st.tau, self.q_to_kv,
                                 self.packed, self.lut, z, sel, self.counts, encode=encode, levels=(lev, self.hist),
                                 exact_valid=valid, host_keys=Kh, cap=st.cap)
        if encode is not None:
            self.done[layer] = True
        return o


class PairKeys(CodedKeys):
    """Copies: the 16-centroid factor codebooks transposed [L, Hkv, G, ds, 16] f32 and their norms
    [L, Hkv, G, 16] (the encoder and the fast-scan tables); scratch: fs.FastScanLUT and the codes
    encoded ahead."""

    def _copies(self, cb) -> list:
        self.F = np.ascontiguousarray(cb.factors.numpy().transpose(0, 1, 2, 4, 3))
        self.fnorm = fs.factor_norms(self.F)
        return [self.F, self.fnorm]

    def _scratch(self) -> list:
        self.lut = fs.FastScanLUT(self.Hq, self.F.shape[2], self.lanes)
        return self.lut.arrays

    def _encode(self, K):
        return fs.encode_pairs(K, _flat(self.F), _flat(self.fnorm))

    def step(self, st: StoreState, layer, q, kn, vn, EK, EV, n_exact, valid, views, leaving):
        V, z, PT, sel, lev, Kh = views
        if st.codebooks is not self.bound:
            self.bind(st.codebooks)
        encode = None if leaving is None else (leaving[1], self._ahead(layer, leaving[0]))
        o = fs.hca_decode_attend_fs(q, kn, vn, EK, EV, n_exact, self.F[layer], PT, st.n_store, V, st.tau, self.q_to_kv,
                                    self.lut, z, sel, self.counts, fnorm=self.fnorm[layer], encode=encode,
                                    levels=(lev, self.hist), exact_valid=valid, host_keys=Kh, cap=st.cap)
        if encode is not None:
            self.done[layer] = True
        return o


class ProductPairKeys(CodebookKeys):
    """Copies: the product codebooks transposed (CodebookKeys' step) and the factors with their norms
    (PairKeys' encoder); scratch: CodebookKeys' lookup tables. No codes encoded ahead: the step's
    encoder would search the product codebooks, not the factors the store's codes come from."""
    encodes_ahead = False
    _encode = PairKeys._encode

    def _copies(self, cb) -> list:
        self.cbt = np.ascontiguousarray(cb.centroids.numpy().transpose(0, 1, 2, 4, 3))
        return [self.cbt] + PairKeys._copies(self, cb)


def _flat(a: np.ndarray) -> np.ndarray:
    """[L, Hkv, ...] -> [L * Hkv, ...]: the encoders take every layer's heads in one call."""
    return a.reshape(-1, *a.shape[2:])
