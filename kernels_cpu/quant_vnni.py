"""Q8_0 GEMV on integer dot products (AVX-512 VNNI `vpdpbusd`: 64 byte products a instruction).

The float32 tile kernel of kernels_cpu.quant widens every code to float32 and runs at ~3 multiply-adds
a cycle on Zen 4, below what the memory delivers (its GEMV reads 16-22 GB/s where two cores stream
~33): decode was bound by the widening, not the bytes. Here the codes stay bytes:

- the activation x is quantized once per GEMV to 16 bits per 32-element block (scale s_b =
  max|x_b| / 32639, x_q = round(x / s_b)) and split into two signed bytes, x_q = 256 hi + lo
  (hi in [-127, 127], lo in [-128, 127]), so the result keeps ~2^-16 of each block's largest |x|
  where llama.cpp's 8-bit activations keep 2^-8;
- vpdpbusd multiplies unsigned bytes by signed ones: the codes q are read as u = q + 128 (a byte
  XOR), and the offset comes back per block as 128 sum(x_q), one integer per block for all rows;
- per block and row: A = 256 (u . hi) + (u . lo) - 128 sum(x_q), exact in int32, then
  y += d * s_b * A in float32.

Codes are laid out [nt, I/4, 64, 4] (kernels_cpu.quant's Q8_0 tiles): one 32-bit lane holds four
columns of one row, one 512-bit load 16 rows. The tile is LLVM IR built here (Numba has no vector
types), like kernels_cpu.fastscan's pshufb block. Error against the float32 product: at most
sum_b max|x_b| sum_i |w_bi| / 65278, plus float32 rounding (tests/test_quant_kernels.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

_F32 = np.float32
XQ_MAX = 32639            # the largest |x_q|: (x_q + 128) >> 8 stays within a signed byte
ROWS = 64                 # the tile's rows the IR is written for (four 16-lane registers)


def available() -> bool:
    """Whether the code Numba makes here has AVX-512 VNNI (and BW): the host's features, or
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set."""
    from numba.core import codegen, config
    features = config.CPU_FEATURES if config.CPU_NAME else codegen.get_host_cpu_features()
    f = (features or "").split(",")
    return "+avx512vnni" in f and "+avx512bw" in f


@intrinsic
def _tile(typingctx, qs, d, t, nb, hi4, lo4, xs, corr, y):
    """y [64] f32 = the tile t's rows . x: qs int8 [nt, 8 nb, 64, 4]; d float16 bits [nt, nb, 64];
    hi4, lo4 int32 [8 nb] (x's bytes, four columns a word); xs f32 [nb] (s_b); corr int32 [nb]
    (128 sum(x_q) of block b)."""
    sig = types.void(qs, d, t, nb, hi4, lo4, xs, corr, y)

    def codegen(context, builder, signature, args):
        ir = cgutils.ir
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        v16i32, v16i16, v16f32, v16f16 = (ir.VectorType(e, 16) for e in (i32, i16, f32, ir.HalfType()))
        intp = context.get_value_type(types.intp)

        def ptr(k):
            return context.make_array(signature.args[k])(context, builder, args[k]).data

        def idx(k):
            return context.cast(builder, args[k], signature.args[k], types.intp)

        pq, pd, ph, pl, pxs, pc, py = (ptr(k) for k in (0, 1, 4, 5, 6, 7, 8))
        t_, nb_ = idx(2), idx(3)
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i32, [v16i32] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        zeros16 = ir.Constant(ir.VectorType(i32, 16), [0] * 16)

        def bcast(scalar, vty):
            v = builder.insert_element(ir.Constant(vty, None), scalar, i32(0))
            return builder.shuffle_vector(v, v, zeros16)

        flip = ir.Constant(v16i32, [-0x7F7F7F80] * 16)             # 0x80808080: q + 128 as a byte
        eight = ir.Constant(v16i32, [8] * 16)
        acc = [cgutils.alloca_once_value(builder, ir.Constant(v16f32, None)) for _ in range(4)]
        q_tile = builder.mul(t_, builder.mul(nb_, intp(8 * ROWS * 4)))          # bytes before tile t
        d_tile = builder.mul(t_, builder.mul(nb_, intp(ROWS)))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            H = [ir.Constant(v16i32, None)] * 4
            L = [ir.Constant(v16i32, None)] * 4
            for g in range(8):
                gi = builder.add(builder.mul(b, intp(8)), intp(g))
                hb = bcast(builder.load(builder.gep(ph, [gi])), v16i32)
                lb = bcast(builder.load(builder.gep(pl, [gi])), v16i32)
                base = builder.add(q_tile, builder.mul(gi, intp(ROWS * 4)))
                for v in range(4):
                    src = builder.gep(pq, [builder.add(base, intp(64 * v))])
                    u = builder.xor(builder.load(builder.bitcast(src, v16i32.as_pointer()), align=1), flip)
                    H[v] = builder.call(dpbusd, [H[v], u, hb])
                    L[v] = builder.call(dpbusd, [L[v], u, lb])
            c = bcast(builder.load(builder.gep(pc, [b])), v16i32)
            s = bcast(builder.load(builder.gep(pxs, [b])), v16f32)
            d_blk = builder.add(d_tile, builder.mul(b, intp(ROWS)))
            for v in range(4):
                a = builder.sub(builder.add(builder.shl(H[v], eight), L[v]), c)
                dsrc = builder.gep(pd, [builder.add(d_blk, intp(16 * v))])
                dh = builder.bitcast(builder.load(builder.bitcast(dsrc, v16i16.as_pointer()), align=2), v16f16)
                scale = builder.fmul(builder.fpext(dh, v16f32), s)
                builder.store(builder.fadd(builder.load(acc[v]), builder.fmul(builder.sitofp(a, v16f32), scale)), acc[v])
        for v in range(4):
            dst = builder.gep(py, [intp(16 * v)])
            builder.store(builder.load(acc[v]), builder.bitcast(dst, v16f32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _quantize_x(x, hi, lo, xs, corr):
    """x [I] f32 -> hi, lo int8 [I] (x_q = 256 hi + lo), xs f32 [I/32] (s_b), corr int32 [I/32]."""
    for b in range(x.shape[0] // 32):
        amax = _F32(0.0)
        for j in range(32):
            a = abs(x[b * 32 + j])
            if a > amax or a != a:                  # a NaN stays: the block's result is NaN
                amax = a
        inv = _F32(XQ_MAX) / amax if amax > 0 else _F32(0.0)
        tot = 0
        for j in range(32):
            v = x[b * 32 + j] * inv
            v = min(max(v, _F32(-XQ_MAX)), _F32(XQ_MAX)) if v == v else _F32(0.0)
            q = np.int32(np.floor(v + _F32(0.5)))
            h = (q + 128) >> 8
            hi[b * 32 + j] = h
            lo[b * 32 + j] = q - (h << 8)
            tot += q
        xs[b] = amax / _F32(XQ_MAX)
        corr[b] = 128 * tot


@njit(parallel=True, cache=True)
def gemv_q8_0(w, x, out):
    """out [rows] f32 = W @ x for kernels_cpu.quant's Q8_0 tiles of 64 rows; x [I] f32."""
    I = x.shape[0]
    nb = I // 32
    hi = np.empty(I, np.int8)
    lo = np.empty(I, np.int8)
    xs = np.empty(nb, _F32)
    corr = np.empty(nb, np.int32)
    _quantize_x(x, hi, lo, xs, corr)
    hi4, lo4 = hi.view(np.int32), lo.view(np.int32)
    R = w.qs.shape[2]
    for t in prange(w.qs.shape[0]):
        y = np.empty(ROWS, _F32)
        _tile(w.qs, w.d, t, nb, hi4, lo4, xs, corr, y)
        for r in range(min(R, w.rows - t * R)):
            out[t * R + r] = y[r]
