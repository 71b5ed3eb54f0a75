"""Exact attention over a chunk of keys (the fused steps' sinks + ring), weighted value sums and the
log-sum-exp merge, each as (o, m, l) partials."""

import numpy as np
from numba import njit, prange

from ._common import _FASTMATH, _NEG_INF, _exp32, _ld, _as_pool, _prefetch, _rows_in, _as_i32
from .value_rows import acc_row


# ---------------------------------------------------------------------------
# shared pieces of the exact tier / weighted_value_sum
# ---------------------------------------------------------------------------


@njit(cache=True, fastmath=_FASTMATH)
def _dots3(q, K, kv, j0, j1, z, zoff, bmax, heads, rows):
    """z[r_e, j - zoff] = q[h_e] . K[kv, j] for e = 0, 1, 2, heads (h_0, h_1, h_2) and rows (r_0,
    r_1, r_2) (repeated heads allowed: the same score written twice), j in [j0, j1); bmax [>= 3]
    f32 their highest scores. K f32 or half bits. Each key row is read once, the three dot
    products share its loads (one loop, three accumulators: fewer horizontal sums and loads than
    one dot at a time)."""
    h0, h1, h2 = heads
    r0, r1, r2 = rows
    d = q.shape[1]
    q0, q1, q2 = q[h0], q[h1], q[h2]
    m0 = m1 = m2 = _NEG_INF
    for j in range(j0, j1):
        Kj = K[kv, j]
        a0 = a1 = a2 = np.float32(0.0)
        for i in range(d):
            x = _ld(Kj[i])
            a0 += q0[i] * x
            a1 += q1[i] * x
            a2 += q2[i] * x
        z[r0, j - zoff], z[r1, j - zoff], z[r2, j - zoff] = a0, a1, a2
        m0, m1, m2 = max(m0, a0), max(m1, a1), max(m2, a2)
    bmax[0], bmax[1], bmax[2] = m0, m1, m2


@njit(inline="always", fastmath=_FASTMATH)
def dot4(q0, q1, q2, q3, Kj):
    """(q0 . Kj, q1 . Kj, q2 . Kj, q3 . Kj) in float32, Kj f32 or half bits: the key row's loads
    shared by the four dot products."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(q0.shape[0]):
        x = _ld(Kj[i])
        a0 += q0[i] * x
        a1 += q1[i] * x
        a2 += q2[i] * x
        a3 += q3[i] * x
    return a0, a1, a2, a3


@njit(cache=True, fastmath=_FASTMATH)
def _dots4(q, K, kv, j0, j1, z, zoff, bmax, heads, rows):
    """_dots3 for four heads and rows; bmax [4]."""
    h0, h1, h2, h3 = heads
    r0, r1, r2, r3 = rows
    q0, q1, q2, q3 = q[h0], q[h1], q[h2], q[h3]
    m0 = m1 = m2 = m3 = _NEG_INF
    for j in range(j0, j1):
        a0, a1, a2, a3 = dot4(q0, q1, q2, q3, K[kv, j])
        z[r0, j - zoff], z[r1, j - zoff], z[r2, j - zoff], z[r3, j - zoff] = a0, a1, a2, a3
        m0, m1, m2, m3 = max(m0, a0), max(m1, a1), max(m2, a2), max(m3, a3)
    bmax[0], bmax[1], bmax[2], bmax[3] = m0, m1, m2, m3


@njit(cache=True)
def _row_dots(q, K, lanes, r, kv, j0, j1, z, zoff, bmax, by_lane):
    """The scores of table row r's heads (lanes [R, 4], -1: empty) against keys j0..j1 of kv-head
    kv, each key row read once for all of them: z[row, j - zoff] = q[h] . K[kv, j], the row being
    the lane e (by_lane) or the head h itself; bmax [LANES] f32 the highest per lane. Rows of fewer
    than 3 heads repeat their first head (wasted work, the same scores); with by_lane, lanes past
    the row's heads hold those repeats."""
    h0 = lanes[r, 0]
    h1, h2, h3 = max(lanes[r, 1], h0), max(lanes[r, 2], h0), lanes[r, 3]
    r0, r1, r2, r3 = (0, 1, 2, 3) if by_lane else (h0, h1, h2, h3)
    if h3 >= 0:
        _dots4(q, K, kv, j0, j1, z, zoff, bmax, (h0, h1, h2, h3), (r0, r1, r2, r3))
    else:
        _dots3(q, K, kv, j0, j1, z, zoff, bmax, (h0, h1, h2), (r0, r1, r2))


@njit(cache=True)
def _merge_partials(first, po, pm, pl, h, o, m, l):
    """Exact LSE merge of head h's work items first[h]:first[h+1].

    po [items, d] f32 unnormalized sums (sum_j exp(s_j - pm) v_j), pm [items]
    f32 item max, pl [items] f64 item sum of weights; writes o[h], m[h], l[h].
    """
    d = po.shape[1]
    M = _NEG_INF
    for it in range(first[h], first[h + 1]):
        if pl[it] > 0.0 and pm[it] > M:
            M = pm[it]
    if M == _NEG_INF:
        for k in range(d):
            o[h, k] = 0.0
        m[h] = _NEG_INF
        l[h] = 0.0
        return
    acc = np.zeros(d, dtype=np.float64)
    L = 0.0
    for it in range(first[h], first[h + 1]):
        if pl[it] > 0.0:
            sc = np.exp(np.float64(pm[it]) - np.float64(M))
            L += sc * pl[it]
            for k in range(d):
                acc[k] += sc * po[it, k]
    for k in range(d):
        o[h, k] = acc[k] / L
    m[h] = M
    l[h] = L


_ALL_VALID = np.zeros(0, np.uint8)   # _exact_chunk's valid for "every key attended"

# ---------------------------------------------------------------------------
# the exact tier: exact attention over a chunk of keys (level_sum's exact-tier tasks)
# ---------------------------------------------------------------------------


@njit(cache=True)
def _exact_chunk(q, K, V, lanes, r, kv, j0, j1, nch, c, s, po, pm, pl, valid):
    """The query heads of table row r (lanes [R, 4], -1: empty) over keys j0..j1 of kv-head kv,
    each K and V row read once for all of them: writes, for each head h of the row, item
    it = h * nch + c of po [items, d] f32 (sum of exp(s - pm) v), pm [items] f32 (max score),
    pl [items] f64 (sum of the weights, float32-accumulated); a max of -inf, +inf or NaN: pm = that
    max, po = 0, pl = 0 (the merge skips items with pl = 0).
    s [4, >= j1 - j0] f32: scratch. Scores by _row_dots (each key row read once for the row's
    heads), then per head the weights, then the weighted rows in key order.
    valid: uint8 [>= j1] (0: key j is not attended: score -inf, weight 0), or empty: all are."""
    d = q.shape[1]
    nl = lanes.shape[1]
    _row_dots(q, K, lanes, r, kv, j0, j1, s, j0, np.empty(nl, np.float32), True)
    if valid.size:
        for j in range(j0, j1):
            if valid[j] == 0:
                for e in range(nl):
                    s[e, j - j0] = _NEG_INF
    live = 0                                     # bit e: lane e has a finite max
    for e in range(nl):
        h = lanes[r, e]
        if h < 0:
            continue
        it = h * nch + c
        mx = _NEG_INF
        for j in range(j1 - j0):
            if s[e, j] > mx:                     # (a NaN score never becomes the max)
                mx = s[e, j]
        pm[it] = mx
        po[it] = 0.0
        pl[it] = 0.0
        if mx > _NEG_INF and mx < np.inf:
            live |= 1 << e
            lsum = np.float32(0.0)
            for j in range(j1 - j0):
                w = _exp32(s[e, j] - mx)
                s[e, j] = w
                lsum += w
            pl[it] = lsum
    if live == 0:
        return
    for j in range(j0, j1):
        Vj = V[kv, j]
        for e in range(nl):
            if live & (1 << e):
                w = s[e, j - j0]
                acc = po[lanes[r, e] * nch + c]
                for k in range(d):
                    acc[k] += w * _ld(Vj[k])


# ---------------------------------------------------------------------------
# 3. weighted_value_sum
# ---------------------------------------------------------------------------

_WVS_CHUNK = 2048
_PF_DIST = 16  # rows prefetched ahead in weighted_value_sum


@njit(cache=True)
def chunk_items(counts, chunk):
    """Parallel work items over per-head selection lists: (first [Hq + 1] int64, item_h [total]
    int64); head h's list is split into chunks of `chunk` entries, items first[h]..first[h + 1]."""
    Hq = counts.shape[0]
    first = np.empty(Hq + 1, dtype=np.int64)
    first[0] = 0
    for h in range(Hq):
        first[h + 1] = first[h] + (counts[h] + chunk - 1) // chunk
    item_h = np.empty(first[Hq], dtype=np.int64)
    for h in range(Hq):
        for it in range(first[h], first[h + 1]):
            item_h[it] = h
    return first, item_h


@njit(cache=True, parallel=True)
def _k_weighted_value_sum(z, idx, counts, V, q_to_kv, chunk, o, m, l, compact=False):
    # compact: z[h, t] is the score of token idx[h, t], else z[h, idx[h, t]]
    Hq = z.shape[0]
    Hkv, ncap, rw = V.shape     # rw: a row's elements (d for float rows; quantized: value_rows)
    d = o.shape[1]
    Vflat = V.reshape(Hkv * ncap * rw)
    pf_step = max(1, 64 // V.itemsize)  # elements per 64-byte cache line
    first, item_h = chunk_items(counts, chunk)
    total = first[Hq]
    po = np.zeros((total, d), dtype=np.float32)
    pm = np.full(total, _NEG_INF, dtype=np.float32)
    pl = np.zeros(total, dtype=np.float64)
    for it in prange(total):
        h = item_h[it]
        kv = q_to_kv[h]
        t0 = (it - first[h]) * chunk
        t1 = min(np.int64(counts[h]), t0 + chunk)
        zh = z[h]
        ih = idx[h]
        base = np.int64(kv) * ncap * rw
        # prime the prefetch pipeline while scanning for the chunk max
        for t in range(t0, min(t1, t0 + _PF_DIST)):
            _prefetch(Vflat, base + np.int64(ih[t]) * rw)
        mx = _NEG_INF
        for t in range(t0, t1):
            v = zh[t] if compact else zh[ih[t]]
            if v > mx:
                mx = v
        pm[it] = mx
        if mx == _NEG_INF or not (mx < np.inf):
            continue
        acc = po[it]
        lsum = np.float32(0.0)
        for t in range(t0, t1):
            if t + _PF_DIST < t1:
                off = base + np.int64(ih[t + _PF_DIST]) * rw
                for e in range(0, rw, pf_step):
                    _prefetch(Vflat, off + e)
            j = ih[t]
            w = _exp32((zh[t] if compact else zh[j]) - mx)
            lsum += w
            acc_row(V[kv, j], w, acc)
        pl[it] = lsum
    for h in prange(Hq):
        _merge_partials(first, po, pm, pl, h, o, m, l)


def weighted_value_sum(z, idx, counts, V, q_to_kv, compact=False, head_dim=None):
    """Softmax-weighted sum of selected value rows (the GPU cache's value sum on the host).

    z [Hq, >=n] f32 scores, idx int32 [Hq, >=max(counts)] token indices,
    counts int32 [Hq], V [Hkv, n_cap, d] f32 or f16, or [Hkv, n_cap, width] uint8 quantized rows
    (minirun/kv/value_codes.py, dequantized in registers: value_rows) (host value pool, must be
    C-contiguous -- it is never copied), q_to_kv int32 [Hq]
    -> (o [Hq, d] f32, m [Hq] f32, l [Hq] f32):
    over j in idx[h, :counts[h]], w_j = exp(z[h, j] - m_h) with m_h the max
    selected score, o[h] = sum w_j V[kv, j] / l_h, l_h = sum w_j.
    counts[h] == 0 -> o = 0, m = -inf, l = 0.  Lists are split into chunks of
    2048 tokens processed in parallel (float32 accumulation inside a chunk,
    value rows software-prefetched 16 ahead), chunks merged exactly by
    log-sum-exp in float64.  Indices are not bounds-checked.
    compact=True: z[h, t] is the score of token idx[h, t] (the selected scores compacted, as the
    GPU cache copies them to the host). head_dim: d of a quantized pool's rows (required there).
    """
    z = _rows_in(z, np.float32)
    Hq = z.shape[0]
    idx, counts, q_to_kv, V, selected = _selection_args(idx, counts, q_to_kv, V, Hq, "V (value pool)")
    if V.dtype == np.uint8 and head_dim is None:
        raise ValueError("a quantized value pool (uint8 rows) needs head_dim")
    o = np.zeros((Hq, V.shape[2] if head_dim is None else int(head_dim)), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    if selected:
        _k_weighted_value_sum(z, idx, counts, V, q_to_kv, _WVS_CHUNK, o, m, l, bool(compact))
    return o, m, l


def _selection_args(idx, counts, q_to_kv, pool, Hq, what):
    """The selection lists of Hq heads and a host pool [Hkv, n_cap, d] as the list kernels take them
    (weighted_value_sum, rescore.selected_scores), checked -> (idx int32 rows, counts, q_to_kv,
    the pool (f32 or half bits, never copied), whether any head selected a token)."""
    idx = np.asarray(idx, dtype=np.int32)
    width = idx.shape[1]                         # (_rows_in may widen the rows to their stride)
    idx, counts, q_to_kv = _rows_in(idx, np.int32), _as_i32(counts), _as_i32(q_to_kv)
    pool = np.asarray(pool)
    if not pool.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if counts.shape[0] != Hq or idx.shape[0] != Hq:
        raise ValueError(f"idx, counts disagree with the scores on Hq={Hq}")
    if Hq and int(counts.max()) > width:
        raise ValueError("counts exceed idx width")
    return idx, counts, q_to_kv, _as_pool(pool), Hq > 0 and int(counts.max()) > 0


# ---------------------------------------------------------------------------
# the log-sum-exp merge of the fused steps' partials (hca_step, exact_step)
# ---------------------------------------------------------------------------


@njit(cache=True)
def _k_lse_merge(os, ms, ls, o, m, l):
    """Exact log-sum-exp merge of partial attention results: os [P, Hq, d] f32 (each part
    normalized), ms, ls [P, Hq] f32 -> o [Hq, d] f32, m, l [Hq] f32 (written):
    M = max_p m_p, w_p = exp(m_p - M) * l_p, o = sum_p w_p o_p / sum_p w_p, l = sum_p w_p.
    Parts with m = -inf or l = 0 contribute nothing; all parts empty -> o = 0, m = -inf, l = 0.
    Reference: lse_merge_ref."""
    P, Hq, d = os.shape
    acc = np.empty(d, dtype=np.float64)
    for h in range(Hq):
        M = -np.inf
        for p in range(P):
            if ls[p, h] > 0.0 and ms[p, h] > M:
                M = ms[p, h]
        if M == -np.inf:
            o[h, :] = 0.0
            m[h] = _NEG_INF
            l[h] = 0.0
            continue
        acc[:] = 0.0
        L = 0.0
        for p in range(P):
            if ls[p, h] > 0.0 and ms[p, h] > -np.inf:
                w = np.exp(np.float64(ms[p, h]) - np.float64(M)) * np.float64(ls[p, h])
                L += w
                for k in range(d):
                    acc[k] += w * os[p, h, k]
        for k in range(d):
            o[h, k] = acc[k] / L
        m[h] = M
        l[h] = L
