"""Exact scores of the selected tokens, from full-precision keys in host memory (the `rescore` setting).

The codebook scores pick the tokens that carry a head's mass; used as softmax weights too they
carry the codebooks' error (docs/QUALITY.md, "Rescoring from host keys": with every token selected,
the 4-dimension codebooks alone cost +7% perplexity). With the keys kept on the host beside the
values, the selected tokens' scores are recomputed exactly here and the value sum weights them by
those: codebooks only select.
"""

import numpy as np
from numba import njit, prange

from ._common import _FASTMATH, _c_rows, _ld, _prefetch, _rows_in
from .attention import _PF_DIST, _WVS_CHUNK, _selection_args, chunk_items


@njit(cache=True, parallel=True, fastmath=_FASTMATH)
def _k_selected_scores(q, K, idx, counts, q_to_kv, chunk, z, compact):
    Hkv, ncap, d = K.shape
    Kflat = K.reshape(Hkv * ncap * d)
    pf_step = max(1, 64 // K.itemsize)  # elements per 64-byte cache line
    first, item_h = chunk_items(counts, chunk)
    for it in prange(first[-1]):
        h = item_h[it]
        kv = q_to_kv[h]
        t0 = (it - first[h]) * chunk
        t1 = min(np.int64(counts[h]), t0 + chunk)
        qh, ih, zh = q[h], idx[h], z[h]
        base = np.int64(kv) * ncap * d
        for t in range(t0, min(t1, t0 + _PF_DIST)):
            _prefetch(Kflat, base + np.int64(ih[t]) * d)
        for t in range(t0, t1):
            if t + _PF_DIST < t1:   # key rows are scattered: fetch ahead, as the value sum does
                off = base + np.int64(ih[t + _PF_DIST]) * d
                for e in range(0, d, pf_step):
                    _prefetch(Kflat, off + e)
            Kj = K[kv, ih[t]]
            a = np.float32(0.0)
            for i in range(d):
                a += qh[i] * _ld(Kj[i])
            zh[t if compact else ih[t]] = a


def selected_scores(q, K, idx, counts, q_to_kv, z, compact=False):
    """Overwrite the selected tokens' scores with exact ones, in place.

    q [Hq, d] f32 (the scaled queries that read the store), K [Hkv, n_cap, d] f32 or f16 (host key
    pool, C-contiguous, never copied), idx int32 [Hq, >= max(counts)], counts int32 [Hq], q_to_kv
    int32 [Hq], z f32 [Hq, >= n] with unit-stride rows: for t < counts[h], with j = idx[h, t],
    z[h, j] = q[h] . K[q_to_kv[h], j]; compact=True: z[h, t] instead (the layout
    weighted_value_sum(compact=True) reads). Other entries are untouched. Returns z.
    """
    q = _rows_in(q, np.float32)
    Hq = q.shape[0]
    idx, counts, q_to_kv, K, selected = _selection_args(idx, counts, q_to_kv, K, Hq, "K (host key pool)")
    zr = _c_rows(z) if isinstance(z, np.ndarray) and z.dtype == np.float32 and z.ndim == 2 else None
    if zr is None or z.shape[0] != Hq:
        raise ValueError(f"z must be float32 [Hq={Hq}, n] with unit-stride rows (it is written in place)")
    if K.shape[2] != q.shape[1]:
        raise ValueError("K head dim does not match q")
    if selected:
        _k_selected_scores(q, K, idx, counts, q_to_kv, _WVS_CHUNK, zr, bool(compact))
    return z
