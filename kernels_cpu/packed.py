"""Approximate scores from integer-packed lookup tables: the CPU's scoring path for HCA.

Float product-quantization scores add g float32 table entries per (token, query head)
(kernels_cuda's approx_scores; approx_scores_ref in tests/support/references/cpu.py). On a CPU that is
bound by loads, not arithmetic: each (token, group) index costs one scalar load and add per query
head of the kv-head. Here each query head's table is quantized to unsigned integers (SWAR, "SIMD
within a register"):

  qmax = 65535 // g                      (g values of at most qmax never overflow 16 bits)
  lo[h, i] = min_j T[h, i, j]
  s[h] = max_i (max_j T[h, i, j] - lo[h, i]) / qmax
  Q[h, i, j] = floor((T[h, i, j] - lo[h, i]) / s[h] + 1/2)  in [0, qmax]
  z[h, j] = s[h] * sum_i Q[h, i, P[j, i]] + sum_i lo[h, i]

and the tables of up to 4 query heads that share a kv-head go into the four 16-bit lanes of one
uint64, so one 64-bit load and one integer add score all of them; no lane carries into the next.
The indices are read group-major (PT [Hkv, g, n]) and a block of tokens is scored four groups at a
time, so their tables (c x 8 bytes each, 8 KB at c = 1024) stay in the L1 cache.

Accuracy: |z - z_float| <= g * s[h] / 2 plus float32 rounding of the final multiply-add; s[h] is
the widest group's range / qmax (g = 16: 1/4095 of it). That is far below the error of the
product quantization itself (the codebooks), and the selection that follows is approximate anyway.

The fused step (kernels_cpu.hca_step) makes the tables with the lookup table itself (`_k_lut_pack`)
and sums them per token block (`_accumulate_block`, in kernels_cpu.level_select's scoring pass,
which keeps the sums as integer levels).
Reference: pack_lut_ref, packed_scores_ref in tests/support/references/cpu.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import _as_i32, _min_max, _prefetch
from .pq import _nearest

LANES = 4            # 16-bit lanes of a uint64
_BLOCK = 1024        # tokens scored per task: the uint64 accumulators (8 KB) stay in L1


class PackedLUT:
    """tables uint64 [R, g, c] (row r serves kv-head r // (R // Hkv)); lanes int32 [R, 4]: the query
    head in each 16-bit lane (-1: empty); scale, offset f32 [Hq]: z = scale * lane_sum + offset;
    top int64 [Hq]: sum over groups of the largest table entry (no lane sum exceeds it); shift int64
    [Hq]: the level buckets of kernels_cpu.level_select. The fused step fills the tables, scale,
    offset, top and shift (`_k_lut_pack`); lanes are lane_map's."""
    __slots__ = ("tables", "lanes", "scale", "offset", "top", "shift")

    def __init__(self, tables: np.ndarray, lanes: np.ndarray, scale: np.ndarray, offset: np.ndarray):
        self.tables, self.lanes, self.scale, self.offset = tables, lanes, scale, offset
        self.top = np.zeros(scale.shape[0], np.int64)
        self.shift = np.zeros(scale.shape[0], np.int64)


_BUCKET_LOGITS = 1.0 / 32   # the widest level bucket of level_select, in logits


@njit(cache=True)
def _bucket_shift(s):
    """The largest sh <= 15 with s * 2**sh <= 1/32 (0 when one level is wider): level buckets of
    2**sh levels span at most 1/32 of a logit."""
    sh = 0
    while sh < 15 and np.float64(s) * (1 << (sh + 1)) <= _BUCKET_LOGITS:
        sh += 1
    return sh


def lane_map(q_to_kv, Hkv: int) -> np.ndarray:
    """q_to_kv int32 [Hq] -> lanes int32 [Hkv * npass, 4], npass = ceil(max heads per kv-head / 4):
    the query heads of kv-head kv fill rows kv * npass .. kv * npass + npass - 1 in order."""
    q_to_kv = _as_i32(q_to_kv)
    per = np.bincount(q_to_kv, minlength=Hkv)
    npass = max(1, -(-int(per.max(initial=0)) // LANES))
    lanes = np.full((Hkv * npass, LANES), -1, np.int32)
    for kv in range(Hkv):
        for t, h in enumerate(np.flatnonzero(q_to_kv == kv)):
            lanes[kv * npass + t // LANES, t % LANES] = h
    return lanes


@njit(cache=True, parallel=True)
def _k_lut_pack(q, cbt, lanes, T, tables, scale, offset, top, shift, encode, key, cnorm, codes):
    # The lookup table and its packing in one pass over the codebooks, one task per (kv-head, group)
    # for all of its query heads (each group's codebook read once for them all);
    # with `encode`, the same task also encodes group i of key [Hkv, d] into codes [Hkv, 1, g]
    # (the ring key that leaves next). T [Hq, g, c] f32 <- T[h, i, j] =
    # q[h, i*ds:(i+1)*ds] . codebooks[q_to_kv[h], i, j] (reference: build_lut_ref).
    Hkv, g, ds, c = cbt.shape
    Hq = T.shape[0]
    npass = lanes.shape[0] // Hkv
    lo = np.empty((Hq, g), np.float32)
    width = np.empty((Hq, g), np.float32)
    for t in prange(Hkv * g):
        kv, i = t // g, t % g
        Cti = cbt[kv, i]
        for r in range(kv * npass, (kv + 1) * npass):
            for e in range(LANES):
                h = lanes[r, e]
                if h < 0:
                    continue
                Thi = T[h, i]
                for j in range(c):
                    Thi[j] = 0.0
                for k in range(ds):
                    qk = q[h, i * ds + k]
                    row = Cti[k]
                    for j in range(c):
                        Thi[j] += qk * row[j]
                lo[h, i], hi = _min_max(Thi, c)
                width[h, i] = hi - lo[h, i]
        if encode:
            codes[kv, 0, i] = _nearest(key[kv], i, Cti, cnorm[kv, i], np.empty(c, np.float32))
    _k_quantize(T, lanes, lo, width, tables, scale, offset, top, shift)


@njit(inline="always")
def _head_step(lo, width, qmax):
    """One head's quantization from its tables' row minima lo [g] and ranges width [g] f32, rows
    quantized to [0, qmax] -> (scale s = the widest range / qmax, offset = sum lo (float64 sum,
    f32), top = the sum of the rows' largest entries, the level buckets' shift, inv = 1 / s f32).
    The largest entry of each quantized row is its largest T's (the rounding is monotone), so top
    bounds every level sum."""
    g = lo.shape[0]
    w = width.max()
    s = np.float32(np.float64(w) / qmax) if w > 0 else np.float32(1.0)
    inv = np.float32(1.0 / np.float64(s))
    off = 0.0
    tp = 0
    for i in range(g):
        off += np.float64(lo[i])
        tp += np.int64(min(max(np.floor(width[i] * inv + np.float32(0.5)), np.float32(0.0)), np.float32(qmax)))
    return s, np.float32(off), tp, _bucket_shift(s), inv


@njit(inline="always")
def _quantize(x, lo, inv, qmax):
    """A table entry x as its integer level in [0, qmax] (a float32 holding an integer)."""
    return min(max(np.floor((x - lo) * inv + np.float32(0.5)), np.float32(0.0)), np.float32(qmax))


@njit(cache=True, parallel=True)
def _k_quantize(T, lanes, lo, width, tables, scale, offset, top, shift):
    # The packing after the rows' minima / ranges: per-head steps, then the packed tables.
    Hq, g, c = T.shape
    qmax = 65535 // g
    inv = np.empty(Hq, np.float32)
    for h in range(Hq):                            # 2. each head's step (its widest group) and offset
        scale[h], offset[h], top[h], shift[h], inv[h] = _head_step(lo[h], width[h], qmax)
    R = lanes.shape[0]
    for t in prange(R * g):                        # 3. quantize, 4 heads per uint64, in one pass
        r, i = t // g, t % g
        out = tables[r, i]
        h0, h1, h2, h3 = lanes[r, 0], lanes[r, 1], lanes[r, 2], lanes[r, 3]
        if h0 < 0:                                 # a kv-head without query heads
            out[:] = 0
            continue
        # an empty lane reads head h0's row and is masked to 0
        m1 = np.uint64(0xFFFF) if h1 >= 0 else np.uint64(0)
        m2 = np.uint64(0xFFFF) if h2 >= 0 else np.uint64(0)
        m3 = np.uint64(0xFFFF) if h3 >= 0 else np.uint64(0)
        h1, h2, h3 = max(h1, h0), max(h2, h0), max(h3, h0)
        T0, T1, T2, T3 = T[h0, i], T[h1, i], T[h2, i], T[h3, i]
        l0, l1, l2, l3 = lo[h0, i], lo[h1, i], lo[h2, i], lo[h3, i]
        v0, v1, v2, v3 = inv[h0], inv[h1], inv[h2], inv[h3]
        for j in range(c):
            x0 = _quantize(T0[j], l0, v0, qmax)
            x1 = _quantize(T1[j], l1, v1, qmax)
            x2 = _quantize(T2[j], l2, v2, qmax)
            x3 = _quantize(T3[j], l3, v3, qmax)
            out[j] = (np.uint64(np.int32(x0)) | ((np.uint64(np.int32(x1)) & m1) << np.uint64(16))
                      | ((np.uint64(np.int32(x2)) & m2) << np.uint64(32))
                      | ((np.uint64(np.int32(x3)) & m3) << np.uint64(48)))


@njit(inline="always")
def _accumulate_block(tables, r, PT, kv, j0, L, acc):
    """acc[:L] = the packed lane sums of tokens j0 .. j0 + L over all groups, table row r, kv-head kv
    (four groups at a time, their tables (4 x 8 KB at c = 1024) in L1: one read-modify-write of
    acc per four lookups instead of per lookup)."""
    g, cap = tables.shape[1], PT.shape[2]
    acc[:L] = 0
    base = np.int64(kv) * g * cap + j0             # flat offset of group 0's indices of this block
    step = 64 // PT.itemsize
    i = 0
    while i < g:
        # the groups' index rows are cap apart, 2 KB each per block: too short for the hardware
        # prefetcher to ramp up on, so prefetch the next groups' while scoring these
        for nx in range(i + 4, min(i + 8, g)):
            for e in range(0, L, step):
                _prefetch(PT, base + nx * cap + e)
        if i + 4 <= g:
            T0, T1, T2, T3 = tables[r, i], tables[r, i + 1], tables[r, i + 2], tables[r, i + 3]
            P0, P1 = PT[kv, i, j0:j0 + L], PT[kv, i + 1, j0:j0 + L]
            P2, P3 = PT[kv, i + 2, j0:j0 + L], PT[kv, i + 3, j0:j0 + L]
            for u in range(L):                     # the masks: indices are < 32768, never wrap
                acc[u] += ((T0[np.int32(P0[u]) & 0x7FFF] + T1[np.int32(P1[u]) & 0x7FFF])
                           + (T2[np.int32(P2[u]) & 0x7FFF] + T3[np.int32(P3[u]) & 0x7FFF]))
            i += 4
        else:
            Ti, Pi = tables[r, i], PT[kv, i, j0:j0 + L]
            for u in range(L):
                acc[u] += Ti[np.int32(Pi[u]) & 0x7FFF]
            i += 1
