"""HCA scoring and selection on the packed tables' integer levels (the CPU decode path).

packed_scores (kernels_cpu.packed) makes every score z = scale[h] * L + offset[h] from an integer
level L = sum_i Q[h, i, P[j, i]] in [0, top[h]], top[h] = sum_i max_j Q[h, i, j]. The selection can
work on the levels themselves, with no float score and no exp per token:

1. The scoring pass writes L as uint16 (2 bytes instead of a 4-byte float) and counts the tokens
   per level bucket below top: b = min((top - L) >> sh, NB - 1), where sh (PackedLUT.shift) is the
   largest shift with w = scale * 2**sh <= 1/32 of a logit (sh = 0 when one level is wider).
2. Per head, bucket b's softmax mass is estimated as count_b * exp(-w (b - b_top)) (b_top the top
   non-empty bucket; one multiply per bucket), and the cut is the first bucket b* from the top at
   which the cumulative estimate reaches tau times the total.
3. One pass collects {j : (top - L_j) >> sh <= b*} (the boundary bucket whole) in increasing token
   order, with each selected token's float score, compacted (what the value sum reads).

Bound: a bucket's tokens lie within w / 2 of its centre, so each estimate is within a factor
exp(+-w / 2) of the bucket's exact mass: the selection holds at least tau * exp(-w) of the exact
softmax mass over these scores, and the selection without its boundary bucket less than
tau * exp(w) (0.872 and 0.929 at tau = 0.9, w = 1/32); one level per bucket (sh = 0) is exact.
The NB buckets reach NB * w >= 64 logits below top, but top only bounds the best score from
above: when the last (catch-all) bucket is within 40 logits of the top non-empty bucket, that
head is selected by threshold_select on its float scores instead (the exact minimal set).

tau >= 1 selects every token, tau <= 0 none. Reference: packed_select_ref in tests/references/cpu.py.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ._common import _NEG_INF, _c_rows, _ctz64, _exp32
from .packed import _BLOCK, LANES, PackedLUT, _accumulate_block, _check_indices
from .select import _select_head

NB = 4096           # level buckets per head
_COVER = 40.0       # logits: the catch-all bucket must lie this far below the top bucket


def level_hist(Hq: int) -> np.ndarray:
    """Scratch for the per-thread bucket counts: int32 [max threads, Hq, NB]."""
    return np.empty((numba.config.NUMBA_NUM_THREADS, Hq, NB), np.int32)


@njit(cache=True)
def _level_task(tables, lanes, top, shift, PT, n, lev, hh_slot, t, acc, bk):
    # One (token block, table row) task of _k_packed_levels; hh_slot int32 [Hq, NB] its slot's counts,
    # bk int32 [_BLOCK] scratch (the block's bucket numbers, made in a loop that vectorizes).
    R = tables.shape[0]
    b, r = t // R, t % R
    kv = r // (R // PT.shape[0])
    j0 = b * _BLOCK
    L = min(n, j0 + _BLOCK) - j0
    _accumulate_block(tables, r, PT, kv, j0, L, acc)
    for e in range(LANES):
        h = lanes[r, e]
        if h < 0:
            continue
        sh16 = np.uint64(16 * e)
        lh = lev[h, j0:j0 + L]
        for u in range(L):
            lh[u] = np.uint16((acc[u] >> sh16) & np.uint64(0xFFFF))
        _count_levels(lh, L, top[h], shift[h], hh_slot[h], bk)


@njit(inline="always")
def _count_levels(lh, L, top, shift, hh, bk):
    """Counts of lh[:L]'s levels into their buckets hh [NB], b = min((top - L) >> shift, NB - 1);
    bk int32 [>= L] scratch (the bucket numbers, made in a loop that vectorizes)."""
    tp = np.int32(top)                              # top <= 65535: 32-bit lanes suffice
    sh = np.int32(shift)
    for u in range(L):
        bk[u] = min((tp - np.int32(lh[u])) >> sh, np.int32(NB - 1))
    for u in range(L):
        hh[bk[u]] += 1


@njit(cache=True, parallel=True)
def _k_packed_levels(tables, lanes, top, shift, PT, n, lev, hist, nt):
    # As _k_packed_scores, writing lev uint16 [Hq, >=n] and the counts hist[slot, h, bucket]: slot
    # sl of nt (one per thread) does tasks sl, sl + nt, ... into its own counts
    # (numba.get_thread_id would do, but a function that calls it cannot be cached on disk).
    nb = (n + _BLOCK - 1) // _BLOCK
    ntask = nb * tables.shape[0]
    for sl in prange(nt):
        hist[sl] = 0
        acc = np.empty(_BLOCK, np.uint64)
        bk = np.empty(_BLOCK, np.int32)
        for t in range(sl, ntask, nt):
            _level_task(tables, lanes, top, shift, PT, n, lev, hist[sl], t, acc, bk)


@njit(inline="always")
def _merged_counts(hist, h, nt):
    """Head h's bucket counts summed over the nt slots of hist [threads, Hq, NB] -> int64 [NB]."""
    H = np.zeros(NB, np.int64)
    for t in range(nt):
        Ht = hist[t, h]
        for b in range(NB):
            H[b] += Ht[b]
    return H


@njit(inline="always")
def _top_bucket(H):
    """The first non-empty bucket of H int64 [NB] (NB - 1, the catch-all, when only it is)."""
    bt = 0
    while bt < NB - 1 and H[bt] == 0:
        bt += 1
    return bt


@njit(cache=True)
def _level_cut(lh, n, tau, s, o, tp, sh, H, idx_row, z_row, cap=0):
    """One head's cut: the selection is every token with level >= the returned lcut (lcut > 65535:
    none). lh uint16 [>=n] its levels, H int64 [NB] its bucket counts, s / o / tp / sh its scale,
    offset, top and shift; cap > 0: at most that many tokens, in whole buckets from the top
    (_bucket_cut; the exact fallback: the cap highest levels); idx_row / z_row [>=n]: scratch of
    the exact float fallback."""
    if n == 0 or tau <= 0.0:
        return np.int64(1 << 17)                         # above every level: nothing selected
    if tau >= 1.0 and (cap <= 0 or cap >= n):
        return np.int64(0)
    bt = _top_bucket(H)
    w = np.float64(s) * (1 << sh)
    if tau < 1.0 and H[NB - 1] > 0 and (NB - 1 - bt) * w < _COVER:   # top too loose: exact float selection
        # threshold_select keeps every token whose score reaches its cut, and the scores grow with
        # the level, so its set is every level >= the least selected one
        for j in range(n):
            z_row[j] = np.float32(lh[j]) * s + o
        cnt, _, _ = _select_head(z_row, n, tau, idx_row)
        if 0 < cap < cnt:                                # the cap highest of them
            lv = np.empty(cnt, np.int64)
            for k in range(cnt):
                lv[k] = lh[idx_row[k]]
            lv.sort()
            return lv[cnt - cap]
        lmin = np.int64(1 << 17)
        for k in range(cnt):
            lmin = min(lmin, np.int64(lh[idx_row[k]]))
        return lmin
    bstar = _bucket_cut(H, bt, w, tau, cap)
    return np.int64(0) if bstar == NB - 1 else tp - ((np.int64(bstar) + 1) << sh) + 1


@njit(inline="always")
def _bucket_cut(H, bt, w, tau, cap=0):
    """The cut bucket b*: the first from the top bucket bt (buckets w logits wide, b counting down
    from the highest scores) at which the cumulative mass, estimated as count_b * exp(-w (b - bt)),
    reaches tau times the estimated total (tau >= 1: the last non-empty bucket); then, with a cap
    > 0, no further than the buckets from bt whose tokens number at most cap (bt itself always:
    the cap keeps whole buckets). H int64 [NB] the counts, some non-empty."""
    bl = NB - 1                                          # the last non-empty bucket
    while H[bl] == 0:
        bl -= 1
    b = bl
    if tau < 1.0:
        r = np.exp(-w)
        S = 0.0
        e = 1.0
        for k in range(bt, bl + 1):
            S += H[k] * e
            e *= r
        target = tau * S
        cum = 0.0
        e = 1.0
        for k in range(bt, bl + 1):
            cum += H[k] * e
            if cum >= target:
                b = k
                break
            e *= r
    if cap > 0:
        c = 0
        for k in range(bt, b + 1):
            c += H[k]
            if c > cap:
                return max(bt, k - 1)
    return b


@njit(inline="always")
def _word_mask(lh, j0, L, lc):
    """Bit u set where lh[j0 + u] >= lc, u < L <= 64 (a compare-and-or loop that vectorizes)."""
    msk = np.uint64(0)
    for u in range(L):
        msk |= np.uint64(np.int64(lh[j0 + u]) >= lc) << np.uint64(u)
    return msk


@njit(cache=True)
def _select_levels_head(lh, n, tau, s, o, tp, sh, H, idx_row, z_row):
    """One head: H int64 [NB] its bucket counts. Fills idx_row / z_row[:count]; -> (count, m, l_sel)."""
    if n == 0:
        return 0, _NEG_INF, 0.0
    lc = _level_cut(lh, n, tau, s, o, tp, sh, H, idx_row, z_row)
    # collect 64 tokens at a time: a bit mask of the selected ones, then only its set bits (~5%
    # of the tokens at random: a branch per token mispredicts, a write per token costs as much)
    cnt = 0
    lmax = np.uint16(0)
    for j0 in range(0, n, 64):
        L = min(64, n - j0)
        for u in range(L):
            lmax = max(lmax, lh[j0 + u])
        msk = _word_mask(lh, j0, L, lc)
        while msk:
            j = j0 + np.int64(_ctz64(msk))
            idx_row[cnt] = j
            z_row[cnt] = np.float32(lh[j]) * s + o
            cnt += 1
            msk &= msk - np.uint64(1)
    m = np.float32(lmax) * s + o
    lsel = 0.0
    for k in range(cnt):
        lsel += np.float64(_exp32(z_row[k] - m))
    return cnt, m, lsel


@njit(cache=True, parallel=True)
def _k_select_levels(lev, n, tau, scale, offset, top, shift, hist, nt, idx, zsel, counts, m, l_sel):
    Hq = lev.shape[0]
    for h in prange(Hq):
        H = _merged_counts(hist, h, nt)
        cnt, mh, lh = _select_levels_head(lev[h], n, tau, scale[h], offset[h], top[h], shift[h], H,
                                          idx[h], zsel[h])
        counts[h] = cnt
        m[h] = mh
        l_sel[h] = np.float32(lh)


def packed_select(packed: PackedLUT, PT, n: int, tau: float, out_idx=None, out_z=None, scratch=None):
    """Scores from a PackedLUT (pack_lut) over group-major indices and the selection on their levels.

    PT [Hkv, g, n_cap] uint8/int16 (first n columns read), tau float; out_idx int32 / out_z f32
    [Hq, >=n] optional outputs; scratch optional (lev uint16 [Hq, >=n], level_hist(Hq))
    -> (idx int32 [Hq, n], counts int32 [Hq], m f32 [Hq] = max score, l_sel f32 [Hq] = sum of
    exp(z - m) over the selection, z_sel f32 [Hq, n]): row h's first counts[h] entries of idx are the
    selected tokens in increasing order and those of z_sel their scores (= packed_scores' values).
    """
    PT, n = _check_indices(packed, PT, n)
    Hq = packed.scale.shape[0]
    idx = np.empty((Hq, n), np.int32) if out_idx is None else out_idx
    zsel = np.empty((Hq, n), np.float32) if out_z is None else out_z
    ibuf, zbuf = (_c_rows(a) if isinstance(a, np.ndarray) and a.ndim == 2 else None for a in (idx, zsel))
    if ibuf is None or idx.dtype != np.int32 or idx.shape[0] != Hq or idx.shape[1] < n:
        raise ValueError("out_idx must be int32 [Hq, >=n] with unit-stride rows")
    if zbuf is None or zsel.dtype != np.float32 or zsel.shape[0] != Hq or zsel.shape[1] < n:
        raise ValueError("out_z must be float32 [Hq, >=n] with unit-stride rows")
    lev, hist = scratch if scratch is not None else (np.empty((Hq, n), np.uint16), level_hist(Hq))
    counts = np.zeros(Hq, np.int32)
    m = np.full(Hq, -np.inf, np.float32)
    l_sel = np.zeros(Hq, np.float32)
    if n > 0:
        nt = min(numba.get_num_threads(), hist.shape[0])
        _k_packed_levels(packed.tables, packed.lanes, packed.top, packed.shift, PT, n, lev, hist, nt)
        _k_select_levels(lev, n, float(tau), packed.scale, packed.offset, packed.top, packed.shift, hist, nt,
                         ibuf, zbuf, counts, m, l_sel)
    return idx[:, :n], counts, m, l_sel, zsel[:, :n]
