"""Q8_0 GEMV on integer byte dot products: AVX-512 VNNI (`vpdpbusd`) or AVX2 (`vpmaddubsw`).

The float32 tile of kernels_cpu.quant widens every code to float32 and ran at ~3 multiply-adds a
cycle on Zen 4, under what the memory delivers (its GEMV read 16-22 GB/s where two cores stream
~33): decode was bound by the widening, not the bytes. Here the codes stay bytes:

- x is quantized once per GEMV, per 32-element block: s_b = max|x_b| / XQ, x_q = round(x / s_b),
  split into two signed bytes x_q = 2^S hi + lo. AVX-512 VNNI: XQ = 32639, S = 8 (x kept to 2^-16
  of the block's largest |x|); AVX2: XQ = 8191, S = 7 (2^-14: hi and lo within +-64, so that
  vpmaddubsw's 16-bit pair sums cannot saturate). llama.cpp keeps 2^-8.
- the byte products multiply unsigned by signed bytes: the codes q are read as u = q + 128 (a byte
  XOR), and the offset comes back per block as 128 sum(x_q), one integer for all rows;
- per block and row: A = 2^S (u . hi) + (u . lo) - 128 sum(x_q), exact in int32, then
  y += d * s_b * A in float32.

Codes are laid out [nt, I/4, 64, 4] (kernels_cpu.quant's Q8_0 tiles): one 32-bit lane holds four
columns of one row. A lane's dot product is one vpdpbusd (16 rows a register), or vpmaddubsw then
vpmaddwd (8 rows). The tile is LLVM IR built here (Numba has no vector types), as in
kernels_cpu.fastscan. Error against the float32 product: at most
sum_b max|x_b| sum_i |w_bi| / (2 XQ), plus float32 rounding (tests/test_quant_kernels.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import _store_tile

_F32 = np.float32
ROWS = 64                              # the tile's rows the IR is written for (quant.TILE)
XQ_VNNI, S_VNNI = 32639, 8             # (XQ + 128) >> 8 stays a signed byte
XQ_AVX2, S_AVX2 = 8191, 7              # hi, lo within +-64: 255 * 64 * 2 fits vpmaddubsw's int16


def _features() -> list[str]:
    from numba.core import codegen, config
    features = config.CPU_FEATURES if config.CPU_NAME else codegen.get_host_cpu_features()
    return (features or "").split(",")


def isa() -> str | None:
    """The best integer kernel the code Numba makes here can run ("avx512vnni", "avx2" or None):
    the host's features, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set."""
    f = _features()
    if "+avx512vnni" in f and "+avx512bw" in f:
        return "avx512vnni"
    return "avx2" if "+avx2" in f else None


def _make_tile(lanes: int):
    """The tile intrinsic for registers of `lanes` rows (16: vpdpbusd; 8: vpmaddubsw + vpmaddwd).
    Call: (qs int8 [nt, 8 nb, 64, 4], d float16 bits [nt, nb, 64], t, nb, hi4, lo4 int32 [8 nb]
    (x's bytes, four columns a word), xs f32 [nb] (s_b), corr int32 [nb] (128 sum(x_q)), shift,
    y f32 [64]) -> y = the tile t's rows . x."""
    @intrinsic
    def tile(typingctx, qs, d, t, nb, hi4, lo4, xs, corr, shift, y):
        sig = types.void(qs, d, t, nb, hi4, lo4, xs, corr, shift, y)

        def codegen(context, builder, signature, args):
            ir = cgutils.ir
            i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
            vi32, vi16, vf32, vf16 = (ir.VectorType(e, lanes) for e in (i32, i16, f32, ir.HalfType()))
            intp = context.get_value_type(types.intp)

            def ptr(k):
                return context.make_array(signature.args[k])(context, builder, args[k]).data

            def idx(k):
                return context.cast(builder, args[k], signature.args[k], types.intp)

            pq, pd, ph, pl, pxs, pc, py = (ptr(k) for k in (0, 1, 4, 5, 6, 7, 9))
            t_, nb_ = idx(2), idx(3)
            sh = context.cast(builder, args[8], signature.args[8], types.int32)
            if lanes == 16:
                vpdpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi32, [vi32] * 3),
                                                          "llvm.x86.avx512.vpdpbusd.512")

                def dot(acc, u, x):
                    return builder.call(vpdpbusd, [acc, u, x])
            else:
                v32i8, v16i16 = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
                maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i16, [v32i8] * 2),
                                                         "llvm.x86.avx2.pmadd.ub.sw")
                maddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi32, [v16i16] * 2),
                                                        "llvm.x86.avx2.pmadd.wd")
                ones = ir.Constant(v16i16, [1] * 16)

                def dot(acc, u, x):
                    pairs = builder.call(maddubs, [builder.bitcast(u, v32i8), builder.bitcast(x, v32i8)])
                    return builder.add(acc, builder.call(maddwd, [pairs, ones]))

            zeros = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)

            def bcast(scalar, vty):
                v = builder.insert_element(ir.Constant(vty, None), scalar, i32(0))
                return builder.shuffle_vector(v, v, zeros)

            flip = ir.Constant(vi32, [-0x7F7F7F80] * lanes)          # 0x80808080: q + 128 as a byte
            shift = bcast(sh, vi32)
            nv = 4                                                   # registers of rows per pass
            for p in range(ROWS // (nv * lanes)):
                acc = [cgutils.alloca_once_value(builder, ir.Constant(vf32, None)) for _ in range(nv)]
                with cgutils.for_range(builder, nb_) as loop:
                    b = loop.index
                    H = [ir.Constant(vi32, None)] * nv
                    L = [ir.Constant(vi32, None)] * nv
                    for g in range(8):
                        gi = builder.add(builder.mul(b, intp(8)), intp(g))
                        hb = bcast(builder.load(builder.gep(ph, [gi])), vi32)
                        lb = bcast(builder.load(builder.gep(pl, [gi])), vi32)
                        base = builder.mul(builder.add(builder.mul(t_, builder.mul(nb_, intp(8))), gi), intp(ROWS * 4))
                        for v in range(nv):
                            row0 = (p * nv + v) * lanes
                            src = builder.gep(pq, [builder.add(base, intp(4 * row0))])
                            u = builder.xor(builder.load(builder.bitcast(src, vi32.as_pointer()), align=1), flip)
                            H[v] = dot(H[v], u, hb)
                            L[v] = dot(L[v], u, lb)
                    c = bcast(builder.load(builder.gep(pc, [b])), vi32)
                    s = bcast(builder.load(builder.gep(pxs, [b])), vf32)
                    d_blk = builder.mul(builder.add(builder.mul(t_, nb_), b), intp(ROWS))
                    for v in range(nv):
                        row0 = (p * nv + v) * lanes
                        a = builder.sub(builder.add(builder.shl(H[v], shift), L[v]), c)
                        dsrc = builder.gep(pd, [builder.add(d_blk, intp(row0))])
                        dh = builder.bitcast(builder.load(builder.bitcast(dsrc, vi16.as_pointer()), align=2), vf16)
                        scale = builder.fmul(builder.fpext(dh, vf32), s)
                        prod = builder.fmul(builder.sitofp(a, vf32), scale)
                        builder.store(builder.fadd(builder.load(acc[v]), prod), acc[v])
                for v in range(nv):
                    dst = builder.gep(py, [intp((p * nv + v) * lanes)])
                    builder.store(builder.load(acc[v]), builder.bitcast(dst, vf32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile16, _tile8 = _make_tile(16), _make_tile(8)


@njit(inline="always")
def _quantize_x(x, hi, lo, xs, corr, xq, shift):
    """x [I] f32 -> hi, lo int8 [I] (x_q = 2^shift hi + lo), xs f32 [I/32] (s_b), corr int32 [I/32]."""
    half = 1 << (shift - 1)
    for b in range(x.shape[0] // 32):
        amax = _F32(0.0)
        for j in range(32):
            a = abs(x[b * 32 + j])
            if a > amax or a != a:                  # a NaN stays: the block's result is NaN
                amax = a
        inv = _F32(xq) / amax if amax > 0 else _F32(0.0)
        tot = 0
        for j in range(32):
            v = x[b * 32 + j] * inv
            v = min(max(v, _F32(-xq)), _F32(xq)) if v == v else _F32(0.0)
            q = np.int32(np.floor(v + _F32(0.5)))
            h = (q + half) >> shift
            hi[b * 32 + j] = h
            lo[b * 32 + j] = q - (h << shift)
            tot += q
        xs[b] = amax / _F32(xq)
        corr[b] = 128 * tot


@njit(inline="always")
def _x_parts(x, xq, shift):
    I = x.shape[0]
    hi = np.empty(I, np.int8)
    lo = np.empty(I, np.int8)
    xs = np.empty(I // 32, _F32)
    corr = np.empty(I // 32, np.int32)
    _quantize_x(x, hi, lo, xs, corr, xq, shift)
    return hi.view(np.int32), lo.view(np.int32), xs, corr


@njit(parallel=True, cache=True)
def gemv_q8_0_vnni(w, x, out):
    """out [rows] f32 = W @ x for kernels_cpu.quant's Q8_0 tiles of 64 rows; x [I] f32 (AVX-512 VNNI)."""
    hi4, lo4, xs, corr = _x_parts(x, XQ_VNNI, S_VNNI)
    nb = x.shape[0] // 32
    for t in prange(w.qs.shape[0]):
        y = np.empty(ROWS, _F32)
        _tile16(w.qs, w.d, t, nb, hi4, lo4, xs, corr, S_VNNI, y)
        _store_tile(y, t, w.rows, out)


@njit(parallel=True, cache=True)
def gemv_q8_0_avx2(w, x, out):
    """The same on AVX2 (vpmaddubsw, x to 14 bits a block)."""
    hi4, lo4, xs, corr = _x_parts(x, XQ_AVX2, S_AVX2)
    nb = x.shape[0] // 32
    for t in prange(w.qs.shape[0]):
        y = np.empty(ROWS, _F32)
        _tile8(w.qs, w.d, t, nb, hi4, lo4, xs, corr, S_AVX2, y)
        _store_tile(y, t, w.rows, out)
