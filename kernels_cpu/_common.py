"""Shared pieces of the Numba kernels: float16 loads, dtype/layout checks, constants."""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload


_NEG_INF = np.float32(-np.inf)

# ---------------------------------------------------------------------------
# float16 support
# ---------------------------------------------------------------------------


def _target_has_hw_half():
    """True if the LLVM target Numba compiles for converts half natively:
    x86 with F16C, or aarch64 (its base FP/NEON ISA converts half)."""
    if config.CPU_FEATURES is not None:
        feats = config.CPU_FEATURES
    elif config.CPU_NAME is not None:  # e.g. NUMBA_CPU_NAME=generic for portable caches
        return False
    else:
        feats = get_host_cpu_features()
    feats = feats.split(",")
    return "+f16c" in feats or "+fp-armv8" in feats or "+neon" in feats


_HW_HALF = _target_has_hw_half()
#: how float16 pools are converted: "hardware (fpext)" or "software (bits)"
HALF_CONVERSION = "hardware (fpext)" if _HW_HALF else "software (bits)"


@intrinsic
def _u32_as_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not (isinstance(x, types.Integer) and x.bitwidth >= 32):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, context.get_value_type(types.uint32))
        return builder.bitcast(v, context.get_value_type(types.float32))

    return sig, codegen


def _bitcast(src, dst):
    """An intrinsic that reinterprets a value of type src as dst, a type of the same width."""
    @intrinsic
    def cast(typingctx, x):
        if x != src:
            return None
        return dst(x), lambda context, builder, signature, args: builder.bitcast(args[0], context.get_value_type(dst))
    return cast


_f32_as_i32 = _bitcast(types.float32, types.int32)   # the bits of a float32 as an int32


# fastmath for the kernels whose float reductions should vectorize (dot products, GEMVs):
# reassociation and contraction only, so NaN and inf still propagate
_FASTMATH = {"reassoc", "contract"}


@njit(inline="always")
def _min_max(x, n):
    """(min, max) of x[:n], NaN ignored ((inf, -inf) if none is a number).
    LLVM does not vectorize a float min/max reduction without fastmath, but does an integer one:
    each float's bits become an int32 in the same order (negatives' magnitude bits flipped), with
    a NaN beyond +-inf, so a NaN among x shows as a NaN result and the float chains run instead."""
    a = np.int32(0x7F800000)                      # the key of +inf
    b = np.int32(-0x7F800001)                     # the key of -inf (bits 0x807FFFFF)
    for j in range(n):
        i = _f32_as_i32(x[j])
        k = i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF))
        a = min(a, k)
        b = max(b, k)
    a ^= (a >> np.int32(31)) & np.int32(0x7FFFFFFF)
    b ^= (b >> np.int32(31)) & np.int32(0x7FFFFFFF)
    mn, mx = _u32_as_f32(np.uint32(a)), _u32_as_f32(np.uint32(b))
    if mn != mn or mx != mx:
        return _min_max_chains(x, n)
    return mn, mx


@njit(inline="always")
def _min_max_chains(x, n):
    """_min_max with float compares (NaN ignored): four compare-select chains, since a single chain
    runs at the compare-select latency."""
    a0 = a1 = a2 = a3 = np.float32(np.inf)
    b0 = b1 = b2 = b3 = np.float32(-np.inf)
    j = 0
    while j + 4 <= n:
        v0, v1, v2, v3 = x[j], x[j + 1], x[j + 2], x[j + 3]
        a0 = v0 if v0 < a0 else a0
        a1 = v1 if v1 < a1 else a1
        a2 = v2 if v2 < a2 else a2
        a3 = v3 if v3 < a3 else a3
        b0 = v0 if v0 > b0 else b0
        b1 = v1 if v1 > b1 else b1
        b2 = v2 if v2 > b2 else b2
        b3 = v3 if v3 > b3 else b3
        j += 4
    for r in range(j, n):
        v = x[r]
        a0 = v if v < a0 else a0
        b0 = v if v > b0 else b0
    return min(min(a0, a1), min(a2, a3)), max(max(b0, b1), max(b2, b3))


@njit(inline="always", fastmath={"contract"})
def _exp32(x):
    """exp(x) in float32 for x <= 0, branch-free so loops over it vectorize (Numba's np.exp is a
    scalar libm call: ~14 ns here against ~1 ns for this in a vector loop). Cephes expf:
    k = round(x / ln 2), r = x - k ln 2 (two-part ln 2), degree-6 polynomial, times 2^k.
    Within 1 ulp of exp for x >= -87.3 (relative error < 1e-7); below, where float32 goes
    denormal, 0 (so exp(-inf) = 0; no softmax mass notices a 1e-38). NaN in, NaN out.
    """
    tiny = x < np.float32(-87.33654)
    x = max(x, np.float32(-87.33654))
    k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = p * _u32_as_f32(np.uint32(np.int32(k) + 127) << np.uint32(23))
    return np.float32(0.0) if tiny else e


@intrinsic
def _half_bits_fpext(typingctx, x):
    """uint16 half bits -> float32 via LLVM ``fpext half to float``."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 16):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        ir = cgutils.ir  # llvmlite.ir, reached through numba
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(cache=True)
def _half_to_float_soft(h):
    """Exact IEEE binary16 bits (uint16) -> float32 by bit manipulation.

    Normal numbers: move exponent/mantissa into place and rebias the exponent
    (+112 << 23).  Subnormals (exponent 0): value = mantissa * 2^-24, computed
    in float32 without touching denormal arithmetic.  Inf/NaN (exponent 31):
    all-ones float32 exponent, mantissa kept.  Sign: or-ed in / negated.
    """
    x = np.uint32(h)
    sign = (x & np.uint32(0x8000)) << np.uint32(16)
    em = x & np.uint32(0x7FFF)
    bits = (em << np.uint32(13)) + np.uint32(0x38000000)
    if em >= np.uint32(0x7C00):
        bits = (em << np.uint32(13)) | np.uint32(0x7F800000)
    val = _u32_as_f32(bits | sign)
    if em < np.uint32(0x0400):
        val = np.float32(np.float32(em) * np.float32(5.9604644775390625e-08))  # 2^-24
        if sign != np.uint32(0):
            val = -val
    return val


@njit(cache=True)
def half_to_float(h):
    """Exact IEEE binary16 bits (uint16) -> float32 (hardware when available)."""
    if _HW_HALF:
        return _half_bits_fpext(h)
    return _half_to_float_soft(h)


def _ld(x):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_ld)
def _ld_impl(x):
    """Element load as float32: half bits (uint16) are converted, floats cast."""
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        return lambda x: half_to_float(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


def _as_pool(a):
    """float16 -> zero-copy uint16 view; float32 and uint8 (quantized value rows) kept; anything
    else -> float32."""
    a = np.asarray(a)
    if a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype in (np.float32, np.uint8):
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(a, dtype=np.float32)


def _as_f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


try:  # numpy >= 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - numpy 1.x
    _byte_bounds = np.byte_bounds


def _c_rows(a):
    """2-D array with unit-stride rows -> C-contiguous view of the same memory.

    A row view such as ``buf[:, :n]`` of a wider C-contiguous buffer is
    re-exposed as ``[rows, row_stride]`` (the kernels only touch the first n
    columns), so the kernels see one array layout whether or not the caller
    used a preallocated buffer: no copy and no extra Numba specialisation.
    Returns None when that is not possible (the widened view would leave the
    owning buffer, or rows are not unit-stride).
    """
    if a.flags.c_contiguous:
        return a
    it = a.itemsize
    if a.ndim != 2 or a.shape[0] == 0 or a.strides[1] != it or a.strides[0] % it or a.strides[0] < a.shape[1] * it:
        return None
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    _, hi = _byte_bounds(owner)
    start = a.__array_interface__["data"][0]
    if start + a.shape[0] * a.strides[0] > hi:
        return None
    return np.lib.stride_tricks.as_strided(
        a, shape=(a.shape[0], a.strides[0] // it), strides=a.strides, writeable=a.flags.writeable
    )


def _rows_in(a, dtype):
    """Input [rows, >=n] array -> C-contiguous-typed rows of dtype (copy only if unavoidable)."""
    a = np.asarray(a, dtype=dtype)
    r = _c_rows(a)
    return np.ascontiguousarray(a) if r is None else r


def _as_i32(a):
    return np.ascontiguousarray(a, dtype=np.int32)


@intrinsic
def _prefetch(typingctx, arr, off):
    """Software prefetch (llvm.prefetch, read, high locality) of arr.flat[off].

    Purely a performance hint: it never faults, so off may be anything inside
    the array's allocation.  Used to hide DRAM latency of gathered value rows.
    """
    if not isinstance(arr, types.Array) or not isinstance(off, types.Integer):
        return None
    sig = types.void(arr, off)

    def codegen(context, builder, signature, args):
        ir = cgutils.ir  # llvmlite.ir, reached through numba
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        o = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(ary.data, [o]), cgutils.voidptr_t)
        i32 = cgutils.int32_t
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _store_tile(y, t, rows, out):
    """A quantized GEMV's tile of rows y [R] into out[t R:], short of the padding rows past `rows`."""
    R = y.shape[0]
    for r in range(min(R, rows - t * R)):
        out[t * R + r] = y[r]


def stamp_caches(package: str) -> bool:
    """Make every cached kernel of `package` (its loaded modules' cache=True dispatchers) stale when
    any .py file of the package changes, not only its own. Numba keys a cache by the kernel's own
    file, yet a cached kernel holds the code it calls from other files (the fused decode kernels
    hold decode.py's and quant*.py's GEMVs, those hold this file's loads), so an edited GEMV would
    otherwise run in its older form inside them. The stamp Numba compares becomes (own file's,
    the package's digest), set before any kernel runs so that every process reads and writes an
    index under the same stamp. Uses Numba's cache internals; where they differ, nothing is done
    -> whether it was done."""
    import glob
    import hashlib
    import os
    import sys
    from numba.core.registry import CPUDispatcher
    files = sorted(glob.glob(os.path.join(os.path.dirname(sys.modules[package].__file__), "*.py")))
    digest = hashlib.sha256(b"".join(open(f, "rb").read() for f in files)).digest()
    kernels = {id(k): k for name, mod in list(sys.modules.items()) if name.startswith(package + ".")
               for k in vars(mod).values() if isinstance(k, CPUDispatcher)}
    done = True
    for d in kernels.values():
        cache_file = getattr(getattr(d, "_cache", None), "_cache_file", None)
        if cache_file is None or not hasattr(cache_file, "_source_stamp"):
            done = False
            continue
        cache_file._source_stamp = (cache_file._source_stamp, digest)
    return done


def set_num_threads(n: int) -> None:
    """Threads of the parallel kernels (capped at the pool Numba started with, its core count)."""
    import numba
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


@intrinsic
def _ctz64(typingctx, x):
    """Index of the lowest set bit of x != 0 (llvm.cttz, zero input poison: callers test x first)."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.uint64(x)

    def codegen(context, builder, signature, args):
        ir = cgutils.ir
        i64 = ir.IntType(64)
        v = context.cast(builder, args[0], signature.args[0], types.uint64)
        fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i64")
        return builder.call(fn, [v, ir.IntType(1)(1)])

    return sig, codegen
