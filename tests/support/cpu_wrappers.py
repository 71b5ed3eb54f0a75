"""Array entry points to kernels_cpu's scalar Numba helpers, for the tests: the runtime only calls
these helpers inside its kernels (the float16 loads, the bfloat16 stores, one head's exact float
selection), so the tests reach them through the loops here."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu._common import _c_rows, _half_to_float_soft, _rows_in, half_to_float
from kernels_cpu.bf16 import f32_to_bf16
from kernels_cpu.select import _select_head


@njit(cache=True)
def _k_half_array(bits, out, soft):
    for i in range(bits.shape[0]):
        if soft:
            out[i] = _half_to_float_soft(bits[i])
        else:
            out[i] = half_to_float(bits[i])


def half_to_float_array(bits, soft: bool = False) -> np.ndarray:
    """half bits uint16 [N] -> float32 [N] (kernels_cpu.half_to_float); soft forces the
    bit-manipulation path where the hardware conversion would be taken."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16).ravel()
    out = np.empty(bits.shape[0], np.float32)
    _k_half_array(bits, out, soft)
    return out


@njit(cache=True)
def _k_f32_to_bf16_array(f, out):
    for i in range(f.shape[0]):
        out[i] = f32_to_bf16(f[i])


def float_to_bf16_bits(f) -> np.ndarray:
    """float32 [N] -> bfloat16 bits uint16 [N], the kernels' rounding (kernels_cpu.bf16.f32_to_bf16:
    to nearest even)."""
    f = np.ascontiguousarray(f, dtype=np.float32).ravel()
    out = np.empty(f.shape[0], np.uint16)
    _k_f32_to_bf16_array(f, out)
    return out


@njit(cache=True, parallel=True)
def _k_select_rows(z, n, tau, idx, counts, m, l_sel):
    for h in prange(z.shape[0]):
        cnt, mh, lh = _select_head(z[h], n, tau, idx[h])
        counts[h] = cnt
        m[h] = mh
        l_sel[h] = np.float32(lh)


def threshold_select(z, tau, out_idx=None):
    """kernels_cpu.select._select_head (the level cut's exact fallback) on every row of z f32
    [Hq, n] -> (idx int32 [Hq, n] (row h's first counts[h] entries, increasing), counts int32 [Hq],
    m f32 [Hq], l_sel f32 [Hq]); out_idx: optional int32 [Hq, >= n] with unit-stride rows, written."""
    z = np.asarray(z, dtype=np.float32)
    if z.ndim != 2:
        raise ValueError("z must be [Hq, n]")
    Hq, n = z.shape
    z = _rows_in(z, np.float32)
    if out_idx is None:
        out_idx = np.empty((Hq, n), dtype=np.int32)
    buf = _c_rows(out_idx) if isinstance(out_idx, np.ndarray) and out_idx.ndim == 2 else None
    if buf is None or out_idx.dtype != np.int32 or out_idx.shape[0] != Hq or out_idx.shape[1] < n:
        raise ValueError("out_idx must be int32 [Hq, >=n] with unit-stride rows")
    counts = np.zeros(Hq, dtype=np.int32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l_sel = np.zeros(Hq, dtype=np.float32)
    if n > 0:
        _k_select_rows(z, n, float(tau), buf, counts, m, l_sel)
    return out_idx[:, :n], counts, m, l_sel
