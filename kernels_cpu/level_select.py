"""HCA scoring and selection on the packed tables' integer levels (the CPU decode path).

The packed tables (kernels_cpu.packed) make every score z = scale[h] * L + offset[h] from an integer
level L = sum_i Q[h, i, P[j, i]] in [0, top[h]], top[h] = sum_i max_j Q[h, i, j]. The selection
works on the levels themselves, with no float score and no exp per token:

1. The scoring pass (`_k_packed_levels`) writes L as uint16 (2 bytes instead of a 4-byte float)
   and counts the tokens per level bucket below top: b = min((top - L) >> sh, NB - 1), where sh
   (PackedLUT.shift) is the largest shift with w = scale * 2**sh <= 1/32 of a logit (sh = 0 when
   one level is wider).
2. Per head (`_level_cut`), bucket b's softmax mass is estimated as count_b * exp(-w (b - b_top))
   (b_top the top non-empty bucket; one multiply per bucket), and the cut is the first bucket b*
   from the top at which the cumulative estimate reaches tau times the total.
3. The selection is {j : (top - L_j) >> sh <= b*} (the boundary bucket whole): every level at or
   above a cut, which the value sum (kernels_cpu.level_sum) reads from the levels, with no list.

Bound: a bucket's tokens lie within w / 2 of its centre, so each estimate is within a factor
exp(+-w / 2) of the bucket's exact mass: the selection holds at least tau * exp(-w) of the exact
softmax mass over these scores, and the selection without its boundary bucket less than
tau * exp(w) (0.872 and 0.929 at tau = 0.9, w = 1/32); one level per bucket (sh = 0) is exact.
The NB buckets reach NB * w >= 64 logits below top, but top only bounds the best score from
above: when the last (catch-all) bucket is within 40 logits of the top non-empty bucket, that
head is selected on its float scores instead (kernels_cpu.select: the exact minimal set).

tau >= 1 selects every token, tau <= 0 none. The fused steps run these kernels (kernels_cpu.hca_step,
kernels_cpu.fastscan). Reference: packed_select_ref / levels_select_ref in tests/support/references/cpu.py.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .packed import _BLOCK, LANES, _accumulate_block
from .select import _select_head

NB = 4096           # level buckets per head
_COVER = 40.0       # logits: the catch-all bucket must lie this far below the top bucket


def head_caps(cap, Hq: int) -> np.ndarray:
    """The selection's cap per query head as the steps take it, int64 [Hq]: > 0 at most that many
    store tokens, 0 no cap (tau alone), < 0 the head skips the store (selects nothing). cap: None
    or an int (every head alike), or a sequence of Hq of them (per-head budgets)."""
    if cap is None or np.isscalar(cap):
        return np.full(Hq, int(cap or 0), np.int64)
    out = np.ascontiguousarray(cap, np.int64)
    if out.shape != (Hq,):
        raise ValueError(f"cap must be an int or [Hq={Hq}] ints, got shape {out.shape}")
    return out


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
    # The levels of PT [Hkv, g, >=n] over the packed tables, one task per (token block, table row),
    # into lev uint16 [Hq, >=n], and their counts hist[slot, h, bucket]: slot sl of nt (one per
    # thread) does tasks sl, sl + nt, ... into its own counts (numba.get_thread_id would do, but a
    # function that calls it cannot be cached on disk).
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
    (_bucket_cut; the exact fallback: the cap highest levels), cap < 0: none (a head that skips
    the store: head_caps); idx_row / z_row [>=n]: scratch of the exact float fallback."""
    if n == 0 or tau <= 0.0 or cap < 0:
        return np.int64(1 << 17)                         # above every level: nothing selected
    if tau >= 1.0 and (cap <= 0 or cap >= n):
        return np.int64(0)
    bt = _top_bucket(H)
    w = np.float64(s) * (1 << sh)
    if tau < 1.0 and H[NB - 1] > 0 and (NB - 1 - bt) * w < _COVER:   # top too loose: exact float selection
        # _select_head keeps every token whose score reaches its cut, and the scores grow with
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
