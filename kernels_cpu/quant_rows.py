"""Dequantization of kernels_cpu.quant's tiles to float32 or bfloat16 rows: a prefill's slab of
rows before torch's GEMM (minirun.quant.matrix), the embedding's rows of a chunk's tokens, and the
GEMV of a CPU without AVX2.
Each format's row follows ggml-quants.c's formulas (kernels_cpu.quant's docstring has the codes'
order); tests/support/references/quant.py is the reference."""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._common import _FASTMATH, _store_tile, half_to_float
from .bf16 import f32_to_bf16
from .quant import Q4_0Tiles, Q4_1Tiles, Q4_KTiles, Q6_KTiles, Q8_0Tiles, _tile_class, in_features

_F32 = np.float32


@njit(fastmath=_FASTMATH, inline="always")
def _row_q8_0(w, t, r, out):
    for b in range(w.d.shape[1]):
        s = half_to_float(w.d[t, b, r])
        for g in range(8):
            q = w.qs[t, b * 8 + g, r]
            o = out[b * 32 + 4 * g:b * 32 + 4 * g + 4]
            for c in range(4):
                o[c] = _F32(q[c]) * s


@njit(inline="always")
def _byte(a, t, k, r):
    """Byte k of row r of tile t in a code part [nt, k / 4, TILE, 4]."""
    return a[t, k >> 2, r, k & 3]


@njit(fastmath=_FASTMATH, inline="always")
def _row_q4(qs, d, m, t, r, out, has_min):
    for b in range(d.shape[1]):
        sc = half_to_float(d[t, b, r])
        mn = half_to_float(m[t, b, r]) if has_min else _F32(-8.0) * sc
        for k in range(16):
            byte = _byte(qs, t, b * 16 + k, r)
            out[b * 32 + k] = sc * _F32(np.uint8(byte & np.uint8(15))) + mn
            out[b * 32 + 16 + k] = sc * _F32(np.uint8(byte >> np.uint8(4))) + mn


@njit(fastmath=_FASTMATH, inline="always")
def _row_q4_k(w, t, r, out):
    for sb in range(w.d.shape[1]):
        d = half_to_float(w.d[t, sb, r])
        dmin = half_to_float(w.dmin[t, sb, r])
        for c in range(4):
            j = sb * 8 + 2 * c
            s0, s1 = d * _F32(w.sc[t, j, r]), d * _F32(w.sc[t, j + 1, r])
            m0, m1 = dmin * _F32(w.mn[t, j, r]), dmin * _F32(w.mn[t, j + 1, r])
            for k in range(32):
                byte = _byte(w.qs, t, sb * 128 + c * 32 + k, r)
                out[j * 32 + k] = s0 * _F32(np.uint8(byte & np.uint8(15))) - m0
                out[j * 32 + 32 + k] = s1 * _F32(np.uint8(byte >> np.uint8(4))) - m1


@njit(fastmath=_FASTMATH, inline="always")
def _row_q6_k(w, t, r, out):
    for sb in range(w.d.shape[1]):
        d = half_to_float(w.d[t, sb, r])
        for h in range(2):
            e0 = sb * 256 + h * 128
            for l in range(32):
                qa = np.int32(_byte(w.ql, t, sb * 128 + h * 64 + l, r))
                qb = np.int32(_byte(w.ql, t, sb * 128 + h * 64 + 32 + l, r))
                qh = np.int32(_byte(w.qh, t, sb * 64 + h * 32 + l, r))
                g = sb * 16 + h * 8 + l // 16
                out[e0 + l] = d * _F32(w.sc[t, g, r]) * _F32(((qa & 15) | ((qh & 3) << 4)) - 32)
                out[e0 + 32 + l] = d * _F32(w.sc[t, g + 2, r]) * _F32(((qb & 15) | ((qh & 12) << 2)) - 32)
                out[e0 + 64 + l] = d * _F32(w.sc[t, g + 4, r]) * _F32(((qa >> 4) | (qh & 48)) - 32)
                out[e0 + 96 + l] = d * _F32(w.sc[t, g + 6, r]) * _F32(((qb >> 4) | ((qh & 192) >> 2)) - 32)


def _dequant_row(w, t, r, out):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_dequant_row)
def _dequant_row_impl(w, t, r, out):
    cls = _tile_class(w)
    if cls is Q8_0Tiles:
        return lambda w, t, r, out: _row_q8_0(w, t, r, out)
    if cls is Q4_0Tiles:
        return lambda w, t, r, out: _row_q4(w.qs, w.d, w.d, t, r, out, False)
    if cls is Q4_1Tiles:
        return lambda w, t, r, out: _row_q4(w.qs, w.d, w.m, t, r, out, True)
    if cls is Q4_KTiles:
        return lambda w, t, r, out: _row_q4_k(w, t, r, out)
    if cls is Q6_KTiles:
        return lambda w, t, r, out: _row_q6_k(w, t, r, out)
    return None


def _dequant_into(w, t, r, out):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_dequant_into)
def _dequant_into_impl(w, t, r, out):
    """A row into float32, or into bfloat16 bits (uint16, rounded to nearest even: the prefill's
    bfloat16 GEMM) through a float32 row."""
    if isinstance(out.dtype, types.Integer):
        def impl_bf16(w, t, r, out):
            row = np.empty(out.shape[0], _F32)
            _dequant_row(w, t, r, row)
            for i in range(out.shape[0]):
                out[i] = f32_to_bf16(row[i])
        return impl_bf16
    return lambda w, t, r, out: _dequant_row(w, t, r, out)


@njit(parallel=True, cache=True)
def _k_dequant_range(w, r0, out):
    R = w[0].shape[2]
    for i in prange(out.shape[0]):
        r = r0 + i
        _dequant_into(w, r // R, r % R, out[i])


@njit(cache=True)
def _k_dequant_ids(w, ids, out):
    R = w[0].shape[2]
    for i in range(ids.shape[0]):
        _dequant_row(w, ids[i] // R, ids[i] % R, out[i])


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def gemm_portable(w, X, out):
    """out [B, rows] f32 = X @ W^T (X [B, I] f32) where the CPU has no integer kernel
    (kernels_cpu.quant_intdot): each row dequantized once, then its float32 dot with each row of X."""
    R, B = w[0].shape[2], X.shape[0]
    for t in prange(w[0].shape[0]):
        row = np.empty(X.shape[1], _F32)
        y = np.empty((B, R), _F32)
        for r in range(R):
            _dequant_row(w, t, r, row)
            for b in range(B):
                x = X[b]
                s = _F32(0.0)
                for i in range(x.shape[0]):
                    s += row[i] * x[i]
                y[b, r] = s
        for b in range(B):
            _store_tile(y[b], t, w.rows, out[b])


def dequantize_rows(w, r0, r1, out=None):
    """Rows [r0, r1) of a quantized matrix as float32 [r1 - r0, I] (out: C-contiguous float32, or
    uint16 for bfloat16 bits)."""
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"dequantize_rows: rows [{r0}, {r1}) outside [0, {w.rows})")
    if out is None:
        out = np.empty((r1 - r0, in_features(w)), np.float32)
    _k_dequant_range(w, int(r0), out)
    return out


def dequantize_ids(w, ids, out=None):
    """The rows `ids` [n] (int64, each in [0, rows)) as float32 [n, I]: an embedding lookup."""
    ids = np.ascontiguousarray(ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"dequantize_ids: ids outside [0, {w.rows})")
    if out is None:
        out = np.empty((ids.shape[0], in_features(w)), np.float32)
    _k_dequant_ids(w, ids, out)
    return out
