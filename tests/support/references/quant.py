"""NumPy references of kernels_cpu.quant: a quantized matrix's tiles dequantized to float32 by the
formulas of ggml-quants.c, row by row from the row-major planes. The tests hold these against the
`gguf` package's own dequantizers (gguf.quants) and the Numba kernels against these."""
from __future__ import annotations

import numpy as np

from kernels_cpu.quant import planes_from_tiles


def _f16(a):
    return a.view(np.float16).astype(np.float32)


def _nibbles_q4(qs):
    """[O, I/2] bytes of 16-byte blocks -> codes [O, I]: low nibbles first, then high, per block."""
    O = qs.shape[0]
    b = qs.reshape(O, -1, 16)
    return np.concatenate([b & 15, b >> 4], axis=2).reshape(O, -1).astype(np.float32)


def dequantize_ref(w) -> np.ndarray:
    """Tiles (any kernels_cpu.quant format) -> float32 [rows, I]."""
    p = planes_from_tiles(w)
    kind = type(w).__name__
    if kind == "Q8_0Tiles":
        O, I = p["qs"].shape
        return (p["qs"].astype(np.float32).reshape(O, -1, 32) * _f16(p["d"])[..., None]).reshape(O, I)
    if kind in ("Q4_0Tiles", "Q4_1Tiles"):
        q = _nibbles_q4(p["qs"])
        O, I = q.shape
        d = _f16(p["d"])[..., None]
        if kind == "Q4_0Tiles":
            return ((q.reshape(O, -1, 32) - 8) * d).reshape(O, I)
        return (q.reshape(O, -1, 32) * d + _f16(p["m"])[..., None]).reshape(O, I)
    if kind == "Q4_KTiles":
        O = p["qs"].shape[0]
        b = p["qs"].reshape(O, -1, 4, 32)                                    # [O, super-block, chunk, byte]
        q = np.stack([b & 15, b >> 4], axis=3).reshape(O, -1, 8, 32).astype(np.float32)   # [O, sb, j, l]
        sc = p["sc"].reshape(O, -1, 8).astype(np.float32) * _f16(p["d"])[..., None]
        mn = p["mn"].reshape(O, -1, 8).astype(np.float32) * _f16(p["dmin"])[..., None]
        return (q * sc[..., None] - mn[..., None]).reshape(O, -1)
    if kind == "Q6_KTiles":
        O = p["ql"].shape[0]
        ql = p["ql"].reshape(O, -1, 2, 2, 32).astype(np.int32)               # [O, sb, h, byte // 32, l]
        qh = p["qh"].reshape(O, -1, 2, 1, 32).astype(np.int32)               # [O, sb, h, ., l]
        lo = np.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)
        hi = (qh >> (2 * np.arange(4).reshape(1, 1, 1, 4, 1))) & 3         # [O, sb, h, s, l]
        q = ((lo | (hi << 4)) - 32).reshape(O, -1, 16, 16).astype(np.float32)   # [O, sb, group, 16]
        sc = p["sc"].reshape(O, -1, 16).astype(np.float32) * _f16(p["d"])[..., None]
        return (q * sc[..., None]).reshape(O, -1)
    raise TypeError(f"dequantize_ref: not a quantized matrix: {kind}")


def gemv_ref(w, x) -> np.ndarray:
    """W @ x in float64 from the dequantized weights -> float32 [rows]."""
    return (dequantize_ref(w).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)
