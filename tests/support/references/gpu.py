"""NumPy references of kernels_cuda's decode kernels (kernels_cuda/decode.py, gather.cu): the query's
prep, the selection's pack, the staged merge, the gathered value sum and the store-row write.
Re-exported by the references package, where every reference is looked up by name."""
from __future__ import annotations

import numpy as np

from .cpu import lse_merge_ref
from .layer import turn_rows_ref


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


def store_rows_ref(src: np.ndarray, dst: np.ndarray, row: int) -> np.ndarray:
    """src [R, d], dst [R, tokens, d] -> a copy of dst with dst[:, row] = src (kernels_cuda store_rows)."""
    out = dst.copy()
    out[:, row] = src
    return out
