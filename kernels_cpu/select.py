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


@njit(inline="always")
def _select_all(zh, n, mx, idx_row):
    """tau >= 1: every token j < n into idx_row -> their mass sum of exp(z - mx) (float64)."""
    S = 0.0
    for j in range(n):
        idx_row[j] = j
        v = zh[j]
        if v > _NEG_INF:
            S += np.float64(_exp32(v - mx))
    return S


@njit(inline="always")
def _mass_histogram(zh, n, hi, lo, mx, mass):
    """Pass 2: the float32 weights w = exp(z - mx) of zh[:n] (0 below lo or NaN) added into mass
    [_NBUCKETS] f64 by _bucket over [lo, hi] -> (S = sum w, f64; bk int32 [n] each token's
    bucket, the last one for tokens without weight). Weights and buckets first, in a loop that
    vectorizes (the float32 exp is most of the cost), then the scalar histogram."""
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
    return S, bk


@njit(inline="always")
def _boundary_bucket(mass, acc, target):
    """The first bucket b (from the top) at which acc + the mass of buckets 0..b reaches target ->
    (b, the mass of the buckets above it); (-1, the total) when none does (rounding)."""
    cum = 0.0
    for b in range(_NBUCKETS):
        if acc + cum + mass[b] >= target:
            return b, cum
        cum += mass[b]
    return -1, cum


@njit(inline="always")
def _sorted_cut(zh, idx_row, k, mx, acc, target):
    """The cut among the k candidates zh[idx_row[:k]], sorted: from the highest down, the value at
    which acc plus their weights exp(z - mx) reaches target, and every candidate tied with it ->
    (zcut, acc plus the weights of the candidates >= zcut)."""
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
    return zcut, acc


@njit(inline="always")
def _refine(zh, idx_row, k, mx, acc, target, mass):
    """The cut within the boundary bucket's k candidates zh[idx_row[:k]] (acc: the mass above
    them): re-histogrammed over their own value range until <= _SMALL remain (then sorted) or all
    are tied -> (zcut, acc plus the mass of the candidates >= zcut). mass [_NBUCKETS] scratch."""
    zcut = mx
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
            zcut, acc = _sorted_cut(zh, idx_row, k, mx, acc, target)
            break
        scale2 = _NBUCKETS / (np.float64(cmax) - np.float64(cmin))
        mass[:] = 0.0
        for t in range(k):
            v = zh[idx_row[t]]
            mass[_bucket(v, cmax, cmin, scale2)] += np.float64(_exp32(v - mx))
        bstar, cum = _boundary_bucket(mass, acc, target)
        acc += cum
        if bstar < 0:  # rounding: include every candidate
            zcut = cmin
            break
        k2 = 0
        for t in range(k):
            j = idx_row[t]
            if _bucket(zh[j], cmax, cmin, scale2) == bstar:
                idx_row[k2] = j
                k2 += 1
        k = k2
    return zcut, acc


@njit(inline="always")
def _mass_cut(zh, n, tau, mn, mx, lo, idx_row):
    """Passes 2 and 3 over zh[:n] with mx > lo: the cut value zcut and the mass of {z >= zcut}
    (sum of exp(z - mx), f64) -> (zcut, acc). idx_row [>= n] scratch."""
    mass = np.zeros(_NBUCKETS, dtype=np.float64)
    S, bk = _mass_histogram(zh, n, mx, lo, mx, mass)
    target = tau * S
    bstar, cum = _boundary_bucket(mass, 0.0, target)
    if bstar < 0:  # rounding: the buckets never reach tau*S -> take everything
        return mn, S
    # pass 3: collect the candidates of the boundary bucket (idx_row is scratch)
    k = 0
    for j in range(n):
        if bk[j] == bstar and zh[j] >= lo:   # bk: pass 2's buckets (= _bucket's)
            idx_row[k] = j
            k += 1
    return _refine(zh, idx_row, k, mx, cum, target, mass)


@njit(cache=True)
def _select_head(zh, n, tau, idx_row):
    """The smallest set of the tokens of zh f32 [>= n] (the first n scores) holding >= tau of their
    softmax mass -> (count, m = max z, l_sel = sum over the selection of exp(z - m)); the selected
    indices go into idx_row int32 [>= n] (first count entries, increasing; the rest scratch)."""
    mn, mx = _min_max(zh, n)                          # pass 1: max / min (NaN ignored)
    if n == 0 or mx == _NEG_INF or not (mx < np.inf):
        return 0, mx, 0.0
    if tau >= 1.0:
        return n, mx, _select_all(zh, n, mx, idx_row)
    if tau <= 0.0:
        return 0, mx, 0.0
    lo = max(mn, mx - _ZRANGE)
    if mx > lo:
        zcut, acc = _mass_cut(zh, n, tau, mn, mx, lo, idx_row)
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
