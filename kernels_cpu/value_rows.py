"""Value rows of the host pool added into float32 accumulators, for the value sums (level_sum,
attention.weighted_value_sum): float rows (float32, or float16 as uint16 bits) converted per
element; quantized rows (uint8, minirun/kv/value_codes.py) dequantized in registers, a group of 32
channels at a time (one scale, or scale and minimum, per group and row), never into a float copy.

A quantized row of d channels is [codes | float16 scales] bytes: q8 (width >= d) d codes c with
x = (c - 128) s; q4 (width < d) d/2 bytes, group k's byte i holding channel 32k + i (low nibble)
and 32k + 16 + i (high), x = c s + min, (s, min) per group. A weight w times a row is then
(w s) c + w b per group (b = -128 s or min): the sums fold the group's constant once.
Reference: tests/support/references/values.py (decode_values_ref)."""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._common import _ld, half_to_float

GROUP = 32


@njit(inline="always")
def _half_at(row, o):
    """The float16 at bytes o, o + 1 of a uint8 row (little-endian) as float32."""
    return half_to_float(np.uint16(np.uint16(row[o]) | np.uint16(np.uint16(row[o + 1]) << np.uint16(8))))


@njit(inline="always")
def group_affine(row, d, g):
    """(s, b) of group g of a quantized row of d channels: x = c s + b for its codes c."""
    if row.shape[0] >= d:                      # q8: d codes, then a scale per group
        s = _half_at(row, d + 2 * g)
        return s, np.float32(-128.0) * s
    o = d // 2 + 4 * g                         # q4: d / 2 bytes, then (scale, minimum) per group
    return _half_at(row, o), _half_at(row, o + 2)


def acc_row(V, w, acc):  # pragma: no cover - replaced by the overload inside njit code
    """acc [d] += w * row V (float or quantized)."""
    raise NotImplementedError


def acc_pair4(Va, Vb, w0a, w1a, w2a, w3a, w0b, w1b, w2b, w3b, a0, a1, a2, a3):  # pragma: no cover
    """a_e [d] += w_ea * row Va + w_eb * row Vb for the four lanes e (float or quantized rows)."""
    raise NotImplementedError


def _quantized(V):
    return isinstance(V, types.Array) and V.dtype == types.uint8


@overload(acc_row, inline="always")
def _acc_row_impl(V, w, acc):
    if not _quantized(V):
        def float_row(V, w, acc):
            for k in range(acc.shape[0]):
                acc[k] += w * _ld(V[k])
        return float_row

    def quantized_row(V, w, acc):
        d = acc.shape[0]
        q8 = V.shape[0] >= d
        for g in range(d // GROUP):
            s, b = group_affine(V, d, g)
            p, c = w * s, w * b
            o = g * GROUP
            if q8:
                for k in range(GROUP):
                    acc[o + k] += p * np.float32(V[o + k]) + c
            else:
                h = g * (GROUP // 2)
                for k in range(GROUP // 2):
                    x = V[h + k]
                    acc[o + k] += p * np.float32(x & np.uint8(15)) + c
                    acc[o + GROUP // 2 + k] += p * np.float32(x >> np.uint8(4)) + c
    return quantized_row


@overload(acc_pair4, inline="always")
def _acc_pair4_impl(Va, Vb, w0a, w1a, w2a, w3a, w0b, w1b, w2b, w3b, a0, a1, a2, a3):
    if not _quantized(Va):
        def float_pair(Va, Vb, w0a, w1a, w2a, w3a, w0b, w1b, w2b, w3b, a0, a1, a2, a3):
            for k in range(a0.shape[0]):
                xa = _ld(Va[k])
                xb = _ld(Vb[k])
                a0[k] += w0a * xa + w0b * xb
                a1[k] += w1a * xa + w1b * xb
                a2[k] += w2a * xa + w2b * xb
                a3[k] += w3a * xa + w3b * xb
        return float_pair

    def quantized_pair(Va, Vb, w0a, w1a, w2a, w3a, w0b, w1b, w2b, w3b, a0, a1, a2, a3):
        d = a0.shape[0]
        q8 = Va.shape[0] >= d
        for g in range(d // GROUP):
            sa, ba = group_affine(Va, d, g)
            sb, bb = group_affine(Vb, d, g)
            p0a, p1a, p2a, p3a = w0a * sa, w1a * sa, w2a * sa, w3a * sa
            p0b, p1b, p2b, p3b = w0b * sb, w1b * sb, w2b * sb, w3b * sb
            c0, c1 = w0a * ba + w0b * bb, w1a * ba + w1b * bb
            c2, c3 = w2a * ba + w2b * bb, w3a * ba + w3b * bb
            o = g * GROUP
            if q8:
                for k in range(GROUP):
                    xa = np.float32(Va[o + k])
                    xb = np.float32(Vb[o + k])
                    a0[o + k] += p0a * xa + p0b * xb + c0
                    a1[o + k] += p1a * xa + p1b * xb + c1
                    a2[o + k] += p2a * xa + p2b * xb + c2
                    a3[o + k] += p3a * xa + p3b * xb + c3
            else:
                h, u = g * (GROUP // 2), o + GROUP // 2
                for k in range(GROUP // 2):
                    ya, yb = Va[h + k], Vb[h + k]
                    la, lb = np.float32(ya & np.uint8(15)), np.float32(yb & np.uint8(15))
                    ha, hb = np.float32(ya >> np.uint8(4)), np.float32(yb >> np.uint8(4))
                    a0[o + k] += p0a * la + p0b * lb + c0
                    a1[o + k] += p1a * la + p1b * lb + c1
                    a2[o + k] += p2a * la + p2b * lb + c2
                    a3[o + k] += p3a * la + p3b * lb + c3
                    a0[u + k] += p0a * ha + p0b * hb + c0
                    a1[u + k] += p1a * ha + p1b * hb + c1
                    a2[u + k] += p2a * ha + p2b * hb + c2
                    a3[u + k] += p3a * ha + p3b * hb + c3
    return quantized_pair
