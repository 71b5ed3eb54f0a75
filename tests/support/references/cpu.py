"""Plain NumPy references for the CPU kernels in :mod:`kernels_cpu`.

These are written for clarity, not speed; the tests compare every Numba kernel
against the function here with the same name plus ``_ref``.  ``approx_scores_ref``,
``attend_exact_ref`` and ``lse_merge_ref`` have no Numba kernel of their own: they are the
parts the composed references (``hca_decode_attend_ref`` ...) are built from, and the
references of kernels_cuda's kernels of those names.  Nor have ``pack_lut_ref``,
``packed_scores_ref``, ``packed_select_ref`` / ``levels_select_ref``, ``fs_lut_ref`` and
``fs_levels_ref``: the stages inside the one-call steps (hca_decode_attend,
hca_decode_attend_fs), which the tests check on the tables and levels the steps leave in
their scratch.  ``group_major`` is the index layout helper the tests pass to the kernels.
Conventions (shared with the kernels):

* ``Hq`` query heads, ``Hkv`` kv-heads, ``q_to_kv`` int32 [Hq] maps a query
  head to its kv-head (GQA).
* ``d`` head dim, ``g`` groups per key, ``ds = d // g`` sub-vector size,
  ``c`` centroids per group, ``n`` tokens.
* Scores are already scaled (the caller multiplies ``q`` by ``1/sqrt(d)``).
* Value / key pools may be float32 or float16; references just upcast.

Where accuracy matters the references accumulate in float64 and cast the
result to float32, so they serve as ground truth.
"""

from __future__ import annotations

import numpy as np


def build_lut_ref(q, codebooks, q_to_kv):
    """q [Hq, d] f32, codebooks [Hkv, g, c, ds] f32, q_to_kv int32 [Hq]
    -> T [Hq, g, c] f32 with T[h, i, j] = q[h, i*ds:(i+1)*ds] . codebooks[q_to_kv[h], i, j]."""
    q = np.asarray(q, dtype=np.float64)
    cb = np.asarray(codebooks, dtype=np.float64)
    Hq, d = q.shape
    _, g, c, ds = cb.shape
    qg = q.reshape(Hq, g, ds)
    T = np.einsum("hgs,hgcs->hgc", qg, cb[np.asarray(q_to_kv)])
    return T.astype(np.float32)


def approx_scores_ref(T, P, q_to_kv, n):
    """T [Hq, g, c] f32, P [Hkv, n_cap, g] uint8/int16 -> z [Hq, n] f32,
    z[h, j] = sum_i T[h, i, P[q_to_kv[h], j, i]]."""
    T = np.asarray(T, dtype=np.float64)
    Hq, g, c = T.shape
    z = np.zeros((Hq, n), dtype=np.float64)
    groups = np.arange(g)
    for h in range(Hq):
        codes = P[q_to_kv[h], :n].astype(np.int64)  # [n, g]
        z[h] = T[h, groups[None, :], codes].sum(axis=1)
    return z.astype(np.float32)


def pack_lut_ref(T, qmax=None):
    """T [Hq, g, c] f32 -> (Q int64 [Hq, g, c], scale f32 [Hq], offset f32 [Hq]): the quantized
    tables of kernels_cpu.packed (one head per row, unpacked), with its exact float32 operations."""
    T = np.asarray(T, dtype=np.float32)
    Hq, g, c = T.shape
    qmax = 65535 // g if qmax is None else qmax
    Q = np.zeros((Hq, g, c), np.int64)
    scale, offset = np.empty(Hq, np.float32), np.empty(Hq, np.float32)
    for h in range(Hq):
        lo = T[h].min(axis=1)                                     # [g]
        width = (T[h].max(axis=1) - lo).max()
        s = np.float32(np.float64(width) / qmax) if width > 0 else np.float32(1.0)
        inv = np.float32(1.0 / np.float64(s))
        x = np.floor((T[h] - lo[:, None]) * inv + np.float32(0.5))
        Q[h] = np.clip(x, 0, qmax).astype(np.int64)
        off = 0.0
        for i in range(g):                                        # the kernel's summation order
            off += np.float64(lo[i])
        scale[h], offset[h] = s, np.float32(off)
    return Q, scale, offset


def packed_scores_ref(T, P, q_to_kv, n):
    """Scores from the quantized tables of pack_lut_ref: T [Hq, g, c] f32, P [Hkv, n_cap, g]
    (token-major, as approx_scores_ref) -> z [Hq, n] f32 = scale * sum_i Q[h, i, P[j, i]] + offset."""
    Q, scale, offset = pack_lut_ref(T)
    Hq, g, _ = Q.shape
    z = np.empty((Hq, n), np.float32)
    groups = np.arange(g)
    for h in range(Hq):
        codes = P[q_to_kv[h], :n].astype(np.int64)
        sums = Q[h, groups[None, :], codes].sum(axis=1)           # exact integers
        z[h] = sums.astype(np.float32) * scale[h] + offset[h]
    return z


def group_major(P):
    """Indices P [Hkv, n, g] (token-major, as the references take them) -> contiguous [Hkv, g, n]:
    the group-major layout the kernels read (hca_decode_attend)."""
    return np.ascontiguousarray(np.asarray(P).transpose(0, 2, 1))


def codebooks_t(codebooks):
    """Codebooks [Hkv, g, c, ds] -> contiguous f32 [Hkv, g, ds, c]: the layout the LUT kernels read
    (hca_decode_attend's codebooks_t, encode_keys')."""
    return np.ascontiguousarray(np.asarray(codebooks, dtype=np.float32).transpose(0, 1, 3, 2))


def packed_select_ref(T, P, q_to_kv, n, tau, cap=0):
    """The selection of kernels_cpu.level_select on the levels of pack_lut_ref's tables.

    T [Hq, g, c] f32, P [Hkv, n_cap, g] (token-major) -> (idx int32 [Hq, n], counts int32 [Hq],
    m f32 [Hq] = max score, l_sel f32 [Hq] = sum of exp(z - m) over the selection, z_sel f32
    [Hq, n]): row h's first counts[h] entries of idx are the selected tokens in increasing order
    and those of z_sel their scores (packed_scores_ref's); the rest is 0."""
    Q, scale, offset = pack_lut_ref(T)
    g = Q.shape[1]
    levels = np.stack([Q[h, np.arange(g)[None, :], P[q_to_kv[h], :n].astype(np.int64)].sum(axis=1)
                       for h in range(Q.shape[0])]) if n else np.zeros((Q.shape[0], 0), np.int64)
    return levels_select_ref(levels, Q.max(axis=2).sum(axis=1), scale, offset, tau, cap)


def levels_select_ref(levels, top, scale, offset, tau, cap=0):
    """The level selection of kernels_cpu.level_select: levels int64 [Hq, n] (z = scale * L + offset),
    top int64 [Hq] (the sum of the tables' row maxima) -> packed_select_ref's tuple. cap > 0: at
    most cap tokens per head, whole buckets from the top (the exact fallback: the cap highest
    levels, ties at the last one included); cap < 0: none; or one such cap per head [Hq]."""
    from kernels_cpu.level_select import _COVER, NB
    from kernels_cpu.packed import _BUCKET_LOGITS
    Hq, n = levels.shape
    idx, zsel = np.zeros((Hq, n), np.int32), np.zeros((Hq, n), np.float32)
    counts = np.zeros(Hq, np.int32)
    m, l_sel = np.full(Hq, -np.inf, np.float32), np.zeros(Hq, np.float32)
    if n == 0:
        return idx, counts, m, l_sel, zsel
    caps = _caps_ref(cap, Hq)
    for h in range(Hq):
        L, cap = levels[h], caps[h]
        z = L.astype(np.float32) * scale[h] + offset[h]
        top_h, sh = int(top[h]), 0
        while sh < 15 and np.float64(scale[h]) * 2 ** (sh + 1) <= _BUCKET_LOGITS:
            sh += 1
        w = np.float64(scale[h]) * 2 ** sh
        H = np.bincount(np.minimum((top_h - L) >> sh, NB - 1), minlength=NB)
        bt = int(np.flatnonzero(H)[0])
        if tau <= 0 or cap < 0:
            sel = np.arange(0)
        elif tau >= 1 and not 0 < cap < n:
            sel = np.arange(n)
        elif tau < 1 and H[NB - 1] > 0 and (NB - 1 - bt) * w < _COVER:      # the exact fallback
            ridx, rcnt, _, _ = threshold_select_ref(z[None], tau)
            sel = ridx[0, :rcnt[0]]
            if 0 < cap < sel.size:
                lmin = np.sort(L[sel])[sel.size - cap]
                sel = np.flatnonzero(L >= lmin)
        else:
            bstar = _bucket_cut_ref(H, bt, w, tau, cap)
            sel = np.arange(n) if bstar == NB - 1 else np.flatnonzero(((top_h - L) >> sh) <= bstar)
        counts[h] = sel.size
        idx[h, :sel.size] = sel
        zsel[h, :sel.size] = z[sel]
        m[h] = z.max()
        l_sel[h] = np.exp(z[sel].astype(np.float64) - np.float64(m[h])).astype(np.float32).astype(np.float64).sum()
    return idx, counts, m, l_sel, zsel


def _caps_ref(cap, Hq):
    """cap as an int per head [Hq] (an int: the same for every head)."""
    return [int(cap or 0)] * Hq if np.isscalar(cap) or cap is None else [int(c) for c in cap]


def _bucket_cut_ref(H, bt, w, tau, cap=0):
    """The cut bucket of kernels_cpu.level_select._bucket_cut: the first from bt at which the
    cumulative count_b * exp(-w (b - bt)) reaches tau times its total (tau >= 1: the last
    non-empty); with cap > 0 no further than the buckets from bt holding at most cap tokens (bt
    always). H [NB] counts."""
    if tau >= 1:
        b = int(np.flatnonzero(H)[-1])
    else:
        e = np.concatenate([[1.0], np.cumprod(np.full(len(H) - bt - 1, np.exp(-w)))])   # e_k = e_{k-1} r
        cum = np.cumsum(H[bt:] * e)                                                    # in bucket order
        b = bt + int(np.argmax(cum >= tau * cum[-1]))
    if cap > 0:
        over = np.flatnonzero(np.cumsum(H[bt:b + 1]) > cap)
        if over.size:
            b = max(bt, bt + int(over[0]) - 1)
    return b


def threshold_select_ref(z, tau):
    """z [Hq, n] f32, tau float -> (idx int32 [Hq, n], counts int32 [Hq], m f32 [Hq], l_sel f32 [Hq]).

    Definition (shared with the kernel): with m = max z[h] and float32 weights
    w = exp(z - m), S = sum w (float64), the cut value zcut is the largest z
    value such that the mass of {j : z[h, j] >= zcut} is >= tau * S, found by a
    full descending sort here.  The selected set is {j : z[h, j] >= zcut}, i.e.
    the minimal set plus any tokens tied with zcut.  tau >= 1 selects all n,
    tau <= 0 selects nothing.  idx rows hold the selected token indices in
    increasing order in their first counts[h] entries (the rest is 0 here).
    """
    z = np.asarray(z, dtype=np.float32)
    Hq, n = z.shape
    idx = np.zeros((Hq, n), dtype=np.int32)
    counts = np.zeros(Hq, dtype=np.int32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l_sel = np.zeros(Hq, dtype=np.float32)
    if n == 0:
        return idx, counts, m, l_sel
    for h in range(Hq):
        zh = z[h]
        mh = zh.max()
        m[h] = mh
        if mh == -np.inf:
            continue
        w = np.exp(zh - mh).astype(np.float32)
        if tau >= 1.0:
            idx[h] = np.arange(n, dtype=np.int32)
            counts[h] = n
            l_sel[h] = w.astype(np.float64).sum()
            continue
        if tau <= 0.0:
            continue
        S = w.astype(np.float64).sum()
        order = np.argsort(-zh, kind="stable")
        cum = np.cumsum(w[order].astype(np.float64))
        k = int(np.searchsorted(cum, tau * S, side="left"))
        k = min(k, n - 1)
        zcut = zh[order[k]]
        sel = np.nonzero(zh >= zcut)[0]
        idx[h, : sel.size] = sel
        counts[h] = sel.size
        l_sel[h] = w[sel].astype(np.float64).sum()
    return idx, counts, m, l_sel


def attend_exact_ref(q, K, V, q_to_kv, n, valid=None):
    """q [Hq, d] f32 (pre-scaled), K, V [Hkv, n_cap, d] f32/f16 (first n valid), valid: optional
    uint8 [>= n] (rows with 0 left out) -> o [Hq, d] f32 (normalized), m [Hq] f32 (max score),
    l [Hq] f32 (sum exp(s - m)). No row (n == 0 or none valid) -> o = 0, m = -inf, l = 0."""
    q = np.asarray(q, dtype=np.float64)
    Hq, d = q.shape
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    rows = np.arange(n) if valid is None else np.nonzero(np.asarray(valid)[:n])[0]
    if rows.size == 0:
        return o, m, l
    for h in range(Hq):
        kv = q_to_kv[h]
        k = K[kv, rows].astype(np.float64)
        v = V[kv, rows].astype(np.float64)
        s = np.einsum("nd,d->n", k, q[h])
        mh = s.max()
        w = np.exp(s - mh)
        o[h] = np.einsum("n,nd->d", w, v) / w.sum()
        m[h] = mh
        l[h] = w.sum()
    return o, m, l


def weighted_value_sum_ref(z, idx, counts, V, q_to_kv):
    """z [Hq, n] f32, idx int32 [Hq, >=max(counts)], counts int32 [Hq],
    V [Hkv, n_cap, d] f32/f16, q_to_kv int32 [Hq] -> (o [Hq, d] f32, m [Hq] f32, l [Hq] f32).

    Over j in idx[h, :counts[h]]: w_j = exp(z[h, j] - m_h), m_h = max of the
    selected z; o[h] = sum w_j V[kv, j] / l_h, l_h = sum w_j.
    counts[h] == 0 -> o = 0, m = -inf, l = 0."""
    Hq = z.shape[0]
    d = V.shape[2]
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    for h in range(Hq):
        c = int(counts[h])
        if c == 0:
            continue
        sel = idx[h, :c]
        s = z[h, sel].astype(np.float64)
        mh = s.max()
        w = np.exp(s - mh)
        v = V[q_to_kv[h], sel].astype(np.float64)
        o[h] = np.einsum("n,nd->d", w, v) / w.sum()
        m[h] = mh
        l[h] = w.sum()
    return o, m, l


def selected_scores_ref(q, K, idx, counts, q_to_kv, z, compact=False):
    """q [Hq, d] f32, K [Hkv, n_cap, d] f32/f16, idx int32 [Hq, >=max(counts)], counts int32 [Hq],
    q_to_kv int32 [Hq], z f32 [Hq, >=n] -> a copy of z whose selected entries are exact scores:
    z[h, idx[h, t]] (compact: z[h, t]) = q[h] . K[q_to_kv[h], idx[h, t]] for t < counts[h],
    accumulated in float64."""
    z = np.array(z, dtype=np.float32)
    for h in range(z.shape[0]):
        c = int(counts[h])
        sel = np.asarray(idx[h, :c], dtype=np.int64)
        s = K[q_to_kv[h], sel].astype(np.float64) @ np.asarray(q[h], np.float64)
        z[h, np.arange(c) if compact else sel] = s
    return z


def lse_merge_ref(os, ms, ls):
    """os [P, Hq, d], ms [P, Hq], ls [P, Hq] -> (o [Hq, d] f32, m [Hq] f32, l [Hq] f32).

    M = max over non-empty parts of m_p, w_p = exp(m_p - M) * l_p,
    o = sum_p w_p o_p / sum_p w_p, l = sum_p w_p.  Parts with l_p == 0 or
    m_p == -inf are empty; if all are empty: o = 0, m = -inf, l = 0."""
    os = np.asarray(os, dtype=np.float64)
    ms = np.asarray(ms, dtype=np.float64)
    ls = np.asarray(ls, dtype=np.float64)
    P, Hq, d = os.shape
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    for h in range(Hq):
        live = [p for p in range(P) if ls[p, h] > 0 and ms[p, h] > -np.inf]
        if not live:
            continue
        M = max(ms[p, h] for p in live)
        w = np.array([np.exp(ms[p, h] - M) * ls[p, h] for p in live])
        o[h] = np.einsum("p,pd->d", w, os[live, h]) / w.sum()
        m[h] = M
        l[h] = w.sum()
    return o, m, l


def encode_keys_ref(K, codebooks):
    """K [Hkv, n, d] f32/f16, codebooks [Hkv, g, c, ds] f32 -> P [Hkv, n, g]
    (uint8 if c <= 256 else int16): nearest centroid per group by squared L2,
    ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 evaluated in float64 (accurate
    to ~1e-16 relative, so this is ground truth for the float32 kernel);
    ties -> lowest index (np.argmin)."""
    K = np.asarray(K, dtype=np.float64)
    cb = np.asarray(codebooks, dtype=np.float64)
    Hkv, n, d = K.shape
    _, g, c, ds = cb.shape
    dtype = np.uint8 if c <= 256 else np.int16
    P = np.zeros((Hkv, n, g), dtype=dtype)
    if n == 0:
        return P
    for kv in range(Hkv):
        x = K[kv].reshape(n, g, ds)
        for i in range(g):
            xi = x[:, i, :]  # [n, ds]
            ci = cb[kv, i]  # [c, ds]
            # (einsum, not BLAS: keeps the reference single-threaded)
            xc = np.einsum("ns,cs->nc", xi, ci)
            dist = (xi**2).sum(1)[:, None] - 2.0 * xc + (ci**2).sum(1)[None, :]  # [n, c]
            P[kv, :, i] = np.argmin(dist, axis=1)
    return P


def hca_decode_attend_ref(q, k, v, EK, EV, n_exact, codebooks, P, n_store, V, tau, q_to_kv, host_keys=None, cap=0):
    """One decode token's HCA attention (see kernels_cpu.hca_step): the exact lse_merge of
    attend_exact over EK/EV[:, :n_exact], the token's own k, v, and weighted_value_sum over
    packed_select_ref(build_lut(q)). codebooks [Hkv, g, c, ds],
    P [Hkv, >=n_store, g] (token-major here; the kernel reads it group-major) -> o [Hq, d] f32.
    host_keys [Hkv, >=n_store, d] (rescore): the selection's scores made exact first
    (selected_scores_ref). cap: the selection's cap (levels_select_ref)."""
    q = np.asarray(q, dtype=np.float32)
    store = None
    if n_store:
        T = build_lut_ref(q, codebooks, q_to_kv)
        idx, counts, _, _, _ = packed_select_ref(T, P, q_to_kv, n_store, tau, cap)
        z = packed_scores_ref(T, P, q_to_kv, n_store)
        if host_keys is not None:
            z = selected_scores_ref(q, host_keys, idx, counts, q_to_kv, z)
        store = weighted_value_sum_ref(z, idx, counts, V, q_to_kv)
    return _decode_step_ref(q, k, v, EK, EV, n_exact, q_to_kv, store)


def fs_lut_ref(q, F, q_to_kv):
    """The fast-scan tables of kernels_cpu.fastscan: q [Hq, d] f32, F [Hkv, G, ds, 16] (transposed
    factor codebooks) -> (Q int64 [Hq, G, 16] in [0, 127], scale f32 [Hq], offset f32 [Hq]), with
    the kernel's float32 operations (T summed over the sub-dimensions in order)."""
    q, F = np.asarray(q, np.float32), np.asarray(F, np.float32)
    Hq, G, ds = q.shape[0], F.shape[1], F.shape[2]
    T = np.zeros((Hq, G, 16), np.float32)
    for k in range(ds):
        T += q.reshape(Hq, G, ds)[:, :, k, None] * F[np.asarray(q_to_kv), :, k, :]
    return pack_lut_ref(T, qmax=127)


def fs_levels_ref(Q, PT, q_to_kv, n):
    """Levels over nibble-pair codes: Q int64 [Hq, G, 16], PT [Hkv, G/2, >=n] uint8 (byte p =
    code[2p] | code[2p + 1] << 4) -> int64 [Hq, n] = sum_i Q[h, i, code_i(j)]."""
    codes = np.asarray(PT)[:, :, :n].astype(np.int64)
    lo, hi = codes & 15, codes >> 4                                   # [Hkv, G/2, n]
    out = np.zeros((Q.shape[0], n), np.int64)
    for h in range(Q.shape[0]):
        kv = q_to_kv[h]
        for p in range(codes.shape[1]):
            out[h] += Q[h, 2 * p][lo[kv, p]] + Q[h, 2 * p + 1][hi[kv, p]]
    return out


def hca_decode_attend_fs_ref(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, q_to_kv, host_keys=None, cap=0):
    """hca_decode_attend_ref for nibble-pair codes (kernels_cpu.fastscan): F [Hkv, G, ds, 16]
    transposed factor codebooks, PT [Hkv, G/2, >=n_store] uint8 group-major -> o [Hq, d] f32
    (host_keys, cap: as hca_decode_attend_ref's)."""
    q = np.asarray(q, dtype=np.float32)
    store = None
    if n_store:
        Q, scale, offset = fs_lut_ref(q, F, q_to_kv)
        levels = fs_levels_ref(Q, PT, q_to_kv, n_store)
        idx, counts, _, _, _ = levels_select_ref(levels, Q.max(axis=2).sum(axis=1), scale, offset, tau, cap)
        z = levels.astype(np.float32) * scale[:, None] + offset[:, None]
        if host_keys is not None:
            z = selected_scores_ref(q, host_keys, idx, counts, q_to_kv, z)
        store = weighted_value_sum_ref(z, idx, counts, V, q_to_kv)
    return _decode_step_ref(q, k, v, EK, EV, n_exact, q_to_kv, store)


def _decode_step_ref(q, k, v, EK, EV, n_exact, q_to_kv, store):
    """lse_merge of attend_exact over EK/EV[:, :n_exact], the token's own k, v [Hkv, d], and the
    store's (o, m, l) (None: an empty store) -> o [Hq, d] f32."""
    Hq, d = q.shape
    o1, m1, l1 = attend_exact_ref(q, EK, EV, q_to_kv, n_exact)
    kf, vf = np.asarray(k, np.float64)[q_to_kv], np.asarray(v, np.float32)[q_to_kv]
    m3 = np.einsum("hd,hd->h", q.astype(np.float64), kf).astype(np.float32)
    if store is None:
        store = np.zeros((Hq, d), np.float32), np.full(Hq, -np.inf, np.float32), np.zeros(Hq, np.float32)
    o2, m2, l2 = store
    o, _, _ = lse_merge_ref(np.stack([o1, vf, o2]), np.stack([m1, m3, m2]),
                            np.stack([l1, np.ones(Hq, np.float32), l2]))
    return o


def exact_select_ref(z, tau, cap=0):
    """The selection of kernels_cpu.exact_step on float scores: buckets B = floor(32 z), counted
    down from the highest (the last, NB - 1, takes the rest); the cut bucket b* is the first whose
    cumulative mass, estimated as count_b * exp(-b / 32), reaches tau times the estimated total.
    z [Hq, n] f32 -> sel bool [Hq, n] (z >= (R - b*) / 32, R the top bucket). cap > 0: at most cap
    per head, whole buckets from the top (_bucket_cut_ref); cap < 0: none; or one per head [Hq]."""
    from kernels_cpu.level_select import NB
    Hq, n = z.shape
    sel = np.zeros((Hq, n), bool)
    if n == 0 or tau <= 0:
        return sel
    for h, cap in enumerate(_caps_ref(cap, Hq)):
        if cap < 0:
            continue
        if tau >= 1 and not 0 < cap < n:
            sel[h] = True
            continue
        B = np.floor(z[h].astype(np.float32) * np.float32(32)).astype(np.int64)
        R = B.max()
        H = np.bincount(np.minimum(R - B, NB - 1), minlength=NB)
        bstar = _bucket_cut_ref(H, 0, 1.0 / 32, tau, cap)
        sel[h] = True if bstar == NB - 1 else z[h] >= np.float32((R - bstar) / 32)
    return sel


def hca_exact_decode_attend_ref(q, k, v, EK, EV, n_exact, K, n_store, V, tau, q_to_kv, z=None, cap=0):
    """One decode token's attention over a store of exact keys (see kernels_cpu.exact_step): the
    lse_merge of attend_exact over EK/EV[:, :n_exact], the token's own k, v, and
    weighted_value_sum over exact_select_ref of z = q . K (float64 products; z [Hq, n_store]:
    use these scores instead, e.g. the kernel's, to compare selections bit for bit). K, V
    [Hkv, >=n_store, d] -> o [Hq, d] f32."""
    q = np.asarray(q, dtype=np.float32)
    Hq = q.shape[0]
    store = None
    if n_store:
        if z is None:
            Kh = np.asarray(K, np.float64)[q_to_kv, :n_store]                      # [Hq, n, d]
            z = np.einsum("hd,hnd->hn", q.astype(np.float64), Kh).astype(np.float32)
        sel = exact_select_ref(z, tau, cap)
        counts = sel.sum(1).astype(np.int32)
        idx = np.zeros((Hq, n_store), np.int32)
        for h in range(Hq):
            idx[h, :counts[h]] = np.flatnonzero(sel[h])
        store = weighted_value_sum_ref(z, idx, counts, V, q_to_kv)
    return _decode_step_ref(q, k, v, EK, EV, n_exact, q_to_kv, store)
