"""The store's part of an HCA decode step from the integer levels, without a list of the selection.

After kernels_cpu.level_select's scoring pass (levels and bucket counts), each head's selection is
a level cut: every token with level >= lcut[h] (`_level_cut`). Here the value sum reads the levels
directly. One task takes a table row's query heads (the heads of one kv-head, up to 4) over a range
of tokens: per 64 tokens, one bit mask per head and their union; each token of the union has its
value row read once for all of those heads (the heads of a kv-head select overlapping sets: 1.6
selections per distinct token on SmolLM2's real K/V at 16K), weighted by exp(z - m) with
z = scale * level + offset, 0 for a head that did not select it.

m[h] is the top non-empty level bucket's highest level as a score (the highest level itself when
that is the catch-all bucket): >= every score, within one bucket (<= 1/32 logit) of the highest,
so the partial sums of all tasks share it and add without a log-sum-exp merge. The result is
(o, m, l) as weighted_value_sum returns them over a list of the same selection, with this m (the
same softmax, another reference point).
The fused decode steps run it: kernels_cpu.hca_step and fastscan on the levels, kernels_cpu.exact_step
with float32 scores in place of the levels (scale 1, offset 0, m the exact max score).
Reference: weighted_value_sum_ref over packed_select_ref, inside hca_decode_attend_ref
(tests/kernels/test_hca_step_kernel.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import _FASTMATH, _NEG_INF, _ctz64, _exp32, _prefetch
from .attention import _exact_chunk, _merge_partials, dot4
from .level_select import NB, _level_cut, _merged_counts, _top_bucket
from .packed import LANES
from .value_rows import acc_pair4

_RANGE = 1024       # tokens per task (a multiple of 64)
_PF_DIST = 16       # value rows prefetched ahead


@njit(cache=True, parallel=True)
def _k_level_cuts(lev, n, tau, scale, offset, top, shift, hist, nt, idx, zs, lcut, mref, cap):
    # Per head: sum the threads' bucket counts, the cut level (cap int64 [Hq], head_caps: > 0 at
    # most cap[h] tokens, whole buckets; < 0 none) and the reference score m. idx / zs [Hq, >=n]: scratch of _level_cut's exact fallback.
    for h in prange(lev.shape[0]):
        H = _merged_counts(hist, h, nt)
        lcut[h] = _level_cut(lev[h], n, tau, scale[h], offset[h], top[h], shift[h], H, idx[h], zs[h], cap[h])
        bt = _top_bucket(H)
        if bt < NB - 1:
            lhi = max(top[h] - (np.int64(bt) << shift[h]), 0)
        else:                       # all in the catch-all bucket (any distance below top): scan
            lhi = 0
            for j in range(n):
                lhi = max(lhi, np.int64(lev[h, j]))
        mref[h] = np.float32(lhi) * scale[h] + offset[h]


@njit(inline="always")
def _lane_weights(Le, nj, c, s, o, We):
    """We[u] = exp(Le[u] * s + o) where Le[u] >= c, else 0, for u < nj (vectorizes: a branch per
    token costs more than the exp)."""
    for u in range(nj):
        x = _exp32(np.float32(Le[u]) * s + o)
        We[u] = x if Le[u] >= c else np.float32(0.0)


@njit(cache=True, fastmath=_FASTMATH)
def _exact_lane_weights(q, Kkv, ul, nu, fl, j0, h0, h1, h2, h3, mref, W):
    """rescore: W[e, t] = exp(q[h_e] . Kkv[ul[t]] - mref[h_e]) where lane e selected token ul[t]
    (bit e of its flags), else 0: the union's weights from exact scores over host keys Kkv [n, d]
    instead of from levels, each key row read once for the four lanes (kernels_cpu.rescore
    says why). mref stays the levels' reference point: an exact score may pass it by the
    codebooks' error (a few logits), far inside float32's exp range; the argument is capped at
    80 all the same, so no weight is inf."""
    q0, q1, q2, q3 = q[h0], q[h1], q[h2], q[h3]
    r0, r1, r2, r3 = mref[h0], mref[h1], mref[h2], mref[h3]
    cap = np.float32(80.0)
    for t in range(nu):
        a0, a1, a2, a3 = dot4(q0, q1, q2, q3, Kkv[ul[t]])
        f = fl[ul[t] - j0]
        W[0, t] = _exp32(min(a0 - r0, cap)) if f & 1 else np.float32(0.0)
        W[1, t] = _exp32(min(a1 - r1, cap)) if f & 2 else np.float32(0.0)
        W[2, t] = _exp32(min(a2 - r2, cap)) if f & 4 else np.float32(0.0)
        W[3, t] = _exp32(min(a3 - r3, cap)) if f & 8 else np.float32(0.0)


@njit(inline="always")
def _lane_union(L0, L1, L2, L3, c0, c1, c2, c3, nj, j0, fl, ul):
    """The lanes' selections among nj tokens (lane e selects where its levels L_e [nj] reach its cut
    c_e) as bits of fl[u] (bit e: lane e), and their union, tokens j0 + u in increasing order, into
    ul -> the union's size."""
    for u in range(nj):                          # the bits in a loop that vectorizes
        fl[u] = (np.uint8(L0[u] >= c0) | (np.uint8(L1[u] >= c1) << np.uint8(1))
                 | (np.uint8(L2[u] >= c2) << np.uint8(2))
                 | (np.uint8(L3[u] >= c3) << np.uint8(3)))
    for u in range(nj, (nj + 7) // 8 * 8):
        fl[u] = 0
    fl64 = fl.view(np.uint64)
    nu = 0
    for k in range((nj + 7) // 8):               # the union, 8 tokens per test
        x = fl64[k]
        while x:
            b = _ctz64(x) >> np.uint64(3)
            ul[nu] = j0 + 8 * k + np.int64(b)
            nu += 1
            x &= ~(np.uint64(0xFF) << (b * np.uint64(8)))
    return nu


@njit(inline="always")
def _prefetch_rows(Vflat, base, rw, ul, t0, t1):
    """Prefetches the value rows of union tokens ul[t0:t1] (rw elements each, from flat offset base)."""
    pf_step = max(1, 64 // Vflat.itemsize)
    for t in range(t0, t1):
        off = base + ul[t] * rw
        for e in range(0, rw, pf_step):
            _prefetch(Vflat, off + e)


@njit(inline="always")
def _lane_sums(fl, ul, nu, j0, W, lsum, cnt):
    """Adds each lane's selected tokens to cnt [LANES] and their weights W [LANES, >= nu] to lsum
    [LANES] over the union ul[:nu]."""
    W0, W1, W2, W3 = W[0], W[1], W[2], W[3]
    l0 = l1 = l2 = l3 = 0.0
    n0 = n1 = n2 = n3 = 0
    for t in range(nu):
        f = fl[ul[t] - j0]
        n0 += f & 1
        n1 += (f >> 1) & 1
        n2 += (f >> 2) & 1
        n3 += (f >> 3) & 1
        l0 += W0[t]
        l1 += W1[t]
        l2 += W2[t]
        l3 += W3[t]
    lsum[0] += l0
    lsum[1] += l1
    lsum[2] += l2
    lsum[3] += l3
    cnt[0] += n0
    cnt[1] += n1
    cnt[2] += n2
    cnt[3] += n3


@njit(inline="always")
def _add_rows(Vkv, Vflat, base, ul, nu, W, acc):
    """acc [LANES, d] += the union's value rows Vkv[ul[t]] [width] weighted by W[:, t], each row read
    once for all lanes, two rows per pass over the accumulators (half their loads and stores);
    Vflat / base: the pool flat and the kv-head's offset in it, for the prefetches."""
    rw = Vkv.shape[1]
    W0, W1, W2, W3 = W[0], W[1], W[2], W[3]
    a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
    t = 0
    while t < nu:
        _prefetch_rows(Vflat, base, rw, ul, t + _PF_DIST, min(t + _PF_DIST + 2, nu))
        ja = ul[t]
        tb = t + 1 if t + 1 < nu else t
        jb = ul[tb]
        wb = np.float32(1.0) if t + 1 < nu else np.float32(0.0)   # an odd last row pairs with nothing
        w0a, w1a, w2a, w3a = W0[t], W1[t], W2[t], W3[t]
        w0b, w1b, w2b, w3b = W0[tb] * wb, W1[tb] * wb, W2[tb] * wb, W3[tb] * wb
        acc_pair4(Vkv[ja], Vkv[jb], w0a, w1a, w2a, w3a, w0b, w1b, w2b, w3b, a0, a1, a2, a3)
        t += 2


@njit(cache=True)
def _range_task(sel, lanes, V, r, j0, j1, scratch, sums, q, host):
    # Table row r's heads over tokens [j0, j1): adds into sums (acc [LANES, d] f32, lsum [LANES]
    # f64, cnt [LANES] int64, lane order). sel (lev, lcut, scale, offset, mref): uint16 levels lev
    # with int64 cuts lcut, or float32 scores with float32 cuts (kernels_cpu.exact_step: scale 1,
    # offset 0); a head selects where lev >= its cut; mref [Hq] the reference scores.
    # scratch (fl, ul, G, W): fl uint8 [>= j1 - j0 + 8] (bit e: lane e selects the token), ul int64
    # [>= j1 - j0] (the union's tokens), G [LANES, >= j1 - j0] of lev's dtype (their levels), W f32
    # [LANES, >= j1 - j0] (their weights). host (K, rescore): with rescore, the weights from exact
    # scores of the queries q [Hq, d] over host keys K [Hkv, >= j1, d] (f32 or half bits) instead
    # of the levels. V [Hkv, cap, width]: float rows (width d) or quantized ones (uint8: value_rows).
    lev, lcut, scale, offset, mref = sel
    fl, ul, G, W = scratch
    acc, lsum, cnt = sums
    K, rescore = host
    rw = V.shape[2]
    kv = r // (lanes.shape[0] // V.shape[0])
    h0, h1, h2, h3 = lanes[r, 0], lanes[r, 1], lanes[r, 2], lanes[r, 3]
    # an empty lane reads lane 0's head and never selects (cut above every level)
    c0 = lcut[h0]
    c1 = lcut[h1] if h1 >= 0 else np.int64(1 << 17)
    c2 = lcut[h2] if h2 >= 0 else np.int64(1 << 17)
    c3 = lcut[h3] if h3 >= 0 else np.int64(1 << 17)
    h1, h2, h3 = max(h1, h0), max(h2, h0), max(h3, h0)
    L0, L1, L2, L3 = lev[h0, j0:j1], lev[h1, j0:j1], lev[h2, j0:j1], lev[h3, j0:j1]
    nu = _lane_union(L0, L1, L2, L3, c0, c1, c2, c3, j1 - j0, j0, fl, ul)
    if nu == 0:
        return
    # the union's levels, compacted, then their weights in loops that vectorize (on natural text
    # the union is ~10% of the tokens: an exp per token of the range would cost ~10x more)
    G0, G1, G2, G3 = G[0], G[1], G[2], G[3]
    for t in range(nu):
        u = ul[t] - j0
        G0[t], G1[t], G2[t], G3[t] = L0[u], L1[u], L2[u], L3[u]
    _lane_weights(G0, nu, c0, scale[h0], offset[h0] - mref[h0], W[0])
    _lane_weights(G1, nu, c1, scale[h1], offset[h1] - mref[h1], W[1])
    _lane_weights(G2, nu, c2, scale[h2], offset[h2] - mref[h2], W[2])
    _lane_weights(G3, nu, c3, scale[h3], offset[h3] - mref[h3], W[3])   # (all 0 for an empty lane)
    if rescore:
        _exact_lane_weights(q, K[kv], ul, nu, fl, j0, h0, h1, h2, h3, mref, W)
    Vflat = V.reshape(V.size)
    base = np.int64(kv) * V.shape[1] * rw
    _prefetch_rows(Vflat, base, rw, ul, 0, min(nu, _PF_DIST))
    _lane_sums(fl, ul, nu, j0, W, lsum, cnt)    # (while the first rows arrive)
    _add_rows(V[kv], Vflat, base, ul, nu, W, acc)


@njit(cache=True, parallel=True)
def _k_level_value_sum(sel, n, V, lanes, nt, counts, q, exact, host, part, exact_part):
    # sel (lev, lcut, scale, offset, mref): see _range_task. part (o [Hq, d] f32, m / l [Hq] f32),
    # counts [Hq] int32 out. Tasks: with n_exact > 0, first one per table row over the exact tier
    # exact (EK, EV [Hkv, >=n_exact, d], n_exact, valid) (attention._exact_chunk, into exact_part
    # (eo, em, el): the fused decode step's sinks + ring in the same parallel region; valid: its
    # slot mask, see _exact_chunk), then (table row, token range), row-interleaved; slot sl of nt
    # does tasks sl, sl + nt, ... into its own sums. host (K, rescore): with rescore, the store's
    # weights from q's exact scores over host keys K (of V's type; unread otherwise).
    lev, _, _, _, mref = sel
    EK, EV, n_exact, valid = exact
    o, m, l = part
    eo, em, el = exact_part
    Hq, d = o.shape
    R = lanes.shape[0]
    nr = (n + _RANGE - 1) // _RANGE
    nx = R if n_exact > 0 else 0
    xo = np.empty((Hq, d), np.float32)             # the exact tier's partials (one chunk per head)
    xm = np.empty(Hq, np.float32)
    xl = np.zeros(Hq, np.float64)
    po = np.zeros((nt, R, LANES, d), np.float64)
    pl = np.zeros((nt, R, LANES), np.float64)
    pc = np.zeros((nt, R, LANES), np.int64)
    for sl in prange(nt):
        ul = np.empty(_RANGE, np.int64)
        fl = np.empty(_RANGE + 8, np.uint8)
        G = np.empty((LANES, _RANGE), lev.dtype)
        W = np.empty((LANES, max(_RANGE, n_exact)), np.float32)   # (also the exact tier's scores)
        acc = np.empty((LANES, d), np.float32)
        lsum = np.empty(LANES, np.float64)
        cnt = np.empty(LANES, np.int64)
        for t in range(sl, nx + nr * R, nt):
            if t < nx:
                _exact_chunk(q, EK, EV, lanes, t, t // (R // EK.shape[0]), 0, n_exact, 1, 0, W, xo, xm, xl,
                             valid)
                continue
            r, j0 = (t - nx) % R, ((t - nx) // R) * _RANGE
            acc[:] = 0.0
            lsum[:] = 0.0
            cnt[:] = 0
            _range_task(sel, lanes, V, r, j0, min(n, j0 + _RANGE), (fl, ul, G, W), (acc, lsum, cnt), q, host)
            for e in range(LANES):
                pl[sl, r, e] += lsum[e]
                pc[sl, r, e] += cnt[e]
                for k in range(d):
                    po[sl, r, e, k] += acc[e, k]
    if nx > 0:                                     # the exact tier's (o, m, l): one chunk per head
        first = np.arange(Hq + 1)
        for h in range(Hq):
            _merge_partials(first, xo, xm, xl, h, eo, em, el)
    for r in range(R):
        for e in range(LANES):
            h = lanes[r, e]
            if h < 0:
                continue
            L = 0.0
            c = 0
            for sl in range(nt):
                L += pl[sl, r, e]
                c += pc[sl, r, e]
            counts[h] = c
            if c == 0 or not L > 0.0:
                o[h] = 0.0
                m[h] = _NEG_INF
                l[h] = 0.0
                continue
            for k in range(d):
                x = 0.0
                for sl in range(nt):
                    x += po[sl, r, e, k]
                o[h, k] = np.float32(x / L)
            m[h] = mref[h]
            l[h] = np.float32(L)
