"""GEMV and dequantization kernels for GGUF block-quantized weights: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.

Layout ("row tiles"): a weight matrix [O, I] is cut into tiles of TILE consecutive rows (the last
one padded with zero rows), and every part of the GGUF blocks is stored tile-major with the row
index innermost: scales and mins [n_tiles, k, TILE] (k: that part's count per row, I/32 scales,
...), codes [n_tiles, k / 4, TILE, 4]: four consecutive bytes of a row side by side, one 32-bit lane
of an integer dot product. A GEMV reads, per lane of columns, the codes of 16 (or 8) rows in one
register, so each block's scale is a vector multiply and no horizontal sum is needed.

The decode GEMV (kernels_cpu.quant_intdot) multiplies the codes as bytes by x quantized per block to
16 bits (AVX-512 VNNI) or 14 (AVX2), with a stated error bound; a CPU without AVX2 dequantizes each
row and dots it with x in float32 (quant_rows.gemm_portable). Each takes B rows of x (B
sequences' decode tokens) and reads a tile's codes once for all of them. Prefill dequantizes slabs of rows for
torch's GEMM (quant_rows). Scales and mins stay float16 bits (uint16), as the GGUF stores them, so
the resident bytes equal the file's (Q4_K: +2.8%, its 6-bit scales widened to bytes).

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
kernels_cpu.decode accept one wherever they accept a float matrix (the `_gemm_f32` overload
below). References: tests/support/references/quant.py (NumPy), checked against gguf.quants in the tests.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit
from numba.extending import overload

from . import quant_intdot as intdot
from .decode import _gemm_f32, _rows

TILE = 64

Q8_0Tiles = namedtuple("Q8_0Tiles", ["qs", "d", "rows"])
"""qs int8 [nt, I/4, TILE, 4]; d float16 bits [nt, I/32, TILE]."""
Q4_0Tiles = namedtuple("Q4_0Tiles", ["qs", "d", "rows"])
"""qs uint8 [nt, I/8, TILE, 4]; d float16 bits [nt, I/32, TILE]."""
Q4_1Tiles = namedtuple("Q4_1Tiles", ["qs", "d", "m", "rows"])
"""qs uint8 [nt, I/8, TILE, 4]; d, m float16 bits [nt, I/32, TILE]."""
Q4_KTiles = namedtuple("Q4_KTiles", ["qs", "d", "dmin", "sc", "mn", "rows"])
"""qs uint8 [nt, I/8, TILE, 4]; d, dmin float16 bits [nt, I/256, TILE]; sc, mn uint8 [nt, I/32, TILE]."""
Q6_KTiles = namedtuple("Q6_KTiles", ["ql", "qh", "sc", "d", "rows"])
"""ql uint8 [nt, I/8, TILE, 4]; qh uint8 [nt, I/16, TILE, 4]; sc int8 [nt, I/16, TILE]; d float16 bits [nt, I/256, TILE]."""

TILE_TYPES = {"Q8_0": Q8_0Tiles, "Q4_0": Q4_0Tiles, "Q4_1": Q4_1Tiles, "Q4_K": Q4_KTiles, "Q6_K": Q6_KTiles}


# the GEMV of every format: on integer byte products where the CPU has AVX-512 VNNI or AVX2
# (kernels_cpu.quant_intdot), else each row dequantized and dotted with x (quant_rows.gemm_portable)
_GEMM_INT = {"avx512vnni": intdot.gemm_vnni, "avx2": intdot.gemm_avx2}.get(intdot.isa())


def _tile_class(w):
    """The format's named-tuple class of a Numba type, or None."""
    cls = getattr(w, "instance_class", None)
    return cls if cls in _CODES_PER_ENTRY else None


@overload(_gemm_f32)
def _gemm_quant_impl(w, X, out):
    """out [B, rows] (float32) = X [B, I] (float32) @ W^T for a quantized W: the decode kernels' GEMVs."""
    if _tile_class(w) is None:
        return None
    from .quant_rows import gemm_portable          # (quant_rows imports this module)
    kernel = _GEMM_INT or gemm_portable
    return lambda w, X, out: kernel(w, X, out)


@overload(_rows)
def _rows_quant_impl(w):
    if _tile_class(w) is None:
        return None
    return lambda w: w.rows


@njit(cache=True)
def _k_gemm(w, X, out):
    _gemm_f32(w, X, out)


def gemv(w, x, out=None):
    """W @ x for one quantized matrix (a *Tiles tuple): x [I] float32 -> out [rows] float32, or
    x [B, I] (B tokens) -> out [B, rows]."""
    X = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    if out is None:
        out = np.empty((X.shape[0], w.rows) if x.ndim == 2 else w.rows, np.float32)
    _k_gemm(w, X, out.reshape(X.shape[0], w.rows))
    return out


_CODES_PER_ENTRY = {Q8_0Tiles: 4, Q4_0Tiles: 8, Q4_1Tiles: 8, Q4_KTiles: 8, Q6_KTiles: 8}   # of codes' dim 1
_CODE_PARTS = {"qs", "ql", "qh"}      # laid out four bytes of a row to a lane: [nt, k / 4, tile, 4]


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
        g = 4 if name in _CODE_PARTS else 1
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
