"""bfloat16 <-> float32 inside Numba kernels. NumPy has no bfloat16: arrays travel as uint16 bits.

Widening is exact (the bits are a float32's top half); narrowing rounds to nearest even, as torch
does, so values stored by our kernels equal what torch's `.to(torch.bfloat16)` would store.
"""

import numpy as np
from numba import njit, types

from ._common import _bitcast, _u32_as_f32


_f32_as_u32 = _bitcast(types.float32, types.uint32)   # a float32's bits


@njit(inline="always")
def bf16_to_f32(h):
    """bfloat16 bits (uint16) -> float32, exact."""
    return _u32_as_f32(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def f32_to_bf16(f):
    """float32 -> bfloat16 bits, round to nearest even (NaN stays NaN: its high bits survive)."""
    u = _f32_as_u32(f)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

