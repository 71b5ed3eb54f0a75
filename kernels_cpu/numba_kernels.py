"""Numba CPU kernels for the HCAttention decode path.

Every public function here has a NumPy reference of the same name plus
``_ref`` in :mod:`kernels_cpu.reference`; see that module for the exact
semantics.  The public functions are thin Python wrappers that validate /
normalise dtypes and allocate outputs, then call an ``@njit(cache=True)``
kernel (names starting with ``_k_``).  All kernels use ``fastmath=False``
(Numba's default): no reassociation, no nnan/ninf assumptions, so -inf
scores and empty sets behave exactly as documented.  Numba leaves the SLP
vectorizer off, so hot loops are written so that the *loop* vectorizer can
handle them (innermost loops are long, unit-stride, branch-free).

Conventions: ``Hq`` query heads, ``Hkv`` kv-heads, ``q_to_kv`` int32 [Hq]
(query head -> kv-head), ``d`` head dim, ``g`` groups per key, ``ds = d // g``,
``c`` centroids per group, ``n`` tokens.  Float inputs are float32 unless
stated.  Scores are already scaled (q pre-multiplied by 1/sqrt(d)).

Float16 pools
-------------
Numba 0.68 has no float16 type on the CPU (an ``np.float16`` array argument
raises ``NotImplementedError: float16`` at typing time).  float16 key / value
pools are therefore accepted by the wrappers, *viewed* (zero-copy) as uint16,
and converted to float32 element by element inside the kernels by
:func:`half_to_float`.  On hosts whose LLVM target has hardware half
conversion (x86 F16C -- every x86-64 CPU since 2012 -- or aarch64) it is an
LLVM ``fpext half -> float`` (vectorizes to ``vcvtph2ps``); otherwise an exact
branch-free bit-manipulation fallback (:func:`_half_to_float_soft`) is used.
Both are exact IEEE binary16 -> binary32 (subnormals, infinities, NaN).
Kernels are generic over the element type via :func:`_ld` (floats pass
through, uint16 goes through the half conversion), so each pool dtype gets
its own compiled specialisation.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload

__all__ = [
    "build_lut",
    "approx_scores",
    "threshold_select",
    "attend_exact",
    "weighted_value_sum",
    "lse_merge",
    "encode_keys",
    "codebook_norms",
    "transpose_codebooks",
    "half_to_float",
    "HALF_CONVERSION",
]

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


@njit(cache=True)
def _k_half_array(bits, out, soft):
    """out[i] = float32 of half bits[i] (uint16 [N] -> f32 [N]); soft=True
    forces the bit-manipulation path.  Used by the tests."""
    for i in range(bits.shape[0]):
        if soft:
            out[i] = _half_to_float_soft(bits[i])
        else:
            out[i] = half_to_float(bits[i])


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
    """float16 -> zero-copy uint16 view; float32 kept; anything else -> float32."""
    a = np.asarray(a)
    if a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype == np.float32:
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


# ---------------------------------------------------------------------------
# 1. build_lut
# ---------------------------------------------------------------------------


def build_lut(q, codebooks, q_to_kv, codebooks_t=None, out=None):
    """Per-query-head lookup table of sub-vector dot products.

    q [Hq, d] f32 (pre-scaled), codebooks [Hkv, g, c, ds] f32, q_to_kv int32 [Hq]
    -> T [Hq, g, c] f32, T[h, i, j] = q[h, i*ds:(i+1)*ds] . codebooks[q_to_kv[h], i, j].
    The kernel runs over codebooks laid out [Hkv, g, ds, c], so its centroid loop is unit-stride and
    vectorizes; callers that reuse the codebooks pass that layout once made as `codebooks_t`
    (see `transpose_codebooks`; 53 vs 181 us at c = 1024). out: optional preallocated T.
    """
    q = _as_f32(q)
    cb = _as_f32(codebooks)
    q_to_kv = _as_i32(q_to_kv)
    Hq, d = q.shape
    Hkv, g, c, ds = cb.shape
    if g * ds != d:
        raise ValueError(f"codebooks {cb.shape} do not match head dim {d}")
    T = np.empty((Hq, g, c), dtype=np.float32) if out is None else out
    cbt = transpose_codebooks(cb) if codebooks_t is None else _as_f32(codebooks_t)
    _k_build_lut_t(q, cbt, q_to_kv, T)
    return T


def transpose_codebooks(codebooks):
    """[Hkv, g, c, ds] -> contiguous [Hkv, g, ds, c] for build_lut's fast path."""
    return np.ascontiguousarray(np.asarray(codebooks, dtype=np.float32).transpose(0, 1, 3, 2))


@njit(cache=True)
def _k_build_lut_t(q, cbt, q_to_kv, T):
    # cbt [Hkv, g, ds, c]: every inner loop runs over contiguous centroids. Serial: ~50 us of
    # work at SmolLM2 shapes, below what a parallel launch pays for.
    Hq = q.shape[0]
    g = cbt.shape[1]
    ds = cbt.shape[2]
    c = cbt.shape[3]
    for h in range(Hq):
        kv = q_to_kv[h]
        for i in range(g):
            Thi = T[h, i]
            for j in range(c):
                Thi[j] = 0.0
            for k in range(ds):
                qk = q[h, i * ds + k]
                row = cbt[kv, i, k]
                for j in range(c):
                    Thi[j] += qk * row[j]


# ---------------------------------------------------------------------------
# 2. approx_scores
# ---------------------------------------------------------------------------

_SCORE_BLOCK = 1024


@njit(cache=True, parallel=True)
def _k_approx_scores(T, P, q_to_kv, n, z):
    Hq = T.shape[0]
    g = T.shape[1]
    nb = (n + _SCORE_BLOCK - 1) // _SCORE_BLOCK
    for b in prange(nb):
        j0 = b * _SCORE_BLOCK
        j1 = min(n, j0 + _SCORE_BLOCK)
        for h in range(Hq):
            kv = q_to_kv[h]
            Th = T[h]
            for j in range(j0, j1):
                acc = np.float32(0.0)
                for i in range(g):
                    acc += Th[i, P[kv, j, i]]
                z[h, j] = acc


def approx_scores(T, P, q_to_kv, n, out=None):
    """Approximate (PQ) attention scores.

    T [Hq, g, c] f32 (from build_lut), P [Hkv, n_cap, g] uint8 or int16 (only
    the first n rows are read), q_to_kv int32 [Hq], n int, out optional f32
    [Hq, >=n] (C-contiguous rows) -> z [Hq, n] f32 (a view of out when given),
    z[h, j] = sum_i T[h, i, P[q_to_kv[h], j, i]].  Parallel over token blocks.
    """
    T = _as_f32(T)
    q_to_kv = _as_i32(q_to_kv)
    P = np.asarray(P)
    if P.dtype not in (np.uint8, np.int16):
        raise TypeError(f"P must be uint8 or int16, got {P.dtype}")
    if not P.flags.c_contiguous:
        P = np.ascontiguousarray(P)
    n = int(n)
    Hq = T.shape[0]
    if n > P.shape[1]:
        raise ValueError(f"n={n} exceeds P capacity {P.shape[1]}")
    if out is None:
        out = np.empty((Hq, n), dtype=np.float32)
    buf = _c_rows(out) if isinstance(out, np.ndarray) and out.ndim == 2 else None
    if buf is None or out.dtype != np.float32 or out.shape[0] != Hq or out.shape[1] < n:
        raise ValueError("out must be float32 [Hq, >=n] with unit-stride rows")
    if n > 0:
        _k_approx_scores(T, P, q_to_kv, n, buf)
    return out[:, :n]


# ---------------------------------------------------------------------------
# 3. threshold_select
# ---------------------------------------------------------------------------

_NBUCKETS = 2048  # histogram buckets per refinement level
_SMALL = 512  # candidate count at which the last bucket is simply sorted
_ZRANGE = np.float32(104.0)  # exp(-104) underflows float32: lower tokens carry no mass


@njit(cache=True)
def _bucket(v, hi, lo, scale):
    # Bucket of value v in [lo, hi] (scale = _NBUCKETS / (hi - lo), float64):
    # monotone non-increasing in v, bucket 0 holds the largest values.  Done
    # in float64 so that even a denormal-width range cannot overflow; the
    # comparison form also sends NaN/inf to the last bucket, never out of range.
    if v <= lo:
        return _NBUCKETS - 1
    x = (np.float64(hi) - np.float64(v)) * scale
    if not (x < _NBUCKETS - 1):
        return _NBUCKETS - 1
    if x < 0.0:
        return 0
    return int(x)


@njit(cache=True)
def _select_head(zh, n, tau, idx_row):
    """One head of threshold_select.  Returns (count, m, l_sel)."""
    # pass 1: max / min (NaN ignored)
    mx = _NEG_INF
    mn = np.float32(np.inf)
    for j in range(n):
        v = zh[j]
        if v > mx:
            mx = v
        if v < mn:
            mn = v
    if n == 0 or mx == _NEG_INF or not (mx < np.inf):
        return 0, mx, 0.0
    if tau >= 1.0:
        S = 0.0
        for j in range(n):
            idx_row[j] = j
            v = zh[j]
            if v > _NEG_INF:
                S += np.float64(np.exp(v - mx))
        return n, mx, S
    if tau <= 0.0:
        return 0, mx, 0.0

    mass = np.zeros(_NBUCKETS, dtype=np.float64)
    hi = mx
    lo = max(mn, mx - _ZRANGE)
    acc = 0.0  # mass of tokens already known to be selected (above the current range)
    zcut = mx
    if hi > lo:
        # pass 2: total mass and mass histogram (bucketed on z, linear in z)
        scale = _NBUCKETS / (np.float64(hi) - np.float64(lo))
        S = 0.0
        for j in range(n):
            v = zh[j]
            if v >= lo:  # also drops NaN; tokens below lo have zero float32 weight
                w = np.float64(np.exp(v - mx))
                S += w
                mass[_bucket(v, hi, lo, scale)] += w
        target = tau * S
        cum = 0.0
        bstar = -1
        for b in range(_NBUCKETS):
            if cum + mass[b] >= target:
                bstar = b
                break
            cum += mass[b]
        if bstar < 0:  # rounding: the buckets never reach tau*S -> take everything
            zcut = mn
            acc = S
            k = 0
        else:
            acc = cum
            # pass 3: collect the candidates of the boundary bucket (idx_row is scratch)
            k = 0
            for j in range(n):
                v = zh[j]
                if v >= lo and _bucket(v, hi, lo, scale) == bstar:
                    idx_row[k] = j
                    k += 1
        # refinement: re-histogram the boundary bucket until it is small or all-tied
        while k > 0:
            cmax = _NEG_INF
            cmin = np.float32(np.inf)
            for t in range(k):
                v = zh[idx_row[t]]
                if v > cmax:
                    cmax = v
                if v < cmin:
                    cmin = v
            if cmin == cmax:
                # all tied: they all go in
                zcut = cmin
                for t in range(k):
                    acc += np.float64(np.exp(zh[idx_row[t]] - mx))
                break
            if k <= _SMALL:
                vals = np.empty(k, dtype=np.float32)
                for t in range(k):
                    vals[t] = zh[idx_row[t]]
                vals.sort()
                zcut = vals[0]
                reached = False
                for t in range(k - 1, -1, -1):
                    v = vals[t]
                    if reached and v < zcut:
                        break
                    acc += np.float64(np.exp(v - mx))
                    if not reached and acc >= target:
                        reached = True
                        zcut = v
                break
            lo2 = cmin
            hi2 = cmax
            scale2 = _NBUCKETS / (np.float64(hi2) - np.float64(lo2))
            mass[:] = 0.0
            for t in range(k):
                v = zh[idx_row[t]]
                mass[_bucket(v, hi2, lo2, scale2)] += np.float64(np.exp(v - mx))
            cum = 0.0
            bstar = -1
            for b in range(_NBUCKETS):
                if acc + cum + mass[b] >= target:
                    bstar = b
                    break
                cum += mass[b]
            if bstar < 0:  # rounding: include every candidate
                zcut = cmin
                acc += cum
                break
            acc += cum
            k2 = 0
            for t in range(k):
                j = idx_row[t]
                if _bucket(zh[j], hi2, lo2, scale2) == bstar:
                    idx_row[k2] = j
                    k2 += 1
            k = k2
    else:
        # every counted token has z == mx (tokens < lo carry no float32 mass)
        zcut = mx
        acc = 0.0
        for j in range(n):
            if zh[j] == mx:
                acc += 1.0

    # pass 4: write the selection {j : z >= zcut} in increasing token order
    cnt = 0
    for j in range(n):
        if zh[j] >= zcut:
            idx_row[cnt] = j
            cnt += 1
    return cnt, mx, acc


@njit(cache=True, parallel=True)
def _k_threshold_select(z, n, tau, idx, counts, m, l_sel):
    Hq = z.shape[0]
    for h in prange(Hq):
        cnt, mh, lh = _select_head(z[h], n, tau, idx[h])
        counts[h] = cnt
        m[h] = mh
        l_sel[h] = np.float32(lh)


def threshold_select(z, tau, out_idx=None):
    """Per query head, the smallest set of tokens holding >= tau of the softmax mass.

    z [Hq, n] f32 scores, tau float, out_idx optional int32 [Hq, >=n]
    -> (idx int32 [Hq, n] (first counts[h] entries of row h valid, increasing
    token order; the rest is scratch), counts int32 [Hq], m f32 [Hq] = max z[h],
    l_sel f32 [Hq] = sum over the selection of exp(z - m)).

    Algorithm (no full sort): pass 1 max/min; pass 2 float32 weights
    w = exp(z - m), S = sum w (float64) and a 2048-bucket mass histogram over z
    in [max(min z, m - 104), m]; scan from the top to the bucket where the
    cumulative mass reaches tau*S; pass 3 gathers that bucket's tokens and it
    is re-histogrammed over its own value range until <= 512 candidates remain
    (then sorted) or all are tied.  This yields the cut value
    zcut = the largest z at which the mass of {z >= zcut} reaches tau*S; pass 4
    writes {j : z[h, j] >= zcut}.

    Bound: the selection is the minimal set plus the tokens tied with zcut
    (count <= minimal + ties(zcut) - 1), identical to a full-sort reference
    up to float64 summation-order rounding (the mass sums use the same float32
    weights).  If rounding keeps the cumulative mass just below tau*S the
    boundary bucket (or everything) is included.  tau >= 1 selects all n;
    tau <= 0 selects nothing; n == 0 (or all z == -inf) -> counts 0, l_sel 0,
    m = -inf.  NaN scores are never selected (unless tau >= 1).
    """
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
        _k_threshold_select(z, n, float(tau), buf, counts, m, l_sel)
    return out_idx[:, :n], counts, m, l_sel


# ---------------------------------------------------------------------------
# shared pieces of attend_exact / weighted_value_sum
# ---------------------------------------------------------------------------


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


@njit(cache=True)
def _dot(a, b, buf):
    """a . b over d = buf.shape[0] elements, float32, pairwise (tree) order.

    Products go to the scratch buf [d] f32, then halving passes
    buf[k] += buf[k + h]; every pass is a unit-stride loop the loop vectorizer
    handles without reassociation (~2x faster than a scalar dot, and more
    accurate).  b may be a float32 row or a half-bits (uint16) row.
    """
    d = buf.shape[0]
    for k in range(d):
        buf[k] = a[k] * _ld(b[k])
    w = d
    while w > 1:
        h = w // 2
        for k in range(h):
            buf[k] += buf[k + h]
        if w & 1:
            buf[0] += buf[w - 1]
        w = h
    return buf[0]


@njit(cache=True)
def _merge_partials(first, po, pm, pl, h, o, m, l):
    """Exact LSE merge of head h's work items first[h]:first[h+1].

    po [items, d] f32 unnormalized sums (sum_j exp(s_j - pm) v_j), pm [items]
    f32 item max, pl [items] f64 item sum of weights; writes o[h], m[h], l[h].
    """
    d = po.shape[1]
    M = _NEG_INF
    for it in range(first[h], first[h + 1]):
        if pl[it] > 0.0 and pm[it] > M:
            M = pm[it]
    if M == _NEG_INF:
        for k in range(d):
            o[h, k] = 0.0
        m[h] = _NEG_INF
        l[h] = 0.0
        return
    acc = np.zeros(d, dtype=np.float64)
    L = 0.0
    for it in range(first[h], first[h + 1]):
        if pl[it] > 0.0:
            sc = np.exp(np.float64(pm[it]) - np.float64(M))
            L += sc * pl[it]
            for k in range(d):
                acc[k] += sc * po[it, k]
    for k in range(d):
        o[h, k] = acc[k] / L
    m[h] = M
    l[h] = L


# ---------------------------------------------------------------------------
# 4. attend_exact
# ---------------------------------------------------------------------------

_ATT_CHUNK = 512


@njit(cache=True, parallel=True)
def _k_attend_exact(q, K, V, q_to_kv, n, chunk, o, m, l):
    Hq, d = q.shape
    nch = (n + chunk - 1) // chunk
    total = Hq * nch
    first = np.empty(Hq + 1, dtype=np.int64)
    for h in range(Hq + 1):
        first[h] = h * nch
    po = np.zeros((total, d), dtype=np.float32)
    pm = np.full(total, _NEG_INF, dtype=np.float32)
    pl = np.zeros(total, dtype=np.float64)
    for it in prange(total):
        h = it // nch
        kv = q_to_kv[h]
        j0 = (it % nch) * chunk
        j1 = min(n, j0 + chunk)
        qh = q[h]
        s = np.empty(j1 - j0, dtype=np.float32)
        buf = np.empty(d, dtype=np.float32)
        mx = _NEG_INF
        for j in range(j0, j1):
            v = _dot(qh, K[kv, j], buf)
            s[j - j0] = v
            if v > mx:
                mx = v
        pm[it] = mx
        if mx == _NEG_INF or not (mx < np.inf):
            continue
        acc = po[it]
        lsum = np.float32(0.0)
        for j in range(j0, j1):
            w = np.exp(s[j - j0] - mx)
            lsum += w
            Vj = V[kv, j]
            for k in range(d):
                acc[k] += w * _ld(Vj[k])
        pl[it] = lsum
    for h in prange(Hq):
        _merge_partials(first, po, pm, pl, h, o, m, l)


def attend_exact(q, K, V, q_to_kv, n):
    """Exact attention over the first n keys/values.

    q [Hq, d] f32 (pre-scaled), K, V [Hkv, n_cap, d] f32 or f16 (each may be
    either), q_to_kv int32 [Hq], n int -> (o [Hq, d] f32 normalized
    (sum softmax * v), m [Hq] f32 max score, l [Hq] f32 sum exp(s - m)).
    n == 0 -> o = 0, m = -inf, l = 0.  Work split into (head, 512-token chunk)
    items run in parallel, float32 inside a chunk (scores by a pairwise dot),
    chunks merged exactly by log-sum-exp in float64.
    """
    q = _as_f32(q)
    q_to_kv = _as_i32(q_to_kv)
    K = _as_pool(K)
    V = _as_pool(V)
    Hq, d = q.shape
    n = int(n)
    if n > K.shape[1] or n > V.shape[1]:
        raise ValueError("n exceeds K/V capacity")
    if K.shape[2] != d or V.shape[2] != d:
        raise ValueError("K/V head dim does not match q")
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    if n > 0 and Hq > 0:
        _k_attend_exact(q, K, V, q_to_kv, n, _ATT_CHUNK, o, m, l)
    return o, m, l


# ---------------------------------------------------------------------------
# 5. weighted_value_sum
# ---------------------------------------------------------------------------

_WVS_CHUNK = 2048
_PF_DIST = 16  # rows prefetched ahead in weighted_value_sum


@njit(cache=True, parallel=True)
def _k_weighted_value_sum(z, idx, counts, V, q_to_kv, chunk, o, m, l):
    Hq = z.shape[0]
    Hkv, ncap, d = V.shape
    Vflat = V.reshape(Hkv * ncap * d)
    pf_step = max(1, 64 // V.itemsize)  # elements per 64-byte cache line
    # work items: (head, chunk of its selection list)
    first = np.empty(Hq + 1, dtype=np.int64)
    first[0] = 0
    for h in range(Hq):
        first[h + 1] = first[h] + (counts[h] + chunk - 1) // chunk
    total = first[Hq]
    item_h = np.empty(total, dtype=np.int64)
    for h in range(Hq):
        for it in range(first[h], first[h + 1]):
            item_h[it] = h
    po = np.zeros((total, d), dtype=np.float32)
    pm = np.full(total, _NEG_INF, dtype=np.float32)
    pl = np.zeros(total, dtype=np.float64)
    for it in prange(total):
        h = item_h[it]
        kv = q_to_kv[h]
        t0 = (it - first[h]) * chunk
        t1 = min(np.int64(counts[h]), t0 + chunk)
        zh = z[h]
        ih = idx[h]
        base = np.int64(kv) * ncap * d
        # prime the prefetch pipeline while scanning for the chunk max
        for t in range(t0, min(t1, t0 + _PF_DIST)):
            _prefetch(Vflat, base + np.int64(ih[t]) * d)
        mx = _NEG_INF
        for t in range(t0, t1):
            v = zh[ih[t]]
            if v > mx:
                mx = v
        pm[it] = mx
        if mx == _NEG_INF or not (mx < np.inf):
            continue
        acc = po[it]
        lsum = np.float32(0.0)
        for t in range(t0, t1):
            if t + _PF_DIST < t1:
                off = base + np.int64(ih[t + _PF_DIST]) * d
                for e in range(0, d, pf_step):
                    _prefetch(Vflat, off + e)
            j = ih[t]
            w = np.exp(zh[j] - mx)
            lsum += w
            Vj = V[kv, j]
            for k in range(d):
                acc[k] += w * _ld(Vj[k])
        pl[it] = lsum
    for h in prange(Hq):
        _merge_partials(first, po, pm, pl, h, o, m, l)


def weighted_value_sum(z, idx, counts, V, q_to_kv):
    """Softmax-weighted sum of selected value rows (the hot CPU decode kernel).

    z [Hq, >=n] f32 scores, idx int32 [Hq, >=max(counts)] token indices,
    counts int32 [Hq], V [Hkv, n_cap, d] f32 or f16 (host value pool, must be
    C-contiguous -- it is never copied), q_to_kv int32 [Hq]
    -> (o [Hq, d] f32, m [Hq] f32, l [Hq] f32):
    over j in idx[h, :counts[h]], w_j = exp(z[h, j] - m_h) with m_h the max
    selected score, o[h] = sum w_j V[kv, j] / l_h, l_h = sum w_j.
    counts[h] == 0 -> o = 0, m = -inf, l = 0.  Lists are split into chunks of
    2048 tokens processed in parallel (float32 accumulation inside a chunk,
    value rows software-prefetched 16 ahead), chunks merged exactly by
    log-sum-exp in float64.  Indices are not bounds-checked.
    """
    z = _rows_in(z, np.float32)
    idx = np.asarray(idx, dtype=np.int32)
    width = idx.shape[1]
    idx = _rows_in(idx, np.int32)
    counts = _as_i32(counts)
    q_to_kv = _as_i32(q_to_kv)
    V = np.asarray(V)
    if not V.flags.c_contiguous:
        raise ValueError("V (value pool) must be C-contiguous")
    V = _as_pool(V)
    Hq = z.shape[0]
    d = V.shape[2]
    if counts.shape[0] != Hq or idx.shape[0] != Hq:
        raise ValueError("z, idx, counts disagree on Hq")
    if Hq and int(counts.max()) > width:
        raise ValueError("counts exceed idx width")
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    if Hq and int(counts.max()) > 0:
        _k_weighted_value_sum(z, idx, counts, V, q_to_kv, _WVS_CHUNK, o, m, l)
    return o, m, l


# ---------------------------------------------------------------------------
# 6. lse_merge
# ---------------------------------------------------------------------------


@njit(cache=True)
def _k_lse_merge(os, ms, ls, o, m, l):
    P, Hq, d = os.shape
    acc = np.empty(d, dtype=np.float64)
    for h in range(Hq):
        M = -np.inf
        for p in range(P):
            if ls[p, h] > 0.0 and ms[p, h] > M:
                M = ms[p, h]
        if M == -np.inf:
            o[h, :] = 0.0
            m[h] = _NEG_INF
            l[h] = 0.0
            continue
        acc[:] = 0.0
        L = 0.0
        for p in range(P):
            if ls[p, h] > 0.0 and ms[p, h] > -np.inf:
                w = np.exp(np.float64(ms[p, h]) - np.float64(M)) * np.float64(ls[p, h])
                L += w
                for k in range(d):
                    acc[k] += w * os[p, h, k]
        for k in range(d):
            o[h, k] = acc[k] / L
        m[h] = M
        l[h] = L


def lse_merge(os, ms, ls):
    """Exact log-sum-exp merge of partial attention results.

    os [P, Hq, d] f32 (each part normalized), ms [P, Hq] f32, ls [P, Hq] f32
    -> (o [Hq, d] f32, m [Hq] f32, l [Hq] f32): M = max_p m_p,
    w_p = exp(m_p - M) * l_p, o = sum_p w_p o_p / sum_p w_p, l = sum_p w_p.
    Parts with m = -inf or l = 0 contribute nothing; all parts empty ->
    o = 0, m = -inf, l = 0 (no NaN, no warnings).  Sequences of per-part arrays
    are stacked.
    """
    os = _as_f32(np.stack(os) if isinstance(os, (list, tuple)) else os)
    ms = _as_f32(np.stack(ms) if isinstance(ms, (list, tuple)) else ms)
    ls = _as_f32(np.stack(ls) if isinstance(ls, (list, tuple)) else ls)
    P, Hq, d = os.shape
    if ms.shape != (P, Hq) or ls.shape != (P, Hq):
        raise ValueError("ms / ls must be [P, Hq] matching os [P, Hq, d]")
    o = np.zeros((Hq, d), dtype=np.float32)
    m = np.full(Hq, -np.inf, dtype=np.float32)
    l = np.zeros(Hq, dtype=np.float32)
    if P > 0:
        _k_lse_merge(os, ms, ls, o, m, l)
    return o, m, l


# ---------------------------------------------------------------------------
# 7. encode_keys
# ---------------------------------------------------------------------------

_ENC_TILE = 128  # tokens per tile: the vector lanes of the encode loops


@njit(cache=True)
def _argmin_update(v, bv, bi, jj, tn):
    # branch-free running argmin over the tile's tokens; strict < keeps the
    # lowest centroid index on ties (centroids are visited in increasing order)
    for t in range(tn):
        lt = v[t] < bv[t]
        bv[t] = v[t] if lt else bv[t]
        bi[t] = jj if lt else bi[t]


@njit(cache=True, parallel=True)
def _k_encode_keys(K, C, cn, out):
    # K [Hkv, n, d] (f32 or u16 half bits), C [Hkv, g, c, ds] f32,
    # cn [Hkv, g, c] f32 (||centroid||^2), out [Hkv, >=n, g] uint8/int16.
    # Work item = (kv-head, tile of _ENC_TILE tokens); inside, tokens are the
    # vector lanes: for each centroid jj, dist[t] = ||c||^2 - 2 x_t . c is
    # computed for all tokens of the tile at once and folded into a running
    # argmin.  ds = 1, 2, 4 have fused single-loop paths; other ds accumulate
    # in dist[] one dimension at a time (same operation order).
    Hkv, n, d = K.shape
    g = C.shape[1]
    c = C.shape[2]
    ds = C.shape[3]
    TT = _ENC_TILE
    nt = (n + TT - 1) // TT
    for it in prange(Hkv * nt):
        kv = it // nt
        t0 = (it % nt) * TT
        tn = min(TT, n - t0)
        X2 = np.empty((ds, TT), dtype=np.float32)  # 2 * x, dimension-major
        dist = np.empty(TT, dtype=np.float32)
        bv = np.empty(TT, dtype=np.float32)
        bi = np.empty(TT, dtype=np.int32)
        for i in range(g):
            Ci = C[kv, i]
            cni = cn[kv, i]
            for t in range(tn):
                Kt = K[kv, t0 + t]
                for k in range(ds):
                    X2[k, t] = np.float32(2.0) * _ld(Kt[i * ds + k])
            for t in range(tn):
                bv[t] = np.inf
                bi[t] = 0
            if ds == 4:
                x0 = X2[0]
                x1 = X2[1]
                x2 = X2[2]
                x3 = X2[3]
                for jj in range(c):
                    cj = cni[jj]
                    c0 = Ci[jj, 0]
                    c1 = Ci[jj, 1]
                    c2 = Ci[jj, 2]
                    c3 = Ci[jj, 3]
                    jj32 = np.int32(jj)
                    for t in range(tn):
                        v = (((cj - x0[t] * c0) - x1[t] * c1) - x2[t] * c2) - x3[t] * c3
                        lt = v < bv[t]
                        bv[t] = v if lt else bv[t]
                        bi[t] = jj32 if lt else bi[t]
            elif ds == 2:
                x0 = X2[0]
                x1 = X2[1]
                for jj in range(c):
                    cj = cni[jj]
                    c0 = Ci[jj, 0]
                    c1 = Ci[jj, 1]
                    jj32 = np.int32(jj)
                    for t in range(tn):
                        v = (cj - x0[t] * c0) - x1[t] * c1
                        lt = v < bv[t]
                        bv[t] = v if lt else bv[t]
                        bi[t] = jj32 if lt else bi[t]
            elif ds == 1:
                x0 = X2[0]
                for jj in range(c):
                    cj = cni[jj]
                    c0 = Ci[jj, 0]
                    jj32 = np.int32(jj)
                    for t in range(tn):
                        v = cj - x0[t] * c0
                        lt = v < bv[t]
                        bv[t] = v if lt else bv[t]
                        bi[t] = jj32 if lt else bi[t]
            else:
                for jj in range(c):
                    cj = cni[jj]
                    for t in range(tn):
                        dist[t] = cj
                    for k in range(ds):
                        ck = Ci[jj, k]
                        xk = X2[k]
                        for t in range(tn):
                            dist[t] -= xk[t] * ck
                    _argmin_update(dist, bv, bi, np.int32(jj), tn)
            for t in range(tn):
                out[kv, t0 + t, i] = bi[t]


def codebook_norms(codebooks):
    """||c||^2 per centroid: codebooks [Hkv, g, c, ds] -> [Hkv, g, c] f32 (for encode_keys' cnorm)."""
    cb = _as_f32(codebooks)
    return np.einsum("hgcs,hgcs->hgc", cb, cb).astype(np.float32)


def encode_keys(K, codebooks, out=None, cnorm=None):
    """Product-quantize keys: nearest centroid per group.

    K [Hkv, n, d] f32 or f16, codebooks [Hkv, g, c, ds] f32, out optional
    C-contiguous [Hkv, >=n, g] of the result dtype (rows [0, n) written)
    -> P [Hkv, n, g] (a view of out when given), uint8 if c <= 256 else
    int16 (c <= 32768); P[kv, t, i] = argmin_j ||K[kv, t, i*ds:(i+1)*ds] -
    codebooks[kv, i, j]||^2 via the expansion ||c||^2 - 2 x.c (the ||x||^2
    term is constant per argmin and skipped), float32, ties -> lowest index.
    Parallel over (kv-head, 128-token tile); the tile's tokens are the vector
    lanes.  cnorm: optional precomputed ||c||^2 [Hkv, g, c] f32 (callers that encode
    with the same codebooks every step pass it to skip recomputing it).  (As with any float32 expansion, near-ties whose squared distances
    differ by less than ~1e-6 x (||x||^2 + ||c||^2) may be resolved
    differently from exact arithmetic.)
    """
    K = _as_pool(K)
    cb = _as_f32(codebooks)
    Hkv, n, d = K.shape
    Hkv2, g, c, ds = cb.shape
    if Hkv2 != Hkv or g * ds != d:
        raise ValueError(f"codebooks {cb.shape} do not match K {K.shape}")
    if c > 32768:
        raise ValueError("at most 32768 centroids per group")
    dtype = np.uint8 if c <= 256 else np.int16
    if out is None:
        out = np.empty((Hkv, n, g), dtype=dtype)
    elif (
        out.dtype != dtype
        or out.ndim != 3
        or out.shape[0] != Hkv
        or out.shape[1] < n
        or out.shape[2] != g
        or not out.flags.c_contiguous
    ):
        raise ValueError(f"out must be a C-contiguous {np.dtype(dtype).name} [Hkv, >=n, g] array")
    if n > 0:
        cn = codebook_norms(cb) if cnorm is None else _as_f32(cnorm)
        _k_encode_keys(K, cb, cn, out)  # writes rows [0, n) of the full buffer
    return out[:, :n]
