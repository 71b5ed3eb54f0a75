"""Quantized GEMVs on integer byte dot products, every format of kernels_cpu.quant: AVX-512 VNNI
(`vpdpbusd`) or AVX2 (`vpmaddubsw` + `vpmaddwd`).

Widening every code to float32 ran at ~3 multiply-adds a cycle on Zen 4, under what the memory
delivers: decode was bound by the widening, not the bytes. Here the codes stay bytes:

- x is quantized once per GEMV, per 32-element block: s_b = max|x_b| / XQ, x_q = round(x / s_b),
  split into two signed bytes x_q = 2^S hi + lo. AVX-512 VNNI: XQ = 32639, S = 8 (x kept to 2^-16
  of the block's largest |x|); AVX2: XQ = 8191, S = 7 (2^-14: hi and lo within +-64, so that
  vpmaddubsw's 16-bit pair sums cannot saturate). llama.cpp keeps 2^-8. Integer sums of x_q per
  16 columns (qsum) carry the codes' offsets and the mins.
- the byte products multiply unsigned codes u by signed bytes of x: 4-bit codes as they are
  (nibbles masked out of a 32-bit lane), Q6_K's six bits put together from ql and qh, Q8_0's
  signed codes q read as u = q + 128 (a byte XOR).
- per group of columns sharing a scale (32; Q6_K 16) and row: A = 2^S (u . hi) + (u . lo), exact
  in int32; then y += s_b (alpha (A - off qsum) + beta qsum) in float32, with the format's row
  scale alpha (d, or d sc), min beta (Q4_1 m, Q4_K -dmin mn) and code offset off (Q8_0 128,
  Q4_0 8, Q6_K 32).

Codes lie four bytes of a row to a 32-bit lane: parts [nt, bytes / 4, 64, 4] (kernels_cpu.quant's
tiles), so one lane's dot product is one vpdpbusd for 16 rows (vpmaddubsw + vpmaddwd: 8). The tile is
LLVM IR built here (Numba has no vector types), as in kernels_cpu.fastscan; each format is a
generator of its groups (_GROUPS). Error against the float32 product: at most
sum_b max|x_b| sum_i |w_bi| / (2 XQ), plus float32 rounding (tests/kernels/test_quant_kernels.py).
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


# ---- the formats: per period of columns, groups (col0, ncols, lanes [(u, col)], off, alpha, beta) ----
# B (_Rows below) reads one register of rows: B.word(part, w) the w-th 32-bit lane of the period's
# codes; B.half / B.byte / B.sbyte(part, e) the period's e-th scale (float16, uint8, int8) as float32.

def _groups_q8_0(B):
    """Period 32: 8 lanes of signed codes, each read as u = q + 128."""
    yield 0, 32, [(B.flip(B.word("qs", g)), 4 * g) for g in range(8)], 128, B.half("d", 0), None


def _groups_q4(B, has_min):
    """Period 32: 4 lanes, byte k holds element k (low nibble) and 16 + k (high)."""
    lanes = []
    for g in range(4):
        w = B.word("qs", g)
        lanes += [(B.nib(w, 0), 4 * g), (B.nib(w, 4), 16 + 4 * g)]
    yield 0, 32, lanes, 0 if has_min else 8, B.half("d", 0), B.half("m", 0) if has_min else None


def _groups_q4_k(B):
    """Period 256: sub-block j's codes are the (j % 2)-th nibbles of bytes 32 (j // 2) + l."""
    d, dmin = B.half("d", 0), B.half("dmin", 0)
    for j in range(8):
        lanes = [(B.nib(B.word("qs", 8 * (j // 2) + g), 4 * (j % 2)), 32 * j + 4 * g) for g in range(8)]
        yield 32 * j, 32, lanes, 0, B.mul(d, B.byte("sc", j)), B.neg(B.mul(dmin, B.byte("mn", j)))


def _groups_q6_k(B):
    """Period 256: element 128 h + 32 s + l from ql byte 64 h + 32 (s % 2) + l (nibble s // 2) and
    qh byte 32 h + l (bits 2 s, 2 s + 1); a scale per 16 elements."""
    d = B.half("d", 0)
    for h in range(2):
        for s in range(4):
            for half in range(2):
                lanes = []
                for m in range(4 * half, 4 * half + 4):
                    lo = B.nib(B.word("ql", 16 * h + 8 * (s % 2) + m), 4 * (s // 2))
                    lanes.append((B.high2(lo, B.word("qh", 8 * h + m), 2 * s), 128 * h + 32 * s + 4 * m))
                yield (128 * h + 32 * s + 16 * half, 16, lanes, 32,
                       B.mul(d, B.sbyte("sc", 8 * h + 2 * s + half)), None)


_GROUPS = {"Q8_0Tiles": (32, _groups_q8_0), "Q4_0Tiles": (32, lambda B: _groups_q4(B, False)),
           "Q4_1Tiles": (32, lambda B: _groups_q4(B, True)), "Q4_KTiles": (256, _groups_q4_k),
           "Q6_KTiles": (256, _groups_q6_k)}


class _Rows:
    """IR for one register of `lanes` rows (row0...) of tile t in period p: the format's loads."""

    def __init__(self, b, parts, t, p, row0, lanes, intp):
        self.b, self.parts, self.t, self.p, self.row0, self.n, self.intp = b, parts, t, p, row0, lanes, intp
        ir = cgutils.ir
        self.ir, self.i32 = ir, ir.IntType(32)
        self.vi32 = ir.VectorType(self.i32, lanes)
        self.vf32 = ir.VectorType(ir.FloatType(), lanes)

    def _ptr(self, part, e, elem):
        """&part[t, p * per + e, row0] as <lanes x elem>*: part [nt, k, 64(, 4)], per entries a period."""
        data, k, per = self.parts[part]
        b, intp = self.b, self.intp
        i = b.add(b.mul(b.add(b.mul(self.t, k), b.add(b.mul(self.p, per), intp(e))), intp(ROWS)), intp(self.row0))
        base = b.bitcast(data, elem.as_pointer())
        return b.bitcast(b.gep(base, [i]), self.ir.VectorType(elem, self.n).as_pointer())

    def word(self, part, w):
        return self.b.load(self._ptr(part, w, self.i32), align=1)

    def _splat(self, c):
        return self.ir.Constant(self.vi32, [c] * self.n)

    def flip(self, w):
        return self.b.xor(w, self._splat(-0x7F7F7F80))                 # 0x80808080: q + 128 as a byte

    def nib(self, w, shift):
        return self.b.and_(self.b.lshr(w, self._splat(shift)) if shift else w, self._splat(0x0F0F0F0F))

    def high2(self, lo, qh, shift):
        """lo | ((qh >> shift) & 3) << 4, per byte."""
        hb = self.b.and_(self.b.lshr(qh, self._splat(shift)) if shift else qh, self._splat(0x03030303))
        return self.b.or_(lo, self.b.shl(hb, self._splat(4)))

    def half(self, part, e):
        ir = self.ir
        h = self.b.load(self._ptr(part, e, ir.IntType(16)), align=2)
        return self.b.fpext(self.b.bitcast(h, ir.VectorType(ir.HalfType(), self.n)), self.vf32)

    def byte(self, part, e, signed=False):
        v = self.b.load(self._ptr(part, e, self.ir.IntType(8)), align=1)
        return self.b.sitofp(self.b.sext(v, self.vi32) if signed else self.b.zext(v, self.vi32), self.vf32)

    def sbyte(self, part, e):
        return self.byte(part, e, signed=True)

    def mul(self, a, c):
        return self.b.fmul(a, c)

    def neg(self, a):
        return self.b.fneg(a)


def _dot_ir(builder, lanes):
    """dot(acc, u, x) -> acc + u . x per 32-bit lane as IR (u four unsigned bytes, x four signed
    ones): one vpdpbusd for registers of 16 lanes; vpmaddubsw + vpmaddwd for 8."""
    ir = cgutils.ir
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    vi32 = ir.VectorType(i32, lanes)
    if lanes == 16:
        vpdpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi32, [vi32] * 3),
                                                  "llvm.x86.avx512.vpdpbusd.512")

        def dot(acc, u, x):
            return builder.call(vpdpbusd, [acc, u, x])
        return dot
    v32i8, v16i16 = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i16, [v32i8] * 2),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi32, [v16i16] * 2),
                                            "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(v16i16, [1] * 16)

    def dot(acc, u, x):
        pairs = builder.call(maddubs, [builder.bitcast(u, v32i8), builder.bitcast(x, v32i8)])
        return builder.add(acc, builder.call(maddwd, [pairs, ones]))
    return dot


def _tile_parts(context, builder, w, val, n_per):
    """The arrays of a tiles tuple w (type) / val (value) as _Rows reads them: {field: (data pointer,
    entries k of dim 1, entries per period k / n_per)}."""
    parts = {}
    fields = w.instance_class._fields
    for name, ty, v in zip(fields, w.types, cgutils.unpack_tuple(builder, val, len(fields))):
        if isinstance(ty, types.Array):
            a = context.make_array(ty)(context, builder, v)
            k = cgutils.unpack_tuple(builder, a.shape)[1]
            parts[name] = (a.data, k, builder.udiv(k, n_per))
    return parts


class _TileIR:
    """IR of the tile's sums for registers of `lanes` rows: x's parts as data pointers (ph / pl the
    hi4 / lo4 words, pxs xs, pq qsum), sh the shift (int32)."""

    def __init__(self, context, builder, lanes, ph, pl, pxs, pq, sh):
        ir = cgutils.ir
        self.b, self.lanes, self.ph, self.pl, self.pxs, self.pq = builder, lanes, ph, pl, pxs, pq
        self.intp = context.get_value_type(types.intp)
        self.i32 = ir.IntType(32)
        self.vi32, self.vf32 = ir.VectorType(self.i32, lanes), ir.VectorType(ir.FloatType(), lanes)
        self.dot = _dot_ir(builder, lanes)
        self.zeros = ir.Constant(self.vi32, [0] * lanes)
        self.shift = self.bcast(sh, self.vi32)

    def bcast(self, scalar, vty):
        b = self.b
        v = b.insert_element(cgutils.ir.Constant(vty, None), scalar, self.i32(0))
        return b.shuffle_vector(v, v, self.zeros)

    def byte_dots(self, gs, col_p):
        """(H, L): per register v, the int32 sums u . hi and u . lo over the lanes of its group gs[v]
        (_GROUPS' tuples; the period's columns from col_p)."""
        b, intp, nv = self.b, self.intp, len(gs)
        H, L = [self.zeros] * nv, [self.zeros] * nv
        for li in range(len(gs[0][2])):
            xw = b.add(b.udiv(col_p, intp(4)), intp(gs[0][2][li][1] // 4))
            hb = self.bcast(b.load(b.gep(self.ph, [xw])), self.vi32)
            lb = self.bcast(b.load(b.gep(self.pl, [xw])), self.vi32)
            for v in range(nv):
                u = gs[v][2][li][0]
                H[v], L[v] = self.dot(H[v], u, hb), self.dot(L[v], u, lb)
        return H, L

    def group(self, gs, col_p, y):
        """y [nv] f32 vectors += s_b (alpha (A - off qsum) + beta qsum) of the groups gs (one per
        register), A = 2^S (u . hi) + (u . lo)."""
        b, intp, vi32, vf32 = self.b, self.intp, self.vi32, self.vf32
        H, L = self.byte_dots(gs, col_p)
        col0, ncols = gs[0][0], gs[0][1]
        c0 = b.add(col_p, intp(col0))
        s = self.bcast(b.load(b.gep(self.pxs, [b.udiv(c0, intp(32))])), vf32)
        q16 = b.udiv(c0, intp(16))
        qs_ = b.load(b.gep(self.pq, [q16]))
        for k in range(1, ncols // 16):
            qs_ = b.add(qs_, b.load(b.gep(self.pq, [b.add(q16, intp(k))])))
        qsum = self.bcast(qs_, vi32)
        for v in range(len(gs)):
            _, _, _, off, alpha, beta = gs[v]
            a = b.add(b.shl(H[v], self.shift), L[v])
            if off:
                a = b.sub(a, b.mul(qsum, cgutils.ir.Constant(vi32, [off] * self.lanes)))
            f = b.fmul(alpha, b.sitofp(a, vf32))
            if beta is not None:
                f = b.fadd(f, b.fmul(beta, b.sitofp(qsum, vf32)))
            y[v] = b.fadd(y[v], b.fmul(s, f))


def _tile_body(context, builder, lanes, period, groups, parts, t_, n_per, g, py):
    """The tile's loop over its n_per periods (tile t_, x's parts in g: _TileIR) into py [64] f32."""
    intp, vf32 = g.intp, g.vf32
    # nv registers of rows at a time; every pass over a period before the next period, so
    # that the passes read a lane group's 256 bytes together (AVX2's two passes over whole
    # tiles read every other 128 bytes: 11 against 30 GB/s of weights in the model)
    nv, nr = 4, ROWS // lanes
    acc = [cgutils.alloca_once_value(builder, cgutils.ir.Constant(vf32, [0.0] * lanes)) for _ in range(nr)]
    with cgutils.for_range(builder, n_per) as loop:
        p = loop.index
        col_p = builder.mul(p, intp(period))
        for ps in range(nr // nv):
            regs = range(ps * nv, ps * nv + nv)
            y_new = [builder.load(acc[r]) for r in regs]
            for gs in zip(*(groups(_Rows(builder, parts, t_, p, r * lanes, lanes, intp)) for r in regs)):
                g.group(gs, col_p, y_new)
            for v, r in enumerate(regs):
                builder.store(y_new[v], acc[r])
    for r in range(nr):
        dst = builder.gep(py, [intp(r * lanes)])
        builder.store(builder.load(acc[r]), builder.bitcast(dst, vf32.as_pointer()), align=4)


def _make_tile(lanes: int):
    """The tile intrinsic for registers of `lanes` rows (16: vpdpbusd; 8: vpmaddubsw + vpmaddwd).
    Call: (w: a kernels_cpu.quant tiles tuple of 64-row tiles, t, hi4, lo4 int32 [I/4] (x's bytes,
    four columns a word), xs f32 [I/32] (s_b), qsum int32 [I/16], shift, y f32 [64]) -> y = the
    tile t's rows . x."""
    @intrinsic
    def tile(typingctx, w, t, hi4, lo4, xs, qsum, shift, y):
        if not isinstance(w, types.BaseNamedTuple) or w.instance_class.__name__ not in _GROUPS:
            return None
        sig = types.void(w, t, hi4, lo4, xs, qsum, shift, y)
        period, groups = _GROUPS[w.instance_class.__name__]

        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)

            def arr(ty, val):
                return context.make_array(ty)(context, builder, val)

            ph, pl, pxs, pq, py = (arr(signature.args[k], args[k]).data for k in (2, 3, 4, 5, 7))
            n_words = cgutils.unpack_tuple(builder, arr(signature.args[2], args[2]).shape)[0]
            n_per = builder.udiv(builder.mul(n_words, intp(4)), intp(period))     # periods of the row
            parts = _tile_parts(context, builder, w, args[0], n_per)
            t_ = context.cast(builder, args[1], signature.args[1], types.intp)
            sh = context.cast(builder, args[6], signature.args[6], types.int32)
            g = _TileIR(context, builder, lanes, ph, pl, pxs, pq, sh)
            _tile_body(context, builder, lanes, period, groups, parts, t_, n_per, g, py)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile16, _tile8 = _make_tile(16), _make_tile(8)


@njit(inline="always")
def _quantize_x(x, hi, lo, xs, qsum, xq, shift):
    """x [I] f32 -> hi, lo int8 [I] (x_q = 2^shift hi + lo), xs f32 [I/32] (s_b), qsum int32 [I/16]."""
    half = 1 << (shift - 1)
    for b in range(x.shape[0] // 32):
        amax = _F32(0.0)
        for j in range(32):
            a = abs(x[b * 32 + j])
            if a > amax or a != a:                  # a NaN stays: the block's result is NaN
                amax = a
        inv = _F32(xq) / amax if amax > 0 else _F32(0.0)
        for h in range(2):
            tot = 0
            for j in range(b * 32 + 16 * h, b * 32 + 16 * h + 16):
                v = x[j] * inv
                v = min(max(v, _F32(-xq)), _F32(xq)) if v == v else _F32(0.0)
                q = np.int32(np.floor(v + _F32(0.5)))
                g = (q + half) >> shift
                hi[j] = g
                lo[j] = q - (g << shift)
                tot += q
            qsum[2 * b + h] = tot
        xs[b] = amax / _F32(xq)


@njit(inline="always")
def _x_parts(X, xq, shift):
    """X [B, I] f32 -> hi4, lo4 int32 [B, I/4] (each row's bytes, four columns a word), xs f32
    [B, I/32], qsum int32 [B, I/16]: _quantize_x of each row."""
    B, I = X.shape
    hi = np.empty(B * I, np.int8)
    lo = np.empty(B * I, np.int8)
    xs = np.empty((B, I // 32), _F32)
    qsum = np.empty((B, I // 16), np.int32)
    for b in range(B):
        _quantize_x(X[b], hi[b * I:(b + 1) * I], lo[b * I:(b + 1) * I], xs[b], qsum[b], xq, shift)
    return hi.view(np.int32).reshape(B, I // 4), lo.view(np.int32).reshape(B, I // 4), xs, qsum


@njit(parallel=True, cache=True)
def gemm_vnni(w, X, out):
    """out [B, rows] f32 = X @ W^T for kernels_cpu.quant's tiles (any format) of 64 rows; X [B, I]
    f32, B sequences' tokens: a tile's codes are read from memory once and serve the B rows while
    they are in L1 (a 64-row tile of 576 Q4_1 columns is 20 KB). AVX-512 VNNI."""
    hi4, lo4, xs, qsum = _x_parts(X, XQ_VNNI, S_VNNI)
    for t in prange(w[0].shape[0]):
        y = np.empty(ROWS, _F32)
        for b in range(X.shape[0]):
            _tile16(w, t, hi4[b], lo4[b], xs[b], qsum[b], S_VNNI, y)
            _store_tile(y, t, w.rows, out[b])


@njit(parallel=True, cache=True)
def gemm_avx2(w, X, out):
    """The same on AVX2 (vpmaddubsw, x to 14 bits a block)."""
    hi4, lo4, xs, qsum = _x_parts(X, XQ_AVX2, S_AVX2)
    for t in prange(w[0].shape[0]):
        y = np.empty(ROWS, _F32)
        for b in range(X.shape[0]):
            _tile8(w, t, hi4[b], lo4[b], xs[b], qsum[b], S_AVX2, y)
            _store_tile(y, t, w.rows, out[b])
