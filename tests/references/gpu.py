"""NumPy references of kernels_cuda's decode kernels (kernels_cuda/decode.py, gather.cu): the query's
prep, the selection's pack, the staged merge, the gathered value sum and the store-row write.
Re-exported by the references package, where every reference is looked up by name."""
from __future__ import annotations

import numpy as np

from .cpu import lse_merge_ref, turn_rows_ref


def decode_prep_ref(q, scale, cs=None):
    """q [Hq, d] (float) -> (qs = q * scale, qf = qs turned by cs = [cos (d/2) | sin (d/2)] as
    turn_rows_ref does, or None without cs), float32 [Hq, d] each. (The kernel also copies k, v
    into the exact tier's spare row and zeroes a buffer: plain copies, checked directly.)"""
    qs = (np.asarray(q, np.float64) * scale).astype(np.float32)
    if cs is None:
        return qs, None
    h = qs.shape[1] // 2
    return qs, turn_rows_ref(qs[None], 0, cs[:h], cs[h:])[0]


def pack_selection_ref(idx, z, counts, cap, n, w):
    """idx [Hq, >= w] (int), z [Hq, >= n] f32, counts [Hq] -> (c [Hq] = min(counts, cap),
    idx_w [Hq, w] int32, z_w [Hq, w] f32): row h's first min(c, w) entries are idx[h, t] clamped to
    [0, n) and z at it; the rest is unspecified (the kernel leaves it unwritten), zeros here."""
    Hq = len(counts)
    c = np.minimum(np.asarray(counts, np.int64), cap).astype(np.int32)
    idx_w = np.zeros((Hq, w), np.int32)
    z_w = np.zeros((Hq, w), np.float32)
    for h in range(Hq):
        k = min(int(c[h]), w)
        j = np.clip(np.asarray(idx[h, :k], np.int64), 0, n - 1)
        idx_w[h, :k] = j
        z_w[h, :k] = z[h, j]
    return c, idx_w, z_w


def lse_merge_staged_ref(os, ms, ls, stage):
    """os [P, Hq, d], ms, ls [P, Hq], stage [Hq, d + 2] (o | m | l: one more part) -> o [Hq, d]
    f32, as lse_merge_ref over the P + 1 parts."""
    d = os.shape[2]
    stage = np.asarray(stage, np.float32)
    o, _, _ = lse_merge_ref(np.concatenate([os, stage[None, :, :d]]), np.concatenate([ms, stage[None, :, d]]),
                            np.concatenate([ls, stage[None, :, d + 1]]))
    return o


def gather_value_sum_ref(idx, z, counts, cap, n, m, V, q_to_kv, nsplit):
    """idx [Hq, >= c] (int), z [Hq, >= n] f32, counts [Hq], m [Hq] f32 (>= every z[h, :n]),
    V [Hkv, cap_tokens, d], q_to_kv [Hq] -> (os [nsplit, Hq, d], ms, ls [nsplit, Hq]) f32: split s of
    head h covers t in [s S, min((s + 1) S, c)), S = ceil(c / nsplit), c = min(counts[h], cap);
    over j = idx[h, t] clamped to [0, n), w = exp(z[h, j] - m[h]): o = sum w V[kv, j] / sum w,
    m = m[h], l = sum w; an empty split (0, -inf, 0)."""
    Hq, d = len(counts), V.shape[2]
    os = np.zeros((nsplit, Hq, d), np.float32)
    ms = np.full((nsplit, Hq), -np.inf, np.float32)
    ls = np.zeros((nsplit, Hq), np.float32)
    for h in range(Hq):
        c = min(int(counts[h]), cap)
        share = -(-c // nsplit)
        for s in range(nsplit):
            j = np.clip(np.asarray(idx[h, s * share:min((s + 1) * share, c)], np.int64), 0, n - 1)
            if len(j) == 0 or not m[h] > -np.inf:
                continue
            w = np.exp(z[h, j].astype(np.float64) - m[h])
            if not w.sum() > 0:
                continue
            os[s, h] = w @ V[q_to_kv[h], j].astype(np.float64) / w.sum()
            ms[s, h], ls[s, h] = m[h], w.sum()
    return os, ms, ls


def store_rows_ref(src: np.ndarray, dst: np.ndarray, row: int) -> np.ndarray:
    """src [R, d], dst [R, tokens, d] -> a copy of dst with dst[:, row] = src (kernels_cuda store_rows)."""
    out = dst.copy()
    out[:, row] = src
    return out
