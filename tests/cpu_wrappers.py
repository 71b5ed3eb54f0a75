"""Array entry points to kernels_cpu's scalar Numba helpers, for the tests: the runtime only calls
these helpers inside its kernels (the float16 loads, the bfloat16 stores), so the tests reach them
through the loops here."""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels_cpu._common import _half_to_float_soft, half_to_float
from kernels_cpu.bf16 import f32_to_bf16


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
