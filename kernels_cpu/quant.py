"""GEMV and dequantization kernels for GGUF block-quantized weights: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.

Layout ("row tiles"): a weight matrix [O, I] is cut into tiles of TILE consecutive rows (the last
one padded with zero rows), and every part of the GGUF blocks -- codes, scales, mins -- is stored
tile-major with the row index innermost: part [n_tiles, k, TILE], where k is that part's count per
row (I codes, I/32 scales, ...). A GEMV then reads, for each input element, the codes of TILE rows
side by side, so the compiler vectorizes across rows: no horizontal sum per block, the block scale
is a vector multiply. (Row-major blocks with a per-block integer dot product, llama.cpp's way,
came out 3-5x slower here: LLVM reduces each 32-element block horizontally.)

Activations stay float32: codes are widened to float32 and multiplied into the input, then scaled
per block; no int8 quantization of the activation, so the result equals the dequantized weights
times x up to float32 summation order. Q8_0 is the exception where the CPU has AVX-512 VNNI or AVX2:
its codes lie four columns to a 32-bit lane and kernels_cpu.quant_intdot multiplies them as bytes
by x quantized to 16 (VNNI) or 14 bits a block (2.5-4x the float tile's speed; error bound stated
there). Scales and mins stay float16 bits (uint16), as the GGUF stores them, so the resident bytes
equal the file's (Q4_K: +2.8%, its 6-bit scales widened to bytes).

Codes within a block keep GGUF's order (ggml-quants.c):
  Q8_0   32 int8 codes q, w = d * q
  Q4_0   16 bytes: byte k holds element k (low nibble) and 16 + k (high); w = d * (q - 8)
  Q4_1   same codes; w = d * q + m
  Q4_K   super-block of 256 in 8 sub-blocks of 32: byte 32c + l holds element 64c + l (low nibble,
         sub-block 2c) and 64c + 32 + l (high, sub-block 2c + 1); w = d * sc[j] * q - dmin * mn[j]
  Q6_K   super-block of 256, two halves of 128: element 128h + 32s + l has its low 4 bits in ql
         byte 64h + 32(s % 2) + l (nibble s // 2) and its high 2 bits in qh byte 32h + l (bits
         2s, 2s + 1); w = d * sc[e // 16] * (q - 32)

Each format is a named tuple of its parts plus `rows` (the real O); the fused decode kernels of
kernels_cpu.decode accept one wherever they accept a float matrix (the `_gemv_f32` overload
below). References: tests/references/quant.py (NumPy), checked against gguf.quants in the tests.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import decode, quant_intdot as intdot
from ._common import _FASTMATH, _store_tile, half_to_float
from .decode import _gemv_f32, _rows

TILE = 64

Q8_0Tiles = namedtuple("Q8_0Tiles", ["qs", "d", "rows"])
"""qs int8 [nt, I/4, TILE, 4] (four consecutive columns of a row side by side: one 32-bit lane of
an integer dot product); d float16 bits [nt, I/32, TILE]."""
Q4_0Tiles = namedtuple("Q4_0Tiles", ["qs", "d", "rows"])
"""qs uint8 [nt, I/2, TILE]; d float16 bits [nt, I/32, TILE]."""
Q4_1Tiles = namedtuple("Q4_1Tiles", ["qs", "d", "m", "rows"])
"""qs uint8 [nt, I/2, TILE]; d, m float16 bits [nt, I/32, TILE]."""
Q4_KTiles = namedtuple("Q4_KTiles", ["qs", "d", "dmin", "sc", "mn", "rows"])
"""qs uint8 [nt, I/2, TILE]; d, dmin float16 bits [nt, I/256, TILE]; sc, mn uint8 [nt, I/32, TILE]."""
Q6_KTiles = namedtuple("Q6_KTiles", ["ql", "qh", "sc", "d", "rows"])
"""ql uint8 [nt, I/2, TILE]; qh uint8 [nt, I/4, TILE]; sc int8 [nt, I/16, TILE]; d float16 bits [nt, I/256, TILE]."""

TILE_TYPES = {"Q8_0": Q8_0Tiles, "Q4_0": Q4_0Tiles, "Q4_1": Q4_1Tiles, "Q4_K": Q4_KTiles, "Q6_K": Q6_KTiles}
_F32 = np.float32


# ---- one tile of rows: y [TILE] (+)= W_tile @ x ---------------------------------------------------------
# R (the tile's rows) is read from the array shape, not the TILE constant: a constant trip count lets
# LLVM unroll the row loop before vectorizing it, and the unrolled code came out ~3x slower. Each row
# loop sums into four accumulators: with one, its 32 FMAs formed one dependency chain and the loop
# ran at the FMA latency (~1.5x slower, one thread, Zen 4).

@njit(fastmath=_FASTMATH, inline="always")
def _tile_q8_0(qs, d, t, x, y):
    """The portable Q8_0 tile (float32 products; kernels_cpu.quant_intdot has the integer ones). Per
    block, a row quad's 16 bytes (4 rows x 4 columns) times the block's x in that pattern, summed
    over the 8 column groups: the 16-lane loop is contiguous, so it vectorizes; each row's four
    lanes add up once per block."""
    G, R = qs.shape[1], qs.shape[2]
    qt = qs[t].reshape(G, R // 4, 16)
    xe = np.empty((8, 16), _F32)
    acc = np.empty((R // 4, 16), _F32)
    for b in range(G // 8):
        for g in range(8):
            for l in range(16):
                xe[g, l] = x[b * 32 + 4 * g + (l & 3)]
        qb = qt[b * 8:b * 8 + 8]
        for m in range(R // 4):
            for l in range(16):
                s = _F32(0.0)
                for g in range(8):
                    s += _F32(qb[g, m, l]) * xe[g, l]
                acc[m, l] = s
        db = d[t, b]
        for r in range(R):
            a = acc[r // 4, (r % 4) * 4:(r % 4) * 4 + 4]
            y[r] += half_to_float(db[r]) * ((a[0] + a[1]) + (a[2] + a[3]))


@njit(fastmath=_FASTMATH, inline="always")
def _tile_q4(qs, d, m, t, x, xsum, y, has_min):
    """Q4_0 (has_min False: codes offset by 8) and Q4_1 (w = d q + m)."""
    R = qs.shape[2]
    for b in range(qs.shape[1] // 16):
        xb = x[b * 32:b * 32 + 32]
        qb = qs[t, b * 16:b * 16 + 16]
        db = d[t, b]
        mb = m[t, b]
        xs = xsum[b]
        for r in range(R):
            s0 = s1 = s2 = s3 = _F32(0.0)
            for k in range(0, 16, 2):
                b0 = qb[k, r]
                b1 = qb[k + 1, r]
                s0 += _F32(np.uint8(b0 & np.uint8(15))) * xb[k]
                s1 += _F32(np.uint8(b0 >> np.uint8(4))) * xb[16 + k]
                s2 += _F32(np.uint8(b1 & np.uint8(15))) * xb[k + 1]
                s3 += _F32(np.uint8(b1 >> np.uint8(4))) * xb[17 + k]
            s = (s0 + s1) + (s2 + s3)
            if has_min:
                y[r] += half_to_float(db[r]) * s + half_to_float(mb[r]) * xs
            else:
                y[r] += half_to_float(db[r]) * (s - _F32(8.0) * xs)


@njit(fastmath=_FASTMATH, inline="always")
def _tile_q4_k(w, t, x, xsum, y):
    """Each 32-byte chunk in two halves of 16 bytes: a row loop's body of 32 products is what LLVM
    unrolls fully and then vectorizes across rows (64 left the k loop inside and nothing vectorized)."""
    qs, R = w.qs, w.qs.shape[2]
    for sb in range(qs.shape[1] // 128):
        d = w.d[t, sb]
        dmin = w.dmin[t, sb]
        for c in range(4):
            j = sb * 8 + 2 * c                   # the low nibbles' sub-block; j + 1 the high ones'
            sc0, sc1, mn0, mn1 = w.sc[t, j], w.sc[t, j + 1], w.mn[t, j], w.mn[t, j + 1]
            xs0, xs1 = xsum[j], xsum[j + 1]
            for r in range(R):
                y[r] -= half_to_float(dmin[r]) * (_F32(mn0[r]) * xs0 + _F32(mn1[r]) * xs1)
            for part in range(2):
                x0 = x[j * 32 + part * 16:j * 32 + part * 16 + 16]
                x1 = x[j * 32 + 32 + part * 16:j * 32 + 32 + part * 16 + 16]
                qb = qs[t, sb * 128 + c * 32 + part * 16:sb * 128 + c * 32 + part * 16 + 16]
                for r in range(R):
                    s0 = s1 = s2 = s3 = _F32(0.0)
                    for k in range(0, 16, 2):
                        b0 = qb[k, r]
                        b1 = qb[k + 1, r]
                        s0 += _F32(np.uint8(b0 & np.uint8(15))) * x0[k]
                        s1 += _F32(np.uint8(b0 >> np.uint8(4))) * x1[k]
                        s2 += _F32(np.uint8(b1 & np.uint8(15))) * x0[k + 1]
                        s3 += _F32(np.uint8(b1 >> np.uint8(4))) * x1[k + 1]
                    y[r] += half_to_float(d[r]) * (_F32(sc0[r]) * (s0 + s2) + _F32(sc1[r]) * (s1 + s3))


@njit(inline="always")
def _q6(lo, hb, shift):
    """A Q6_K code as float32: 4 low bits `lo` (0..15), 2 high bits at `shift` in byte hb, minus 32."""
    return _F32(np.uint8(lo | np.uint8(np.uint8(hb >> np.uint8(shift)) & np.uint8(3)) << np.uint8(4))) - _F32(32.0)


@njit(fastmath=_FASTMATH, inline="always")
def _rows_q6_k(q, hb, xa, xb, sca, scb, d, y, sh_a, sh_b):
    """y[r] += d[r] (sca[r] sum_k code_a xa[k] + scb[r] sum_k code_b xb[k]) over 8 bytes q[k, r]:
    code_a from the low nibbles and qh bits at sh_a, code_b from the high ones and bits at sh_b."""
    for r in range(q.shape[1]):
        sa0 = sa1 = sb0 = sb1 = _F32(0.0)
        for k in range(0, 8, 2):
            b0, h0 = q[k, r], hb[k, r]
            b1, h1 = q[k + 1, r], hb[k + 1, r]
            sa0 += _q6(np.uint8(b0 & np.uint8(15)), h0, sh_a) * xa[k]
            sb0 += _q6(np.uint8(b0 >> np.uint8(4)), h0, sh_b) * xb[k]
            sa1 += _q6(np.uint8(b1 & np.uint8(15)), h1, sh_a) * xa[k + 1]
            sb1 += _q6(np.uint8(b1 >> np.uint8(4)), h1, sh_b) * xb[k + 1]
        y[r] += half_to_float(d[r]) * (_F32(sca[r]) * (sa0 + sa1) + _F32(scb[r]) * (sb0 + sb1))


@njit(fastmath=_FASTMATH, inline="always")
def _tile_q6_k(w, t, x, y):
    """Per 8 bytes of ql two row loops (bytes l, then 32 + l) of 16 products each, with constant
    shifts: the body LLVM unrolls fully and vectorizes across rows (see _tile_q4_k; 16 bytes per
    loop, with the high bits' extra work, left it scalar: 10x slower)."""
    ql = w.ql
    for sb in range(ql.shape[1] // 128):
        d = w.d[t, sb]
        for h in range(2):
            e0 = sb * 256 + h * 128
            for half in range(2):                # 16 elements per scale: l in [16 half, 16 half + 16)
                l0 = half * 16
                q0 = sb * 128 + h * 64 + l0
                hb = w.qh[t, sb * 64 + h * 32 + l0:sb * 64 + h * 32 + l0 + 16]
                g = sb * 16 + h * 8 + half       # the scale of group s (elements 32 s + l): g + 2 s
                for k0 in range(0, 16, 8):
                    a = e0 + l0 + k0
                    _rows_q6_k(ql[t, q0 + k0:q0 + k0 + 8], hb[k0:k0 + 8], x[a:a + 8], x[a + 64:a + 72],
                               w.sc[t, g], w.sc[t, g + 4], d, y, 0, 4)
                    _rows_q6_k(ql[t, q0 + 32 + k0:q0 + 40 + k0], hb[k0:k0 + 8], x[a + 32:a + 40], x[a + 96:a + 104],
                               w.sc[t, g + 2], w.sc[t, g + 6], d, y, 2, 6)


@njit(fastmath=_FASTMATH, inline="always")
def _block_sums(x):
    """x [I] -> sums of its 32-element blocks [I/32] (the mins' and Q4_0 offset's factor)."""
    n = x.shape[0] // 32
    out = np.empty(n, _F32)
    for b in range(n):
        s = _F32(0.0)
        for j in range(32):
            s += x[b * 32 + j]
        out[b] = s
    return out


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_q8_0_portable(w, x, out):
    nt = w.qs.shape[0]
    for t in prange(nt):
        y = np.zeros(w.qs.shape[2], _F32)
        _tile_q8_0(w.qs, w.d, t, x, y)
        _store_tile(y, t, w.rows, out)


# Q8_0 multiplies bytes where the CPU has AVX-512 VNNI or AVX2 (kernels_cpu.quant_intdot)
_gemv_q8_0 = {"avx512vnni": intdot.gemv_q8_0_vnni, "avx2": intdot.gemv_q8_0_avx2}.get(intdot.isa(), _gemv_q8_0_portable)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_q4_0(w, x, out):
    xsum = _block_sums(x)
    for t in prange(w.qs.shape[0]):
        y = np.zeros(w.qs.shape[2], _F32)
        _tile_q4(w.qs, w.d, w.d, t, x, xsum, y, False)
        _store_tile(y, t, w.rows, out)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_q4_1(w, x, out):
    xsum = _block_sums(x)
    for t in prange(w.qs.shape[0]):
        y = np.zeros(w.qs.shape[2], _F32)
        _tile_q4(w.qs, w.d, w.m, t, x, xsum, y, True)
        _store_tile(y, t, w.rows, out)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_q4_k(w, x, out):
    xsum = _block_sums(x)
    for t in prange(w.qs.shape[0]):
        y = np.zeros(w.qs.shape[2], _F32)
        _tile_q4_k(w, t, x, xsum, y)
        _store_tile(y, t, w.rows, out)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_q6_k(w, x, out):
    for t in prange(w.ql.shape[0]):
        y = np.zeros(w.ql.shape[2], _F32)
        _tile_q6_k(w, t, x, y)
        _store_tile(y, t, w.rows, out)


_GEMV = {Q8_0Tiles: _gemv_q8_0, Q4_0Tiles: _gemv_q4_0, Q4_1Tiles: _gemv_q4_1, Q4_KTiles: _gemv_q4_k,
         Q6_KTiles: _gemv_q6_k}


def _tile_class(w):
    """The format's named-tuple class of a Numba type, or None."""
    cls = getattr(w, "instance_class", None)
    return cls if cls in _GEMV else None


@overload(_gemv_f32)
def _gemv_quant_impl(w, x, out):
    """out [rows] (float32) = W @ x (float32) for a quantized W: the decode kernels' GEMVs."""
    cls = _tile_class(w)
    if cls is None:
        return None
    kernel = _GEMV[cls]
    return lambda w, x, out: kernel(w, x, out)


@overload(_rows)
def _rows_quant_impl(w):
    if _tile_class(w) is None:
        return None
    return lambda w: w.rows


@njit(cache=True)
def _k_gemv(w, x, out):
    _gemv_f32(w, x, out)


def gemv(w, x, out=None):
    """W @ x for one quantized matrix (a *Tiles tuple) and x [I] float32 -> out [rows] float32."""
    if out is None:
        out = np.empty(w.rows, np.float32)
    _k_gemv(w, np.ascontiguousarray(x, np.float32), out)
    return out


_CODES_PER_ENTRY = {Q8_0Tiles: 4, Q4_0Tiles: 2, Q4_1Tiles: 2, Q4_KTiles: 2, Q6_KTiles: 2}   # of codes' dim 1
_GROUPED = {(Q8_0Tiles, "qs"): 4}     # parts whose columns lie in groups innermost: [nt, k / g, tile, g]


def in_features(w) -> int:
    """I: the matrix's columns, from its codes' shape."""
    return w[0].shape[1] * _CODES_PER_ENTRY[type(w)]


def is_quantized(w) -> bool:
    return type(w) in _CODES_PER_ENTRY


# ---- layout: row-major planes <-> row tiles ------------------------------------------------------------

def tiles_from_planes(fmt: str, planes: dict):
    """Row-major parts -> the format's tiles. planes: part name -> array [O, k] in the dtypes the
    tile tuple documents (float16 scales as float16 or uint16 bits); rows padded with zeros to a
    multiple of TILE. The one repacking a loaded matrix goes through."""
    cls = TILE_TYPES[fmt]
    parts = [f for f in cls._fields if f != "rows"]
    rows = planes[parts[0]].shape[0]
    nt = -(-rows // TILE)
    out = {}
    for name in parts:
        p = np.asarray(planes[name])
        if p.dtype == np.float16:
            p = p.view(np.uint16)
        if p.ndim != 2 or p.shape[0] != rows:
            raise ValueError(f"tiles_from_planes: part {name} has shape {p.shape}, expected [{rows}, k]")
        g = _GROUPED.get((cls, name), 1)
        padded = np.zeros((nt * TILE, p.shape[1]), p.dtype)
        padded[:rows] = p
        t = padded.reshape(nt, TILE, p.shape[1] // g, g).transpose(0, 2, 1, 3)
        out[name] = np.ascontiguousarray(t if g > 1 else t[..., 0])
    return cls(rows=rows, **out)


def planes_from_tiles(w) -> dict:
    """The inverse of tiles_from_planes: part name -> row-major [rows, k] array (float16 bits as uint16)."""
    out = {}
    for name in type(w)._fields:
        if name != "rows":
            a = getattr(w, name)
            a = a if a.ndim == 4 else a[..., None]              # [nt, k / g, tile, g]
            out[name] = np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(-1, a.shape[1] * a.shape[3])[:w.rows])
    return out


def cat_rows(ws):
    """Matrices of one format stacked by rows (the fused QKV and gate/up): one tiles tuple."""
    fmt = {type(w) for w in ws}
    if len(fmt) != 1:
        raise ValueError("cat_rows: the matrices must share a format")
    planes = [planes_from_tiles(w) for w in ws]
    name = next(k for k, v in TILE_TYPES.items() if v in fmt)
    return tiles_from_planes(name, {k: np.concatenate([p[k] for p in planes]) for k in planes[0]})
