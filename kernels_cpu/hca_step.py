"""One HCA decode step of one layer's attention in a single call.

The step is seven kernels (exact attention over sinks + ring, the new token's own score, lookup
table, approximate scores, threshold selection, weighted value sum, log-sum-exp merge). Called
one by one from Python, their wrappers, checks and small NumPy glue cost ~1 ms per layer on the
2-core VM, as much as the scoring itself; here they run back to back inside one compiled function.
Reference: kernels_cpu.reference.hca_decode_attend_ref (the composition of the kernels' references).
"""

import numpy as np
from numba import njit

from ._common import _NEG_INF, _as_f32, _as_i32, _as_pool, _ld
from .attention import _ATT_CHUNK, _WVS_CHUNK, _k_attend_exact, _k_lse_merge, _k_weighted_value_sum
from .pq import _k_approx_scores, _k_build_lut_t
from .select import _k_threshold_select


@njit(cache=True)
def _k_hca_decode(q, k, v, EK, EV, n_exact, cbt, P, n_store, V, tau, q_to_kv, heads, starts, lut, z, idx,
                  counts, out):
    Hq, d = q.shape
    os = np.zeros((3, Hq, d), np.float32)
    ms = np.full((3, Hq), _NEG_INF, np.float32)
    ls = np.zeros((3, Hq), np.float32)
    if n_exact > 0:                                                   # 1. sinks + ring, exact
        _k_attend_exact(q, EK, EV, q_to_kv, n_exact, _ATT_CHUNK, os[0], ms[0], ls[0])
    for h in range(Hq):                                               # 2. the new token itself
        kv = q_to_kv[h]
        s = np.float32(0.0)
        for i in range(d):
            s += q[h, i] * _ld(k[kv, i])
            os[1, h, i] = _ld(v[kv, i])
        ms[1, h] = s
        ls[1, h] = 1.0
    if n_store > 0:                                                   # 3. the store, approximately
        _k_build_lut_t(q, cbt, q_to_kv, lut)
        _k_approx_scores(lut, P, heads, starts, n_store, z)
        msel = np.empty(Hq, np.float32)
        lsel = np.empty(Hq, np.float32)
        _k_threshold_select(z, n_store, tau, idx, counts, msel, lsel)
        if counts.max() > 0:
            _k_weighted_value_sum(z, idx, counts, V, q_to_kv, _WVS_CHUNK, os[2], ms[2], ls[2])
    m = np.empty(Hq, np.float32)
    l = np.empty(Hq, np.float32)
    out[:] = 0.0
    _k_lse_merge(os, ms, ls, out, m, l)                               # 4. exact merge


def heads_by_kv(q_to_kv, Hkv):
    """Query heads grouped by kv-head: (heads int32 [Hq], starts int32 [Hkv + 1]) for hca_decode_attend."""
    from .pq import _heads_by_kv
    return _heads_by_kv(_as_i32(q_to_kv), Hkv)


def hca_decode_attend(q, k, v, EK, EV, n_exact, codebooks_t, P, n_store, V, tau, q_to_kv, heads, starts,
                      lut, z, idx, counts=None):
    """Attention of one decode token over sinks + ring (exact), itself, and the store (HCA).

    q [Hq, d] f32 (pre-scaled by 1/sqrt(d)); k, v [Hkv, d] (the token's own key and value);
    EK, EV [Hkv, >=n_exact, d] the exact tier; codebooks_t [Hkv, g, ds, c] f32
    (transpose_codebooks); P [Hkv, >=n_store, g] uint8/int16 indices; V [Hkv, >=n_store, d] the
    value pool; heads, starts from heads_by_kv. K/V arrays f32 or f16. Scratch (C-contiguous rows):
    lut f32 [Hq, g, c], z f32 [Hq, >=n_store], idx int32 [Hq, >=n_store], counts int32 [Hq].
    -> o [Hq, d] f32, exactly the lse_merge of attend_exact(EK, EV), the token itself, and
    weighted_value_sum over threshold_select(approx_scores(build_lut(q))); counts holds the
    selection size per head afterwards.
    """
    Hq = q.shape[0]
    if counts is None:
        counts = np.zeros(Hq, np.int32)
    out = np.empty(q.shape, np.float32)
    _k_hca_decode(_as_f32(q), _as_pool(k), _as_pool(v), _as_pool(EK), _as_pool(EV), int(n_exact),
                  codebooks_t, P, int(n_store), _as_pool(V), float(tau), q_to_kv, heads, starts, lut, z, idx,
                  counts, out)
    return out
