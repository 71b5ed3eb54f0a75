"""One decode token's exact attention over a dense KV cache on the CPU (minirun/kv/dense.py's
attend_np), float32 or bfloat16 bits; its NumPy reference is tests/support/references/cpu.py's
`dense_attend_ref`."""

import numpy as np
from numba import njit, prange

from ._common import _FASTMATH, _NEG_INF, _exp32
from .decode import _FLOAT_OR_BF16, _st, _wf


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _k_dense_attend(q, K, V, n, scale, chunk, out):
    """q [Hq, d], K, V [Hkv, >=n, d] f32 or bfloat16 bits -> out [Hq, d] (f32 or bfloat16 bits).

    One task per (kv-head, chunk of keys): each K and V row is read once and serves the kv-head's
    Hq/Hkv query heads (the GQA group), then the chunks' partial softmaxes merge per head.
    """
    _dense_attend(q, K, V, n, scale, chunk, out)


@njit(fastmath=_FASTMATH, cache=True)
def _k_dense_attend_serial(q, K, V, n, scale, chunk, out):
    """_k_dense_attend in the calling thread: under ~190 keys starting its two parallel regions
    costs more than the work (SmolLM2 at 16 keys: 3.6 against 9 us a layer, 2 cores)."""
    _dense_attend(q, K, V, n, scale, chunk, out)


@njit(fastmath=_FASTMATH, inline="always")
def _dense_attend(q, K, V, n, scale, chunk, out):
    Hq, d = q.shape
    Hkv = K.shape[0]
    rep = Hq // Hkv
    nch = (n + chunk - 1) // chunk
    po = np.zeros((Hkv * nch, rep, d), np.float32)   # per task: unnormalized sum of weighted values
    pm = np.full((Hkv * nch, rep), _NEG_INF, np.float32)
    pl = np.zeros((Hkv * nch, rep), np.float32)
    for it in prange(Hkv * nch):
        kv = it // nch
        j0 = (it % nch) * chunk
        m = min(n, j0 + chunk) - j0
        qf = np.empty((rep, d), np.float32)          # the group's queries, scaled, as float32
        for r in range(rep):
            for i in range(d):
                qf[r, i] = _wf(q[kv * rep + r, i]) * scale
        s = np.empty((rep, m), np.float32)
        for j in range(m):
            kr = K[kv, j0 + j]
            for r in range(rep):
                qh = qf[r]
                a = np.float32(0.0)
                for i in range(d):
                    a += qh[i] * _wf(kr[i])
                s[r, j] = a
        for r in range(rep):
            mx = _NEG_INF
            for j in range(m):
                mx = max(mx, s[r, j])
            lsum = np.float32(0.0)
            for j in range(m):
                w = _exp32(s[r, j] - mx)
                s[r, j] = w
                lsum += w
            pm[it, r] = mx
            pl[it, r] = lsum
        acc = po[it]
        for j in range(m):
            vr = V[kv, j0 + j]
            for r in range(rep):
                w = s[r, j]
                for i in range(d):
                    acc[r, i] += w * _wf(vr[i])
    for h in prange(Hq):
        kv, r = h // rep, h % rep
        mx = _NEG_INF
        for c in range(nch):
            mx = max(mx, pm[kv * nch + c, r])
        lsum = np.float32(0.0)
        o = np.zeros(d, np.float32)
        for c in range(nch):
            sc = _exp32(pm[kv * nch + c, r] - mx)
            lsum += sc * pl[kv * nch + c, r]
            for i in range(d):
                o[i] += sc * po[kv * nch + c, r, i]
        for i in range(d):
            _st(out[h], i, o[i] / lsum)



def dense_attend(q, K, V, n, scale=1.0, out=None):
    """One decode token's exact attention over the first n keys of a dense cache.

    q [Hq, d] (scores are scale * q.k); K, V [Hkv, >=n, d] (C-contiguous); each of q, K, V and
    out float32 or bfloat16 bits (uint16); Hq a multiple of Hkv (query head h reads kv-head
    h // (Hq/Hkv)). Returns out [Hq, d] (float32 unless given). n >= 1. torch's SDPA on the same
    decode step costs 2-3x as much on a 2-core CPU (dispatch at short contexts, a slower inner
    loop at long ones).
    """
    Hq, d = q.shape
    Hkv = K.shape[0]
    if not (V.dtype is K.dtype and K.dtype in _FLOAT_OR_BF16 and q.dtype in _FLOAT_OR_BF16) or Hq % Hkv \
            or not 1 <= n <= K.shape[1]:
        raise ValueError(f"dense_attend: q, K, V float32 or bfloat16 bits and Hq % Hkv == 0, 1 <= n <= {K.shape[1]}; "
                         f"got {q.dtype}/{K.dtype}/{V.dtype}, Hq={Hq}, Hkv={Hkv}, n={n}")
    out = np.empty((Hq, d), np.float32) if out is None else out
    # enough tasks for the threads at short contexts, long chunks (less merging) at long ones
    chunk = min(512, max(64, -(-n // max(1, 8 // Hkv))))
    (_k_dense_attend if n >= 192 else _k_dense_attend_serial)(q, K, V, int(n), np.float32(scale), chunk, out)
    return out

