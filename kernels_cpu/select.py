"""Cumulative-mass threshold selection without a full sort: one head's float scores (the exact
fallback of kernels_cpu.level_select's level cut).

Algorithm of `_select_head` (no full sort): pass 1 max/min; pass 2 float32 weights
w = exp(z - m), S = sum w (float64) and a 2048-bucket mass histogram over z in
[max(min z, m - 104), m]; scan from the top to the bucket where the cumulative mass reaches
tau*S; pass 3 gathers that bucket's tokens and it is re-histogrammed over its own value range
until <= 512 candidates remain (then sorted) or all are tied. This yields the cut value
zcut = the largest z at which the mass of {z >= zcut} reaches tau*S; pass 4 writes
{j : z[j] >= zcut} in increasing token order.

Bound: the selection is the minimal set plus the tokens tied with zcut (count <= minimal +
ties(zcut) - 1), identical to a full-sort reference (threshold_select_ref in
tests/support/references/cpu.py) up to float64 summation-order rounding (the mass sums use the same
float32 weights). If rounding keeps the cumulative mass just below tau*S the boundary bucket (or
everything) is included. tau >= 1 selects all n; tau <= 0 nothing; n == 0 (or all z == -inf)
-> count 0, l_sel 0, m = -inf. NaN scores are never selected (unless tau >= 1).
"""

import numpy as np
from numba import njit

from ._common import _NEG_INF, _exp32, _min_max

_NBUCKETS = 2048  # histogram buckets per refinement level
_SMALL = 512  # candidate count at which the last bucket is simply sorted
_ZRANGE = np.float32(104.0)  # exp(-104) underflows float32: lower tokens carry no mass


@njit(cache=True)
def _bucket(v, hi, lo, scale):
    # Bucket of value v in [lo, hi] (scale = _NBUCKETS / (hi - lo), float64):
    # monotone non-increasing in v, bucket 0 holds the largest values.  Done
    # in float64 so that even a denormal-width range cannot overflow; the
    # comparison form also sends NaN/inf to the last bucket, never out of range.
    if v <= lo:
        return _NBUCKETS - 1
    x = (np.float64(hi) - np.float64(v)) * scale
    if not (x < _NBUCKETS - 1):
        return _NBUCKETS - 1
    if x < 0.0:
        return 0
    return int(x)


@njit(cache=True)
def _select_head(zh, n, tau, idx_row):
    """The smallest set of the tokens of zh f32 [>= n] (the first n scores) holding >= tau of their
    softmax mass -> (count, m = max z, l_sel = sum over the selection of exp(z - m)); the selected
    indices go into idx_row int32 [>= n] (first count entries, increasing; the rest scratch)."""
    mn, mx = _min_max(zh, n)                          # pass 1: max / min (NaN ignored)
    if n == 0 or mx == _NEG_INF or not (mx < np.inf):
        return 0, mx, 0.0
    if tau >= 1.0:
        S = 0.0
        for j in range(n):
            idx_row[j] = j
            v = zh[j]
            if v > _NEG_INF:
                S += np.float64(_exp32(v - mx))
        return n, mx, S
    if tau <= 0.0:
        return 0, mx, 0.0

    mass = np.zeros(_NBUCKETS, dtype=np.float64)
    hi = mx
    lo = max(mn, mx - _ZRANGE)
    acc = 0.0  # mass of tokens already known to be selected (above the current range)
    zcut = mx
    if hi > lo:
        # pass 2: total mass and mass histogram (bucketed on z, linear in z). Weights and
        # buckets first, in a loop that vectorizes (the float32 exp is most of the cost), then
        # the scalar histogram. The buckets equal _bucket's; pass 3 reuses them.
        scale = _NBUCKETS / (np.float64(hi) - np.float64(lo))
        w32 = np.empty(n, np.float32)
        bk = np.empty(n, np.int32)
        for j in range(n):
            v = zh[j]
            ok = v >= lo   # also drops NaN; tokens below lo have zero float32 weight
            w32[j] = _exp32(v - mx) if ok else np.float32(0.0)
            x = min(max((np.float64(hi) - np.float64(v)) * scale, 0.0), np.float64(_NBUCKETS - 1))
            bk[j] = np.int32(x) if ok else _NBUCKETS - 1
        # two half-histograms and sums (even / odd tokens): neighbours often share a bucket, and
        # one read-modify-write chain through memory would serialize them
        mass2 = np.zeros(_NBUCKETS, dtype=np.float64)
        S = 0.0
        S2 = 0.0
        j = 0
        while j + 2 <= n:
            w = np.float64(w32[j])
            w2 = np.float64(w32[j + 1])
            S += w
            S2 += w2
            mass[bk[j]] += w
            mass2[bk[j + 1]] += w2
            j += 2
        if j < n:
            S += np.float64(w32[j])
            mass[bk[j]] += np.float64(w32[j])
        S += S2
        for b in range(_NBUCKETS):
            mass[b] += mass2[b]
        target = tau * S
        cum = 0.0
        bstar = -1
        for b in range(_NBUCKETS):
            if cum + mass[b] >= target:
                bstar = b
                break
            cum += mass[b]
        if bstar < 0:  # rounding: the buckets never reach tau*S -> take everything
            zcut = mn
            acc = S
            k = 0
        else:
            acc = cum
            # pass 3: collect the candidates of the boundary bucket (idx_row is scratch)
            k = 0
            for j in range(n):
                if bk[j] == bstar and zh[j] >= lo:   # bk: pass 2's buckets (= _bucket's)
                    idx_row[k] = j
                    k += 1
        # refinement: re-histogram the boundary bucket until it is small or all-tied
        while k > 0:
            cmax = _NEG_INF
            cmin = np.float32(np.inf)
            for t in range(k):
                v = zh[idx_row[t]]
                if v > cmax:
                    cmax = v
                if v < cmin:
                    cmin = v
            if cmin == cmax:
                # all tied: they all go in
                zcut = cmin
                for t in range(k):
                    acc += np.float64(_exp32(zh[idx_row[t]] - mx))
                break
            if k <= _SMALL:
                vals = np.empty(k, dtype=np.float32)
                for t in range(k):
                    vals[t] = zh[idx_row[t]]
                vals.sort()
                zcut = vals[0]
                reached = False
                for t in range(k - 1, -1, -1):
                    v = vals[t]
                    if reached and v < zcut:
                        break
                    acc += np.float64(_exp32(v - mx))
                    if not reached and acc >= target:
                        reached = True
                        zcut = v
                break
            lo2 = cmin
            hi2 = cmax
            scale2 = _NBUCKETS / (np.float64(hi2) - np.float64(lo2))
            mass[:] = 0.0
            for t in range(k):
                v = zh[idx_row[t]]
                mass[_bucket(v, hi2, lo2, scale2)] += np.float64(_exp32(v - mx))
            cum = 0.0
            bstar = -1
            for b in range(_NBUCKETS):
                if acc + cum + mass[b] >= target:
                    bstar = b
                    break
                cum += mass[b]
            if bstar < 0:  # rounding: include every candidate
                zcut = cmin
                acc += cum
                break
            acc += cum
            k2 = 0
            for t in range(k):
                j = idx_row[t]
                if _bucket(zh[j], hi2, lo2, scale2) == bstar:
                    idx_row[k2] = j
                    k2 += 1
            k = k2
    else:
        # every counted token has z == mx (tokens < lo carry no float32 mass)
        zcut = mx
        acc = 0.0
        for j in range(n):
            if zh[j] == mx:
                acc += 1.0

    # pass 4: write the selection {j : z >= zcut} in increasing token order
    cnt = 0
    for j in range(n):
        if zh[j] >= zcut:
            idx_row[cnt] = j
            cnt += 1
    return cnt, mx, acc
