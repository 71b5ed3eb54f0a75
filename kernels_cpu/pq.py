"""Product-quantization kernels: key encoding (the lookup tables and the scores from them:
kernels_cpu.packed, kernels_cpu.level_select)."""

import numpy as np
from numba import njit, prange

from ._common import _ld, _as_pool, _as_f32, _min_max


# ---------------------------------------------------------------------------
# encode_keys
# ---------------------------------------------------------------------------

_ENC_TILE = 128  # tokens per tile: the vector lanes of the encode loops


@njit(cache=True)
def _argmin_update(v, bv, bi, jj, tn):
    # branch-free running argmin over the tile's tokens; strict < keeps the
    # lowest centroid index on ties (centroids are visited in increasing order)
    for t in range(tn):
        lt = v[t] < bv[t]
        bv[t] = v[t] if lt else bv[t]
        bi[t] = jj if lt else bi[t]


@njit(inline="always")
def _tile_argmin(X2, Ci, cni, tn, dist, bv, bi):
    """bi[t] = the centroid of Ci [c, ds] nearest to token t < tn of the tile, X2 [ds, >= tn] (2 x,
    dimension-major), by dist = cni[jj] - X2[:, t] . Ci[jj] (cni [c] the norms); bv [>= tn] the best
    distances, dist [>= tn] scratch. ds = 1, 2, 4: one fused loop per centroid; other ds
    accumulate dist one dimension at a time (the same operation order)."""
    c, ds = Ci.shape
    for t in range(tn):
        bv[t] = np.inf
        bi[t] = 0
    if ds == 4:
        x0 = X2[0]
        x1 = X2[1]
        x2 = X2[2]
        x3 = X2[3]
        for jj in range(c):
            cj = cni[jj]
            c0 = Ci[jj, 0]
            c1 = Ci[jj, 1]
            c2 = Ci[jj, 2]
            c3 = Ci[jj, 3]
            jj32 = np.int32(jj)
            for t in range(tn):
                v = (((cj - x0[t] * c0) - x1[t] * c1) - x2[t] * c2) - x3[t] * c3
                lt = v < bv[t]
                bv[t] = v if lt else bv[t]
                bi[t] = jj32 if lt else bi[t]
    elif ds == 2:
        x0 = X2[0]
        x1 = X2[1]
        for jj in range(c):
            cj = cni[jj]
            c0 = Ci[jj, 0]
            c1 = Ci[jj, 1]
            jj32 = np.int32(jj)
            for t in range(tn):
                v = (cj - x0[t] * c0) - x1[t] * c1
                lt = v < bv[t]
                bv[t] = v if lt else bv[t]
                bi[t] = jj32 if lt else bi[t]
    elif ds == 1:
        x0 = X2[0]
        for jj in range(c):
            cj = cni[jj]
            c0 = Ci[jj, 0]
            jj32 = np.int32(jj)
            for t in range(tn):
                v = cj - x0[t] * c0
                lt = v < bv[t]
                bv[t] = v if lt else bv[t]
                bi[t] = jj32 if lt else bi[t]
    else:
        for jj in range(c):
            cj = cni[jj]
            for t in range(tn):
                dist[t] = cj
            for k in range(ds):
                ck = Ci[jj, k]
                xk = X2[k]
                for t in range(tn):
                    dist[t] -= xk[t] * ck
            _argmin_update(dist, bv, bi, np.int32(jj), tn)


@njit(cache=True, parallel=True)
def _k_encode_keys(K, C, cn, out):
    # K [Hkv, n, d] (f32 or u16 half bits), C [Hkv, g, c, ds] f32,
    # cn [Hkv, g, c] f32 (||centroid||^2), out [Hkv, >=n, g] uint8/int16.
    # Work item = (kv-head, tile of _ENC_TILE tokens); inside, tokens are the
    # vector lanes: for each centroid jj, dist[t] = ||c||^2 - 2 x_t . c is
    # computed for all tokens of the tile at once and folded into a running
    # argmin (_tile_argmin).
    Hkv, n, d = K.shape
    g = C.shape[1]
    ds = C.shape[3]
    TT = _ENC_TILE
    nt = (n + TT - 1) // TT
    for it in prange(Hkv * nt):
        kv = it // nt
        t0 = (it % nt) * TT
        tn = min(TT, n - t0)
        X2 = np.empty((ds, TT), dtype=np.float32)  # 2 * x, dimension-major
        dist = np.empty(TT, dtype=np.float32)
        bv = np.empty(TT, dtype=np.float32)
        bi = np.empty(TT, dtype=np.int32)
        for i in range(g):
            for t in range(tn):
                Kt = K[kv, t0 + t]
                for k in range(ds):
                    X2[k, t] = np.float32(2.0) * _ld(Kt[i * ds + k])
            _tile_argmin(X2, C[kv, i], cn[kv, i], tn, dist, bv, bi)
            for t in range(tn):
                out[kv, t0 + t, i] = bi[t]


_FEW = 8  # encode_keys: up to this many tokens, the centroids are the vector lanes (_k_encode_few)


@njit(cache=True, parallel=True)
def _k_encode_few(K, Ct, cn, out):
    # K [Hkv, n, d] (f32 or u16 half bits) with few tokens, Ct [Hkv, g, ds, c] f32 (transposed
    # codebooks), cn [Hkv, g, c], out [Hkv, >=n, g]. The tile path above vectorizes over tokens and
    # runs scalar for one token (2.6 ms per decode step for 30 layers); here the centroids are the
    # lanes. Same expression, same order, same tie rule, so the same indices as _k_encode_keys.
    Hkv, n, d = K.shape
    g, c = Ct.shape[1], Ct.shape[3]
    for it in prange(Hkv * g):
        kv, i = it // g, it % g
        dist = np.empty(c, np.float32)
        for t in range(n):
            out[kv, t, i] = _nearest(K[kv, t], i, Ct[kv, i], cn[kv, i], dist)


@njit(inline="always")
def _nearest(k, i, Cti, cni, dist):
    """Index of the centroid of group i nearest to the key row k (f32 or half bits): Cti [ds, c]
    transposed codebook, cni [c] norms, dist [c] scratch. Ties go to the lowest index."""
    ds, c = Cti.shape
    if ds == 4:                                   # one pass over the row (same order of operations)
        x0, x1 = np.float32(2.0) * _ld(k[i * 4]), np.float32(2.0) * _ld(k[i * 4 + 1])
        x2, x3 = np.float32(2.0) * _ld(k[i * 4 + 2]), np.float32(2.0) * _ld(k[i * 4 + 3])
        C0, C1, C2, C3 = Cti[0], Cti[1], Cti[2], Cti[3]
        for jj in range(c):
            dist[jj] = (((cni[jj] - x0 * C0[jj]) - x1 * C1[jj]) - x2 * C2[jj]) - x3 * C3[jj]
    else:
        for jj in range(c):
            dist[jj] = cni[jj]
        for k_ in range(ds):
            x2 = np.float32(2.0) * _ld(k[i * ds + k_])
            row = Cti[k_]
            for jj in range(c):
                dist[jj] -= x2 * row[jj]
    best, _ = _min_max(dist, c)                   # argmin as min + first match
    bi = 0
    if best < np.inf:
        while dist[bi] != best:
            bi += 1
    return bi


def codebook_norms(codebooks):
    """||c||^2 per centroid: codebooks [Hkv, g, c, ds] -> [Hkv, g, c] f32 (for encode_keys' cnorm)."""
    cb = _as_f32(codebooks)
    return np.einsum("hgcs,hgcs->hgc", cb, cb).astype(np.float32)


def encode_keys(K, codebooks, cnorm=None, codebooks_t=None):
    """Product-quantize keys: nearest centroid per group.

    K [Hkv, n, d] f32 or f16, codebooks [Hkv, g, c, ds] f32
    -> P [Hkv, n, g], uint8 if c <= 256 else int16 (c <= 32768);
    P[kv, t, i] = argmin_j ||K[kv, t, i*ds:(i+1)*ds] -
    codebooks[kv, i, j]||^2 via the expansion ||c||^2 - 2 x.c (the ||x||^2
    term is constant per argmin and skipped), float32, ties -> lowest index.
    Parallel over (kv-head, 128-token tile); the tile's tokens are the vector
    lanes.  cnorm: optional precomputed ||c||^2 [Hkv, g, c] f32 (callers that encode
    with the same codebooks every step pass it to skip recomputing it). codebooks_t: optional
    codebooks laid out [Hkv, g, ds, c] (contiguous); with it, up to 8 tokens (a decode step's one
    token leaving the ring) are encoded with the centroids as the vector lanes (same result; the
    tile path runs scalar for so few tokens).  (As with any float32 expansion, near-ties whose
    squared distances differ by less than ~1e-6 x (||x||^2 + ||c||^2) may be resolved
    differently from exact arithmetic.)
    """
    K = _as_pool(K)
    cb = _as_f32(codebooks)
    Hkv, n, d = K.shape
    Hkv2, g, c, ds = cb.shape
    if Hkv2 != Hkv or g * ds != d:
        raise ValueError(f"codebooks {cb.shape} do not match K {K.shape}")
    if c > 32768:
        raise ValueError("at most 32768 centroids per group")
    out = np.empty((Hkv, n, g), dtype=np.uint8 if c <= 256 else np.int16)
    if n > 0:
        cn = codebook_norms(cb) if cnorm is None else _as_f32(cnorm)
        if codebooks_t is not None and n <= _FEW:
            _k_encode_few(K, _as_f32(codebooks_t), cn, out)
        else:
            _k_encode_keys(K, cb, cn, out)
    return out
