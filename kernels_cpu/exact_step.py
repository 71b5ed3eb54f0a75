"""One HCA decode step of one layer when the store keeps exact keys (the 50% preset, key_store="exact").

The keys of the store are full precision, the values are the offloaded tier: the step reads every
key once and only the selected values, about half of dense attention's bytes on natural text (each
kv-head's query heads select ~5-10% of the tokens, 1.6 picks per distinct token). In one call:

1. Scores (`_k_exact_scores`): one task per (1024 keys, table row), each key row read once for the
   row's query heads (lanes of kernels_cpu.packed.lane_map), z[h, j] = q[h] . K[kv, j] in float32.
   While the block is in L1 the task counts its tokens into per-thread buckets of 1/32 logit on an
   absolute grid, B = floor(32 z), numbered down from the thread's highest bucket so far (a thread
   that meets a higher block shifts its counts down; the catch-all bucket NB - 1 takes the rest).
2. Cuts (`_k_float_cuts`): per head, the threads' counts aligned on the highest bucket R, and the
   cut bucket b* of level_select._bucket_cut (the bucket-resolution mass estimate of the level
   path: the selection holds at least tau * exp(-1/32) of the softmax mass); the selection is
   every token with z >= (R - b*) / 32, compared on the float scores (floor(32 z) >= k exactly
   when z >= k / 32, both exact in float32). tau >= 1 selects every token, tau <= 0 none.
3. The value sum over the selection and sinks + ring exactly, in one parallel region
   (level_sum._k_level_value_sum, which reads float scores as it reads levels: scale 1, offset 0,
   m = the exact max score), the token itself, and the log-sum-exp merge, as hca_step does.

Reference: hca_exact_decode_attend_ref in tests/support/references/cpu.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import _NEG_INF, _as_f32, _as_pool, _c_rows
from .attention import _row_dots
from .hca_step import _exact_args, _step_args, _step_partials, _step_scratch, _sum_and_merge
from .level_select import NB, _bucket_cut, _merged_counts, head_caps
from .packed import LANES

_BLOCK = 1024                  # keys per scoring task
_PER_LOGIT = 32                # buckets per logit
_NO_REF = -(1 << 62)           # a thread's reference bucket before it has counted a token


@njit(inline="always")
def _raise_ref(hh, s):
    """A thread's counts hh [NB] re-numbered from a top bucket s buckets higher: bucket i moves
    to i + s, those past the end into the catch-all NB - 1."""
    tail = 0
    for i in range(max(0, NB - 1 - s), NB):
        tail += hh[i]
    for i in range(NB - 2, s - 1, -1):
        hh[i] = hh[i - s]
    for i in range(min(s, NB - 1)):
        hh[i] = 0
    hh[NB - 1] = tail


@njit(cache=True)
def _count_block(zh, j0, j1, bm, hh, ref_h, bk):
    """Counts head h's scores zh[j0:j1] (block max bm) into hh int32 [NB]; ref_h its reference
    bucket (the highest so far), returned updated. bk int32 [>= j1 - j0] scratch."""
    if not bm > _NEG_INF:                      # no finite score: no mass to count
        return ref_h
    top = np.int64(np.floor(bm * np.float32(_PER_LOGIT)))
    if top > ref_h:
        if ref_h != _NO_REF:
            _raise_ref(hh, min(top - ref_h, NB))
        ref_h = top
    L = j1 - j0
    # bucket numbers in int32 (vectorizes twice as wide): bm is this block's max, so every finite
    # score's floor(32 z) lies between the clamp bounds below and ref_h; NaN lands in a clamped bucket
    hi = np.float32(ref_h + 1)
    lo = np.float32(ref_h - NB)
    r32 = np.int32(0)
    for u in range(L):
        x = min(max(np.floor(zh[j0 + u] * np.float32(_PER_LOGIT)), lo), hi)
        b = np.int32(np.float32(ref_h) - x)
        bk[u] = min(max(b, r32), np.int32(NB - 1))
    for u in range(L):
        hh[bk[u]] += 1
    return ref_h


@njit(cache=True, parallel=True)
def _k_exact_scores(q, K, n, lanes, z, hist, ref, smax, nt):
    # z f32 [Hq, >=n] out; slot sl of nt does tasks sl, sl + nt, ... (block-major) into its own
    # counts hist[sl] int32 [Hq, NB], reference buckets ref[sl] int64 [Hq] and maxima smax[sl] f32 [Hq]
    R = lanes.shape[0]
    ntask = ((n + _BLOCK - 1) // _BLOCK) * R
    for sl in prange(nt):
        hist[sl] = 0
        ref[sl] = _NO_REF
        smax[sl] = _NEG_INF
        bmax = np.empty(LANES, np.float32)
        bk = np.empty(_BLOCK, np.int32)
        for t in range(sl, ntask, nt):
            r = t % R
            kv = r // (R // K.shape[0])
            j0 = (t // R) * _BLOCK
            j1 = min(n, j0 + _BLOCK)
            _row_dots(q, K, lanes, r, kv, j0, j1, z, 0, bmax, False)
            for e in range(LANES):
                h = lanes[r, e]
                if h >= 0:
                    ref[sl, h] = _count_block(z[h], j0, j1, bmax[e], hist[sl, h], ref[sl, h], bk)
                    smax[sl, h] = max(smax[sl, h], bmax[e])


@njit(cache=True, parallel=True)
def _k_float_cuts(hist, ref, smax, nt, n, tau, zcut, mref, cap):
    # Per head: the float cut zcut [Hq] f32 (select z >= zcut; cap int64 [Hq], head_caps: > 0 at
    # most cap[h] tokens, whole buckets from the top, < 0 none) and the exact max score mref [Hq] f32.
    # Re-numbers the threads' counts in hist (scratch) onto the highest reference bucket.
    for h in prange(zcut.shape[0]):
        R = _NO_REF
        M = _NEG_INF
        for sl in range(nt):
            R = max(R, ref[sl, h])
            M = max(M, smax[sl, h])
        mref[h] = M
        if n == 0 or tau <= 0.0 or R == _NO_REF or cap[h] < 0:
            zcut[h] = np.inf
            continue
        if tau >= 1.0 and (cap[h] <= 0 or cap[h] >= n):
            zcut[h] = _NEG_INF
            continue
        for sl in range(nt):                           # every thread's counts from bucket R
            if ref[sl, h] != _NO_REF and ref[sl, h] < R:
                _raise_ref(hist[sl, h], min(R - ref[sl, h], NB))
        H = _merged_counts(hist, h, nt)
        bstar = _bucket_cut(H, 0, 1.0 / _PER_LOGIT, tau, cap[h])   # (bucket 0 holds the max score)
        zcut[h] = _NEG_INF if bstar == NB - 1 else np.float32((R - bstar) / _PER_LOGIT)


@njit(cache=True)
def _k_exact_decode(step, exact, store, heads, scratch, tau, cap, out):
    # The arguments of hca_exact_decode_attend by part: step (q, k, v) the token; exact (EK, EV,
    # n_exact, valid) sinks + ring; store (K, n_store, V); heads (q_to_kv, lanes); scratch (z,
    # hist, nt, counts) -> out [Hq, d].
    q, k, v = step
    K, n_store, V = store
    q_to_kv, lanes = heads
    z, hist, nt, counts = scratch
    Hq = q.shape[0]
    parts = _step_partials(q, k, v, q_to_kv)             # the new token itself
    zcut = np.full(Hq, np.inf, np.float32)
    mref = np.full(Hq, _NEG_INF, np.float32)
    if n_store > 0:                                      # the store: scores and cuts
        ref = np.empty((nt, Hq), np.int64)
        smax = np.empty((nt, Hq), np.float32)
        _k_exact_scores(q, K, n_store, lanes, z, hist, ref, smax, nt)
        _k_float_cuts(hist, ref, smax, nt, n_store, tau, zcut, mref, cap)
    # the value sum over the selection (float scores: scale 1, offset 0), sinks + ring, the merge
    sel = (z, zcut, np.ones(Hq, np.float32), np.zeros(Hq, np.float32), mref)
    _sum_and_merge(sel, n_store, V, lanes, nt, counts, q, exact, (K, False), parts, out)


def hca_exact_decode_attend(q, k, v, EK, EV, n_exact, K, n_store, V, tau, q_to_kv, lanes, z, hist,
                            counts=None, exact_valid=None, cap=0):
    """Attention of one decode token over sinks + ring (exact), itself, and a store of exact keys
    with threshold selection (module docstring).

    q [Hq, d] f32 (pre-scaled by 1/sqrt(d)); k, v [Hkv, d] the token's own key and value;
    EK, EV [Hkv, >=n_exact, d] the exact tier (f32 or f16); K [Hkv, >=n_store, d] f32 the store's
    keys; V [Hkv, >=n_store, d] f32/f16 its values (all C-contiguous); lanes int32 [R, 4]
    (lane_map(q_to_kv, Hkv)); scratch: z f32 [Hq, >=n_store] (holds the scores afterwards),
    hist level_hist(Hq); counts int32 [Hq] optional (the selection size per head afterwards);
    exact_valid and cap as hca_decode_attend's. -> o [Hq, d] f32.
    """
    Hq = q.shape[0]
    K = _as_f32(K)
    if K.ndim != 3 or K.shape[1] < n_store or not K.flags.c_contiguous:
        raise ValueError(f"K must be C-contiguous float32 [Hkv, >={n_store}, d], got {K.shape}")
    zr = _c_rows(z)
    if zr is None or z.dtype != np.float32 or z.shape[0] != Hq or z.shape[1] < n_store:
        raise ValueError(f"z must be float32 [Hq={Hq}, >={n_store}] with unit-stride rows")
    counts, out, _, nt = _step_scratch(q, n_store, counts, (None, hist))
    _k_exact_decode(_step_args(q, k, v), _exact_args(EK, EV, n_exact, exact_valid), (K, int(n_store), _as_pool(V)),
                    (q_to_kv, lanes), (zr, hist, nt, counts), float(tau), head_caps(cap, Hq), out)
    return out
